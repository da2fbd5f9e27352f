"""The disk spool: bounded append-only segment files of framed batches, read back in order.

One agent incarnation (stream) owns the files ``<prefix>-<segno>.seg`` in the spool directory. The
writer (in the training process) appends one frame per batch with a single ``write`` on an O_APPEND
descriptor and never rewrites; the reader (the shipper process) keeps its position in
``<prefix>.ack`` and deletes a segment only once everything in it was acknowledged by the collector.

Frame: ``MAGIC (4 bytes) | payload length (u32 LE) | crc32(payload) (u32 LE) | payload``; the payload
is one batch of records (``encode_batch``). The reader resynchronises after damage on the next
position where a header and its crc hold up: a flipped byte fails the crc, a garbled header fails
the magic, and a torn tail (the writer died mid-write) is cut off; each is skipped and counted.

Writes are not fsynced: a killed process's writes are already in the page cache, which is what crash
durability needs; a power loss of the node may lose the last second.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import re
import struct
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ddpscope.agent.log import get_logger

logger = get_logger(__name__)

MAGIC = b"\xffDS\x01"
HEADER = struct.Struct("<4sII")
MARSHAL_VERSION = 4
MAX_FRAME = 64 * 2**20
"""A length field above this is damage, not data."""

WAKE_URGENT, WAKE_DATA = b"!", b"."
"""Bytes the writer sends on the shipper's stdin pipe: ship now (urgent records, a flush), or new
frames are waiting (rationed by the writer; see ``spool_exporter``)."""

Position = tuple[int, int]
"""(segment number, byte offset in it)."""


def frame(payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


@dataclass
class Parsed:
    entries: list[tuple[bytes, int]] = field(default_factory=list)
    """(payload, offset just past its frame)."""
    consumed: int = 0
    """Offset up to which the buffer is settled (entries, or damage skipped)."""
    corrupt: int = 0
    """Damaged regions skipped (bad magic, bad crc, impossible length)."""
    truncated: int = 0
    """Torn frames at the end of a sealed segment."""


def parse(buf: bytes, final: bool) -> Parsed:
    """Split ``buf`` (which starts on a frame boundary) into frames.

    ``final`` means nothing more will be appended to ``buf``: an incomplete frame at its end is then a
    torn write rather than one still in progress.
    """
    out = Parsed()
    n, pos = len(buf), 0
    while n - pos >= HEADER.size:
        state = _frame_at(buf, pos)
        if state == "valid":
            length = HEADER.unpack_from(buf, pos)[1]
            body = pos + HEADER.size
            pos = body + length
            out.entries.append((buf[body:pos], pos))
            continue
        if state == "partial":
            # Still being written, or its length field is damaged: only a complete valid frame
            # further on proves the damage.
            nxt = _next_frame(buf, pos + HEADER.size, accept=("valid",))
            if nxt >= 0:
                out.corrupt += 1
                pos = nxt
                continue
            if final:
                out.truncated += 1
                pos = n
            break
        out.corrupt += 1
        nxt = _next_frame(buf, pos + 1, accept=("valid", "partial"))
        if nxt < 0:
            # Keep a possibly partial magic at the very end: the next frame may be arriving.
            nxt = n if final else max(pos + 1, n - len(MAGIC) + 1)
        pos = nxt
    if final and pos < n:
        out.truncated += 1  # a few bytes of header and no more: the writer died mid-write
        pos = n
    out.consumed = pos
    return out


def _frame_at(buf: bytes, pos: int) -> str:
    """'valid' (complete, crc ok), 'partial' (runs past the end of buf) or 'bad'."""
    if len(buf) - pos < HEADER.size:
        return "partial"
    magic, length, crc = HEADER.unpack_from(buf, pos)
    if magic != MAGIC or length > MAX_FRAME:
        return "bad"
    body = pos + HEADER.size
    if body + length > len(buf):
        return "partial"
    return "valid" if zlib.crc32(buf[body : body + length]) == crc else "bad"


def _next_frame(buf: bytes, start: int, accept: tuple[str, ...]) -> int:
    """The first position at or after ``start`` where a frame in an ``accept`` state begins; -1 if none.

    Payloads are binary and may contain the magic bytes by chance, so a candidate counts only if its
    header and crc hold up.
    """
    i = buf.find(MAGIC, start)
    while i >= 0:
        if _frame_at(buf, i) in accept:
            return i
        i = buf.find(MAGIC, i + 1)
    return -1


def segment_path(directory: str, prefix: str, segno: int) -> str:
    return os.path.join(directory, f"{prefix}-{segno:06d}.seg")


def list_segments(directory: str, prefix: str) -> list[tuple[int, str]]:
    pattern = re.compile(re.escape(prefix) + r"-(\d{6,})\.seg$")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(directory, name)) for name in names if (m := pattern.match(name))]
    return sorted(found)


def ack_path(directory: str, prefix: str) -> str:
    return os.path.join(directory, f"{prefix}.ack")


ACK_BYTES = 64
"""The ack file's fixed size: ``<segno> <offset> <crc32>`` padded with spaces, rewritten in place."""


