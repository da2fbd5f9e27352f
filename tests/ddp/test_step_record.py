"""StepTimer: the engine-independent builder of 'step' records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddpscope import agent
from ddpscope.agent import ring
from ddpscope.agent.records import validate_record
from ddpscope.ddp.step_record import StepTimer
from tests.agent.conftest import spool_agent, spooled


def stamp(record: dict) -> dict:
    """What the agent adds before a record leaves the process."""
    return {**record, "job": "j", "stream": "s", "seq": 0, "time_ns": 1}


def test_a_synced_step_record_has_one_entry_per_bucket_in_the_order_they_happened() -> None:
    timer = StepTimer(rank=3, bucket_bytes=[400, 100])
    timer.forward_start(step=7, synced=True, t_ns=10)
    timer.forward_end(t_ns=20)
    timer.backward_start(t_ns=25)
    timer.backward_start(t_ns=99)  # a later hook does not move the start
    timer.bucket_ready(1, t_ns=30)
    timer.bucket_ready(0, t_ns=40)
    timer.allreduce_launched(0, coll_seq=5, t_ns=41)
    timer.allreduce_launched(1, coll_seq=6, t_ns=42)
    timer.allreduce_done(0, t_ns=50)
    timer.allreduce_done(1, t_ns=55)
    record = timer.finish(unused_parameters=["fc.bias"], backward_end_ns=60)
    assert validate_record(stamp(record)) == "step"
    assert record["rank"] == 3 and record["step"] == 7 and record["synced"] is True
    assert (record["forward_start_ns"], record["forward_end_ns"]) == (10, 20)
    assert (record["backward_start_ns"], record["backward_end_ns"]) == (25, 60)
    assert record["bucket_ready_ns"] == [40, 30]
    assert record["ready_order"] == [1, 0]
    assert record["allreduce_start_ns"] == [41, 42]
    assert record["allreduce_end_ns"] == [50, 55]
    assert record["collective_seqs"] == [5, 6]
    assert record["bucket_bytes"] == [400, 100]
    assert record["unused_parameters"] == ["fc.bias"]


def test_an_unsynced_step_has_no_bucket_entries_and_still_validates() -> None:
    timer = StepTimer(rank=0, bucket_bytes=[4])
    timer.forward_start(step=1, synced=False)
    timer.forward_end()
    record = timer.finish()
    assert validate_record(stamp(record)) == "step"
    assert record["synced"] is False
    assert record["bucket_ready_ns"] == record["allreduce_end_ns"] == record["bucket_bytes"] == []
    # No hook fired: backward is reported as an empty span at its end rather than as time 0.
    assert record["backward_start_ns"] == record["backward_end_ns"] >= record["forward_end_ns"]


def test_a_new_step_forgets_the_previous_steps_bucket_times() -> None:
    timer = StepTimer(rank=0, bucket_bytes=[4, 4])
    timer.forward_start(step=0)
    timer.bucket_ready(0)
    timer.allreduce_launched(0, coll_seq=1)
    timer.forward_start(step=1)
    record = timer.finish()
    assert record["bucket_ready_ns"] == [0, 0] and record["ready_order"] == []
    assert record["collective_seqs"] == [0, 0]


def test_a_relayout_changes_the_bucket_count_of_the_next_record() -> None:
    timer = StepTimer(rank=0, bucket_bytes=[8])
    timer.set_buckets([2, 2, 4])
    timer.forward_start(step=0)
    assert timer.finish()["bucket_bytes"] == [2, 2, 4]


def test_device_measured_bucket_times_replace_the_host_ones_but_keep_the_ready_order() -> None:
    timer = StepTimer(rank=0, bucket_bytes=[4, 4])
    timer.forward_start(step=0, t_ns=1)
    timer.bucket_ready(1, t_ns=5)
    timer.bucket_ready(0, t_ns=6)
    timer.set_bucket_times([16, 15], [17, 18], [20, 21])
    record = timer.finish(backward_end_ns=30)
    assert record["bucket_ready_ns"] == [16, 15]
    assert record["allreduce_start_ns"] == [17, 18] and record["allreduce_end_ns"] == [20, 21]
    assert record["ready_order"] == [1, 0]


def a_step(timer: StepTimer, step: int, *, synced: bool = True, ready: tuple[int, ...] = (1, 0)) -> None:
    timer.forward_start(step=step, synced=synced, t_ns=10 + step)
    timer.forward_end(t_ns=20 + step)
    timer.backward_start(t_ns=25 + step)
    if synced:
        for k in ready:
            timer.bucket_ready(k, t_ns=30 + k)
            timer.allreduce_launched(k, coll_seq=5 + k + 2 * step, t_ns=41 + k)
            timer.allreduce_done(k, t_ns=50 + k)


ENVELOPE = ("job", "stream", "seq", "time_ns")


def test_emit_makes_each_step_record_crash_durable_and_identical_to_finish_whatever_its_shape(
    tmp_path: Path,
) -> None:
    a = spool_agent(tmp_path, "steps", rank=3)
    timer = StepTimer(rank=3, bucket_bytes=[400, 100])
    expected = []
    try:
        # Synced, twice with the same shape (one template), then unsynced, then unused parameters, then a
        # failed step whose bucket 0 never became ready, then a new layout.
        shapes: list[tuple[dict[str, Any], list[str]]] = [
            ({}, []), ({}, []), ({"synced": False}, []), ({}, ["fc.bias"]), ({"ready": (1,)}, []),
        ]  # fmt: skip
        for step, (kwargs, unused) in enumerate(shapes):
            a_step(timer, step, **kwargs)
            expected.append(timer.finish(unused, backward_end_ns=60 + step))
            timer.emit(unused, backward_end_ns=60 + step)
        timer.set_buckets([8, 8, 8])
        a_step(timer, 9, ready=(2, 1, 0))
        expected.append(timer.finish(backward_end_ns=70))
        timer.emit(backward_end_ns=70)

        # Before any spool write: the ring alone has every step, as a crash would leave it.
        in_ring = sorted(
            (r for r in ring.read_ring(str(tmp_path), a.exporter.prefix) if r["kind"] == "step"),
            key=lambda r: r["step"],
        )
        assert a.flush_local(10.0)
        in_spool = sorted((r for r in spooled(tmp_path) if r["kind"] == "step"), key=lambda r: r["step"])
        assert in_ring == in_spool
        assert [{k: v for k, v in r.items() if k not in ENVELOPE} for r in in_spool] == expected
        assert all(validate_record(r) == "step" for r in in_spool)
    finally:
        agent.shutdown(2.0)


def test_a_step_record_the_wire_format_refuses_as_a_template_still_goes_out_as_a_dict() -> None:
    exporter = agent.InMemoryExporter()
    agent.configure(job="odd", rank=0, exporter=exporter, flush_interval_s=60)
    try:
        timer = StepTimer(rank=0, bucket_bytes=[4])
        a_step(timer, 0, ready=(0,))
        timer.emit([7])  # type: ignore[list-item]  # not a name: no template; the agent counts it
        assert agent.get_agent().flush_local(10.0)
        assert [r for r in exporter.records if r["kind"] == "step"] == []
        assert agent.get_agent().stats()["dropped"] == {"invalid:step": 1}
    finally:
        agent.shutdown(2.0)


def test_time_blocked_in_other_collectives_is_split_by_phase_from_the_previous_records_end() -> None:
    from ddpscope.ddp.collectives import RECORDER

    blocked = RECORDER.blocked_time()  # this thread's: what the recorder adds a user's collective to
    timer = StepTimer(rank=0, bucket_bytes=[4])
    blocked.ns += 1_000  # before any step: nobody's between-steps time
    timer.forward_start(step=0)
    blocked.ns += 20  # a buffer broadcast in forward
    timer.forward_end()
    blocked.ns += 3  # a SyncBatchNorm all-reduce in backward
    first = timer.finish()
    blocked.ns += 400  # the loss all-reduced for logging after the optimizer step
    timer.forward_start(step=1)
    timer.forward_end()
    second = timer.finish()
    assert validate_record(stamp(first)) == validate_record(stamp(second)) == "step"
    spans = [tuple(r[f"blocked_{p}_ns"] for p in ("between", "forward", "backward")) for r in (first, second)]
    assert spans == [(0, 20, 3), (400, 0, 0)]


def test_collectives_blocked_in_by_another_thread_do_not_count_for_the_training_thread() -> None:
    import threading

    from ddpscope.ddp.collectives import RECORDER

    timer = StepTimer(rank=0, bucket_bytes=[4])
    timer.forward_start(step=0)
    other = threading.Thread(target=lambda: setattr(RECORDER.blocked_time(), "ns", 10**9))
    other.start()
    other.join()
    timer.forward_end()
    record = timer.finish()
    assert (record["blocked_forward_ns"], record["blocked_backward_ns"]) == (0, 0)


def test_the_step_so_far_has_what_happened_and_zeros_for_what_had_not() -> None:
    timer = StepTimer(rank=1, bucket_bytes=[400, 100])
    assert timer.partial() is None  # no step yet
    timer.forward_start(step=4, t_ns=10)
    timer.forward_end(t_ns=20)
    timer.backward_start(t_ns=25)
    timer.bucket_ready(1, t_ns=30)
    timer.allreduce_launched(0, coll_seq=5, t_ns=41)
    partial = timer.partial()
    assert partial == {
        "step": 4,
        "synced": True,
        "forward_start_ns": 10,
        "forward_end_ns": 20,
        "backward_start_ns": 25,
        "bucket_ready_ns": [0, 30],
        "allreduce_start_ns": [41, 0],
        "allreduce_end_ns": [0, 0],
        "bucket_bytes": [400, 100],
    }
    # A copy: the hang report keeps what it saw while the step goes on.
    timer.allreduce_done(0, t_ns=50)
    assert partial["allreduce_end_ns"] == [0, 0]
    hang = stamp({"kind": "hang", "rank": 1, "phase": "backward", "step": 4, "stalled_s": 1.0,
                  "pending_buckets": [], "inflight": [], "stacks": [], "message": "m", "partial_step": partial})  # fmt: skip
    assert validate_record(hang) == "hang"
    # An unsynchronised step all-reduces no bucket: no bucket arrays.
    timer.forward_start(step=5, synced=False, t_ns=60)
    assert timer.partial() == {**partial, "step": 5, "synced": False, "forward_start_ns": 60,
                               "forward_end_ns": 0, "backward_start_ns": 0, "bucket_ready_ns": [],
                               "allreduce_start_ns": [], "allreduce_end_ns": [], "bucket_bytes": []}  # fmt: skip
