"""Test-side helpers: run a failure job on real gloo ranks with a deadline and read its records."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpscope.agent.records import validate_record
from tests.support.procs import RankResult, describe, run_ranks

JOBS = Path(__file__).parent
COLLECTIVE_JOB = JOBS / "collective_job.py"


@dataclass
class JobRun:
    results: list[RankResult]
    records: dict[int, list[dict[str, Any]]]

    def of(self, rank: int, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records[rank] if r["kind"] == kind]

    def output(self) -> str:
        return describe(self.results)


def run_job(
    scenario: str,
    out_dir: Path,
    *,
    world_size: int = 2,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 90.0,
) -> JobRun:
    """Run ``collective_job.py scenario`` and return every rank's result and (validated) records."""
    results = run_ranks(
        COLLECTIVE_JOB, world_size, args=[scenario, str(out_dir)], env=dict(env or {}), timeout_s=timeout_s
    )
    return JobRun(results, read_records(out_dir, world_size))


def read_records(out_dir: Path, world_size: int) -> dict[int, list[dict[str, Any]]]:
    """Every rank's records from ``out_dir/rank<R>.jsonl`` (written by ``_capture``), validated."""
    records: dict[int, list[dict[str, Any]]] = {}
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        # A rank killed mid-write may leave a torn last line; everything before it is whole.
        parsed = []
        for line in lines:
            try:
                parsed.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        for record in parsed:
            validate_record(record)
        records[rank] = parsed
    return records


def site(name: str, script: Path = COLLECTIVE_JOB) -> str:
    """``file:line`` suffix of the line marked ``# SITE:<name>`` in a job script."""
    for number, line in enumerate(script.read_text().splitlines(), start=1):
        if re.search(rf"# SITE:{re.escape(name)}\b", line):
            return f"{script.name}:{number}"
    raise KeyError(name)
