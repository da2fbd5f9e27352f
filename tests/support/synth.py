"""Synthetic wire records of a DDP job: valid against ``ddpscope.agent.records``, with a simple but
physical timing model, for tests and benchmarks that need a job without running one.

Model per step: ranks start together (the previous step's all-reduces synchronised them); forward then
backward compute, scaled by ``slowdown`` on ``slow_rank``; buckets become ready in index order through
backward; each all-reduce launches when its bucket is ready and the previous one has launched, and
ends ``comm_ns`` after the last rank launched it (and after the previous all-reduce ended). Jitter is
seeded, so a given call always returns the same records.

``synth_job(...)`` returns every record of the job (rank_start, layout, steps, collectives and their
ends, heartbeats, agent_stats and, when ``finished``, rank_exit) ordered by time. ``batch(records)``
wraps records into a wire batch.
"""

from __future__ import annotations

import random
from typing import Any

T0_NS = 1_700_000_000_000_000_000


def _env(job: str, rank: int, seqs: dict[int, int], kind: str, time_ns: int) -> dict[str, Any]:
    seq = seqs.get(rank, 0)
    seqs[rank] = seq + 1
    return {
        "kind": kind,
        "job": job,
        "rank": rank,
        "stream": f"{job}-r{rank}",
        "seq": seq,
        "time_ns": time_ns,
    }


def rank_start(
    job: str, rank: int, world_size: int, seqs: dict[int, int], t: int, find_unused: bool
) -> dict[str, Any]:
    return {
        **_env(job, rank, seqs, "rank_start", t),
        "world_size": world_size,
        "backend": "gloo",
        "device": "cpu",
        "host": "synth",
        "pid": 1000 + rank,
        "engine": "ddpscope",
        "torch_version": "2.13.0",
        "ddpscope_version": "0.1.0",
        "python_version": "3.11",
        "find_unused_parameters": find_unused,
        "bucket_cap_mb": 25.0,
        "clock_offset_ns": 0,
        "clock_error_ns": 5000,
    }


def layout(
    job: str, rank: int, seqs: dict[int, int], t: int, buckets: int, bucket_bytes: int
) -> dict[str, Any]:
    return {
        **_env(job, rank, seqs, "layout", t),
        "step": 0,
        "reason": "initial",
        "buckets": [
            {
                "index": i,
                "bytes": bucket_bytes,
                "dtype": "float32",
                "device": "cpu",
                "parameters": [f"layers.{buckets - 1 - i}.weight", f"layers.{buckets - 1 - i}.bias"],
            }
            for i in range(buckets)
        ],
    }


