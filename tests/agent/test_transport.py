"""``Poster`` reads every answer framing HTTP/1.x allows, keeps the connection only when it may."""

from __future__ import annotations

import socket
import threading
import time

from ddpscope.agent.transport import Poster


class RawServer:
    """A loopback server that answers each request with the next scripted raw bytes (None: hang up
    instead), closing the connection after an HTTP/1.0 answer or ``Connection: close``."""

    def __init__(self, answers: list[bytes | None], idle_close_after: frozenset[int] = frozenset()) -> None:
        self.answers = answers
        self.idle_close_after = idle_close_after
        """Indexes of answers after which the server closes the connection unannounced, as a server's
        keep-alive timeout does."""
        self.answered = 0
        self.requests: list[bytes] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/api/v1/ingest"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.answers:
            conn, _ = self.sock.accept()
            self.connections += 1
            with conn:
                while self.answers:
                    request = self._request(conn)
                    if request is None:
                        break
                    self.requests.append(request)
                    answer = self.answers.pop(0)
                    if answer is None:
                        break
                    conn.sendall(answer)
                    self.answered += 1
                    if answer.startswith(b"HTTP/1.0") or b"connection: close" in answer.lower():
                        break  # as a server that answers so would: hang up
                    if self.answered - 1 in self.idle_close_after:
                        break

    @staticmethod
    def _request(conn: socket.socket) -> bytes | None:
        data = b""
        while b"\r\n\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                return None
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += conn.recv(65536)
        return head + b"\r\n\r\n" + body


def test_every_framing_of_an_answer_is_read_and_the_connection_kept_when_allowed() -> None:
    server = RawServer(
        [
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Busy\r\nRetry-After: 3\r\nContent-Length: 4\r\n\r\nbusy",
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n4;x=1\r\nNot \r\n5\r\nFound\r\n0\r\nT: 1\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.0 422 Unprocessable\r\n\r\nbad record",  # framed by the end of the connection
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        ]
    )
    poster = Poster(server.url, "s3cret", 5.0)
    got = [poster.post(b"body %d" % i) for i in range(7)]
    assert [o.status for o in got] == [200, 503, 404, 204, 422, 200, 200]
    assert [o.ok for o in got] == [True, False, False, True, False, True, True]
    assert got[1].retry and got[1].retry_after_s == 3.0 and got[1].detail == "busy"
    assert got[2].detail == "Not Found" and not got[2].retry
    assert got[4].detail == "bad record"
    assert server.connections == 3, "a new connection only after HTTP/1.0 and Connection: close"
    first = server.requests[0]
    assert first.startswith(b"POST /api/v1/ingest HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer s3cret\r\n" in first
    assert b"Content-Encoding" not in first, "a body that is not gzip is sent as it is"
    assert first.endswith(b"\r\nContent-Length: 6\r\n\r\nbody 0")
    poster.close()


def test_a_hang_up_or_garbage_is_a_transient_failure_and_the_next_post_reconnects() -> None:
    server = RawServer([None, b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"])
    poster = Poster(server.url, None, 5.0)
    hung_up, garbage, ok = (poster.post(b"x") for _ in range(3))
    assert hung_up.retry and hung_up.status is None and "RemoteDisconnected" in hung_up.detail
    assert garbage.retry and garbage.status is None and "ProtocolError" in garbage.detail
    assert ok.ok and server.connections == 3


def test_a_kept_alive_connection_the_collector_closed_while_idle_is_replaced_without_a_failure() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    server = RawServer([ok, ok, ok], idle_close_after=frozenset({0, 1}))
    poster = Poster(server.url, None, 5.0)
    for i in range(3):
        outcome = poster.post(b"x%d" % i)
        assert outcome.ok, outcome
        time.sleep(0.05)  # the server has closed the connection by the next post
    assert server.connections == 3 and len(server.requests) == 3
    poster.close()


def test_an_unreachable_collector_is_a_transient_failure() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    outcome = Poster(f"http://127.0.0.1:{port}/api/v1/ingest", None, 1.0).post(b"x")
    assert outcome.retry and "ConnectionRefusedError" in outcome.detail
