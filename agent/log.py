"""ddpscope's loggers in the training process: a log call that fails never raises.

A training process whose stderr was closed (a launcher that daemonizes its workers) turns every log call
into an exception: with no handler configured, logging's last-resort handler writes to the closed
``sys.stderr``, and its error report writes there again, raising ``ValueError`` out of
``logger.warning``. ddpscope logs from hooks inside backward, from its ``except`` blocks and from its own
threads; such a raise would fail the step it only meant to comment on, or lose the record the log line
came before. Records carry everything that matters; a log line that cannot be written is dropped.
"""

from __future__ import annotations

import logging
from typing import Any


class QuietLogger(logging.LoggerAdapter):
    """The module's logger, every call of which swallows a failure of the handlers."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        try:
            # One frame more than logging's own adapter: the record names the caller, not this method.
            kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
            super().log(level, msg, *args, **kwargs)
        except Exception:
            pass  # stderr closed or a handler broken: nothing left to say it with


def get_logger(name: str) -> QuietLogger:
    """``logging.getLogger(name)``, seen through ``QuietLogger``."""
    return QuietLogger(logging.getLogger(name), {})
