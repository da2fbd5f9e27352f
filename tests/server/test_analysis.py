"""Analysis functions over rows: the definitions of DESIGN.md, checked on hand-built and synthetic steps."""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpscope.server.analysis.buckets import bucket_stats, out_of_order
from ddpscope.server.analysis.collectives import mismatches
from ddpscope.server.analysis.steps import step_metrics, union_after
from ddpscope.server.analysis.stragglers import stragglers
from ddpscope.server.analysis.timeline import timeline
from ddpscope.server.analysis.trace import trace_events
from ddpscope.server.analysis.unused import aggregate_unused, unused_report
from ddpscope.server.rows import StepRow, step_rows_from_wire
from tests.support.synth import synth_job

MS = 1_000_000


def _row(
    rank=0,
    step=0,
    fs=0,
    fe=10,
    bs=10,
    be=40,
    ready=(20, 30),
    ar_start=(20, 30),
    ar_end=(28, 38),
    order=(0, 1),
):
    ms = lambda xs: [x * MS for x in xs]  # noqa: E731
    return StepRow(
        rank, step, True, fs * MS, fe * MS, bs * MS, be * MS,
        ms(ready), ms(ar_start), ms(ar_end), [100] * len(ready), list(order), list(range(len(ready))),
    )  # fmt: skip


def test_step_metrics_follow_the_design_definitions():
    # Buckets ready at 20 and 30 ms, all-reduces 20-28 and 30-38, backward ends at 40 ms.
    m = step_metrics(_row())
    assert m.step_s == pytest.approx(0.040)
    assert m.forward_s == pytest.approx(0.010)
    assert m.backward_s == pytest.approx(0.030)
    assert m.comm_s == pytest.approx(0.016)  # two disjoint 8 ms spans
    assert m.exposed_comm_s == pytest.approx(0.008)  # after the last ready (30 ms): 30-38
    assert m.overlap_ratio == pytest.approx(0.5)
    assert m.compute_s == pytest.approx(0.030)
    assert m.wait_s == pytest.approx(0.010)


def test_overlapping_all_reduces_are_counted_once():
    assert union_after([0, 5, 20], [10, 12, 25], after=8) == (17, 4 + 5)


spans = st.lists(
    st.tuples(st.integers(-500, 1000), st.integers(-50, 300)), max_size=60
)  # clocks may read < 0


@settings(max_examples=400, deadline=None)
@given(
    spans=spans,
    after=st.integers(-100, 1500),
    sort=st.booleans(),
)
def test_the_union_of_spans_counts_every_covered_nanosecond_once_sorted_or_not(
    spans: list[tuple[int, int]], after: int, sort: bool
) -> None:
    # Spans as (start, length); sorted ones take the fast path unless one is still in flight (length < 0).
    if sort:
        spans = sorted(spans)
    covered = {x for s, n in spans for x in range(s, s + n)}  # unit cells [x, x + 1)
    starts = array("q", [s for s, _ in spans])
    ends = array("q", [s + n for s, n in spans])
    assert union_after(starts, ends, after) == (len(covered), sum(1 for x in covered if x >= after))


def test_a_step_without_all_reduce_has_no_overlap_ratio():
    m = step_metrics(_row(ready=(), ar_start=(), ar_end=(), order=()))
    assert m.comm_s == 0 and m.overlap_ratio is None


def test_a_bucket_ready_before_a_lower_index_is_out_of_order():
    assert out_of_order([0, 1, 2, 3]) == set()
    assert out_of_order([2, 0, 1, 3]) == {2}
    assert out_of_order([3, 2, 1, 0]) == {1, 2, 3}


def test_bucket_stats_report_layout_out_of_order_counts_and_order_penalty():
    layout = {"rank": 0, "step": 0, "time_ns": 0, "buckets": [
        {"index": 0, "bytes": 8, "dtype": "float32", "device": "cpu", "parameters": ["b"]},
        {"index": 1, "bytes": 16, "dtype": "float32", "device": "cpu", "parameters": ["a", "c"]},
    ]}  # fmt: skip
    # Bucket 1 ready at 20 ms but bucket 0 only at 30: bucket 1 waits 10 ms to launch.
    late = _row(ready=(30, 20), ar_start=(30, 30), ar_end=(35, 38), order=(1, 0))
    stats = bucket_stats([layout], [late, _row(step=1)])
    assert [(b.index, b.bytes, b.parameters) for b in stats] == [(0, 8, ["b"]), (1, 16, ["a", "c"])]
    assert [b.out_of_order for b in stats] == [0, 1]
    assert stats[1].order_penalty_s == pytest.approx(0.010 / 2)


