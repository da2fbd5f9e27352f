"""Helpers shared by the benchmarks: the machine, robust statistics, result files, multi-rank jobs.

Every benchmark prints the machine it ran on (with the load average: this machine is shared, and a
load of 20 on 2 cores changes absolute timings several-fold, which is why benchmarks report ratios
measured side by side) and writes ``bench/results/<name>.json`` through ``write_result``.

``run_module_ranks`` starts ``python -m <module>`` once per rank (gloo on 127.0.0.1, one thread
each), every rank in its own session, and kills what is left by process group at the deadline.
``interleave`` runs in-process variants in blocks whose order rotates every round, so that drift and
other processes' noise hit every variant alike; ``ratios_to`` turns its per-round block medians into
per-round ratios to a baseline variant.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# -- the machine ----------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    # importlib.metadata, not ``import torch``: describing the machine must not cost a torch import.
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """Platform, CPU model and count, load average (1, 5, 15 min), Python and torch versions."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": load,
        "python": platform.python_version(),
        "torch": _version("torch"),
    }


def machine_line(m: Mapping[str, Any]) -> str:
    """One line for the top of a benchmark's output."""
    load = m.get("load_average") or []
    load_s = " / ".join(f"{x:.1f}" for x in load) if load else "unknown"
    return (
        f"machine: {m.get('cpu')}, {m.get('cpu_count')} CPUs, {m.get('platform')}, "
        f"python {m.get('python')}, torch {m.get('torch')}, load average {load_s} (1/5/15 min)"
    )


# -- statistics -----------------------------------------------------------------------------------


def task_cpu_ns(pid: int | str, tid: int | str) -> int | None:
    """CPU time in ns of one thread (``pid="self"`` for this process), from the kernel's per-thread
    accounting (Linux ``schedstat``, ns resolution); None when the thread is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, quartiles, IQR, 10th/90th percentiles (the spread), min, max and count."""
    if not values:
        raise ValueError("summary of no values")
    vals = sorted(values)
    if len(vals) == 1:
        q = [vals[0]] * 3
        d = [vals[0]] * 9
    else:
        q = statistics.quantiles(vals, n=4, method="inclusive")
        d = statistics.quantiles(vals, n=10, method="inclusive")
    return {
        "median": statistics.median(vals),
        "p25": q[0],
        "p75": q[2],
        "iqr": q[2] - q[0],
        "p10": d[0],
        "p90": d[-1],
        "min": vals[0],
        "max": vals[-1],
        "n": len(vals),
    }


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (0 < pct <= 100): the value at or below which pct % of values lie."""
    if not values:
        raise ValueError("percentile of no values")
    vals = sorted(values)
    k = max(0, min(len(vals) - 1, math.ceil(pct / 100 * len(vals)) - 1))
    return vals[k]


def median_interval(values: Sequence[float]) -> tuple[float, float]:
    """A ~95 % confidence interval for the median of ``values``, distribution-free: the order statistics
    n/2 -+ 1.96 sqrt(n)/2 (the binomial count of values below the median, normally approximated). What an
    A/B of interleaved blocks can resolve: a difference inside it is noise at this many blocks."""
    if not values:
        raise ValueError("median_interval of no values")
    vals = sorted(values)
    n = len(vals)
    half_width = 1.96 * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half_width))
    hi = min(n - 1, math.ceil(n / 2 + half_width) - 1)
    return vals[lo], vals[hi]


# -- interleaved variants within one process ------------------------------------------------------


def rotations(variants: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of each round: rotated by one every round, so no variant always runs first or last."""
    n = len(variants)
    return [list(variants[r % n :]) + list(variants[: r % n]) for r in range(rounds)]


def interleave(
    blocks: Mapping[str, Callable[[], list[float]]], rounds: int
) -> tuple[dict[str, list[float]], list[dict[str, float]]]:
    """Run every block once per round in rotating order; each block returns its step times.

    Returns all step times per variant and, per round, each variant's block median.
    """
    samples: dict[str, list[float]] = {name: [] for name in blocks}
    per_round: list[dict[str, float]] = []
    for order in rotations(list(blocks), rounds):
        medians = {}
        for name in order:
            times = blocks[name]()
            samples[name].extend(times)
            medians[name] = statistics.median(times)
        per_round.append(medians)
    return samples, per_round


def ratios_to(per_round: Sequence[Mapping[str, float]], baseline: str) -> dict[str, list[float]]:
    """Per-round ratio of each variant's block median to the baseline's block median of that round."""
    out: dict[str, list[float]] = {}
    for medians in per_round:
        base = medians[baseline]
        for name, value in medians.items():
            if name != baseline and base > 0:
                out.setdefault(name, []).append(value / base)
    return out


# -- result files ---------------------------------------------------------------------------------


def write_result(name: str, data: Mapping[str, Any], results_dir: Path | None = None) -> Path:
    """Write ``<results_dir>/<name>.json`` (machine added when missing) and return its path."""
    out = dict(data)
    out.setdefault("bench", name)
    out.setdefault("machine", machine())
    path = (results_dir or RESULTS_DIR) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return path


# -- multi-rank jobs ------------------------------------------------------------------------------


@dataclass
class RankRun:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str


def run_module_ranks(
    module: str,
    world_size: int,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    on_started: Callable[[list[subprocess.Popen[str]]], None] | None = None,
) -> list[RankRun]:
    """Run ``python -m module args`` as a ``world_size``-rank gloo job; kill leftovers at the deadline.

    ``on_started`` (optional) is called with the processes once all have started and may block (for
    a benchmark that watches the job from outside); the deadline covers it too.
    """
    from tests.support.procs import free_port, kill_group, rank_env

    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    deadline = time.monotonic() + timeout_s
    try:
        for rank in range(world_size):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    env=rank_env(rank, world_size, port, env),
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        if on_started is not None:
            on_started(procs)
        runs = []
        for rank, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                runs.append(RankRun(rank, p.returncode, out, err))
            except subprocess.TimeoutExpired:
                kill_group(p)
                out, err = p.communicate(timeout=10)
                runs.append(RankRun(rank, None, out, err))
        return runs
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p)
            with contextlib.suppress(Exception):
                p.communicate(timeout=10)


def check_ranks(runs: Sequence[RankRun], what: str) -> None:
    """Raise with the failing ranks' stderr tails when a rank did not exit 0."""
    bad = [r for r in runs if r.returncode != 0]
    if bad:
        tails = "\n".join(f"rank {r.rank} rc={r.returncode}: {r.stderr[-1500:]}" for r in bad)
        raise RuntimeError(f"{what}: ranks failed\n{tails}")
