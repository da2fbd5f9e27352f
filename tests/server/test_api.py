"""The HTTP API through the real app (TestClient), on SQLite and PostgreSQL, fed synthetic jobs."""

from __future__ import annotations

import gzip
import json
import re
import time
from pathlib import Path

import pytest

from tests.server.conftest import make_client, post
from tests.support.synth import batch, by_rank, site_profile, synth_job


def _feed(client, records):
    for rank_records in by_rank(records).values():
        r = post(client, rank_records, gzip_body=True)
        assert r.status_code == 200, r.text


def test_ingest_acknowledges_what_it_stored_and_ignores_a_retry(client):
    records = synth_job(2, 3, 2)
    first = post(client, records)
    assert first.status_code == 200 and first.json() == {"accepted": len(records), "duplicates": 0}
    again = post(client, records, gzip_body=True)
    assert again.json() == {"accepted": 0, "duplicates": len(records)}


def test_a_batch_with_one_bad_record_is_refused_whole_naming_the_field(client):
    records = synth_job(2, 3, 2)
    bad = [dict(r) for r in records]
    bad[-1] = {**bad[-1], "rank": "one"}
    r = post(client, bad)
    assert r.status_code == 422
    assert f"records[{len(bad) - 1}].rank" in r.json()["detail"]
    assert client.get("/api/v1/jobs").json() == {"items": []}


