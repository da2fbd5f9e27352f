"""Ranks that build their model with different DDP classes: ddpscope's engine on some, torch's own on
others (two copies of a training script that drifted apart, a flag read differently on some nodes).

The two constructors run different collectives before the first step: the engine its state broadcast and a
point-to-point clock sync, torch's its parameter-shape check and state broadcast in C++. Each rank waits in its
own for a peer that is in the other, until the process group's timeout; the collector sees one rank wait in a
collective the other "never issued", which is true and not the cause. Read from the hang reports' stacks:
the frame of the constructor each rank is in.
"""

from __future__ import annotations

import re

from ddpscope.server.analysis.incident_model import Record
from ddpscope.server.analysis.native_wait import main_stack

_CONSTRUCTORS = (
    (re.compile(r'/ddp/engine\.py", line \d+, in __init__'), "ddpscope's DistributedDataParallel"),
    (
        re.compile(r'/torch/nn/parallel/distributed\.py", line \d+, in __init__'),
        "torch's DistributedDataParallel",
    ),
)


def constructor(hang: Record) -> str | None:
    """Which DDP class's constructor the report's training thread is in, None when in neither."""
    stack = main_stack(hang) or ""
    for frame, name in _CONSTRUCTORS:
        if frame.search(stack):
            return name
    return None


def wrappers_differ(hang: Record, peer: Record | None) -> str:
    """'; it is inside torch's DistributedDataParallel constructor while rank 0 is inside ddpscope's: ...'
    when ``hang``'s rank and ``peer``'s are each in a different DDP class's constructor; '' otherwise."""
    if peer is None:
        return ""
    mine, theirs = constructor(hang), constructor(peer)
    if mine is None or theirs is None or mine == theirs:
        return ""
    return (
        f"; it is inside the constructor of {theirs} while rank {hang['rank']} is inside that of {mine}: the ranks wrap the "
        "model with different classes, whose start-up collectives differ, so neither constructor finishes. Wrap "
        "it with one class on every rank (ddpscope's engine everywhere, or torch's with instrument() everywhere)"
    )
