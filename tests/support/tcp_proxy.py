"""A loopback TCP proxy whose faults the test switches at run time.

``TcpProxy(upstream_port)`` listens on a free loopback port and forwards every connection to
``127.0.0.1:upstream_port``. ``proxy.set(mode, **params)`` changes what happens to traffic from now
on, also on connections already open (the agent keeps its connection alive between batches):

- ``pass``: forward as is;
- ``latency``: hold every chunk ``delay_s`` before forwarding it (both directions);
- ``slow``: forward at most ``bytes_per_s`` (both directions);
- ``reset``: answer the next request bytes with a TCP reset (``SO_LINGER`` 0);
- ``hang``: swallow the request and never answer (the client must time out);
- ``cut``: forward half of the next request chunk, then reset both sides (a body cut mid-way);
- ``lost_ack``: forward the request, drop the answer, then reset: the server committed, the client
  never heard (a retry must not store the batch twice).

``events`` records ``(monotonic time, "request" | "status", value)``: a request's first bytes seen
from the client and each answer's status line, so tests can check ``Retry-After`` is honoured.
Threads only, bounded: every socket has a timeout and the proxy stops by itself after
``max_lifetime_s`` (and on ``stop()`` / leaving the ``with`` block).
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import struct
import threading
import time
from collections import Counter
from typing import Any

logger = logging.getLogger(__name__)

MODES = ("pass", "latency", "slow", "reset", "hang", "cut", "lost_ack")
_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")
_CHUNK = 4096


class TcpProxy:
    def __init__(self, upstream_port: int, *, max_lifetime_s: float = 300.0) -> None:
        self.upstream_port = upstream_port
        self.mode = "pass"
        self.params: dict[str, float] = {}
        self.faults: Counter[str] = Counter()
        """Faults actually injected, by mode (a mode with no traffic injects nothing)."""
        self.events: list[tuple[float, str, Any]] = []
        self.connections = 0
        self._deadline = time.monotonic() + max_lifetime_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-proxy", daemon=True)

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, mode: str, **params: float) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        with self._lock:
            self.mode, self.params = mode, dict(params)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            _close(s)
        _close(self._listener)
        if self._thread.is_alive():
            self._thread.join(2.0)

    def _stopped(self) -> bool:
        return self._stop.is_set() or time.monotonic() > self._deadline

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.add(s)

    def _accept_loop(self) -> None:
        while not self._stopped():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            client.settimeout(0.2)
            self._track(client)
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2.0)
            except OSError:
                _close(client)  # the collector is down: the client sees its connection end
                continue
            upstream.settimeout(0.2)
            self._track(upstream)
            pair = _Pair(client, upstream)
            for src, dst, upward in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(
                    target=self._pump, args=(pair, src, dst, upward), name="tcp-proxy-pump", daemon=True
                ).start()
        self._stop.set()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            _close(s)

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        try:
            while not self._stopped() and not pair.dead:
                try:
                    data = src.recv(_CHUNK)
                except TimeoutError:
                    continue
                if not data:
                    break
                with self._lock:
                    mode, params = self.mode, dict(self.params)
                if upward:
                    if data.startswith((b"POST ", b"GET ")):
                        self.events.append((time.monotonic(), "request", data.split(b" ", 2)[1]))
                    if not self._forward_up(pair, dst, data, mode, params):
                        break
                else:
                    if pair.blackholed:
                        continue
                    m = _STATUS.match(data)
                    if m:
                        self.events.append((time.monotonic(), "status", int(m.group(1))))
                    self._send(dst, data, mode, params)
        except OSError:
            pass  # a peer went away: end this connection
        finally:
            pair.kill(reset=False)

    def _forward_up(
        self, pair: _Pair, dst: socket.socket, data: bytes, mode: str, params: dict[str, float]
    ) -> bool:
        if mode == "reset":
            self.faults["reset"] += 1
            pair.kill(reset=True)
            return False
        if mode == "hang":
            if not pair.hung:
                pair.hung = True
                self.faults["hang"] += 1
            return True  # swallow: nothing reaches the collector, nothing comes back
        if pair.hung:
            return True
        if mode == "cut":
            self.faults["cut"] += 1
            dst.sendall(data[: max(1, len(data) // 2)])
            time.sleep(0.05)
            pair.kill(reset=True)
            return False
        if mode == "lost_ack":
            if not pair.blackholed:
                pair.blackholed = True
                self.faults["lost_ack"] += 1
                # Give the collector time to commit, then vanish without its answer.
                threading.Timer(params.get("after_s", 0.5), pair.kill, kwargs={"reset": True}).start()
            dst.sendall(data)
            return True
        self._send(dst, data, mode, params)
        return True

    def _send(self, dst: socket.socket, data: bytes, mode: str, params: dict[str, float]) -> None:
        if mode == "latency":
            self.faults["latency"] += 1
            time.sleep(params.get("delay_s", 0.2))
            dst.sendall(data)
        elif mode == "slow":
            self.faults["slow"] += 1
            rate = params.get("bytes_per_s", 20_000)
            step = max(1, int(rate / 20))  # 50 ms slices
            for i in range(0, len(data), step):
                dst.sendall(data[i : i + step])
                time.sleep(len(data[i : i + step]) / rate)
        else:
            dst.sendall(data)


class _Pair:
    """The two sockets of one proxied connection and its fault state."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.dead = False
        self.hung = False
        self.blackholed = False

    def kill(self, reset: bool) -> None:
        if self.dead:
            return
        self.dead = True
        for s in (self.client, self.upstream):
            if reset:
                with contextlib.suppress(OSError):
                    # Linger 0: close() sends RST instead of FIN.
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            _close(s)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.close()
