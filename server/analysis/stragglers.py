"""Stragglers: ranks whose compute is consistently slower than their peers'.

Compute time of a rank in a step = forward start to its last bucket ready (``steps.compute_s``). In
each of the recent steps, a rank's ratio is its compute over the **median of the other ranks**; the
step counts against it when the ratio exceeds ``1 + threshold`` (and by at least ``min_excess_s``,
so sub-millisecond jitter never counts). A rank is a straggler when that happens in **most** of the
recent steps and its median ratio (``slowdown``) also exceeds the threshold. Medians everywhere: on
an oversubscribed machine any rank can lose the CPU for one step, but not for most of them.

The slowdown is attributed to the phase with the largest excess, in seconds, over the others' median: ``forward``
or ``backward`` (backward compute up to the last bucket ready). The other ranks show the same time as
all-reduce wait (``wait_s``: last bucket ready to backward end), which is why compute, not step time,
is compared: every rank's step takes as long as the slowest one's.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ddpscope.server.analysis.steps import NS, last_ready_ns
from ddpscope.server.rows import StepRow, StepTimes

THRESHOLD = 0.15
WINDOW_STEPS = 20
MIN_STEPS = 3
MIN_EXCESS_S = 0.001


@dataclass(slots=True)
class Straggler:
    rank: int
    slowdown: float
    """Median over recent steps of compute time / median compute of the other ranks."""
    steps_flagged: int
    steps_considered: int
    flagged: bool
    phase: str | None
    """Where the extra time goes: 'forward' or 'backward'; None when not flagged."""
    forward_slowdown: float
    backward_slowdown: float
    wait_s: float
    """Median time from the last bucket ready to backward end (all-reduce wait), seconds."""


def _phases(r: StepRow | StepTimes) -> tuple[float, float, float, float]:
    ready = last_ready_ns(r)
    compute = (ready - r.forward_start_ns) / NS
    forward = (r.forward_end_ns - r.forward_start_ns) / NS
    backward = (ready - r.backward_start_ns) / NS
    wait = max(0, r.backward_end_ns - ready) / NS
    return compute, forward, backward, wait


def median_without(values: Sequence[float], x: float) -> float:
    """Median of sorted ``values`` with one occurrence of ``x`` (which must be among them) removed."""
    n = len(values) - 1
    i = bisect.bisect_left(values, x)

    def at(k: int) -> float:  # k-th element of the list without position i
        return values[k + 1] if k >= i else values[k]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def _ratio(x: float, ref: float) -> float:
    return x / ref if ref > 0 else 1.0


def stragglers(
    rows: Sequence[StepRow | StepTimes],
    *,
    threshold: float = THRESHOLD,
    window: int = WINDOW_STEPS,
    min_excess_s: float = MIN_EXCESS_S,
) -> list[Straggler]:
    """One item per rank seen in the last ``window`` steps, most slowed down first."""
    by_step: dict[int, dict[int, tuple[float, float, float, float]]] = defaultdict(dict)
    for r in rows:
        by_step[r.step][r.rank] = _phases(r)
    recent = sorted(s for s, ranks in by_step.items() if len(ranks) >= 2)[-window:]
    ratios: dict[int, list[tuple[float, float, float, float, float]]] = defaultdict(list)
    flagged_steps: dict[int, int] = defaultdict(int)
    waits: dict[int, list[float]] = defaultdict(list)
    for step in recent:
        ranks = by_step[step]
        # One sort per phase and step; each rank's "median of the others" is then a lookup, so a
        # 1024-rank job costs O(n log n) per step rather than O(n^2).
        columns = [sorted(v[i] for v in ranks.values()) for i in range(3)]
        for rank, (compute, fwd, bwd, wait) in ranks.items():
            med = [median_without(columns[i], x) for i, x in enumerate((compute, fwd, bwd))]
            ratio = _ratio(compute, med[0])
            ratios[rank].append((ratio, _ratio(fwd, med[1]), _ratio(bwd, med[2]), fwd - med[1], bwd - med[2]))
            waits[rank].append(wait)
            if ratio > 1 + threshold and compute - med[0] > min_excess_s:
                flagged_steps[rank] += 1
    out = []
    for rank, rs in ratios.items():
        slowdown = statistics.median(r[0] for r in rs)
        fwd = statistics.median(r[1] for r in rs)
        bwd = statistics.median(r[2] for r in rs)
        n = len(rs)
        flagged = n >= MIN_STEPS and flagged_steps[rank] * 2 > n and slowdown > 1 + threshold
        phase = None
        if flagged:
            # The phase that holds the extra seconds, not the larger ratio: a phase of a few hundred
            # microseconds doubles from one scheduler hiccup, which says nothing about the slowdown.
            fwd_excess = statistics.median(r[3] for r in rs)
            bwd_excess = statistics.median(r[4] for r in rs)
            phase = "forward" if fwd_excess >= bwd_excess else "backward"
        out.append(
            Straggler(
                rank=rank,
                slowdown=slowdown,
                steps_flagged=flagged_steps[rank],
                steps_considered=n,
                flagged=flagged,
                phase=phase,
                forward_slowdown=fwd,
                backward_slowdown=bwd,
                wait_s=statistics.median(waits[rank]),
            )
        )
    out.sort(key=lambda s: (-s.slowdown, s.rank))
    return out
