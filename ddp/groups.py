"""Process-group helpers: one stable name per group, shared by the engine and the collective recorder."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


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
    name = getattr(group, "group_name", None)
    return f"pg:{name}" if name else f"pg:{id(group):x}"


def group_rank(group: Any = None) -> int:
    return int(dist.get_rank(group))


def global_rank() -> int:
    return int(dist.get_rank())


def group_size(group: Any = None) -> int:
    return int(dist.get_world_size(group))
