"""The end of a test job: every rank leaves only once all have finished their collectives."""

from __future__ import annotations

import datetime

import torch.distributed as dist


def destroy_together(timeout_s: float = 60.0) -> None:
    """``destroy_process_group()`` once every rank has finished its collectives; rank 0 returns only
    once every rank has destroyed its group. Call it instead of ``destroy_process_group()``.

    A rank that tears down its gloo connections (or aborts at interpreter exit, which torch does now
    and then: TORCH-FACTS) while a peer still reads the last message of their last collective fails
    that peer with "Connection reset by peer"; a peer that is still tearing down its group meets
    connections closed under it. The rendezvous goes through the job's store, not a collective, so
    the recorder sees nothing; the store (hosted by rank 0, kept here past the destroy) outlives the
    group.
    """
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=timeout_s)
    store.set(f"ddpscope-test/finished/{rank}", "1")
    store.wait([f"ddpscope-test/finished/{r}" for r in range(world)], timeout)
    dist.destroy_process_group()
    if rank == 0:
        store.wait([f"ddpscope-test/destroyed/{r}" for r in range(1, world)], timeout)
    else:
        store.set(f"ddpscope-test/destroyed/{rank}", "1")
