"""The bucket layout and how well it matches the order gradients actually arrive in.

All-reduces launch strictly in bucket-index order, so a bucket that becomes ready while a lower-index
bucket is still waiting for gradients is **ready out of order**: its all-reduce waits until the
previous index has launched (the **order penalty**: ``min(launch[i], launch[i-1]) - ready[i]`` when
positive; bucket 0 never waits on order, and the engine's own launch latency is not counted). Many out-of-order buckets mean the layout does not follow the
backward pass (e.g. parameters used in a different order than declared).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpscope.server.analysis.steps import NS
from ddpscope.server.rows import StepRow


@dataclass(slots=True)
class BucketStats:
    index: int
    bytes: int
    parameters: list[str]
    dtype: str | None = None
    out_of_order: int = 0
    """Number of (rank, step) in which this bucket was ready before a lower-index one."""
    steps: int = 0
    """Number of (rank, step) observed."""
    order_penalty_s: float = 0.0
    """Mean time the bucket, once ready, waited for the previous index to launch, seconds."""


def out_of_order(ready_order: Sequence[int]) -> set[int]:
    """Buckets that became ready while some lower-index bucket was not yet ready."""
    seen: set[int] = set()
    lowest_missing = 0
    late: set[int] = set()
    for b in ready_order:
        if b > lowest_missing:
            late.add(b)
        seen.add(b)
        while lowest_missing in seen:
            lowest_missing += 1
    return late


def order_wait_ns(ready_ns: Sequence[int], launch_ns: Sequence[int], i: int) -> int:
    """How long bucket ``i`` waited, after its last gradient, for bucket ``i-1`` to launch."""
    if i == 0 or not ready_ns[i] or not launch_ns[i] or not launch_ns[i - 1]:
        return 0  # bucket 0 has no predecessor; 0 means "did not happen in this step"
    return max(0, min(launch_ns[i], launch_ns[i - 1]) - ready_ns[i])


def current_layout(layouts: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The layout in force now: the one with the highest ``step`` (rank 0's on a tie)."""
    if not layouts:
        return None
    return max(layouts, key=lambda r: (r["step"], -r["rank"], r["time_ns"]))


def bucket_stats(layouts: Sequence[Mapping[str, Any]], rows: Sequence[StepRow]) -> list[BucketStats]:
    layout = current_layout(layouts)
    stats: dict[int, BucketStats] = {}
    if layout is not None:
        for b in layout["buckets"]:
            stats[b["index"]] = BucketStats(b["index"], b["bytes"], list(b["parameters"]), b.get("dtype"))
    since = layout["step"] if layout is not None else None
    penalty_ns: dict[int, int] = {}
    for r in rows:
        if since is not None and r.step < since:
            continue  # measured under an older layout
        late = out_of_order(r.ready_order)
        for i in range(min(len(r.bucket_ready_ns), len(r.allreduce_start_ns))):
            st = stats.get(i)
            if st is None:
                nbytes = r.bucket_bytes[i] if i < len(r.bucket_bytes) else 0
                st = stats[i] = BucketStats(i, nbytes, [])
            st.steps += 1
            st.out_of_order += i in late
            penalty_ns[i] = penalty_ns.get(i, 0) + order_wait_ns(r.bucket_ready_ns, r.allreduce_start_ns, i)
    for i, st in stats.items():
        st.order_penalty_s = penalty_ns.get(i, 0) / NS / st.steps if st.steps else 0.0
    return [stats[i] for i in sorted(stats)]
