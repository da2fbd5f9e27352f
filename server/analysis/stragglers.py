"""Stragglers: ranks whose own work is consistently slower than their peers'.

Every rank's step takes as long as the slowest one's (the others wait for it in the all-reduce), so
what is compared is the time a rank spends *before* it can join the all-reduce:

- ``compute``: forward start to its last bucket ready (``steps.compute_s``);
- ``between_steps``: its previous step's backward end to this forward start: the optimizer step,
  loading the next batch, anything the loop does on the host. A rank with a slow data loader or
  slow host work starts its forward late; its compute looks normal and the *other* ranks show the
  time as all-reduce wait.

Time a rank spent blocked in *other* collectives (``blocked_*_ns``: a user's loss all-reduce, the
buffer broadcast before forward, SyncBatchNorm) is left out of every phase: a fast rank waits there
for the slow one, and counting that wait as its own work would make every rank look as slow as the
straggler (a slow data loader on one rank of a model with BatchNorm shows on every other rank as a
long forward, spent in the buffer broadcast) or flag the fast members of a subgroup that all-reduces
a metric as slow between steps.

In each of the recent steps, a rank's ratio is its ``busy`` time (between steps + compute) over the
**median of the other ranks'**, and so is its compute ratio; the step counts against it when either
exceeds ``1 + threshold`` (and by at least ``min_excess_s``, so sub-millisecond jitter never counts).
A rank is a straggler when that happens in **most** of the recent steps (of at least ``MIN_STEPS``,
after the ``WARMUP_STEPS``) and its median ratio (``slowdown``, the larger of the two) also exceeds
the threshold. Medians everywhere: on an
oversubscribed machine any rank can lose the CPU for one step, but not for most of them.

The slowdown is attributed to the phase with the largest excess, in seconds, over the others'
median: ``forward``, ``backward`` (backward compute up to the last bucket ready) or ``between_steps``.
The first step a rank is seen with has no previous step: its between-steps time counts as zero for
it (callers pass one step more than the window, so every step in the window has its predecessor).
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ddpscope.server.analysis.profile_sites import SampledSite
from ddpscope.server.analysis.steps import NS, StepTiming, last_ready_ns
from ddpscope.server.rows import StepRow

THRESHOLD = 0.15
WINDOW_STEPS = 20
MIN_STEPS = 8
"""Steps a rank must be compared in before it can be flagged: a job that fails after a few steps
has only its warm-up to go on, where one rank losing the CPU for three steps out of five is noise (a
culprit flagged as slow before it hung points the reader the wrong way)."""
WARMUP_STEPS = 2
"""Steps 0 and 1 are never compared: the first allocates everything, the second rebuilds buckets."""
MIN_EXCESS_S = 0.001


@dataclass(slots=True)
class Straggler:
    rank: int
    slowdown: float
    """Median over recent steps of (between steps + compute) / the same of the other ranks, or of
    compute alone when that is larger."""
    steps_flagged: int
    steps_considered: int
    flagged: bool
    phase: str | None
    """Where the extra time goes: 'forward', 'backward' or 'between_steps'; None when not flagged."""
    forward_slowdown: float
    backward_slowdown: float
    between_steps_slowdown: float
    """Median ratio of the time from the previous backward end to this forward start."""
    wait_s: float
    """Median time from the last bucket ready to backward end (all-reduce wait), seconds."""
    contention: str | None = None
    """A flagged rank's host has more compute threads than cores (``host_load``): what that means, or None."""
    sampled: SampledSite | None = None
    """The line its slow phase was sampled at most (``profile_sites``), or None."""


PHASES = ("forward", "backward", "between_steps")


def step_phases(r: StepRow | StepTiming, previous_end_ns: int | None) -> tuple[float, ...]:
    """(busy, compute, forward, backward, between steps, wait) of one rank's step, in seconds, each
    less the time blocked in other collectives within it."""
    ready = last_ready_ns(r)
    in_forward, in_backward = r.blocked_forward_ns, r.blocked_backward_ns
    compute = max(0, ready - r.forward_start_ns - in_forward - in_backward) / NS
    forward = max(0, r.forward_end_ns - r.forward_start_ns - in_forward) / NS
    backward = max(0, ready - r.backward_start_ns - in_backward) / NS
    between = (
        0.0
        if previous_end_ns is None
        else max(0, r.forward_start_ns - previous_end_ns - r.blocked_between_ns) / NS
    )
    wait = max(0, r.backward_end_ns - ready) / NS
    return between + compute, compute, forward, backward, between, wait


