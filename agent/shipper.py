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
it also reads the writer's write-ahead ring (``ring.py``) and ships the records the spool lacked, and
so it does, once, whenever a live writer has been quiet for ``QUIET_WRITER_S`` (stopped by SIGSTOP, a
thread holding the GIL, a starved worker): the last records of a frozen rank would otherwise wait in
its ring until it dies, and the collector would show where it was a few steps before it froze.

Delivery is at-least-once (a batch is acknowledged only after a 2xx); the collector deduplicates by
(job, rank, stream, seq). Drops made here (spool over its cap, damaged frames, refused batches) are
reported in this process's own ``agent_stats`` stream ``<stream>.shipper``.

A wrong ``DDPSCOPE_URL`` is not a refused batch: an answer no ddpscope collector gives on its ingest
path (``wrong_url``: a redirect, 403, 404, 405, 407, 501) keeps the records in the spool and is retried, so
nothing is set aside that a corrected URL could still deliver. The user hears of trouble on the
rank's own stderr, once (``Notices``): when the URL is wrong, when a batch is refused for good, or
when the collector has accepted nothing for ``DDPSCOPE_NOTICE_AFTER_S``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import select
import stat
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from ddpscope.agent import ring, spool
from ddpscope.agent.config import DDPSCOPE_NOTICE_AFTER_S
from ddpscope.agent.records import shipper_stream
from ddpscope.agent.transport import (
    Backoff,
    OlderCollector,
    Outcome,
    Poster,
    batch_body,
    count_unserializable,
    encode_record,
    encode_records,
    set_aside,
)

logger = logging.getLogger("ddpscope.agent.shipper")

MAX_POST_BYTES = 2 * 2**20
"""Uncompressed spool bytes per POST."""
NICE = 10
"""Priority increment: on a host whose cores the training ranks keep busy, shipping waits for them."""
IDLE_MAX_S = 2.0
"""Longest look-free sleep with nothing to send (a rank that died with a forked child holding the
pipe open, so no end-of-file comes, is still noticed this soon)."""
QUIET_WRITER_S = 5.0
"""A live writer that has not woken the shipper for this long is frozen or starved (its heartbeats
alone wake the shipper every few seconds): its ring is read for records the spool lacks. Well under
the collector's 10 s silent threshold, so a rank called silent shows where it really stopped."""
RECENT_SEQS = 4 * ring.SLOTS
"""How many ``seq`` of the latest spool records are kept: the ring holds only the latest
``ring.SLOTS``, so four times that covers every ring record the spool carried."""
NOTICE_AFTER_S = 30.0
"""Default of ``DDPSCOPE_NOTICE_AFTER_S``: how long the collector may accept nothing (unreachable,
busy, failing) before the rank's stderr hears of it; shorter outages are only logged here."""
NOTICE_EVERY_S = 600.0
"""At most one line on the rank's stderr per this many seconds: never one per batch."""
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


