"""SIGTERM ends a rank as it would without ddpscope, also while its main thread waits inside a real gloo
collective (where Python cannot run the agent's handler), and its rank_exit still arrives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpscope.agent import lifecycle, sigterm_watcher
from tests.agent.conftest import spooled
from tests.agent.fake_collector import FakeCollector
from tests.support.agent_env import agent_env
from tests.support.procs import free_port, started_ranks

CHILD = Path(__file__).with_name("sigterm_child.py")
pytestmark = pytest.mark.timeout(120)

DEADLINE_S = sigterm_watcher.GRACE_S + lifecycle.EXIT_FLUSH_S + 2.0
"""The promise: the grace the main thread gets, the bounded drain, and slack for a loaded machine."""
IN_COLLECTIVE_S = 1.5
"""Time for rank 0 to get from printing READY into the all-reduce's wait."""


def read_line(p: subprocess.Popen[str]) -> str:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line and p.poll() is not None and p.stderr is not None:
        pytest.fail(f"the child exited with {p.returncode}: {p.stderr.read()[-3000:]}")
    return line.strip()


def terminate(p: subprocess.Popen[str], signals: int = 1) -> float:
    """SIGTERM ``p`` (``signals`` times, 50 ms apart) and return how long it took to die; fails the
    test past ``DEADLINE_S``."""
    t0 = time.monotonic()
    for i in range(signals):
        if i:
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
    try:
        p.wait(DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the process ignored SIGTERM for {DEADLINE_S} s")
    return time.monotonic() - t0


def term_blocked_rank(env: dict[str, str]) -> tuple[int | None, float, str]:
    """Start the 2-rank job and SIGTERM rank 0 inside its all-reduce: (returncode, seconds to die,
    its output). Rank 1 never joins and is checked to be still running afterwards, so the collective
    cannot have ended by itself."""
    del env["RANK"]
    with started_ranks(CHILD, 2, args=["blocked", "20"], env=env) as (rank0, rank1):
        assert read_line(rank0) == "READY"
        assert read_line(rank1) == "READY"
        time.sleep(IN_COLLECTIVE_S)
        assert rank0.poll() is None
        took = terminate(rank0)
        assert rank1.poll() is None, "rank 1 must still be away from the collective"
        out, err = rank0.communicate(timeout=10)
        return rank0.returncode, took, out + err


def start(started: list[subprocess.Popen[str]], mode: str, env: dict[str, str]) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, str(CHILD), mode, "10"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    started.append(p)
    return p


def test_without_ddpscope_sigterm_ends_a_rank_blocked_in_a_gloo_all_reduce_at_once(tmp_path: Path) -> None:
    # The baseline the agent must match.
    env = agent_env("http://127.0.0.1:9", tmp_path, "baseline", DDPSCOPE_DISABLED="1")
    code, took, output = term_blocked_rank(env)
    assert code == -signal.SIGTERM and took < 2.0, output[-3000:]


def test_sigterm_ends_a_rank_blocked_in_a_gloo_all_reduce_and_its_rank_exit_reaches_the_collector(
    collector: FakeCollector, spool_dir: Path
) -> None:
    code, took, output = term_blocked_rank(agent_env(collector.url, spool_dir, "blocked"))
    assert code == -signal.SIGTERM, output[-3000:]
    assert "ALL_REDUCE RETURNED" not in output
    # The main thread never ran Python again: the watcher acted once its grace was over.
    assert took >= sigterm_watcher.GRACE_S * 0.9
    assert collector.wait_for(lambda c: any(r["rank"] == 0 for r in c.of_kind("rank_exit")), 20), output
    assert [r["reason"] for r in collector.of_kind("rank_exit") if r["rank"] == 0] == ["sigterm"]
    assert sorted(r["step"] for r in collector.of_kind("heartbeat") if r["rank"] == 0) == list(range(20))
    assert collector.duplicates == 0


def test_a_blocked_ranks_rank_exit_is_in_its_spool_when_it_dies_with_the_collector_down(
    spool_dir: Path,
) -> None:
    code, _, output = term_blocked_rank(agent_env(f"http://127.0.0.1:{free_port()}", spool_dir, "offline"))
    assert code == -signal.SIGTERM, output[-3000:]
    exits = [r for r in spooled(spool_dir) if r["kind"] == "rank_exit"]
    assert [(r["rank"], r["reason"]) for r in exits] == [(0, "sigterm")]


def test_a_scripts_own_sigterm_handler_still_decides_while_the_main_thread_is_blocked(
    collector: FakeCollector, spool_dir: Path
) -> None:
    # Without ddpscope the script's handler cannot run either and the rank waits on: ddpscope does
    # not turn a SIGTERM the script handles into a kill (documented in sigterm_watcher).
    env = agent_env(collector.url, spool_dir, "handler")
    del env["RANK"]
    with started_ranks(CHILD, 2, args=["blocked_handler", "5"], env=env) as (rank0, rank1):
        assert read_line(rank0) == "READY"
        assert read_line(rank1) == "READY"
        time.sleep(IN_COLLECTIVE_S)
        rank0.send_signal(signal.SIGTERM)
        time.sleep(sigterm_watcher.GRACE_S + 1.5)
        assert rank0.poll() is None and rank1.poll() is None
    assert not collector.of_kind("rank_exit")


@pytest.mark.parametrize("signals", [1, 2], ids=["one-sigterm", "two-sigterms"])
def test_a_free_main_thread_handles_sigterm_itself_and_rank_exit_is_reported_once(
    collector: FakeCollector, spool_dir: Path, started: list[subprocess.Popen[str]], signals: int
) -> None:
    # The watcher hears the same signal: exactly one of the two flushes, and a second SIGTERM during
    # the flush does not cut it short.
    p = start(started, "free", agent_env(collector.url, spool_dir, "free"))
    assert "ddpscope-sigterm" in read_line(p)
    assert read_line(p) == "READY"
    took = terminate(p, signals)
    assert p.returncode == -signal.SIGTERM
    # The watcher waits GRACE_S before it acts; the main thread's handler takes 30-120 ms here.
    assert took < sigterm_watcher.GRACE_S, "the main thread's handler did not run"
    assert collector.wait_for(lambda c: c.of_kind("rank_exit") and len(c.of_kind("heartbeat")) == 10, 20)
    assert [r["reason"] for r in collector.of_kind("rank_exit")] == ["sigterm"]
    assert collector.duplicates == 0


def test_a_sigterm_the_script_ignores_stays_ignored_and_the_agent_keeps_reporting(
    collector: FakeCollector, spool_dir: Path, started: list[subprocess.Popen[str]]
) -> None:
    p = start(started, "ignored", agent_env(collector.url, spool_dir, "ignored"))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-3000:]
    assert "STILL_IGNORED True" in out
    assert collector.wait_for(lambda c: c.of_kind("rank_exit") and len(c.of_kind("heartbeat")) == 11, 20)
    assert [r["reason"] for r in collector.of_kind("rank_exit")] == ["finished"]


