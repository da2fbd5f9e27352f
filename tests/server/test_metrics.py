"""/metrics semantics: gauges from the same analysis as the API, and which jobs are exposed when.

Records go through the real app's ingest into a real database (SQLite file and PostgreSQL); the
scrapes use ``make_registry`` on that storage with a fixed collector clock, so a test looks 15 minutes
ahead without waiting. The agreement test scrapes the app's own ``/metrics`` with the real clock.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ddpscope.server import serve
from ddpscope.server.analysis.status import DEFAULT_DEAD_AFTER_S, job_status
from ddpscope.server.metrics import make_registry
from ddpscope.server.settings import DEFAULT_METRICS_RETENTION_S, Settings
from tests.server.conftest import make_client, post
from tests.support.synth import T0_NS, by_rank, rank_start, synth_job

RETENTION_S = 60.0
PER_JOB = {
    "ddpscope_hang_active",
    "ddpscope_straggler",
    "ddpscope_step_seconds",
    "ddpscope_overlap_ratio",
    "ddpscope_last_seen_timestamp_seconds",
    "ddpscope_rank_finished",
    "ddpscope_unused_parameters",
    "ddpscope_replicas_diverged",
    "ddpscope_memory_growth",
    "ddpscope_collective_mismatches_total",
}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def feed(client: Any, records: list[dict[str, Any]]) -> None:
    for rank_records in by_rank(records).values():
        r = post(client, rank_records)
        assert r.status_code == 200, r.text


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(client: Any, now_s: float, retention_s: float = RETENTION_S) -> Samples:
    """/metrics as a collector whose clock reads ``now_s`` would expose it."""
    registry = make_registry(client.app.state.storage, retention_s=retention_s, clock=lambda: now_s)
    return parse(generate_latest(registry).decode())


def of_job(samples: Samples, job: str) -> Samples:
    return {k: v for k, v in samples.items() if ("job", job) in k[1]}


def value(samples: Samples, name: str, job: str, rank: int | None = None) -> float:
    labels = [("job", job)] + ([("rank", str(rank))] if rank is not None else [])
    return samples[(name, tuple(sorted(labels)))]


def last_s(records: list[dict[str, Any]]) -> float:
    return max(r["time_ns"] for r in records) / 1e9


def extra(job: str, rank: int, kind: str, time_ns: int, seq: int, **fields: Any) -> dict[str, Any]:
    """A record appended after a synthetic job's own (``seq`` above any synth_job uses)."""
    env = {"job": job, "rank": rank, "stream": f"{job}-r{rank}", "seq": 10_000 + seq, "time_ns": time_ns}
    return {**env, "kind": kind, **fields}


def hang(job: str, rank: int, time_ns: int, seq: int = 0) -> dict[str, Any]:
    """A hang report of a rank waiting in an all-reduce (a wait, so a hang whatever its peers do)."""
    waiting = {"pg": "default", "coll_seq": 99, "op": "all_reduce", "shapes": [[4]], "dtypes": ["float32"],
               "call_site": "train.py:57", "start_ns": time_ns - 300 * 10**9}  # fmt: skip
    return extra(
        job, rank, "hang", time_ns, seq, phase="allreduce", step=3, stalled_s=300.0,
        pending_buckets=[], inflight=[waiting], stacks=[], message="no progress for 300 s",
    )  # fmt: skip


def heartbeats(job: str, until_s: float, seq: int) -> list[dict[str, Any]]:
    """Each rank's latest heartbeat at ``until_s``: its processes are alive (hung or not)."""
    t_ns = int(until_s * 1e9)
    return [
        extra(job, r, "heartbeat", t_ns, seq, phase="allreduce", step=3, last_coll_seq=8, pid=100 + r)
        for r in (0, 1)
    ]


def died(job: str, rank: int, time_ns: int, message: str, seq: int = 1) -> list[dict[str, Any]]:
    """A rank's fatal error and its exit with reason 'error'."""
    error = extra(
        job, rank, "rank_error", time_ns, seq, step=3, phase="allreduce", error_type="RuntimeError",
        message=message, stack="Traceback ...", fatal=True,
    )  # fmt: skip
    return [error, extra(job, rank, "rank_exit", time_ns + 1, seq + 1, step=3, reason="error")]


