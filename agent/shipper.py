"""The shipper: a small stdlib-only process per agent that tails the spool and POSTs it; it outlives its rank.

Started by ``spool_exporter`` as ``python -m ddpscope.agent.shipper '<json settings>'`` in its own
session (so a process-group kill of the rank, Ctrl-C or torchrun's cleanup does not take it down),
with a pipe on stdin: every byte is a wake-up ("new data"), end-of-file or a change of parent pid
means the writer is gone. Then it drains what is left, turns a non-empty faulthandler crash file
into a fatal ``rank_error`` record, ships it, removes the spool files and exits. If the collector
stays unreachable for ``linger_s`` after the rank is gone it exits anyway and leaves the spool (with
its acknowledged position) on disk; the next shipper of the same job adopts such orphans.

Cost on the training host: the shipper runs at a lower priority (``NICE``), ships at most once per
``ship_interval_s`` while records flow (at once for an urgent wake-up: hang reports, flushes) and
backs off to one look every ``IDLE_MAX_S`` when there is nothing to send. Once the writer is gone
it also reads the writer's write-ahead ring (``ring.py``) and ships the records the spool lacked.

Delivery is at-least-once (a batch is acknowledged only after a 2xx); the collector deduplicates by
(job, rank, stream, seq). Drops made here (spool over its cap, damaged frames, refused batches) are
reported in this process's own ``agent_stats`` stream ``<stream>.shipper``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import select
import sys
import time
from collections import Counter, deque
from typing import Any

from ddpscope.agent import ring, spool
from ddpscope.agent.transport import Backoff, Poster, batch_body, encode_record, set_aside

logger = logging.getLogger("ddpscope.agent.shipper")

MAX_POST_BYTES = 2 * 2**20
"""Uncompressed spool bytes per POST."""
NICE = 10
"""Priority increment: on a host whose cores the training ranks keep busy, shipping waits for them."""
IDLE_MAX_S = 2.0
"""Longest look-free sleep with nothing to send (a rank that died with a forked child holding the
pipe open, so no end-of-file comes, is still noticed this soon)."""
FATAL_NAMES = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Floating point exception": "SIGFPE",
    "Bus error": "SIGBUS",
    "Illegal instruction": "SIGILL",
}


def crash_record(text: str, meta: dict[str, Any], mtime_ns: int) -> dict[str, Any]:
    """A fatal ``rank_error`` from faulthandler's output ("Fatal Python error: Aborted" ...)."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "fatal signal")
    error_type = next((sig for name, sig in FATAL_NAMES.items() if name in first), "FatalSignal")
    return {
        "kind": "rank_error",
        "job": meta["job"],
        "rank": meta["rank"],
        "stream": f"{meta['stream']}.crash",
        "seq": 0,
        "time_ns": mtime_ns,
        "step": None,
        "phase": "unknown",
        "error_type": error_type,
        "message": first,
        "stack": text,
        "fatal": True,
    }


