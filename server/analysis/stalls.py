"""Stalls: a rank that holds every other rank up now and then, not in most steps.

A straggler is slow in most steps (``stragglers.py``, medians). A rank whose data source stalls on every
tenth batch, or that writes a log to a slow disk every few hundred steps, is not: its median step is like
everyone's, and yet each of its stalls is waited out by every other rank in the next all-reduce, so the job
may spend most of its time waiting for it. That is a stall here: a step in which a rank's own time (between
steps and computing, ``stragglers.step_phases``) exceeds the median of the others' by ``MIN_STALL_S`` and by as
much again as their whole busy time, and takes twice what that rank usually does. A rank with at least ``MIN_STALLS`` of them in the window, fewer than
half its steps (more is a straggler), whose stalls add up to ``MIN_SHARE`` of the window's wall time, is
reported with how often (``every N steps`` when the stalls come at one interval), how long, and in which
phase the time went.

Pure function of step timings; no database, no HTTP.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ddpscope.server.analysis.steps import StepTiming
from ddpscope.server.analysis.stragglers import PHASES, median_without, phases_by_step
from ddpscope.server.rows import StepRow

WINDOW_STEPS = 200
"""Steps looked at: every rank's step records of them are read at each request."""
MIN_STALL_S = 0.05
"""A stall costs every other rank at least this much: below, it is jitter, not worth a line."""
CONCENTRATION = 3
"""A rank's stalls must outnumber the most any other rank had this many times over: on a loaded host every
rank loses the CPU now and then, and that is nobody's stall."""
MIN_STALLS = 3
MIN_SHARE = 0.05
"""The stalls' excess over the window's wall time (sum of the steps' slowest busy times), at least."""


@dataclass(slots=True)
class Stall:
    rank: int
    stalls: int
    """Steps of the window in which the rank stalled."""
    steps_considered: int
    median_excess_s: float
    """How much longer than the others' median its stalled steps took, typically."""
    total_excess_s: float
    share: float
    """``total_excess_s`` over the window's wall time: what the stalls cost the whole job."""
    every: int | None
    """The stalls' interval in steps when they come at one (every 10th batch), else None."""
    phase: str
    """'forward', 'backward' or 'between_steps': where the stalled steps' extra time went."""
    steps: list[int]
    """The latest stalled steps (at most 10)."""

    def sentence(self) -> str:
        how_often = (
            f"every {self.every} steps"
            if self.every
            else f"in {self.stalls} of {self.steps_considered} steps"
        )
        where = {
            "between_steps": "between steps (loading the next batch, the optimizer step or other host work)",
            "forward": "in its forward",
            "backward": "in its backward",
        }[self.phase]
        return (
            f"rank {self.rank} stalls {how_often} ({self.stalls} times, {self.median_excess_s * 1000:.0f} ms longer "
            f"than the others each time, typically), {where}; every other rank waits it out in the next "
            f"all-reduce: {self.share:.0%} of the job's time over the {self.steps_considered} steps looked at. "
            "Look at what that rank does "
            "then (a remote or slow data read, a log or checkpoint write, garbage collection)"
        )


def intermittent_stalls(rows: Sequence[StepRow | StepTiming], *, window: int = WINDOW_STEPS) -> list[Stall]:
    """The ranks that stall now and then (see the module doc), most costly first."""
    by_step, recent = phases_by_step(rows, window)
    own: dict[int, list[float]] = defaultdict(list)
    for step in recent:
        for rank, values in by_step[step].items():
            own[rank].append(values[0])
    usual = {rank: statistics.median(busy) for rank, busy in own.items()}
    stalled: dict[int, list[tuple[int, float, int]]] = defaultdict(list)
    seen: dict[int, int] = defaultdict(int)
    wall = 0.0
    for step in recent:
        ranks = by_step[step]
        wall += max(v[0] + v[5] for v in ranks.values())
        busy = sorted(v[0] for v in ranks.values())
        for rank, values in ranks.items():
            seen[rank] += 1
            others = median_without(busy, values[0])
            excess = values[0] - others
            # Longer than the others by a stall's worth, and than this rank usually takes (a steady
            # straggler is slow every step: that is the stragglers' story).
            if excess >= MIN_STALL_S and excess >= others and values[0] >= 2 * usual[rank]:
                # The phase that holds the extra time (forward, backward, between steps).
                phase_s = [values[2], values[3], values[4]]
                stalled[rank].append((step, excess, phase_s.index(max(phase_s))))
    out = []
    for rank, found in stalled.items():
        total = sum(e for _, e, _ in found)
        if len(found) < MIN_STALLS or len(found) * 2 > seen[rank] or wall <= 0 or total / wall < MIN_SHARE:
            continue
        others = max((len(f) for r, f in stalled.items() if r != rank), default=0)
        if len(found) < CONCENTRATION * others:
            continue
        steps = [s for s, _, _ in found]
        gaps = {b - a for a, b in zip(steps, steps[1:], strict=False)}
        phases = [p for _, _, p in found]
        out.append(
            Stall(
                rank=rank,
                stalls=len(found),
                steps_considered=seen[rank],
                median_excess_s=statistics.median(e for _, e, _ in found),
                total_excess_s=total,
                share=total / wall,
                every=gaps.pop() if len(gaps) == 1 else None,
                phase=PHASES[max(set(phases), key=phases.count)],
                steps=steps[-10:],
            )
        )
    out.sort(key=lambda s: (-s.total_excess_s, s.rank))
    return out
