"""Access and abuse at the ingest door: tokens, oversized bodies, a gzip bomb (live collector)."""

from __future__ import annotations

import hmac
import http.client
import json
import sqlite3
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ddpscope.server.app import create_app
from ddpscope.server.routes import ingest as ingest_route
from ddpscope.server.settings import Settings
from tests.support.collector_proc import CollectorProc
from tests.support.synth import batch, synth_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TOKEN = "s3cret-token-0123456789"
BODY = json.dumps(batch(synth_job(2, 2, 2, job="guarded"))).encode()


def gzip_bomb(inflated_bytes: int, chunk: int = 4 * 2**20) -> bytes:
    """A valid gzip stream of ``inflated_bytes`` zeros in about 1/1000 of that, built in ~1 s.

    Deflate of a zero-filled window reaches a steady state: after a sync flush every further chunk
    of zeros compresses to the same bytes, so the stream is one piece repeated, plus our own gzip
    header and trailer (CRC-32 and length of the whole).
    """
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    zeros = bytes(chunk)
    pieces = [c.compress(zeros) + c.flush(zlib.Z_SYNC_FLUSH) for _ in range(3)]
    assert pieces[1] == pieces[2], "deflate did not reach a steady state"
    n = inflated_bytes // chunk
    crc = 0
    for _ in range(n):
        crc = zlib.crc32(zeros, crc)
    stream = pieces[0] + pieces[1] * (n - 1) + c.flush(zlib.Z_FINISH)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    return header + stream + struct.pack("<II", crc, (n * chunk) & 0xFFFFFFFF)


def post(port: int, body: Any, headers: dict[str, str]) -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/api/v1/ingest", body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read().decode("utf-8", "replace")
    except (BrokenPipeError, ConnectionResetError) as e:
        # Refusing early (before reading a whole oversized body) may reset the connection while we
        # still send: the server refused it, which is what we test, but we have no status to show.
        return -1, {}, repr(e)
    finally:
        conn.close()


def stored(db: Path) -> int:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return sum(
            con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
            for t in ("jobs", "steps", "events", "collectives", "heartbeats", "agent_stats")
        )
    finally:
        con.close()


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[tuple[CollectorProc, Path]]:
    db = tmp_path / "collector.db"
    with CollectorProc(f"sqlite:///{db}", token=TOKEN, log_path=tmp_path / "collector.log") as c:
        c.start()
        yield c, db


def test_ingest_without_the_token_or_with_a_wrong_one_is_401_and_stores_nothing(
    guarded: tuple[CollectorProc, Path], figures: dict[str, Any]
) -> None:
    collector, db = guarded
    wrong = [
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer "},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"Authorization": f"Bearer {TOKEN.upper()}"},
    ]
    statuses = [post(collector.port, BODY, {"Content-Type": "application/json", **h})[0] for h in wrong]
    assert statuses == [401] * len(wrong)
    assert stored(db) == 0
    ok = post(collector.port, BODY, {"Authorization": f"Bearer {TOKEN}"})
    assert ok[0] == 200 and stored(db) > 0
    figures["auth"] = {"wrong_or_missing_tokens_tried": len(wrong), "all_401": True, "rows_stored_by_them": 0}


def test_the_token_is_compared_with_hmac_compare_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return original(a, b)

    monkeypatch.setattr(ingest_route.hmac, "compare_digest", spy)
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 'c.db'}", token=TOKEN))
    with TestClient(app) as client:
        assert (
            client.post("/api/v1/ingest", content=BODY, headers={"Authorization": "Bearer nope"}).status_code
            == 401
        )
        r = client.post("/api/v1/ingest", content=BODY, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
    assert calls == [(b"nope", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]


def test_an_oversized_body_and_a_gzip_bomb_get_413_and_the_collector_memory_stays_bounded(
    tmp_path: Path, figures: dict[str, Any]
) -> None:
    db = tmp_path / "collector.db"
    with CollectorProc(f"sqlite:///{db}", log_path=tmp_path / "collector.log") as collector:
        collector.start()
        assert post(collector.port, BODY, {})[0] == 200  # warm: imports, pools, first commit
        rows = stored(db)
        rss_before = collector.rss_kb("VmRSS")
        big = b"[" + b" " * (17 * 2**20) + b"]"  # over the 16 MiB default, declared by Content-Length
        declared = post(collector.port, big, {"Content-Type": "application/json"})

        def chunks() -> Iterator[bytes]:
            for _ in range(20):  # 20 MiB, chunked: no Content-Length to refuse up front
                yield b" " * 2**20

        streamed = post(collector.port, chunks(), {"Transfer-Encoding": "chunked"})
        bomb = gzip_bomb(2**30)
        bombed = post(collector.port, bomb, {"Content-Encoding": "gzip", "Content-Type": "application/json"})
        peak_kb = collector.rss_kb("VmHWM")
        rss_after = collector.rss_kb("VmRSS")
        assert collector.healthy()
        assert stored(db) == rows

    figures["body_limits"] = {
        "oversized_declared_status": declared[0],
        "oversized_chunked_status": streamed[0],
        "gzip_bomb_compressed_bytes": len(bomb),
        "gzip_bomb_inflated_bytes": 2**30,
        "gzip_bomb_status": bombed[0],
        "collector_rss_before_mb": round(rss_before / 1024, 1),
        "collector_rss_peak_mb": round(peak_kb / 1024, 1),
        "collector_rss_after_mb": round(rss_after / 1024, 1),
    }
    assert declared[0] == 413 and "limit" in declared[2]
    assert streamed[0] in (413, -1), streamed
    assert bombed[0] == 413 and "decompressed" in bombed[2], bombed
    # Inflating stops at the 64 MiB decompressed limit: the peak stays far below the bomb's 1 GiB.
    assert (peak_kb - rss_before) / 1024 < 300, figures["body_limits"]
