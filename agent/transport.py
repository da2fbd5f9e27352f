"""HTTP delivery to the collector: encoding, one POST, retry policy, and the direct HTTP exporter.

A batch on the wire is ``{"schema": SCHEMA_VERSION, "records": [...]}``, gzip-compressed, POSTed to
``<url>/api/v1/ingest``. 2xx means committed. 429/503 (with ``Retry-After``), 408, other 5xx and
network errors are retried with capped, jittered exponential backoff; any other 4xx is permanent:
the batch is set aside in a rejected file and counted, never retried forever. One refusal is not: a
collector older than this agent refuses a batch holding a record kind it does not know (422 naming the
value at ``.kind``); ``OlderCollector`` then leaves that kind out of every batch and the rest is sent again.

Standard library only: the shipper process imports this module.
"""

from __future__ import annotations

import collections
import email.utils
import gzip
import json
import os
import random
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ddpscope.agent import step_block
from ddpscope.agent.exporters import ExportResult
from ddpscope.agent.log import get_logger
from ddpscope.agent.records import RECORD_KINDS, SCHEMA_VERSION, packed_step_record
from ddpscope.agent.spool import plain

logger = get_logger(__name__)

RETRYABLE = frozenset({408, 425, 429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 60.0
"""A collector asking for a longer pause is still retried after this long."""


def encode_record(record: dict[str, Any]) -> bytes:
    """One record as compact JSON; NaN/inf raise ``ValueError`` (strict collectors refuse them).

    A step's bucket arrays travel packed (``records.packed_step_record``): cheaper to encode here and
    stored by the collector without parsing one JSON number per bucket and field."""
    if record.get("kind") == "step":
        record = packed_step_record(record)
    return _ENCODER.encode(record).encode()


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=plain)
"""One encoder for every record (``json.dumps`` with options builds one per call, ~1 us a record).
default=plain: a 0-d tensor or numpy integer becomes its number, as in the spool."""


_LIST_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=plain, check_circular=False)
"""``_ENCODER`` without the cycle check (15 % of encoding a record): a cycle (marshal carries them)
ends in RecursionError instead, and ``_ENCODER`` then finds the record to leave out."""


def encode_records(
    records: list[dict[str, Any]], *, step_blocks: bool = True
) -> tuple[bytes, list[dict[str, Any]]]:
    """Many records as the comma-separated items of a batch's ``records`` array (one element for
    ``batch_body``), and the records that are in it.

    Step records travel as ``step_block`` records, one per stream (``step_block.py``): the collector
    stores those rows without a Python object per step. ``step_blocks=False`` sends them one by one,
    for a collector older than blocks. One encoder call for the whole list: ``JSONEncoder.encode`` sets
    up its C encoder anew on every call, which is 40 % of encoding a typical 300-byte record alone (4.4 us
    each one by one, 2.7 us in one list; 2 cores, Python 3.11). A record JSON cannot carry (NaN, inf, an
    unknown type) fails the whole call: only then is each item encoded alone, the records of a block that
    fails one by one, and those that fail are left out."""
    items = _wire_items(records, step_blocks)
    try:
        return _LIST_ENCODER.encode([item for item, _ in items]).encode()[1:-1], records
    except (TypeError, ValueError, RecursionError):
        pass
    parts, good = [], []
    for item, held in items:
        if item.get("kind") == "step_block":
            alone = [(packed_step_record(r), [r]) for r in held]
        else:
            alone = [(item, held)]
        for shaped, carried in alone:
            try:
                parts.append(_ENCODER.encode(shaped).encode())
            except (TypeError, ValueError):
                continue
            good += carried
    return b",".join(parts), good


def count_unserializable(
    records: list[dict[str, Any]], shipped: list[dict[str, Any]], dropped: collections.Counter[str]
) -> None:
    """Count in ``dropped`` the records ``encode_records`` left out (NaN, inf: strict JSON refuses them)."""
    if len(shipped) < len(records):
        kept = {id(r) for r in shipped}
        for record in records:
            if id(record) not in kept:
                dropped[f"unserializable:{record.get('kind')}"] += 1


