"""The default exporter: append each batch to the disk spool and let the shipper process deliver it.

One delivery path for everything: the training process only ever writes local files (fast, no
network in the process), and the shipper (``shipper.py``), started here in its own session, POSTs
them, so what was spooled before a SIGKILL or an abort still arrives. ``force_flush`` waits until
the shipper has acknowledged everything written so far (the collector committed it).

Wake-ups are rationed, because on a busy host every one costs the training process CPU: the
shipper is woken at once (``WAKE_URGENT``) for hang, hang_resolved and rank_error records and by
``force_flush``, otherwise at most once per ``SHIP_INTERVAL_S``; in between it finds new frames by
itself on its own ``SHIP_INTERVAL_S`` schedule. ``write_ahead`` puts a record in the memory-mapped
ring (``ring.py``) for the case this process dies before the spool write.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from ddpscope.agent import spool
from ddpscope.agent.exporters import ExportResult
from ddpscope.agent.log import get_logger
from ddpscope.agent.records import URGENT_KINDS
from ddpscope.agent.ring import WriteAheadRing
from ddpscope.agent.spool import WAKE_DATA, WAKE_URGENT

logger = get_logger(__name__)

SHIP_INTERVAL_S = 1.0
"""Non-urgent records reach the collector within about this long; the shipper wakes no more often
for them (a POST per 20 ms round cost the training ~5 % of a step on 2 cores; at 0.5 s the shipper
still took ~0.9 % of a 15 ms step, at 1 s ~0.65 %). Well inside the collector's 10 s silence rule;
urgent records (hang reports, errors) and flushes are shipped at once."""
HEALTH_CHECK_S = 1.0
"""How often ``export`` checks that the shipper is still alive (a ``waitpid`` each time)."""


class SpoolExporter:
    def __init__(
        self,
        *,
        spool_dir: str,
        prefix: str,
        meta: dict[str, Any],
        ingest_url: str,
        token: str | None = None,
        spool_max_bytes: int = 256 * 2**20,
        http_timeout_s: float = 10.0,
        retry_max_backoff_s: float = 5.0,
        linger_s: float = 600.0,
        crash_file: bool = True,
        ship_interval_s: float = SHIP_INTERVAL_S,
    ) -> None:
        self.spool_dir, self.prefix = spool_dir, prefix
        segment_bytes = max(16 * 1024, min(4 * 2**20, spool_max_bytes // 8))
        # Twice the cap: the shipper enforces the cap itself; this backstop only stops a runaway disk.
        self._writer = spool.SpoolWriter(
            spool_dir, prefix, segment_bytes=segment_bytes, hard_cap_bytes=2 * spool_max_bytes
        )
        with open(os.path.join(spool_dir, f"{prefix}.meta"), "w") as f:
            json.dump({**meta, "pid": os.getpid()}, f)
        self._settings = {
            "spool_dir": spool_dir,
            "prefix": prefix,
            "ingest_url": ingest_url,
            "spool_max_bytes": spool_max_bytes,
            "http_timeout_s": http_timeout_s,
            "retry_max_backoff_s": retry_max_backoff_s,
            "linger_s": linger_s,
            "poll_s": 0.25,
            "ship_interval_s": ship_interval_s,
            "writer_pid": os.getpid(),
        }
        self._ship_interval_s = ship_interval_s
        self._token = token
        self._proc: subprocess.Popen[bytes] | None = None
        self._wake_fd = -1
        self._last_wake = 0.0
        self._checked_at = 0.0
        self._started_at = 0.0
        self._closed = False
        self._write_errors: set[int | None] = set()
        """errnos of the spool write failures already said (``export``)."""
        self.dropped: collections.Counter[str] = collections.Counter()
        """Records this exporter did not hand to the shipper: 'spool_full:kind', 'unserializable:kind'."""
        self._crash: IO[str] | None = None
        if crash_file:
            self._enable_crash_file()
        self._ring: WriteAheadRing | None = None
        try:
            self._ring = WriteAheadRing(spool_dir, prefix)
        except (OSError, ValueError):
            logger.warning(
                "ddpscope: no write-ahead ring in %s; durable records take the spool path", spool_dir
            )
        self.write_ahead: Callable[[dict[str, Any]], bool] = (
            self._ring.put if self._ring is not None else _no_ring
        )
        """Make one stamped record crash-durable now, without a system call (see ``ring.py``); the
        caller still exports it as usual. False when it does not fit or the ring is closed: then spool
        it synchronously. The ring's own ``put``: no wrapper level on the training thread's hot path."""
        self.write_ahead_templated: Callable[..., bool] | None = (
            self._ring.put_templated if self._ring is not None else None
        )
        """The same for a record made from a template (``WriteAheadRing.put_templated``)."""
        self._start_shipper()

    def _enable_crash_file(self) -> None:
        # faulthandler writes every thread's stack here on SIGSEGV/SIGABRT/...; the shipper turns it
        # into a fatal rank_error once this process is gone.
        self._crash = open(os.path.join(self.spool_dir, f"{self.prefix}.crash"), "w")  # noqa: SIM115
        faulthandler.enable(file=self._crash, all_threads=True)

    def _start_shipper(self) -> None:
        self._started_at = time.monotonic()
        env = dict(os.environ)
        env.pop("DDPSCOPE_TOKEN", None)
        if self._token:
            env["DDPSCOPE_TOKEN"] = self._token  # env, not argv: argv is world-readable in ps
        log = open(os.path.join(self.spool_dir, f"{self.prefix}.shipper.log"), "ab")  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "ddpscope.agent.shipper", json.dumps(self._settings)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                # Not the rank's stderr: a launcher reading it to EOF would wait for the shipper.
                stderr=log,
                env=env,
                close_fds=True,
                start_new_session=True,
            )
        finally:
            log.close()
        assert self._proc.stdin is not None
        self._wake_fd = self._proc.stdin.fileno()
        os.set_blocking(self._wake_fd, False)

    @property
    def shipper_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def drop_write_ahead(self) -> None:
        """Remove the ring: the agent drained everything into the spool (a clean shutdown)."""
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ring.path)

    def export(self, batch: list[dict[str, Any]]) -> ExportResult:
        if self._closed:
            return ExportResult.FAILURE
        try:
            payload = spool.encode_batch(batch)
        except ValueError:
            # Something marshal cannot write (a tensor, a numpy scalar): find and count it.
            good = []
            for record in batch:
                try:
                    spool.encode_batch([record])
                    good.append(record)
                except ValueError:
                    self.dropped[f"unserializable:{record.get('kind')}"] += 1
            batch, payload = good, spool.encode_batch(good)
        # agent_stats (sent alone) passes the cap: otherwise the drops of a full spool go unreported.
        stats_only = all(record.get("kind") == "agent_stats" for record in batch)
        try:
            written = not batch or self._writer.append(payload, over_cap=stats_only)
        except OSError as e:
            # The disk is full or gone: these records are lost, counted, and said once per kind of error.
            if e.errno not in self._write_errors:
                self._write_errors.add(e.errno)
                logger.warning(
                    "ddpscope: cannot write the spool in %s (%s): records are dropped (and counted) until "
                    "it can; free space there or point DDPSCOPE_SPOOL_DIR at a disk with room",
                    self.spool_dir,
                    e,
                )
            for record in batch:
                self.dropped[f"spool_error:{record.get('kind')}"] += 1
            return ExportResult.FAILURE
        if not written:
            for record in batch:
                self.dropped[f"spool_full:{record.get('kind')}"] += 1
            return ExportResult.FAILURE
        if any(record.get("kind") in URGENT_KINDS for record in batch):
            self._wake(WAKE_URGENT)
        elif time.monotonic() - self._last_wake >= self._ship_interval_s:
            self._wake(WAKE_DATA)
        return ExportResult.SUCCESS

    def _wake(self, signal: bytes = WAKE_URGENT) -> None:
        now = time.monotonic()
        self._last_wake = now
        if now - self._checked_at >= HEALTH_CHECK_S or signal is WAKE_URGENT:
            self._checked_at = now
            self._restart_if_dead(now)
        with contextlib.suppress(BlockingIOError, BrokenPipeError, OSError):
            os.write(self._wake_fd, signal)  # a full pipe already means "wake up"

    def _restart_if_dead(self, now: float) -> None:
        if self._proc is not None and self._proc.poll() is not None and now - self._started_at > 5:
            # The shipper died (killed, OOM): a new one resumes from the acknowledged position.
            logger.warning("ddpscope: shipper exited with %s; restarting it", self._proc.returncode)
            self._close_pipe()
            self._start_shipper()

    def spool_bytes(self) -> int:
        return self._writer.disk_bytes + self._writer.size

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """True once the collector acknowledged everything written so far."""
        deadline = time.monotonic() + timeout_s
        target = self._writer.position
        self._wake()
        while spool.read_ack(self.spool_dir, self.prefix) < target:
            if time.monotonic() > deadline or self._proc is None:
                return False
            time.sleep(0.005)
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Close the spool; the shipper sees end-of-file, delivers the rest and exits on its own."""
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        if self._ring is not None:
            # Kept on disk (unless dropped after a complete drain): the shipper reads it at end
            # of file, sends what the spool lacks and removes it.
            self._ring.close()
            self._ring = None
        self._close_pipe()
        if self._crash is not None:
            # A clean shutdown is no crash: stop writing fatal-signal stacks to a file we leave behind.
            with contextlib.suppress(ValueError, RuntimeError):
                faulthandler.disable()
            self._crash.close()
            self._crash = None

    def _close_pipe(self) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        self._wake_fd = -1


def _no_ring(record: dict[str, Any]) -> bool:
    return False
