"""Turn on everything that watches a training process, in one call.

    from ddpscope.ddp import monitor
    monitor.enable()   # recorder patches, rank_error hooks, hang watchdog + heartbeats

Importing ``ddpscope.ddp`` wraps ``torch.distributed.init_process_group`` (``watch_init_process_group``),
so a script that imports ddpscope before creating its process group is monitored from the moment the
group exists: a rank that fails, exits or waits for its peers between ``init_process_group`` and the
construction of its DDP model is reported too. The hang watchdog alone starts as the call begins
(``_watch_rendezvous``): a rank left in the rendezvous by a peer that never started is reported after the
hang timeout, not torch's. The engine and the torch-DDP adapter call ``enable`` at
construction as well (a group created before ddpscope was imported is monitored from there); a job
that uses raw ``torch.distributed`` collectives may call it after ``init_process_group``.
Once a default process group exists, it also starts ``job_check`` (once per group): the ranks compare,
through the group's store and off the training thread, the job ids they report under.
Idempotent; with ddpscope disabled it installs nothing.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

from ddpscope.agent import adopt_rank
from ddpscope.agent.log import get_logger
from ddpscope.ddp import collectives, errors, job_check, peer_presence, store_file, watchdog
from ddpscope.ddp.progress import PROGRESS

logger = get_logger(__name__)

ENV_DISABLED = "DDPSCOPE_DISABLED"
_WRAPPED = "__ddpscope_init_hook__"
"""Marks our wrapper of ``init_process_group``: wrapping is idempotent, also across reloads."""


def enable(
    *,
    hang_timeout_s: float | None = None,
    heartbeat_s: float | None = None,
    first_heartbeat_s: float = 0.0,
) -> watchdog.Watchdog:
    """Install the collective recorder and the error hooks, start the watchdog; return the watchdog.

    ``hang_timeout_s`` / ``heartbeat_s`` default to ``DDPSCOPE_HANG_TIMEOUT`` / ``DDPSCOPE_HEARTBEAT_S``
    (through the agent's config). A non-positive value raises ``ValueError``. ``first_heartbeat_s``:
    how long a newly started watchdog waits before its first heartbeat, and the job id check before
    it says this rank's id.
    """
    adopt_rank()  # the default group's, for an agent made without RANK (torch.multiprocessing.spawn)
    # The thread that builds the DDP model is the one whose waits in its construction a report shows, until
    # a step's forward says which thread trains (``training_thread.py``).
    PROGRESS.trainer = threading.get_ident()
    collectives.install()
    errors.install_error_hooks()
    dog = watchdog.start_watchdog(
        timeout_s=hang_timeout_s, heartbeat_s=heartbeat_s, first_heartbeat_s=first_heartbeat_s
    )
    job_check.start(delay_s=first_heartbeat_s)  # returns at once, never raises
    peer_presence.announce()  # one store write; peers building a model look for it (never raises)
    return dog


def disable(timeout_s: float = 5.0) -> None:
    """Undo ``enable`` (tests; a process that stops being a rank)."""
    job_check.stop()
    watchdog.stop_watchdog(timeout_s)
    errors.uninstall_error_hooks()
    collectives.uninstall()


def _watch_rendezvous(world_size: int | None) -> None:
    """Start the hang watchdog before ``init_process_group``'s rendezvous; never raises into the user's call.

    A rank whose peer never started (a node that failed to launch, a wrong MASTER_PORT) waits in the
    rendezvous for the process group's timeout, 30 minutes by default, and nothing of it reached the
    collector until then. The watchdog reports a main thread blocked there after the hang timeout, as
    any wait for the peers before the first step (``setup_wait``), and its end. Until such a report it
    sends nothing: its first heartbeat is due one hang timeout from now, moved to one interval after the
    group exists (``_enable_after_init``), so an ordinary rendezvous sends nothing under the identity the
    environment gives, which a script may replace right after ``init_process_group``.
    """
    try:
        dog = watchdog.start_watchdog(first_heartbeat_s=watchdog.hang_timeout_setting())
        dog.expect_world_size(world_size)
    except Exception:
        logger.warning("ddpscope could not watch init_process_group's rendezvous", exc_info=True)


def _enable_after_init() -> None:
    """``enable()`` for a process group just created; never raises into the user's call."""
    try:
        # The first heartbeat one interval later: a script that configures the agent itself right
        # after init_process_group (agent.configure(job=..., rank=dist.get_rank())) replaces the
        # agent enable() made from the environment before that one has sent anything anywhere.
        heartbeat = watchdog.heartbeat_setting()
        enable(first_heartbeat_s=heartbeat)
        dog = watchdog.get_watchdog()
        if dog is not None:
            dog.heartbeat_within(heartbeat)  # the one started for the rendezvous put it off to its timeout
    except Exception:
        logger.warning("ddpscope could not start monitoring after init_process_group", exc_info=True)


def _argument(
    signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any], name: str
) -> Any:
    """The argument ``name`` of an ``init_process_group`` call, None when not given or not bound."""
    try:
        value = kwargs.get(name)
        if value is None and signature is not None:
            value = signature.bind_partial(*args, **kwargs).arguments.get(name)
        return value
    except TypeError:
        return None


def _world_size_asked(
    signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int | None:
    """The world size ``init_process_group`` was asked for (its argument, else ``WORLD_SIZE``), if known."""
    try:
        asked = _argument(signature, args, kwargs, "world_size")
        if isinstance(asked, int) and asked > 0:
            return asked
        return int(os.environ.get("WORLD_SIZE", "")) or None
    except ValueError:
        return None


def watch_init_process_group() -> bool:
    """Wrap ``torch.distributed.init_process_group`` so that ``enable()`` runs once it has returned.

    Idempotent. The wrapper passes every argument through and returns (or raises) what torch does;
    ddpscope's own failures are logged, never raised. Not installed (False) when ``DDPSCOPE_DISABLED``
    is set in the environment or torch has no ``torch.distributed``: then torch is left as it is.
    ``enable()`` itself still reads the agent's configuration when the group is created
    (``agent.configure(disabled=True)`` before that keeps everything off).
    """
    if os.environ.get(ENV_DISABLED, "").strip().lower() in ("1", "true", "yes", "on"):
        return False  # disabled means free: torch is not touched (agent/config.py reads it alike)
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return False
        c10d = dist.distributed_c10d
        original = c10d.init_process_group
    except (ImportError, AttributeError):
        return False
    if getattr(original, _WRAPPED, False):
        return True
    wrapped = _wrap(original)
    c10d.init_process_group = wrapped
    # ``torch.distributed`` re-exports it: user code calls that name, torch's own helpers the c10d one.
    if getattr(dist, "init_process_group", None) is original:
        dist.init_process_group = wrapped
    return True


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    try:
        signature: inspect.Signature | None = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        PROGRESS.trainer = threading.get_ident()  # its rendezvous waits are read on this thread
        _watch_rendezvous(_world_size_asked(signature, args, kwargs))
        found_file = store_file.existing(_argument(signature, args, kwargs, "init_method"))
        try:
            result = original(*args, **kwargs)  # the user's errors pass through as torch raised them
        except Exception as e:
            # The rendezvous timed out (a rank that never started or cannot reach MASTER_ADDR), or the
            # backend failed: nothing of this rank ever reached the collector, so say it now. A wait the
            # watchdog reported there ended in this failure, not in progress: no hang_resolved for it.
            PROGRESS.fail()
            errors.report_error(e, fatal=False, flush=True, store_file=found_file)
            raise
        _enable_after_init()
        return result

    setattr(init_process_group, _WRAPPED, True)
    return init_process_group
