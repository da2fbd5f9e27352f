"""``ddpscope demo`` runs its real jobs and prints what the collector found (here one scenario, 2 ranks)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.collector_proc import CollectorProc
from tests.support.procs import kill_group

DEMO_DEADLINE_S = 150.0


def run_demo(tmp_path: Path, scenario: str) -> tuple[int | None, str]:
    """``ddpscope demo`` on one 2-rank scenario against its own collector: (exit status, output)."""
    with CollectorProc(f"sqlite:///{tmp_path}/demo.db") as collector:
        collector.start()
        cmd = [str(Path(sys.executable).with_name("ddpscope")), "demo", "--url", collector.url, "--scenario", scenario,
               "--ranks", "2", "--steps", "12", "--exit"]  # fmt: skip
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=DEMO_DEADLINE_S)
        finally:
            kill_group(proc)
    return proc.returncode, out


@pytest.mark.slow
def test_the_demo_of_a_checkpoint_loaded_on_one_rank_prints_the_diverged_replicas(tmp_path: Path) -> None:
    code, out = run_demo(tmp_path, "diverged")
    assert code == 0, out
    assert "status: finished" in out, out  # nothing fails: the ranks just train different models
    assert "[replicas_diverged] The ranks' copies of the model differ at step 8" in out, out
    assert "they were identical at step 4" in out and "ranks 0, 1 each hold a different copy" in out, out


@pytest.mark.slow
def test_the_demo_of_a_nan_batch_on_one_rank_names_that_rank_though_every_rank_went_nan(
    tmp_path: Path,
) -> None:
    code, out = run_demo(tmp_path, "nan")
    assert code == 0, out
    assert "status: finished" in out, out  # nothing fails: the job trains on NaN
    assert "[nonfinite_loss] Rank 1's loss was NaN or Inf at step 6" in out, out
    assert "rank 0 followed from step 7" in out and "has not been finite since on ranks 0, 1" in out, out
    assert "so the nonfinite_loss incident names the rank whose loss went first" in out, out


@pytest.mark.slow
def test_the_demo_stops_a_hung_job_with_sigterm_so_only_the_stuck_rank_is_blamed(tmp_path: Path) -> None:
    code, out = run_demo(tmp_path, "hang")
    assert code == 0, out
    # Stopped as a launcher stops a job, both ranks tell the collector so: neither reads as fallen silent.
    assert "rank 0: killed by SIGTERM, rank 1: killed by SIGTERM" in out, out
    assert "status: failed" in out, out  # a hung job ended by a signal did not finish
    assert "culprit: rank 1 (never issued collective" in out, out
    assert "until it exited (sigterm)" in out, out
    # The step it hung in, which no rank finished: where each rank stopped, and the page that draws it
    # (rank 0 waits in backward or, once every bucket is launched, in the all-reduce phase).
    stopped = re.search(
        r"step (\d+), where it stopped: rank 0 hung in (backward|allreduce), all-reduce of buckets? [\d, ]+ "
        r"in flight; rank 1 hung between steps after step (\d+): http\S+/steps/(\d+)",
        out,
    )
    assert stopped and stopped[1] == stopped[4] and int(stopped[3]) == int(stopped[1]) - 1, out
    assert "rank_silent" not in out and "went silent" not in out and "None" not in out, out
