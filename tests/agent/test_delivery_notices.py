"""Delivery trouble reaches the person running the job: one line on the rank's own stderr, and a wrong
URL loses nothing. Real rank processes, real shippers, real HTTP servers on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

import pytest

from ddpscope.agent.shipper import tell_writer, wrong_url
from ddpscope.agent.transport import Outcome
from tests.agent.conftest import kill_shippers, shipper_pids, spooled, wait_shippers_gone
from tests.agent.fake_collector import FakeCollector
from tests.support.agent_env import agent_env
from tests.support.procs import free_port, kill_group

CHILD = Path(__file__).with_name("child.py")
pytestmark = pytest.mark.timeout(120)

PROXY_PAGE = (
    b"<html><head><title>404 Not Found</title></head><body><h1>404 Not Found</h1><hr>nginx</body></html>"
)


class NotACollector:
    """A real HTTP server that answers every request 404 with an HTML page, as a proxy or another
    service at a wrong ``DDPSCOPE_URL`` does."""

    def __init__(self) -> None:
        self.posts = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                if self.command == "POST":
                    owner.posts += 1
                self.send_response(404)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(PROXY_PAGE)))
                self.end_headers()
                self.wfile.write(PROXY_PAGE)

            do_GET = do_POST = _answer

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})
        self.thread.daemon = True

    def __enter__(self) -> NotACollector:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def not_a_collector() -> Iterator[NotACollector]:
    with NotACollector() as server:
        yield server


def start_rank(
    procs: list[subprocess.Popen[bytes]], mode: str, env: dict[str, str], stderr: int | IO[Any]
) -> subprocess.Popen[bytes]:
    """``child.py MODE 50``: 50 heartbeats; 'sigterm' then waits (READY on stdout) until SIGTERM."""
    p = subprocess.Popen(
        [sys.executable, str(CHILD), mode, "50"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        start_new_session=True,
    )
    procs.append(p)
    return p


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def ready(p: subprocess.Popen[bytes]) -> None:
    assert p.stdout is not None
    assert p.stdout.readline().strip() == b"READY"


def notices(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("ddpscope: rank ")]


def test_only_answers_no_ddpscope_collector_gives_on_ingest_count_as_a_wrong_url() -> None:
    def outcome(status: int | None) -> Outcome:
        return Outcome(False, False, status, None, "")

    assert all(wrong_url(outcome(s)) for s in (301, 302, 307, 308, 403, 404, 405, 407, 501))
    # The collector's own refusals (bad batch, token, size) and transient failures are not.
    assert not any(wrong_url(outcome(s)) for s in (None, 400, 401, 413, 422, 429, 500, 503))


def test_a_collector_answering_server_errors_is_said_to_be_up_but_failing_to_store_not_missing() -> None:
    from ddpscope.agent.shipper import _advice

    assert "see its log and its /healthz" in _advice(Outcome(False, True, 503, None, "database is locked"))
    assert "start a collector" in _advice(Outcome(False, True, None, None, "ConnectionRefusedError"))


def test_a_url_answering_404_keeps_every_record_tells_the_rank_once_and_a_corrected_url_delivers_them(
    not_a_collector, spool_dir, started
) -> None:
    env = agent_env(not_a_collector.url, spool_dir, "wrong-url", DDPSCOPE_SHIPPER_LINGER_S="1")
    rank = start_rank(started, "sigterm", env, subprocess.PIPE)
    ready(rank)
    wait_until(lambda: not_a_collector.posts >= 4, 30, "several POSTs to the 404 server")
    os.kill(rank.pid, signal.SIGTERM)
    _, err = rank.communicate(timeout=20)
    lines = notices(err.decode())
    assert len(lines) == 1, err.decode()  # one line for all those retries, never one per batch
    (line,) = lines
    for part in (f"{not_a_collector.url}/api/v1/ingest", "HTTP 404", "not a ddpscope collector"):
        assert part in line
    assert str(spool_dir) in line and "DDPSCOPE_URL" in line and "Nothing is dropped" in line
    # Kept for replay, not set aside: the shipper gives up after its linger and leaves the spool.
    assert wait_shippers_gone(spool_dir, 30)
    assert not list(spool_dir.glob("*.rejected"))
    assert sorted(r["step"] for r in spooled(spool_dir) if r["kind"] == "heartbeat") == list(range(50))

    # The same job rerun with the right URL: its shipper adopts what the first run left behind.
    with FakeCollector() as collector:
        again = start_rank(started, "exit", agent_env(collector.url, spool_dir, "wrong-url"), subprocess.PIPE)
        again.communicate(timeout=30)
        assert collector.wait_for(lambda c: len(c.of_kind("heartbeat")) >= 100, 30)
        streams = {r["stream"] for r in collector.of_kind("heartbeat")}
        assert len(streams) == 2 and collector.duplicates == 0
        assert sorted(r["step"] for r in collector.of_kind("heartbeat")) == sorted(2 * list(range(50)))


@pytest.mark.parametrize("mode", ["w", "a"])
def test_a_rank_whose_stderr_is_a_file_gets_the_line_exactly_once_appended_or_truncated(
    mode, not_a_collector, spool_dir, started, tmp_path
) -> None:
    """``> log`` (no O_APPEND): the shipper must not write into the file (the rank's next write would
    land over the line), so the rank prints it at exit. ``>> log``: the shipper appends it at once."""
    log = tmp_path / "rank.log"
    with open(log, mode) as stderr:
        rank = start_rank(started, "sigterm", agent_env(not_a_collector.url, spool_dir, "to-a-file"), stderr)
    ready(rank)
    wait_until(lambda: not_a_collector.posts >= 2, 30, "the 404")
    if mode == "a":
        wait_until(lambda: len(notices(log.read_text())) == 1, 10, "the line in the log")
    else:
        wait_until(lambda: bool(list(spool_dir.glob("*.notice"))), 10, "the notice file")
        assert notices(log.read_text()) == []
    os.kill(rank.pid, signal.SIGTERM)
    rank.wait(20)
    text = log.read_text()
    assert len(notices(text)) == 1 and "HTTP 404" in text, text
    assert not list(spool_dir.glob("*.notice"))


def test_a_collector_that_stays_unreachable_is_told_once_after_the_notice_delay(spool_dir, started) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = agent_env(url, spool_dir, "unreachable", DDPSCOPE_NOTICE_AFTER_S="1")
    rank = start_rank(started, "sigterm", env, subprocess.PIPE)
    ready(rank)
    wait_until(lambda: "accepted nothing" in logs(spool_dir), 30, "the shipper's notice")
    time.sleep(1.5)  # more failed retries (0.3 s apart): still one line
    os.kill(rank.pid, signal.SIGTERM)
    _, err = rank.communicate(timeout=20)
    (line,) = notices(err.decode())
    assert f"the collector at {url}/api/v1/ingest has accepted nothing for" in line
    assert "ConnectionRefusedError" in line and str(spool_dir) in line and "DDPSCOPE_URL" in line


def test_a_rank_that_ends_before_the_notice_delay_with_nothing_delivered_still_says_so_once_at_exit(
    spool_dir, started
) -> None:
    # A short job with no collector: before, nothing was said anywhere the person looks.
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = agent_env(url, spool_dir, "short", DDPSCOPE_NOTICE_AFTER_S="600")
    rank = start_rank(started, "sigterm", env, subprocess.PIPE)
    ready(rank)
    wait_until(lambda: any(spool_dir.glob("*.pending-notice")), 30, "the shipper's first failed attempt")
    os.kill(rank.pid, signal.SIGTERM)
    _, err = rank.communicate(timeout=20)
    (line,) = notices(err.decode())
    assert f"the collector at {url}/api/v1/ingest has accepted nothing" in line
    assert "ConnectionRefusedError" in line and str(spool_dir) in line and "ddpscope serve" in line


def test_a_batch_the_collector_refuses_for_good_is_told_once_with_where_it_was_set_aside(
    collector, spool_dir, started
) -> None:
    collector.script(422, 422)
    rank = start_rank(started, "sigterm", agent_env(collector.url, spool_dir, "refused"), subprocess.PIPE)
    ready(rank)
    wait_until(lambda: collector.requests.count(422) == 2 or bool(collector.of_kind("heartbeat")), 30, "422s")
    os.kill(rank.pid, signal.SIGTERM)
    _, err = rank.communicate(timeout=20)
    (line,) = notices(err.decode())
    assert "refused a batch for good (HTTP 422 (scripted failure))" in line
    assert ".rejected" in line and "DDPSCOPE_TOKEN" in line


def logs(spool_dir: Path) -> str:
    return "\n".join(p.read_text() for p in spool_dir.glob("*.shipper.log"))


@contextlib.contextmanager
def sleeper(stderr: int | IO[Any]) -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "60"], stderr=stderr, start_new_session=True)
    try:
        yield p
    finally:
        kill_group(p)
        p.wait(10)


def test_the_line_is_written_to_a_pipe_or_an_appended_file_but_never_over_a_truncated_file_or_a_socket(
    tmp_path,
) -> None:
    with sleeper(subprocess.PIPE) as p:
        assert tell_writer(p.pid, "ddpscope: hello")
        assert p.stderr is not None and p.stderr.readline() == b"ddpscope: hello\n"
    for mode, expected in (("a", True), ("w", False)):
        path = tmp_path / f"stderr-{mode}.log"
        with open(path, mode) as f, sleeper(f) as p:
            assert tell_writer(p.pid, "ddpscope: hello") is expected
        assert path.read_text() == ("ddpscope: hello\n" if expected else "")
    left, right = socket.socketpair()
    with left, right, sleeper(left.fileno()) as p:
        assert not tell_writer(p.pid, "ddpscope: hello")


def _wakeups(pid: int) -> int:
    """Times the process has gone to sleep and been woken (its threads' voluntary context switches)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            status = (task / "status").read_text()
            total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


def test_a_shipper_left_behind_by_its_rank_sleeps_through_its_backoff(spool_dir, started) -> None:
    """Nothing can be added to the spool once the rank is gone, so the shipper has nothing to watch
    between retries: a sweep of short jobs with the collector down leaves one lingering shipper per rank
    (80 of them took a quarter of a core, waking 4 times a second each to re-check the spool's cap)."""
    env = agent_env(f"http://127.0.0.1:{free_port()}", spool_dir, "lingering", DDPSCOPE_RETRY_MAX_S="2")
    rank = start_rank(started, "exit", env, subprocess.PIPE)
    try:
        _, err = rank.communicate(timeout=30)
        wait_until(lambda: len(shipper_pids(spool_dir)) == 1, 10, "the shipper's lock")
        (pid,) = shipper_pids(spool_dir)
        time.sleep(4.0)  # the backoff reaches its 2 s cap
        before = _wakeups(pid)
        time.sleep(6.0)
        woken = _wakeups(pid) - before
        # A retry every 2 s (a refused connection each); polling the spool every 0.25 s woke it 24 times.
        assert woken <= 10, woken  # 27 before the fix, measured
    finally:
        kill_shippers(spool_dir)
