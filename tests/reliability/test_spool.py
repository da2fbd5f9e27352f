"""The disk spool under pressure: a cap that holds while the collector is down, and damaged files."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ddpscope.agent import spool
from tests.reliability.conftest import Accounting, Started, account, agent_env, finish
from tests.support.collector_proc import CollectorProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CAP_MB = 0.05
CAP_BYTES = int(CAP_MB * 2**20)
SEGMENT_BYTES = 16 * 1024
"""What the spool exporter picks for so small a cap (max(16 KiB, cap / 8))."""


def spool_disk_bytes(directory: Path) -> int:
    total = 0
    for p in directory.glob("*.seg"):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            continue  # deleted by the shipper between glob and stat
    return total


def wait_accounted(db: Path, job: str, n: int, timeout_s: float) -> Accounting:
    """Poll until every emitted step record is either stored or counted as dropped."""
    deadline = time.monotonic() + timeout_s
    while True:
        acc = account(db, job) if db.exists() else Accounting()
        if acc.rows + acc.dropped_steps >= n or time.monotonic() > deadline:
            return acc
        time.sleep(0.2)


def test_a_full_spool_holds_its_cap_and_its_drops_reach_the_collector_exactly(
    tmp_path: Path, collector: CollectorProc, started: Started, figures: dict[str, Any]
) -> None:
    n = 3000
    job = "spoolcap"
    spool_dir = tmp_path / "spool"
    db = Path(collector.db_url.removeprefix("sqlite:///"))
    # The collector is down: its port is chosen but nothing listens yet.
    env = agent_env(collector.url, spool_dir, job, DDPSCOPE_SPOOL_MAX_MB=str(CAP_MB))
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], spool_disk_bytes(spool_dir) if spool_dir.exists() else 0)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        summary = finish(started.emitter(env, n, 1500.0), 60)
        time.sleep(0.5)  # the shipper enforces the cap on its next round after the writer is gone
    finally:
        stop.set()
        sampler.join(5)
    collector.start()
    acc = wait_accounted(db, job, n, 45)

    figures["spool_cap"] = {
        "cap_bytes": CAP_BYTES,
        "peak_spool_bytes_on_disk": peak[0],
        "step_records_emitted": n,
        "step_records_delivered": acc.rows,
        "step_records_dropped_counted": acc.dropped_steps,
        "step_records_lost": n - acc.rows - acc.dropped_steps,
        "duplicates": acc.duplicates,
        "drop_reasons": dict(acc.dropped),
        "delivered_steps_first_last": [min(acc.per_rank.get(0, {-1})), max(acc.per_rank.get(0, {-1}))],
    }
    assert summary["emitted"] == n
    assert acc.dropped_steps > 0, "the test must overflow the spool"
    assert acc.rows + acc.dropped_steps == n, (acc.rows, dict(acc.dropped))
    assert acc.duplicates == 0
    # The shipper drops whole old segments once pending bytes pass the cap, never the segment being
    # written; the writer refuses frames past twice the cap. So the disk never holds more than that.
    assert peak[0] <= 2 * CAP_BYTES + SEGMENT_BYTES, peak[0]
    assert acc.dropped_steps == sum(
        v for k, v in acc.dropped.items() if k.startswith("spool_full:") and k.endswith(":step")
    )


def test_a_corrupted_spool_is_skipped_counted_and_the_rest_delivered(
    tmp_path: Path, collector: CollectorProc, started: Started, figures: dict[str, Any]
) -> None:
    n = 600
    job = "spoolcorrupt"
    spool_dir = tmp_path / "spool"
    db = Path(collector.db_url.removeprefix("sqlite:///"))
    # First incarnation: collector down, a shipper that gives up at once: the spool stays on disk.
    env = agent_env(
        collector.url, spool_dir, job, DDPSCOPE_SHIPPER_LINGER_S="0", DDPSCOPE_FLUSH_INTERVAL_S="0.002"
    )
    # Slow enough for a frame every few dozen records (a busy round every 0.25 s): 16 or so frames.
    finish(started.emitter(env, n, 150.0), 60)
    deadline = time.monotonic() + 20
    while list(spool_dir.glob("*.lock")) and any(_holds_lock(p) for p in spool_dir.glob("*.lock")):
        assert time.monotonic() < deadline, "the first shipper did not give up"
        time.sleep(0.1)
    (meta,) = spool_dir.glob("*.meta")
    prefix = meta.name[: -len(".meta")]
    segments = spool.list_segments(str(spool_dir), prefix)
    frames: list[tuple[str, int, int, bytes]] = []  # (path, start, end, payload)
    for _, path in segments:
        buf = Path(path).read_bytes()
        start = 0
        for payload, end in spool.parse(buf, final=True).entries:
            frames.append((path, start, end, payload))
            start = end
    assert len(frames) >= 8, f"need several frames to damage, got {len(frames)}"

    def steps_in(payload: bytes) -> int:
        return sum(r["kind"] == "step" for r in _decode(payload))

    # Damage: one flipped byte inside two payloads, one garbled header, and a torn tail, with an intact
    # frame between any two (adjacent damage is skipped, and counted, as one region).
    flipped = [frames[1], frames[5]]
    garbled = frames[3]
    tail = frames[-1]
    for path, start, end, _ in flipped:
        _flip(Path(path), start + spool.HEADER.size + (end - start - spool.HEADER.size) // 2)
    _flip(Path(garbled[0]), garbled[1])  # the magic's first byte
    with open(tail[0], "r+b") as f:
        f.truncate(tail[1] + spool.HEADER.size + (tail[2] - tail[1] - spool.HEADER.size) // 2)
    lost_expected = sum(steps_in(fr[3]) for fr in (*flipped, garbled, tail))

    # Second incarnation of the job, collector up: its shipper adopts the damaged orphan.
    collector.start()
    finish(started.emitter(agent_env(collector.url, spool_dir, job), 10, 1000.0, first=n), 30)
    acc = wait_accounted(db, job, n + 10 - lost_expected, 30)
    deadline = time.monotonic() + 20
    while sum(v for k, v in acc.dropped.items() if k.startswith(("corrupt:", "truncated:"))) < 4:
        assert time.monotonic() < deadline, f"damage not counted: {dict(acc.dropped)}"
        time.sleep(0.2)
        acc = account(db, job)

    figures["spool_corruption"] = {
        "frames": len(frames),
        "damaged_frames": 4,
        "step_records_in_damaged_frames": lost_expected,
        "step_records_delivered": acc.rows,
        "damage_counted": {k: v for k, v in acc.dropped.items() if k.startswith(("corrupt:", "truncated:"))},
        "duplicates": acc.duplicates,
    }
    assert acc.dropped["corrupt:unknown"] == 3 and acc.dropped["truncated:unknown"] == 1, dict(acc.dropped)
    assert acc.rows == n + 10 - lost_expected and acc.duplicates == 0
    damaged_steps = {
        r["step"] for fr in (*flipped, garbled, tail) for r in _decode(fr[3]) if r["kind"] == "step"
    }
    assert acc.per_rank[0] == set(range(n + 10)) - damaged_steps


def _decode(payload: bytes) -> list[dict[str, Any]]:
    """A frame's records, with the spool's own decoder when it has one (the payload format is its own)."""
    decode = getattr(spool, "decode_batch", None)
    return list(decode(payload)) if decode is not None else list(json.loads(payload))


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def _holds_lock(lock: Path) -> bool:
    try:
        pid = int(lock.read_text())
        os.kill(pid, 0)
    except (ValueError, OSError):
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"
