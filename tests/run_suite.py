"""``make test``: the whole suite, as the streams of ``tests/streams.py``.

    python -m tests.run_suite [pytest options...]

The heavy and light streams run at once, each its own pytest process in its own session (its own zygote,
subreaper and temporary directory); the solo stream runs after both. The heavy stream writes to the
terminal as it goes, the light one to a log printed when the heavy one is done; a summary ends the output.
The exit status is non-zero when any stream fails (pytest's "no tests collected" is not a failure: a filter
given here may leave a stream empty). Every stream is killed, by process group, if the suite outlives
``DEADLINE_S`` or is interrupted.
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

DEADLINE_S = 45 * 60.0
"""The whole suite's deadline; CI allows 90 minutes."""
NO_TESTS = 5
"""pytest's exit status when a selection leaves no test."""


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
        # tests' teardown ends them, which a SIGKILL of the stream skips.
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


def show(run: Run) -> None:
    print(f"\n===== the {run.stream} stream =====", flush=True)
    sys.stdout.write(run.log.read_text(errors="replace"))
    sys.stdout.flush()


def main(args: list[str]) -> int:
    deadline = time.monotonic() + DEADLINE_S
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
        raise
    print("\n" + "\n".join(r.summary() for r in runs), flush=True)
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