def median_without(values: Sequence[float], x: float) -> float:
    """Median of sorted ``values`` with one occurrence of ``x`` (which must be among them) removed."""
    n = len(values) - 1
    i = bisect.bisect_left(values, x)

    def at(k: int) -> float:  # k-th element of the list without position i
        return values[k + 1] if k >= i else values[k]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def _ratio(x: float, ref: float) -> float:
    return x / ref if ref > 0 else 1.0


def phases_by_step(
    rows: Sequence[StepRow | StepTiming], window: int
) -> tuple[dict[int, dict[int, tuple[float, ...]]], list[int]]:
    """``(step -> rank -> step_phases, the last `window` steps)``: the steps compared, those after the
    warm-up that at least two ranks recorded, each rank's phases measured from its previous step's end."""
    by_rank_step = {(r.rank, r.step): r for r in rows}
    by_step: dict[int, dict[int, tuple[float, ...]]] = defaultdict(dict)
    for (rank, step), r in by_rank_step.items():
        previous = by_rank_step.get((rank, step - 1))
        by_step[step][rank] = step_phases(r, None if previous is None else previous.backward_end_ns)
    recent = sorted(s for s, ranks in by_step.items() if len(ranks) >= 2 and s >= WARMUP_STEPS)[-window:]
    return by_step, recent


def stragglers(
    rows: Sequence[StepRow | StepTiming],
    *,
    threshold: float = THRESHOLD,
    window: int = WINDOW_STEPS,
    min_excess_s: float = MIN_EXCESS_S,
) -> list[Straggler]:
    """One item per rank seen in the last ``window`` steps, most slowed down first."""
    by_step, recent = phases_by_step(rows, window)
    # Per rank and step: (slowdown, forward, backward, between ratios, then their excess seconds).
    ratios: dict[int, list[tuple[float, ...]]] = defaultdict(list)
    flagged_steps: dict[int, int] = defaultdict(int)
    waits: dict[int, list[float]] = defaultdict(list)
    for step in recent:
        ranks = by_step[step]
        # One sort per measure and step; each rank's "median of the others" is then a lookup, so a
        # 1024-rank job costs O(n log n) per step rather than O(n^2).
        columns = [sorted(v[i] for v in ranks.values()) for i in range(5)]
        for rank, values in ranks.items():
            med = [median_without(columns[i], values[i]) for i in range(5)]
            busy_ratio, compute_ratio = _ratio(values[0], med[0]), _ratio(values[1], med[1])
            ratios[rank].append(
                (max(busy_ratio, compute_ratio),)
                + tuple(_ratio(values[i], med[i]) for i in (2, 3, 4))
                + tuple(values[i] - med[i] for i in (2, 3, 4))
            )
            waits[rank].append(values[5])
            slower = (busy_ratio > 1 + threshold and values[0] - med[0] > min_excess_s) or (
                compute_ratio > 1 + threshold and values[1] - med[1] > min_excess_s
            )
            if slower:
                flagged_steps[rank] += 1
    out = []
    for rank, rs in ratios.items():
        slowdown = statistics.median(r[0] for r in rs)
        n = len(rs)
        flagged = n >= MIN_STEPS and flagged_steps[rank] * 2 > n and slowdown > 1 + threshold
        phase = None
        if flagged:
            # The phase that holds the extra seconds, not the larger ratio: a phase of a few hundred
            # microseconds doubles from one scheduler hiccup, which says nothing about the slowdown.
            excess = [statistics.median(r[4 + i] for r in rs) for i in range(len(PHASES))]
            phase = PHASES[excess.index(max(excess))]
        out.append(
            Straggler(
                rank=rank,
                slowdown=slowdown,
                steps_flagged=flagged_steps[rank],
                steps_considered=n,
                flagged=flagged,
                phase=phase,
                forward_slowdown=statistics.median(r[1] for r in rs),
                backward_slowdown=statistics.median(r[2] for r in rs),
                between_steps_slowdown=statistics.median(r[3] for r in rs),
                wait_s=statistics.median(waits[rank]),
            )
        )
    out.sort(key=lambda s: (-s.slowdown, s.rank))
    return out
