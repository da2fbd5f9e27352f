"""What ranks must agree on when they issue a collective at one sequence number of a process group."""

from __future__ import annotations

from typing import Any

from ddpscope.server.analysis.collectives import agreed_shapes
from ddpscope.server.analysis.incident_model import P2P_OPS, Record


def signature(c: Record, root: bool = True) -> tuple[Any, ...]:
    """What every rank must agree on at one sequence number; ``root=False`` leaves the root out (when
    some rank's record has none: an older agent, the engine's own broadcast)."""
    shapes = agreed_shapes(c)
    # send and recv are the two halves of one transfer: compare them as one op (direction checked apart).
    op = "send/recv" if c.get("op") in P2P_OPS else c.get("op")
    return (op, c.get("reduce_op"), shapes, tuple(c.get("dtypes") or []), c.get("root") if root else None)


def full_key(c: Record) -> tuple[Any, ...]:
    """``signature`` and the call site: the same call from the same line."""
    return (*signature(c), c.get("call_site"))
