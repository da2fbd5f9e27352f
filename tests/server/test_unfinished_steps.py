"""The step a job hung or crashed in has no step records (a rank sends one at the end of its backward):
its timeline and trace come from the ranks' hang and error reports (``partial_step``), and ranks that
stopped elsewhere say where. Synthetic records through the real ingest route and a real SQLite file."""

from __future__ import annotations

import time
from typing import Any

from ddpscope.server.analysis.snapshot import current_process_reports
from ddpscope.server.analysis.stops import stops
from tests.server.conftest import post
from tests.support.synth import by_rank, synth_job

MS = 1_000_000


def _feed(client: Any, records: list[dict[str, Any]]) -> None:
    for rank_records in by_rank(records).values():
        r = post(client, rank_records)
        assert r.status_code == 200, r.text


def _report(base: dict[str, Any], kind: str, rank: int, seq: int, t_ns: int, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "job": base["job"], "rank": rank, "stream": f"{base['job']}-r{rank}", "seq": seq,
            "time_ns": t_ns, **fields}  # fmt: skip


def _hang(base: dict[str, Any], rank: int, t_ns: int, phase: str, step: int, partial: Any) -> dict[str, Any]:
    return _report(base, "hang", rank, 10_000, t_ns, phase=phase, step=step, stalled_s=5.0, pending_buckets=[],
                   inflight=[], stacks=[], message=f"rank {rank} made no progress", partial_step=partial)  # fmt: skip


def _partial(t0: int, step: int) -> dict[str, Any]:
    """Step ``step`` of a 2-bucket job, stopped in its all-reduces: bucket 0's done, bucket 1's in flight."""
    return {"step": step, "synced": True, "forward_start_ns": t0, "forward_end_ns": t0 + 10 * MS,
            "backward_start_ns": t0 + 11 * MS, "bucket_ready_ns": [t0 + 15 * MS, t0 + 20 * MS],
            "allreduce_start_ns": [t0 + 16 * MS, t0 + 21 * MS], "allreduce_end_ns": [t0 + 19 * MS, 0],
            "bucket_bytes": [4096, 4096]}  # fmt: skip


def _hung_job() -> tuple[list[dict[str, Any]], int]:
    """Steps 0-2 on both ranks; then rank 0 hangs in step 3's all-reduce, and rank 1 between steps 2 and 3."""
    records = synth_job(2, 3, 2, finished=False)
    t0 = max(r["time_ns"] for r in records) + MS
    base = records[0]
    records += [
        _hang(base, 0, t0 + 5_000 * MS, "allreduce", 3, _partial(t0, 3)),
        _hang(base, 1, t0 + 5_000 * MS, "idle", 2, None),
    ]
    return records, t0


def test_the_step_a_job_hung_in_is_drawn_from_the_hang_reports_with_its_open_all_reduce(client: Any) -> None:
    records, _ = _hung_job()
    _feed(client, records)
    tl = client.get("/api/v1/jobs/synth/timeline").json()  # no step: the one the job is in
    assert tl["step"] == 3 and tl == client.get("/api/v1/jobs/synth/timeline?step=3").json()
    (rank0,) = tl["ranks"]
    assert (rank0["rank"], rank0["state"], rank0["phase"]) == (0, "hung", "allreduce")
    assert rank0["message"] == "rank 0 made no progress"
    assert rank0["forward"] == [0.0, 0.01] and rank0["backward"] == [0.011, rank0["until"]]
    assert rank0["until"] >= 5.0  # the report's time (or later: the rank was last heard from then)
    done, in_flight = rank0["buckets"]
    assert done["allreduce"] == [0.016, 0.019] and not done["open"]
    assert in_flight["allreduce"] == [0.021, rank0["until"]] and in_flight["open"]
    assert rank0["exposed_comm_s"] is None and rank0["overlap_ratio"] is None
    # Rank 1 has no record of step 3: it stopped between steps 2 and 3, which its own report says.
    assert tl["elsewhere"] == [
        {"rank": 1, "state": "hung", "step": 2, "phase": "idle", "message": "rank 1 made no progress"}
    ]
    # Steps both ranks finished are unchanged.
    finished = client.get("/api/v1/jobs/synth/timeline?step=2").json()
    assert [r["state"] for r in finished["ranks"]] == ["completed", "completed"] and finished[
        "elsewhere"
    ] == []