def _layout(reason, step, *dtypes):
    buckets = [
        {"index": i, "bytes": 8, "dtype": d, "device": "cpu", "parameters": [f"p{i}"]}
        for i, d in enumerate(dtypes)
    ]
    return {"rank": 0, "step": step, "time_ns": step, "reason": reason, "buckets": buckets}


# Bucket 1 ready at 20 ms, bucket 0 at 30: bucket 1 waits for bucket 0 to launch.
_LATE = {"ready": (30, 20), "ar_start": (30, 30), "ar_end": (35, 38), "order": (1, 0)}


def test_after_the_rebuild_a_bucket_ready_out_of_order_is_not_advised_the_rebuild_that_already_happened():
    layouts = [_layout("initial", 0, "float32", "float32"), _layout("rebuilt", 1, "float32", "float32")]
    stats = bucket_stats(layouts, [_row(step=0, **_LATE), _row(step=1, **_LATE), _row(step=2, **_LATE)])
    assert [b.out_of_order for b in stats] == [0, 2]  # step 0 ran under the initial layout
    assert stats[1].waits_for == 0 and stats[0].advice is None
    advice = stats[1].advice
    assert advice.startswith("Bucket 1 became ready before bucket 0 in 2 of 2 steps (each rank")
    assert "rebuilt at step 1" in advice and "not rebuilt again" in advice
    assert "find_unused_parameters" not in advice and "parameters() order" not in advice


def test_a_layout_never_rebuilt_is_advised_the_module_order_and_when_ddp_rebuilds():
    stats = bucket_stats(
        [_layout("initial", 0, "float32", "float32")], [_row(step=s, **_LATE) for s in range(3)]
    )
    advice = stats[1].advice
    assert "have not been rebuilt" in advice and "reverse parameters() order" in advice
    assert "find_unused_parameters" in advice


def test_torchs_rebuilt_mixed_dtype_buckets_are_out_of_order_and_blamed_on_its_dtype_order_not_a_rebuild():
    # instrument() of torch's DDP on fp32 layers under a bf16 head: torch's rebuild puts the fp32 bucket
    # first although the bf16 one is ready first, every step (measured on torch 2.13, gloo).
    layouts = [_layout("initial", 0, "bfloat16", "float32"), _layout("rebuilt", 1, "float32", "bfloat16")]
    stats = bucket_stats(layouts, [_row(step=s, **_LATE) for s in range(1, 5)])
    assert [b.out_of_order for b in stats] == [0, 4] and stats[1].order_penalty_s == pytest.approx(0.010)
    advice = stats[1].advice
    assert "holds bfloat16 and bucket 0 float32" in advice and "one dtype" in advice
    assert "not rebuilt again" in advice and "find_unused_parameters" not in advice


def test_the_same_mixed_dtype_wait_under_ddpscopes_engine_is_blamed_on_the_gradient_order_not_torch():
    # The engine orders rebuilt buckets as they become ready: a wait there means the order changed since.
    layouts = [_layout("initial", 0, "bfloat16", "float32"), _layout("rebuilt", 1, "float32", "bfloat16")]
    rows = [_row(step=s, **_LATE) for s in range(1, 5)]
    advice = bucket_stats(layouts, rows, engine="ddpscope")[1].advice
    assert "gradients now arrive in another order" in advice and "hash map" not in advice
    assert "hash map" in bucket_stats(layouts, rows, engine="torch")[1].advice


def test_the_engines_rebuilt_mixed_dtype_buckets_ready_in_index_order_are_in_order_with_no_advice():
    layouts = [_layout("initial", 0, "bfloat16", "float32"), _layout("rebuilt", 1, "bfloat16", "float32")]
    stats = bucket_stats(layouts, [_row(step=s) for s in range(1, 5)])
    assert [(b.out_of_order, b.waits_for, b.advice) for b in stats] == [(0, None, None), (0, None, None)]


def test_timeline_puts_every_rank_on_one_clock_from_the_earliest_start():
    rows = [_row(rank=0, fs=100, fe=110, bs=110, be=140), _row(rank=1, fs=102, fe=112, bs=112, be=140)]
    tl = timeline(0, rows)
    assert tl is not None
    assert tl.ranks[0].forward == (0.0, pytest.approx(0.010))
    assert tl.ranks[1].forward == (pytest.approx(0.002), pytest.approx(0.012))
    assert tl.ranks[1].buckets[0].allreduce == (pytest.approx(-0.080), pytest.approx(-0.072))
    assert timeline(5, rows) is None


