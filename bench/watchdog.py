"""Cost of the hang watchdog + collective recorder: per training step, and per collective.

Per step, on the engine benchmark's own workload (the target is set there): a 2-rank gloo job trains
``bench.engine``'s MLP (1.06 M parameters, batch 32, one thread per rank) with ddpscope's engine, the
same step ``bench.engine`` times. Blocks of 20 steps alternate between "on" (recorder patches
installed, engine collectives recorded, watchdog thread running) and "off" (no patches, the engine's
recorder calls made no-ops, no watchdog), the order flipping every round, until each arm has 3,000
steps (``--quick``: 400). The agent runs in both arms with an exporter that discards (its transport is
measured by its own bench) but keeps the real write-ahead ring, so a durable collective record costs
what it costs in a job; every block ends with the worker handling what the block emitted
(``flush_local``), so its CPU counts in the arm that caused it. Per arm: the median step's wall time,
the training thread's CPU time per step, and the whole process's CPU per step (training, gloo, agent
and watchdog threads). A second A/B adds a
user ``all_reduce`` of the loss each step, as training loops do for logging (one more collective
recorded a step; not the target's workload).

Per collective: the wrapper the recorder puts around ``torch.distributed.all_reduce``, timed around a
Python function of the same signature that does nothing (so gloo's latency noise is not in the
figure), and the real small all-reduce patched vs unpatched on the 2-rank group, interleaved.

Target: recorder + watchdog <= 1 % of the step time on the engine benchmark: the wall-time difference
and the process CPU added, each as a share of the step. Prints the machine; writes
bench/results/watchdog.json. ``--quick`` runs in about a minute;
``--steps N`` sets the engine benchmark's steps per arm (its 95 % interval narrows as 1/sqrt(N)).

    .venv/bin/python -m bench.watchdog [--quick] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "watchdog.json"
TARGET_PCT = 1.0


class _Discard:
    """Agent exporter that drops everything: the bench measures recording, not shipping. It has the
    spool exporter's write-ahead ring, the path every durable collective record takes."""

    def __init__(self) -> None:
        import tempfile

        from ddpscope.agent.ring import WriteAheadRing

        self._dir = tempfile.TemporaryDirectory(prefix="ddpscope-bench-ring-")
        self._ring = WriteAheadRing(self._dir.name, f"r{id(self)}")
        self.write_ahead = self._ring.put
        self.write_ahead_templated = self._ring.put_templated  # the planned collectives' path

    def drop_write_ahead(self) -> None:
        """What the agent calls once everything is spooled at shutdown (here: nothing to keep)."""
        self._ring.close()

    def export(self, batch: list[dict[str, Any]]) -> Any:
        from ddpscope.agent import ExportResult

        return ExportResult.SUCCESS

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        return None


# -- the worker (one per rank) ------------------------------------------------------------------------


_ENGINE_CALLS = ("begin", "end", "begin_planned", "end_planned")


def _no_op(*args: Any, **kwargs: Any) -> int:
    return 0


class _Mode:
    """Switches the recorder and the watchdog on and off between blocks. The watchdog's heartbeats keep
    the rate of a real job (one every ``heartbeat_s`` of the time it runs): a watchdog started afresh
    heartbeats at once, which at every 20-step block would be ~9 times a job's rate."""

    def __init__(self) -> None:
        self.on_s = 0.0
        """Time the watchdog has run so far, over all "on" blocks."""
        self._since: float | None = None

    def set(self, on: bool) -> None:
        from ddpscope.ddp import collectives, watchdog
        from ddpscope.ddp.collectives import RECORDER

        if on:
            for name in _ENGINE_CALLS:
                RECORDER.__dict__.pop(name, None)
            collectives.install()
            period = watchdog.heartbeat_setting()
            watchdog.start_watchdog(first_heartbeat_s=period - self.on_s % period)
            self._since = time.monotonic()
        else:
            # Instance attributes shadow the methods: the engine's own recorder calls (its bucket
            # all-reduces are planned ones) become no-ops.
            for name in _ENGINE_CALLS:
                setattr(RECORDER, name, _no_op)
            collectives.uninstall()
            if self._since is not None:
                self.on_s += time.monotonic() - self._since
                self._since = None
            watchdog.stop_watchdog()


