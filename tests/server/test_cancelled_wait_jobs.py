"""A stall the hang timeout never saw: jobs that end, by a cancellation or by their process group's own
timeout, while a rank waits for a peer, before the watchdog's timeout (5 minutes by default) lets any
rank report a hang. 2-rank gloo jobs stream to a real collector.

Both used to leave the wrong story: the cancelled job read ``finished`` with no incident (its ranks'
SIGTERM exits looked like a clean end), and the timeout blamed "the OS or a network failure" although
the collector knew which rank never issued the collective.

This file is also the rank script (``python test_cancelled_wait_jobs.py SCENARIO ENGINE``; torch is
imported only there). Every job has a deadline and every rank is killed by its process group.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FAULT_STEP = 3
STEPS = 6
GROUP_TIMEOUT_S = 8.0
"""The ``group_timeout`` scenario's process-group timeout: far under the hang timeout."""
HANG_TIMEOUT_S = 300.0
"""ddpscope's default: no rank reports a hang in these jobs."""


# ------------------------------------------------------------------------------------- the rank script


def rank_main(scenario: str, engine: str) -> None:  # pragma: no cover - runs in the ranks
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn

    from ddpscope.ddp import DistributedDataParallel, instrument, monitor

    monitor.enable()
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S if scenario == "group_timeout" else 300)
    dist.init_process_group("gloo", timeout=timeout)
    torch.manual_seed(0)
    rank = dist.get_rank()
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    model: nn.Module = (
        instrument(nn.parallel.DistributedDataParallel(net))
        if engine == "torch"
        else DistributedDataParallel(net)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        if step == FAULT_STEP and rank == 1:
            time.sleep(600)  # a stuck data loader  # SITE:stall
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    rank_main(sys.argv[1], sys.argv[2])
    sys.exit(0)


# ------------------------------------------------------------------------------------------- the tests

import pytest  # noqa: E402

from tests.support.real_job import RealJob, jobs_at_one_collector  # noqa: E402

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__)
JOBS = (("cancelled", "ddpscope"), ("cancelled", "torch"), ("group_timeout", "ddpscope"))
WAIT_S = 150.0
"""Deadline for one diagnosis: 6 ranks import torch at once on 2 cores first."""


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], RealJob]]:
    """Every job started at once against one real collector (the waits overlap); killed at the end."""
    with jobs_at_one_collector(
        tmp_path_factory.mktemp("cancelled-wait"),
        SCRIPT,
        JOBS,
        prefix="cancel",
        hang_timeout_s=HANG_TIMEOUT_S,
        wait_s=WAIT_S,
    ) as started:
        yield started


def missing(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [i for i in incidents if i["kind"] == "missing_collective" and i["step"] == FAULT_STEP]


@pytest.mark.parametrize("engine", ["ddpscope", "torch"])
def test_a_job_cancelled_while_a_rank_waited_for_a_stuck_peer_is_failed_with_that_peer_named(
    jobs: dict[tuple[str, str], RealJob], engine: str
) -> None:
    j = jobs[("cancelled", engine)]
    # The collector sees rank 0's wait once it has lasted longer than a rank may stay silent (10 s).
    j.wait_for("rank 0's wait for rank 1", missing)
    assert j.status() == "running"  # no rank reported a hang: the hang timeout is 5 minutes
    for p in j.procs:  # the scheduler cancels the job, as scancel or a launcher's timeout does
        p.send_signal(signal.SIGTERM)
    j.wait_exit()
    deadline = time.monotonic() + WAIT_S
    while j.status() != "failed" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert j.status() == "failed", j.logs()
    (wait,) = missing(j.incidents())
    assert wait["culprit_ranks"] == [1], wait
    assert wait["message"].startswith("Rank 0 waited "), wait
    assert "until it was stopped by SIGTERM; rank 1 never issued it" in wait["message"], wait


def test_a_process_group_timeout_before_any_hang_report_is_blamed_on_the_rank_that_never_issued_it(
    jobs: dict[tuple[str, str], RealJob],
) -> None:
    j = jobs[("group_timeout", "ddpscope")]
    (err,) = j.wait_for(
        "rank 0's timeout", lambda inc: [i for i in inc if i["kind"] == "rank_error" and i["rank"] == 0]
    )
    assert err["culprit_ranks"] == [1], err
    assert "the cause is on rank 1: rank 0 was waiting in all_reduce" in err["message"], err
    assert "which rank 1 never issued" in err["message"], err
    assert "killed by the OS" not in err["message"], err
