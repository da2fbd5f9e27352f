"""`ddpscope demo`: real multi-process gloo DDP jobs that show each failure ddpscope diagnoses.

Starts a collector on SQLite when none answers at --url, runs one job per scenario (each rank a plain
process in its own session, stopped by pid on its deadline: SIGTERM, then SIGKILL), prints what the
collector found (rank, bucket, parameter, line) and the dashboard URLs, then keeps serving until Ctrl-C
unless --exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ddpscope.cli.client import Client, CollectorError
from ddpscope.cli.report import safe, sampled_words, stopped_step

SCENARIOS = ("healthy", "straggler", "unused", "mismatch", "diverged", "nan", "crash", "hang")

DESCRIPTIONS = {
    "healthy": "a healthy job: no incident expected",
    "straggler": "the last rank computes 50% slower from step 6",
    "unused": "the last rank stops using a layer at step 6 (find_unused_parameters=False)",
    "mismatch": "the last rank issues two same-shape all-reduces in the opposite order",
    "diverged": "the last rank loads a checkpoint after wrapping at step 6 (if rank == ...: load_state_dict)",
    "nan": "the last rank's batch holds a NaN at step 6 (a corrupt sample)",
    "crash": "the last rank is SIGKILLed at step 6",
    "hang": "the last rank stops before forward at step 6 (a stuck data loader)",
}

HANG_TIMEOUT_S = 3.0
"""The demo's watchdog timeout; production defaults to 300 s (DDPSCOPE_HANG_TIMEOUT)."""


@dataclass
class ScenarioRun:
    scenario: str
    job: str
    returncodes: list[int | None]
    elapsed_s: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


