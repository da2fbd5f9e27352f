"""The ddpscope command at the edges: a URL that is no collector, a closed output pipe, many jobs.

Each server here is a real HTTP server on loopback answering fixed JSON or error pages, so the answer
is exactly the edge under test (a proxy's 404 page, 25 jobs with known last-seen times)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

PROXY_PAGE = (
    b"<html><head><title>404 Not Found</title></head><body><h1>404 Not Found</h1><hr>nginx</body></html>"
)
FASTAPI_404 = b'{"detail":"Not Found"}'


class Stub:
    """Answers ``GET path`` from ``routes`` (status, body), anything else with ``fallback``."""

    def __init__(self, routes: dict[str, tuple[int, bytes]], fallback: tuple[int, bytes]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = routes.get(self.path.partition("?")[0], fallback)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Any]:
    made: list[Stub] = []

    def make(routes: dict[str, tuple[int, bytes]], fallback: tuple[int, bytes]) -> str:
        made.append(Stub(routes, fallback))
        return made[-1].url

    yield make
    for s in made:
        s.close()


def jobs_body(n: int) -> bytes:
    items = [
        {"job": f"job-{i:04d}", "world_size": 2, "status": "finished", "last_seen": 1_700_000_000 + i}
        for i in range(n)
    ]
    return json.dumps({"items": items[::-1][: n // 2] + items[: n - n // 2]}).encode()  # not in time order


def ddpscope(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpscope.cli.main", *args], capture_output=True, text=True, timeout=60, **kw
    )


@pytest.mark.parametrize("page", [PROXY_PAGE, FASTAPI_404], ids=["proxy-html", "another-fastapi-app"])
def test_a_url_that_answers_404_to_everything_is_not_a_collector_and_exits_three(stub, page) -> None:
    url = stub({}, (404, page))
    for args in (["report", "some-job"], ["jobs"], ["export", "some-job", "-o", "/dev/null"]):
        out = ddpscope(*args, "--url", url)
        assert out.returncode == 3, (args, out.stderr)
        assert f"{url} does not look like a ddpscope collector" in out.stderr
        assert "HTTP 404" in out.stderr and "DDPSCOPE_URL" in out.stderr and "Traceback" not in out.stderr
        assert ("404 Not Found nginx" if page is PROXY_PAGE else "Not Found") in out.stderr  # what answered


def test_a_url_that_answers_html_instead_of_json_is_not_a_collector_and_exits_three(stub) -> None:
    url = stub({}, (200, b"<html><body>Welcome to nginx!</body></html>"))
    out = ddpscope("jobs", "--url", url)
    assert out.returncode == 3 and "does not look like a ddpscope collector" in out.stderr, out.stderr


def test_an_unknown_job_lists_the_most_recent_jobs_and_counts_the_rest(stub) -> None:
    missing = (404, b'{"detail":"job \'nope\' not found: no record of it reached this collector"}')
    url = stub({"/api/v1/jobs": (200, jobs_body(25))}, missing)
    out = ddpscope("report", "nope", "--url", url)
    assert out.returncode == 4, out.stderr
    newest_first = ", ".join(f"job-{i:04d}" for i in range(24, 14, -1))
    assert f"(known jobs: {newest_first}, ... and 15 more: ddpscope jobs)" in out.stderr
    assert "job-0000" not in out.stderr


@pytest.mark.parametrize("jobs", [3, 5000], ids=["output-in-the-buffer", "output-past-the-pipe"])
def test_jobs_piped_into_a_reader_that_stops_early_exits_quietly(stub, jobs) -> None:
    """`ddpscope jobs | head -4`: no BrokenPipeError traceback, the exit status of a Unix tool that
    met a closed pipe (128 + SIGPIPE). The reader here stops after at most four lines."""
    url = stub({"/api/v1/jobs": (200, jobs_body(jobs))}, (404, FASTAPI_404))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpscope.cli.main", "jobs", "--url", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        if jobs > 4:
            head = [proc.stdout.readline() for _ in range(4)]
            assert head[0].startswith(b"job ") and all(head)
        proc.stdout.close()  # for 3 jobs: closed before the command has even fetched them
        err = proc.stderr.read().decode()
        assert proc.wait(60) == 141, err
        assert err == "", err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("url", ["htp://127.0.0.1:8321", "127.0.0.1:8321"])
def test_a_url_that_is_not_http_is_a_usage_error_said_before_any_request(url: str) -> None:
    done = ddpscope("report", "some-job", "--url", url)
    assert done.returncode == 2, done
    assert "is not an http(s) URL" in done.stderr and "Traceback" not in done.stderr


def test_export_to_a_path_it_cannot_write_is_a_usage_error_and_writes_nothing(stub, tmp_path) -> None:
    trace = json.dumps({"traceEvents": [{"ph": "X", "name": "forward"}]}).encode()
    url = stub({"/api/v1/jobs/j/trace": (200, trace)}, (404, FASTAPI_404))
    for target, said in [
        (tmp_path / "missing" / "t.json", "which does not exist"),
        (tmp_path, "is a directory"),
    ]:
        done = ddpscope("export", "j", "--url", url, "-o", str(target))
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done
    done = ddpscope("export", "j", "--url", url, "-o", str(tmp_path / "t.json"), "--start", "9", "--end", "3")
    assert done.returncode == 2 and "--start 9 is after --end 3" in done.stderr
    done = ddpscope("export", "j", "--url", url, "-o", str(tmp_path / "t.json"))
    assert done.returncode == 0 and json.loads((tmp_path / "t.json").read_text()) == json.loads(trace)
