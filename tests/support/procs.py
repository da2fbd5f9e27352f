"""Start real multi-process jobs with a deadline, and kill exactly what was started.

Every rank is a plain subprocess in its own session (torch.multiprocessing.spawn would SIGTERM the
survivors as soon as one rank dies and hide their errors). On the deadline or on exit the whole
process group of each rank is killed by pid, never by name.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.preloaded import RankPopen

REPO = Path(__file__).resolve().parents[2]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, for a rank's store or a collector to bind later.

    Chosen below the kernel's ephemeral range: a port from ``bind(0)`` lies in that range, where every
    outgoing connection (gloo's pairs, HTTP clients, other jobs' stores) takes its source port, so it
    could be taken between this check and the rank's own bind (EADDRINUSE in torch's TCPStore, seen with
    15 two-rank jobs started at once). Never the same port twice in one test process."""
    high = _ephemeral_low()
    low = max(1024, high - 12_000)
    for _ in range(200):
        port = random.randrange(low, high)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    with socket.socket() as s:  # a crowded range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (exited, not yet reaped: gone for us)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    return False


def until_asleep(native_id: int | None, timeout_s: float = 5.0) -> None:
    """Wait until thread ``native_id`` of this process sleeps in the kernel (state S in /proc): blocked in a
    system call, not on its way there or waiting for a core."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "S":
                return
        time.sleep(0.02)


def kill_group(proc: subprocess.Popen[bytes] | subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def rank_env(rank: int, world_size: int, port: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # Job scripts import test helpers (tests.support.job_end) from the repository.
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    )
    env.update(extra or {})
    return env


@contextlib.contextmanager
def started_ranks(
    script: str | Path,
    world_size: int,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    per_rank_env: Mapping[int, Mapping[str, str]] | None = None,
) -> Iterator[list[subprocess.Popen[str]]]:
    """Start ``python script args`` once per rank (forked from a zygote that has imported torch, when that
    changes nothing the rank does: ``tests/support/preloaded.py``); kill every process group on exit."""
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(world_size):
            e = rank_env(rank, world_size, port, env)
            e.update((per_rank_env or {}).get(rank, {}))
            procs.append(
                RankPopen(
                    [sys.executable, str(script), *args],
                    env=e,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p)
        for p in procs:
            with contextlib.suppress(Exception):
                p.communicate(timeout=10)


def wait_all(procs: Sequence[subprocess.Popen[str]], timeout_s: float) -> list[RankResult]:
    """Wait for every rank until the deadline; a rank still running then is killed (returncode None)."""
    deadline = time.monotonic() + timeout_s
    results: list[RankResult] = []
    for rank, p in enumerate(procs):
        remaining = max(0.1, deadline - time.monotonic())
        try:
            out, err = p.communicate(timeout=remaining)
            results.append(RankResult(rank, p.returncode, out, err))
        except subprocess.TimeoutExpired:
            kill_group(p)
            out, err = p.communicate(timeout=10)
            results.append(RankResult(rank, None, out, err))
    return results


def run_ranks(
    script: str | Path,
    world_size: int,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
) -> list[RankResult]:
    """Run a job to completion (or the deadline) and return each rank's exit code and output."""
    with started_ranks(script, world_size, args=args, env=env) as procs:
        return wait_all(procs, timeout_s)


def exited_cleanly(r: RankResult) -> bool:
    """Exit 0, or torch's known SIGABRT at interpreter exit after the work finished (TORCH-FACTS:
    "terminate called without an active exception", no Python error): not a training failure. The
    caller still checks what the rank wrote."""
    if r.returncode == 0:
        return True
    return (
        r.returncode == -signal.SIGABRT
        and r.stderr.strip().endswith("terminate called without an active exception")
        and "Traceback" not in r.stderr
    )


def describe(results: Sequence[RankResult], tail: int = 3000) -> str:
    """Each rank's exit code and the end of its stderr, then one line per rank with its exit code and
    the last line it wrote: when a report is cut to its end (a CI log keeps the tail), every rank's
    fate is still in it, not only the last rank's traceback."""
    blocks = [f"--- rank {r.rank} rc={r.returncode}\n{r.stderr[-tail:]}" for r in results]
    fates = [f"rank {r.rank} rc={r.returncode}: {_last_line(r.stderr)}" for r in results]
    return "\n".join([*blocks, "--- how each rank ended", *fates])


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "(no stderr)"


def assert_all_ok(results: Sequence[RankResult]) -> None:
    bad = [r for r in results if not exited_cleanly(r)]
    if bad:
        raise AssertionError(f"{len(bad)} rank(s) failed:\n{describe(results)}")