def test_malformed_bodies_get_400_with_the_reason(client):
    r = client.post("/api/v1/ingest", content=b"{nope", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    r = client.post("/api/v1/ingest", content=b"not gzip", headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "gzip" in r.json()["detail"]
    r = client.post("/api/v1/ingest", content=b"{}", headers={"Content-Encoding": "br"})
    assert r.status_code == 400 and "Content-Encoding" in r.json()["detail"]


def test_bodies_over_the_limit_are_refused_before_and_after_decompression(db_url):
    with make_client(db_url, max_body_bytes=50_000, max_decompressed_bytes=200_000) as client:
        big = json.dumps(batch(synth_job(4, 40, 8))).encode()
        assert len(big) > 200_000
        r = client.post("/api/v1/ingest", content=big)
        assert r.status_code == 413 and "limit of 50000 bytes" in r.json()["detail"]
        bomb = gzip.compress(b" " * 50_000_000)  # 50 MB of spaces in ~50 kB
        assert len(bomb) < 50_000
        r = client.post("/api/v1/ingest", content=bomb, headers={"Content-Encoding": "gzip"})
        assert r.status_code == 413 and "decompressed" in r.json()["detail"]
        metrics = client.get("/metrics").text
        assert 'ddpscope_rejected_batches_total{reason="too_large"} 2.0' in metrics


def test_with_a_token_ingest_needs_the_bearer_and_stores_nothing_without_it(db_url):
    with make_client(db_url, token="s3cret") as client:
        records = synth_job(1, 1, 1)
        assert post(client, records).status_code == 401
        assert post(client, records, Authorization="Bearer wrong").status_code == 401
        assert client.get("/api/v1/jobs").json()["items"] == []
        assert post(client, records, Authorization="Bearer s3cret").status_code == 200
        assert 'ddpscope_rejected_batches_total{reason="unauthorized"} 2.0' in client.get("/metrics").text


def test_an_overloaded_collector_answers_429_with_retry_after(client):
    gate = client.app.state.ingest_gate
    held = 0
    while gate.try_enter():  # occupy every ingest slot, as slow concurrent requests would
        held += 1
    try:
        r = post(client, synth_job(1, 1, 1))
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    finally:
        for _ in range(held):
            gate.leave()
    assert post(client, synth_job(1, 1, 1)).status_code == 200
    assert 'ddpscope_rejected_batches_total{reason="overloaded"} 1.0' in client.get("/metrics").text


def test_jobs_list_status_and_progress(client):
    _feed(client, synth_job(2, 5, 2, job="done"))
    _feed(client, synth_job(3, 4, 2, job="live", finished=False))
    jobs = {j["job"]: j for j in client.get("/api/v1/jobs").json()["items"]}
    assert (
        jobs["done"]["status"] == "finished"
        and jobs["done"]["world_size"] == 2
        and jobs["done"]["steps"] == 5
    )
    assert jobs["live"]["world_size"] == 3 and jobs["live"]["status"] != "finished"
    assert jobs["live"]["last_seen"] > 1.6e9 and jobs["live"]["step_rate"] > 0


def test_unknown_jobs_get_404_naming_the_job(client):
    for path in ("steps", "timeline", "buckets", "stragglers", "unused-parameters", "incidents", "trace"):
        r = client.get(f"/api/v1/jobs/ghost/{path}")
        assert r.status_code == 404 and "ghost" in r.json()["detail"], path


def test_steps_are_paged_with_a_next_cursor(client):
    _feed(client, synth_job(3, 7, 2))
    seen, url = [], "/api/v1/jobs/synth/steps?limit=4"
    while url:
        page = client.get(url).json()
        seen += [(i["step"], i["rank"]) for i in page["items"]]
        url = f"/api/v1/jobs/synth/steps?limit=4&cursor={page['next']}" if page["next"] else None
    assert seen == [(s, r) for s in range(7) for r in range(3)]
    item = client.get("/api/v1/jobs/synth/steps?rank=1&start=2&end=3").json()["items"][0]
    assert (item["rank"], item["step"]) == (1, 2)
    assert {"step_s", "forward_s", "backward_s", "comm_s", "exposed_comm_s", "overlap_ratio"} <= set(item)
    assert client.get("/api/v1/jobs/synth/steps?cursor=garbage").status_code == 400


def test_a_stragglers_slow_phase_is_placed_at_the_line_its_watchdog_sampled_most_there(client):
    records = synth_job(4, 25, 3, slow_rank=2)
    end_ns = max(r["time_ns"] for r in records)
    slow = [("forward", "model.py:40", 12), ("after_forward", "loss.py:3", 2), ("backward", "model.py:41", 9),
            ("backward", None, 1), ("idle", "train.py:20", 20)]  # fmt: skip
    records += [
        site_profile("synth", 2, end_ns, slow),
        site_profile("synth", 0, end_ns, [("forward", "model.py:7", 30)]),
    ]
    _feed(client, records)
    (flagged,) = [s for s in client.get("/api/v1/jobs/synth/stragglers").json()["items"] if s["flagged"]]
    assert flagged["rank"] == 2
    # Its slow phase's samples only, and its own: forward counts the loss after it too.
    expected = {
        "forward": {"site": "model.py:40", "samples": 12, "of": 14, "loader": False},
        "backward": {"site": "model.py:41", "samples": 9, "of": 10, "loader": False},
    }
    assert flagged["sampled"] == expected[flagged["phase"]], flagged


def test_timeline_buckets_stragglers_and_unused_parameters(client):
    _feed(client, synth_job(4, 25, 3, slow_rank=2, unused={1: ["layers.2.bias"]}))
    tl = client.get("/api/v1/jobs/synth/timeline?step=10").json()
    assert [r["rank"] for r in tl["ranks"]] == [0, 1, 2, 3]
    assert min(r["forward"][0] for r in tl["ranks"]) == 0.0
    assert {"index", "ready", "allreduce", "bytes"} <= set(tl["ranks"][0]["buckets"][0])
    assert client.get("/api/v1/jobs/synth/timeline").json()["step"] == 24
    assert client.get("/api/v1/jobs/synth/timeline?step=99").status_code == 404

    buckets = client.get("/api/v1/jobs/synth/buckets").json()["items"]
    assert [b["index"] for b in buckets] == [0, 1, 2]
    assert (
        buckets[0]["parameters"] == ["layers.2.weight", "layers.2.bias"] and buckets[0]["out_of_order"] == 0
    )

    flagged = [s for s in client.get("/api/v1/jobs/synth/stragglers").json()["items"] if s["flagged"]]
    # Slow in every step: a straggler, not a rank that stalls now and then.
    assert client.get("/api/v1/jobs/synth/stalls").json() == {"items": [], "window": 200}
    assert [s["rank"] for s in flagged] == [2] and flagged[0]["phase"] in ("forward", "backward")
    assert flagged[0]["slowdown"] > 1.3 and flagged[0]["steps_flagged"] >= 13
    assert flagged[0]["sampled"] is None  # no site_profile records yet

    unused = client.get("/api/v1/jobs/synth/unused-parameters").json()
    assert unused["items"] == [
        {"name": "layers.2.bias", "ranks": [1], "steps": 25, "first_step": 0, "last_step": 24}
    ]
    assert "find_unused_parameters=False" in unused["advice"]


def test_trace_is_perfetto_json_for_a_step_range(client):
    _feed(client, synth_job(2, 6, 2))
    trace = client.get("/api/v1/jobs/synth/trace?start=2&end=3").json()
    steps = {e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert steps == {2, 3}
    assert client.get("/api/v1/jobs/synth/trace?start=3&end=2").status_code == 400
    # The step list says the same of the same range, instead of an empty page.
    steps_page = client.get("/api/v1/jobs/synth/steps?start=3&end=2")
    assert steps_page.status_code == 400 and "before start" in steps_page.json()["detail"]


def test_metrics_expose_the_design_names_and_ended_jobs_leave_after_their_retention(client):
    # "live" ran a second ago: a job that fell silent long ago is dead and would leave after its retention.
    recent_ns = time.time_ns() - 1_000_000_000
    _feed(
        client,
        synth_job(2, 12, 2, job="live", slow_rank=1, finished=False, unused={0: ["w"]}, t0_ns=recent_ns),
    )
    # Both finished; "done" in 2023, far beyond the default 15-minute retention, "just-done" a second ago.
    _feed(client, synth_job(2, 5, 2, job="done"))
    _feed(client, synth_job(2, 5, 2, job="just-done", t0_ns=time.time_ns() - 1_000_000_000))
    text = client.get("/metrics").text
    for name in (
        "ddpscope_hang_active",
        "ddpscope_straggler",
        "ddpscope_step_seconds",
        "ddpscope_overlap_ratio",
        "ddpscope_last_seen_timestamp_seconds",
        "ddpscope_collective_mismatches_total",
        "ddpscope_unused_parameters",
        "ddpscope_replicas_diverged",
        "ddpscope_ingested_records_total",
    ):
        assert f'{name}{{job="live"' in text or (
            name == "ddpscope_ingested_records_total" and name in text
        ), name
    assert 'ddpscope_straggler{job="live",rank="1"} 1.0' in text
    assert 'ddpscope_unused_parameters{job="live"} 1.0' in text
    assert 'ddpscope_rank_finished{job="live",rank="0"} 0.0' in text
    assert 'job="done"' not in text
    assert 'ddpscope_rank_finished{job="just-done",rank="1"} 1.0' in text


def test_health_answers_when_the_database_does(client):
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_incidents_can_be_filtered_by_kind(client):
    _feed(client, synth_job(2, 4, 2, unused={1: ["layers.0.bias"]}, finished=False))
    found = client.get("/api/v1/jobs/synth/incidents?kind=unused_parameters").json()["items"]
    assert found and all(i["kind"] == "unused_parameters" for i in found)
    assert "layers.0.bias" in found[0]["parameters"]
    assert client.get("/api/v1/jobs/synth/incidents?kind=hang").json()["items"] == []


def test_an_unknown_incident_kind_is_a_400_that_lists_the_kinds(client):
    _feed(client, synth_job(2, 4, 2, finished=False))
    r = client.get("/api/v1/jobs/synth/incidents?kind=hangs")
    assert r.status_code == 400 and "'hangs' is not an incident kind" in r.json()["detail"]
    assert (
        "hang, job_id_shared, job_ids_differ, job_silent, memory_growth, mismatch" in r.json()["detail"]
        and "unsynced_gradients" in r.json()["detail"]
    )
    # A known kind the job does not have is an empty list, not an error.
    assert client.get("/api/v1/jobs/synth/incidents?kind=rank_silent").json()["items"] == []


def test_every_incident_kind_the_diagnosis_makes_is_listed_for_the_kind_filter():
    # The kinds written in the diagnosis modules (kind="...", or _error_incident("...")), against the list
    # the kind filter accepts: a new kind must be added there, or filtering for it would be refused.
    from ddpscope.server.analysis.incident_model import INCIDENT_KINDS

    root = Path(__file__).resolve().parents[2] / "server" / "analysis"
    written = set()
    for path in root.glob("*.py"):
        text = path.read_text()
        written |= set(re.findall(r'\bkind="([a-z_]+)"', text)) | set(
            re.findall(r'_incident\(\s*"([a-z_]+)"', text)
        )
        written |= set(re.findall(r'"(rank_crashed|rank_error)" if', text))
    written.discard("stable")  # numpy's sort kind, not an incident
    assert written and written <= INCIDENT_KINDS, written - INCIDENT_KINDS


def test_metrics_show_active_hangs_until_resolved_and_the_agents_drops(client):
    # Recent (a job silent for long is dead, its hang over), and waiting in an all-reduce.
    records = synth_job(2, 3, 2, finished=False, t0_ns=time.time_ns() - 1_000_000_000)
    stats = next(r for r in records if r["kind"] == "agent_stats" and r["rank"] == 1)
    stats["dropped"] = {"queue_full:step": 3, "queue_full:heartbeat": 2}
    env = {"job": "synth", "rank": 0, "stream": "synth-r0"}
    t_ns = records[-1]["time_ns"] + 1
    waiting = {"pg": "default", "coll_seq": 9, "op": "all_reduce", "shapes": [[4]], "dtypes": ["float32"],
               "call_site": "train.py:57", "start_ns": t_ns - 60 * 10**9}  # fmt: skip
    hang = {
        **env, "kind": "hang", "seq": 10_000, "time_ns": t_ns, "phase": "allreduce", "step": 3,
        "stalled_s": 60.0, "pending_buckets": [], "inflight": [waiting], "stacks": [],
        "message": "no progress for 60 s",
    }  # fmt: skip
    _feed(client, [*records, hang])
    text = client.get("/metrics").text
    assert 'ddpscope_hang_active{job="synth",rank="0"} 1.0' in text
    assert 'ddpscope_hang_active{job="synth",rank="1"} 0.0' in text
    assert (
        'ddpscope_agent_dropped_records_total{job="synth",kind="step",rank="1",reason="queue_full"} 3.0'
        in text
    )
    resolved = {
        **env,
        "kind": "hang_resolved",
        "seq": 10_001,
        "time_ns": hang["time_ns"] + 1,
        "step": 3,
        "hang_s": 5.0,
    }
    assert post(client, [resolved]).status_code == 200
    assert 'ddpscope_hang_active{job="synth",rank="0"} 0.0' in client.get("/metrics").text


def test_the_collector_serves_the_dashboard_pages_when_the_dashboard_is_installed(client):
    pytest.importorskip("ddpscope.dashboard")
    r = client.get("/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]


def test_a_restarted_job_shows_its_current_attempts_steps_in_every_step_view(client):
    from tests.server.test_incidents import started

    job = started(2)
    end = job.train(5)  # the first attempt: steps 0-4, then a crash
    for r in range(2):  # torchrun --max-restarts: new processes, same job id, steps from 0 again
        job.start(r, end + 10)
    end2 = job.train(12, t=end + 11)
    r = post(client, job.records)
    assert r.status_code == 200, r.text
    base = f"/api/v1/jobs/{job.job}"
    steps = client.get(f"{base}/steps").json()["items"]
    assert sorted((s["rank"], s["step"]) for s in steps) == [(r, s) for r in range(2) for s in range(12)]
    (summary,) = client.get("/api/v1/jobs").json()["items"]
    assert summary["steps"] == 12
    assert summary["step_rate"] == pytest.approx(12 / (end2 - 0.1 + 9e-6 - (end + 10)), rel=1e-3)
    tl = client.get(f"{base}/timeline", params={"step": 3}).json()
    assert [row["rank"] for row in tl["ranks"]] == [0, 1]
    trace = client.get(f"{base}/trace").json()
    spans = [e for e in trace["traceEvents"] if e.get("name") == "forward"]
    assert len(spans) == 2 * 12
    assert {s["rank"] for s in client.get(f"{base}/stragglers").json()["items"]} == {0, 1}