def failed_job(job: str, survivor_s: float = 0.03, t0_ns: int = T0_NS) -> list[dict[str, Any]]:
    """Rank 1 raised a real error; rank 0 lost its connection to it ``survivor_s`` later: a failed job."""
    records = synth_job(2, 4, 2, job=job, finished=False, t0_ns=t0_ns)
    end = max(r["time_ns"] for r in records)
    return [
        *records,
        *died(job, 1, end + 1_000, "CUDA error: an illegal memory access was encountered"),
        *died(job, 0, end + int(survivor_s * 1e9), "Connection reset by peer"),
    ]


def test_a_stale_hang_of_a_dead_rank_does_not_keep_ddpscope_hang_active_at_1(client):
    records = synth_job(2, 4, 2, job="stale", finished=False)
    end = max(r["time_ns"] for r in records)
    feed(client, [*records, hang("stale", 0, end + 1)])
    now = last_s(records) + 1
    assert value(scrape(client, now), "ddpscope_hang_active", "stale", 0) == 1.0

    # Rank 0 then dies while hanging (its peer was killed): no hang_resolved will ever come.
    feed(client, died("stale", 0, end + 2_000_000, "Connection reset by peer"))
    samples = scrape(client, now)
    assert value(samples, "ddpscope_hang_active", "stale", 0) == 0.0
    assert value(samples, "ddpscope_hang_active", "stale", 1) == 0.0
    # The API says the hang is over (it ended in the rank's death) but keeps it in the diagnosis of the
    # failure, and the job failed rather than hangs.
    hangs = client.get("/api/v1/jobs/stale/incidents?kind=hang").json()["items"]
    assert [h["rank"] for h in hangs] == [0] and hangs[0]["message"].startswith("(ended when the rank died)")
    assert client.get("/api/v1/jobs/stale").json()["status"] == "failed"


def test_a_hung_job_stopped_by_its_scheduler_is_not_finished_on_metrics_either(client):
    # A time limit that kills a hung job before DDPJobHang's 30 s elapsed: the API says failed, and the
    # stopped ranks must not read as finished, or DDPRankSilent would leave them out and nothing pages.
    records = synth_job(2, 4, 2, job="killed", finished=False)
    end = max(r["time_ns"] for r in records)
    stop = [extra("killed", r, "rank_exit", end + 2_000_000, 5, step=None, reason="sigterm") for r in (0, 1)]
    feed(client, [*records, hang("killed", 0, end + 1), *stop])
    assert client.get("/api/v1/jobs/killed").json()["status"] == "failed"
    samples = scrape(client, last_s(records) + 1)
    assert value(samples, "ddpscope_rank_finished", "killed", 0) == 0.0
    assert value(samples, "ddpscope_hang_active", "killed", 0) == 0.0


def test_a_hang_reported_before_a_rank_restarted_does_not_count(client):
    records = synth_job(2, 4, 2, job="restart", finished=False)
    start = min(r["time_ns"] for r in records)
    # A hang from the rank's previous life, before its latest rank_start.
    feed(client, [hang("restart", 1, start - 60_000_000_000), *records])
    samples = scrape(client, last_s(records) + 1)
    assert value(samples, "ddpscope_hang_active", "restart", 1) == 0.0


def cancelled_job(job: str) -> list[dict[str, Any]]:
    """Every rank stopped by SIGTERM (a scheduler cancelling or preempting the job)."""
    records = synth_job(2, 4, 2, job=job)
    return [{**r, "reason": "sigterm"} if r["kind"] == "rank_exit" else r for r in records]


