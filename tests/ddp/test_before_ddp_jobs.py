"""Real 2-rank gloo jobs that go wrong (or wait) between init_process_group and the DDP construction.

The scripts import ddpscope first and never call its monitor: creating the process group starts it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.ddp.failure_jobs.runner import JOBS, JobRun, read_records, site
from tests.support.procs import exited_cleanly, run_ranks

pytestmark = pytest.mark.slow

SCRIPT = JOBS / "before_ddp_job.py"
WAIT_ENV = {"DDPSCOPE_HANG_TIMEOUT": "2.0", "DDPSCOPE_HEARTBEAT_S": "0.5", "JOB_STALL_S": "7.0"}


def run(scenario: str, out_dir: Path, env: dict[str, str] | None = None) -> JobRun:
    results = run_ranks(SCRIPT, 2, args=[scenario, str(out_dir)], env=env or {}, timeout_s=120)
    return JobRun(results, read_records(out_dir, 2))


def test_a_rank_that_raises_before_building_its_model_sends_the_error_with_type_message_and_stack(
    tmp_path: Path,
) -> None:
    job = run("raise", tmp_path)
    assert job.results[1].returncode == 1, job.output()
    (err,) = job.of(1, "rank_error")
    assert (err["error_type"], err["fatal"], err["step"], err["phase"]) == (
        "FileNotFoundError",
        True,
        0,
        "idle",
    )
    assert "no-such-shard.bin" in err["message"]
    assert site("open", SCRIPT).split(":")[1] in err["stack"] and "load_data" in err["stack"]
    (exit_,) = job.of(1, "rank_exit")
    assert exit_["reason"] == "error"
    # Its peer, waiting in torch's DDP constructor, fails there and says so too.
    (peer,) = job.of(0, "rank_error")
    ddp_line = site("ddp", SCRIPT).split(":")[1]
    assert (
        peer["fatal"] and "distributed.py" in peer["stack"] and f"line {ddp_line}, in build" in peer["stack"]
    )
    for rank in (0, 1):  # even a rank gone within a second says how large the job is
        assert {b["world_size"] for b in job.of(rank, "heartbeat")} == {2}


def test_a_rank_that_calls_sys_exit_before_building_its_model_sends_a_fatal_system_exit(
    tmp_path: Path,
) -> None:
    job = run("exit", tmp_path)
    assert job.results[1].returncode == 1, job.output()
    (err,) = job.of(1, "rank_error")
    assert (err["error_type"], err["fatal"], err["message"]) == (
        "SystemExit",
        True,
        "sys.exit(1): exit status 1",
    )
    assert site("exit", SCRIPT).split(":")[1] in err["stack"]
    assert [r["reason"] for r in job.of(1, "rank_exit")] == ["error"]


def test_a_rank_that_returns_early_with_status_0_exits_promptly_with_its_normal_exit_record(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    job = run("return", tmp_path)
    took_s = time.monotonic() - started
    assert job.results[1].returncode == 0, job.output()
    assert job.of(1, "rank_error") == []
    (exit_,) = job.of(1, "rank_exit")
    assert exit_["reason"] == "finished"
    (beat,) = job.of(1, "heartbeat")  # sent as its watchdog stopped, before the first interval was up
    assert beat["world_size"] == 2
    # Both ranks (rank 0 fails in its DDP constructor once rank 1 is gone) are done in seconds: nothing
    # ddpscope started holds a process back at exit.
    assert took_s < 40, job.output()


def test_a_rank_waiting_in_torchs_ddp_constructor_for_a_peer_in_set_up_reports_that_it_waits_for_its_peers(
    tmp_path: Path,
) -> None:
    job = run("wait", tmp_path, WAIT_ENV)
    assert all(exited_cleanly(r) for r in job.results), job.output()
    entered_ns = int(job.results[0].stdout.split("building at ")[1].split()[0])
    (hang,) = job.of(0, "hang")
    assert (hang["phase"], hang["step"], hang["inflight"], hang["pending_buckets"]) == ("idle", 0, [], [])
    # Within the timeout, plus a few seconds of a loaded 2-core machine.
    assert 2.0 <= (hang["time_ns"] - entered_ns) / 1e9 < 6.0
    assert hang["stalled_s"] >= 2.0 and hang["main_cpu_s"] is not None and hang["main_cpu_s"] < 0.2
    message = hang["message"]
    assert (
        "waited" in message and "for its peers inside torch's DistributedDataParallel construction" in message
    )
    assert "before its first step" in message and "This rank is not stuck itself" in message
    assert f"the main thread waits at tests/ddp/failure_jobs/{site('ddp', SCRIPT)}" in message
    main = next(s for s in hang["stacks"] if s["thread"] == "MainThread")
    assert "torch/distributed/utils.py" in main["stack"].strip().splitlines()[-2]
    (resolved,) = job.of(0, "hang_resolved")
    assert resolved["time_ns"] > hang["time_ns"] and resolved["hang_s"] >= hang["stalled_s"]
    # Rank 1 slept in its own set-up: that is not reported, however long it is.
    assert job.of(1, "hang") == []
    for rank in (0, 1):
        beats = job.of(rank, "heartbeat")
        (start,) = job.of(rank, "rank_start")
        assert beats[0]["time_ns"] < start["time_ns"] and {b["world_size"] for b in beats} == {2}
        assert len(job.of(rank, "step")) == 3


def test_a_healthy_short_job_reports_no_hang_and_its_heartbeats_carry_the_world_size(tmp_path: Path) -> None:
    job = run("healthy", tmp_path, {"DDPSCOPE_HANG_TIMEOUT": "2.0", "DDPSCOPE_HEARTBEAT_S": "0.2"})
    assert all(exited_cleanly(r) for r in job.results), job.output()
    for rank in (0, 1):
        assert job.of(rank, "hang") == [] and job.of(rank, "rank_error") == []
        beats = job.of(rank, "heartbeat")
        assert beats and all(b["world_size"] == 2 for b in beats)
        assert [r["reason"] for r in job.of(rank, "rank_exit")] == ["finished"]


@pytest.mark.parametrize(
    "env", [{"DDPSCOPE_DISABLED": "1"}, {"PROBE_CONFIGURE_DISABLED": "1"}], ids=["environment", "configure"]
)
def test_with_ddpscope_disabled_creating_the_group_starts_no_monitoring(
    tmp_path: Path, env: dict[str, str]
) -> None:
    (result,) = run_ranks(SCRIPT, 1, args=["probe", str(tmp_path)], env=env, timeout_s=60)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout.split("PROBE ", 1)[1])
    assert facts["threads"] == ["MainThread"]
    assert (
        facts["excepthook_module"] != "ddpscope.ddp.errors"
        and facts["exit_kept"]
        and facts["all_reduce_kept"]
    )
    # Disabled in the environment, torch is not even wrapped; configured off, the wrapper does nothing.
    assert facts["wrapped"] is ("DDPSCOPE_DISABLED" not in env)
    assert read_records(tmp_path, 1)[0] == []


def test_without_any_setting_creating_the_group_starts_the_monitor(tmp_path: Path) -> None:
    (result,) = run_ranks(SCRIPT, 1, args=["probe", str(tmp_path)], timeout_s=60)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout.split("PROBE ", 1)[1])
    assert "ddpscope-watchdog" in facts["threads"] and facts["excepthook_module"] == "ddpscope.ddp.errors"
    assert not facts["exit_kept"] and not facts["all_reduce_kept"]
    (beat,) = [r for r in read_records(tmp_path, 1)[0] if r["kind"] == "heartbeat"]
    assert beat["world_size"] == 1
