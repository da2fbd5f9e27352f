"""A job that trains a second model with plain torch DDP next to the one ddpscope observes (a GAN whose
discriminator is left unwrapped): a stall in the plain model's C++ all-reduce must still page. 2-rank
gloo jobs stream to a real collector.

The plain model's all-reduces run in torch's C++ Reducer and are not recorded, so a rank waiting in
one reports a hang with nothing in flight, as a rank stuck in its own code does; the collector used to
read both ranks as busy in their own code (like an evaluation on every rank) and raised no incident.

This file is also the rank script (``python test_plain_ddp_hang_jobs.py SCENARIO ENGINE``; torch is
imported only there). Every job has a deadline and every rank is killed by its process group.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FAULT_STEP = 3
STEPS = 6
HANG_TIMEOUT_S = 3.0
PLAIN_GROUP_TIMEOUT_S = 15.0
"""The plain model's process group gives up on its all-reduce after this: the ``timeout`` scenario."""


# ------------------------------------------------------------------------------------- the rank script


def rank_main(scenario: str, engine: str) -> None:  # pragma: no cover - runs in the ranks
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn

    from ddpscope.ddp import DistributedDataParallel, instrument
    from tests.support.job_end import destroy_together
    from tests.support.job_start import start_monitored_rank

    rank = start_monitored_rank()
    width = 384 if scenario == "plain_phase" else 16  # real work per step in the long plain stretch

    def mlp(out: int) -> nn.Module:
        return nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, out)
        )

    observed = mlp(width)
    generator: nn.Module = (
        instrument(nn.parallel.DistributedDataParallel(observed))
        if engine == "torch"
        else DistributedDataParallel(observed)
    )
    # The discriminator stays plain torch DDP: ddpscope records none of its collectives.
    group = dist.new_group(timeout=datetime.timedelta(seconds=PLAIN_GROUP_TIMEOUT_S))
    discriminator = nn.parallel.DistributedDataParallel(mlp(1), process_group=group)
    opt_g = torch.optim.SGD(generator.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=1e-3)

    def discriminator_step(fake: torch.Tensor) -> None:
        opt_d.zero_grad(set_to_none=True)
        discriminator(fake.detach()).pow(2).mean().backward()  # SITE:plain_backward
        opt_d.step()

    for step in range(STEPS):
        fake = generator(torch.randn(64, width))
        if step == FAULT_STEP and scenario in ("stall", "timeout") and rank == 1:
            time.sleep(300)  # its own code, before the plain model's backward  # SITE:stall
        if step == FAULT_STEP and scenario == "plain_phase":
            # Every rank trains the plain model alone for longer than the hang timeout: working, not
            # hung. Every rank must run as many steps: the count is agreed from a timed sample.
            began = time.monotonic()
            for _ in range(10):
                discriminator_step(fake)
            count = torch.tensor([4 * HANG_TIMEOUT_S / ((time.monotonic() - began) / 10)])
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            for _ in range(int(count.item())):
                discriminator_step(fake)
        discriminator_step(fake)
        opt_g.zero_grad(set_to_none=True)
        discriminator(fake).pow(2).mean().backward()
        opt_g.step()
    dist.barrier()
    destroy_together()


if __name__ == "__main__":  # pragma: no cover
    rank_main(sys.argv[1], sys.argv[2])
    sys.exit(0)


# ------------------------------------------------------------------------------------------- the tests

import pytest  # noqa: E402

from tests.support.real_job import RealJob, jobs_at_one_collector, marked_site  # noqa: E402

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__)
JOBS = (("stall", "torch"), ("stall", "ddpscope"), ("timeout", "torch"), ("plain_phase", "torch"))
WAIT_S = 150.0
"""Deadline for one diagnosis: 8 ranks import torch at once on 2 cores first."""


def site(name: str) -> str:
    """``file:line`` of the line marked ``# SITE:<name>`` in this file."""
    return marked_site(SCRIPT, name)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], RealJob]]:
    """Every job started at once against one real collector (the waits overlap); killed at the end."""
    with jobs_at_one_collector(
        tmp_path_factory.mktemp("plain-ddp"),
        SCRIPT,
        JOBS,
        prefix="plain",
        hang_timeout_s=HANG_TIMEOUT_S,
        wait_s=WAIT_S,
    ) as started:
        yield started


def hangs(incidents: list[dict[str, Any]], rank: int) -> list[dict[str, Any]]:
    return [i for i in incidents if i["kind"] == "hang" and i["rank"] == rank and i["step"] == FAULT_STEP]


@pytest.mark.parametrize("engine", ["torch", "ddpscope"])
def test_a_rank_stuck_before_the_plain_models_backward_is_named_by_its_peer_waiting_in_torchs_allreduce(
    jobs: dict[tuple[str, str], RealJob], engine: str
) -> None:
    j = jobs[("stall", engine)]
    # Rank 0's hang report may reach the collector before rank 1's own: until then its incident names no
    # culprit (nothing in flight, no peer known to be stuck). The diagnosis must settle on rank 1.
    (wait,) = j.wait_for(
        "rank 0's wait in the plain all-reduce, blamed",
        lambda inc: [h for h in hangs(inc, 0) if h["culprit_ranks"]],
    )
    assert wait["culprit_ranks"] == [1], wait
    assert "in torch's backward pass" in wait["message"], wait
    assert wait["call_site"].endswith(site("plain_backward")), wait
    assert site("stall") in wait["message"] and wait["active"], wait
    (own,) = j.wait_for("rank 1's own stall", lambda inc: hangs(inc, 1))
    assert own["culprit_ranks"] == [1] and own["call_site"].endswith(site("stall")), own
    assert "while rank 0 waits for it" in own["message"], own
    assert j.status() == "hung"


def test_a_timeout_in_the_plain_models_allreduce_is_blamed_on_the_stuck_peer_not_the_waiting_rank(
    jobs: dict[tuple[str, str], RealJob],
) -> None:
    j = jobs[("timeout", "torch")]
    (err,) = j.wait_for(
        "rank 0's timeout", lambda inc: [i for i in inc if i["kind"] == "rank_error" and i["rank"] == 0]
    )
    assert err["culprit_ranks"] == [1], err
    assert f"rank 1 was stuck between forward and backward at step {FAULT_STEP}" in err["message"], err


def test_every_rank_training_only_the_plain_model_for_longer_than_the_hang_timeout_is_no_hang(
    jobs: dict[tuple[str, str], RealJob],
) -> None:
    j = jobs[("plain_phase", "torch")]
    deadline = time.monotonic() + WAIT_S
    while j.status() != "finished" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert j.status() == "finished", j.logs()
    assert j.incidents() == [], j.logs()
    # The premise: each rank's watchdog did report the stretch (the agent prints hang reports to stderr).
    for rank in range(len(j.procs)):
        assert "has made no progress" in j.stderr(rank)