@pytest.mark.parametrize(
    ("ending", "status"), [("failed", "failed"), ("finished", "finished"), ("cancelled", "finished")]
)
def test_an_ended_jobs_series_disappear_after_the_retention_and_are_present_before_it(client, ending, status):
    build = {
        "failed": failed_job,
        "finished": lambda job: synth_job(2, 4, 2, job=job),
        "cancelled": cancelled_job,
    }
    records = build[ending]("ended")
    feed(client, records)
    assert client.get("/api/v1/jobs/ended").json()["status"] == status
    last = last_s(records)

    before = of_job(scrape(client, last + RETENTION_S - 1), "ended")
    assert {name for name, _ in before} == PER_JOB
    # A rank that exited without an error is done: the rules do not call it silent or a straggler.
    finished = 0.0 if ending == "failed" else 1.0
    assert [value(before, "ddpscope_rank_finished", "ended", r) for r in (0, 1)] == [finished, finished]

    after = scrape(client, last + RETENTION_S + 1)
    assert of_job(after, "ended") == {}
    assert ("ddpscope_ingested_records_total", ()) in after  # the collector's own series stay
    # The API keeps the job: only /metrics forgets it, so alerts resolve.
    assert client.get("/api/v1/jobs/ended").json()["status"] == status


def test_the_retention_is_measured_from_the_jobs_newest_record_not_its_first(client):
    # Rank 1 failed at once; rank 0 only noticed two retentions later (a long collective timeout).
    records = failed_job("late", survivor_s=2 * RETENTION_S)
    feed(client, records)
    first_failure = min(r["time_ns"] for r in records if r["kind"] == "rank_error") / 1e9
    last = last_s(records)
    assert last - first_failure > RETENTION_S
    assert of_job(scrape(client, last + 1), "late")
    assert of_job(scrape(client, last + RETENTION_S + 1), "late") == {}


def test_a_job_that_left_metrics_comes_back_when_its_ranks_restart(client):
    records = failed_job("again")
    feed(client, records)
    now_s = last_s(records) + RETENTION_S + 1
    # One registry across scrapes: it remembers which jobs left, and must notice when one comes back.
    registry = make_registry(client.app.state.storage, retention_s=RETENTION_S, clock=lambda: now_s)
    for _ in range(2):
        assert of_job(parse(generate_latest(registry).decode()), "again") == {}
    seqs = {0: 20_000, 1: 20_000}
    restart_ns = int(now_s * 1e9)
    feed(client, [rank_start("again", r, 2, seqs, restart_ns, False) for r in (0, 1)])
    samples = of_job(parse(generate_latest(registry).decode()), "again")
    assert value(samples, "ddpscope_last_seen_timestamp_seconds", "again", 1) == pytest.approx(now_s)
    assert job_status(client.app.state.storage.load_snapshot("again"), now_s) == "running"


def test_a_mismatch_of_the_processes_before_a_restart_stops_counting(client):
    before = synth_job(2, 6, 2, job="fixed", finished=False)
    for r in before:
        if r["kind"] == "collective" and r["rank"] == 1 and r["coll_seq"] == 5:
            r["shapes"] = [[7]]
    after = synth_job(
        2, 6, 2, job="fixed", finished=False, t0_ns=max(r["time_ns"] for r in before) + 60 * 10**9
    )
    for r in after:
        r["stream"] += "-restarted"  # new processes, new agent streams
    feed(client, [*before, *after])
    mismatches = client.get("/api/v1/jobs/fixed/incidents?kind=mismatch").json()["items"]
    assert [m["active"] for m in mismatches] == [False]
    samples = scrape(client, last_s(after) + 1)
    assert value(samples, "ddpscope_collective_mismatches_total", "fixed") == 0.0


def test_replicas_diverged_is_1_while_a_rank_trains_on_gradients_ddp_never_all_reduced(client):
    # Every micro-batch under no_sync() while the optimizer steps: the digests follow syncs and see nothing.
    records = synth_job(2, 6, 2, job="unsynced", finished=False)
    t_ns = max(r["time_ns"] for r in records)
    feed(client, records)
    assert value(scrape(client, last_s(records) + 1), "ddpscope_replicas_diverged", "unsynced") == 0.0
    warned = [extra("unsynced", r, "warning", t_ns + 1, 1, step=40, code="unsynced_gradients",
                    message="the last 32 training forwards ran without a synchronised backward", parameters=["w"])
              for r in (0, 1)]  # fmt: skip
    feed(client, warned)
    assert value(scrape(client, last_s(warned) + 1), "ddpscope_replicas_diverged", "unsynced") == 1.0