def _ack_text(pos: Position) -> bytes:
    text = b"%d %d" % pos
    return (b"%s %08x" % (text, zlib.crc32(text))).ljust(ACK_BYTES - 1) + b"\n"


def read_ack(directory: str, prefix: str) -> Position:
    """The acknowledged position; (0, 0) if there is none (everything is sent again: at least once)."""
    for _ in range(100):
        try:
            with open(ack_path(directory, prefix), "rb") as f:
                fields = f.read().split()
        except FileNotFoundError:
            return (0, 0)
        try:
            if len(fields) == 2:  # the rename-only form of earlier shippers
                return int(fields[0]), int(fields[1])
            segno, offset, crc = fields
            if zlib.crc32(b"%s %s" % (segno, offset)) == int(crc, 16):
                return int(segno), int(offset)
        except ValueError:
            pass
        # Read while the shipper rewrote it (a torn read, which the checksum catches): read again.
        time.sleep(0.0001)
    return (0, 0)


def write_ack(directory: str, prefix: str, pos: Position) -> None:
    """Replace the ack file atomically (a reader never sees half a position)."""
    path = ack_path(directory, prefix)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(_ack_text(pos))
    os.replace(tmp, path)


def encode_batch(records: list[dict[str, Any]]) -> bytes:
    """One frame's payload. ``marshal`` (format 4, readable by every Python 3 since 3.4) is ~10x
    cheaper than JSON for the training process; the shipper converts to JSON in its own process.

    marshal refuses subclasses of the built-in types, and records carry some: ``torch.__version__``
    is a ``str`` subclass, an ``IntEnum`` an ``int`` one, a 0-d tensor or numpy scalar a number in
    disguise. Those are converted (``plain``) rather than dropped; ValueError means a value that is
    no JSON value at all (a tensor with elements, an arbitrary object)."""
    try:
        return marshal.dumps(records, MARSHAL_VERSION)
    except ValueError:
        return marshal.dumps([plain(r) for r in records], MARSHAL_VERSION)


_PLAIN_SCALARS = (str, int, float, bool, type(None), bytes)


def plain(value: Any) -> Any:
    """``value`` rebuilt from exact built-in types (what marshal and JSON carry); ValueError if a
    part is not a JSON value or a scalar that converts to one (``.item()`` of a one-element tensor
    or numpy scalar)."""
    if type(value) in _PLAIN_SCALARS:
        return value
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    for base in (str, int, float):  # bool cannot be subclassed
        if isinstance(value, base):
            return base(value)
    if callable(getattr(value, "item", None)) and _one_element(value):
        return plain(value.item())
    raise ValueError(f"a record value of type {type(value).__name__} is not a JSON value")


