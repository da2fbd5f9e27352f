"""Run the engine's test jobs (tests/ddp/jobs/) and load what each rank wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.procs import assert_all_ok, run_ranks

JOBS = Path(__file__).parent / "jobs"


def run_job(
    script: str, world_size: int, args: list[str], outdir: Path, timeout_s: float = 150
) -> list[dict[str, Any]]:
    """Run a job to completion (every rank must exit 0) and return each rank's JSON output."""
    outdir.mkdir(parents=True, exist_ok=True)
    results = run_ranks(JOBS / script, world_size, args=[*args, str(outdir)], timeout_s=timeout_s)
    assert_all_ok(results)
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(world_size)]
