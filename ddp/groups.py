"""Process-group helpers: one stable name per group, shared by the engine and the collective recorder."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ddpscope.agent.log import get_logger
from ddpscope.ddp.collectives import RECORDER, group_pg_name

logger = get_logger(__name__)


def pg_name(group: Any = None) -> str:
    """A name for ``group`` that is the same on every rank of it.

    ``"default"`` for the default (world) group; otherwise ``"pg:<c10d group name>"``: torch numbers
    groups in creation order, which every rank goes through identically, so the name matches across ranks
    and the server can line up per-group sequence numbers.
    """
    if group is None or group is dist.group.WORLD:
        return "default"
    if dist.is_initialized() and group is dist.distributed_c10d._get_default_group():
        return "default"
    pg = group_pg_name(group)
    _register(pg, group)
    return pg


def _register(pg: str, group: Any) -> None:
    """Tell the recorder the members of ``group``, so the engine's records on it carry them too (the
    collector cannot tell a member that never issued a collective from a rank outside the group)."""
    try:
        RECORDER.register_group(pg, dist.get_process_group_ranks(group))
    except Exception:  # not a ProcessGroup torch knows (a test double): its records go without members
        logger.debug("ddpscope could not read the members of %s", pg, exc_info=True)


def replica_ranks(group: Any = None) -> list[int] | None:
    """The global ranks holding copies of a model that DDP reduces over ``group``; None when that is every
    rank of the job (the default group, or a group of the whole world). Models on disjoint groups (DDP on
    subgroups: one replica group per pipeline stage or per shard) are different models, never compared."""
    if pg_name(group) == "default":
        return None
    try:
        ranks = sorted(int(r) for r in dist.get_process_group_ranks(group))
    except Exception:  # not a ProcessGroup torch knows (a test double)
        return None
    return None if len(ranks) == dist.get_world_size() else ranks


def group_rank(group: Any = None) -> int:
    return int(dist.get_rank(group))


def global_rank() -> int:
    return int(dist.get_rank())


def group_size(group: Any = None) -> int:
    return int(dist.get_world_size(group))
