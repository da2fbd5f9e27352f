"""Every dashboard page in headless Chromium against a real collector fed through its ingest endpoint.

Each test posts its own job (synthetic wire records, ``tests/support/synth.py`` or ``wire.SynthJob``)
to the session's collector, opens the page, reads what Plotly actually holds, and saves a screenshot
to test-artifacts/. The ``page`` fixture fails a test on any console error, uncaught exception or
alert() dialog.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest

from tests.browser.conftest import screenshot
from tests.browser.pages import (
    WAIT_MS,
    figure,
    job_url,
    open_incidents,
    open_job,
    open_job_list,
    open_step,
    text,
    timeline_kinds,
)
from tests.browser.wire import SynthJob, collectives, post, rank_error, stopped
from tests.support.collector_proc import CollectorProc as Collector
from tests.support.synth import synth_job

pytestmark = pytest.mark.browser


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def api(collector: Collector, path: str) -> dict:
    with urllib.request.urlopen(collector.url + path, timeout=30) as resp:
        return json.loads(resp.read())


def test_job_list_shows_each_job_with_status_world_size_steps_and_straggler_flag(
    collector: Collector, page
) -> None:
    healthy, slow = unique("healthy"), unique("slow")
    post(collector.url, synth_job(2, 6, 3, job=healthy, t0_ns=time.time_ns() - 10**9))
    straggling = SynthJob(slow, world_size=3, buckets=3, slow_rank=1)
    post(collector.url, straggling.start() + straggling.steps(12))
    open_job_list(page, collector.url)
    page.wait_for_function(
        "(job) => [...document.querySelectorAll('#jobs tbody tr')].some(tr => tr.dataset.job === job && tr.textContent.includes('straggler'))",
        arg=slow, timeout=WAIT_MS)  # fmt: skip
    rows = {r.get_attribute("data-job"): r.inner_text() for r in page.locator("#jobs tbody tr").all()}
    assert healthy in rows and slow in rows
    assert "finished" in rows[healthy] and "\t2\t" in rows[healthy] and "\t6\t" in rows[healthy]
    assert "straggler: rank 1" in rows[slow] and "\t3\t" in rows[slow]
    screenshot(page, "job-list")


def test_job_page_draws_every_rank_and_step_and_flags_the_straggler(collector: Collector, page) -> None:
    job = unique("job")
    synth = SynthJob(job, world_size=4, buckets=5, slow_rank=2)
    steps = synth.steps(12)
    profile = synth.site_profile(2, [("forward", "model.py:40", 9), ("backward", "model.py:40", 9)])
    post(collector.url, synth.start() + steps + [profile])
    open_job(page, collector.url, job)
    heat = figure(page, "heatmap")["data"][0]
    assert heat["y"] == [0, 1, 2, 3] and heat["x"] == list(range(12))
    assert all(v is not None for row in heat["z"] for v in row)
    overlap = figure(page, "overlap")["data"]
    assert {t["name"] for t in overlap} == {f"rank {r}" for r in range(4)}
    strag = figure(page, "stragglers")["data"]
    assert strag[0]["x"] == [0, 1, 2, 3]
    assert text(page, "#stragglers-msg").startswith("Flagged: rank 2 (")
    assert ", at model.py:40 in 9 of 9 samples" in text(page, "#stragglers-msg")  # its watchdog's samples
    buckets = figure(page, "buckets")["data"]
    assert buckets[0]["x"] == list(range(5))
    assert max(buckets[1]["y"]) > 0, "the synthetic job readies bucket 2 before bucket 1 every third step"
    assert text(page, "#latest-step-link") == "timeline of step 11"
    href = page.get_attribute("#trace-link", "href")
    assert href.endswith("/trace?start=2&end=11")
    screenshot(page, "job-page")
    # A narrower window re-lays the figures out (responsive) without collapsing them to their min-height.
    page.set_viewport_size({"width": 900, "height": 700})
    page.wait_for_function("document.getElementById('heatmap')._fullLayout.width < 900", timeout=WAIT_MS)
    sizes = page.evaluate("() => ['heatmap', 'overlap', 'buckets'].map((id) => { const d = document.getElementById(id); "
                          "return [d.clientHeight, d._fullLayout.height]; })")  # fmt: skip
    assert all(shown == drawn for shown, drawn in sizes), sizes


def test_job_page_names_a_rank_that_stalls_now_and_then_beside_the_stragglers(
    collector: Collector, page
) -> None:
    job = unique("stall")
    synth = SynthJob(job, world_size=3, buckets=3, stall=(1, 4))
    records = synth.start() + synth.steps(16)
    stack = '  File "/proj/train.py", line 40, in <module>\n    loss = model(batch)\n  File "/proj/model.py", line 20\n'
    records += [
        synth._record(
            "stall_sample",
            1,
            synth.clock_ns,
            step=step,
            phase="forward",
            stalled_s=0.5,
            site="model.py:20",
            stack=stack,
            main_cpu_s=0.45,
        )  # fmt: skip
        for step in (7, 11)
    ]
    post(collector.url, records)
    open_job(page, collector.url, job)
    said = text(page, "#stragglers-msg")
    assert said.startswith("No rank is flagged as a straggler. Now and then: rank 1 stalls every 4 steps"), (
        said
    )
    assert "in its backward" in said or "in its forward" in said, said
    assert "its main thread was at model.py:20 in 2 of 2 samples, busy on the CPU" in said, said
    summary = page.locator("#stall-stacks details summary")
    assert summary.inner_text() == "rank 1's main thread in its stalls (model.py:20)"
    summary.click()
    assert "loss = model(batch)" in page.locator("#stall-stacks pre.stack").inner_text()


def test_job_page_charts_each_ranks_memory_and_its_workers_and_names_what_grows(
    collector: Collector, page
) -> None:
    job = unique("memory")
    synth = SynthJob(job, world_size=2, buckets=2)
    records = synth.start() + synth.steps(4)
    records += synth.memory(0, 12, start_bytes=2**30, per_sample=0, workers_per_sample=50 * 2**20)
    records += synth.memory(1, 12, start_bytes=2**30, per_sample=100 * 2**20)
    post(collector.url, records)
    open_job(page, collector.url, job)
    page.wait_for_function("document.getElementById('memory').data", timeout=WAIT_MS)
    fig = figure(page, "memory")
    assert fig is not None
    resident = [t for t in fig["data"] if not t["name"].endswith(("available", "workers"))]
    assert [t["name"] for t in resident] == ["rank 0", "rank 1"]
    (workers,) = [t for t in fig["data"] if t["name"].endswith("workers")]  # rank 1 has none
    assert workers["name"] == "rank 0 workers" and workers["line"]["dash"] == "dash"
    assert abs(workers["y"][-1] - workers["y"][0] - 550 / 1024) < 1e-9
    assert (
        abs(resident[1]["y"][-1] - resident[1]["y"][0] - 1100 / 1024) < 1e-9
        and len(set(resident[0]["y"])) == 1
    )
    said = text(page, "#memory-msg")
    assert said.startswith(
        "Growing: rank 0's DataLoader workers (+100.0 MiB/min), rank 1 (+200.0 MiB/min); see the memory_growth"
    ), said
    assert "Largest: rank 1, 2.1 GiB, with 18.9 GiB of 24.0 GiB left where it runs." in said, said
    screenshot(page, "job-memory")


def test_trace_link_downloads_perfetto_json_of_the_chosen_steps(collector: Collector, page) -> None:
    job = unique("trace")
    synth = SynthJob(job, world_size=2, buckets=3)
    post(collector.url, synth.start() + synth.steps(6))
    open_job(page, collector.url, job)
    page.fill("#trace-start", "2")
    page.fill("#trace-end", "3")
    with page.expect_download(timeout=WAIT_MS) as dl:
        page.click("#trace-link")
    trace = json.loads(dl.value.path().read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert events, "the downloaded trace has no events"
    assert dl.value.suggested_filename.endswith(".json")


def test_step_timeline_holds_every_rank_and_bucket_with_parameter_names_on_hover(
    collector: Collector, page
) -> None:
    job = unique("timeline")
    synth = SynthJob(job, world_size=4, buckets=6, slow_rank=3)
    post(collector.url, synth.start() + synth.steps(4))
    open_step(page, collector.url, job, 2)
    kinds = timeline_kinds(page)
    assert kinds["bucket ready"]["segments"] == 4 * 6
    assert kinds["all-reduce"]["segments"] + kinds["all-reduce (odd buckets)"]["segments"] == 4 * 6
    assert kinds["forward"]["segments"] == 4 and kinds["backward"]["segments"] == 4
    assert kinds["exposed tail"]["segments"] == 4, (
        "every rank waits for the last all-reduce after its last gradient"
    )
    fig = figure(page, "timeline")
    assert fig["layout"]["yaxis"]["ticktext"] == [f"rank {r}" for r in range(4)]
    ready_text = kinds["bucket ready"]["text"]
    assert any("bucket 5" in t and "layers.5.p0" in t for t in ready_text)
    # Hover a real tick and read the label Plotly shows.
    box = page.evaluate(
        """() => { const d = document.getElementById('timeline'), t = d.data.find(t => t.meta && t.meta.kind === 'bucket ready');
           const xa = d._fullLayout.xaxis, ya = d._fullLayout.yaxis, r = d.getBoundingClientRect();
           return [r.left + xa._offset + xa.l2p(t.x[0]), r.top + ya._offset + ya.l2p(t.y[0])]; }""")  # fmt: skip
    page.mouse.move(box[0], box[1])
    page.wait_for_selector(".hovertext", timeout=WAIT_MS)
    hover = page.evaluate("() => document.querySelector('.hovertext').textContent")
    assert "bucket" in hover and "layers." in hover and "KiB" in hover
    screenshot(page, "step-timeline")


def test_the_step_page_asks_for_its_data_once_and_before_its_scripts_have_run(
    collector: Collector, page
) -> None:
    # An id that encodeURIComponent and Python's quote() spell differently unless told: the server-side
    # preload must be the very URL the script fetches, or the browser would fetch everything twice.
    job = unique("pre!load*'(x)") + " é"
    synth = SynthJob(job, world_size=2, buckets=3)
    post(collector.url, synth.start() + synth.steps(2))
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    open_step(page, collector.url, job, 1)
    page.wait_for_function("window.ddpTimelineComplete === true", timeout=WAIT_MS)
    api_calls = [u.split("/api/v1/", 1)[1] for u in requests if "/api/v1/" in u]
    assert len(api_calls) == len(set(api_calls)), f"an API URL was requested twice: {api_calls}"
    # Issued by the <link rel=preload> in the head (initiator "link"), not by the script once it ran.
    entries = page.evaluate(
        "() => performance.getEntriesByType('resource').filter(r => r.name.includes('/timeline?'))"
        ".map(r => r.initiatorType)"
    )
    assert entries == ["link"], f"the timeline was not taken from the preload: {entries}"
    assert timeline_kinds(page)["bucket ready"]["segments"] == 2 * 3


def test_step_navigation_links_to_previous_next_and_slowest_steps(collector: Collector, page) -> None:
    job = unique("nav")
    records = synth_job(2, 8, 3, job=job, t0_ns=time.time_ns() - 10**9, seed=3)
    post(collector.url, records)
    slowest = max(api(collector, f"/api/v1/jobs/{job}/steps?rank=0")["items"], key=lambda i: i["step_s"])[
        "step"
    ]
    open_step(page, collector.url, job, 4)
    page.wait_for_function(
        "!document.getElementById('next-step').classList.contains('disabled')", timeout=WAIT_MS
    )
    assert page.get_attribute("#prev-step", "href").endswith("/steps/3")
    assert page.get_attribute("#next-step", "href").endswith("/steps/5")
    assert page.get_attribute("#slowest-step", "href").endswith(f"/steps/{slowest}")
    page.click("#next-step")
    page.wait_for_function("window.ddpTimelineComplete === true", timeout=WAIT_MS)
    assert page.url.endswith("/steps/5") and text(page, "#step-no") == "5"
    open_step(page, collector.url, job, 0)
    page.wait_for_function("window.ddpTimelineComplete === true", timeout=WAIT_MS)
    assert page.get_attribute("#prev-step", "href") is None, "step 0 has no previous step"
    assert str(page.locator("#ranks tbody tr").count()) == "2"


def test_a_step_that_does_not_exist_gets_a_clear_message(collector: Collector, page) -> None:
    job = unique("nostep")
    synth = SynthJob(job, world_size=2, buckets=3)
    post(collector.url, synth.start() + synth.steps(3))
    page.problems.allowed.append("404")  # the timeline API answers 404 for a missing step; the page says so
    resp = open_step(page, collector.url, job, 999)
    assert resp.status == 200
    page.wait_for_function(
        "document.getElementById('message').textContent.includes('no records')", timeout=WAIT_MS
    )
    assert "Step 999 has no records" in text(page, "#message")
    screenshot(page, "step-missing")


def test_a_rank_with_no_record_of_the_step_is_named_on_the_timeline(collector: Collector, page) -> None:
    job = unique("silent")
    synth = SynthJob(job, world_size=3, buckets=3)
    post(collector.url, synth.start() + synth.steps(2) + synth.steps(1, ranks=[0, 2]))
    open_step(page, collector.url, job, 2)
    assert "rank 1" in text(page, "#message")
    fig = figure(page, "timeline")
    assert fig["layout"]["yaxis"]["ticktext"] == ["rank 0", "rank 1", "rank 2"]
    assert any("rank 1: no record" in a["text"] for a in fig["layout"]["annotations"])
    assert timeline_kinds(page)["bucket ready"]["segments"] == 2 * 3
    screenshot(page, "step-silent-rank")


def test_the_step_a_job_hung_in_shows_each_ranks_unfinished_spans_and_where_the_others_stopped(
    collector: Collector, page
) -> None:
    job = unique("hung")
    synth = SynthJob(job, world_size=3, buckets=3)
    recs = synth.start() + synth.steps(2)
    recs += [
        stopped(synth, 0, "hang", phase="allreduce", step=2, partial=synth.partial_step(launched=3, done=2)),
        stopped(
            synth,
            1,
            "error",
            phase="backward",
            step=2,
            partial=synth.partial_step(launched=1, done=1),
            message="Connection closed by peer",
        ),  # fmt: skip
        stopped(synth, 2, "hang", phase="idle", step=1, partial=None),
    ]
    post(collector.url, recs)
    open_step(page, collector.url, job, 2)
    message = text(page, "#message")
    assert "never finished on rank 0 (hung in allreduce), 1 (failed in backward)" in message
    assert "Rank 2 hung in idle at step 1" in message
    kinds = timeline_kinds(page)
    assert kinds["all-reduce still in flight"]["segments"] == 1  # rank 0's bucket 2
    assert kinds["report of the stop"]["segments"] == 2
    assert kinds["bucket ready"]["segments"] == 3 + 1
    fig = figure(page, "timeline")
    assert fig["layout"]["yaxis"]["ticktext"] == ["rank 0", "rank 1", "rank 2"]
    notes = [a["text"] for a in fig["layout"]["annotations"]]
    assert "rank 2: hung in idle at step 1, not in this step" in notes
    page.wait_for_function("window.ddpTimelineComplete === true", timeout=WAIT_MS)
    assert "Connection closed by peer" in text(page, "#ranks")
    screenshot(page, "step-hung")
    # The job page links the step it stopped in, which no rank finished.
    open_job(page, collector.url, job)
    link = page.locator("#stopped-step-link")
    link.wait_for(timeout=WAIT_MS)
    assert link.inner_text() == "step 2, where it stopped"


def test_a_job_with_no_steps_yet_says_so_and_an_unknown_job_is_a_404_page(collector: Collector, page) -> None:
    job = unique("nosteps")
    post(collector.url, SynthJob(job, world_size=2, buckets=2).start())
    open_job(page, collector.url, job)
    assert "has not reported any steps yet" in text(page, "#message")
    screenshot(page, "job-no-steps")
    page.problems.allowed.append("404")  # the document itself is a 404 page
    resp = page.goto(job_url(collector.url, "never-heard-of-it"))
    assert resp.status == 404
    assert "no records for job" in text(page, "#message")


def test_the_job_list_says_so_when_no_job_has_reported(tmp_path, page) -> None:
    from tests.browser.conftest import running_collector

    with running_collector(tmp_path) as empty:
        open_job_list(page, empty.url)
        assert "No jobs yet" in text(page, "#message")
        assert page.locator("#jobs").is_hidden()
        screenshot(page, "job-list-empty")


def test_markup_in_job_ids_parameter_names_and_stacks_renders_as_text(collector: Collector, page) -> None:
    job = unique("<img src=x onerror=alert(1)>") + "\"'&"
    synth = SynthJob(job, world_size=2, buckets=3, param_name="<script>alert('p{bucket}')</script>.w{i}")
    recs = synth.start() + synth.steps(3, unused=["<b onmouseover=alert(2)>head</b>"])
    recs.append(rank_error(synth, 1, message="bad <script>alert(3)</script>",
                           stack='File "<img src=y onerror=alert(4)>.py", line 1\nValueError: bad'))  # fmt: skip
    post(collector.url, recs)
    open_job_list(page, collector.url)
    assert job in [r.get_attribute("data-job") for r in page.locator("#jobs tbody tr").all()]
    open_job(page, collector.url, job)
    assert job in text(page, "h1")
    assert page.locator("img").count() == 0 and page.locator("main script").count() == 0
    page.wait_for_function("!document.getElementById('unused').hidden", timeout=WAIT_MS)
    assert "<b onmouseover=alert(2)>head</b>" in text(page, "#unused")
    open_step(page, collector.url, job, 1)
    assert any(
        "&lt;script&gt;alert('p0')&lt;/script&gt;.w0" in t
        for t in timeline_kinds(page)["bucket ready"]["text"]
    )
    open_incidents(page, collector.url, job)
    assert "<img src=y onerror=alert(4)>.py" in text(page, "pre.stack")
    assert page.locator("img").count() == 0
    assert page.problems.dialogs == []


def test_incidents_page_shows_the_diagnosis_with_stacks_and_culprit_ranks_highlighted(
    collector: Collector, page
) -> None:
    job = unique("incidents")
    synth = SynthJob(job, world_size=3, buckets=3)
    recs = synth.start() + synth.steps(3)
    recs += collectives(synth, {
        0: [("all_reduce", "train.py:10"), ("all_reduce", "train.py:11")],
        1: [("all_reduce", "train.py:10"), ("broadcast", "train.py:30")],
        2: [("all_reduce", "train.py:10"), ("all_reduce", "train.py:11")],
    })  # fmt: skip
    recs.append(
        rank_error(
            synth,
            1,
            message="shape mismatch",
            stack='Traceback (most recent call last):\n  File "train.py", line 30\nValueError: shape mismatch',
        )
    )
    post(collector.url, recs)
    open_incidents(page, collector.url, job)
    kinds = [a.get_attribute("data-kind") for a in page.locator("article.incident").all()]
    assert "mismatch" in kinds and "rank_error" in kinds
    culprits = [c.inner_text() for c in page.locator("#rank-grid .rank.culprit").all()]
    assert culprits == ["1"]
    assert page.locator("#rank-grid .rank").count() == 3
    mismatch = page.locator("article.incident[data-kind=mismatch]")
    assert "train.py:30" in mismatch.inner_text()
    assert (
        "ValueError: shape mismatch"
        in page.locator("article.incident[data-kind=rank_error] pre.stack").inner_text()
    )
    screenshot(page, "incidents")
    open_job(page, collector.url, job)
    page.wait_for_function("document.querySelectorAll('#incidents li').length >= 2", timeout=WAIT_MS)


def test_job_page_updates_without_reload_while_records_arrive(collector: Collector, page) -> None:
    job = unique("live-synth")
    synth = SynthJob(job, world_size=2, buckets=4)
    post(collector.url, synth.start() + synth.steps(3))
    open_job(page, collector.url, job)
    page.evaluate("window.__notReloaded = true")
    assert figure(page, "heatmap")["data"][0]["x"] == [0, 1, 2]
    for _ in range(3):
        post(collector.url, synth.steps(2))
        time.sleep(0.5)
    page.wait_for_function(
        "() => { const d = document.getElementById('heatmap'); return d.data && d.data[0].x.length === 9; }", timeout=WAIT_MS)  # fmt: skip
    assert page.evaluate("window.__notReloaded === true"), "the page reloaded instead of updating in place"
    assert text(page, "#latest-step-link") == "timeline of step 8"
    screenshot(page, "job-page-live-synthetic")