def _rows(**kw):
    return step_rows_from_wire(synth_job(**kw))


def test_a_healthy_noisy_job_flags_nobody():
    # 4 ranks with ±30 % per-step jitter (an oversubscribed 2-core machine) and a few huge outliers.
    rows = _rows(world_size=4, steps=40, buckets=4, jitter=0.3, seed=7)
    rng = random.Random(3)
    for r in rng.sample(rows, 12):  # a rank losing the CPU for a whole step, now and then
        r.bucket_ready_ns = [t + 40 * MS for t in r.bucket_ready_ns]
    assert [s.rank for s in stragglers(rows) if s.flagged] == []


@pytest.mark.parametrize("slow_rank", [0, 3])
def test_a_rank_fifty_percent_slower_is_flagged_alone(slow_rank):
    rows = _rows(world_size=4, steps=30, buckets=4, slow_rank=slow_rank, slowdown=1.5, jitter=0.2, seed=1)
    result = stragglers(rows)
    assert [s.rank for s in result if s.flagged] == [slow_rank]
    top = result[0]
    assert top.rank == slow_rank and 1.3 < top.slowdown < 1.7
    assert top.steps_flagged > top.steps_considered // 2
    others = [s for s in result if s.rank != slow_rank]
    assert all(o.wait_s > top.wait_s for o in others)  # the others wait in all-reduce for it


def test_straggler_phase_names_forward_when_only_forward_is_slow():
    rows = _rows(world_size=3, steps=20, buckets=2, jitter=0.05)
    for r in rows:
        if r.rank == 2:
            extra = 20 * MS  # forward twice as long; backward unchanged
            r.forward_end_ns += extra
            r.backward_start_ns += extra
            r.bucket_ready_ns = [t + extra for t in r.bucket_ready_ns]
    (top,) = [s for s in stragglers(rows) if s.flagged]
    assert (top.rank, top.phase) == (2, "forward")


def _slow_loader_rows(
    slow_rank: int,
    loader_ms: int,
    world_size: int = 4,
    steps: int = 20,
    blocked_ms: Callable[[int, int], int] = lambda rank, step: 0,
) -> list[StepRow]:
    """Ranks in lockstep (they all leave the step when the last bucket's all-reduce ends); between
    steps each loads its next batch for 2-4 ms, ``slow_rank`` for ``loader_ms`` more, so its forward
    starts late while its compute is as fast as anyone's; and each is blocked in some other collective
    for ``blocked_ms(rank, step)`` ms before it starts (its ``blocked_between_ns``)."""
    rng = random.Random(5)
    rows, end = [], 0
    for step in range(steps):
        blocked = {r: blocked_ms(r, step) if step else 0 for r in range(world_size)}
        starts = {
            r: end + rng.randint(2, 4) + (loader_ms if r == slow_rank else 0) + blocked[r]
            for r in range(world_size)
        }
        last_ready = max(starts.values()) + 30
        comm_end = last_ready + 8
        for r, fs in starts.items():
            ready = (fs + 20, fs + 30)
            ends = (max(ready[0], last_ready - 10) + 8, comm_end)
            rows.append(_row(r, step, fs, fs + 10, fs + 10, comm_end + 1, ready, ready, ends))
            rows[-1].blocked_between_ns = blocked[r] * MS
        end = comm_end + 1
    return rows


def test_a_rank_with_a_slow_data_loader_is_flagged_alone_in_the_time_between_steps():
    rows = _slow_loader_rows(slow_rank=1, loader_ms=20)
    result = stragglers(rows)
    assert [s.rank for s in result if s.flagged] == [1], result
    (slow,) = [s for s in result if s.flagged]
    assert slow.phase == "between_steps" and slow.forward_slowdown == pytest.approx(1.0)
    assert all(o.wait_s > slow.wait_s for o in result if o.rank != 1)  # the others wait for it


