"""Real 2-rank gloo jobs at a real collector: one whose rank 1 was started with another ``DDPSCOPE_JOB``
than rank 0 (so each rank reports under a job of its own), trained with ddpscope's engine over a process
group of its own rather than the default one; and a healthy one, trained with torch's DDP under
``instrument()``. The ranks compare their job ids through the default group's store
(``ddp/job_check.py``): each of the split job's two ids gets a ``job_ids_differ`` incident naming both ids
and rank 1; the healthy job gets none.

This file is also the rank script (``python test_job_ids_differ_jobs.py ENGINE``; torch is imported only
there). Every job has a deadline and every rank and the collector are killed by process group.
"""

from __future__ import annotations

import json
import sys

STEPS = 4
CHECK_WAIT_S = 90.0
"""How long a rank waits at the end for its job id check (it starts a heartbeat after the group)."""


# ------------------------------------------------------------------------------------- the rank script


def rank_main(engine: str) -> None:  # pragma: no cover - runs in the ranks
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddpscope.ddp import DistributedDataParallel, instrument, job_check
    from tests.support.job_model import finish

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    model: nn.Module = (
        instrument(nn.parallel.DistributedDataParallel(net))
        if engine == "torch"
        else DistributedDataParallel(net, process_group=dist.new_group([0, 1]))
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
    # The job is over in a second: let the check (a daemon thread) finish before the rank exits.
    check = job_check.current()
    done = check is not None and check.wait(CHECK_WAIT_S)
    said = {"done": done, "message": check.message if check is not None else None}
    print("JOB_CHECK " + json.dumps(said), file=sys.stderr, flush=True)
    finish(STEPS - 1)


if __name__ == "__main__":  # pragma: no cover
    rank_main(sys.argv[1])
    sys.exit(0)


# ------------------------------------------------------------------------------------------- the tests

import contextlib  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from tests.support.collector_proc import CollectorProc  # noqa: E402
from tests.support.procs import free_port, started_ranks  # noqa: E402
from tests.support.real_job import RealJob  # noqa: E402

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__)
WAIT_S = 150.0
"""Deadline for one diagnosis: 4 ranks import torch at once on 2 cores first."""


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RealJob]]:
    """The split job (as its two job ids, ``split`` and ``stray``) and the healthy one, started at once
    against one real collector; killed at the end."""
    tmp = tmp_path_factory.mktemp("job-ids")
    with contextlib.ExitStack() as stack:
        collector = stack.enter_context(
            CollectorProc(f"sqlite:///{tmp / 'ddpscope.db'}", log_path=tmp / "collector.log")
        )
        url = collector.start()
        tag = uuid.uuid4().hex[:6]
        ids = {
            "split": f"ids-split-{tag}",
            "stray": f"ids-stray-{tag}",
            "healthy": f"ids-healthy-{tag}",
            "elsewhere": f"ids-elsewhere-{tag}",
        }

        def start(job: str, engine: str, rank1_job: str, rank1_url: str = url) -> list[Any]:
            env = {
                "DDPSCOPE_URL": url,
                "DDPSCOPE_JOB": job,
                "DDPSCOPE_HEARTBEAT_S": "0.5",
                "DDPSCOPE_SPOOL_DIR": str(tmp / job),
            }
            rank1 = {"DDPSCOPE_JOB": rank1_job, "DDPSCOPE_SPOOL_DIR": str(tmp / f"{rank1_job}-1"),
                     "DDPSCOPE_URL": rank1_url}  # fmt: skip
            return stack.enter_context(
                started_ranks(SCRIPT, 2, args=[engine], env=env, per_rank_env={1: rank1})
            )

        split = start(ids["split"], "ddpscope", ids["stray"])
        healthy = start(ids["healthy"], "torch", ids["healthy"])
        # Rank 1's DDPSCOPE_URL names a port nobody listens on (a typo on one node): same job id.
        nowhere = f"http://127.0.0.1:{free_port()}"
        elsewhere = start(ids["elsewhere"], "torch", ids["elsewhere"], rank1_url=nowhere)
        yield {
            "split": RealJob(url, ids["split"], split, wait_s=WAIT_S),
            "stray": RealJob(url, ids["stray"], split, wait_s=WAIT_S),
            "healthy": RealJob(url, ids["healthy"], healthy, wait_s=WAIT_S, engine="torch"),
            "elsewhere": RealJob(url, ids["elsewhere"], elsewhere, wait_s=WAIT_S, engine="torch"),
        }


def job_ids_differ(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [i for i in incidents if i["kind"] == "job_ids_differ"]


def checks(job: RealJob) -> list[dict[str, Any]]:
    """What each rank's job id check said (the rank script prints it on stderr)."""
    said = []
    for rank in range(len(job.procs)):
        line = next(x for x in job.stderr(rank).splitlines() if x.startswith("JOB_CHECK "))
        said.append(json.loads(line.removeprefix("JOB_CHECK ")))
    return said


def test_a_rank_started_with_another_ddpscope_job_is_named_in_an_incident_of_each_job(
    jobs: dict[str, RealJob],
) -> None:
    split, stray = jobs["split"], jobs["stray"]
    assert split.exited_cleanly(), split.logs()
    said = checks(split)
    assert all(s["done"] for s in said) and said[0]["message"] == said[1]["message"], said
    for job, reporter in ((split, 0), (stray, 1)):
        (inc,) = job.wait_for("the ranks' different job ids", job_ids_differ)
        message = inc["message"]
        assert inc["rank"] == reporter and inc["culprit_ranks"] == [1], inc
        assert message == f"Rank {reporter}: {said[0]['message']}", inc
        assert "report to ddpscope under 2 job ids" in message, inc
        assert f"{split.job!r} (rank 0; DDPSCOPE_JOB) and {stray.job!r} (rank 1; DDPSCOPE_JOB)" in message, (
            inc
        )
        assert "Probably misconfigured: rank 1 on " in message, inc
        assert "Give every rank the same DDPSCOPE_JOB" in message, inc


def test_a_job_whose_ranks_share_one_id_gets_no_job_ids_incident(jobs: dict[str, RealJob]) -> None:
    healthy = jobs["healthy"]
    assert healthy.exited_cleanly(), healthy.logs()
    assert checks(healthy) == [{"done": True, "message": None}] * 2
    deadline = time.monotonic() + WAIT_S
    while healthy.status() != "finished" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert healthy.status() == "finished", healthy.logs()
    assert healthy.incidents() == [], healthy.incidents()


def test_a_rank_sending_to_another_collector_under_the_same_id_is_named_at_the_jobs_collector(
    jobs: dict[str, RealJob],
) -> None:
    # Without the check the job's collector could only say rank 1 "never reported ... ran without ddpscope".
    job = jobs["elsewhere"]
    assert job.exited_cleanly(), job.logs()
    said = checks(job)
    assert said[0]["message"] == said[1]["message"] and said[0]["message"] is not None, said
    (inc,) = job.wait_for(
        "the ranks' different collectors", lambda seen: [i for i in seen if i["kind"] == "collectors_differ"]
    )
    assert inc["rank"] == 0 and inc["culprit_ranks"] == [1], inc
    assert (
        f"send their records to 2 collector URLs: '{job.url}' (rank 0) and 'http://127.0.0.1:"
        in inc["message"]
    )
    assert (
        "Probably misconfigured: rank 1 on " in inc["message"] and "the same DDPSCOPE_URL" in inc["message"]
    )
