"""``make test``: the whole suite, as the streams of ``tests/streams.py``.

    python -m tests.run_suite [pytest options...]

The heavy and light streams run at once, each its own pytest process in its own session (its own zygote,
subreaper and temporary directory); the solo stream runs after both. The heavy stream writes to the
terminal as it goes, the light one to a log printed when the heavy one is done; a summary ends the output.
The exit status is non-zero when any stream fails (pytest's "no tests collected" is not a failure: a filter
given here may leave a stream empty). Every stream is killed, by process group, if the suite outlives
``DEADLINE_S`` or is interrupted.

This process is a child subreaper: what a stream leaves behind (ranks and collectors its tests started in
sessions of their own, orphaned when a killed stream skips the tests' teardown, or leaked by a test) comes
to it, and is killed by pid once every stream has ended; the summary names what was.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tests.streams import ENV, Stream
from tests.support.preloaded import become_subreaper

DEADLINE_S = 45 * 60.0
"""The whole suite's deadline; CI allows 90 minutes."""
NO_TESTS = 5
"""pytest's exit status when a selection leaves no test."""
LEFTOVER_GRACE_S = 5.0
"""How long what a stream left behind may take to exit on its own (a collector shutting down) before it is killed."""


@dataclass
class Run:
    stream: Stream
    proc: subprocess.Popen[bytes]
    log: Path
    copier: threading.Thread
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    @property
    def ok(self) -> bool:
        return self.proc.returncode in (0, NO_TESTS)

    def summary(self) -> str:
        took = (self.ended or time.monotonic()) - self.started
        tail = _last_line(self.log) if self.log.exists() else ""
        verdict = "ok" if self.ok else f"FAILED (exit {self.proc.returncode})"
        return f"{self.stream:>5}: {verdict} in {took:.0f} s{f' ({tail})' if tail else ''}"


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip("= ") if lines else ""


def start(stream: Stream, args: list[str], *, live: bool, work: Path) -> Run:
    """Start one stream's pytest; its output goes to a log and, when ``live``, to the terminal as well."""
    log = work / f"{stream}.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--basetemp={work / stream}",
            *args,
        ],
        env={**os.environ, ENV: stream},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # Killed as a group. The ranks and collectors its tests start live in sessions of their own: the
        # tests' teardown ends them, and what a SIGKILL of the stream orphans comes here (end_leftovers).
        start_new_session=True,
    )
    assert proc.stdout is not None
    copier = threading.Thread(
        target=_copy, args=(proc.stdout, log, live), name=f"{stream}-output", daemon=True
    )
    copier.start()
    return Run(stream, proc, log, copier)


def _copy(source: IO[bytes], log: Path, live: bool) -> None:
    """Copy a stream's output to its log (and the terminal) as it comes: pytest's progress has no newlines."""
    with open(log, "wb") as out:
        while chunk := os.read(source.fileno(), 65536):
            out.write(chunk)
            out.flush()
            if live:
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()


def wait(runs: list[Run], deadline: float) -> None:
    """Wait for every run; kill them all at ``deadline``."""
    while any(r.proc.poll() is None for r in runs):
        for r in runs:
            if r.ended is None and r.proc.poll() is not None:
                r.ended = time.monotonic()
        if time.monotonic() > deadline:
            print(f"\nrun_suite: the suite outlived its {DEADLINE_S:.0f} s deadline: killing it", flush=True)
            kill(runs)
            return
        time.sleep(0.2)
    for r in runs:
        r.ended = r.ended or time.monotonic()
        r.copier.join(10.0)  # the rest of its output: the pipe ends with the process group's last writer


def kill(runs: list[Run]) -> None:
    for r in runs:
        if r.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait()
        r.ended = r.ended or time.monotonic()


def _children() -> dict[int, str]:
    """This process's children, pid -> command line: the orphans re-parented here, once the streams are reaped."""
    me, found = os.getpid(), {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == me:
                cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found[int(entry.name)] = cmd.strip()[:160]
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return found


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def end_leftovers(grace_s: float = LEFTOVER_GRACE_S) -> dict[int, str]:
    """Kill, by pid, what the streams left behind (call once every stream is reaped: this reaps any child).
    Waits ``grace_s`` for it to exit on its own first. Returns what had to be killed."""
    grace_end = time.monotonic() + grace_s
    while (left := _children()) and time.monotonic() < grace_end:
        _reap()
        time.sleep(0.2)
    killed: dict[int, str] = {}
    give_up = time.monotonic() + 10.0
    while left and time.monotonic() < give_up:
        for pid, cmd in left.items():
            killed.setdefault(pid, cmd)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        _reap()  # their own children come here as they die, and are killed in the next round
        left = _children()
    return killed


def show(run: Run) -> None:
    print(f"\n===== the {run.stream} stream =====", flush=True)
    sys.stdout.write(run.log.read_text(errors="replace"))
    sys.stdout.flush()


def main(args: list[str]) -> int:
    deadline = time.monotonic() + DEADLINE_S
    become_subreaper()
    work = Path(tempfile.mkdtemp(prefix="ddpscope-suite-"))
    runs: list[Run] = []
    try:
        print(
            "run_suite: the heavy and light streams at once (tests/streams.py), then the solo one", flush=True
        )
        print("\n===== the heavy stream =====", flush=True)
        light = start("light", args, live=False, work=work)
        heavy = start("heavy", args, live=True, work=work)
        runs += [light, heavy]
        wait([light, heavy], deadline)
        show(light)
        print("\n===== the solo stream =====", flush=True)
        solo = start("solo", args, live=True, work=work)
        runs.append(solo)
        wait([solo], deadline)
    except BaseException:
        kill(runs)
        end_leftovers()
        raise
    killed = end_leftovers()
    print("\n" + "\n".join(r.summary() for r in runs), flush=True)
    if killed:
        print(f"run_suite: killed what the streams left behind ({len(killed)}):", flush=True)
        for pid, cmd in sorted(killed.items()):
            print(f"  {pid}: {cmd}", flush=True)
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
