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

A record made from a template (``template.py``) takes a second slot layout, so that the caller packs
a few integers instead of marshalling a dict: ``TEMPLATE_MAGIC | template length | crc32(template) |
n | 3 pad bytes | seq, time_ns, n values, check (int64 LE each) | template``, the template being the
marshalled ``(fixed fields with the envelope, variable names)``, encoded once per agent
(``encode_template``). The template and prefix go in first (and only when the slot holds another
record), the integers last; torn integers fail their ``check`` (a hash of them), a torn template its
crc, and either way the slot is skipped.
"""

from __future__ import annotations

import itertools
import logging
import marshal
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ddpscope.agent import spool

logger = logging.getLogger(__name__)

SLOT_BYTES = 4096
"""A collective record with its envelope marshals to ~300 bytes, a 50-bucket step record to ~1.8 KB;
a bigger record is not copied (a durable one then takes the synchronous spool path)."""
SLOTS = 512
"""2 MiB per rank: the last 512 records, far more durable records than a worker round (0.25 s) emits in
training (``RING_DRAIN_AT`` in ``_core`` wakes the worker early when it is not)."""


TEMPLATE_MAGIC = b"\xffDT\x01"
_TEMPLATE_PREFIX = struct.Struct("<4sIIBxxx")
"""magic, template length, crc32 of the template, number of variable values (16 bytes)."""


def ring_path(directory: str, prefix: str) -> str:
    return os.path.join(directory, f"{prefix}.ring")


class TemplateFrame(NamedTuple):
    """A template as one agent writes it into ring slots (``encode_template``)."""

    prefix: bytes
    """``_TEMPLATE_PREFIX``, packed."""
    ints: struct.Struct
    """seq, time_ns, the values and the check, after the prefix."""
    payload: bytes
    """The marshalled template, after the integers."""


def encode_template(
    fixed: dict[str, Any], variables: Sequence[str], slot_bytes: int = SLOT_BYTES
) -> TemplateFrame | None:
    """``fixed`` holds every field but the variables, seq and time_ns (the envelope's job, rank and
    stream included). None when it does not marshal or does not fit in a slot."""
    try:
        payload = marshal.dumps((fixed, tuple(variables)), 4)
    except ValueError:
        return None
    ints = struct.Struct("<" + "q" * (len(variables) + 3))
    if _TEMPLATE_PREFIX.size + ints.size + len(payload) > slot_bytes:
        return None
    prefix = _TEMPLATE_PREFIX.pack(TEMPLATE_MAGIC, len(payload), zlib.crc32(payload), len(variables))
    return TemplateFrame(prefix, ints, payload)


def _check(seq: int, time_ns: int, values: tuple[int, ...]) -> int:
    # hash() of a tuple of ints is the same in every process (no hash randomisation for ints), and
    # xor keeps the result in int64.
    return hash(values) ^ seq ^ time_ns


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
        self._held: list[TemplateFrame | None] = [None] * slots
        """The template each slot holds (``put_templated``), if any."""
        self.put_templated = self._templated_writer()

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
        slot = next(self._next) % self.slots
        self._held[slot] = None
        at = slot * size
        try:
            m[at : at + len(data)] = data
        except (ValueError, TypeError):  # closed by a concurrent shutdown
            return False
        return True

    def _templated_writer(self) -> Callable[[TemplateFrame, int, int, tuple[int, ...]], bool]:
        """``put_templated(frame, seq, time_ns, values) -> bool``: write one record made from a template.
        No dict, no marshal, and when the slot already holds this template (the engine's buckets come
        round to the same slots step after step) only the integers. False if a value is not an int64
        (the record then waits for the worker's round) or the ring is closed.

        A closure over the mapping and the slot counter, not a method: it runs between a backward hook
        and an all-reduce, with the caches cold, where each attribute lookup on ``self`` costs about a
        microsecond (the method measured 20 us a call in the engine, 5 of them before the first copy;
        what the closure saves is within the run-to-run spread of ``bench.cost_accounting``). Each copy
        into the mapping costs 5-10 us there, hence the template is written only when the slot holds
        something else."""
        m = self._map
        assert m is not None
        counter, slots, slot_bytes, held = self._next, self.slots, self.slot_bytes, self._held
        prefix_size = _TEMPLATE_PREFIX.size

        def put_templated(frame: TemplateFrame, seq: int, time_ns: int, values: tuple[int, ...]) -> bool:
            slot = next(counter) % slots
            at = slot * slot_bytes
            ints = frame.ints
            try:
                if held[slot] is not frame:
                    held[slot] = None
                    body = at + prefix_size + ints.size
                    m[body : body + len(frame.payload)] = frame.payload
                    m[at : at + prefix_size] = frame.prefix
                    held[slot] = frame
                # The check inline (see _check): a call frame more costs microseconds with cold caches.
                ints.pack_into(m, at + prefix_size, seq, time_ns, *values, hash(values) ^ seq ^ time_ns)
            except (ValueError, TypeError, struct.error):  # closed by shutdown (ValueError); not an int64
                return False
            return True

        return put_templated

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
    templates: dict[bytes, tuple[dict[str, Any], tuple[str, ...]] | None] = {}
    for at in range(0, len(buf) - slot_bytes + 1, slot_bytes):
        magic, length, crc = header.unpack_from(buf, at)
        if magic == TEMPLATE_MAGIC:
            record = _read_templated(buf, at, slot_bytes, templates)
            if record is not None:
                out.append(record)
            continue
        body = at + header.size
        if magic != spool.MAGIC or body + length > at + slot_bytes:
            continue  # never written, or damaged
        payload = buf[body : body + length]
        if zlib.crc32(payload) == crc:
            out.extend(spool.decode_batch(payload))
    return out


def _read_templated(
    buf: bytes,
    at: int,
    slot_bytes: int,
    templates: dict[bytes, tuple[dict[str, Any], tuple[str, ...]] | None],
) -> dict[str, Any] | None:
    _, length, crc, n = _TEMPLATE_PREFIX.unpack_from(buf, at)
    ints = struct.Struct("<" + "q" * (n + 3))
    body = at + _TEMPLATE_PREFIX.size + ints.size
    if body + length > at + slot_bytes:
        return None
    seq, time_ns, *values, check = ints.unpack_from(buf, at + _TEMPLATE_PREFIX.size)
    if _check(seq, time_ns, tuple(values)) != check:
        return None  # torn integers
    payload = buf[body : body + length]
    if payload not in templates:
        template = None
        if zlib.crc32(payload) == crc:
            try:
                fixed, names = marshal.loads(payload)
                if isinstance(fixed, dict) and len(names) == n:
                    template = (fixed, tuple(names))
            except (ValueError, EOFError, TypeError):
                pass
        templates[payload] = template
    template = templates[payload]
    if template is None:
        return None  # torn or damaged template
    fixed, names = template
    return {**fixed, **dict(zip(names, values, strict=True)), "seq": seq, "time_ns": time_ns}