@dataclass(slots=True)
class Attempt:
    """One batch as posted: kept while the collector cannot take it (down, busy, a wrong URL), and
    posted again as it is. Reading, decoding, encoding and compressing up to ``MAX_POST_BYTES`` of
    spool again for every retry cost this process ~100 ms a try, ~4 % of a core for as long as the
    collector stayed down (measured on a 2-rank job with no collector listening)."""

    body: bytes
    end: spool.Position
    """The spool position the batch ends at: acknowledged once it is delivered."""
    shipped: list[dict[str, Any]]
    """The spool records it carries (written to the rejected file if it is refused for good)."""
    extra_lines: list[bytes]
    """The records made here that it carries (crash report, ``agent_stats``), encoded."""
    extras: int
    """How many of the shipper's ``extra`` records it took (more may have been made since)."""
    stats: dict[str, Any] | None


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
        self.ingest_url = settings["ingest_url"]
        self.poster = Poster(self.ingest_url, os.environ.get("DDPSCOPE_TOKEN"), settings["http_timeout_s"])
        self.older = OlderCollector(self.ingest_url)
        self.backoff = Backoff(cap_s=settings["retry_max_backoff_s"])
        self.notices = Notices(self, _env_seconds(DDPSCOPE_NOTICE_AFTER_S, NOTICE_AFTER_S))
        self.dropped: Counter[str] = Counter()
        self.stats_seq = 0
        self.stats_sent: dict[str, int] = {}
        self.extra: list[dict[str, Any]] = []
        """Records made here (crash report) still to be acknowledged."""
        self.eof = writer_pid is None
        self.crash_checked = False
        self.ring_checked = False
        self.woken_at = time.monotonic()
        """When the writer last woke this shipper (or it started)."""
        self.quiet_checked = False
        """The ring was read during the writer's current quiet spell (``QUIET_WRITER_S``)."""
        self.from_ring: set[Any] = set()
        """``seq`` of the records shipped from a live writer's ring: its spool carries them later,
        and they are not sent again (the collector would drop them as duplicates anyway)."""
        self.backlog = False
        """The last chunk was full: more is waiting, ship again without pausing."""
        self.recent: deque[Any] = deque(maxlen=RECENT_SEQS)
        """``seq`` of the latest records shipped from the spool (see ``RECENT_SEQS``)."""
        self.attempt: Attempt | None = None
        """The batch the collector did not take yet: the next try posts it again (see ``Attempt``)."""

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
            self.woken_at = time.monotonic()
            self.quiet_checked = False
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
            if dropped:
                self.attempt = None  # its records may be among those dropped (and counted so)
            now = time.monotonic()
            if now < retry_at:
                # Backing off: wake-ups only keep the cap enforced, they do not cut the pause short.
                # Once the rank is gone the spool cannot grow: sleep the whole pause (a lingering
                # shipper per rank of every job run while the collector is down adds up).
                self.wait(retry_at - now if done else min(retry_at - now, self.s["poll_s"]))
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
                logger.error(
                    "ddpscope shipper: nothing delivered for %.0f s after the rank ended (last answer: %s); "
                    "leaving %s in the spool for the next shipper of this spool directory",
                    self.s["linger_s"],
                    self.notices.last,
                    self.prefix,
                )
                self.poster.close()
                self.reader.close()
                return False
            if state == "failed":
                retry_at = time.monotonic() + delay
            elif state == "sent":
                idle_s = interval
                if not done and not self.backlog:
                    self.wait(interval, urgent_only=True)
            elif state == "drained":
                if not done and self.frozen_writer():
                    continue
                # Nothing to send: look less and less often; the writer's wake-up ends the sleep.
                self.wait(idle_s)
                idle_s = min(IDLE_MAX_S, idle_s * 2)

    def frozen_writer(self) -> bool:
        """True when a live writer has been quiet for ``QUIET_WRITER_S`` and its ring held records the
        spool lacks, now queued to ship (read once per quiet spell)."""
        if self.quiet_checked or time.monotonic() - self.woken_at < QUIET_WRITER_S:
            return False
        self.quiet_checked = True
        records = self.unsent_ring_records()
        self.from_ring.update(r.get("seq") for r in records)
        self.extra += records
        return bool(records)

    def ship_once(self, writer_done: bool) -> tuple[str, float]:
        attempt = self.attempt or self.next_attempt(writer_done)
        if attempt is None:
            return "drained", 0.0
        self.attempt = None
        outcome = self.poster.post(attempt.body)
        if outcome.retry or wrong_url(outcome):
            self.attempt = attempt
            delay = self.backoff.next_delay(outcome.retry_after_s)
            logger.info(
                "ddpscope shipper: ingest failed (%s %s); retry in %.2fs",
                outcome.status,
                outcome.detail,
                delay,
            )
            self.notices.failed(outcome)
            return "failed", delay
        if not outcome.ok and self.older.learn(outcome):
            return "failed", 0.0  # the same chunk again at once, without the kind the collector does not know
        if not outcome.ok:
            logger.error(
                "ddpscope shipper: collector refused a batch (%s): %s", outcome.status, outcome.detail
            )
            # One line per record in the rejected file: encoded again, on this rare path only.
            lines = [encode_record(r) for r in attempt.shipped] + attempt.extra_lines
            set_aside(os.path.join(self.dir, f"{self.prefix}.rejected"), lines, outcome)
            for kind, n in Counter(str(r.get("kind")) for r in attempt.shipped).items():
                self.dropped[f"rejected:{kind}"] += n
            self.notices.refused(outcome)
        else:
            self.notices.delivered()
        self.backoff.reset()
        self.reader.ack(attempt.end)
        del self.extra[: attempt.extras]
        if attempt.stats is not None:
            self.stats_sent = dict(attempt.stats["dropped"])
            self.stats_seq += 1
        return "sent", 0.0

    def next_attempt(self, writer_done: bool) -> Attempt | None:
        """The next batch from the acknowledged position; None when there is nothing to send."""
        chunk = self.reader.read(MAX_POST_BYTES, writer_done)
        if chunk.corrupt:
            self.dropped["corrupt:unknown"] += chunk.corrupt
        if chunk.truncated:
            self.dropped["truncated:unknown"] += chunk.truncated
        self.backlog = sum(len(p) for p in chunk.payloads) >= MAX_POST_BYTES // 2
        records = [record for payload in chunk.payloads for record in spool.decode_batch(payload)]
        self.remember(records)
        if self.from_ring:
            records = self.skip_shipped_from_ring(records)
        records = self.older.keep(records, self.dropped)
        # The whole chunk in one encoder call (``encode_records``): per record, this transcoding
        # is most of the shipper's CPU.
        items, shipped = encode_records(records, step_blocks=self.older.step_blocks)
        count_unserializable(records, shipped, self.dropped)
        extras = len(self.extra)
        extra = self.older.keep(list(self.extra), self.dropped)
        stats = self.stats_record() if dict(self.dropped) != self.stats_sent else None
        if stats is not None:
            extra.append(stats)
        if not shipped and not extra:
            self.reader.ack(chunk.end)
            del self.extra[:extras]  # all of a kind the collector does not know
            return None
        extra_lines = [encode_record(r) for r in extra]
        body = batch_body([items, *extra_lines])
        return Attempt(body, chunk.end, shipped, extra_lines, extras, stats)

    def skip_shipped_from_ring(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The spool's records minus those already shipped from the writer's ring while it was quiet;
        once the spool has passed them all, nothing is filtered any more."""
        shipped = self.from_ring
        kept = [r for r in records if r.get("seq") not in shipped]
        if records and max((r.get("seq") or 0) for r in records) >= max(s or 0 for s in shipped):
            shipped.clear()
        return kept

    def remember(self, records: list[dict[str, Any]]) -> None:
        # Only the last ``recent.maxlen`` seqs count; the set is built once, when the ring is read.
        self.recent.extend([r.get("seq") for r in records[-RECENT_SEQS:]])

    def unsent_ring_records(self) -> list[dict[str, Any]]:
        """Records of the writer's write-ahead ring that the spool did not carry (nor an earlier read
        of the ring): those it emitted right before it died (e.g. the collective gloo aborted in) or
        froze, oldest first."""
        own = self.meta.get("stream")
        recent = set(self.recent) | self.from_ring
        records = [
            r
            for r in ring.read_ring(self.dir, self.prefix)
            if r.get("stream") == own and r.get("seq") not in recent
        ]
        if records:
            logger.info("ddpscope shipper: %d records from the write-ahead ring", len(records))
        return sorted(records, key=lambda r: r.get("seq", 0))

    def stats_record(self) -> dict[str, Any]:
        return {
            "kind": "agent_stats",
            "job": self.meta["job"],
            "rank": self.meta["rank"],
            "stream": shipper_stream(self.meta["stream"], os.getpid()),
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
        self.reader.close()
        for _, path in spool.list_segments(self.dir, self.prefix):
            _unlink(path)
        for suffix in (".ack", ".meta", ".crash", ".ring", NOTICE_SUFFIX, PENDING_SUFFIX):
            _unlink(os.path.join(self.dir, self.prefix + suffix))


def wrong_url(outcome: Outcome) -> bool:
    """The answer says the URL does not lead to a ddpscope collector's ingest endpoint.

    A ddpscope collector answers ``POST /api/v1/ingest`` with 2xx, 400, 401, 413, 422, 429 or 5xx,
    never with a redirect, 403, 404, 405, 407 or 501: those come from a proxy, another service, a
    static file server or a wrong path in ``DDPSCOPE_URL``, whatever their body says (an unknown path
    of any FastAPI app, including a ddpscope collector behind a wrong prefix, reads ``{"detail":"Not
    Found"}``). Such a batch is not at fault and a corrected URL would take it, so it stays in the
    spool and is retried instead of being set aside as refused.
    """
    status = outcome.status
    return status is not None and (300 <= status < 400 or status in (403, 404, 405, 407, 501))


class Notices:
    """What the user hears on the rank's own stderr about delivery trouble: one line per episode
    (from the first failure to the next acknowledged batch), at most one per ``NOTICE_EVERY_S``.

    The shipper's stderr is its log file (a launcher waiting for the end of the rank's output must
    not wait for the shipper too), so a line goes through ``tell_writer``; when that is not possible
    it waits in ``<prefix>.notice`` for the rank's exit hook (``lifecycle``) to print it.
    """

    def __init__(self, shipper: Shipper, after_s: float) -> None:
        self.shipper = shipper
        self.after_s = after_s
        self.failing_since: float | None = None
        self.told = False
        """A line was printed (or tried) during the current episode."""
        self.told_at = -NOTICE_EVERY_S
        self.last = "none"
        """The last failed answer, for the log."""

    def delivered(self) -> None:
        if self.failing_since is not None:
            _drop_notice(self.shipper.dir, self.shipper.prefix, PENDING_SUFFIX)
        self.failing_since = None
        self.told = False

    def failed(self, outcome: Outcome) -> None:
        now = time.monotonic()
        self.last = describe(outcome)
        sh = self.shipper
        if self.failing_since is None:
            self.failing_since = now
            # For the rank's exit, should it come before the notice below is due (a job shorter than
            # DDPSCOPE_NOTICE_AFTER_S): it prints this unless a delivery or a told notice removed it.
            _write_notice(
                sh.dir,
                sh.prefix,
                self._line(
                    f"the collector at {sh.ingest_url} has accepted nothing since this rank's records "
                    "stopped getting through "
                    f"(last: {self.last}). They wait in {sh.dir}; a shipper retries for "
                    f"{sh.s['linger_s']:.0f} s after this rank's exit (log: "
                    f"{os.path.join(sh.dir, sh.prefix + '.shipper.log')}); {_advice(outcome)}."
                ),
                PENDING_SUFFIX,
            )
        if wrong_url(outcome):
            self.tell(
                f"{sh.ingest_url} answered {self.last}: not a ddpscope collector (a proxy, another "
                f"service, a wrong port or path?). Nothing is dropped: records wait in {sh.dir} and "
                "are retried; check DDPSCOPE_URL (the address `ddpscope serve` prints)."
            )
        elif now - self.failing_since >= self.after_s:
            self.tell(
                f"the collector at {sh.ingest_url} has accepted nothing for {now - self.failing_since:.0f} s "
                f"(last: {self.last}). Records wait in {sh.dir} and are sent when it answers (retried "
                f"while this rank runs and {sh.s['linger_s']:.0f} s after); {_advice(outcome)}."
            )

    def refused(self, outcome: Outcome) -> None:
        sh = self.shipper
        self.tell(
            f"the collector at {sh.ingest_url} refused a batch for good ({describe(outcome)}); its "
            f"records are set aside in {os.path.join(sh.dir, sh.prefix + '.rejected')}, not retried. "
            "Check DDPSCOPE_TOKEN and DDPSCOPE_URL, and that agent and collector are one ddpscope "
            f"version; further refusals are logged in {os.path.join(sh.dir, sh.prefix + '.shipper.log')}."
        )

    def _line(self, text: str) -> str:
        meta = self.shipper.meta
        return f"ddpscope: rank {meta.get('rank')} (job {meta.get('job')}): {text}"

    def tell(self, text: str) -> None:
        now = time.monotonic()
        if self.told or now - self.told_at < NOTICE_EVERY_S:
            return
        self.told, self.told_at = True, now
        sh = self.shipper
        line = self._line(text)
        logger.warning("%s", line)
        _drop_notice(sh.dir, sh.prefix, PENDING_SUFFIX)  # this line says more
        # After its rank is gone (or for an adopted orphan) nobody is left to read it: the log has it.
        if sh.writer_pid is not None and not sh.writer_done() and not tell_writer(sh.writer_pid, line):
            _write_notice(sh.dir, sh.prefix, line)


def _advice(outcome: Outcome) -> str:
    """What to do about a collector that keeps failing: one that answers with a server error is up but
    cannot store (its database is full or locked), not missing."""
    if outcome.status is not None and outcome.status >= 500:
        return "the collector is up but fails to store them: see its log and its /healthz"
    return "start a collector (ddpscope serve) or check DDPSCOPE_URL"


def describe(outcome: Outcome) -> str:
    """``HTTP 404 (Not Found nginx)`` or the network error, short and printable."""
    if outcome.status is None:
        return outcome.detail[:200]
    body = outcome.detail
    with contextlib.suppress(ValueError, AttributeError):
        body = str(json.loads(body).get("detail", body))  # a ddpscope (FastAPI) error
    body = re.sub(r"<[^>]*>", " ", body)  # a proxy's HTML error page
    body = " ".join(re.sub(r"[\x00-\x1f\x7f-\x9f]", " ", body).split())[:100]
    return f"HTTP {outcome.status}" + (f" ({body})" if body else "")


PIPE_LINE_MAX = 4000
"""A write of at most PIPE_BUF (4096 on Linux) bytes to a pipe is atomic: the line cannot be
interleaved with the rank's own output."""
NOTICE_SUFFIX = ".notice"
PENDING_SUFFIX = ".pending-notice"
"""A failing delivery's line for the rank to print at its exit if nothing was told or delivered since."""


def tell_writer(pid: int, line: str) -> bool:
    """Write one line to process ``pid``'s stderr (fd 2) without keeping it open; False if unsafe.

    Opened anew through ``/proc/<pid>/fd/2`` (Linux) and closed at once, so a launcher that reads
    the rank's output to its end is never kept waiting. Only where a second writer cannot damage
    the rank's output: a pipe or a terminal (non-blocking: a full pipe loses the line, not the
    shipper's time), or a regular file the rank itself appends to. A file opened without
    ``O_APPEND`` (``> log``) would have the rank's next write land over the line: that case, and
    any other, returns False. Called only while ``pid`` is our parent (not yet reparented), so the
    pid cannot have been reused.
    """
    path = f"/proc/{pid}/fd/2"
    data = line.encode("utf-8", "replace")[:PIPE_LINE_MAX] + b"\n"
    flags = os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            if not _fd_appends(pid, 2):
                return False
            flags |= os.O_APPEND
        elif not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
            return False  # a socket cannot be reopened; anything else is no stream for a person
        fd = os.open(path, flags)
    except OSError:
        return False
    try:
        return os.write(fd, data) == len(data)
    except OSError:
        return False
    finally:
        os.close(fd)


def _fd_appends(pid: int, fd: int) -> bool:
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
            for row in f:
                if row.startswith("flags:"):
                    return bool(int(row.split()[1], 8) & os.O_APPEND)
    except (OSError, ValueError, IndexError):
        pass  # no /proc, or a format we do not know: assume the worst
    return False


def _write_notice(directory: str, prefix: str, line: str, suffix: str = NOTICE_SUFFIX) -> None:
    path = os.path.join(directory, prefix + suffix)
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w") as f:
            f.write(line + "\n")
        os.replace(path + ".tmp", path)  # the rank never reads half a line


def _drop_notice(directory: str, prefix: str, suffix: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(directory, prefix + suffix))


def take_notice(directory: str, prefix: str) -> str:
    """The line a shipper could not print on its rank's stderr, else the line of a delivery still
    failing (empty if neither), removed once read: the rank prints it itself at exit."""
    for suffix in (NOTICE_SUFFIX, PENDING_SUFFIX):
        path = os.path.join(directory, prefix + suffix)
        try:
            with open(path, errors="replace") as f:
                text = f.read()
            os.unlink(path)
        except OSError:
            continue
        if text.strip():
            _drop_notice(directory, prefix, PENDING_SUFFIX)
            return text.strip()
    return ""


def _env_seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name) or default)
    except ValueError:
        return default
    return value if value >= 0 else default


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
