"""One process, no process group: an exception escapes the training loop at step 7, in backward.

    python uncaught_job.py OUT_DIR [raise | exit-code | exit-message | exit-caught | interrupt]

``exit-code`` / ``exit-message`` leave with ``sys.exit(3)`` / ``sys.exit("loss is nan ...")`` at that
point instead; ``exit-caught`` calls ``sys.exit(3)`` at step 7, catches the ``SystemExit`` and trains on;
``interrupt`` sends itself SIGINT there (Ctrl-C: a ``KeyboardInterrupt``).

The error hooks must turn it into a fatal ``rank_error`` that reaches OUT_DIR/rank<R>.jsonl before the
process exits, and the usual traceback must still be printed by the previous hook.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import _capture

from ddpscope.ddp.errors import install_error_hooks
from ddpscope.ddp.progress import PROGRESS


def train(how: str) -> None:
    for step in range(10):
        PROGRESS.enter("forward", step)
        PROGRESS.enter("backward")
        PROGRESS.counter += 1  # what gradient hooks and collectives do
        if step != 7:
            continue
        if how == "raise":
            raise FloatingPointError("loss is nan at step 7")  # SITE:raise
        if how == "exit-code":
            sys.exit(3)  # SITE:exit
        if how == "exit-message":
            sys.exit("loss is nan at step 7, aborting")
        if how == "interrupt":
            os.kill(os.getpid(), signal.SIGINT)
        with contextlib.suppress(SystemExit):  # a caught exit: training goes on
            sys.exit(3)


if __name__ == "__main__":
    _capture.capture(sys.argv[1], flusher=False)
    install_error_hooks()
    train(sys.argv[2] if len(sys.argv) > 2 else "raise")
