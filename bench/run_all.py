"""Run every benchmark (what ``make bench`` runs) and print one markdown table for the README.

    .venv/bin/python -m bench.run_all [--quick] [--only engine,scale] [--table-only]

Each benchmark runs as ``python -m bench.<name> [--quick]`` in its own session with a deadline (its
process group is killed by pid when the deadline passes). Afterwards every ``bench/results/<name>.json``
is collected into ``bench/results/all.json`` with the machine, the load average before and after,
each benchmark's exit status, and the table rows. A result file not written by this run (older than
it, or its benchmark failed here) is still published, but marked stale.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, ROOT, machine, machine_line
from bench.table import Row, markdown, rows_for

logger = logging.getLogger(__name__)

# name -> (deadline quick, deadline full), seconds. Order: cheap and central first.
BENCHMARKS: dict[str, tuple[float, float]] = {
    "engine": (300, 1800),
    "end_to_end": (300, 3600),
    "adapter": (360, 1500),
    "debug_aids": (240, 1800),
    "watchdog": (180, 900),
    "replicas": (120, 600),
    "agent": (180, 900),
    "cost_accounting": (240, 900),
    "cost_accounting_instrument": (240, 900),
    "hang_latency": (150, 600),
    "collector": (360, 1800),
    "scale": (240, 1800),
    "dashboard": (240, 600),
}
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "cost_accounting_instrument": ("cost_accounting", ["--instrument"])
}
"""Benchmarks that are another module run with extra arguments (each writes ``<name>.json``)."""


def run_one(name: str, quick: bool, deadline_s: float) -> dict[str, Any]:
    """Run one benchmark to completion or its deadline; its output goes straight to ours."""
    module, extra = VARIANTS.get(name, (name, []))
    cmd = [sys.executable, "-m", f"bench.{module}", *extra] + (["--quick"] if quick else [])
    print(f"\n=== {' '.join(cmd[2:])} (deadline {deadline_s:.0f} s)", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    status = "ok"
    try:
        proc.wait(timeout=deadline_s)
        if proc.returncode != 0:
            status = f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        status = f"killed at the {deadline_s:.0f} s deadline"
        # SIGINT first: the benchmark's ranks and collectors run in sessions of their own, which only
        # its own cleanup (finally blocks, context managers) kills; SIGKILL if it does not exit.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"status": status, "wall_s": round(time.monotonic() - started, 1)}


def collect(
    names: list[str], runs: dict[str, dict[str, Any]], since: float, results_dir: Path = RESULTS_DIR
) -> tuple[dict[str, Any], list[Row]]:
    """Read each benchmark's result file; stale files (older than ``since``) are kept but marked."""
    results: dict[str, Any] = {}
    rows: list[Row] = []
    for name in names:
        path = results_dir / f"{name}.json"
        run = runs.setdefault(name, {"status": "not run"})
        if not path.exists():
            run["result"] = "missing"
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            run["result"] = f"unreadable: {exc}"
            continue
        # A file written after the start by someone else's run, while this run's benchmark failed, is
        # not this run's result either.
        fresh = path.stat().st_mtime >= since and run.get("status", "ok") in ("ok", "not run")
        run["result"] = "fresh" if fresh else "stale (not from this run)"
        results[name] = data
        for row in rows_for(name, data):
            if not fresh:
                row.figure += " [stale: not from this run]"
            rows.append(row)
    return results, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark's --quick variant")
    parser.add_argument("--only", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--table-only", action="store_true", help="run nothing: table from existing results")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    before = machine()
    print(machine_line(before), flush=True)
    started_wall, started = time.time(), time.monotonic()
    runs: dict[str, dict[str, Any]] = {}
    if not args.table_only:
        for name in names:
            quick_s, full_s = BENCHMARKS[name]
            runs[name] = run_one(name, args.quick, quick_s if args.quick else full_s)
    since = 0.0 if args.table_only else started_wall
    results, rows = collect(names, runs, since)
    after = machine()
    table = markdown(rows)
    all_json = {
        "quick": args.quick,
        "machine_before": before,
        "load_average_after": after["load_average"],
        "wall_s": round(time.monotonic() - started, 1),
        "runs": runs,
        "rows": [r.as_dict() for r in rows],
        "results": results,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "all.json").write_text(json.dumps(all_json, indent=2, default=str) + "\n")
    print("\n" + machine_line(before))
    print(f"load average after: {' / '.join(f'{x:.1f}' for x in after['load_average'])}")
    for name in names:
        r = runs[name]
        print(f"  {name:<13} {r.get('status', '-'):<32} result {r.get('result', '-')}  {r.get('wall_s', '')}")
    print("\n" + table + "\n")
    print(f"wrote {RESULTS_DIR / 'all.json'} (wall {all_json['wall_s']} s)")
    return 0 if all(r.get("status", "ok") == "ok" for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