def test_the_trace_draws_the_unfinished_step_and_marks_where_each_rank_stopped(client: Any) -> None:
    records, _ = _hung_job()
    _feed(client, records)
    trace = client.get("/api/v1/jobs/synth/trace?start=3&end=3").json()["traceEvents"]
    unfinished = {(e["pid"], e["name"]) for e in trace if e["ph"] == "X"}
    assert unfinished == {(0, "forward"), (0, "backward (unfinished)"), (0, "all-reduce b0"),
                          (0, "all-reduce b1 (unfinished)")}  # fmt: skip
    marks = [e for e in trace if e["ph"] == "i" and e.get("s") == "p"]
    assert [(m["pid"], m["name"]) for m in marks] == [(0, "hung in allreduce (step 3)")]
    whole = client.get("/api/v1/jobs/synth/trace").json()["traceEvents"]
    assert {(m["pid"], m["name"]) for m in whole if m["ph"] == "i" and m.get("s") == "p"} == {
        (0, "hung in allreduce (step 3)"),
        (1, "hung between steps (after step 2)"),
    }
    # Steps before the stops: no marks.
    early = client.get("/api/v1/jobs/synth/trace?start=0&end=1").json()["traceEvents"]
    assert not [e for e in early if e["ph"] == "i" and e.get("s") == "p"]


def test_a_resolved_hang_or_a_restart_leaves_no_unfinished_step(client: Any) -> None:
    records, t0 = _hung_job()
    base = records[0]
    resolved = _report(base, "hang_resolved", 0, 10_001, t0 + 6_000 * MS, step=3, hang_s=6.0)
    _feed(client, [*records, resolved])
    tl = client.get("/api/v1/jobs/synth/timeline").json()
    assert tl["step"] == 2 and client.get("/api/v1/jobs/synth/timeline?step=3").status_code == 404
    assert client.get("/api/v1/jobs/synth/timeline?step=2").json()["elsewhere"] == []  # rank 1 has its row

    # A restarted rank 1 (a new stream): its report from before the restart describes a step run again.
    restarted = synth_job(2, 1, 2, finished=False, t0_ns=t0 + 7_000 * MS, seed=1)
    start = next(r for r in restarted if r["kind"] == "rank_start" and r["rank"] == 1)
    _feed(client, [{**start, "stream": "after-restart", "seq": 0}])
    assert client.get("/api/v1/jobs/synth/timeline?step=3").status_code == 404
    # (Its records are from long ago: it is silent now, but no longer hung in the step it left.)
    assert [e["state"] for e in client.get("/api/v1/jobs/synth/timeline?step=1").json()["elsewhere"]] == [
        "silent"
    ]


def test_a_rank_that_failed_mid_step_shows_its_failed_all_reduce_and_how_it_ended(client: Any) -> None:
    records = synth_job(2, 3, 2, finished=False)
    t0 = max(r["time_ns"] for r in records) + MS
    base = records[0]
    partial = _partial(t0, 3)
    error = _report(base, "rank_error", 0, 10_000, t0 + 40 * MS, step=3, phase="allreduce",
                    error_type="RuntimeError", message="Connection closed by peer", stack="...", fatal=False,
                    partial_step=partial)  # fmt: skip
    fatal = {
        **error,
        "seq": 10_001,
        "time_ns": t0 + 41 * MS,
        "phase": "idle",
        "fatal": True,
        "partial_step": None,
    }
    exit_ = _report(base, "rank_exit", 0, 10_002, t0 + 42 * MS, step=3, reason="error")
    _feed(client, [*records, error, fatal, exit_])
    (rank0,) = client.get("/api/v1/jobs/synth/timeline?step=3").json()["ranks"]
    assert rank0["state"] == "failed" and rank0["phase"] == "allreduce"
    assert rank0["message"] == "RuntimeError: Connection closed by peer (then it exited on an error)"
    assert rank0["buckets"][1]["open"] and rank0["buckets"][1]["allreduce"][1] == rank0["until"]


def test_a_partial_step_the_wire_format_refuses_is_a_422_naming_the_field(client: Any) -> None:
    records, t0 = _hung_job()
    bad = _hang(records[0], 0, t0, "backward", 3, {**_partial(t0, 3), "bucket_ready_ns": "soon"})
    r = post(client, [bad])
    assert r.status_code == 422 and "partial_step" in r.text and "bucket_ready_ns" in r.text