def _training(name: str, user_all_reduce: bool) -> tuple[Callable[[], None], str]:
    """One training step of ``bench.engine``'s model ``name`` under ddpscope's engine (torch's DDP if
    the engine cannot be built), the same step the engine benchmark times; ``user_all_reduce`` adds
    an all-reduce of the loss, as training loops do for logging (one more recorded collective)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from bench.engine import _models, train_step

    factory, batch = _models()[name]
    torch.manual_seed(0)
    module = factory()
    try:
        from ddpscope.ddp import DistributedDataParallel

        model: Any = DistributedDataParallel(module)
        engine = "ddpscope"
    except Exception as exc:  # the engine is optional for this bench
        print(f"ddpscope engine unavailable ({type(exc).__name__}: {exc}); using torch DDP", file=sys.stderr)
        model, engine = nn.parallel.DistributedDataParallel(module), "torch"
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        x, y = batch(gen)
        loss = train_step(model, opt, loss_fn, x, y)
        if user_all_reduce:
            dist.all_reduce(loss.detach())

    return step, engine


def _step_bench(name: str, steps_per_arm: int, block: int, user_all_reduce: bool) -> dict[str, Any]:
    """Blocks of ``block`` steps alternate "on" and "off" (the order flips every round, so a drift of
    the machine falls on both arms alike) until each arm has ``steps_per_arm`` steps. Per step: wall
    time and the training thread's CPU time; per block: the whole process's CPU time (training, gloo,
    agent and watchdog threads). Each arm's figure is the median over its steps (blocks)."""
    import torch.distributed as dist

    from bench.common import median_interval
    from ddpscope.agent import get_agent
    from ddpscope.ddp.collectives import RECORDER

    flush_local = get_agent().flush_local

    def numbered() -> int:  # collectives numbered so far, every group
        return sum(RECORDER.last_seq(pg) for pg in list(RECORDER._counters))

    step, engine = _training(name, user_all_reduce)
    mode = _Mode()
    mode.set(True)
    for _ in range(20):  # warm-up, and the engine's bucket rebuild
        step()
    mode.set(False)
    for _ in range(5):
        step()
    dist.barrier()
    wall: dict[bool, list[float]] = {True: [], False: []}
    thread_cpu: dict[bool, list[float]] = {True: [], False: []}
    process_cpu: dict[bool, list[float]] = {True: [], False: []}
    pair_ratios: list[float] = []
    recorded = 0
    for r in range(max(1, steps_per_arm // block)):
        block_medians: dict[bool, float] = {}
        for on in (True, False) if r % 2 == 0 else (False, True):
            mode.set(on)
            before = numbered()
            times = []
            p0 = time.process_time_ns()
            for _ in range(block):
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                step()
                thread_cpu[on].append((time.thread_time_ns() - c0) / 1e3)
                times.append((time.perf_counter_ns() - t0) / 1e3)
            # The agent's worker handles this block's records now, inside this block's process CPU: left
            # to its next round (every 0.25 s, about a block), it would run in the other arm's block.
            flush_local()
            process_cpu[on].append((time.process_time_ns() - p0) / block / 1e3)
            wall[on].extend(times)
            block_medians[on] = statistics.median(times)
            if on:
                recorded += numbered() - before
        pair_ratios.append(block_medians[True] / block_medians[False])
    mode.set(False)
    med = {k: {on: statistics.median(v[on]) for on in (True, False)} for k, v in
           (("wall", wall), ("thread", thread_cpu), ("process", process_cpu))}  # fmt: skip
    step_us = med["wall"][False]
    quartiles = statistics.quantiles(pair_ratios, n=4) if len(pair_ratios) >= 2 else [pair_ratios[0]] * 3
    return {
        "model": name,
        "engine": engine,
        "user_all_reduce": user_all_reduce,
        "steps_per_arm": len(wall[True]),
        "block": block,
        "step_us_off": step_us,
        "step_us_on": med["wall"][True],
        "overhead_pct": (med["wall"][True] / step_us - 1) * 100,
        "block_pair_overhead_pct_iqr": [(quartiles[0] - 1) * 100, (quartiles[2] - 1) * 100],
        "block_pair_overhead_pct_median_ci95": [(r - 1) * 100 for r in median_interval(pair_ratios)],
        "thread_cpu_us_off": med["thread"][False],
        "thread_cpu_added_us": med["thread"][True] - med["thread"][False],
        "process_cpu_us_off": med["process"][False],
        "process_cpu_added_us": med["process"][True] - med["process"][False],
        "collectives_recorded_per_step": recorded / max(1, len(wall[True])),
    }


def _switches() -> dict[str, int]:
    """Voluntary context switches (sleeps, i.e. wake-ups) of each named thread of this process."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                line = next(ln for ln in f if ln.startswith("voluntary_ctxt_switches"))
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except (OSError, StopIteration):
            continue  # the thread ended meanwhile
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0) + int(line.split()[1])
    return out


def _wakeups_bench(steps: int) -> dict[str, Any]:
    """Wake-ups per second of each thread while training with everything on (gloo's own threads
    included, for scale): the agent's and the watchdog's should be a handful. A step count, not a
    duration: every rank must issue the same collectives."""
    step, _ = _training("mlp", user_all_reduce=True)
    mode = _Mode()
    mode.set(True)
    before, t0 = _switches(), time.monotonic()
    for _ in range(steps):
        step()
    after, elapsed = _switches(), time.monotonic() - t0
    mode.set(False)
    return {"wakeups_per_s": {k: round((v - before.get(k, 0)) / elapsed, 1) for k, v in after.items()}}


def _wrapper_bench(calls: int) -> dict[str, Any]:
    """The recorder's own cost per user collective, without gloo's latency noise."""
    import torch

    from ddpscope.ddp import _patch
    from ddpscope.ddp.collectives import RECORDER

    def fake_all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    wrapped = _patch._make_wrapper(RECORDER, "all_reduce", _patch.OPS["all_reduce"], fake_all_reduce)
    t = torch.ones(1024)
    bare, rec = [], []
    for _ in range(10):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fake_all_reduce(t)
        t1 = time.perf_counter_ns()
        for _ in range(calls):
            wrapped(t)
        t2 = time.perf_counter_ns()
        bare.append((t1 - t0) / calls)
        rec.append((t2 - t1) / calls)
    return {
        "wrapper_ns": statistics.median(rec) - statistics.median(bare),
        "bare_call_ns": statistics.median(bare),
    }


def _allreduce_bench(calls: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    on: list[float] = []
    off: list[float] = []
    mode = _Mode()
    for i in range(10):
        for recording in (True, False) if i % 2 == 0 else (False, True):
            mode.set(recording)
            dist.barrier()
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                dist.all_reduce(t)
            (on if recording else off).append((time.perf_counter_ns() - t0) / calls)
    mode.set(False)
    return {
        "small_all_reduce_us_on": statistics.median(on) / 1e3,
        "small_all_reduce_us_off": statistics.median(off) / 1e3,
    }


PLANS = {
    # steps per arm, block: the engine benchmark's MLP, then the same with a user all-reduce a step
    False: {"engine_benchmark": (3000, 20), "with_user_all_reduce": (1000, 20)},
    True: {"engine_benchmark": (400, 20), "with_user_all_reduce": (200, 20)},
}


def worker(quick: bool, steps_per_arm: int | None) -> None:
    import torch
    import torch.distributed as dist

    from ddpscope import agent

    torch.set_num_threads(1)
    agent.configure(exporter=_Discard())
    dist.init_process_group("gloo")
    result: dict[str, Any] = {"rank": dist.get_rank()}
    for key, (steps, block) in PLANS[quick].items():
        if steps_per_arm is not None and key == "engine_benchmark":
            steps = steps_per_arm
        result[key] = _step_bench("mlp", steps, block, user_all_reduce=key == "with_user_all_reduce")
    result.update(_allreduce_bench(calls=100 if quick else 400))
    result.update(_wrapper_bench(calls=5_000 if quick else 50_000))
    result.update(_wakeups_bench(steps=100 if quick else 400))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(gathered))
    dist.destroy_process_group()


# -- the launcher ---------------------------------------------------------------------------------------


def _summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One A/B's figures, the ranks averaged: they share every step, so their medians differ only
    by noise."""

    def mean(key: str) -> float:
        return statistics.mean(r[key] for r in per_rank)

    step_us = mean("step_us_off")
    return {
        "model": per_rank[0]["model"],
        "steps_per_arm": per_rank[0]["steps_per_arm"],
        "step_ms_off": step_us / 1e3,
        "step_ms_on": mean("step_us_on") / 1e3,
        "step_overhead_pct": mean("overhead_pct"),
        "step_overhead_pct_per_rank": [r["overhead_pct"] for r in per_rank],
        "block_pair_overhead_pct_iqr_rank0": per_rank[0]["block_pair_overhead_pct_iqr"],
        "block_pair_overhead_pct_median_ci95_per_rank": [
            r["block_pair_overhead_pct_median_ci95"] for r in per_rank
        ],
        "thread_cpu_added_us": mean("thread_cpu_added_us"),
        "thread_cpu_added_pct_of_step": mean("thread_cpu_added_us") / step_us * 100,
        "process_cpu_added_us": mean("process_cpu_added_us"),
        "process_cpu_added_pct_of_step": mean("process_cpu_added_us") / step_us * 100,
        "collectives_recorded_per_step": per_rank[0]["collectives_recorded_per_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps: about a minute")
    parser.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="steps per arm of the engine benchmark's A/B (a 95 %% interval narrows as 1/sqrt(N))",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps is not None and args.steps < 40:
        parser.error(f"--steps {args.steps}: the A/B needs at least 40 steps per arm (two 20-step blocks)")
    if args.worker:
        worker(args.quick, args.steps)
        return

    from bench.common import check_ranks, machine, machine_line, run_module_ranks

    info = machine()
    print(machine_line(info))
    argv = (
        ["--worker"] + (["--quick"] if args.quick else []) + ([f"--steps={args.steps}"] if args.steps else [])
    )
    deadline_s = (300 if args.quick else 900) + (args.steps or 0) * 0.08  # ~2 x 11 ms a step, 4 x margin
    started = time.monotonic()
    runs = run_module_ranks("bench.watchdog", 2, args=argv, timeout_s=deadline_s)
    check_ranks(runs, "bench.watchdog")
    line = next(ln for ln in runs[0].stdout.splitlines() if ln.startswith("RESULT "))
    ranks = json.loads(line[len("RESULT ") :])
    ab = {key: _summary([r[key] for r in ranks]) for key in PLANS[args.quick]}
    head = ab["engine_benchmark"]
    per_coll_ns = statistics.mean(r["wrapper_ns"] for r in ranks)
    summary = {
        "machine": info,
        "quick": args.quick,
        "wall_s": round(time.monotonic() - started, 1),
        "engine": ranks[0]["engine_benchmark"]["engine"],
        **ab,
        "recorder_ns_per_collective_warm": per_coll_ns,
        "small_all_reduce_us_on": statistics.mean(r["small_all_reduce_us_on"] for r in ranks),
        "small_all_reduce_us_off": statistics.mean(r["small_all_reduce_us_off"] for r in ranks),
        "target_pct": TARGET_PCT,
        # On the engine benchmark, as the target is set: the wall-time difference and everything the
        # process spends more (all threads), each as a share of the step.
        "meets_target": head["step_overhead_pct"] <= TARGET_PCT
        and head["process_cpu_added_pct_of_step"] <= TARGET_PCT,
        "ranks": ranks,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"engine: {summary['engine']}")
    for key, label in (
        ("engine_benchmark", "engine benchmark's MLP"),
        ("with_user_all_reduce", "same + a user all_reduce a step"),
    ):
        a = ab[key]
        iqr = a["block_pair_overhead_pct_iqr_rank0"]
        ci = "; ".join(
            f"{lo:+.2f} .. {hi:+.2f}" for lo, hi in a["block_pair_overhead_pct_median_ci95_per_rank"]
        )
        print(
            f"{label}: {a['steps_per_arm']} steps per arm, step {a['step_ms_off']:.2f} ms off, "
            f"{a['step_ms_on']:.2f} ms on: {a['step_overhead_pct']:+.2f} % wall (ranks "
            f"{', '.join(f'{x:+.2f}' for x in a['step_overhead_pct_per_rank'])} %; rank 0 block pairs' IQR "
            f"{iqr[0]:+.1f} .. {iqr[1]:+.1f} %; median block pair's 95 % interval per rank {ci} %); "
            "CPU added per step: training thread "
            f"{a['thread_cpu_added_us']:.0f} us ({a['thread_cpu_added_pct_of_step']:.2f} % of the step), "
            f"process {a['process_cpu_added_us']:.0f} us ({a['process_cpu_added_pct_of_step']:.2f} %); "
            f"{a['collectives_recorded_per_step']:.1f} collectives recorded a step"
        )
    print(
        f"target <= {TARGET_PCT} % on the engine benchmark: {'met' if summary['meets_target'] else 'MISSED'}"
    )
    print(f"recorder wrapper in a warm loop: {per_coll_ns:.0f} ns per collective")
    print(
        f"small all_reduce on 2 ranks: {summary['small_all_reduce_us_off']:.1f} us off, "
        f"{summary['small_all_reduce_us_on']:.1f} us on"
    )
    print(f"wake-ups per second while training (rank 0): {ranks[0]['wakeups_per_s']}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
