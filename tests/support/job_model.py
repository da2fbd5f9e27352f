"""A test job's model under either engine, and the end every test job's rank says before it leaves."""

from __future__ import annotations

from typing import Any

from torch import nn

from ddpscope import agent
from ddpscope.ddp import DistributedDataParallel, instrument
from tests.support.job_end import destroy_together


def wrap(net: nn.Module, engine: str, **kwargs: Any) -> nn.Module:
    """``net`` under ddpscope's engine (``engine`` "ddpscope"), or torch's DDP observed by ``instrument()``
    ("torch"), with the same DDP keyword arguments."""
    if engine == "torch":
        return instrument(nn.parallel.DistributedDataParallel(net, **kwargs))
    return DistributedDataParallel(net, **kwargs)


def finish(last_step: int) -> None:
    """Say the rank finished its loop (``rank_exit``), deliver what the agent holds, and leave the group
    with the other ranks (``destroy_together``)."""
    agent.emit({"kind": "rank_exit", "step": last_step, "reason": "finished"})
    agent.get_agent().force_flush(10.0)
    destroy_together()
