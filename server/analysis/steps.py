"""Per-step, per-rank timing: the definitions every view shares (API, /metrics, dashboard).

- ``step_s`` = backward end - forward start; ``forward_s``, ``backward_s`` the phases' spans.
- ``comm_s``: total all-reduce time, the length of the union of the buckets' [launch, end] spans
  (all-reduces overlap each other, so a plain sum would count time twice).
- ``exposed_comm_s``: the part of that union after the last gradient was ready (nothing left to
  hide it behind). ``overlap_ratio`` = (comm - exposed) / comm, None when the step had no all-reduce.
- ``compute_s``: forward start to the last bucket ready (the straggler definition's compute time);
  ``wait_s``: last bucket ready to backward end, i.e. waiting for all-reduces (and so for peers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import le

from ddpscope.server.rows import StepRow, StepTimes

NS = 1e9


@dataclass(slots=True)
class StepMetrics:
    rank: int
    step: int
    synced: bool
    step_s: float
    forward_s: float
    backward_s: float
    comm_s: float
    exposed_comm_s: float
    overlap_ratio: float | None
    compute_s: float
    wait_s: float


def union_after(
    starts: Sequence[int], ends: Sequence[int], after: int, starts_shift: int = 0, ends_shift: int = 0
) -> tuple[int, int]:
    """(length of the union of [start, end] spans, length of that union after ``after``), in ns.
    Span i is ``[starts[i] + starts_shift, ends[i] + ends_shift]`` (see ``rows.StepTimes``).

    Written with plain comparisons (no ``max`` calls): it runs once per rank per step in every view.
    """
    total = exposed = 0
    cur_s = cur_e = -1
    # Launched in bucket order, the spans usually come sorted already: skip building and sorting pairs.
    in_order = all(map(le, starts[:-1], starts[1:]))
    pairs = zip(starts, ends, strict=False) if in_order else sorted(zip(starts, ends, strict=False))
    for s, e in pairs:  # a shift per array keeps the order
        s += starts_shift
        e += ends_shift
        if e < s:
            continue  # a span still in flight or garbled: it has no length to count
        if cur_e < 0:
            cur_s, cur_e = s, e
        elif s > cur_e:
            total += cur_e - cur_s
            if cur_e > after:
                exposed += cur_e - (cur_s if cur_s > after else after)
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e >= 0:
        total += cur_e - cur_s
        if cur_e > after:
            exposed += cur_e - (cur_s if cur_s > after else after)
    return total, exposed


def last_ready_ns(row: StepRow | StepTimes) -> int:
    """When the step's last bucket became ready (backward end when it had no bucket)."""
    t = row if isinstance(row, StepTimes) else StepTimes.of(row)  # one formula for both shapes
    return max(t.ready) + t.ready_shift if len(t.ready) else t.backward_end_ns


def step_metrics(row: StepRow | StepTimes) -> StepMetrics:
    t = row if isinstance(row, StepTimes) else StepTimes.of(row)
    last_ready = last_ready_ns(t)
    comm, exposed = union_after(t.starts, t.ends, last_ready, t.starts_shift, t.ends_shift)
    overlap = (comm - exposed) / comm if comm > 0 else None
    return StepMetrics(
        rank=row.rank,
        step=row.step,
        synced=row.synced,
        step_s=(row.backward_end_ns - row.forward_start_ns) / NS,
        forward_s=(row.forward_end_ns - row.forward_start_ns) / NS,
        backward_s=(row.backward_end_ns - row.backward_start_ns) / NS,
        comm_s=comm / NS,
        exposed_comm_s=exposed / NS,
        overlap_ratio=overlap,
        compute_s=(last_ready - row.forward_start_ns) / NS,
        wait_s=max(0, row.backward_end_ns - last_ready) / NS,
    )


def mean_overlap(metrics: Sequence[StepMetrics]) -> float | None:
    """Overlap over several steps, weighted by comm time (a short step does not count as much)."""
    comm = sum(m.comm_s for m in metrics if m.overlap_ratio is not None)
    if comm <= 0:
        return None
    return sum(m.comm_s - m.exposed_comm_s for m in metrics if m.overlap_ratio is not None) / comm