class Shipper:
    """Ships one stream's spool (``prefix``) until its writer is gone and everything is acknowledged."""

    def __init__(self, settings: dict[str, Any], prefix: str, *, writer_pid: int | None) -> None:
        self.s = settings
        self.dir = settings["spool_dir"]
        self.prefix = prefix
        self.writer_pid = writer_pid
        """Parent pid while the writer lives; None for an adopted orphan (writer already gone)."""
        self.meta = _read_json(os.path.join(self.dir, f"{prefix}.meta"))
        self.reader = spool.SpoolReader(self.dir, prefix)
        self.poster = Poster(
            settings["ingest_url"], os.environ.get("DDPSCOPE_TOKEN"), settings["http_timeout_s"]
        )
        self.backoff = Backoff(cap_s=settings["retry_max_backoff_s"])
        self.dropped: Counter[str] = Counter()
        self.stats_seq = 0
        self.stats_sent: dict[str, int] = {}
        self.extra: list[dict[str, Any]] = []
        """Records made here (crash report) still to be acknowledged."""
        self.eof = writer_pid is None
        self.crash_checked = False
        self.ring_checked = False
        self.backlog = False
        """The last chunk was full: more is waiting, ship again without pausing."""
        window = 4 * ring.SLOTS
        self.recent: deque[int] = deque(maxlen=window)
        self.recent_set: set[int] = set()
        """``seq`` of the latest records shipped from the spool: the ring holds only the latest
        ``ring.SLOTS``, so a window of four times that covers every ring record the spool carried."""

    def writer_done(self) -> bool:
        if not self.eof and self.writer_pid is not None and os.getppid() != self.writer_pid:
            self.eof = True  # reparented: the rank died (SIGKILL, abort) without closing the pipe
        return self.eof

    def wait(self, timeout_s: float, urgent_only: bool = False) -> None:
        """Sleep until the timeout, end-of-file on the pipe, or a wake-up from the writer (only an
        urgent one with ``urgent_only``: the pause between two POSTs lets records pile up)."""
        if self.eof or self.writer_pid is None:
            time.sleep(timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            ready, _, _ = select.select([0], [], [], remaining)
            if not ready:
                return
            try:
                data = os.read(0, 65536)
            except OSError:
                data = b""
            if not data:
                self.eof = True
                return
            if not urgent_only or spool.WAKE_URGENT in data:
                return

    def run(self) -> bool:
        """True when everything was delivered and the files removed; False after the linger window."""
        gone_at: float | None = None
        retry_at = 0.0
        interval = float(self.s.get("ship_interval_s", self.s["poll_s"]))
        idle_s = interval
        while True:
            done = self.writer_done()
            if done and gone_at is None:
                gone_at = time.monotonic()
                self.check_crash_file()
            dropped = self.reader.drop_over_cap(self.s["spool_max_bytes"], done)
            for kind, n in dropped.items():
                self.dropped[f"spool_full:{kind}"] += n
            now = time.monotonic()
            if now < retry_at:
                # Backing off: wake-ups only keep the cap enforced, they do not cut the pause short.
                self.wait(min(retry_at - now, self.s["poll_s"]))
                continue
            state, delay = self.ship_once(done)
            if state == "drained" and done:
                if not self.ring_checked:
                    self.ring_checked = True
                    self.extra += self.unsent_ring_records()
                    if self.extra:
                        continue
                self.cleanup()
                return True
            if gone_at is not None and time.monotonic() - gone_at > self.s["linger_s"]:
                logger.error("ddpscope shipper: collector unreachable; leaving %s in the spool", self.prefix)
                return False
            if state == "failed":
                retry_at = time.monotonic() + delay
            elif state == "sent":
                idle_s = interval
                if not done and not self.backlog:
                    self.wait(interval, urgent_only=True)
            elif state == "drained":
                # Nothing to send: look less and less often; the writer's wake-up ends the sleep.
                self.wait(idle_s)
                idle_s = min(IDLE_MAX_S, idle_s * 2)

    def ship_once(self, writer_done: bool) -> tuple[str, float]:
        chunk = self.reader.read(MAX_POST_BYTES, writer_done)
        if chunk.corrupt:
            self.dropped["corrupt:unknown"] += chunk.corrupt
        if chunk.truncated:
            self.dropped["truncated:unknown"] += chunk.truncated
        encoded: list[bytes] = []
        kinds: Counter[str] = Counter()
        self.backlog = sum(len(p) for p in chunk.payloads) >= MAX_POST_BYTES // 2
        for payload in chunk.payloads:
            for record in spool.decode_batch(payload):
                self.remember(record.get("seq"))
                try:
                    encoded.append(encode_record(record))
                    kinds[str(record.get("kind"))] += 1
                except (TypeError, ValueError):  # NaN, inf: strict JSON parsers refuse them
                    self.dropped[f"unserializable:{record.get('kind')}"] += 1
        extra = list(self.extra)
        stats = self.stats_record() if dict(self.dropped) != self.stats_sent else None
        if stats is not None:
            extra.append(stats)
        if not encoded and not extra:
            self.reader.ack(chunk.end)
            return "drained", 0.0
        encoded += [encode_record(r) for r in extra]
        outcome = self.poster.post(batch_body(encoded))
        if outcome.retry:
            delay = self.backoff.next_delay(outcome.retry_after_s)
            logger.info(
                "ddpscope shipper: ingest failed (%s %s); retry in %.2fs",
                outcome.status,
                outcome.detail,
                delay,
            )
            return "failed", delay
        if not outcome.ok:
            logger.error(
                "ddpscope shipper: collector refused a batch (%s): %s", outcome.status, outcome.detail
            )
            set_aside(os.path.join(self.dir, f"{self.prefix}.rejected"), encoded, outcome)
            for kind, n in kinds.items():
                self.dropped[f"rejected:{kind}"] += n
        self.backoff.reset()
        self.reader.ack(chunk.end)
        self.extra = []
        if stats is not None:
            self.stats_sent = dict(stats["dropped"])
            self.stats_seq += 1
        return "sent", 0.0

    def remember(self, seq: Any) -> None:
        if len(self.recent) == self.recent.maxlen:
            self.recent_set.discard(self.recent[0])
        self.recent.append(seq)
        self.recent_set.add(seq)

    def unsent_ring_records(self) -> list[dict[str, Any]]:
        """Records of the dead writer's write-ahead ring that the spool did not carry: those it
        emitted right before it died (e.g. the collective gloo aborted in), oldest first."""
        own = self.meta.get("stream")
        records = [
            r
            for r in ring.read_ring(self.dir, self.prefix)
            if r.get("stream") == own and r.get("seq") not in self.recent_set
        ]
        if records:
            logger.info("ddpscope shipper: %d records from the write-ahead ring", len(records))
        return sorted(records, key=lambda r: r.get("seq", 0))

    def stats_record(self) -> dict[str, Any]:
        return {
            "kind": "agent_stats",
            "job": self.meta["job"],
            "rank": self.meta["rank"],
            "stream": f"{self.meta['stream']}.shipper-{os.getpid()}",
            "seq": self.stats_seq,
            "time_ns": time.time_ns(),
            "emitted": 0,
            "dropped": dict(self.dropped),
            "spool_bytes": self.reader.pending_bytes(),
        }

    def check_crash_file(self) -> None:
        path = os.path.join(self.dir, f"{self.prefix}.crash")
        try:
            with open(path, errors="replace") as f:
                text = f.read()
            mtime_ns = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            return
        if text.strip():
            record = crash_record(text, self.meta, mtime_ns)
            logger.error("ddpscope shipper: rank %s died: %s", self.meta["rank"], record["message"])
            self.extra.append(record)

    def cleanup(self) -> None:
        self.poster.close()
        for _, path in spool.list_segments(self.dir, self.prefix):
            _unlink(path)
        for suffix in (".ack", ".meta", ".crash", ".ring"):
            _unlink(os.path.join(self.dir, self.prefix + suffix))


def lock(directory: str, prefix: str) -> int | None:
    """Hold ``<prefix>.lock`` (flock) for this process's life; None if another shipper holds it."""
    fd = os.open(os.path.join(directory, f"{prefix}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def orphans(directory: str, own: str) -> list[str]:
    """Prefixes in the spool whose writer process is gone and which no shipper holds."""
    found = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".meta") or name == f"{own}.meta":
            continue
        prefix = name[: -len(".meta")]
        meta = _read_json(os.path.join(directory, name))
        if not meta or _alive(int(meta.get("pid", 0))):
            continue
        found.append(prefix)
    return found


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (FileNotFoundError, ValueError):
        return {}


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def main(argv: list[str]) -> int:
    settings = json.loads(argv[0])
    with contextlib.suppress(OSError):
        os.nice(NICE)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    directory, own = settings["spool_dir"], settings["prefix"]
    fd = lock(directory, own)
    if fd is None:
        return 0  # another shipper already serves this stream
    ok = Shipper(settings, own, writer_pid=settings["writer_pid"]).run()
    _unlink(os.path.join(directory, f"{own}.lock"))
    os.close(fd)
    if not ok:
        return 1
    log = os.path.join(directory, f"{own}.shipper.log")
    with contextlib.suppress(OSError):
        if os.path.getsize(log) == 0:
            os.unlink(log)  # nothing went wrong: leave no trace
    # Our own stream is delivered: deliver what earlier, dead shippers of this job left behind.
    for prefix in orphans(directory, own):
        ofd = lock(directory, prefix)
        if ofd is None:
            continue
        if Shipper(settings, prefix, writer_pid=None).run():
            _unlink(os.path.join(directory, f"{prefix}.lock"))
        os.close(ofd)
    with contextlib.suppress(OSError):
        os.rmdir(directory)  # only succeeds when nothing (no other stream, no rejected file) is left
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
