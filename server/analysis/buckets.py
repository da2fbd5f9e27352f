"""The bucket layout and how well it matches the order gradients actually arrive in.

All-reduces launch strictly in bucket-index order, so a bucket that becomes ready while a lower-index
bucket is still waiting for gradients is **ready out of order**: its all-reduce waits until the
previous index has launched (the **order penalty**: ``min(launch[i], launch[i-1]) - ready[i]`` when
positive; bucket 0 never waits on order, and the engine's own launch latency is not counted). Many out-of-order buckets mean the layout does not follow the
backward pass (e.g. parameters used in a different order than declared).

Each out-of-order bucket gets an ``advice`` that depends on the layout record in force: an ``initial``
layout (reverse ``parameters()`` order) has not been rebuilt, a ``rebuilt`` one was, once, and both
engines never rebuild again, so the advice never asks for a rebuild that already happened. After a
rebuild, a bucket ready before a lower index of another dtype points, under torch's DDP, at torch's
rebuild, which orders the last bucket of each dtype by a hash map, not by readiness; ddpscope's engine
orders them as they become ready, so there (as for one dtype) it means the gradient order changed.
"""

from __future__ import annotations

from collections import Counter
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
    waits_for: int | None = None
    """The lower index still missing when this bucket was ready out of order (the most frequent one)."""
    advice: str | None = None
    """Why the bucket was ready out of order and what to do about it; None when it never was."""


def ready_before(ready_order: Sequence[int]) -> dict[int, int]:
    """Each bucket that became ready while some lower-index bucket was not yet ready -> the lowest such
    index (the bucket whose launch it waits for first)."""
    seen: set[int] = set()
    lowest_missing = 0
    late: dict[int, int] = {}
    for b in ready_order:
        if b > lowest_missing:
            late[b] = lowest_missing
        seen.add(b)
        while lowest_missing in seen:
            lowest_missing += 1
    return late


def out_of_order(ready_order: Sequence[int]) -> set[int]:
    """Buckets that became ready while some lower-index bucket was not yet ready."""
    return set(ready_before(ready_order))


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


def order_advice(
    st: BucketStats, earlier: BucketStats | None, layout: Mapping[str, Any] | None, engine: str | None = None
) -> str:
    """What ``st`` being ready before ``earlier`` (its ``waits_for``) means under ``layout``; ``engine``:
    the ranks' ``rank_start.engine`` ('ddpscope', 'torch'), None when unknown."""
    j = st.waits_for
    said = (
        f"Bucket {st.index} became ready before bucket {j} in {st.out_of_order} of {st.steps} steps (each "
        "rank's counted) and waited for it: all-reduces launch in index order."
    )
    if layout is None:
        return said
    if layout.get("reason") != "rebuilt":
        return (
            f"{said} The buckets hold the parameters in reverse parameters() order and have not been "
            "rebuilt: DDP rebuilds them once, in the order gradients arrive, after the first synchronised "
            "step, but never with find_unused_parameters=True. Define modules in the order forward uses "
            "them, or drop find_unused_parameters if every parameter gets a gradient in every step."
        )
    rebuilt = (
        f"The buckets were rebuilt at step {layout['step']} in the order gradients arrived on rank 0 in the "
        "first synchronised step, and they are not rebuilt again"
    )
    if (
        engine != "ddpscope"
        and earlier is not None
        and st.dtype
        and earlier.dtype
        and st.dtype != earlier.dtype
    ):
        return (
            f"{said} {rebuilt}. Bucket {st.index} holds {st.dtype} and bucket {j} {earlier.dtype} "
            "parameters: torch's DDP rebuild puts the last bucket of each dtype in the order of a hash map "
            "(for float dtypes the reverse of the order their first gradients arrive), not in the order "
            "they become ready. Keep the trainable parameters in one dtype, or use ddpscope's "
            "DistributedDataParallel, which orders them as they become ready"
            + (
                " (if this job already does, gradients arrive in another order since the rebuild)."
                if engine is None
                else "."
            )
        )
    return (
        f"{said} {rebuilt}: gradients now arrive in another order, in later steps or on other ranks (the "
        "parameters a forward uses, or the order it uses them in, change with the step, the data or the "
        "rank). Make that order the same in every step and on every rank."
    )


def bucket_stats(
    layouts: Sequence[Mapping[str, Any]], rows: Sequence[StepRow], engine: str | None = None
) -> list[BucketStats]:
    """Per bucket of the layout in force: out-of-order counts, order penalty, advice (``order_advice``)."""
    layout = current_layout(layouts)
    stats: dict[int, BucketStats] = {}
    if layout is not None:
        for b in layout["buckets"]:
            stats[b["index"]] = BucketStats(b["index"], b["bytes"], list(b["parameters"]), b.get("dtype"))
    since = layout["step"] if layout is not None else None
    penalty_ns: dict[int, int] = {}
    waits: dict[int, Counter[int]] = {}
    for r in rows:
        if since is not None and r.step < since:
            continue  # measured under an older layout
        late = ready_before(r.ready_order)
        for i in range(min(len(r.bucket_ready_ns), len(r.allreduce_start_ns))):
            st = stats.get(i)
            if st is None:
                nbytes = r.bucket_bytes[i] if i < len(r.bucket_bytes) else 0
                st = stats[i] = BucketStats(i, nbytes, [])
            st.steps += 1
            if i in late:
                st.out_of_order += 1
                waits.setdefault(i, Counter())[late[i]] += 1
            penalty_ns[i] = penalty_ns.get(i, 0) + order_wait_ns(r.bucket_ready_ns, r.allreduce_start_ns, i)
    for i, st in stats.items():
        st.order_penalty_s = penalty_ns.get(i, 0) / NS / st.steps if st.steps else 0.0
        if i in waits:
            st.waits_for = waits[i].most_common(1)[0][0]
            st.advice = order_advice(st, stats.get(st.waits_for), layout, engine)
    return [stats[i] for i in sorted(stats)]
