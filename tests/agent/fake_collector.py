"""A fake ddpscope collector: a real stdlib HTTP server on loopback that can misbehave on cue.

It speaks the real ingest contract (``POST /api/v1/ingest``, gzip JSON ``{"schema", "records"}``
validated with ``records.validate_batch``, bearer token when set) and stores records deduplicated by
their idempotency key, counting the duplicates it ignored. ``script(...)`` queues behaviours for
the next requests, one each (``unknown_kinds`` plays a collector older than the agent): ``"ok"``, an HTTP status (``500``, ``400``), ``("429", seconds)`` with
``Retry-After``, ``"reset"`` (TCP reset before answering), ``"hang"`` (never answers, until stop)
or ``"commit-then-500"`` (stores the batch, then claims failure: the client must resend and the
duplicate must be ignored). Reusable by any test::

    with FakeCollector() as collector:
        agent.configure(url=collector.url, ...)
        ...
        collector.wait_for(lambda c: len(c.of_kind("step")) == 10, timeout_s=10)
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ddpscope.agent import step_block
from ddpscope.agent.records import RecordError, idempotency_key, validate_batch

Behaviour = Any


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    collector: FakeCollector


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.collector._lock:
            self.server.collector._conns.add(self.connection)

    def finish(self) -> None:
        with self.server.collector._lock:
            self.server.collector._conns.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        return None  # keep pytest output readable

    def do_GET(self) -> None:
        self._answer(200, b'{"status":"ok"}')

    def do_POST(self) -> None:
        c = self.server.collector
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length)
        behaviour = c._next_behaviour()
        c.requests.append(behaviour)
        c.request_times.append(time.monotonic())
        c.bodies.append(body)
        if behaviour == "reset":
            # SO_LINGER 0 then close: the client sees ECONNRESET, not a clean close.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        if behaviour == "hang":
            c._stopped.wait(c.hang_s)
            self.close_connection = True
            return
        if c.token is not None and self.headers.get("Authorization") != f"Bearer {c.token}":
            self._answer(401, b'{"detail":"missing or wrong bearer token"}')
            return
        if isinstance(behaviour, tuple):
            status, retry_after = behaviour
            self._answer(int(status), b'{"detail":"slow down"}', {"Retry-After": str(retry_after)})
            return
        if isinstance(behaviour, int):
            self._answer(behaviour, b'{"detail":"scripted failure"}')
            return
        try:
            raw = gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body
            batch = json.loads(raw)
            for i, record in enumerate(batch.get("records") or []):
                if isinstance(record, dict) and record.get("kind") in c.unknown_kinds:
                    # What an older ddpscope collector's decoder answers for a kind added since.
                    detail = f"Invalid value '{record['kind']}' - at `batch.records[{i}].kind`"
                    c.unknown_refusals += 1
                    self._answer(422, json.dumps({"detail": detail}).encode())
                    return
            records = validate_batch(batch)
        except (OSError, ValueError, RecordError) as exc:
            c.bad_batches.append(str(exc))
            self._answer(400, json.dumps({"detail": str(exc)}).encode())
            return
        c._store(records)
        if behaviour == "commit-then-500":
            self._answer(500, b'{"detail":"committed but answered 500"}')
            return
        self._answer(200, json.dumps({"accepted": len(records)}).encode())

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)


class FakeCollector:
    def __init__(self, port: int = 0, *, token: str | None = None, hang_s: float = 30.0) -> None:
        self.port = port
        self.token = token
        self.hang_s = hang_s
        self.records: dict[tuple[str, int, str, int], dict[str, Any]] = {}
        """Stored records by idempotency key (first copy wins)."""
        self.duplicates = 0
        self.requests: list[Behaviour] = []
        self.request_times: list[float] = []
        self.bodies: list[bytes] = []
        """Every request body as it arrived (gzip or not), in order."""
        self.bad_batches: list[str] = []
        self.unknown_kinds: set[str] = set()
        self.unknown_refusals = 0
        self.step_blocks = 0
        """``step_block`` records received (each stored as its step records)."""
        """Kinds refused as a collector older than the agent refuses them (422 naming the ``.kind``)."""
        self._script: collections.deque[Behaviour] = collections.deque()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeCollector:
        self._stopped.clear()
        self._server = _Server(("127.0.0.1", self.port), _Handler)
        self._server.collector = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.daemon = True
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        # Kept-alive connections outlive server_close(); a stopped collector must not answer them.
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> FakeCollector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def script(self, *behaviours: Behaviour) -> None:
        with self._lock:
            self._script.extend(behaviours)

    def _next_behaviour(self) -> Behaviour:
        with self._lock:
            return self._script.popleft() if self._script else "ok"

    def _store(self, records: list[Any]) -> None:
        with self._lock:
            for r in records:
                if r["kind"] != "step_block":
                    self._store_one(r)
                    continue
                self.step_blocks += 1  # stored as the step records it stands for, as the collector does
                for step in step_block.expand(r):
                    self._store_one(step)

    def _store_one(self, r: Any) -> None:
        key = idempotency_key(r)
        if key in self.records:
            self.duplicates += 1
        else:
            self.records[key] = dict(r)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return sorted(
                (r for r in self.records.values() if r["kind"] == kind),
                key=lambda r: (r["rank"], r["stream"], r["seq"]),
            )

    def dropped_total(self, exclude_kinds: tuple[str, ...] = ("agent_stats",)) -> int:
        """Drops reported by every stream's latest ``agent_stats``, not counting excluded kinds."""
        latest: dict[tuple[str, int, str], dict[str, Any]] = {}
        for r in self.of_kind("agent_stats"):
            key = (r["job"], r["rank"], r["stream"])
            if key not in latest or r["seq"] > latest[key]["seq"]:
                latest[key] = r
        return sum(
            n
            for r in latest.values()
            for reason_kind, n in r["dropped"].items()
            if reason_kind.split(":", 1)[-1] not in exclude_kinds
        )

    def wait_for(self, predicate: Callable[[FakeCollector], bool], timeout_s: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(0.02)
        return predicate(self)