def test_sigterm_to_a_forked_child_never_ends_its_parent(
    collector: FakeCollector, spool_dir: Path, started: list[subprocess.Popen[str]]
) -> None:
    # The child inherits the parent's wakeup pipe; a byte written there by the child's signal handler
    # would look like the parent's own SIGTERM, unhandled by its main thread, and end the parent.
    p = start(started, "fork", agent_env(collector.url, spool_dir, "forked"))
    line = read_line(p)
    assert line.startswith("CHILD "), line
    time.sleep(0.3)
    os.kill(int(line.split()[1]), signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err[-3000:]
    assert f"CHILD_STATUS {-signal.SIGTERM}" in out
    assert collector.wait_for(lambda c: c.of_kind("rank_exit"), 20)
    assert [r["reason"] for r in collector.of_kind("rank_exit")] == ["finished"]


def test_asyncios_signal_wakeup_fd_is_left_alone_and_sigterm_still_flushes(
    collector: FakeCollector, spool_dir: Path, started: list[subprocess.Popen[str]]
) -> None:
    p = start(started, "asyncio", agent_env(collector.url, spool_dir, "asyncio"))
    assert read_line(p) == "ASYNCIO OK"
    assert "ddpscope-sigterm" not in read_line(p), "the fd is asyncio's: no watcher"
    assert read_line(p) == "READY"
    terminate(p)
    assert p.returncode == -signal.SIGTERM
    assert collector.wait_for(lambda c: c.of_kind("rank_exit"), 20)
    assert [r["reason"] for r in collector.of_kind("rank_exit")] == ["sigterm"]


@pytest.mark.parametrize("disabled", [False, True], ids=["enabled", "disabled"])
def test_the_watcher_takes_the_wakeup_fd_only_when_the_agent_is_enabled(
    spool_dir: Path, started: list[subprocess.Popen[str]], disabled: bool
) -> None:
    env = agent_env(f"http://127.0.0.1:{free_port()}", spool_dir, "probe")
    if disabled:
        env["DDPSCOPE_DISABLED"] = "1"
    p = start(started, "probe", env)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-3000:]
    fd = int(out.split("WAKEUP_FD")[1].split()[0])
    assert (fd == -1) is disabled
    assert ("ddpscope-sigterm" in out) is not disabled
