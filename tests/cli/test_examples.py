"""The worked examples run as documented: torchrun, one changed line, records at the collector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.collector_proc import CollectorProc
from tests.support.procs import free_port, kill_group

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _jobs(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(f"{url}/api/v1/jobs", timeout=10) as r:
        return {j["job"]: j for j in json.load(r)["items"]}


@pytest.mark.slow
@pytest.mark.parametrize(
    "example, engine", [("train_ddpscope.py", "ddpscope"), ("train_instrument.py", "torch")]
)
def test_the_example_trains_under_torchrun_and_its_job_finishes_at_the_collector(
    example: str, engine: str, tmp_path: Path
) -> None:
    run_id = f"example-{engine}-{os.getpid()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", DDPSCOPE_SPOOL_DIR=str(tmp_path / "spool"))
    env.pop("DDPSCOPE_JOB", None)  # the job id must come from torchrun's TORCHELASTIC_RUN_ID
    with CollectorProc(f"sqlite:///{tmp_path}/examples.db") as collector:
        collector.start()
        env["DDPSCOPE_URL"] = collector.url
        cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{free_port()}", "--rdzv-id", run_id, str(ROOT / "examples" / example)]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, start_new_session=True, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=180)
        finally:
            kill_group(proc)
        assert proc.returncode == 0, out[-3000:]
        deadline = time.monotonic() + 30
        while (job := _jobs(collector.url).get(run_id)) is None or job["status"] != "finished":
            assert time.monotonic() < deadline, f"job {run_id} not finished at the collector: {job}"
            time.sleep(0.5)
        assert job["world_size"] == 2 and job.get("steps") == 50
