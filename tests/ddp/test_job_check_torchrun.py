"""The job id check under torchrun restarts. torchrun keeps one c10d store for the whole run, so the
claims an attempt left are still there when the restarted ranks look (checked on torch 2.13): the check
keeps each attempt's keys apart by ``TORCHELASTIC_RESTART_COUNT``. Here attempt 0's rank 1 reports under
another job id and every rank says so; attempt 1's ranks agree and say nothing, though attempt 0's
differing claims are still in the store.

The workers make their default group with torch's fake backend over torchrun's real store (the store
``env://`` would give them, made the same way): gloo's own restart under torchrun fails about half the time
on torch 2.13 ("Gloo connectFullMesh failed ... Connection refused" in the restarted attempt, or a hang:
3 of 6 runs of a plain torch script with no ddpscope), and a gloo connection is nothing the check uses.

This file is also the worker script (``torchrun ... test_job_check_torchrun.py``; torch is imported only
there). The run has a deadline; torchrun's process group and every worker (each in a session of its own
under torchrun, its pid written to a file at start) are killed by pid.
"""

from __future__ import annotations

import json
import os
import sys

# ------------------------------------------------------------------------------------ the worker script


def worker_main() -> None:  # pragma: no cover - runs under torchrun
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    with open(os.path.join(os.environ["JOB_CHECK_PIDS"], str(os.getpid())), "w"):
        pass
    import datetime

    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    from ddpscope import agent
    from ddpscope.ddp import job_check

    job = "stray" if (attempt, rank) == (0, 1) else "train"
    # In attempt 1, rank 1 says its id well after rank 0 (the check waits a heartbeat first): rank 0 must
    # wait for it, not take the claim attempt 0's rank 1 left for this attempt's.
    late = (attempt, rank) == (1, 1)
    agent.configure(exporter=agent.InMemoryExporter(), job=job, rank=rank, heartbeat_s=2.0 if late else 0.3)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timeout)
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("fake", store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world)
    check = job_check.current()
    done = check is not None and check.wait(60.0)
    said = {"attempt": attempt, "rank": rank, "done": done, "message": check.message if check else None}
    print("JOB_CHECK " + json.dumps(said), file=sys.stderr, flush=True)
    dist.destroy_process_group()
    sys.exit(1 if attempt == 0 else 0)  # attempt 0 fails: torchrun restarts every worker


if __name__ == "__main__":  # pragma: no cover
    worker_main()


# ------------------------------------------------------------------------------------------- the tests

import contextlib  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.support.procs import REPO, free_port, kill_group  # noqa: E402

pytestmark = pytest.mark.slow
TORCHRUN = Path(sys.executable).with_name("torchrun")
DEADLINE_S = 240.0


def test_a_restarted_attempt_does_not_read_the_job_ids_an_earlier_attempt_left_in_torchruns_store(
    tmp_path: Path,
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), JOB_CHECK_PIDS=str(pids))
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "job-check-restart", __file__]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, start_new_session=True, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    finally:
        kill_group(proc)
        for pid in pids.iterdir():  # a worker left behind (in a session of its own) is killed by its pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid.name), signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    said = [json.loads(line.split("JOB_CHECK ", 1)[1]) for line in out.splitlines() if "JOB_CHECK " in line]
    first = [s for s in said if s["attempt"] == 0]
    second = [s for s in said if s["attempt"] == 1]
    assert len(first) == len(second) == 2 and all(s["done"] for s in said), out[-4000:]
    assert all("'stray' (rank 1; " in (s["message"] or "") for s in first), first
    assert [s["message"] for s in second] == [None, None], second
