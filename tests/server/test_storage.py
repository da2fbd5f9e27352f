"""Storage contract, run against a real SQLite file and a real PostgreSQL."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import msgspec
import pytest
from sqlalchemy import select, text

from ddpscope.agent import records as wire
from ddpscope.agent.transport import encode_records
from ddpscope.server import migrations, schema
from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.jobs import rank_table, summarize
from ddpscope.server.analysis.snapshot import snapshot_from_records
from ddpscope.server.analysis.status import job_status, liveness
from ddpscope.server.analysis.steps import page_metrics, page_timings, step_metrics
from ddpscope.server.analysis.stragglers import WINDOW_STEPS, stragglers
from ddpscope.server.codec import decode_batch, kind_of
from ddpscope.server.storage import ALL_KINDS, Storage
from tests.server.conftest import decoded
from tests.server.test_incidents import T0, JobRecords, started
from tests.support.synth import T0_NS, by_rank, synth_job

LATEST_ONLY = {"heartbeat", "agent_stats"}


def _latest(records, kind):
    out = {}
    for r in records:
        if r["kind"] == kind:
            out[(r["rank"], r["stream"]) if kind == "agent_stats" else r["rank"]] = r
    return sorted(out.values(), key=lambda r: (r["time_ns"], r["rank"], r["seq"]))


def test_records_come_back_wire_shaped_exactly_as_they_were_sent(storage):
    records = synth_job(3, 4, 3, unused={2: ["layers.0.bias"]}, find_unused=True)
    rank1 = [r for r in records if r["rank"] == 1]
    records.append(
        {**{k: rank1[0][k] for k in ("job", "rank", "stream")}, "kind": "warning", "seq": rank1[-1]["seq"] + 1,
         "time_ns": records[-1]["time_ns"], "step": 2, "code": "unsynced_gradients", "message": "drift",
         "parameters": ["layers.0.weight"], "call_site": None}
    )  # fmt: skip
    records.append(
        {**{k: rank1[0][k] for k in ("job", "rank", "stream")}, "kind": "replica_digest", "seq": rank1[-1]["seq"] + 2,
         "time_ns": records[-1]["time_ns"], "step": 2, "syncs": 2, "model": 0, "parameters": 2, "group": 1,
         "norms": [0.125, -1.0]}
    )  # fmt: skip
    storage.write_batch(decoded(records))
    for kind in ALL_KINDS:
        got = storage.fetch_records("synth", [kind])
        if kind in LATEST_ONLY:
            expected = _latest(records, kind)
        else:
            expected = [r for r in records if r["kind"] == kind]
        key = lambda r: (r["rank"], r["seq"])  # noqa: E731
        assert sorted(got, key=key) == sorted(expected, key=key), kind


def test_a_resent_batch_is_all_duplicates_and_changes_nothing(storage):
    records = synth_job(2, 3, 2)
    first = storage.write_batch(decoded(records))
    assert (first.accepted, first.duplicates) == (len(records), 0)
    again = storage.write_batch(decoded(records))
    assert (again.accepted, again.duplicates) == (0, len(records))
    assert storage.load_snapshot("synth").steps[0].count == 3
    assert storage.counters()["ingested_records"] == len(records)


def test_a_batch_that_fails_midway_stores_nothing(storage):
    records = synth_job(2, 3, 2)
    good = decoded(records)
    # A record the decoder would refuse, built directly so that it fails inside the transaction,
    # after everything before it was written: the database rejects an integer beyond int64.
    step = next(r for r in good if kind_of(r) == "step")
    poison = msgspec.structs.replace(step, seq=2**63)
    with pytest.raises(Exception):  # noqa: B017 - the driver's overflow error differs per database
        storage.write_batch([*good, poison])
    assert storage.job_row("synth") is None
    assert storage.fetch_records("synth") == []
    assert "ingested_records" not in storage.counters()


def test_the_stored_snapshot_equals_the_one_built_from_the_records(storage):
    records = synth_job(4, 6, 3, slow_rank=1, unused={3: ["layers.1.weight"]})
    for rank_records in by_rank(records).values():  # as the agents send them: one rank per batch
        storage.write_batch(decoded(rank_records))
    stored = storage.load_snapshot("synth")
    built = snapshot_from_records("synth", records)
    assert stored is not None
    for field in (
        "job",
        "world_size",
        "ranks",
        "layouts",
        "heartbeats",
        "hangs",
        "rank_exits",
        "agent_stats",
        "unused",
    ):
        assert getattr(stored, field) == getattr(built, field), field
    assert stored.steps == built.steps
    assert stored.rank_last_seen_s == built.rank_last_seen_s
    key = lambda c: (c["pg"], c["coll_seq"], c["rank"])  # noqa: E731
    assert sorted(stored.collectives, key=key) == sorted(built.collectives, key=key)
    assert all(c["end_ns"] is not None and c["ok"] for c in stored.collectives)


def test_step_windows_and_cursor_order_by_step_then_rank(storage):
    storage.write_batch(decoded(synth_job(3, 10, 2)))
    job_id = storage.job_id("synth")
    rows = storage.steps(job_id, start=4, end=6)
    assert [(r.step, r.rank) for r in rows] == [(s, r) for s in (4, 5, 6) for r in range(3)]
    page = storage.steps(job_id, after=(4, 1), limit=2)
    assert [(r.step, r.rank) for r in page] == [(4, 2), (5, 0)]
    assert {r.step for r in storage.recent_steps(job_id, 3)} == {7, 8, 9}
    assert len(rows[0].bucket_ready_ns) == 2


def test_heartbeats_keep_only_the_newest_per_rank_even_when_an_older_one_arrives_late(storage):
    records = [r for r in synth_job(1, 5, 1) if r["kind"] == "heartbeat"]
    storage.write_batch(decoded(records[3:]))
    late = storage.write_batch(decoded(records[:3]))
    assert late.accepted == 0
    (hb,) = storage.fetch_records("synth", ["heartbeat"])
    assert hb == records[-1]


def test_the_schema_is_versioned_and_reopening_does_not_migrate_again(storage, db_url):
    with storage.engines.reader.connect() as conn:
        assert conn.execute(select(schema.schema_version.c.version)).scalar_one() == migrations.LATEST
    storage.write_batch(decoded(synth_job(1, 1, 1)))
    again = Storage.open(db_url)
    try:
        assert migrations.migrate(again.engines.writer) == migrations.LATEST
        assert again.job_row("synth") is not None
    finally:
        again.close()


@contextlib.contextmanager
def reopened(db_url: str, records: list[dict]) -> Iterator[Storage]:
    """The database opened again, migrated to the latest schema; its step records read as written."""
    again = Storage.open(db_url)
    try:
        assert migrations.migrate(again.engines.writer) == migrations.LATEST
        key = lambda r: (r["rank"], r["seq"])  # noqa: E731
        expected = [r for r in records if r["kind"] == "step"]
        assert sorted(again.fetch_records("synth", ["step"]), key=key) == sorted(expected, key=key)
        yield again
    finally:
        again.close()


def test_a_version_1_database_with_msgpack_step_arrays_is_repacked_on_open_and_reads_the_same(
    storage, db_url
):
    records = synth_job(2, 3, 2)
    storage.write_batch(decoded(records))
    to_msgpack = msgspec.msgpack.Encoder().encode
    t = schema.steps
    with storage.engines.writer.begin() as conn:  # turn it back into what a version-1 collector wrote
        for row in conn.execute(select(t.c.job_id, t.c.rank, t.c.stream, t.c.seq, t.c.arrays)).all():
            old = to_msgpack(wire.unpack_step_arrays(row.arrays))
            key = (
                (t.c.job_id == row.job_id)
                & (t.c.rank == row.rank)
                & (t.c.stream == row.stream)
                & (t.c.seq == row.seq)
            )
            conn.execute(t.update().where(key).values(arrays=old))
        conn.execute(schema.schema_version.update().values(version=1))
    with reopened(db_url, records):
        pass  # reopening checks it


def test_a_version_2_database_gets_the_blocked_time_columns_on_open_and_its_steps_read_as_zero(
    storage, db_url
):
    records = synth_job(2, 3, 2)
    storage.write_batch(decoded(records))
    with storage.engines.writer.begin() as conn:  # what a version-2 collector created
        for name in wire.BLOCKED_FIELDS:
            conn.execute(text(f"ALTER TABLE steps DROP COLUMN {name}"))
        conn.execute(schema.schema_version.update().values(version=2))
    with reopened(db_url, records) as again:
        newer = synth_job(2, 4, 2)[-12:]  # and the next steps store their blocked times again
        again.write_batch(
            decoded([{**r, "blocked_between_ns": 5} if r["kind"] == "step" else r for r in newer])
        )
        stored = again.fetch_records("synth", ["step"])
        assert {r["blocked_between_ns"] for r in stored if r["step"] == 3} == {5}


def test_a_database_from_a_newer_collector_is_refused(storage, db_url):
    with storage.engines.writer.begin() as conn:
        conn.execute(schema.schema_version.update().values(version=migrations.LATEST + 1))
    with pytest.raises(RuntimeError, match="newer than this collector"):
        Storage.open(db_url)


def test_two_collectors_writing_at_once_lose_nothing_and_count_everything(db_url):
    """Several collector processes share one database: nothing is held in process memory."""
    a, b = Storage.open(db_url), Storage.open(db_url)
    records = synth_job(4, 20, 3)
    errors: list[BaseException] = []

    def send(st: Storage, rank_records: list) -> None:
        try:
            for i in range(0, len(rank_records), 25):
                st.write_batch(decoded(rank_records[i : i + 25]))
        except BaseException as e:  # re-raised below, in the test thread
            errors.append(e)

    threads = [
        threading.Thread(target=send, args=((a, b)[rank % 2], recs))
        for rank, recs in by_rank(records).items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errors, errors
        assert a.counters()["ingested_records"] == len(records)
        assert {r.count for r in b.load_snapshot("synth").steps.values()} == {20}
    finally:
        a.close()
        b.close()


def test_rejections_counted_later_are_not_lost(storage):
    storage.defer_count("rejected_batches:overloaded", 2)
    storage.write_batch(decoded(synth_job(1, 1, 1)))
    storage.defer_count("rejected_batches:overloaded")
    storage.flush_counts()
    assert storage.counters()["rejected_batches:overloaded"] == 3


def test_unknown_jobs_and_kinds(storage):
    assert storage.load_snapshot("nope") is None
    assert storage.fetch_records("nope") == []
    with pytest.raises(ValueError, match="unknown record kinds"):
        storage.fetch_records("nope", ["stepz"])
    assert storage.ping()


def test_the_collective_log_keeps_only_the_newest_sequence_numbers(storage, monkeypatch):
    from ddpscope.server import writer

    monkeypatch.setattr(writer, "KEEP_COLLECTIVES", 10)
    monkeypatch.setattr(writer, "PRUNE_EVERY", 5)
    records = [r for r in synth_job(2, 12, 2) if r["kind"] in ("collective", "collective_end")]
    for rank_records in by_rank(records).values():
        for i in range(0, len(rank_records), 4):
            storage.write_batch(decoded(rank_records[i : i + 4]))
    kept = storage.fetch_records("synth", ["collective", "collective_end"])
    seqs = {r["coll_seq"] for r in kept}
    assert max(seqs) == 24 and min(seqs) >= 24 - 10 - 5
    assert {r["kind"] for r in kept if r["coll_seq"] == 24} == {"collective", "collective_end"}


def test_after_a_restart_the_new_processes_collectives_are_in_the_snapshot_window(storage):
    # The old processes got to #300; the restarted ones number from #1 again and must not fall out of
    # the window the diagnosis reads (the last COLLECTIVE_WINDOW numbers).
    before = synth_job(2, 150, 2, finished=False)
    after = synth_job(2, 3, 2, finished=False, t0_ns=T0_NS + 3600 * 10**9)
    for r in after:
        r["stream"] += "-restarted"
    storage.write_batch(decoded(before + after))
    snap = storage.load_snapshot("synth")
    new = sorted({c["coll_seq"] for c in snap.collectives if c["stream"].endswith("-restarted")})
    old = {c["coll_seq"] for c in snap.collectives if not c["stream"].endswith("-restarted")}
    assert new == list(range(1, 7)) and max(old) == 300
    assert all(c["end_ns"] is not None for c in snap.collectives), "each end joined to its own process's call"


def _restarted_job(resume_at: int = 0) -> JobRecords:
    """Two ranks ran steps 0-4, crashed and came back (new processes, new agent streams) to run
    steps ``resume_at``..``resume_at + 11`` under the same job id, step 1 of rank 1 with an unused
    parameter in the first attempt only."""
    job = started(2)
    end = job.train(5)
    for r in range(2):
        job.start(r, end + 10)
    t = end + 11
    for s in range(resume_at, resume_at + 12):
        for r in range(2):
            job.step(r, t, s, seqs=[2 * s + 1, 2 * s + 2])
        t += 0.1
    return job


def _first_attempt_unused(job: JobRecords) -> None:
    for rec in job.records:
        if rec["kind"] == "step" and rec["stream"] == "s1.1" and rec["step"] == 1:
            rec["unused_parameters"] = ["head.bias"]


def test_steps_of_a_restarted_rank_come_from_its_latest_attempt_only(storage):
    job = _restarted_job()
    storage.write_batch(decoded(job.records))
    job_id = storage.job_id(job.job)
    rows = storage.steps(job_id)
    assert [(r.step, r.rank) for r in rows] == [(s, r) for s in range(12) for r in range(2)]
    assert {r.stream for r in rows} == {"s0.2", "s1.2"}
    times = storage.steps(job_id, rank=1, start=2, end=3)
    assert [t.step for t in times] == [2, 3]
    assert all(t.forward_start_ns >= job.records[-1]["time_ns"] - 2 * 10**9 for t in times)
    assert len(storage.steps(job_id, every_attempt=True)) == 2 * 5 + 2 * 12


def test_a_step_page_holds_the_same_rows_metrics_and_stragglers_as_the_unpacked_rows(storage):
    job = _restarted_job()
    storage.write_batch(decoded(job.records))
    job_id = storage.job_id(job.job)
    for window in ({}, {"rank": 1, "start": 2, "end": 3}, {"after": (4, 0), "limit": 5}):
        page = storage.step_page(job_id, **window)
        times = storage.steps(job_id, **window)
        assert list(zip(page.step.tolist(), page.rank.tolist(), strict=True)) == [
            (t.step, t.rank) for t in times
        ]
        assert page_metrics(page) == [step_metrics(t) for t in times]
    page = storage.recent_step_page(job_id, WINDOW_STEPS + 1)
    assert stragglers(page_timings(page)) == stragglers(storage.steps(job_id, start=int(page.step.min())))


def test_the_last_step_of_a_restarted_job_is_its_current_attempts_even_when_the_old_one_got_further(storage):
    job = _restarted_job(resume_at=0)
    # The first attempt got to step 30 before it crashed; the new processes restarted from 0.
    old = next(r for r in job.records if r["kind"] == "step" and r["step"] == 4 and r["rank"] == 0)
    old["step"] = 30
    storage.write_batch(decoded(job.records))
    job_id = storage.job_id(job.job)
    assert storage.last_step(job_id) == 11
    assert {r.step for r in storage.recent_steps(job_id, 3)} == {9, 10, 11}
    assert storage.load_snapshot(job.job).steps[0].last_step == 11
    assert job.snapshot().steps[0].last_step == 11


def test_right_after_a_restart_the_job_keeps_its_step_count_and_makes_no_rate_of_the_old_processes_steps(
    storage,
):
    job = started(2)
    end = job.train(16, dt=0.4)
    for r in range(2):
        job.start(r, end + 10)  # relaunched; no new step yet
    storage.write_batch(decoded(job.records))
    summary = summarize(storage.load_snapshot(job.job), T0, "running")
    assert (summary.steps, summary.step_rate) == (16, None)
    # Rank 0's first new steps arrive before rank 1's: rank 1's last step is still the old process's.
    sent = len(job.records)
    job.train(3, t=end + 11, dt=0.4, ranks=[0])
    storage.write_batch(decoded(job.records[sent:]))
    summary = summarize(storage.load_snapshot(job.job), T0, "running")
    assert summary.steps == 3 and summary.step_rate is not None and summary.step_rate < 3, summary


def test_unused_parameters_of_an_attempt_before_a_restart_are_not_reported(storage):
    job = _restarted_job()
    _first_attempt_unused(job)
    storage.write_batch(decoded(job.records))
    assert storage.unused_rows(storage.job_id(job.job)) == []
    assert storage.load_snapshot(job.job).unused == job.snapshot().unused == []


def _relaunched_smaller() -> tuple[JobRecords, float]:
    """Four ranks ran 8 steps and exited; the job was relaunched under the same id on two ranks (an
    elastic scale-down, a rerun on fewer machines), which ran 6 steps. Returns the job and its end."""
    job = started(4)
    end = job.train(8)
    for r in range(4):
        job.exit(r, end, step=7)
    job.world = 2
    for r in range(2):
        job.start(r, end + 10)
    return job, job.train(6, t=end + 11, ranks=[0, 1])


def test_a_job_relaunched_on_fewer_ranks_is_judged_on_the_new_world_alone(storage):
    # The world size never shrank, and the absent ranks' old processes stayed current: a false
    # mismatch and replicas_diverged against ranks 2 and 3, which had exited long before.
    job, end = _relaunched_smaller()
    storage.write_batch(decoded(job.records))
    job_id = storage.job_id(job.job)
    for snap in (storage.load_snapshot(job.job), job.snapshot()):
        assert snap is not None and snap.world_size == 2
        assert job_status(snap, end + 1) == "running"
        assert diagnose(snap, end + 1) == []
        assert [row["rank"] for row in rank_table(snap)] == [0, 1]
        assert summarize(snap, T0, "running").steps == 6
    assert {r.rank for r in storage.steps(job_id)} == {0, 1}
    assert {r.step for r in storage.steps(job_id)} == set(range(6))
    assert set(storage.step_page(job_id).rank.tolist()) == {0, 1}
    for r in range(2):
        job.exit(r, end + 1, step=5)
    storage.write_batch(decoded(job.records[-2:]))
    assert job_status(storage.load_snapshot(job.job), end + 2) == "finished"


def test_a_relaunch_on_more_ranks_counts_them_all(storage):
    job = started(2)
    end = job.train(3)
    job.world = 4
    for r in range(4):
        job.start(r, end + 10)
    job.train(2, t=end + 11)
    storage.write_batch(decoded(job.records))
    assert storage.load_snapshot(job.job).world_size == job.snapshot().world_size == 4
    assert {r.rank for r in storage.steps(storage.job_id(job.job))} == {0, 1, 2, 3}


def test_a_job_that_never_restarted_keeps_every_step_row(storage):
    job = started(2)
    job.train(4)
    storage.write_batch(decoded(job.records))
    assert len(storage.steps(storage.job_id(job.job))) == 8


def _in_blocks(records: list[dict]) -> list:
    """Records decoded as the agent ships them: the steps of each stream in one ``step_block``."""
    items, _ = encode_records(records)
    return decode_batch(b'{"schema":1,"records":[%s]}' % items)


def test_steps_sent_in_blocks_are_stored_exactly_as_steps_sent_one_by_one(storage):
    # 300 steps a rank: more than one multi-row INSERT (ROWS_PER_STATEMENT) and a remainder.
    one_by_one = synth_job(2, 300, 3, job="single", unused={1: ["head.bias"]}, collectives=False)
    blocks = synth_job(2, 300, 3, job="blocks", unused={1: ["head.bias"]}, collectives=False)
    storage.write_batch(decoded(one_by_one))
    first = storage.write_batch(_in_blocks(blocks))
    assert (first.accepted, first.duplicates) == (len(blocks), 0)
    again = storage.write_batch(_in_blocks(blocks))
    assert (again.accepted, again.duplicates) == (0, len(blocks))  # counted in step records, not blocks
    jobs = {j: storage.job_row(j) for j in ("single", "blocks")}
    assert (
        [(r.rank, r.step_records, r.last_step) for r in jobs["blocks"].ranks]
        == [(r.rank, r.step_records, r.last_step) for r in jobs["single"].ranks]
        == [(0, 300, 299), (1, 300, 299)]
    )
    single, block = (storage.steps(jobs[j].id, start=0, end=299) for j in ("single", "blocks"))
    assert [{**s.to_wire("j"), "stream": ""} for s in block] == [
        {**s.to_wire("j"), "stream": ""} for s in single
    ]
    assert storage.unused_rows(jobs["blocks"].id) == storage.unused_rows(jobs["single"].id) != []


def test_a_snapshot_reads_the_last_hour_of_memory_records_however_long_the_job_ran(storage):
    job = JobRecords(2, job="long-memory")
    job.start(0)
    job.start(1)
    for i in range(3 * 60):  # three hours, a record a minute per rank
        for r in (0, 1):
            job.add(
                "memory",
                r,
                T0 + 60 * i,
                step=i,
                rss_bytes=2**30 + i,
                available_bytes=2**34,
                total_bytes=2**35,
            )
    storage.write_batch(decoded(job.records))
    snap = storage.load_snapshot("long-memory")
    assert snap is not None
    times = [m["time_ns"] for m in snap.memory]
    assert times == sorted(times) and len(times) == 2 * 61  # the newest and the hour before it, both ranks
    assert min(times) == int((T0 + 60 * 119) * 1e9) and {m["rank"] for m in snap.memory} == {0, 1}
    assert len(storage.fetch_records("long-memory", ["memory"])) == 2 * 180  # all kept, for an export


def test_a_ranks_shipper_reporting_after_the_rank_died_does_not_keep_the_rank_alive(storage):
    """The shipper outlives its rank to send what it left, then its own ``agent_stats``; a rank SIGKILLed
    (the OOM killer) must still read as the one that died when its peer lost the connection."""
    job = started(2)
    end = job.train(3)
    job.error(0, end + 0.05, "Connection reset by peer")
    rank1_stream = next(r["stream"] for r in job.records if r["rank"] == 1)
    stats = {"kind": "agent_stats", "job": job.job, "rank": 1, "stream": wire.shipper_stream(rank1_stream, 4242),
             "seq": 0, "time_ns": int((end + 3.0) * 1e9), "emitted": 0, "dropped": {}, "spool_bytes": 0}  # fmt: skip
    wire.validate_record(stats)
    storage.write_batch(decoded([*job.records, stats]))
    stored = storage.load_snapshot(job.job)
    built = snapshot_from_records(job.job, [*job.records, stats])
    assert stored is not None
    assert stored.rank_last_seen_s == built.rank_last_seen_s
    assert stored.rank_last_seen_s[1] < end + 0.05
    assert liveness(stored, end + 4).crashed == [1]
