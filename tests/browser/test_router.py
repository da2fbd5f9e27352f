"""The router's HTTP contract, without a browser: status codes, escaping, assets, no internet."""

from __future__ import annotations

import hashlib
import re
from importlib.resources import files
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from ddpscope.dashboard import plotly_js
from tests.browser.stub_api import HOSTILE_JOB, stub_app


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(stub_app())


def test_an_unknown_job_gets_a_404_page_that_says_so(client: TestClient) -> None:
    resp = client.get("/jobs/no-such-job")
    assert resp.status_code == 404
    assert "text/html" in resp.headers["content-type"]
    assert "no records for job" in resp.text and "no-such-job" in resp.text


def test_every_page_of_an_unknown_job_is_a_404_page(client: TestClient) -> None:
    for suffix in ("", "/steps/3", "/incidents"):
        assert client.get(f"/jobs/nope{suffix}").status_code == 404


def test_a_step_that_is_not_a_number_gets_a_page_saying_so(client: TestClient) -> None:
    resp = client.get(f"/jobs/{quote(HOSTILE_JOB, safe='')}/steps/abc")
    assert resp.status_code == 404
    assert "is not a step number" in resp.text


def test_a_hostile_job_id_is_escaped_in_every_server_rendered_page(client: TestClient) -> None:
    job = quote(HOSTILE_JOB, safe="")
    for path in (f"/jobs/{job}", f"/jobs/{job}/steps/5", f"/jobs/{job}/incidents", "/jobs/%3Cscript%3Ex"):
        html = client.get(path).text
        assert "<img src=x" not in html and "<script>x" not in html, path
        assert "&lt;img src=x onerror=alert(1)&gt;" in html or "&lt;script&gt;x" in html, path


def test_pages_load_scripts_only_from_the_collector_itself(client: TestClient) -> None:
    html = client.get(f"/jobs/{quote(HOSTILE_JOB, safe='')}/steps/5").text
    sources = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sources and all(s.startswith(("/", "data:", "#")) for s in sources), sources
    # plotly.js by its versioned URL (?v=hash of the bytes served), so it can be cached for good.
    assert any(re.fullmatch(r"/static/plotly\.min\.js\?v=[0-9a-f]{12}", s) for s in sources), sources


def test_plotly_js_is_served_from_the_collector_with_cache_headers(client: TestClient) -> None:
    resp = client.get("/static/plotly.min.js")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/javascript")
    assert "max-age" in resp.headers["cache-control"]
    assert b"plotly" in resp.content[:2000].lower() and len(resp.content) > 1_000_000


def test_plotly_js_is_the_vendored_bundle_byte_for_byte_after_one_compile_hint_line(
    client: TestClient,
) -> None:
    vendored = plotly_js.vendored_bytes()
    served = client.get("/static/plotly.min.js", headers={"accept-encoding": "identity"})
    hint, _, rest = served.content.partition(b"\n")
    assert hint == b"//# allFunctionsCalledOnLoad" and rest == vendored
    assert "content-encoding" not in served.headers


def test_the_vendored_plotly_bundle_is_the_pinned_npm_release_unedited() -> None:
    assert hashlib.sha256(plotly_js.vendored_bytes()).hexdigest() == plotly_js.VENDORED_SHA256


SHAPE_TYPES = {"path", "line", "rect", "circle"}
"""``type`` values of layout shapes: the rest of a page's ``type: "..."`` are trace types."""


def test_every_trace_type_the_pages_draw_is_registered_in_the_vendored_bundle() -> None:
    static = files("ddpscope.dashboard") / "static"
    used = {
        kind
        for res in static.iterdir()
        if res.name.endswith(".js")
        for kind in re.findall(r'\btype: *"([a-z0-9]+)"', res.read_text())
    } - SHAPE_TYPES
    registered = set(re.findall(rb'moduleType:"trace",name:"([a-z0-9]+)"', plotly_js.vendored_bytes()))
    assert {"scatter", "bar", "heatmap"} <= used  # the scan itself finds what the pages draw
    assert {k.encode() for k in used} <= registered, sorted(used)


def test_plotly_js_is_immutable_under_its_versioned_url_and_a_revalidation_gets_a_304(
    client: TestClient,
) -> None:
    html = client.get(f"/jobs/{quote(HOSTILE_JOB, safe='')}/steps/5").text
    url = re.search(r'src="(/static/plotly\.min\.js\?v=[^"]+)"', html)
    assert url is not None
    first = client.get(url.group(1))
    assert (
        "immutable" in first.headers["cache-control"] and "max-age=31536000" in first.headers["cache-control"]
    )
    etag = first.headers["etag"]
    again = client.get(url.group(1), headers={"if-none-match": etag})
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
    other = client.get(url.group(1), headers={"if-none-match": '"some-other-version"'})
    assert other.status_code == 200 and other.content == first.content


def test_plotly_js_is_gzipped_once_at_startup_and_unpacks_to_the_same_bytes() -> None:
    import time

    with TestClient(stub_app()) as client:  # runs the lifespan, which starts the compression
        plain = client.get("/static/plotly.min.js", headers={"accept-encoding": "identity"})
        deadline = time.monotonic() + 60
        while True:
            resp = client.get("/static/plotly.min.js", headers={"accept-encoding": "gzip, deflate"})
            if resp.headers.get("content-encoding") == "gzip" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert resp.headers.get("content-encoding") == "gzip", "plotly.js was never served compressed"
        assert int(resp.headers["content-length"]) < len(plain.content) // 2
        assert resp.content == plain.content  # httpx unpacked it
        assert "accept-encoding" in resp.headers["vary"].lower()
        refused = client.get("/static/plotly.min.js", headers={"accept-encoding": "gzip;q=0, identity"})
        assert "content-encoding" not in refused.headers and refused.content == plain.content


def test_own_assets_are_served_and_nothing_outside_the_static_folder_is(client: TestClient) -> None:
    assert client.get("/dashboard-static/timeline.js").status_code == 200
    assert "immutable" in client.get("/dashboard-static/style.css").headers["cache-control"]
    for name in ("..%2F__init__.py", "%2E%2E%2Froutes.py", ".hidden", "nope.js"):
        assert client.get(f"/dashboard-static/{name}").status_code == 404, name


def test_scripts_never_put_data_into_the_page_with_inner_html() -> None:
    from importlib.resources import files

    for res in (files("ddpscope.dashboard") / "static").iterdir():
        if res.name.endswith(".js"):
            text = res.read_text()
            assert "innerHTML" not in text and "outerHTML" not in text and "insertAdjacentHTML" not in text, (
                res.name
            )


def test_a_failing_api_does_not_turn_the_page_into_an_error() -> None:
    from fastapi import FastAPI

    from ddpscope.dashboard import router

    app = FastAPI()
    app.include_router(router)

    @app.get("/api/v1/jobs/{job}")
    def broken(job: str) -> None:
        raise RuntimeError("database is gone")

    resp = TestClient(app, raise_server_exceptions=False).get("/jobs/some-job")
    assert resp.status_code == 200, "the page loads and its script reports the API error"
    assert 'data-job="some-job"' in resp.text