def test_replicas_diverged_is_1_while_the_ranks_copies_differ_and_0_once_they_agree_again(client):
    records = synth_job(2, 6, 2, job="drift", finished=False)
    t_ns = max(r["time_ns"] for r in records)
    norms = {0: [1.5, 0.25], 1: [1.5, 0.75]}
    for seq, step in enumerate((0, 4)):
        for r in (0, 1):
            records.append(extra("drift", r, "replica_digest", t_ns + seq, seq, step=step, syncs=step, model=0, parameters=2,
                                 group=1, norms=norms[0] if step == 0 else norms[r]))  # fmt: skip
    feed(client, records)
    assert value(scrape(client, last_s(records) + 1), "ddpscope_replicas_diverged", "drift") == 1.0
    # The ranks loaded one checkpoint again: equal at step 8, nothing to page for any more.
    feed(client, [extra("drift", r, "replica_digest", t_ns + 5, 5, step=8, syncs=8, model=0, parameters=2, group=1,
                        norms=norms[0]) for r in (0, 1)])  # fmt: skip
    assert value(scrape(client, last_s(records) + 1), "ddpscope_replicas_diverged", "drift") == 0.0


def test_a_running_jobs_series_never_disappear_while_its_ranks_report(client):
    records = synth_job(2, 4, 2, job="live", finished=False)
    feed(client, records)
    last = last_s(records)
    for i, later_s in enumerate((1.0, RETENTION_S + 1, 1000 * RETENTION_S)):
        feed(client, heartbeats("live", last + later_s - 1, seq=i * 2))
        samples = of_job(scrape(client, last + later_s), "live")
        assert {name for name, _ in samples} == PER_JOB, later_s
        assert value(samples, "ddpscope_rank_finished", "live", 0) == 0.0


def test_a_hung_jobs_series_and_its_hang_stay_however_long_it_hangs(client):
    records = synth_job(2, 4, 2, job="stuck", finished=False)
    feed(client, [*records, hang("stuck", 1, max(r["time_ns"] for r in records) + 1)])
    later = last_s(records) + 1000 * RETENTION_S
    feed(client, heartbeats("stuck", later - 1, seq=1))
    samples = scrape(client, later)
    assert value(samples, "ddpscope_hang_active", "stuck", 1) == 1.0
    assert value(samples, "ddpscope_hang_active", "stuck", 0) == 0.0
    assert job_status(client.app.state.storage.load_snapshot("stuck"), later) == "hung"


def test_a_hung_job_killed_whole_stops_paging_as_a_hang_and_leaves_metrics_after_the_retention(client):
    # Every rank SIGKILLed at once (a scheduler's kill) while rank 1 hung: nothing will ever resolve it.
    records = synth_job(2, 4, 2, job="gone", finished=False)
    feed(client, [*records, hang("gone", 1, max(r["time_ns"] for r in records) + 1)])
    last, retention = last_s(records), DEFAULT_METRICS_RETENTION_S
    assert value(scrape(client, last + 30, retention), "ddpscope_hang_active", "gone", 1) == 1.0
    dead_s = last + DEFAULT_DEAD_AFTER_S + 1
    assert value(scrape(client, dead_s, retention), "ddpscope_hang_active", "gone", 1) == 0.0
    assert job_status(client.app.state.storage.load_snapshot("gone"), dead_s) == "failed"
    # Still exposed for the retention (DDPRankSilent pages meanwhile), then its series go and alerts resolve.
    assert of_job(scrape(client, last + retention + 1, retention), "gone") == {}


