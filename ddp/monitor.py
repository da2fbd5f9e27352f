"""Turn on everything that watches a training process, in one call.

    from ddpscope.ddp import monitor
    monitor.enable()   # recorder patches, rank_error hooks, hang watchdog + heartbeats

The engine and the torch-DDP adapter call it at construction; a job that uses raw
``torch.distributed`` collectives without either may call it after ``init_process_group``.
Idempotent; with ddpscope disabled it installs nothing.
"""

from __future__ import annotations

import logging

from ddpscope.ddp import collectives, errors, watchdog

logger = logging.getLogger(__name__)


def enable(*, hang_timeout_s: float | None = None, heartbeat_s: float | None = None) -> watchdog.Watchdog:
    """Install the collective recorder and the error hooks, start the watchdog; return the watchdog.

    ``hang_timeout_s`` / ``heartbeat_s`` default to ``DDPSCOPE_HANG_TIMEOUT`` / ``DDPSCOPE_HEARTBEAT_S``
    (through the agent's config). A non-positive value raises ``ValueError``.
    """
    collectives.install()
    errors.install_error_hooks()
    return watchdog.start_watchdog(timeout_s=hang_timeout_s, heartbeat_s=heartbeat_s)


def disable(timeout_s: float = 5.0) -> None:
    """Undo ``enable`` (tests; a process that stops being a rank)."""
    watchdog.stop_watchdog(timeout_s)
    errors.uninstall_error_hooks()
    collectives.uninstall()