def _one_element(value: Any) -> bool:
    """A torch tensor (``numel()``) or numpy value (``size``) holding exactly one number."""
    try:
        numel = getattr(value, "numel", None)
        return int(numel() if callable(numel) else value.size) == 1
    except Exception:
        return False


def decode_batch(payload: bytes) -> list[dict[str, Any]]:
    """The records of one frame; [] for a payload that does not decode (counted by the caller)."""
    try:
        records = marshal.loads(payload)
    except (ValueError, EOFError, TypeError):
        return []
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []


def count_kinds(payload: bytes) -> Counter[str]:
    """Record kinds in one frame's payload (used only when dropping, to count drops by kind)."""
    records = decode_batch(payload)
    return Counter(str(r.get("kind")) for r in records) if records else Counter({"unknown": 1})


class SpoolWriter:
    """Appends frames to the current segment; rolls at ``segment_bytes``; refuses past ``hard_cap_bytes``.

    The reader enforces the real cap (dropping oldest first). The hard cap here is the backstop for a
    shipper that is not running: the disk never fills up because of us.
    """

    def __init__(self, directory: str, prefix: str, *, segment_bytes: int, hard_cap_bytes: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory, self.prefix = directory, prefix
        self.segment_bytes, self.hard_cap_bytes = segment_bytes, hard_cap_bytes
        existing = list_segments(directory, prefix)
        self.segno = existing[-1][0] + 1 if existing else 0
        self.size = 0
        self.disk_bytes = 0
        self._checked_at = 0.0
        self._fd = self._open()

    def _open(self) -> int:
        path = segment_path(self.directory, self.prefix, self.segno)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    @property
    def position(self) -> Position:
        return (self.segno, self.size)

    def append(self, payload: bytes, *, over_cap: bool = False) -> bool:
        """Write one frame; False (nothing written) when the spool is over its hard cap.

        ``over_cap`` writes anyway: for the agent's own small drop accounting, which must reach the
        collector precisely when the spool is full.
        """
        if self.size >= self.segment_bytes:
            os.close(self._fd)
            self.segno += 1
            self.size = 0
            self._fd = self._open()
            self._measure()
        data = frame(payload)
        # Re-measure whenever this frame would not fit: the shipper may have freed old segments since.
        if (
            self.disk_bytes + self.size + len(data) > self.hard_cap_bytes
            and time.monotonic() - self._checked_at > 0.2
        ):
            self._measure()
        if self.disk_bytes + self.size + len(data) > self.hard_cap_bytes and not over_cap:
            return False
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError:
            # A full disk mid-frame: cut the torn part off, so the next frame starts where the shipper
            # expects one (O_APPEND writes at the new end).
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.size)
            raise
        self.size += len(data)
        return True

    def _measure(self) -> None:
        """Bytes in this stream's older segments still on disk (the shipper deletes acknowledged ones)."""
        self._checked_at = time.monotonic()
        total = 0
        for segno, path in list_segments(self.directory, self.prefix):
            if segno < self.segno:
                try:
                    total += os.path.getsize(path)
                except FileNotFoundError:
                    continue  # just deleted by the shipper
        self.disk_bytes = total

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class Chunk:
    payloads: list[bytes]
    end: Position
    corrupt: int = 0
    truncated: int = 0