def _wire_items(
    records: list[dict[str, Any]], step_blocks: bool
) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each item of the batch's ``records`` with the records it carries: a block per stream of step
    records (placed where its first step was), the rest as they are."""
    if not step_blocks:
        return [(packed_step_record(r) if r.get("kind") == "step" else r, [r]) for r in records]
    items: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    streams: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
    at: dict[tuple[Any, Any, Any], int] = {}
    for r in records:
        if r.get("kind") != "step":
            items.append((r, [r]))
            continue
        key = (r.get("job"), r.get("rank"), r.get("stream"))
        if key not in streams:
            streams[key] = []
            at[key] = len(items)
            items.append(({}, []))  # the block's place, filled below
        streams[key].append(r)
    for key, steps in streams.items():
        block, held = step_block.build(steps)
        alone: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        if len(held) < len(steps):  # a step that cannot be packed goes alone: the collector names its fault
            kept = {id(r) for r in held}
            alone = [(packed_step_record(r), [r]) for r in steps if id(r) not in kept]
        items[at[key]] = (block, held) if block is not None else alone.pop(0)
        items += alone
    return items


GZIP_MIN_RATIO = 2.0
"""A body is sent gzipped when gzip at least halves it. JSON records shrink 5-10x; a step block is mostly
packed integers in base64 (nanosecond times: their low bytes are noise), which gzip shrinks by only ~40 %,
for ~24 ms of the shipper's CPU and ~4 ms of the collector's per 1,000 steps (2 cores, level 1)."""
GZIP_SAMPLE_BYTES = 16 * 1024
"""Bodies longer than three of these are judged on three samples (start, middle, end)."""


def batch_body(encoded: list[bytes]) -> bytes:
    """The body for already-encoded records (or runs of them from ``encode_records``): gzip when that at
    least halves it (``GZIP_MIN_RATIO``), else the JSON itself. ``is_gzip`` tells which."""
    raw = b'{"schema":%d,"records":[%s]}' % (SCHEMA_VERSION, b",".join(e for e in encoded if e))
    if len(raw) > 3 * GZIP_SAMPLE_BYTES:
        mid, n = len(raw) // 2, GZIP_SAMPLE_BYTES
        sample = raw[:n] + raw[mid : mid + n] + raw[-n:]
        if len(_gzip(sample)) * GZIP_MIN_RATIO > len(sample):
            return raw
        return _gzip(raw)
    packed = _gzip(raw)
    return packed if len(packed) * GZIP_MIN_RATIO <= len(raw) else raw


def _gzip(data: bytes) -> bytes:
    # mtime=0: zlib writes the gzip header and checksum in its one pass (the header's time is
    # meaningless here), ~25 % less CPU than gzip.compress's separate header, crc32 and trailer.
    return gzip.compress(data, compresslevel=1, mtime=0)


def is_gzip(body: bytes) -> bool:
    """Whether ``batch_body`` compressed ``body`` (gzip's magic number; a JSON body starts with '{')."""
    return body[:2] == b"\x1f\x8b"


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    retry: bool
    """Worth retrying (network error, 408/429/5xx); False with ok=False means permanently refused."""
    status: int | None
    retry_after_s: float | None
    detail: str


_UNKNOWN_KIND = re.compile(r"Invalid value '([a-z_]{1,64})' - at `[^`]*\.kind`")
"""How the collector's decoder (msgspec) refuses a record whose kind it has no type for."""


class OlderCollector:
    """The record kinds the collector turned down as unknown: it is older than this agent (a kind was
    added since), and without this every batch holding one such record, step records and all, would be
    refused for good. Those kinds are left out of every later batch, counted as dropped
    (``unsupported:<kind>``), and said once in the log."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.kinds: set[str] = set()

    @property
    def step_blocks(self) -> bool:
        """Whether the collector takes step records in blocks (``encode_records``)."""
        return "step_block" not in self.kinds

    def learn(self, outcome: Outcome) -> bool:
        """True when ``outcome`` refused a kind of this agent's wire format not known before: send again."""
        match = _UNKNOWN_KIND.search(outcome.detail) if outcome.status == 422 else None
        kind = match.group(1) if match else None
        if kind is None or kind not in RECORD_KINDS or kind in self.kinds:
            return False  # a real refusal: bad input, not an older collector
        self.kinds.add(kind)
        if kind == "step_block":
            logger.warning(
                "ddpscope: the collector at %s does not take step records in blocks: it is older than this "
                "agent. They are sent one by one from now on (more work for the collector); nothing is lost.",
                self.url,
            )
            return True
        logger.error(
            "ddpscope: the collector at %s does not know the record kind %r: it is older than this agent. "
            "Records of that kind are left out from now on, the rest is delivered; upgrade the collector to "
            "get them too.",
            self.url,
            kind,
        )
        return True

    def keep(self, records: list[dict[str, Any]], dropped: collections.Counter[str]) -> list[dict[str, Any]]:
        """``records`` without the kinds the collector does not know (counted in ``dropped``)."""
        if not self.kinds:
            return records
        kept = []
        for record in records:
            kind = record.get("kind")
            if kind in self.kinds:
                dropped[f"unsupported:{kind}"] += 1
            else:
                kept.append(record)
        return kept


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), capped."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))


class ProtocolError(Exception):
    """The answer is no HTTP/1.x response we can read (transient, like a network error)."""


class RemoteDisconnected(ConnectionResetError):
    """The collector closed the connection without answering (e.g. a kept-alive one it timed out)."""


MAX_LINE = 65536
MAX_HEADERS = 100
MAX_BODY = 65536
"""A longer answer body is not read to its end (only its start is kept): the connection is closed."""
DETAIL_BYTES = 2000


class Poster:
    """POSTs bodies to one ingest URL over a kept-alive connection (reopened after any error).

    HTTP/1.1 written and read here rather than through ``http.client``: one POST a second is all the
    shipper sends, and ``http.client`` spent ~450 us of CPU on each (request headers assembled one by
    one, the answer's headers parsed by the ``email`` package); this takes ~200 us, most of it the
    kernel's. What is read: the status line (1xx skipped), headers, and a body framed by
    Content-Length, chunked, or the end of the connection."""

    def __init__(self, ingest_url: str, token: str | None, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(ingest_url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        default_port = 443 if self._https else 80
        self._port = parts.port or default_port
        host = f"[{self._host}]" if ":" in self._host else self._host
        if self._port != default_port:
            host += f":{self._port}"
        lines = [
            f"POST {parts.path or '/'} HTTP/1.1",
            f"Host: {host}",
            "Accept-Encoding: identity",
            "Content-Type: application/json",
        ]
        if token:
            lines.append(f"Authorization: Bearer {token}")
        self._head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")
        self._gzip_head = ("\r\n".join([*lines, "Content-Encoding: gzip"]) + "\r\nContent-Length: ").encode(
            "latin-1"
        )
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._rfile: Any = None

    def post(self, body: bytes) -> Outcome:
        reused = self._sock is not None
        outcome = self._post_once(body)
        if reused and outcome.status is None:
            # A collector closes a kept-alive connection that sat idle (uvicorn after 5 s: a rank quiet
            # for a while, a SIGSTOP, a held GIL), and the first POST on it then fails without saying
            # anything of the collector. Once more on a new connection: ingest is idempotent, and a
            # collector that is really down refuses the connection at once.
            outcome = self._post_once(body)
        return outcome

    def _post_once(self, body: bytes) -> Outcome:
        try:
            sock = self._sock or self._connect()
            # Head and body in one send: no Nagle / delayed-ACK stall between two small writes.
            head = self._gzip_head if is_gzip(body) else self._head
            sock.sendall(b"%s%d\r\n\r\n%s" % (head, len(body), body))
            status, retry_after_header, text = self._response()
            retry_after = parse_retry_after(retry_after_header)
        except (OSError, ProtocolError, ValueError) as exc:
            # Connection refused/reset, timeout, a collector that hung up: all transient.
            self.close()
            return Outcome(False, True, None, None, f"{type(exc).__name__}: {exc}")
        if 200 <= status < 300:
            return Outcome(True, False, status, None, "")
        return Outcome(False, status in RETRYABLE, status, retry_after, text.strip()[:500])

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self._host, self._port), self._timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._https:
                import ssl  # only for an https URL: not every Python has it, and it costs ~10 ms to import

                context = ssl.create_default_context()
                context.set_alpn_protocols(["http/1.1"])
                sock = context.wrap_socket(sock, server_hostname=self._host)
        except BaseException:
            sock.close()
            raise
        self._sock, self._rfile = sock, sock.makefile("rb")
        return sock

    def _line(self) -> bytes:
        line: bytes = self._rfile.readline(MAX_LINE + 1)
        if len(line) > MAX_LINE:
            raise ProtocolError("an answer line longer than 64 kB")
        return line

    def _response(self) -> tuple[int, str | None, str]:
        """(status, Retry-After, the start of the body) of the next answer on the connection."""
        while True:
            line = self._line()
            if not line:
                raise RemoteDisconnected("the collector closed the connection without an answer")
            version, _, rest = line.decode("latin-1").partition(" ")
            code = rest.lstrip()[:3]
            if not version.startswith("HTTP/") or not (code.isdigit() and len(code) == 3):
                raise ProtocolError(f"not an HTTP answer: {line[:100]!r}")
            status = int(code)
            headers: dict[str, str] = {}
            for _ in range(MAX_HEADERS + 1):
                line = self._line()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, sep, value = line.decode("latin-1").partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            else:
                raise ProtocolError(f"an answer with more than {MAX_HEADERS} headers")
            if status >= 200:
                break  # a 1xx (100 Continue, 103 Early Hints) is interim: the answer follows
        connection = headers.get("connection", "").lower()
        close = "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection)
        if status in (204, 304):
            body = b""
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            body, complete = self._chunked()
            close = close or not complete
        elif "content-length" in headers:
            length = int(headers["content-length"])
            body = self._rfile.read(min(length, MAX_BODY))
            if len(body) < min(length, MAX_BODY):
                raise ProtocolError("the answer's body was cut short")
            close = close or length > MAX_BODY
        else:
            body, close = self._rfile.read(MAX_BODY), True  # framed by the end of the connection
        if close:
            self.close()
        return status, headers.get("retry-after"), body[:DETAIL_BYTES].decode("utf-8", "replace")

    def _chunked(self) -> tuple[bytes, bool]:
        """A chunked body (at most ``MAX_BODY``) and whether it was read to its end."""
        parts: list[bytes] = []
        size = 0
        while size <= MAX_BODY:
            line = self._line()
            try:
                n = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise ProtocolError(f"a bad chunk size line: {line[:100]!r}") from None
            if n == 0:
                while self._line() not in (b"\r\n", b"\n", b""):
                    pass  # trailer fields
                return b"".join(parts), True
            chunk = self._rfile.read(n + 2)  # and its CRLF
            if len(chunk) < n + 2:
                raise ProtocolError("the answer's body was cut short")
            parts.append(chunk[:n])
            size += n
        return b"".join(parts), False

    def close(self) -> None:
        sock, rfile, self._sock, self._rfile = self._sock, self._rfile, None, None
        if rfile is not None:
            rfile.close()
        if sock is not None:
            sock.close()


class Backoff:
    """Capped exponential backoff with full jitter in [0.5, 1] of the step; ``Retry-After`` wins."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 5.0) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.attempt = 0

    def next_delay(self, retry_after_s: float | None = None) -> float:
        step = min(self.cap_s, self.base_s * (2**self.attempt))
        self.attempt = min(self.attempt + 1, 30)
        delay = step * random.uniform(0.5, 1.0)
        return max(delay, retry_after_s) if retry_after_s is not None else delay

    def reset(self) -> None:
        self.attempt = 0


def set_aside(path: str, encoded: list[bytes], outcome: Outcome) -> None:
    """Append permanently refused records to the rejected file (one JSON line per record)."""
    header = json.dumps({"rejected_status": outcome.status, "detail": outcome.detail}).encode()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "ab") as f:
        f.write(b"#" + header + b"\n" + b"\n".join(encoded) + b"\n")


class HttpExporter:
    """Sends each batch straight to the collector from the agent's worker thread.

    No crash durability (the default pipeline spools first, see ``spool_exporter``); useful where no
    disk is available. ``export`` retries within ``export_timeout_s`` and then gives up (RETRY).
    """

    crash_durable = False
    """Records live in memory until sent: the agent never makes the training thread wait to persist
    them (``emit_durable``)."""

    def __init__(
        self,
        ingest_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 10.0,
        retry_max_backoff_s: float = 5.0,
        export_timeout_s: float = 30.0,
        rejected_path: str | None = None,
    ) -> None:
        self._poster = Poster(ingest_url, token, timeout_s)
        self._older = OlderCollector(ingest_url)
        self._retry_max_backoff_s = retry_max_backoff_s
        self._export_timeout_s = export_timeout_s
        self._rejected_path = rejected_path
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self.dropped: collections.Counter[str] = collections.Counter()
        """'reason:kind' -> records this exporter did not deliver (merged into agent_stats): reasons
        'unserializable', 'rejected' (4xx), 'export_failed' (retries exhausted), 'unsupported' (a kind the
        collector does not know)."""
        self.rejected_batches = 0

    def export(self, batch: list[dict[str, Any]]) -> ExportResult:
        batch = self._older.keep(batch, self.dropped)
        items, shipped = encode_records(batch, step_blocks=self._older.step_blocks)
        count_unserializable(batch, shipped, self.dropped)
        if not shipped:
            return ExportResult.SUCCESS
        body = batch_body([items])
        backoff = Backoff(cap_s=self._retry_max_backoff_s)
        deadline = time.monotonic() + self._export_timeout_s
        older = False
        with self._lock:
            while not self._closed.is_set():
                outcome = self._poster.post(body)
                if outcome.ok:
                    return ExportResult.SUCCESS
                older = not outcome.retry and self._older.learn(outcome)
                if older:
                    break
                if not outcome.retry:
                    self.rejected_batches += 1
                    logger.error(
                        "ddpscope: collector refused a batch (%s): %s", outcome.status, outcome.detail
                    )
                    if self._rejected_path:
                        set_aside(self._rejected_path, [encode_record(r) for r in shipped], outcome)
                    self._count(shipped, "rejected")
                    return ExportResult.FAILURE
                delay = backoff.next_delay(outcome.retry_after_s)
                if time.monotonic() + delay > deadline:
                    break
                logger.debug("ddpscope: ingest failed (%s), retrying in %.2fs", outcome.detail, delay)
                # The sleep is the shutdown event: shutdown() cuts it short (OTel OTLP exporter).
                self._closed.wait(delay)
        if older:  # once per kind: the same batch again, without the kind the collector does not know
            return self.export(batch)
        self._count(batch, "export_failed")
        return ExportResult.RETRY

    def _count(self, batch: list[dict[str, Any]], reason: str) -> None:
        for record in batch:
            self.dropped[f"{reason}:{record.get('kind')}"] += 1

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return True  # export() is synchronous: nothing is buffered here

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._closed.set()
        if self._lock.acquire(timeout=max(0.0, timeout_s)):
            try:
                self._poster.close()
            finally:
                self._lock.release()
