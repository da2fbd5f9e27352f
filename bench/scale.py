"""How ddpscope's costs grow with buckets and ranks, so users can plan for their scale.

Records come from the synthetic job generator (``tests/support/synth.py``: valid wire records with a
physical timing model) and go over HTTP encoded exactly as the agent sends them (``agent.transport``: the
steps of each stream in one ``step_block``, gzip when it halves the body), to a live collector
(``ddpscope serve`` on SQLite, started here and killed by pid).

* Buckets (8 ranks; 10, 100, 1 000 buckets): one step record's size (the agent's JSON with packed arrays, gzip alone and
  within a 100-record batch) and the collector's ingest cost: step records/s through the API and the
  collector process's CPU µs per record.
* Ranks (8, 64, 256, 1 024 simulated ranks, 50 buckets, posting step and heartbeat records for one
  job, in time-ordered requests of 500 records): ingest rate, then the
  latency of the analysis queries at that scale (stragglers, incidents = the cross-rank diagnosis,
  the step timeline), median of 3 calls (1 with ``--quick``).

    .venv/bin/python -m bench.scale [--quick]

Writes bench/results/scale.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from bench.common import machine, machine_line, write_result
from ddpscope.agent.transport import batch_body, encode_record, encode_records, is_gzip

logger = logging.getLogger(__name__)

RANK_BATCH = 500
"""Records per request in the ranks sweep."""
MAX_BATCH_BYTES = 4 * 1024 * 1024


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _post(url: str, records: list[dict[str, Any]]) -> None:
    body = batch_body([encode_records(records)[0]])  # exactly what the agent sends: steps in blocks
    headers = {"Content-Type": "application/json"}
    if is_gzip(body):
        headers["Content-Encoding"] = "gzip"
    req = urllib.request.Request(f"{url}/api/v1/ingest", data=body, headers=headers)
    for _ in range(20):
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()
                return
        except urllib.error.HTTPError as e:
            if e.code != 429:
                raise RuntimeError(f"ingest refused: {e.code} {e.read()[:300]!r}") from None
            time.sleep(0.2)
    raise RuntimeError("ingest: collector busy 20 times in a row")


def _batches(records: list[dict[str, Any]], per: int) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    cur: list[dict[str, Any]] = []
    size = 0
    for r in records:
        n = len(json.dumps(r))
        if cur and (len(cur) >= per or size + n > MAX_BATCH_BYTES):
            out.append(cur)
            cur, size = [], 0
        cur.append(r)
        size += n
    return out + ([cur] if cur else [])


def _ingest(url: str, pid: int, requests: list[list[dict[str, Any]]]) -> dict[str, float]:
    steps = sum(1 for b in requests for r in b if r["kind"] == "step")
    total = sum(len(b) for b in requests)
    cpu0, t0 = _proc_cpu_s(pid), time.perf_counter()
    for b in requests:
        _post(url, b)
    wall, cpu = time.perf_counter() - t0, _proc_cpu_s(pid) - cpu0
    return {
        "records": total,
        "step_records": steps,
        "requests": len(requests),
        "seconds": round(wall, 3),
        "records_per_s": total / wall,
        "step_records_per_s": steps / wall,
        "us_per_record": wall / total * 1e6,
        "collector_cpu_us_per_record": cpu / total * 1e6,
    }


def bucket_sweep(url: str, pid: int, quick: bool) -> list[dict[str, Any]]:
    from tests.support.synth import synth_job

    out = []
    for buckets in (10, 100, 1000):
        steps = (40 if quick else 200) if buckets < 1000 else (10 if quick else 50)
        recs = synth_job(8, steps, buckets, job=f"scale-buckets-{buckets}", collectives=False)
        step = next(r for r in recs if r["kind"] == "step")
        step_recs = [r for r in recs if r["kind"] == "step"][:100]
        one = encode_record(step)  # as the agent sends it: bucket arrays packed
        batch = b'{"schema":1,"records":[%s]}' % b",".join(encode_record(r) for r in step_recs)
        row: dict[str, Any] = {
            "buckets": buckets,
            "ranks": 8,
            "steps": steps,
            "json_bytes": len(one),
            "json_bytes_with_array_lists": len(json.dumps(step, separators=(",", ":"))),
            "gzip_bytes": len(gzip.compress(one)),
            "gzip_bytes_per_record_in_batch_of_100": len(gzip.compress(batch)) // len(step_recs),
        }
        row.update(_ingest(url, pid, _batches(recs, 500)))
        out.append(row)
        print(
            f"  {buckets:>5} buckets: step record {row['json_bytes']:,} B JSON, {row['gzip_bytes']:,} B gzip "
            f"({row['gzip_bytes_per_record_in_batch_of_100']:,} B in a batch); ingest "
            f"{row['step_records_per_s']:,.0f} step records/s, {row['us_per_record']:.0f} µs/record wall, "
            f"{row['collector_cpu_us_per_record']:.0f} µs/record collector CPU",
            flush=True,
        )
    return out


def _query_ms(url: str, path: str, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url + path, timeout=300) as resp:
            resp.read()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rank_sweep(url: str, pid: int, quick: bool) -> list[dict[str, Any]]:
    from tests.support.synth import synth_job

    out = []
    plan = {8: 40, 64: 20, 256: 10, 1024: 10} if quick else {8: 200, 64: 100, 256: 50, 1024: 30}
    for ranks, steps in plan.items():
        job = f"scale-ranks-{ranks}"
        recs = synth_job(ranks, steps, 50, job=job, slow_rank=ranks - 1, collectives=False, finished=False)
        # Time-ordered batches of RANK_BATCH records from all ranks: the collector's cost per record
        # at this scale; per-request overhead (one small request per rank's agent) comes on top.
        requests = _batches(recs, RANK_BATCH)
        row: dict[str, Any] = {"ranks": ranks, "steps": steps, "buckets": 50}
        row.update(_ingest(url, pid, requests))
        base = f"/api/v1/jobs/{job}"
        calls = 1 if quick else 3  # at 1 024 ranks one stragglers call takes seconds on this machine
        row["queries_ms"] = {
            name: _query_ms(url, f"{base}/{name}", calls) for name in ("stragglers", "incidents", "timeline")
        }
        row["query_calls"] = calls
        out.append(row)
        q = ", ".join(f"{k} {v:.0f} ms" for k, v in row["queries_ms"].items())
        print(
            f"  {ranks:>5} ranks x {steps} steps: {row['requests']} requests, {row['records_per_s']:,.0f} records/s "
            f"({row['collector_cpu_us_per_record']:.0f} µs collector CPU/record); queries: {q}",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps per configuration")
    args = parser.parse_args(argv)

    from tests.support.collector_proc import CollectorProc

    m = machine()
    print(machine_line(m), flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, CollectorProc(f"sqlite:///{tmp}/scale.db") as collector:
        url = collector.start()
        assert collector.pid is not None
        print("step records as buckets grow (8 ranks):")
        buckets = bucket_sweep(url, collector.pid, args.quick)
        print("one job as ranks grow (50 buckets):")
        ranks = rank_sweep(url, collector.pid, args.quick)
    m_after = machine()
    result = {
        "quick": args.quick,
        "machine": m,
        "load_average_after": m_after["load_average"],
        "database": "sqlite",
        "buckets": buckets,
        "ranks": ranks,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(f"load average after: {m_after['load_average']}; wall {result['wall_s']} s")
    print(f"wrote {write_result('scale', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