def test_a_slow_data_loader_is_still_flagged_when_the_others_wait_for_it_in_a_buffer_broadcast():
    # A model with BatchNorm: every forward begins with a broadcast of the buffers, so the fast ranks
    # wait for the slow one inside their own forward, and all start computing together.
    rows = _slow_loader_rows(slow_rank=1, loader_ms=20)
    for step in {r.step for r in rows}:
        of_step = [r for r in rows if r.step == step]
        last_start = max(r.forward_start_ns for r in of_step)
        for r in of_step:
            wait = last_start - r.forward_start_ns
            r.forward_end_ns += wait
            r.backward_start_ns += wait
            r.bucket_ready_ns = [t + wait for t in r.bucket_ready_ns]
            r.blocked_forward_ns = wait
    result = stragglers(rows)
    assert [s.rank for s in result if s.flagged] == [1], result
    assert next(s for s in result if s.flagged).phase == "between_steps"
    for r in rows:
        r.blocked_forward_ns = 0  # what an agent that does not measure the wait would send
    assert [s.rank for s in stragglers(rows) if s.flagged] == []


def test_ranks_waiting_for_each_other_in_a_subgroup_between_steps_are_not_flagged():
    # Ranks 0 and 1 all-reduce a metric on their own group after each step; whichever is first waits
    # for the other, a long time on an oversubscribed machine, and none of it is its own work.
    def waits(rank: int, step: int) -> int:
        return (12 if (rank + step) % 2 else 9) if rank in (0, 1) else 0

    assert [s.rank for s in stragglers(_slow_loader_rows(-1, 0, blocked_ms=waits)) if s.flagged] == []
    unmeasured = _slow_loader_rows(-1, 0, blocked_ms=waits)
    for r in unmeasured:
        r.blocked_between_ns = 0  # what an agent that does not measure the wait would send
    assert sorted(s.rank for s in stragglers(unmeasured) if s.flagged) == [0, 1]


def test_the_same_loader_on_every_rank_flags_nobody():
    rows = _slow_loader_rows(slow_rank=-1, loader_ms=20)
    assert [s.rank for s in stragglers(rows) if s.flagged] == []


def test_unused_parameters_are_aggregated_by_name_across_ranks_and_steps():
    found = aggregate_unused([(0, 1, ["a"]), (1, 1, ["a", "b"]), (1, 2, ["a"])])
    # Steps, not (rank, step) pairs: "a" was unused in steps 1 and 2.
    assert [(u.name, u.ranks, u.steps) for u in found] == [("a", [0, 1], 2), ("b", [1], 1)]


def test_find_unused_parameters_without_any_unused_parameter_is_called_out():
    report = unused_report([], find_unused_parameters=True, steps_seen=50)
    assert report.advice is not None and "set it to False" in report.advice
    assert unused_report([], find_unused_parameters=False, steps_seen=50).advice is None


def test_parameters_unused_under_torchs_static_graph_are_not_said_to_hang():
    found = aggregate_unused([(0, 1, ["head.weight"]), (1, 1, ["head.weight"])])
    plain = unused_report(found, find_unused_parameters=False, steps_seen=10)
    assert plain.advice is not None and "this hangs or fails" in plain.advice
    static = unused_report(found, find_unused_parameters=False, steps_seen=10, static_graph=True)
    assert static.advice is not None and "static_graph=True handles" in static.advice
    assert "hangs" not in static.advice


def test_trace_has_one_process_per_rank_and_communication_on_its_own_track():
    rows = _rows(world_size=2, steps=2, buckets=3)
    events = trace_events("synth", rows)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {e["name"] for e in spans if e["tid"] == 0} == {"forward", "backward"}
    assert {e["name"] for e in spans if e["tid"] == 1} == {"all-reduce b0", "all-reduce b1", "all-reduce b2"}
    assert min(e["ts"] for e in spans) == 0.0
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}


def test_the_traces_order_penalty_track_is_the_wait_for_a_predecessor_not_launch_latency():
    (row,) = _rows(world_size=1, steps=1, buckets=2)
    t = row.backward_start_ns
    # Bucket 0 is launched 0.4 ms after its last gradient (latency, no predecessor); bucket 1 is ready
    # first and waits 3 ms for bucket 0 to launch.
    row.bucket_ready_ns = [t + 4 * MS, t + 1 * MS]
    row.allreduce_start_ns = [t + 4 * MS + 400_000, t + 4 * MS + 500_000]
    row.allreduce_end_ns = [t + 6 * MS, t + 7 * MS]
    waits = [e for e in trace_events("synth", [row])["traceEvents"] if e.get("tid") == 3 and e["ph"] == "X"]
    assert [(e["name"], e["dur"]) for e in waits] == [("wait for b0 b1", 3400.0)]
    (b1,) = [b for b in timeline(row.step, [row]).ranks[0].buckets if b.index == 1]
    assert b1.order_penalty_s == pytest.approx(3.4e-3)  # what the timeline says of the same wait