def test_a_rank_killed_outright_is_named_silent_in_the_step_it_never_reached_and_a_late_one_is_not(
    client: Any,
) -> None:
    # A minute ago: rank 0 failed in step 3 when rank 1, quiet since, was killed without a word.
    records = synth_job(2, 3, 2, finished=False, t0_ns=time.time_ns() - 60_000 * MS)
    t0 = max(r["time_ns"] for r in records) + MS
    base = records[0]
    error = _report(base, "rank_error", 0, 10_000, t0 + 40 * MS, step=3, phase="allreduce", error_type="RuntimeError",
                    message="Connection closed by peer", stack="...", fatal=True, partial_step=_partial(t0, 3))  # fmt: skip
    _feed(client, [*records, error])
    tl = client.get("/api/v1/jobs/synth/timeline?step=3").json()
    assert [r["rank"] for r in tl["ranks"]] == [0]
    (silent,) = tl["elsewhere"]
    assert (silent["rank"], silent["state"], silent["step"], silent["phase"]) == (1, "silent", 2, None)
    assert "s, after step 2: killed outright" in silent["message"], silent
    # A rank heard from a moment ago is late (its record may still come), not gone.
    beat = _report(
        base, "heartbeat", 1, 10_000, time.time_ns(), phase="forward", step=3, last_coll_seq=9, pid=1001
    )
    _feed(client, [beat])
    assert client.get("/api/v1/jobs/synth/timeline?step=3").json()["elsewhere"] == []


def test_a_restart_that_failed_in_its_set_up_is_where_the_ranks_stopped_not_the_step_the_old_processes_hung_in(
    client: Any,
) -> None:
    records, t0 = _hung_job()
    base = records[0]
    # torchrun stopped the hung attempt, then started every rank again: new processes (new streams) that
    # failed connecting in init_process_group, so before any rank_start of theirs.
    for rank in (0, 1):
        records.append(_report(base, "rank_exit", rank, 10_001, t0 + 6_000 * MS, step=3, reason="sigterm"))
        again = {"stream": f"synth-r{rank}-again", "seq": 0, "time_ns": t0 + 8_000 * MS}
        records.append({**_report(base, "rank_error", rank, 0, 0, step=0, phase="idle", error_type="DistStoreError",
                        message="timed out waiting for the store", stack="...", fatal=True), **again})  # fmt: skip
        records.append({**_report(base, "rank_exit", rank, 0, 0, step=0, reason="error"), **again,
                        "seq": 1, "time_ns": t0 + 8_001 * MS})  # fmt: skip
    _feed(client, records)
    tl = client.get("/api/v1/jobs/synth/timeline").json()
    # The old processes' hang in step 3 is history: every rank finished step 2, and step 3 is no stop of theirs.
    assert tl["step"] == 2 and [r["state"] for r in tl["ranks"]] == ["completed", "completed"]
    assert client.get("/api/v1/jobs/synth/timeline?step=3").status_code == 404
    # Where each rank stopped is its new process's failure.
    found = stops(current_process_reports("synth", sorted(records, key=lambda r: r["time_ns"])))
    assert {r: (s.state, s.message) for r, s in found.items()} == {
        rank: ("failed", "DistStoreError: timed out waiting for the store (then it exited on an error)")
        for rank in (0, 1)
    }


def test_a_crash_read_from_a_fatal_signal_file_has_no_phase_rather_than_phase_unknown(client: Any) -> None:
    # The shipper reads a SIGSEGV's faulthandler file after the process died: no step, no phase it could
    # know ("unknown" on the wire). Where it stopped says "failed", not "failed in unknown".
    records = synth_job(2, 3, 2, finished=False)
    t0 = max(r["time_ns"] for r in records) + MS
    base = records[0]
    records += [
        _report(base, "rank_error", 1, 10_000, t0 + 30 * MS, step=None, phase="unknown", error_type="SIGSEGV",
                message="Fatal Python error: Segmentation fault", stack="...", fatal=True),
        _report(base, "rank_error", 0, 10_000, t0 + 40 * MS, step=3, phase="allreduce", error_type="RuntimeError",
                message="Connection closed by peer", stack="...", fatal=True, partial_step=_partial(t0, 3)),
    ]  # fmt: skip
    found = stops(current_process_reports("synth", sorted(records, key=lambda r: r["time_ns"])))
    assert (found[1].state, found[1].phase) == ("failed", None)
    _feed(client, records)
    tl = client.get("/api/v1/jobs/synth/timeline?step=3").json()
    (rank1,) = [r for r in tl["ranks"] + tl["elsewhere"] if r["rank"] == 1]
    assert rank1["state"] == "failed" and rank1["phase"] is None, rank1