def test_every_per_job_gauge_agrees_with_the_api(client):
    t0 = time.time_ns() - 2_000_000_000  # recent, so the app's own clock sees a live job
    records = synth_job(
        4, 25, 3, job="agree", slow_rank=2, unused={1: ["layers.2.bias"]}, finished=False, t0_ns=t0
    )
    # Rank 3 issues collective #5 with a different shape: a mismatch.
    for r in records:
        if r["kind"] == "collective" and r["rank"] == 3 and r["coll_seq"] == 5:
            r["shapes"] = [[7]]
    feed(client, [*records, hang("agree", 0, max(r["time_ns"] for r in records) + 1)])
    samples = parse(client.get("/metrics").text)
    api = "/api/v1/jobs/agree"

    flagged = {s["rank"] for s in client.get(f"{api}/stragglers").json()["items"] if s["flagged"]}
    assert flagged == {2}
    assert {r for r in range(4) if value(samples, "ddpscope_straggler", "agree", r) == 1.0} == flagged

    hangs = client.get(f"{api}/incidents?kind=hang").json()["items"]
    active = {h["rank"] for h in hangs if h["active"]}
    assert active == {0}
    assert {r for r in range(4) if value(samples, "ddpscope_hang_active", "agree", r) == 1.0} == active

    mismatches = client.get(f"{api}/incidents?kind=mismatch").json()["items"]
    assert len(mismatches) >= 1
    assert value(samples, "ddpscope_collective_mismatches_total", "agree") == len(mismatches)

    unused = client.get(f"{api}/unused-parameters").json()["items"]
    assert value(samples, "ddpscope_unused_parameters", "agree") == len(unused) == 1

    last_seen = client.get(api).json()["last_seen"]
    seen = [value(samples, "ddpscope_last_seen_timestamp_seconds", "agree", r) for r in range(4)]
    assert max(seen) == pytest.approx(last_seen)
    for rank in range(4):
        latest = client.get(f"{api}/steps?rank={rank}&start=24&end=24").json()["items"][0]
        assert value(samples, "ddpscope_step_seconds", "agree", rank) == pytest.approx(latest["step_s"])


def test_the_retention_setting_defaults_to_15_minutes_and_refuses_a_window_too_short_to_alert():
    assert Settings().metrics_retention_s == DEFAULT_METRICS_RETENTION_S == 900.0
    args = serve.parser().parse_args(["--metrics-retention-s", "3600"])
    assert args.metrics_retention_s == 3600.0
    Settings(metrics_retention_s=3600.0).check()
    for bad in (30.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="--metrics-retention-s"):
            Settings(metrics_retention_s=bad).check()


def test_serve_refuses_a_too_short_retention_with_a_message_naming_the_option(capsys):
    assert serve.main(["--db", "sqlite:///:memory:", "--metrics-retention-s", "10"]) == 2
    assert "--metrics-retention-s 10" in capsys.readouterr().err


def test_the_app_applies_the_retention_setting_to_its_own_metrics(db_url):
    # Real clock: a failed job whose last record is 5 minutes old is past a 2-minute retention.
    t0 = time.time_ns() - 300 * 1_000_000_000
    with make_client(db_url, metrics_retention_s=120.0) as client:
        feed(client, failed_job("old", t0_ns=t0))
        assert 'job="old"' not in client.get("/metrics").text


def test_memory_gauges_follow_each_ranks_latest_sample_and_its_workers_and_growth_is_1_while_a_rank_leaks(
    client,
):
    records = synth_job(2, 6, 2, job="leaky", finished=False)
    t_ns = max(r["time_ns"] for r in records)
    gib = 2**30
    for i in range(10):  # rank 1 grows 100 MiB every 30 s, rank 0 holds still
        for r in (0, 1):
            records.append(extra("leaky", r, "memory", t_ns + i * 30 * 10**9, i, step=10 * i,
                                 rss_bytes=gib + r * i * 100 * 2**20, available_bytes=20 * gib - i * 100 * 2**20,
                                 total_bytes=24 * gib, **({"workers_bytes": 300 * 2**20, "workers": 2} if r else {})))  # fmt: skip
    feed(client, records)
    samples = scrape(client, last_s(records) + 1)
    assert value(samples, "ddpscope_rank_memory_bytes", "leaky", 0) == gib
    assert value(samples, "ddpscope_rank_memory_bytes", "leaky", 1) == gib + 900 * 2**20
    assert value(samples, "ddpscope_memory_available_bytes", "leaky", 1) == 20 * gib - 900 * 2**20
    assert value(samples, "ddpscope_rank_workers_memory_bytes", "leaky", 1) == 300 * 2**20
    assert ("ddpscope_rank_workers_memory_bytes", (("job", "leaky"), ("rank", "0"))) not in samples
    assert value(samples, "ddpscope_memory_growth", "leaky") == 1.0
    steady = synth_job(2, 6, 2, job="steady", finished=False)
    feed(client, steady)
    assert value(scrape(client, last_s(steady) + 1), "ddpscope_memory_growth", "steady") == 0.0