def test_all_to_alls_differing_only_in_their_split_sizes_are_no_mismatch():
    base = {
        "pg": "default",
        "coll_seq": 3,
        "op": "all_to_all_single",
        "reduce_op": None,
        "dtypes": ["float32"],
    }
    colls = [{**base, "rank": 0, "shapes": [[2, 8]]}, {**base, "rank": 1, "shapes": [[6, 8]]}]
    assert mismatches(colls) == []
    assert len(mismatches([*colls[:1], {**colls[1], "shapes": [[6, 4]]}])) == 1


def test_ranks_issuing_different_collectives_at_one_sequence_number_are_a_mismatch():
    base = {
        "pg": "default",
        "coll_seq": 7,
        "op": "all_reduce",
        "reduce_op": "SUM",
        "shapes": [[4]],
        "dtypes": ["float32"],
    }
    colls = [{**base, "rank": 0}, {**base, "rank": 1, "shapes": [[5]]}, {**base, "rank": 0, "coll_seq": 8}]
    (m,) = mismatches(colls)
    assert (m.pg, m.coll_seq, sorted(m.signatures)) == ("default", 7, [0, 1])


def _row_from_blob(row: StepRow) -> object:
    """What the database hands back: the scalar columns and the packed blob."""
    from types import SimpleNamespace

    from ddpscope.agent import records as wire

    blob = wire.pack_step_arrays([getattr(row, n) for n in wire.STEP_ARRAYS])
    return SimpleNamespace(**{k: getattr(row, k) for k in ("rank", "step", "synced", "forward_start_ns",
        "forward_end_ns", "backward_start_ns", "backward_end_ns", "time_ns", "stream", "seq", *wire.BLOCKED_FIELDS)},
        arrays=blob)  # fmt: skip


def test_metrics_read_from_a_packed_page_equal_those_of_fully_unpacked_rows():
    from ddpscope.server.analysis.steps import page_metrics
    from ddpscope.server.step_page import SCALARS, StepPage

    rng = random.Random(7)
    rows = step_rows_from_wire(synth_job(4, 30, 12))
    # Arrays that cross a 2**32 ns boundary (their low bytes wrap), in-flight spans, empty arrays.
    t0 = (1 << 32) * 400_000_000 - 3_000_000
    for r in rows[:20]:
        n = len(r.bucket_ready_ns)
        r.bucket_ready_ns = [t0 + rng.randint(0, 6_000_000) for _ in range(n)]
        r.allreduce_start_ns = sorted(t0 + rng.randint(0, 6_000_000) for _ in range(n))
        r.allreduce_end_ns = [s + rng.randint(-1000, 900_000) for s in r.allreduce_start_ns]
    rows[20].bucket_ready_ns = rows[20].allreduce_start_ns = rows[20].allreduce_end_ns = []
    db_rows = [_row_from_blob(r) for r in rows]
    page = StepPage.from_db([tuple(getattr(d, name) for name in (*SCALARS, "arrays")) for d in db_rows])
    assert (
        page_metrics(page)
        == [step_metrics(StepRow.from_db(d)) for d in db_rows]
        == list(map(step_metrics, rows))
    )


def test_a_slowdown_is_attributed_to_the_phase_holding_the_extra_seconds_not_the_larger_ratio():
    # Rank 3 sleeps 12 ms more in forward; its 0.3 ms backward also happens to take 0.8 ms (a scheduler
    # hiccup): a larger ratio, but a few hundred microseconds of the 12.5 ms it is behind.
    ms = 1_000_000
    rows = []
    for step in range(20):
        for rank in range(4):
            fwd, bwd = (32 * ms, 0.8 * ms) if rank == 3 else (20 * ms, 0.3 * ms)
            t0 = step * 100 * ms
            ready = t0 + fwd + int(bwd)
            rows.append(StepRow(rank=rank, step=step, synced=True, forward_start_ns=t0, forward_end_ns=t0 + fwd,
                backward_start_ns=t0 + fwd, backward_end_ns=t0 + 40 * ms, bucket_ready_ns=[ready],
                allreduce_start_ns=[ready], allreduce_end_ns=[t0 + 40 * ms], bucket_bytes=[4], ready_order=[0],
                collective_seqs=[step + 1]))  # fmt: skip
    (slow,) = [s for s in stragglers(rows) if s.flagged]
    assert slow.rank == 3 and slow.phase == "forward"
    assert slow.backward_slowdown > slow.forward_slowdown  # the ratios alone would have said backward
