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
a few integers instead of marshalling a dict. The template, the marshalled ``(fixed fields with the
envelope, variables)`` encoded once per agent (``encode_template``), is written once into a **template
table** after the slots (``TABLE_ENTRIES`` entries of a slot each: ``TABLE_MAGIC | template length |
crc32(template) | n | template``), before any slot refers to it. A record's slot then holds
``REF_MAGIC | entry index | crc32(template) | n | seq, time_ns, n values, check (int64 LE each)``,
written in one ``struct.pack_into``, which zeroes its whole span and then writes the fields in order:
the ``check`` (``~seq ^ crc32(template)``, never 0) is the last word written, so it matches only once
every integer before it is in place, and only for the template the entry holds. A torn slot fails its
check, a torn entry its crc, and either way the record is skipped. (A hash of the integers as the check
cost ~5 us a record with the caches cold; this one costs nothing. Copying the template into each slot,
as the ring did before the table, cost ~4 us more a record cold: the slots that come round to a record
hardly ever held its template, since the records of a step are not a fixed cycle.)

Once the table is full (templates keep changing: a user's collectives of ever new shapes), a record
carries its template inline: ``TEMPLATE_MAGIC | template length | crc32(template) | n | the integers |
template``, the template and prefix copied first, the integers last as above.
"""

from __future__ import annotations

import contextlib
import itertools
import marshal
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from ddpscope.agent import spool
from ddpscope.agent.implied import IMPLIES_KEY, implied_records
from ddpscope.agent.log import get_logger

logger = get_logger(__name__)

SLOT_BYTES = 4096
"""A collective record with its envelope marshals to ~300 bytes; a step record made from its template
takes 40 bytes a bucket and ~0.5 KB more (up to ~80 buckets fit). A bigger record is not copied (a
durable one then takes the synchronous spool path)."""
SLOTS = 512
"""2 MiB per rank (plus the template table's 256 KiB): the last 512 records, far more durable records
than a worker round (0.25 s) emits in training (``RING_DRAIN_AT`` in ``_core`` wakes the worker early
when it is not)."""


TABLE_ENTRIES = 64
"""Templates written once into the table after the slots (256 KiB). An engine uses two per bucket
and a few for its step records; a user's repeated collectives one per call site and shape."""

TEMPLATE_MAGIC = b"\xffDT\x01"
TABLE_MAGIC = b"\xffDE\x01"
REF_MAGIC = b"\xffDR\x01"
_TEMPLATE_PREFIX = struct.Struct("<4sIII")
"""magic, template length, crc32 of the template, number of variable values (16 bytes)."""

Variable = str | tuple[str, int]
"""A template's variable field: a name (one integer) or ``(name, n)`` (a list of ``n`` integers)."""


def width(variables: Sequence[Variable]) -> int:
    """How many integers ``variables`` take."""
    return sum(1 if isinstance(v, str) else v[1] for v in variables)


def fill(variables: Sequence[Variable], values: Sequence[int]) -> dict[str, Any]:
    """The variable fields of a record: ``values`` cut along ``variables`` (``ValueError`` when the
    counts differ). Scalars only, the recorder's case, is one ``zip``."""
    if all(isinstance(v, str) for v in variables):
        return dict(zip(variables, values, strict=True))  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    at = 0
    for v in variables:
        if isinstance(v, str):
            out[v] = values[at]
            at += 1
        else:
            name, n = v
            out[name] = list(values[at : at + n])
            at += n
    if at != len(values):
        raise ValueError(f"{len(values)} values for variables of width {at}")
    return out


def ring_path(directory: str, prefix: str) -> str:
    return os.path.join(directory, f"{prefix}.ring")


class TemplateFrame:
    """A template as one agent writes it into its ring (``encode_template``)."""

    __slots__ = ("prefix", "ints", "payload", "crc", "ref")

    def __init__(self, prefix: bytes, ints: struct.Struct, payload: bytes, crc: int) -> None:
        self.prefix = prefix
        """``_TEMPLATE_PREFIX`` of the inline layout, packed."""
        self.ints = ints
        """seq, time_ns, the values and the check (inline: after the prefix)."""
        self.payload = payload
        """The marshalled template."""
        self.crc = crc
        """crc32 of ``payload``, in every prefix and part of each record's check."""
        self.ref: tuple[object, struct.Struct, int] | None = None
        """Set by the ring that wrote it into its table: (that ring's token, the packer of a referring
        slot, the entry's index)."""


def encode_template(
    fixed: dict[str, Any], variables: Sequence[Variable], slot_bytes: int = SLOT_BYTES
) -> TemplateFrame | None:
    """``fixed`` holds every field but the variables, seq and time_ns (the envelope's job, rank and
    stream included). None when it does not marshal or does not fit in a slot."""
    try:
        payload = marshal.dumps((fixed, tuple(variables)), 4)
    except ValueError:
        return None
    n = width(variables)
    ints = struct.Struct(f"<{n + 3}q")
    if _TEMPLATE_PREFIX.size + ints.size + len(payload) > slot_bytes:
        return None
    crc = zlib.crc32(payload)
    prefix = _TEMPLATE_PREFIX.pack(TEMPLATE_MAGIC, len(payload), crc, n)
    return TemplateFrame(prefix, ints, payload, crc)


def _check(seq: int, crc: int) -> int:
    """The last integer of a templated slot (see the module's docstring): ~seq is negative, so a
    zeroed word never matches."""
    return ~seq ^ crc


class WriteAheadRing:
    """Writer side (the training process). ``put`` is safe from any thread: slot numbers come from
    an ``itertools.count`` (atomic under the GIL) and each copy writes only its own slot."""

    def __init__(
        self,
        directory: str,
        prefix: str,
        *,
        slots: int = SLOTS,
        slot_bytes: int = SLOT_BYTES,
        table_entries: int = TABLE_ENTRIES,
    ) -> None:
        self.path = ring_path(directory, prefix)
        self.slots, self.slot_bytes = slots, slot_bytes
        size = (slots + table_entries) * slot_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            # Blocks reserved now, not a sparse file: a page of a mapping the filesystem cannot back
            # (a full disk or tmpfs) is a SIGBUS in the training process at the first write to it, not
            # an error. A full filesystem fails here (OSError: ENOSPC) and the caller goes without a ring.
            os.posix_fallocate(fd, 0, size)
            self._map: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_WRITE)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        finally:
            os.close(fd)  # the mapping keeps the file alive
        self._next = itertools.count()
        self._entries = iter(range(slots, slots + table_entries))
        """Table entries not written yet (their absolute slot index)."""
        self._token = object()
        """What a frame's ``ref`` names this ring by (a frame may outlive a ring)."""
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
        at = slot * size
        try:
            m[at : at + len(data)] = data
        except (ValueError, TypeError):  # closed by a concurrent shutdown
            return False
        return True

    def _templated_writer(self) -> Callable[[TemplateFrame, int, int, tuple[int, ...]], bool]:
        """``put_templated(frame, seq, time_ns, values) -> bool``: write one record made from a template:
        no dict, no marshal, one ``pack_into`` of the integers behind a reference to the template's
        table entry (written at the template's first record). False if a value is not an int64 (the
        record then waits for the worker's round) or the ring is closed.

        A closure over the mapping and the slot counter, not a method: it runs between a backward hook
        and an all-reduce, with the caches cold, where each attribute lookup on ``self`` costs about a
        microsecond (the method measured 20 us a call in the engine, 5 of them before the first copy)."""
        m = self._map
        assert m is not None
        counter, slots, slot_bytes, token = self._next, self.slots, self.slot_bytes, self._token
        prefix_size = _TEMPLATE_PREFIX.size
        add_entry = self._add_entry

        def put_templated(frame: TemplateFrame, seq: int, time_ns: int, values: tuple[int, ...]) -> bool:
            ref = frame.ref
            try:
                if ref is None or ref[0] is not token:
                    ref = add_entry(frame)
                at = next(counter) % slots * slot_bytes
                if ref is not None:
                    # The check inline (see _check): a call frame more costs microseconds with cold caches.
                    ref[1].pack_into(m, at, REF_MAGIC, ref[2], frame.crc, len(values), seq, time_ns, *values,
                                     ~seq ^ frame.crc)  # fmt: skip
                    return True
                body = at + prefix_size + frame.ints.size
                m[body : body + len(frame.payload)] = frame.payload
                m[at : at + prefix_size] = frame.prefix
                frame.ints.pack_into(m, at + prefix_size, seq, time_ns, *values, ~seq ^ frame.crc)
            except (ValueError, TypeError, struct.error):  # closed by shutdown (ValueError); not an int64
                return False
            return True

        return put_templated

    def _add_entry(self, frame: TemplateFrame) -> tuple[object, struct.Struct, int] | None:
        """Write ``frame``'s template into the next table entry and give the frame its reference
        there; None once the table is full (its records then carry the template inline)."""
        index = next(self._entries, None)
        m = self._map
        if index is None or m is None:
            return None
        at = index * self.slot_bytes
        m[at + _TEMPLATE_PREFIX.size : at + _TEMPLATE_PREFIX.size + len(frame.payload)] = frame.payload
        n = frame.ints.size // 8 - 3
        m[at : at + _TEMPLATE_PREFIX.size] = _TEMPLATE_PREFIX.pack(
            TABLE_MAGIC, len(frame.payload), frame.crc, n
        )
        ref = (self._token, struct.Struct(f"<4sIII{n + 3}q"), index)
        frame.ref = ref
        return ref

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
    templates: dict[bytes, tuple[dict[str, Any], tuple[Variable, ...]] | None] = {}
    for at in range(0, len(buf) - slot_bytes + 1, slot_bytes):
        magic, length, crc = header.unpack_from(buf, at)
        if magic in (TEMPLATE_MAGIC, REF_MAGIC):
            record = _read_templated(buf, at, slot_bytes, templates)
            if record is not None:
                implies = record.pop(IMPLIES_KEY, None)
                out.append(record)
                if implies is not None:
                    with contextlib.suppress(Exception):  # a damaged implication loses only itself
                        out.extend(implied_records(tuple(implies), record))
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
    templates: dict[bytes, tuple[dict[str, Any], tuple[Variable, ...]] | None],
) -> dict[str, Any] | None:
    magic, length, crc, n = _TEMPLATE_PREFIX.unpack_from(buf, at)
    ints = at + _TEMPLATE_PREFIX.size
    if ints + 8 * (n + 3) > at + slot_bytes:
        return None
    seq, time_ns, *values, check = struct.unpack_from(f"<{n + 3}q", buf, ints)
    if _check(seq, crc) != check:
        return None  # torn integers
    if magic == REF_MAGIC:  # the template is in the table entry the prefix names
        entry = length * slot_bytes
        if entry > len(buf) - slot_bytes:
            return None
        e_magic, length, e_crc, e_n = _TEMPLATE_PREFIX.unpack_from(buf, entry)
        if e_magic != TABLE_MAGIC or e_crc != crc or e_n != n:
            return None  # never written, torn, or another template's
        body = entry + _TEMPLATE_PREFIX.size
        if body + length > entry + slot_bytes:
            return None
    else:
        body = ints + 8 * (n + 3)
        if body + length > at + slot_bytes:
            return None
    payload = buf[body : body + length]
    if payload not in templates:
        template = None
        if zlib.crc32(payload) == crc:
            try:
                fixed, names = marshal.loads(payload)
                if isinstance(fixed, dict) and width(names) == n:
                    template = (fixed, tuple(names))
            except (ValueError, EOFError, TypeError, IndexError):
                pass
        templates[payload] = template
    template = templates[payload]
    if template is None:
        return None  # torn or damaged template
    fixed, names = template
    return {**fixed, **fill(names, values), "seq": seq, "time_ns": time_ns}