class SpoolReader:
    """Reads frames after the acknowledged position; ``ack`` moves it and deletes finished segments."""

    def __init__(self, directory: str, prefix: str) -> None:
        self.directory, self.prefix = directory, prefix
        self.pos: Position = read_ack(directory, prefix)
        self._ack_fd = -1
        """The ack file, rewritten in place once this reader replaced it (see ``ack``)."""

    def read(self, max_bytes: int, writer_done: bool) -> Chunk:
        """Frames from the acknowledged position, up to about ``max_bytes`` (at least one frame)."""
        segs = list_segments(self.directory, self.prefix)
        chunk = Chunk([], self.pos)
        budget = max_bytes
        for i, (segno, path) in enumerate(segs):
            if segno < chunk.end[0]:
                continue
            offset = chunk.end[1] if segno == chunk.end[0] else 0
            sealed = writer_done or i < len(segs) - 1
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                # Only what is there: a read of the whole budget allocates (and faults in) 2 MB for
                # the ~100 kB a second brings, ~80 us a read.
                size = os.fstat(fd).st_size
                want = min(size - offset, budget if not chunk.payloads else max(1, budget))
                buf = os.pread(fd, want, offset) if want > 0 else b""
            finally:
                os.close(fd)
            at_eof = offset + len(buf) >= size
            parsed = parse(buf, final=sealed and at_eof)
            if not parsed.entries and not at_eof and not chunk.payloads:
                # One frame bigger than the budget: read the rest of the segment.
                with open(path, "rb") as f:
                    f.seek(offset)
                    buf = f.read()
                at_eof = True
                parsed = parse(buf, final=sealed)
            chunk.payloads.extend(p for p, _ in parsed.entries)
            chunk.corrupt += parsed.corrupt
            chunk.truncated += parsed.truncated
            chunk.end = (segno, offset + parsed.consumed)
            budget -= parsed.consumed
            if not (sealed and at_eof and offset + parsed.consumed >= offset + len(buf)):
                break
            if i + 1 < len(segs):
                chunk.end = (segs[i + 1][0], 0)
            if budget <= 0:
                break
        return chunk

    def ack(self, pos: Position) -> None:
        if pos == self.pos:
            return
        if self._ack_fd < 0:
            # Once per reader: a fresh file of the fixed size by rename, then in place (one pwrite,
            # ~3 us, where a rename over the file costs ~200 us of the shipper's CPU on ext4, once a
            # second). A reader that catches the pwrite half done sees a bad checksum and reads again.
            write_ack(self.directory, self.prefix, pos)
            self._ack_fd = os.open(ack_path(self.directory, self.prefix), os.O_WRONLY | os.O_CLOEXEC)
            older = True
        else:
            os.pwrite(self._ack_fd, _ack_text(pos), 0)
            older = pos[0] != self.pos[0]
        self.pos = pos
        if older:  # a segment was finished: delete what lies before the position
            for segno, path in list_segments(self.directory, self.prefix):
                if segno < pos[0]:
                    _unlink(path)

    def close(self) -> None:
        if self._ack_fd >= 0:
            os.close(self._ack_fd)
            self._ack_fd = -1

    def pending_bytes(self) -> int:
        total = 0
        for segno, path in list_segments(self.directory, self.prefix):
            if segno >= self.pos[0]:
                try:
                    total += os.path.getsize(path)
                except FileNotFoundError:
                    continue
        return max(0, total - self.pos[1])

    def drop_over_cap(self, cap_bytes: int, writer_done: bool) -> Counter[str]:
        """Drop whole oldest segments while over ``cap_bytes``; return the records dropped, by kind."""
        dropped: Counter[str] = Counter()
        while self.pending_bytes() > cap_bytes:
            segs = [s for s in list_segments(self.directory, self.prefix) if s[0] >= self.pos[0]]
            # The newest segment is still being appended to: never drop it under the writer.
            if not segs or (len(segs) == 1 and not writer_done):
                break
            segno, path = segs[0]
            try:
                with open(path, "rb") as f:
                    f.seek(self.pos[1] if segno == self.pos[0] else 0)
                    buf = f.read()
            except FileNotFoundError:
                buf = b""
            for payload, _ in parse(buf, final=True).entries:
                dropped.update(count_kinds(payload))
            nxt = (segs[1][0], 0) if len(segs) > 1 else (segno + 1, 0)
            logger.warning("ddpscope: spool over its cap; dropping %s", path)
            self.ack(nxt)
            _unlink(path)
        return dropped


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
