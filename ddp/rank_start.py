"""The ``rank_start`` record (agent/records.py) that every engine sends once per rank at construction.

ddpscope's own engine and the ``instrument()`` adapter build it here, so the two cannot drift apart
in field names or in how versions are read::

    record = rank_start_record(
        rank=0, world_size=2, group=None, device="cpu", engine="ddpscope",
        find_unused_parameters=False, bucket_cap_mb=25.0, clock=estimate,
    )
    agent.emit(record)
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import socket
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddpscope.agent.log import get_logger
from ddpscope.ddp import watchdog
from ddpscope.ddp.groups import pg_name
from ddpscope.ddp.nonfinite import gradient_check_enabled

logger = get_logger(__name__)


class ClockEstimate(Protocol):
    """What the record needs of ``ddp.clock.estimate_offset()``'s result."""

    @property
    def offset_ns(self) -> int: ...

    @property
    def error_ns(self) -> int: ...


@functools.cache
def ddpscope_version() -> str:
    """The installed ddpscope distribution's version, ``0+unknown`` when run from a bare checkout."""
    try:
        return importlib.metadata.version("ddpscope")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _hang_timeout_s() -> float:
    """The hang timeout this rank's watchdog runs with (``monitor.enable(hang_timeout_s=...)`` may have
    set it), else the one it would start with: the collector compares it across ranks."""
    current = watchdog.get_watchdog()
    return float(current.timeout_s) if current is not None else watchdog.hang_timeout_setting()


def group_timeout_s(group: Any) -> float | None:
    """The timeout of process group ``group`` (None: the default one), as its backend holds it (gloo's and
    NCCL's options), or None where torch does not say."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cuda" if dist.get_backend(pg) == "nccl" else "cpu"))
        return float(backend.options._timeout.total_seconds())
    except Exception:  # a private API: another torch, another backend
        return None


@functools.cache
def _warn_group_times_out_first(group_s: float, hang_s: float) -> None:
    """Once per pair of values: ranks of one job share them."""
    logger.warning(
        "ddpscope: the process group's timeout (%g s) is shorter than the hang timeout (%g s): a stalled "
        "collective ends in torch's 'Timed out' error before ddpscope's hang report (every thread's stack, "
        "the rank holding the others up) is taken. Set DDPSCOPE_HANG_TIMEOUT below %g s on every rank.",
        group_s,
        hang_s,
        group_s,
    )


def rank_start_record(
    *,
    rank: int,
    world_size: int,
    group: Any,
    device: str,
    engine: str,
    find_unused_parameters: bool,
    bucket_cap_mb: float,
    clock: ClockEstimate,
    static_graph: bool = False,
    unobserved_ranks: Sequence[int] = (),
) -> dict[str, Any]:
    """A ``rank_start`` record ready for ``agent.emit()``; warns (once) when the process group would time
    out before the hang watchdog reports.

    ``rank`` is the global rank, ``group`` the process group the engine reduces over (None: the
    default one), ``engine`` ``"ddpscope"`` or ``"torch"``, ``clock`` the offset estimate to rank 0.
    """
    hang_s = _hang_timeout_s()
    timeouts: dict[str, float] = {"hang_timeout_s": hang_s}
    group_s = group_timeout_s(group)
    if group_s is not None:
        timeouts["group_timeout_s"] = group_s
        if group_s < hang_s:
            _warn_group_times_out_first(group_s, hang_s)
    return {
        "kind": "rank_start",
        "rank": rank,
        "world_size": world_size,
        "backend": str(dist.get_backend(group)),
        "device": device,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "engine": engine,
        "torch_version": str(torch.__version__),  # a str subclass: see agent.spool.plain
        "ddpscope_version": ddpscope_version(),
        "python_version": platform.python_version(),
        "find_unused_parameters": bool(find_unused_parameters),
        "bucket_cap_mb": float(bucket_cap_mb),
        "clock_offset_ns": clock.offset_ns,
        "clock_error_ns": clock.error_ns,
        "process_group": pg_name(group),
        "static_graph": bool(static_graph),
        **timeouts,
        "check_gradients": gradient_check_enabled(),
        **_cpu_share(),
        **({"unobserved_ranks": [int(r) for r in unobserved_ranks]} if unobserved_ranks else {}),
    }


def _cpu_share() -> dict[str, int]:
    """What this rank may compute with: the host's CPUs, those its affinity allows, its intra-op threads. The
    collector adds up the ranks of a host to tell a host with more threads than cores, where sharing the cores
    slows ranks unevenly and a rank can read as a straggler that is not slow itself."""
    out: dict[str, int] = {"threads": int(torch.get_num_threads())}
    cpus = os.cpu_count()
    if cpus:
        out["host_cpus"] = cpus
    if hasattr(os, "sched_getaffinity"):
        out["cpus_allowed"] = len(os.sched_getaffinity(0))
    return out