@contextlib.contextmanager
def collector(client: Client, db: str) -> Iterator[subprocess.Popen[bytes] | None]:
    """Use the collector at client.url if one answers, else start one there on SQLite."""
    if client.healthy():
        yield None
        return
    port = client.url.rsplit(":", 1)[-1].split("/")[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpscope.cli.main", "serve", "--port", port, "--db", db],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not client.healthy():
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise CollectorError(f"the demo collector did not start on {client.url}:\n{err[-2000:]}")
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(proc)


def _has_incident(client: Client, job: str, kinds: set[str]) -> bool:
    with contextlib.suppress(CollectorError):
        return any(i.get("kind") in kinds for i in client.items(client.job_path(job, "incidents")))
    return False


def run_scenario(client: Client, scenario: str, ranks: int, steps: int, deadline_s: float) -> ScenarioRun:
    job = f"demo-{scenario}-{uuid.uuid4().hex[:6]}"
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    env_base = dict(os.environ)
    env_base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(ranks),
        OMP_NUM_THREADS="1",
        DDPSCOPE_URL=client.url,
        DDPSCOPE_JOB=job,
        DDPSCOPE_HANG_TIMEOUT=str(HANG_TIMEOUT_S),
        DDPSCOPE_HEARTBEAT_S="1",
    )
    if client.token:
        env_base["DDPSCOPE_TOKEN"] = client.token
    try:
        for rank in range(ranks):
            env = dict(env_base, RANK=str(rank), LOCAL_RANK=str(rank))
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "ddpscope.cli.scenario_job",
                        "--scenario",
                        scenario,
                        "--steps",
                        str(steps),
                    ],
                    env=env,
                    start_new_session=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = started + deadline_s
        # A live line on a terminal; in a log (CI, a pipe) only a start and an end line per scenario.
        live = sys.stdout.isatty()
        if not live:
            print(f"  {scenario:<10} running ({ranks} ranks)", flush=True)
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            elapsed = time.monotonic() - started
            alive = sum(p.poll() is None for p in procs)
            if live:
                print(
                    f"\r  {scenario:<10} {elapsed:5.1f} s  ranks running: {alive}/{ranks}  "
                    f"steps recorded: {_steps_seen(client, job)}   ",
                    end="",
                    flush=True,
                )
            # A hung job never ends by itself: stop it once the collector has diagnosed it.
            if scenario == "hang" and elapsed > HANG_TIMEOUT_S and _has_incident(client, job, {"hang"}):
                time.sleep(1.0)  # let the other ranks' reports land too
                break
            time.sleep(0.5)
    finally:
        _stop(procs)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
    elapsed = time.monotonic() - started
    codes = ", ".join(f"rank {r}: {_describe_exit(p.returncode)}" for r, p in enumerate(procs))
    print(f"\r  {scenario:<10} {elapsed:5.1f} s  done ({codes})" + " " * 20, flush=True)
    return ScenarioRun(scenario, job, [p.returncode for p in procs], elapsed)


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """Stop the ranks still running as a launcher does: SIGTERM, then SIGKILL after a grace period.

    A SIGTERMed rank tells the collector it was stopped (``rank_exit`` 'sigterm'), even one blocked inside
    a collective (``agent/sigterm_watcher``), so a hung job stopped here reads as stopped, not as ranks
    that fell silent next to the real culprit.
    """
    running = [p for p in procs if p.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            _kill_group(p)


def _steps_seen(client: Client, job: str) -> int:
    with contextlib.suppress(CollectorError):
        for j in client.items("/api/v1/jobs"):
            if j["job"] == job:
                return int(j.get("steps") or 0)
    return 0


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


def summarize(client: Client, run: ScenarioRun) -> list[str]:
    """One short paragraph per scenario: what the collector found, from its API."""
    job = run.job
    lines = [f"{run.scenario}: {DESCRIPTIONS[run.scenario]}  (job {job})"]
    try:
        # Give crash-durable records from killed ranks a moment to be shipped and analysed.
        incidents = client.items(client.job_path(job, "incidents"))
        stragglers = [s for s in client.items(client.job_path(job, "stragglers")) if s.get("flagged", True)]
        status = next((j.get("status") for j in client.items("/api/v1/jobs") if j["job"] == job), "?")
    except CollectorError as e:
        return lines + [f"  could not read the diagnosis: {e}"]
    lines.append(f"  status: {status}")
    for s in stragglers:
        phase = f" (mostly {s['phase'].replace('_', ' ')})" if s.get("phase") else ""
        if sampled := s.get("sampled"):  # a run long enough for its watchdog's samples (--steps)
            phase += sampled_words(sampled)
        lines.append(f"  straggler: rank {s['rank']} is {s['slowdown']:.2f}x slower than the others{phase}")
        if s.get("contention"):
            lines.append(f"      but {safe(s['contention'])}")
    for inc in incidents:
        lines.append(f"  [{safe(inc.get('kind'))}] {safe(inc.get('message'))}")
        if inc.get("call_site"):
            lines.append(f"      at {safe(inc['call_site'])}")
    if not incidents and not stragglers:
        lines.append("  nothing wrong found")
    if status in ("hung", "failed") and (stopped := stopped_step(client, job)):
        where = "; ".join(line for line, _ in stopped.ranks)
        lines.append(
            f"  step {stopped.step}, where it stopped: {where}: {client.url}/jobs/{job}/steps/{stopped.step}"
        )
    lines.append(f"  dashboard: {client.url}/jobs/{job}")
    return lines


def main(client: Client, scenario: str, ranks: int, steps: int, exit_after: bool, db: str) -> int:
    scenarios = SCENARIOS if scenario == "all" else (scenario,)
    try:
        with collector(client, db) as proc:
            origin = "started on " + db if proc else "already running"
            print(f"ddpscope demo: collector at {client.url} ({origin})")
            print(f"running {len(scenarios)} scenario(s), {ranks} ranks each, gloo on the CPU")
            runs = [run_scenario(client, s, ranks, steps, deadline_s=60.0 + steps * 2.0) for s in scenarios]
            time.sleep(2.0)  # the shippers of killed ranks deliver their last records
            print()
            for run in runs:
                print("\n".join(summarize(client, run)))
                print()
            print(f"dashboard: {client.url}/")
            if exit_after or proc is None:
                return 0
            print("serving the dashboard; press Ctrl-C to stop")
            with contextlib.suppress(KeyboardInterrupt):
                while proc.poll() is None:
                    time.sleep(1.0)
            return 0
    except CollectorError as e:
        print(f"ddpscope demo: {e}", file=sys.stderr)
        return 3


def default_db() -> str:
    return f"sqlite:///{Path.cwd() / 'ddpscope-demo.db'}"
