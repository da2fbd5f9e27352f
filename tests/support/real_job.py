"""A real multi-rank job streaming to a real collector, and what the collector says about it: the test
side of ``tests/server``'s real-job modules (each starts its ranks its own way and hands them here)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from tests.support.collector_proc import CollectorProc
from tests.support.procs import RankResult, exited_cleanly, kill_group, started_ranks


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


class RealJob:
    """The ranks of one job (``procs``, rank order) at the collector ``url``. ``wait_s``: deadline for one
    diagnosis to show up; ``exit_wait_s``: for the ranks to end. Killed by process group in ``logs``."""

    def __init__(
        self,
        url: str,
        job: str,
        procs: list[subprocess.Popen[str]],
        *,
        wait_s: float = 90.0,
        exit_wait_s: float = 240.0,
        engine: str = "ddpscope",
    ) -> None:
        self.url, self.job, self.procs, self.engine = url, job, procs, engine
        self.wait_s, self.exit_wait_s = wait_s, exit_wait_s
        self._stderr: dict[int, str] = {}

    def incidents(self) -> list[dict[str, Any]]:
        return list(get_json(f"{self.url}/api/v1/jobs/{self.job}/incidents")["items"])

    def status(self) -> str | None:
        jobs = get_json(f"{self.url}/api/v1/jobs")["items"]
        return next((j["status"] for j in jobs if j["job"] == self.job), None)

    def settled_status(self, wanted: str = "finished") -> str | None:
        """Poll the job's status until it is ``wanted`` or ``wait_s`` passes; the last status read."""
        deadline = time.monotonic() + self.wait_s
        while (status := self.status()) != wanted and time.monotonic() < deadline:
            time.sleep(0.5)
        return status

    def wait_for(self, what: str, found: Callable[[list[dict[str, Any]]], Any]) -> Any:
        """Poll the incidents until ``found(incidents)`` is truthy; fail with what was seen and the logs."""
        deadline = time.monotonic() + self.wait_s
        seen: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                seen = self.incidents()
                result = found(seen)
                if result:
                    return result
            time.sleep(0.5)
        raise AssertionError(f"{what} not diagnosed within {self.wait_s} s; incidents: {seen}\n{self.logs()}")

    def wait_exit(self) -> list[int | None]:
        deadline = time.monotonic() + self.exit_wait_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        return [p.poll() for p in self.procs]

    def exited_cleanly(self) -> bool:
        """Every rank exited 0, or with torch's known abort at interpreter exit (``procs.exited_cleanly``)."""
        codes = self.wait_exit()
        return all(
            code is not None and exited_cleanly(RankResult(rank, code, "", self.stderr(rank)))
            for rank, code in enumerate(codes)
        )

    def stderr(self, rank: int) -> str:
        """Rank ``rank``'s whole stderr, once it has ended (read once, then kept)."""
        if rank not in self._stderr:
            self._stderr[rank] = self.procs[rank].communicate(timeout=10)[1]
        return self._stderr[rank]

    def logs(self) -> str:
        out = ""
        for rank, p in enumerate(self.procs):
            kill_group(p)
            with contextlib.suppress(Exception):
                out += f"--- rank {rank} rc={p.returncode}\n{self.stderr(rank)[-2500:]}\n"
        return out


def marked_site(script: Path, name: str) -> str:
    """``file:line`` of the line of ``script`` marked ``# SITE:<name>`` (a rank script's call the diagnosis
    must name)."""
    for number, line in enumerate(script.read_text().splitlines(), start=1):
        if line.rstrip().endswith(f"# SITE:{name}"):
            return f"{script.name}:{number}"
    raise KeyError(name)


@contextlib.contextmanager
def jobs_at_one_collector(
    tmp: Path,
    script: Path,
    jobs: Iterable[tuple[str, str]],
    *,
    prefix: str,
    hang_timeout_s: float,
    wait_s: float,
    env: dict[str, str] | None = None,
) -> Iterator[dict[tuple[str, str], RealJob]]:
    """A real collector on a SQLite file in ``tmp`` and one 2-rank job per (scenario, engine) of ``jobs``
    (``python script scenario engine``), all started at once (their waits overlap), each with ``env`` added
    to its own; every rank's process group and the collector are killed when the block ends."""
    import uuid

    with contextlib.ExitStack() as stack:
        collector = stack.enter_context(
            CollectorProc(f"sqlite:///{tmp / 'ddpscope.db'}", log_path=tmp / "collector.log")
        )
        url = collector.start()
        started: dict[tuple[str, str], RealJob] = {}
        for scenario, engine in jobs:
            job_id = f"{prefix}-{scenario}-{engine}-{uuid.uuid4().hex[:6]}"
            job_env = {
                **(env or {}),
                "DDPSCOPE_URL": url,
                "DDPSCOPE_JOB": job_id,
                "DDPSCOPE_HANG_TIMEOUT": str(hang_timeout_s),
                "DDPSCOPE_HEARTBEAT_S": "0.5",
                "DDPSCOPE_SPOOL_DIR": str(tmp / job_id),
            }
            procs = stack.enter_context(started_ranks(script, 2, args=[scenario, engine], env=job_env))
            started[(scenario, engine)] = RealJob(url, job_id, procs, wait_s=wait_s)
        yield started
