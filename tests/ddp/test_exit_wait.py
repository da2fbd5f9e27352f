"""A rank that finished its script but cannot exit (a non-daemon thread that never ends) is reported as
such, naming the thread, by the real watchdog in a real process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ddpscope.agent.exit_wait import at_exit, holders_phrase
from ddpscope.server.analysis.native_wait import joining_threads
from tests.support.procs import kill_group

SCRIPT = textwrap.dedent(
    """
    import threading, time
    from ddpscope import agent
    from ddpscope.ddp import watchdog
    from ddpscope.ddp.progress import PROGRESS

    agent.configure(exporter=agent.InMemoryExporter(), rank=3, hang_timeout_s=1.0, heartbeat_s=0.2)
    watchdog.start_watchdog()
    PROGRESS.enter("forward", 7)
    PROGRESS.enter("idle")  # step 7 done: training is over
    threading.Thread(target=time.sleep, args=(60,), name="metrics-pusher").start()
    threading.Thread(target=time.sleep, args=(60,), name="helper", daemon=True).start()
    print("script done", flush=True)
    """
)


def test_a_rank_held_at_exit_by_a_non_daemon_thread_says_so_and_names_that_thread(tmp_path: Path) -> None:
    script = tmp_path / "held.py"
    script.write_text(SCRIPT)
    out = run_until(script, "cannot exit")
    assert "script done" in out
    assert "rank 3 finished its script" in out and "cannot exit" in out, out
    assert "Python's shutdown for thread 'metrics-pusher'" in out and "helper" not in out, out


HANDLER = textwrap.dedent(
    """
    import atexit, time
    from ddpscope import agent
    from ddpscope.ddp import watchdog
    from ddpscope.ddp.progress import PROGRESS

    agent.configure(exporter=agent.InMemoryExporter(), rank=2, hang_timeout_s=1.0, heartbeat_s=0.2)
    watchdog.start_watchdog()
    PROGRESS.enter("forward", 7)
    PROGRESS.enter("idle")

    def upload_final_checkpoint():
        time.sleep(60)  # storage that never answers

    atexit.register(upload_final_checkpoint)
    print("script done", flush=True)
    """
)


def run_until(script: Path, text: str) -> str:
    """Run ``script`` until its output shows ``text`` (or 60 s), then kill its process group."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    out = ""
    try:
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while text not in out and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out += line
    finally:
        kill_group(proc)
        proc.wait(10)
    return out


def test_a_rank_held_at_exit_by_an_exit_handler_that_never_returns_says_so_with_its_line(
    tmp_path: Path,
) -> None:
    script = tmp_path / "handler.py"
    script.write_text(HANDLER)
    out = run_until(script, "cannot exit")
    assert "script done" in out
    assert "rank 2 finished its script" in out and "runs an exit handler that has not returned" in out, out
    assert "handler.py:13" in out, out


def test_a_main_thread_in_pythons_shutdown_is_told_from_its_innermost_frame() -> None:
    assert at_exit("_shutdown", "/usr/lib/python3.11/threading.py")
    assert not at_exit("_shutdown", "/proj/train.py") and not at_exit(
        "join", "/usr/lib/python3.11/threading.py"
    )
    stack = '  File "/proj/train.py", line 3, in <module>\n  File "/usr/lib/python3.11/threading.py", line 1590, in _shutdown\n    lock.acquire()\n'

    def report(main: str) -> dict[str, object]:
        return {"stacks": [{"thread": "MainThread", "stack": main}]}

    assert joining_threads(report(stack)) and not joining_threads(report(stack.replace("_shutdown", "wait")))
    assert holders_phrase([("a", "x.py:1"), ("b", None)]) == "thread 'a' (at x.py:1), thread 'b'"
