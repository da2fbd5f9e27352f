"""The cost of torch's own debug aids on the same model, side by side with ddpscope's engine.

torch's aids are switched by environment variables read at process start, so each is a separate
2-rank gloo job; jobs run in rounds whose order rotates, and every ratio is a job's median step time
over the plain job's median in the same round:

* ``plain``: stock torch DDP, Flight Recorder on (torch's default), nothing of ddpscope imported;
* ``ddpscope``: ddpscope's engine (agent with an in-memory exporter, watchdog running), measured the
  same way as torch's aids (its engine blocks over the plain job), and also against torch DDP blocks
  interleaved in its own job. The two can differ: ddpscope's threads (agent worker, watchdog) also
  run during the torch blocks of its own job, so only the cross-job ratio has a torch-only baseline;
* ``INFO``: ``TORCH_DISTRIBUTED_DEBUG=INFO``;
* ``FR off``: ``TORCH_FR_BUFFER_SIZE=0`` (so the Flight Recorder's own cost is plain / FR off);
* ``DETAIL``: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` segfaults in the DDP constructor on gloo
  (TORCH-FACTS), so it is measured on a raw 4-float ``all_reduce`` loop only, against the same loop in
  the plain job.

Model: the MLP of ``bench.engine`` (~1 M parameters), one thread per rank. Writes
bench/results/debug_aids.json.

    .venv/bin/python -m bench.debug_aids [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    check_ranks,
    interleave,
    machine,
    machine_line,
    ratios_to,
    rotations,
    run_module_ranks,
    summary,
    write_result,
)

logger = logging.getLogger(__name__)

KINDS: dict[str, dict[str, str]] = {
    "plain": {},
    "ddpscope": {},
    "INFO": {"TORCH_DISTRIBUTED_DEBUG": "INFO"},
    "FR off": {"TORCH_FR_BUFFER_SIZE": "0"},
    "DETAIL (raw all_reduce only)": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
}
WORLD = 2
ALL_REDUCES = 300


def worker(kind: str, rounds: int, block: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from bench.engine import _models

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    result: dict[str, Any] = {}
    if not kind.startswith("DETAIL"):
        factory, batch = _models()["mlp"]
        torch.manual_seed(0)
        base = factory()
        models: dict[str, nn.Module] = {"torch": nn.parallel.DistributedDataParallel(base)}
        if kind == "ddpscope":
            from ddpscope import agent
            from ddpscope.ddp import DistributedDataParallel

            agent.configure(exporter=agent.InMemoryExporter(), job="bench-debug-aids", rank=rank)
            ours = factory()
            ours.load_state_dict(base.state_dict())
            models["ddpscope engine"] = DistributedDataParallel(ours)
        optims = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
        gen, loss_fn = torch.Generator().manual_seed(rank), nn.CrossEntropyLoss()

        cpu: dict[str, list[float]] = {v: [] for v in models}
        """Process CPU seconds per step, per block (all threads): less disturbed by other processes."""

        def steps(variant: str, n: int) -> list[float]:
            times, cpu0 = [], time.process_time()
            for _ in range(n):
                x, y = batch(gen)
                t0 = time.perf_counter()
                optims[variant].zero_grad(set_to_none=True)
                loss_fn(models[variant](x), y).backward()
                optims[variant].step()
                times.append(time.perf_counter() - t0)
            cpu[variant].append((time.process_time() - cpu0) / n)
            return times

        for v in models:
            steps(v, 5)
            cpu[v].clear()
        samples, per_round = interleave({v: functools.partial(steps, v, block) for v in models}, rounds)
        result["median_step_s"] = {k: statistics.median(v) for k, v in samples.items()}
        result["ratios"] = ratios_to(per_round, "torch")
        result["median_cpu_per_step_s"] = {k: statistics.median(v) for k, v in cpu.items()}
        result["cpu_ratios"] = [
            c / t for c, t in zip(cpu.get("ddpscope engine", []), cpu["torch"], strict=False)
        ]
    t = torch.ones(4)
    lat = []
    for _ in range(ALL_REDUCES):
        t0 = time.perf_counter()
        dist.all_reduce(t)
        lat.append(time.perf_counter() - t0)
    result["all_reduce_us"] = statistics.median(lat[20:]) * 1e6
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    if kind == "ddpscope":
        from ddpscope import agent

        agent.shutdown()
    dist.destroy_process_group()


def _run(kind: str, rounds: int, block: int, timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        args = ["--worker", kind, "--rounds", str(rounds), "--block", str(block), "--out", out]
        runs = run_module_ranks("bench.debug_aids", WORLD, args=args, env=KINDS[kind], timeout_s=timeout_s)
        check_ranks(runs, f"debug_aids {kind} job")
        return dict(json.loads(Path(out).read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two rounds of jobs")
    parser.add_argument("--worker", choices=list(KINDS), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.rounds, args.block, args.out)
        return 0
    m = machine()
    print(machine_line(m), flush=True)
    started = time.monotonic()
    # Quick: two rounds (a job costs 10-30 s of start-up on 2 loaded cores), so its cross-job ratios
    # are two samples each; the CPU ratios are the steadier ones under load.
    job_rounds, inner_rounds, block = (2, 6, 5) if args.quick else (5, 6, 8)
    per_round: list[dict[str, dict[str, Any]]] = []
    for order in rotations(list(KINDS), job_rounds):
        per_round.append({k: _run(k, inner_rounds, block, 300) for k in order})
    step_ratios: dict[str, list[float]] = {}
    ours: list[float] = []
    detail: list[float] = []
    for r in per_round:
        for key, label in (("median_step_s", "wall"), ("median_cpu_per_step_s", "CPU")):
            plain, info, off = (r[k][key]["torch"] for k in ("plain", "INFO", "FR off"))
            for name, ratio in (
                (f"INFO, {label}", info / plain),
                (f"FR off, {label}", off / plain),
                (f"FR on (default) vs off, {label}", plain / off),
            ):
                step_ratios.setdefault(name, []).append(ratio)
        for key, label in (("median_step_s", "wall"), ("median_cpu_per_step_s", "CPU")):
            engine = r["ddpscope"][key]["ddpscope engine"] / r["plain"][key]["torch"]
            step_ratios.setdefault(f"ddpscope engine, {label}", []).append(engine)
        ours.extend(r["ddpscope"]["ratios"]["ddpscope engine"])
        step_ratios.setdefault("ddpscope engine vs torch blocks in its own job, CPU", []).extend(
            r["ddpscope"]["cpu_ratios"]
        )
        detail.append(r["DETAIL (raw all_reduce only)"]["all_reduce_us"] / r["plain"]["all_reduce_us"])
    ratios = {k: {"per_round": v, **summary(v)} for k, v in step_ratios.items()}
    ratios["ddpscope engine vs torch blocks in its own job, wall"] = {
        "per_block_round": ours,
        **summary(ours),
    }
    m_after = machine()
    result = {
        "quick": args.quick,
        "machine": m,
        "load_average_after": m_after["load_average"],
        "model": "mlp",
        "world_size": WORLD,
        "rounds": job_rounds,
        "ratios": ratios,
        "detail_all_reduce": {
            "ratio": statistics.median(detail),
            "per_round": detail,
            "plain_us": [r["plain"]["all_reduce_us"] for r in per_round],
            "detail_us": [r["DETAIL (raw all_reduce only)"]["all_reduce_us"] for r in per_round],
        },
        "median_step_ms": [{k: v.get("median_step_s") for k, v in r.items()} for r in per_round],
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(f"MLP, {WORLD} ranks gloo: step time (wall) and process CPU per step, ratio to plain torch DDP")
    print("(median over rounds, p10..p90; every aid and ddpscope in a job of its own, vs the plain job)")
    for k, r in ratios.items():
        print(f"  {k:<58} {r['median']:.3f}  ({r['p10']:.3f} .. {r['p90']:.3f}, n={r['n']})")
    d = result["detail_all_reduce"]
    print(f"  DETAIL / plain, 4-float all_reduce latency: {d['ratio']:.2f} x (per round {d['per_round']})")
    print(f"load average after: {m_after['load_average']}; wall {result['wall_s']} s")
    print(f"wrote {write_result('debug_aids', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