def synth_job(
    world_size: int = 2,
    steps: int = 10,
    buckets: int = 4,
    *,
    job: str = "synth",
    slow_rank: int | None = None,
    slowdown: float = 1.5,
    jitter: float = 0.05,
    forward_ns: int = 10_000_000,
    backward_ns: int = 20_000_000,
    comm_ns: int = 3_000_000,
    bucket_bytes: int = 4 * 1024 * 1024,
    unused: dict[int, list[str]] | None = None,
    find_unused: bool = False,
    collectives: bool = True,
    finished: bool = True,
    seed: int = 0,
    t0_ns: int = T0_NS,
) -> list[dict[str, Any]]:
    """Records of a ``world_size``-rank job of ``steps`` steps with ``buckets`` buckets each.

    ``unused`` maps rank -> parameter names that get no gradient on that rank in every step.
    """
    rng = random.Random(seed)
    seqs: dict[int, int] = {}
    coll_seq = 0
    out: list[dict[str, Any]] = []
    for rank in range(world_size):
        out.append(rank_start(job, rank, world_size, seqs, t0_ns, find_unused))
        out.append(layout(job, rank, seqs, t0_ns + 1000, buckets, bucket_bytes))
    t = t0_ns + 1_000_000
    for step in range(steps):
        scale = {
            r: (slowdown if r == slow_rank else 1.0) * (1 + rng.uniform(-jitter, jitter))
            for r in range(world_size)
        }
        fwd_end = {r: t + int(forward_ns * scale[r]) for r in range(world_size)}
        ready = {
            r: [fwd_end[r] + int(backward_ns * scale[r] * (i + 1) / buckets) for i in range(buckets)]
            for r in range(world_size)
        }
        launch = {r: list(ready[r]) for r in range(world_size)}
        ends: list[int] = []
        for i in range(buckets):
            last_launch = max(launch[r][i] for r in range(world_size))
            ends.append(max(last_launch, ends[-1] if ends else 0) + comm_ns)
        step_end = ends[-1] + 200_000
        for r in range(world_size):
            seqs_of_step = list(range(coll_seq + 1, coll_seq + 1 + buckets))
            if collectives:
                for i, cs in enumerate(seqs_of_step):
                    out.append(
                        {
                            **_env(job, r, seqs, "collective", launch[r][i]),
                            "pg": "default",
                            "coll_seq": cs,
                            "op": "all_reduce",
                            "reduce_op": "SUM",
                            "shapes": [[bucket_bytes // 4]],
                            "dtypes": ["float32"],
                            "call_site": None,
                            "start_ns": launch[r][i],
                            "step": step,
                            "source": "engine",
                        }
                    )
                    out.append(
                        {
                            **_env(job, r, seqs, "collective_end", ends[i]),
                            "pg": "default",
                            "coll_seq": cs,
                            "end_ns": ends[i],
                            "ok": True,
                        }
                    )
            out.append(
                {
                    **_env(job, r, seqs, "step", step_end),
                    "step": step,
                    "synced": True,
                    "forward_start_ns": t,
                    "forward_end_ns": fwd_end[r],
                    "backward_start_ns": fwd_end[r],
                    "backward_end_ns": step_end,
                    "blocked_between_ns": 0,
                    "blocked_forward_ns": 0,
                    "blocked_backward_ns": 0,
                    "bucket_ready_ns": ready[r],
                    "allreduce_start_ns": launch[r],
                    "allreduce_end_ns": ends,
                    "bucket_bytes": [bucket_bytes] * buckets,
                    "ready_order": list(range(buckets)),
                    "unused_parameters": list((unused or {}).get(r, [])),
                    "collective_seqs": seqs_of_step,
                }
            )
            out.append(
                {
                    **_env(job, r, seqs, "heartbeat", step_end + 1),
                    "phase": "idle",
                    "step": step,
                    "last_coll_seq": seqs_of_step[-1],
                    "pid": 1000 + r,
                }
            )
        coll_seq += buckets
        t = step_end + 500_000
    for r in range(world_size):
        out.append(
            {**_env(job, r, seqs, "agent_stats", t), "emitted": seqs[r] + 1, "dropped": {}, "spool_bytes": 0}
        )
        if finished:
            out.append({**_env(job, r, seqs, "rank_exit", t + 1), "step": steps - 1, "reason": "finished"})
    out.sort(key=lambda r: (r["time_ns"], r["rank"], r["seq"]))
    return out


def site_profile(
    job: str, rank: int, time_ns: int, sites: list[tuple[str, str | None, int]], *, seq: int = 10_000
) -> dict[str, Any]:
    """A ``site_profile`` record of ``rank`` (after ``synth_job``'s: seq 10 000): (phase, file:line, samples)
    where its watchdog sampled it."""
    return {**_env(job, rank, {rank: seq}, "site_profile", time_ns), "step": 0, "interval_s": 5.0,
            "samples": sum(n for _, _, n in sites), "sites": [{"phase": p, "site": x, "n": n} for p, x, n in sites],
            "other": 0}  # fmt: skip


def batch(records: list[dict[str, Any]]) -> dict[str, Any]:
    return {"schema": 1, "records": records}


def by_rank(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Records grouped per rank (what each rank's agent would send), in emission order."""
    out: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(records, key=lambda r: (r["rank"], r["seq"])):
        out.setdefault(r["rank"], []).append(r)
    return out
