"""Crash durability and process lifecycle, with real child processes and a real HTTP collector."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.conftest import kill_shippers, wait_shippers_gone
from tests.agent.fake_collector import FakeCollector
from tests.support.agent_env import agent_env
from tests.support.procs import assert_all_ok, free_port, run_ranks

CHILD = Path(__file__).with_name("child.py")
pytestmark = pytest.mark.timeout(120)


def child_env(url: str, spool_dir: Path, job: str, **extra: str) -> dict[str, str]:
    return agent_env(url, spool_dir, job, **{"DDPSCOPE_HTTP_TIMEOUT_S": "2", **extra})


def start(
    procs: list[subprocess.Popen[str]], mode: str, n: int, env: dict[str, str]
) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, str(CHILD), mode, str(n)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    procs.append(p)
    return p


def wait_ready(p: subprocess.Popen[str]) -> None:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "READY", (line, p.stderr.read() if p.poll() is not None and p.stderr else "")


def logs(spool_dir: Path) -> str:
    """The shipper logs, for assertion messages."""
    return (
        "\n".join(f"{p.name}: {p.read_text()[-2000:]}" for p in spool_dir.glob("*.log")) or "(no shipper log)"
    )


def heartbeat_steps(c: FakeCollector) -> list[int]:
    return sorted(r["step"] for r in c.of_kind("heartbeat"))


def test_records_emitted_before_a_sigkill_reach_the_collector(collector, spool_dir, started) -> None:
    p = start(started, "kill", 500, child_env(collector.url, spool_dir, "killed"))
    wait_ready(p)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    ok = collector.wait_for(lambda c: len(c.of_kind("heartbeat")) == 500, 20)
    assert ok, (len(collector.of_kind("heartbeat")), sorted(os.listdir(spool_dir)), logs(spool_dir))
    assert heartbeat_steps(collector) == list(range(500))
    assert collector.duplicates == 0
    assert wait_shippers_gone(spool_dir, 20), "the shipper must exit once its rank is gone and all is sent"
    assert not list(spool_dir.glob("*.seg")), "delivered segments are removed"


def test_an_aborted_rank_reports_a_fatal_rank_error_with_its_stack(collector, spool_dir, started) -> None:
    p = start(started, "abort", 20, child_env(collector.url, spool_dir, "aborted"))
    p.wait(30)
    assert p.returncode == -signal.SIGABRT
    assert collector.wait_for(lambda c: c.of_kind("rank_error") and len(c.of_kind("heartbeat")) == 20, 20)
    (err,) = collector.of_kind("rank_error")
    assert err["fatal"] is True and err["error_type"] == "SIGABRT"
    assert err["phase"] == "unknown" and err["step"] is None and err["rank"] == 0
    assert "crash_here" in err["stack"] and "Aborted" in err["message"]


def collective_seqs(c: FakeCollector) -> list[int]:
    return sorted(r["coll_seq"] for r in c.of_kind("collective"))


def test_collectives_made_durable_just_before_an_abort_arrive_from_the_write_ahead_ring(
    collector, spool_dir, started
) -> None:
    # The worker's round is a minute away: the records were never written to the spool, only to the
    # memory-mapped ring, which the shipper reads once the rank is gone.
    env = child_env(collector.url, spool_dir, "ring-abort", DDPSCOPE_FLUSH_INTERVAL_S="60")
    p = start(started, "durable_abort", 40, env)
    p.wait(30)
    assert p.returncode == -signal.SIGABRT
    ok = collector.wait_for(lambda c: len(c.of_kind("collective")) == 40 and c.of_kind("rank_error"), 20)
    assert ok, (collective_seqs(collector), logs(spool_dir))
    assert collective_seqs(collector) == list(range(1, 41))
    assert collector.duplicates == 0
    assert wait_shippers_gone(spool_dir, 20)
    assert not list(spool_dir.glob("*.ring")), "the ring goes with the rest of the delivered spool"


def test_urgent_records_emitted_just_before_a_sigkill_arrive_without_any_flush(
    collector, spool_dir, started
) -> None:
    # The worker's round is a minute away: the error reports were copied into the write-ahead ring
    # as each was emitted, and the ring carries whatever the worker had not spooled yet.
    env = child_env(collector.url, spool_dir, "ring-kill", DDPSCOPE_FLUSH_INTERVAL_S="60")
    p = start(started, "kill_unflushed", 200, env)
    wait_ready(p)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    ok = collector.wait_for(lambda c: len(c.of_kind("rank_error")) == 200, 20)
    assert ok, (len(collector.of_kind("rank_error")), logs(spool_dir))
    assert sorted(r["step"] for r in collector.of_kind("rank_error")) == list(range(200))
    assert collector.duplicates == 0


@pytest.mark.parametrize("worker", ["woken", "starved"])
def test_more_durable_collectives_than_the_ring_holds_all_arrive_after_a_sigkill(
    collector, spool_dir, started, worker
) -> None:
    # The worker's round is a minute away and 1200 collectives overflow the ring's 512 slots: the
    # early ones survive because half a ring of unspooled records wakes the worker to spool them, and
    # when the worker does not run (starved), because the caller spools them itself at three quarters.
    env = child_env(collector.url, spool_dir, "ring-overflow", DDPSCOPE_FLUSH_INTERVAL_S="60")
    if worker == "starved":
        env["CHILD_STARVE_WORKER"] = "1"
    p = start(started, "kill_ringed", 1200, env)
    wait_ready(p)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    ok = collector.wait_for(lambda c: len(c.of_kind("collective")) == 1200, 30)
    assert ok, (len(collector.of_kind("collective")), logs(spool_dir))
    assert collective_seqs(collector) == list(range(1, 1201))
    assert collector.duplicates == 0


def test_collectives_made_durable_then_spooled_at_exit_are_not_sent_twice(
    collector, spool_dir, started
) -> None:
    env = child_env(collector.url, spool_dir, "ring-exit", DDPSCOPE_FLUSH_INTERVAL_S="60")
    p = start(started, "durable_exit", 40, env)
    assert p.wait(30) == 0
    assert collector.wait_for(lambda c: c.of_kind("rank_exit") and len(c.of_kind("collective")) == 40, 20)
    assert wait_shippers_gone(spool_dir, 20)
    assert collective_seqs(collector) == list(range(1, 41))
    assert collector.duplicates == 0, "the ring's copies of records the spool carried stay unsent"


def test_a_frozen_ranks_last_records_leave_its_write_ahead_ring_while_it_is_stopped_and_only_once(
    collector, spool_dir, started
) -> None:
    env = child_env(collector.url, spool_dir, "frozen", DDPSCOPE_FLUSH_INTERVAL_S="60")
    p = start(started, "kill_ringed", 10, env)
    wait_ready(p)
    os.kill(p.pid, signal.SIGSTOP)  # as a debugger, a GIL held in C code or a stopped job would
    try:
        # Only in the ring (the worker's round is 60 s away): read once the rank was quiet for 5 s.
        ok = collector.wait_for(lambda c: len(c.of_kind("collective")) == 10, 20)
        assert ok, (len(collector.of_kind("collective")), logs(spool_dir))
    finally:
        os.kill(p.pid, signal.SIGCONT)
    # Woken again and stopped cleanly, the rank spools the same records at exit: not sent twice.
    os.kill(p.pid, signal.SIGTERM)
    p.wait(20)
    assert collector.wait_for(lambda c: bool(c.of_kind("rank_exit")), 20), logs(spool_dir)
    assert wait_shippers_gone(spool_dir, 20)
    assert collective_seqs(collector) == list(range(1, 11))
    assert collector.duplicates == 0


def test_sigterm_flushes_and_reports_rank_exit_sigterm(collector, spool_dir, started) -> None:
    p = start(started, "sigterm", 50, child_env(collector.url, spool_dir, "termed"))
    wait_ready(p)
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(10) == -signal.SIGTERM  # the default action still happens after the flush
    assert collector.wait_for(lambda c: c.of_kind("rank_exit") and len(c.of_kind("heartbeat")) == 50, 20)
    assert [r["reason"] for r in collector.of_kind("rank_exit")] == ["sigterm"]


def test_sigterm_chains_to_the_scripts_own_handler_and_training_may_go_on(
    collector, spool_dir, started
) -> None:
    p = start(started, "sigterm_chain", 20, child_env(collector.url, spool_dir, "chained"))
    wait_ready(p)
    os.kill(p.pid, signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and "USER HANDLER" in out, err[-2000:]
    assert collector.wait_for(lambda c: c.of_kind("rank_exit") and len(c.of_kind("heartbeat")) == 21, 20)
    assert [r["reason"] for r in collector.of_kind("rank_exit")] == ["sigterm"]


def test_normal_exit_reports_rank_exit_finished_and_the_final_counts(collector, spool_dir, started) -> None:
    p = start(started, "exit", 30, child_env(collector.url, spool_dir, "finished"))
    assert p.wait(30) == 0
    assert collector.wait_for(lambda c: c.of_kind("rank_exit") and c.of_kind("agent_stats"), 20)
    assert [r["reason"] for r in collector.of_kind("rank_exit")] == ["finished"]
    stats = max(collector.of_kind("agent_stats"), key=lambda r: r["seq"])
    assert stats["emitted"] == 31 and stats["dropped"] == {}  # 30 heartbeats + rank_exit


def test_a_rank_ending_with_os_exit_reports_rank_exit_finished_and_loses_nothing(
    collector, spool_dir, started
) -> None:
    p = start(started, "os_exit", 30, child_env(collector.url, spool_dir, "os-exit"))
    assert p.wait(30) == 0
    assert collector.wait_for(lambda c: c.of_kind("rank_exit") and len(c.of_kind("heartbeat")) == 30, 20)
    assert [r["reason"] for r in collector.of_kind("rank_exit")] == ["finished"]


def test_an_uncaught_exception_becomes_a_fatal_rank_error_then_rank_exit_error(
    collector, spool_dir, started
) -> None:
    p = start(started, "raise", 3, child_env(collector.url, spool_dir, "raised"))
    assert p.wait(30) == 1
    assert collector.wait_for(lambda c: c.of_kind("rank_error") and c.of_kind("rank_exit"), 20)
    (err,) = collector.of_kind("rank_error")
    assert err["error_type"] == "ValueError" and err["fatal"] is True
    assert "loss is nan" in err["message"] and "Traceback" in err["stack"]
    assert [r["reason"] for r in collector.of_kind("rank_exit")] == ["error"]


@pytest.mark.slow
def test_collector_down_for_a_whole_two_rank_job_then_started_every_step_arrives_once(spool_dir) -> None:
    port = free_port()
    env = child_env(f"http://127.0.0.1:{port}", spool_dir, "down-job")
    del env["RANK"]
    try:
        results = run_ranks(CHILD, 2, args=["job", "40"], env=env, timeout_s=90)
        assert_all_ok(results)
        assert list(spool_dir.glob("*.seg")), "while the collector is down the records wait on disk"
        with FakeCollector(port) as collector:
            ok = collector.wait_for(
                lambda c: len(c.of_kind("step")) == 80 and len(c.of_kind("rank_exit")) == 2, 30
            )
            assert ok, len(collector.of_kind("step"))
            for rank in (0, 1):
                assert sorted(r["step"] for r in collector.of_kind("step") if r["rank"] == rank) == list(
                    range(40)
                )
            assert collector.duplicates == 0
            assert wait_shippers_gone(spool_dir, 20)
    finally:
        kill_shippers(spool_dir)


def test_memory_and_disk_stay_bounded_with_the_collector_down_and_drops_are_counted_exactly(
    spool_dir, started
) -> None:
    port = free_port()
    n = 200_000
    env = child_env(
        f"http://127.0.0.1:{port}", spool_dir, "flood", DDPSCOPE_SPOOL_MAX_MB="1", DDPSCOPE_QUEUE_SIZE="5000"
    )
    p = start(started, "flood", n, env)
    out, err = p.communicate(timeout=90)
    assert p.returncode == 0, err[-2000:]
    growth_kb = int(out.split("RSS_GROWTH_KB")[1].split()[0])
    # 200k records of ~150 bytes held in memory would be > 30 MB; the queue bound keeps it far below.
    assert growth_kb < 20_000, growth_kb
    on_disk = sum(f.stat().st_size for f in spool_dir.glob("*.seg"))
    assert on_disk <= 2 * 2**20 + 2**18, on_disk  # the writer's backstop (2x cap) plus one frame
    with FakeCollector(port) as collector:

        def delivered(c: FakeCollector) -> int:
            return len(c.of_kind("heartbeat")) + len(c.of_kind("rank_exit"))

        # Wait on the accounting itself: the shipper may not have taken its lock yet when the child exits.
        accounted = collector.wait_for(lambda c: delivered(c) + c.dropped_total() == n + 1, 60)
        assert wait_shippers_gone(spool_dir, 60)
        dropped = collector.dropped_total()
        assert dropped > 0, "a 1 MiB spool cannot hold 200k records: some must have been dropped"
        assert accounted, (delivered(collector), dropped)  # emitted = delivered + dropped (+ rank_exit)
        assert collector.duplicates == 0


@pytest.mark.slow
def test_dataloader_workers_under_fork_send_no_duplicates_and_do_not_deadlock(
    collector, spool_dir, started
) -> None:
    p = start(started, "dataloader", 0, child_env(collector.url, spool_dir, "loader"))
    out, err = p.communicate(timeout=90)
    assert p.returncode == 0 and "DONE" in out, err[-3000:]
    main_steps = [s for s in range(200) if s % 100 in range(0, 16, 4)]
    assert collector.wait_for(lambda c: c.of_kind("rank_exit") and len(c.of_kind("heartbeat")) >= 8 + 32, 30)
    assert wait_shippers_gone(spool_dir, 30)
    beats = collector.of_kind("heartbeat")
    parent = [r for r in beats if r["step"] < 1000]
    workers = [r for r in beats if r["step"] >= 1000]
    assert sorted(r["step"] for r in parent) == main_steps
    assert sorted(r["step"] for r in workers) == sorted(1000 + i for i in range(16) for _ in range(2))
    assert len({r["stream"] for r in parent}) == 1
    assert not {r["stream"] for r in parent} & {r["stream"] for r in workers}, (
        "a child never reuses the parent's stream"
    )
    assert collector.duplicates == 0
    assert len(collector.of_kind("rank_exit")) == 1, "forked workers do not report rank_exit"


def test_a_spool_left_by_a_dead_shipper_is_adopted_and_its_damage_counted(collector, spool_dir) -> None:
    import json

    from ddpscope import agent
    from ddpscope.agent import spool

    dead = subprocess.Popen(["true"])
    dead.wait()
    writer = spool.SpoolWriter(str(spool_dir), "r5-deadbeef", segment_bytes=1 << 20, hard_cap_bytes=1 << 30)
    for i in range(6):
        rec = {"kind": "heartbeat", "job": "orphan", "rank": 5, "stream": "deadbeef", "seq": i, "time_ns": i,
               "phase": "idle", "step": i, "last_coll_seq": 0, "pid": dead.pid}  # fmt: skip
        writer.append(spool.encode_batch([rec]))
    writer.close()
    (seg,) = spool_dir.glob("r5-deadbeef-*.seg")
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x01  # damage one frame in the middle
    seg.write_bytes(bytes(data))
    (spool_dir / "r5-deadbeef.meta").write_text(
        json.dumps({"job": "orphan", "rank": 5, "stream": "deadbeef", "pid": dead.pid})
    )
    a = agent.configure(job="orphan", rank=0, url=collector.url, spool_dir=str(spool_dir))
    agent.emit({"kind": "heartbeat", "phase": "idle", "step": 100, "last_coll_seq": 0, "pid": os.getpid()})
    assert a.force_flush(10.0)
    agent.shutdown(5.0)  # our shipper drains, then adopts what the dead one left behind
    assert collector.wait_for(lambda c: len(c.of_kind("heartbeat")) == 6, 20), logs(spool_dir)
    orphan_steps = sorted(r["step"] for r in collector.of_kind("heartbeat") if r["rank"] == 5)
    assert len(orphan_steps) == 5 and set(orphan_steps) < set(range(6))
    assert collector.wait_for(
        lambda c: any(r["dropped"].get("corrupt:unknown") == 1 for r in c.of_kind("agent_stats")), 10
    )
    assert wait_shippers_gone(spool_dir, 20)
    assert not list(spool_dir.glob("r5-deadbeef*.seg"))
