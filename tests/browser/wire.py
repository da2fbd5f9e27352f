"""Synthetic wire records (the real format of ``ddpscope.agent.records``) for driving a real collector.

``SynthJob`` plays the agents of every rank of one job: it keeps each rank's stream and sequence
numbers, so a test can post steps a few at a time (a job that is still running) and the collector
sees one continuous stream per rank. Every record it builds passes ``validate_record``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

from ddpscope.agent.records import SCHEMA_VERSION, validate_record

MS = 1_000_000


class SynthJob:
    """Records of one DDP job with ``world_size`` ranks and ``buckets`` buckets per step."""

    def __init__(
        self,
        job: str,
        *,
        world_size: int,
        buckets: int,
        slow_rank: int | None = None,
        stall: tuple[int, int] | None = None,
        params_per_bucket: int = 2,
        param_name: str = "layers.{bucket}.p{i}",
    ) -> None:
        self.job = job
        self.world_size = world_size
        self.buckets = buckets
        self.slow_rank = slow_rank
        self.stall = stall
        """(rank, every): that rank computes 8 times longer in every ``every``-th step (a stall now and then)."""
        self.seq = [0] * world_size
        self.next_step = 0
        # Start a little in the past so the whole job lands before "now" and looks live.
        self.clock_ns = time.time_ns() - 5_000 * MS
        self.parameters = [
            [param_name.format(bucket=b, i=i) for i in range(params_per_bucket)] for b in range(buckets)
        ]
        self.bucket_bytes = [4096 * (b + 1) for b in range(buckets)]

    def _record(self, kind: str, rank: int, time_ns: int, **fields: Any) -> dict[str, Any]:
        rec = {"kind": kind, "job": self.job, "rank": rank, "stream": f"synth-{rank}", "seq": self.seq[rank],
               "time_ns": time_ns, **fields}  # fmt: skip
        self.seq[rank] += 1
        validate_record(rec)
        return rec

    def site_profile(self, rank: int, sites: list[tuple[str, str, int]]) -> dict[str, Any]:
        """A ``site_profile`` record of ``rank`` now: (phase, file:line, samples) where its watchdog sampled it."""
        return self._record("site_profile", rank, self.clock_ns, step=0, interval_s=5.0,
                            samples=sum(n for _, _, n in sites), other=0,
                            sites=[{"phase": p, "site": site, "n": n} for p, site, n in sites])  # fmt: skip

    def memory(
        self, rank: int, samples: int, *, start_bytes: int, per_sample: int, workers_per_sample: int = 0
    ) -> list[dict[str, Any]]:
        """``samples`` memory records of ``rank`` every 30 s up to now, growing ``per_sample`` bytes each, and
        with ``workers_per_sample``, two DataLoader workers whose own memory grows that much each."""
        gib, end_ns = 2**30, self.clock_ns
        workers = (
            (lambda i: {"workers_bytes": 2**28 + i * workers_per_sample, "workers": 2})
            if workers_per_sample
            else (lambda i: {})
        )
        return [
            self._record(
                "memory",
                rank,
                end_ns - (samples - 1 - i) * 30 * 10**9,
                step=10 * i,
                rss_bytes=start_bytes + i * per_sample,
                available_bytes=20 * gib - i * per_sample,
                total_bytes=24 * gib,
                **workers(i),
            )  # fmt: skip
            for i in range(samples)
        ]

    def partial_step(self, *, launched: int, done: int) -> dict[str, Any]:
        """The next step so far, as a hang or error report carries it: every bucket ready up to
        ``launched`` (exclusive) launched, the first ``done`` of them finished."""
        t0, n = self.clock_ns, self.buckets
        return {"step": self.next_step, "synced": True, "forward_start_ns": t0, "forward_end_ns": t0 + 20 * MS,
                "backward_start_ns": t0 + 21 * MS,
                "bucket_ready_ns": [t0 + (25 + 5 * b) * MS if b < launched else 0 for b in range(n)],
                "allreduce_start_ns": [t0 + (26 + 5 * b) * MS if b < launched else 0 for b in range(n)],
                "allreduce_end_ns": [t0 + (28 + 5 * b) * MS if b < done else 0 for b in range(n)],
                "bucket_bytes": self.bucket_bytes}  # fmt: skip

    def start(self, ranks: Iterable[int] | None = None) -> list[dict[str, Any]]:
        """``rank_start`` and the initial ``layout`` of each rank."""
        out = []
        for rank in range(self.world_size) if ranks is None else ranks:
            out.append(self._record(
                "rank_start", rank, self.clock_ns, world_size=self.world_size, backend="gloo", device="cpu",
                host="synth", pid=1000 + rank, engine="ddpscope", torch_version="2.13.0", ddpscope_version="0.1.0",
                python_version="3.11", find_unused_parameters=False, bucket_cap_mb=25.0, clock_offset_ns=0,
                clock_error_ns=20_000))  # fmt: skip
            layout = [
                {
                    "index": b,
                    "bytes": self.bucket_bytes[b],
                    "dtype": "float32",
                    "device": "cpu",
                    "parameters": self.parameters[b],
                }
                for b in range(self.buckets)
            ]
            out.append(self._record("layout", rank, self.clock_ns, step=0, reason="initial", buckets=layout))
        return out

    def steps(
        self, count: int, *, ranks: Sequence[int] | None = None, unused: Sequence[str] = ()
    ) -> list[dict[str, Any]]:
        """``count`` more steps of every rank in ``ranks`` (default all), then a heartbeat each."""
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        out = []
        for _ in range(count):
            step = self.next_step
            t0 = self.clock_ns
            compute = {
                r: (1.5 if r == self.slow_rank else 1.0) + 0.02 * ((step * 7 + r * 3) % 5) for r in ranks
            }
            if (
                self.stall is not None
                and step % self.stall[1] == self.stall[1] - 1
                and self.stall[0] in compute
            ):
                compute[self.stall[0]] *= 8
            fwd_end = {r: t0 + int(20 * MS * compute[r]) for r in ranks}
            bwd_start = {r: fwd_end[r] + MS // 10 for r in ranks}
            bwd_len = {r: int(50 * MS * compute[r]) for r in ranks}
            # Buckets become ready in index order through backward, except bucket 1 and 2 swap every
            # third step (out of order: bucket 2 then waits for bucket 1 to launch).
            order = list(range(self.buckets))
            if step % 3 == 0 and self.buckets > 2:
                order[1], order[2] = order[2], order[1]
            ready = {r: [0] * self.buckets for r in ranks}
            for r in ranks:
                for pos, b in enumerate(order):
                    ready[r][b] = bwd_start[r] + bwd_len[r] * (pos + 1) // (self.buckets + 1)
            # All-reduce b starts once bucket b and all earlier ones are launched; it ends when the
            # slowest rank has joined, plus a transfer time proportional to its size.
            start = {r: [0] * self.buckets for r in ranks}
            end = [0] * self.buckets
            prev_end = 0
            for b in range(self.buckets):
                for r in ranks:
                    start[r][b] = max(ready[r][b], start[r][b - 1] if b else 0)
                joined = max(start[r][b] for r in ranks)
                end[b] = max(joined, prev_end) + MS // 10 + self.bucket_bytes[b]  # ~1 GB/s
                prev_end = end[b]
            for r in ranks:
                bwd_end = max(end[-1], ready[r][-1]) + MS // 5
                out.append(self._record(
                    "step", r, bwd_end, step=step, synced=True, forward_start_ns=t0, forward_end_ns=fwd_end[r],
                    backward_start_ns=bwd_start[r], backward_end_ns=bwd_end, bucket_ready_ns=ready[r],
                    allreduce_start_ns=start[r], allreduce_end_ns=end, bucket_bytes=self.bucket_bytes,
                    ready_order=order, unused_parameters=list(unused),
                    collective_seqs=[step * self.buckets + b + 1 for b in range(self.buckets)]))  # fmt: skip
            self.clock_ns = max(end[-1], t0) + 5 * MS
            self.next_step += 1
        for r in ranks:
            out.append(self._record("heartbeat", r, self.clock_ns, phase="forward", step=self.next_step,
                                    last_coll_seq=self.next_step * self.buckets, pid=1000 + r))  # fmt: skip
        return out


def post(base_url: str, records: Sequence[dict[str, Any]], chunk: int = 2000) -> None:
    """POST records to the collector's real ingest endpoint in batches; raise on any non-200 answer."""
    for i in range(0, len(records), chunk):
        body = json.dumps({"schema": SCHEMA_VERSION, "records": list(records[i : i + chunk])}).encode()
        req = urllib.request.Request(
            base_url + "/api/v1/ingest",
            data=body,
            method="POST",
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            if resp.status != 200:
                raise RuntimeError(f"ingest answered {resp.status}: {resp.read()[:500]!r}")


def collectives(
    job: SynthJob, ops: dict[int, list[tuple[str, str]]], *, pg: str = "default"
) -> list[dict[str, Any]]:
    """``collective`` + ``collective_end`` records: ``ops[rank]`` is that rank's ``(op, call_site)`` list."""
    out = []
    for rank, calls in ops.items():
        for i, (op, site) in enumerate(calls):
            t = job.clock_ns + i * MS
            out.append(job._record(
                "collective", rank, t, pg=pg, coll_seq=i + 1, op=op, reduce_op="sum" if op == "all_reduce" else None,
                shapes=[[1024]], dtypes=["float32"], call_site=site, start_ns=t, step=None, source="user"))  # fmt: skip
            out.append(
                job._record(
                    "collective_end", rank, t + MS // 2, pg=pg, coll_seq=i + 1, end_ns=t + MS // 2, ok=True
                )
            )
    return out


def rank_error(job: SynthJob, rank: int, *, message: str, stack: str, step: int = 0) -> dict[str, Any]:
    """A fatal exception on ``rank``, as the engine ships it before the process dies."""
    return job._record("rank_error", rank, job.clock_ns, step=step, phase="forward", error_type="ValueError",
                       message=message, stack=stack, fatal=True)  # fmt: skip


def stopped(
    job: SynthJob,
    rank: int,
    kind: str,
    *,
    phase: str,
    step: int,
    partial: dict[str, Any] | None,
    message: str = "made no progress",
) -> dict[str, Any]:
    """A ``hang`` (kind "hang") or ``rank_error`` (kind "error") report of ``rank``, carrying the step it
    stopped in so far (``partial``, from ``SynthJob.partial_step``) or None between steps."""
    t = job.clock_ns + 2_000 * MS
    if kind == "hang":
        return job._record("hang", rank, t, phase=phase, step=step, stalled_s=2.0, pending_buckets=[], inflight=[],
                           stacks=[], message=f"rank {rank} {message}", partial_step=partial)  # fmt: skip
    return job._record("rank_error", rank, t, step=step, phase=phase, error_type="RuntimeError", message=message,
                       stack="Traceback", fatal=False, partial_step=partial)  # fmt: skip
