"""Ranks forked from the zygote (``tests/support/preloaded.py``) must behave as exec'd ones: the same script
run both ways prints the same, exits the same and is signalled the same."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.preloaded import RankPopen, startup_env

SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys, time
    atexit.register(lambda: print("atexit", flush=True))
    print(__name__, sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)), flush=True)
    print(os.getppid(), os.getcwd(), os.environ.get("ONLY_HERE"), os.getpgid(0) == os.getpid(), flush=True)
    print(sorted(int(fd) for fd in os.listdir("/proc/self/fd"))[:3], flush=True)
    mode = sys.argv[1]
    if mode == "raise":
        raise ValueError("boom")
    if mode == "exit":
        sys.exit(3)
    if mode == "wait":
        print("waiting", flush=True)
        time.sleep(60)
    import torch
    print(float(torch.ones(3).sum()), flush=True)
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "rank_script.py"
    path.write_text(SCRIPT)
    return path


def _run(cls: type[subprocess.Popen], script: Path, mode: str, cwd: Path) -> tuple[int, str, str]:  # type: ignore[type-arg]
    env = dict(os.environ, ONLY_HERE=mode, OMP_NUM_THREADS="1")
    p = cls(
        [sys.executable, str(script), mode],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    return p.returncode, out, err


@pytest.mark.parametrize("mode", ["ok", "raise", "exit"])
def test_a_forked_rank_prints_and_exits_as_an_exec_d_one(script: Path, tmp_path: Path, mode: str) -> None:
    forked = _run(RankPopen, script, mode, tmp_path)
    execd = _run(subprocess.Popen, script, mode, tmp_path)
    assert forked[:2] == execd[:2], (forked, execd)
    assert forked[2].splitlines()[-1:] == execd[2].splitlines()[-1:]  # the exception's last line, if any
    assert str(os.getpid()) in forked[1]  # its parent is this process, as an exec'd rank's


def test_a_forked_rank_is_its_own_process_group_and_dies_of_the_signal_sent_to_it(script: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = RankPopen(
        [sys.executable, str(script), "wait"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert p.stdout is not None
        deadline = time.monotonic() + 60
        while "waiting" not in p.stdout.readline() and time.monotonic() < deadline:
            pass
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(timeout=30) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def test_a_launch_that_differs_in_a_start_up_variable_gets_its_own_zygote() -> None:
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "DDPSCOPE_URL": "a"}
    assert startup_env(base) == startup_env({**base, "DDPSCOPE_URL": "b", "RANK": "1"})
    assert startup_env(base) != startup_env({**base, "OMP_NUM_THREADS": "2"})
    assert startup_env(base) != startup_env({**base, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
