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

Where the time went, line by line: the rank's watchdog samples its main thread's stack in a stall of its
own (``stall_sample`` records, 0.5 s in and at each doubling, earlier once short stalls recur,
``ddp/stall_sampler.py``). The samples taken in
the stalled steps name the line the rank spent them on (``StallSite``: the most sampled one, with its
stack, and whether the thread was blocked or busy there).

Pure function of step timings; no database, no HTTP.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpscope.agent.torch_waits import blocked
from ddpscope.server.analysis.native_wait import named_thread_words
from ddpscope.server.analysis.profile_sites import SampledSite
from ddpscope.server.analysis.steps import StepTiming
from ddpscope.server.analysis.stragglers import PHASES, median_without, phases_by_step
from ddpscope.server.analysis.stuck import stack_waits_for_loader, waits_on, workers_words
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
class StallSite:
    """Where a rank's training thread (its main thread, unless it trains on another) was when its stalls
    were sampled."""

    site: str | None
    """file:line of user code the most samples name (None: none of them was in user code)."""
    samples: int
    """Samples at that line."""
    of: int
    """Samples taken in the rank's stalled steps in all."""
    stalls: int
    """Stalled steps with at least one sample."""
    blocked: bool | None
    """True when the thread used under ``torch_waits.BLOCKED_CPU_SHARE`` of those samples' time on the CPU (the
    hang reports' rule, ``torch_waits.blocked``); None unknown."""
    stack: str
    """The sampled thread's stack in the latest sample at that line."""
    from_s: float
    """How far into a stall the earliest of those samples was taken."""
    loader: bool = False
    """That stack waits for a DataLoader's workers to deliver a batch: the time goes in the workers."""
    thread: str | None = None
    """The name of the thread sampled when the rank trains on one other than its main thread; None for the
    main thread."""
    waits_on: str | None = None
    """What the blocked thread waited on in the latest sample at that line (``stuck.waits_on``: the system
    call, and a socket's peer, a file's path, a child), when it was blocked and the sample said."""
    workers: str | None = None
    """What its DataLoader's workers were doing in that sample (``stuck.workers_words``), when it waited for
    them and the sample said."""

    def sentence(self) -> str:
        where = f"at {self.site}" if self.site else "outside user code"
        if self.loader:
            where += ", waiting for its DataLoader's workers to deliver the next batch,"
        stalls = "that stall" if self.stalls == 1 else f"{self.stalls} of those stalls"
        how = f", blocked, {self.waits_on}" if self.blocked and self.waits_on else HOW[self.blocked]
        workers = f" ({self.workers})" if self.workers else ""
        return (
            f"Sampled {self.from_s:.3g} s and more into {stalls}, its {named_thread_words(self.thread)} was {where} in "
            f"{self.samples} of {self.of} samples{how}{workers}"
        )

    def advice(self) -> str:
        return line_advice(loader=self.loader)


def line_advice(*, loader: bool) -> str:
    """What to do about the line a rank's stalls were sampled at (``loader``: a DataLoader waiting for its
    workers there)."""
    if loader:
        return (
            "the time goes in the workers, in the Dataset's __getitem__ or collate_fn on some batches (a slow "
            "or remote read, a large item); more workers or a higher prefetch_factor hide it, a faster read "
            "removes it"
        )
    return (
        "look at that line (a remote or slow data read, a log or checkpoint write, work only that rank does)"
    )


PHASE_WORDS = {"between_steps": "between steps", "forward": "in forward", "backward": "in backward"}

HOW = {True: ", blocked (I/O, a lock, a sleep or a queue)", False: ", busy on the CPU", None: ""}
"""What ``blocked`` says of a sampled thread, as a clause."""


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
    sampled: StallSite | None = None
    """Where the rank's main thread was in those stalls, when its watchdog sampled them."""
    profiled: SampledSite | None = None
    """Where its watchdog's samples of the whole phase place it (``profile_sites``; stalls too short or too
    quick to be sampled themselves): read when ``sampled`` names no line."""

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
        head = (
            f"rank {self.rank} stalls {how_often} ({self.stalls} times, {self.median_excess_s * 1000:.0f} ms longer "
            f"than the others each time, typically), {where}; every other rank waits it out in the next "
            f"all-reduce: {self.share:.0%} of the job's time over the {self.steps_considered} steps looked at. "
        )
        if self.sampled is not None and self.sampled.site:
            return f"{head}{self.sampled.sentence()}: {self.sampled.advice()}"
        if (p := self.profiled) is not None:
            loader = ", waiting for its DataLoader's workers to deliver the next batch," if p.loader else ""
            return (
                f"{head}Its watchdog's samples of all its time {PHASE_WORDS[self.phase]} (its stalls and its other "
                f"steps alike) place it at {p.site}{loader} in {p.samples} of {p.of}: {line_advice(loader=p.loader)}"
            )
        sampled = f"{self.sampled.sentence()}. " if self.sampled else ""
        return (
            f"{head}{sampled}Look at what that rank does then (a remote or slow data read, a log or checkpoint "
            "write, garbage collection)"
        )


def intermittent_stalls(
    rows: Sequence[StepRow | StepTiming],
    *,
    window: int = WINDOW_STEPS,
    samples: Iterable[Mapping[str, Any]] = (),
) -> list[Stall]:
    """The ranks that stall now and then (see the module doc), most costly first. ``samples``: the ranks'
    ``stall_sample`` records of those steps, which say where the time went."""
    samples = list(samples)
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
                sampled=stall_site([x for x in samples if x["rank"] == rank], set(steps)),
            )
        )
    out.sort(key=lambda s: (-s.total_excess_s, s.rank))
    return out


def stall_site(samples: Sequence[Mapping[str, Any]], stalled_steps: set[int]) -> StallSite | None:
    """Where one rank's ``samples`` taken in its ``stalled_steps`` place its main thread, or None when none
    was. An idle rank's sample carries the step it had finished: its stall is the next step's."""
    taken = [
        x
        for x in samples
        if (int(x["step"]) + 1 if x["phase"] == "idle" else int(x["step"])) in stalled_steps
    ]
    if not taken:
        return None
    counts = Counter(x.get("site") for x in taken)
    site, n = max(counts.items(), key=lambda kv: (kv[1], kv[0] is not None))
    there = [x for x in taken if x.get("site") == site]
    cpu = [x.get("main_cpu_s") for x in there]
    spent = sum(float(x["stalled_s"]) for x in there)
    was_blocked = None if None in cpu else blocked(sum(float(c or 0) for c in cpu), spent)
    loader = stack_waits_for_loader(str(there[-1]["stack"]))
    return StallSite(
        site=site,
        samples=n,
        of=len(taken),
        stalls=len({(int(x["step"]), x["phase"]) for x in taken}),
        blocked=was_blocked,
        stack=str(there[-1]["stack"]),
        from_s=min(float(x["stalled_s"]) for x in taken),
        loader=loader,
        thread=there[-1].get("thread"),
        # A DataLoader's wait on its workers' pipe is said as such (``loader``), not as a pipe.
        waits_on=waits_on(there[-1]) if was_blocked and not loader else None,
        workers=workers_words(there[-1]) if loader else None,
    )
