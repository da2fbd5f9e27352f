"""The end of a test job: every rank leaves only once all have finished their collectives."""

from __future__ import annotations

import datetime

import torch.distributed as dist


def finish_together(timeout_s: float = 60.0) -> None:
    """Return once every rank has finished its collectives; call it before ``destroy_process_group``.

    A rank that tears down its gloo connections (or aborts at interpreter exit, which torch does now
    and then: TORCH-FACTS) while a peer still reads the last message of their last collective fails
    that peer with "Connection reset by peer". The rendezvous goes through the job's store, not a
    collective, so the recorder sees nothing. Rank 0 hosts the store, so it also waits until every
    other rank is past its last store call before it may leave.
    """
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=timeout_s)
    store.set(f"ddpscope-test/finished/{rank}", "1")
    store.wait([f"ddpscope-test/finished/{r}" for r in range(world)], timeout)
    if rank == 0:
        store.wait([f"ddpscope-test/left/{r}" for r in range(1, world)], timeout)
    else:
        store.set(f"ddpscope-test/left/{rank}", "1")
