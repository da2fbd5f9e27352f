"""Where the agent reports what it swallowed.

The agent never raises into training, so every ``except`` in it ends here: the error is logged with
its traceback and handed to the registered hooks. Tests register a hook that re-raises (sentry's
``internal_exceptions`` fixture), so a swallowed bug still fails the test that caused it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from ddpscope.agent.log import get_logger

logger = get_logger("ddpscope.agent")

HOOKS: list[Callable[[str, BaseException], None]] = []
"""Called with (where, exception) for every swallowed exception."""

LOG_LIMIT = 5
"""Tracebacks logged per place; a record emitted wrong every step must not flood the training log."""
_logged: dict[str, int] = {}


def swallowed(where: str) -> None:
    """Call from inside an ``except`` block: log the current exception and notify the hooks."""
    exc = sys.exc_info()[1]
    seen = _logged.get(where, 0)
    if seen < LOG_LIMIT:
        _logged[where] = seen + 1
        logger.warning("ddpscope agent: error in %s (swallowed, training continues)", where, exc_info=True)
    if exc is None:
        return
    for hook in list(HOOKS):
        try:
            hook(where, exc)
        except Exception:  # a failing hook must not take the agent down either
            logger.debug("ddpscope agent: error hook failed", exc_info=True)
