"""A training-like process that emits synthetic step records through the real agent.

``python emitter.py N RATE [FIRST_STEP]``: emit N step records (steps FIRST_STEP...) at about RATE
records per second, timing every ``emit()`` call, then print one JSON line
``{"emitted": N, "max_emit_ms": ..., "p99_emit_ms": ..., "stats": agent stats}`` and exit normally
(the agent flushes to its spool at exit; the shipper delivers the rest after we are gone). The agent
is configured only from the DDPSCOPE_* / RANK environment the test sets.
"""

from __future__ import annotations

import json
import os
import sys
import time

from ddpscope import agent


def step_record(step: int) -> dict[str, object]:
    t = time.time_ns()
    return {
        "kind": "step",
        "step": step,
        "synced": True,
        "forward_start_ns": t - 3_000_000,
        "forward_end_ns": t - 2_000_000,
        "backward_start_ns": t - 2_000_000,
        "backward_end_ns": t,
        "bucket_ready_ns": [t - 1_500_000, t - 1_000_000],
        "allreduce_start_ns": [t - 1_500_000, t - 1_000_000],
        "allreduce_end_ns": [t - 500_000, t - 100_000],
        "bucket_bytes": [4096, 4096],
        "ready_order": [0, 1],
        "unused_parameters": [],
        "collective_seqs": [2 * step + 1, 2 * step + 2],
    }


def main(n: int, rate: float, first: int) -> None:
    durations: list[int] = []
    start = time.monotonic()
    for i in range(n):
        record = step_record(first + i)
        t0 = time.perf_counter_ns()
        agent.emit(record)
        durations.append(time.perf_counter_ns() - t0)
        # Hold the rate on a schedule (not a fixed sleep), so slow iterations do not add up.
        ahead = start + (i + 1) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
    durations.sort()
    out = {
        "pid": os.getpid(),
        "emitted": n,
        "max_emit_ms": durations[-1] / 1e6,
        "p99_emit_ms": durations[int(len(durations) * 0.99)] / 1e6,
        "stats": agent.get_agent().stats(),
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
