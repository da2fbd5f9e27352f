"""The write-ahead ring: a memory-mapped file holding the last few hundred records emitted, so that
they survive an abort or a SIGKILL that comes before the worker's next spool write.

Why a mapped file and not a spool write: a ``MAP_SHARED`` page written by this process is in the
kernel's page cache the moment the copy ends, so it survives SIGKILL, SIGABRT (gloo's size-mismatch
abort ~1 ms after a collective starts) or a segfault exactly as a ``write`` would, but costs a
``memcpy`` (~0.3 us) instead of a system call, a lock and a wake-up of the shipper (~15 us plus the
shipper's CPU, measured in bench/watchdog.py). The same record also goes the ordinary way (queue,
spool, shipper) with the same idempotency key; the ring is read only when its writer died, and the
shipper then sends just the records it has not already seen in the spool.

Layout: ``slots`` fixed-size slots; a record goes to slot ``n % slots`` as one spool frame
(``spool.frame``: magic, length, crc32, marshal payload) at the slot's start. Only that first frame
is read back, so the tail of an older, longer record left in the slot is never mistaken for data; a
torn copy (the process died mid-``memcpy``) fails its crc and is skipped. A record larger than a
slot is refused: it waits in memory for the worker's round (``emit_durable`` writes it at once).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import zlib
from typing import Any

from ddpscope.agent import spool

logger = logging.getLogger(__name__)

SLOT_BYTES = 4096
"""A collective record with its envelope marshals to ~300 bytes, a 50-bucket step record to ~1.8 KB;
a bigger record is not copied (a durable one then takes the synchronous spool path)."""
SLOTS = 512
"""2 MiB per rank: the last 512 records, far more than a worker round (0.1 s) emits in training."""


def ring_path(directory: str, prefix: str) -> str:
    return os.path.join(directory, f"{prefix}.ring")


class WriteAheadRing:
    """Writer side (the training process). ``put`` is safe from any thread: slot numbers come from
    an ``itertools.count`` (atomic under the GIL) and each copy writes only its own slot."""

    def __init__(
        self, directory: str, prefix: str, *, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES
    ) -> None:
        self.path = ring_path(directory, prefix)
        self.slots, self.slot_bytes = slots, slot_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, slots * slot_bytes)
            self._map: mmap.mmap | None = mmap.mmap(fd, slots * slot_bytes, mmap.MAP_SHARED, mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file alive
        self._next = itertools.count()

    def put(self, record: dict[str, Any]) -> bool:
        """Copy one stamped record into the next slot; False if it does not fit or cannot be encoded."""
        m = self._map
        if m is None:
            return False
        try:
            data = spool.frame(spool.encode_batch([record]))
        except ValueError:
            return False
        size = self.slot_bytes
        if len(data) > size:
            return False
        at = (next(self._next) % self.slots) * size
        try:
            m[at : at + len(data)] = data
        except (ValueError, TypeError):  # closed by a concurrent shutdown
            return False
        return True

    def close(self) -> None:
        m, self._map = self._map, None
        if m is not None:
            m.close()


def read_ring(directory: str, prefix: str, slot_bytes: int = SLOT_BYTES) -> list[dict[str, Any]]:
    """Every intact record in the ring (any order; empty if there is no ring). Reader side: the
    shipper, once the writer is gone."""
    try:
        with open(ring_path(directory, prefix), "rb") as f:
            buf = f.read()
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    header = spool.HEADER
    for at in range(0, len(buf) - slot_bytes + 1, slot_bytes):
        magic, length, crc = header.unpack_from(buf, at)
        body = at + header.size
        if magic != spool.MAGIC or body + length > at + slot_bytes:
            continue  # never written, or damaged
        payload = buf[body : body + length]
        if zlib.crc32(payload) == crc:
            out.extend(spool.decode_batch(payload))
    return out
