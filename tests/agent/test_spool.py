"""The spool file format and its reader: order, acknowledgement, cap, and damage."""

from __future__ import annotations

from pathlib import Path

from ddpscope.agent import spool


def payload(i: int, kind: str = "step") -> bytes:
    return spool.encode_batch([{"kind": kind, "i": i}])


def index(p: bytes) -> int:
    return int(spool.decode_batch(p)[0]["i"])


def write(d: Path, n: int, *, segment_bytes: int = 1 << 20, kind: str = "step") -> spool.SpoolWriter:
    w = spool.SpoolWriter(str(d), "p", segment_bytes=segment_bytes, hard_cap_bytes=1 << 30)
    for i in range(n):
        assert w.append(payload(i, kind))
    return w


def read_all(d: Path, writer_done: bool = True) -> spool.Chunk:
    return spool.SpoolReader(str(d), "p").read(1 << 30, writer_done)


def test_frames_read_back_in_order_across_segments(tmp_path: Path) -> None:
    write(tmp_path, 50, segment_bytes=200)
    assert len(spool.list_segments(str(tmp_path), "p")) > 3
    chunk = read_all(tmp_path)
    assert [index(p) for p in chunk.payloads] == list(range(50))
    assert chunk.corrupt == chunk.truncated == 0


def test_acknowledged_segments_are_deleted_and_the_position_survives_a_new_reader(tmp_path: Path) -> None:
    write(tmp_path, 30, segment_bytes=200)
    reader = spool.SpoolReader(str(tmp_path), "p")
    first = reader.read(300, writer_done=False)
    assert 0 < len(first.payloads) < 30
    reader.ack(first.end)
    assert spool.list_segments(str(tmp_path), "p")[0][0] == first.end[0]
    rest = spool.SpoolReader(str(tmp_path), "p").read(1 << 30, writer_done=True)
    got = [index(p) for p in first.payloads + rest.payloads]
    assert got == list(range(30))


def test_a_flipped_byte_skips_only_the_damaged_frame_and_is_counted(tmp_path: Path) -> None:
    write(tmp_path, 10)
    (seg,) = [p for _, p in spool.list_segments(str(tmp_path), "p")]
    data = bytearray(Path(seg).read_bytes())
    frame_len = len(spool.frame(payload(0)))
    data[4 * frame_len + spool.HEADER.size + 3] ^= 0x20  # inside the 5th frame's payload
    Path(seg).write_bytes(bytes(data))
    chunk = read_all(tmp_path)
    assert [index(p) for p in chunk.payloads] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert chunk.corrupt == 1


def test_a_garbled_header_is_skipped_by_resynchronising_on_the_next_frame(tmp_path: Path) -> None:
    write(tmp_path, 6)
    (seg,) = [p for _, p in spool.list_segments(str(tmp_path), "p")]
    data = bytearray(Path(seg).read_bytes())
    frame_len = len(spool.frame(payload(0)))
    data[2 * frame_len + 5] ^= 0xFF  # the 3rd frame's length field
    Path(seg).write_bytes(bytes(data))
    chunk = read_all(tmp_path)
    assert [index(p) for p in chunk.payloads] == [0, 1, 3, 4, 5]
    assert chunk.corrupt == 1


def test_a_torn_tail_waits_while_the_writer_lives_and_is_counted_once_it_is_gone(tmp_path: Path) -> None:
    write(tmp_path, 4)
    (seg,) = [p for _, p in spool.list_segments(str(tmp_path), "p")]
    with open(seg, "ab") as f:
        f.write(spool.frame(payload(99))[:-5])  # the writer died mid-write
    live = read_all(tmp_path, writer_done=False)
    assert len(live.payloads) == 4 and live.truncated == 0
    done = read_all(tmp_path, writer_done=True)
    assert len(done.payloads) == 4 and done.truncated == 1
    assert done.end[1] == Path(seg).stat().st_size


def test_over_the_cap_the_oldest_segments_are_dropped_and_counted_by_kind(tmp_path: Path) -> None:
    write(tmp_path, 40, segment_bytes=300)
    reader = spool.SpoolReader(str(tmp_path), "p")
    total = reader.pending_bytes()
    dropped = reader.drop_over_cap(total // 2, writer_done=False)
    assert reader.pending_bytes() <= total // 2
    rest = reader.read(1 << 30, writer_done=True)
    kept = [index(p) for p in rest.payloads]
    assert dropped["step"] + len(kept) == 40
    assert kept == list(range(40 - len(kept), 40))  # oldest first


def test_the_writer_refuses_past_its_hard_cap_instead_of_filling_the_disk(tmp_path: Path) -> None:
    w = spool.SpoolWriter(str(tmp_path), "p", segment_bytes=256, hard_cap_bytes=1024)
    results = [w.append(payload(i)) for i in range(100)]
    assert results[0] and not results[-1]
    size = sum(Path(p).stat().st_size for _, p in spool.list_segments(str(tmp_path), "p"))
    assert size <= 1024


def test_magic_bytes_inside_a_payload_are_not_mistaken_for_a_frame_start() -> None:
    tricky = spool.encode_batch([{"kind": "step", "i": 0, "blob": spool.MAGIC * 3}])
    whole = spool.frame(tricky)
    buf = spool.frame(payload(1)) + whole[: len(whole) - 4]  # the second frame is still being written
    parsed = spool.parse(buf, final=False)
    assert [index(p) for p, _ in parsed.entries] == [1]
    assert parsed.corrupt == 0 and parsed.consumed == len(spool.frame(payload(1)))
    done = spool.parse(buf + whole[-4:], final=False)
    assert len(done.entries) == 2 and done.corrupt == 0


def test_every_acknowledgement_is_read_back_and_finished_segments_go(tmp_path: Path) -> None:
    """The first ``ack`` of a reader replaces the ack file, later ones rewrite it in place."""
    write(tmp_path, 30, segment_bytes=200)
    reader = spool.SpoolReader(str(tmp_path), "p")
    got: list[int] = []
    while True:
        chunk = reader.read(150, writer_done=True)
        if not chunk.payloads:
            break
        got += [index(p) for p in chunk.payloads]
        reader.ack(chunk.end)
        assert spool.read_ack(str(tmp_path), "p") == chunk.end
        assert all(segno >= chunk.end[0] for segno, _ in spool.list_segments(str(tmp_path), "p"))
    reader.close()
    assert got == list(range(30))
    assert spool.SpoolReader(str(tmp_path), "p").read(1 << 30, writer_done=True).payloads == []


def test_an_ack_file_is_read_in_the_earlier_form_and_a_damaged_one_means_from_the_start(
    tmp_path: Path,
) -> None:
    path = Path(spool.ack_path(str(tmp_path), "p"))
    path.write_text("3 1234")  # written by an earlier shipper
    assert spool.read_ack(str(tmp_path), "p") == (3, 1234)
    spool.write_ack(str(tmp_path), "p", (4, 5678))
    assert len(path.read_bytes()) == spool.ACK_BYTES
    assert spool.read_ack(str(tmp_path), "p") == (4, 5678)
    path.write_bytes(path.read_bytes().replace(b"5678", b"5679"))  # a torn or damaged write
    assert spool.read_ack(str(tmp_path), "p") == (0, 0)  # everything is sent again: at least once
