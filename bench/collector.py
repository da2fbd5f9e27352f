"""Collector throughput and query latency, measured side by side in one run.

1. **Raw ceiling**: the exact rows the collector stores for 50-bucket step records (``rows.block_rows``
   of the decoded batches, built before the clock starts), inserted with plain ``sqlite3.executemany``
   into the same table and indexes, same pragmas, 1000 rows per transaction, SQLite's own checkpoints.
2. **End-to-end ingest** over HTTP: ``ddpscope serve`` in its own process, fresh SQLite file (and then
   a fresh, durable PostgreSQL 15); simulated ranks in client processes POST batches of 1000 step
   records, encoded as the agent's shipper does (``encode_records``: one ``step_block``; ``batch_body``:
   not gzipped, as gzip would not halve it); timed from
   the first request to the last 200 (i.e. committed). SQLite: ``--rounds`` rounds of 1 then 2, and the
   median of the rounds' ratios (the machine is too noisy for one pair).
3. **Query latency**: a collector on a database of 1 M step records (``--quick``: 100 k), p95 over
   HTTP of ``timeline?step=S``, ``steps?start=S&end=S+49`` (50 steps x all ranks) and ``stragglers``
   (last 20 steps); ``stalls`` (last 200 steps) beside them, with no target of its own.

Targets on the 2-core machine: ingest >= 0.8 x the raw ceiling and >= 20 000 step records/s; p95 <= 50 ms.
Prints the machine; writes bench/results/collector.json.

    .venv/bin/python -m bench.collector [--quick]
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine

from bench.common import machine
from ddpscope.agent.transport import batch_body, encode_records, is_gzip
from ddpscope.server import schema
from ddpscope.server.body import decode_content
from ddpscope.server.codec import STRUCTS, decode_batch, kind_of
from ddpscope.server.rows import STEP_COLUMNS, block_rows, step_row
from ddpscope.server.storage import Storage
from tests.server.live import live_collector
from tests.support import postgres

RESULTS = Path(__file__).parent / "results" / "collector.json"
BUCKETS = 50
BATCH = 1000
T0 = 1_700_000_000_000_000_000


def step_record(job: str, rank: int, step: int, rng: random.Random) -> dict[str, Any]:
    t = T0 + step * 50_000_000
    fe = t + 10_000_000 + rng.randint(0, 1_000_000)
    ready = [fe + (i + 1) * 400_000 + rng.randint(0, 50_000) for i in range(BUCKETS)]
    ends = [x + 300_000 for x in ready]
    return {
        "kind": "step", "job": job, "rank": rank, "stream": f"{job}-{rank}", "seq": step, "time_ns": ends[-1],
        "step": step, "synced": True, "forward_start_ns": t, "forward_end_ns": fe, "backward_start_ns": fe,
        "backward_end_ns": ends[-1] + 100_000, "bucket_ready_ns": ready, "allreduce_start_ns": ready,
        "allreduce_end_ns": ends, "bucket_bytes": [1 << 20] * BUCKETS, "ready_order": list(range(BUCKETS)),
        "unused_parameters": [], "collective_seqs": list(range(step * BUCKETS + 1, step * BUCKETS + BUCKETS + 1)),
    }  # fmt: skip


def bodies(job: str, ranks: int, batches_per_rank: int) -> list[list[bytes]]:
    """Per rank, batches of BATCH step records encoded exactly as the agent's shipper sends them (one
    ``step_block`` per batch: ``agent.transport.encode_records`` and ``batch_body``)."""
    rng = random.Random(0)
    out = []
    for rank in range(ranks):
        mine = []
        for b in range(batches_per_rank):
            recs = [step_record(job, rank, b * BATCH + i, rng) for i in range(BATCH)]
            mine.append(batch_body([encode_records(recs)[0]]))
        out.append(mine)
    return out


# -- 1. raw ceiling --------------------------------------------------------------------------------
def raw_ceiling(all_bodies: list[list[bytes]], workdir: Path) -> float:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "raw.db"
    schema.metadata.create_all(create_engine(f"sqlite:///{path}"))  # the same table and indexes
    rows = [
        [
            row
            for r in decode_batch(decode_content(body, "gzip" if is_gzip(body) else None, 1 << 30))
            for row in (block_rows(1, r) if kind_of(r) == "step_block" else [step_row(1, r)])
        ]
        for per_rank in all_bodies
        for body in per_rank
    ]
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA cache_size=-65536")  # the collector's pragmas (server/engines.py), for fairness
    sql = f"INSERT INTO steps ({', '.join(STEP_COLUMNS)}) VALUES ({', '.join('?' * len(STEP_COLUMNS))}) ON CONFLICT DO NOTHING"
    n = sum(len(b) for b in rows)
    start = time.perf_counter()
    for batch_rows in rows:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(sql, batch_rows)
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - start
    conn.close()
    return n / elapsed


# -- 2. HTTP ingest --------------------------------------------------------------------------------
def _client(args: tuple[int, list[bytes]]) -> tuple[int, list[float]]:
    port, mine = args
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    latencies = []
    for body in mine:
        headers = {"Content-Type": "application/json"}
        if is_gzip(body):  # the agent compresses when it pays (agent.transport.batch_body)
            headers["Content-Encoding"] = "gzip"
        while True:
            t = time.perf_counter()
            conn.request("POST", "/api/v1/ingest", body=body, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
            if resp.status == 429:
                time.sleep(float(resp.getheader("Retry-After", "1")) / 10)
                continue
            if resp.status != 200:
                raise RuntimeError(f"ingest failed: {resp.status} {payload[:300]!r}")
            latencies.append(time.perf_counter() - t)
            break
    conn.close()
    return len(mine) * BATCH, latencies


def http_ingest(db_url: str, all_bodies: list[list[bytes]]) -> dict[str, float]:
    with live_collector(db_url) as url:
        port = int(url.rsplit(":", 1)[1])
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(len(all_bodies)) as pool:
            start = time.perf_counter()
            results = pool.map(_client, [(port, mine) for mine in all_bodies])
            elapsed = time.perf_counter() - start
    n = sum(r[0] for r in results)
    lat = sorted(x for r in results for x in r[1])
    return {
        "records": n,
        "seconds": elapsed,
        "records_per_s": n / elapsed,
        "batch_p95_ms": lat[int(0.95 * (len(lat) - 1))] * 1e3,
    }


# -- 3. queries ------------------------------------------------------------------------------------
def populate(db_url: str, job: str, ranks: int, steps: int) -> None:
    """Fill through the storage layer (no HTTP) with the same kind of step records."""
    storage = Storage.open(db_url)
    step_struct = STRUCTS["step"]
    rng = random.Random(1)
    try:
        chunk = max(1, 5000 // ranks)
        for s0 in range(0, steps, chunk):
            batch = [
                step_struct(**{k: v for k, v in step_record(job, rank, s, rng).items() if k != "kind"})
                for s in range(s0, min(steps, s0 + chunk))
                for rank in range(ranks)
            ]
            storage.write_batch(batch)
    finally:
        storage.close()


def query_latency(db_url: str, job: str, steps: int, repeats: int) -> dict[str, dict[str, float]]:
    rng = random.Random(2)
    out: dict[str, dict[str, float]] = {}
    with live_collector(db_url) as url:
        port = int(url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        queries = {
            "timeline": lambda: f"/api/v1/jobs/{job}/timeline?step={rng.randrange(steps)}",
            "steps": lambda: (lambda s: f"/api/v1/jobs/{job}/steps?start={s}&end={s + 49}")(
                rng.randrange(steps - 50)
            ),
            "stragglers": lambda: f"/api/v1/jobs/{job}/stragglers",
            # Ten times the steps /stragglers reads (200 against 20): no target of its own, measured beside.
            "stalls": lambda: f"/api/v1/jobs/{job}/stalls",
        }
        for name, make in queries.items():
            times = []
            for i in range(repeats + 3):
                t = time.perf_counter()
                conn.request("GET", make())
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{name}: HTTP {resp.status}")
                if i >= 3:  # warm-up requests excluded
                    times.append(time.perf_counter() - t)
            times.sort()
            out[name] = {
                "p50_ms": statistics.median(times) * 1e3,
                "p95_ms": times[int(0.95 * (len(times) - 1))] * 1e3,
            }
        conn.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller runs (under 2 minutes)")
    p.add_argument("--ranks", type=int, default=4, help="concurrent simulated ranks sending")
    p.add_argument("--no-postgres", action="store_true")
    p.add_argument("--rounds", type=int, default=3, help="rounds of raw ceiling + HTTP ingest (SQLite)")
    p.add_argument("--ingest-only", action="store_true", help="skip the query-latency part")
    args = p.parse_args(argv)
    batches = 6 if args.quick else 15
    query_ranks, query_steps = (16, 6_250) if args.quick else (16, 62_500)
    result: dict[str, Any] = {"machine": {**machine(), "sqlite": sqlite3.sqlite_version}, "quick": args.quick}
    print("machine:", json.dumps(result["machine"]))
    all_bodies = bodies("bench", args.ranks, batches)
    with tempfile.TemporaryDirectory(prefix="ddpscope-bench-") as tmp:
        work = Path(tmp)
        # The machine is shared and noisy (the same raw insert varies by +-25 % from one second to the
        # next): rounds of the ceiling and then the collector, each round's ratio, the median of those.
        rounds = []
        for i in range(args.rounds):
            raw = raw_ceiling(all_bodies, work / f"raw{i}")
            sq = http_ingest(f"sqlite:///{work / f'ingest{i}.db'}", all_bodies)
            rounds.append((raw, sq, sq["records_per_s"] / raw))
            print(
                f"round {i + 1}: raw sqlite3.executemany {raw:,.0f} step records/s; "
                f"HTTP ingest, SQLite {sq['records_per_s']:,.0f} records/s ({sq['records_per_s'] / raw:.2f}x raw)"
            )
        ceiling = statistics.median(r[0] for r in rounds)
        ratios = sorted(r[2] for r in rounds)
        sq = sorted((r[1] for r in rounds), key=lambda x: x["records_per_s"])[len(rounds) // 2]
        sq["ratio_to_raw"] = statistics.median(ratios)
        sq["ratio_to_raw_per_round"] = ratios
        result["ingest"] = {"raw_sqlite_executemany_records_per_s": ceiling, "sqlite": sq}
        print(f"raw sqlite3.executemany ceiling (median): {ceiling:,.0f} step records/s")
        print(
            f"HTTP ingest, SQLite (median): {sq['records_per_s']:,.0f} records/s; median of the rounds' ratios "
            f"{sq['ratio_to_raw']:.2f}x raw (rounds {', '.join(f'{x:.2f}' for x in ratios)})"
        )
        if not args.no_postgres and postgres.available():
            with postgres.running_postgres(durable=True) as pg:
                pq = http_ingest(pg.create_database("bench"), all_bodies)
            result["ingest"]["postgresql"] = pq
            pq["ratio_to_raw"] = pq["records_per_s"] / ceiling
            print(
                f"HTTP ingest, PostgreSQL: {pq['records_per_s']:,.0f} records/s ({pq['ratio_to_raw']:.2f}x raw sqlite)"
            )
        if args.ingest_only:
            return 0
        qdb = f"sqlite:///{work / 'query.db'}"
        t = time.perf_counter()
        populate(qdb, "big", query_ranks, query_steps)
        n = query_ranks * query_steps
        print(
            f"query database: {n:,} step records ({query_ranks} ranks) filled in {time.perf_counter() - t:.0f} s"
        )
        lat = query_latency(qdb, "big", query_steps, repeats=40)
        result["queries"] = {"step_records": n, "ranks": query_ranks, **lat}
        for name, v in lat.items():
            print(f"  {name:<11} p50 {v['p50_ms']:6.1f} ms   p95 {v['p95_ms']:6.1f} ms")
    result["targets"] = {"ratio_to_raw": 0.8, "records_per_s": 20_000, "query_p95_ms": 50}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
