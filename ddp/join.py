"""Uneven inputs: ``DistributedDataParallel.join()`` under torch's ``Join`` context manager.

A rank that runs out of batches leaves its training loop and waits in ``Join.__exit__``; for every
iteration its peers still run, Join calls this module's ``main_hook``, which issues the collectives the
peers' forward and backward issue, in the same order (torch's ``_DDPJoinHook`` protocol):

====================================  ===========================================================
peer that still trains (``forward``)   rank that joined (``main_hook``)
====================================  ===========================================================
Join's "not joined" all-reduce         Join's count of the ranks not joined (join.py)
bucket rebuild broadcast (once)        the same rebuild, from the same rank-0 order
``find_common_rank`` + buffers         the same, this rank not a candidate for the source
"will sync gradients" flag (1 / 0)     the flag (0), waited: skip the rest when nobody syncs
bucket all-reduces (backward)          one all-reduce of zeros per bucket, in bucket order
used-parameter bitmap (backward)       its last backward's bitmap (``find_unused_parameters``)
====================================  ===========================================================

Once every rank has joined, ``post_hook`` agrees on the last rank to join and broadcasts its
parameters and buffers to every rank, so all end with the same model. Joined ranks add zeros, so the
peers' gradients are sums over the ranks still training, divided by the world size
(``divide_by_initial_world_size=True``, torch's default) or by how many ranks still train.

Every collective here is recorded with ``source="join"``: a joined rank's calls come from other code
than its peers' (their call sites differ by design), and the collector compares such calls by op,
shapes and dtypes only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from ddpscope.ddp.collectives import RECORDER, reduce_name

if TYPE_CHECKING:
    from ddpscope.ddp.engine import DistributedDataParallel


def _launch(
    tensor: torch.Tensor, ddp: DistributedDataParallel, op: Any = dist.ReduceOp.SUM
) -> tuple[int, Any]:
    """Start an in-place all-reduce of ``tensor`` over ``ddp``'s group, recorded as a ``join``
    collective; return its sequence number and Work."""
    with RECORDER.engine_call():
        seq = RECORDER.begin(
            ddp._pg,
            "all_reduce",
            [tensor],
            reduce_op=reduce_name(op),
            source="join",
            call_site=RECORDER.call_site(1),
        )
        return seq, dist.all_reduce(tensor, op=op, group=ddp.process_group, async_op=True)


def _finish(ddp: DistributedDataParallel, seq: int, work: Any) -> None:
    try:
        work.wait()
    except Exception as e:
        RECORDER.end(ddp._pg, seq, ok=False, error=str(e))
        raise
    RECORDER.end(ddp._pg, seq, ok=True)


def join_all_reduce(
    tensor: torch.Tensor, ddp: DistributedDataParallel, *, op: Any = dist.ReduceOp.SUM, wait: bool = True
) -> None:
    """All-reduce ``tensor`` in place over ``ddp``'s group as a recorded ``join`` collective."""
    seq, work = _launch(tensor, ddp, op)
    if wait:
        _finish(ddp, seq, work)
    else:
        RECORDER.track(ddp._pg, seq, work)  # ended when the recorder sees it completed


def find_common_rank(ddp: DistributedDataParallel, candidate: bool) -> int:
    """The highest group rank among the candidates (torch's ``_find_common_rank``): the source of a
    broadcast that must come from a rank whose state is current."""
    rank = torch.tensor([ddp._rank if candidate else -1])
    join_all_reduce(rank, ddp, op=dist.ReduceOp.MAX)
    common = int(rank.item())
    if common < 0:
        raise RuntimeError("DistributedDataParallel join: no rank was a candidate for the common rank")
    return common


def send_sync_flag(ddp: DistributedDataParallel, synced: bool) -> None:
    """A rank still training tells the joined ranks whether this iteration's backward reduces
    gradients (1) or not (0: ``no_sync()``, evaluation); not waited for, as torch does."""
    join_all_reduce(torch.ones(1) if synced else torch.zeros(1), ddp, wait=False)


class EngineJoinHook(JoinHook):
    """What a joined rank does for each iteration its peers still run, and once all have joined."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp._replicas.stop()  # its sync count now falls behind its peers'
        reducer = ddp._reducer
        if reducer.wants_rebuild():
            ddp._rebuild_buckets()
        ddp._sync_buffers(joined=True)
        flag = torch.zeros(1)
        join_all_reduce(flag, ddp)
        # As its peers: their next forward broadcasts buffers only after a synchronised one.
        ddp.require_forward_param_sync = flag.item() != 0
        if flag.item() == 0:
            return  # every peer is under no_sync() or evaluating: no gradient all-reduce to shadow
        shadows = reducer.shadow_buckets()
        if reducer.find_unused:
            # torch sends the used-parameter map of this rank's last backward, not zeros: a parameter
            # it used then counts as used by the peers' step (its gradient becomes their average).
            shadows.append(torch.frombuffer(bytearray(reducer.used), dtype=torch.uint8).to(torch.int32))
        # Launched in bucket order, then waited, as the peers' backward does.
        for seq, work in [_launch(tensor, ddp) for tensor in shadows]:
            _finish(ddp, seq, work)
        reducer.shadowed_synced_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the last rank to join (the highest such rank)."""
        ddp = self.ddp
        ddp._broadcast_state(src_rank=find_common_rank(ddp, is_last_joiner))
