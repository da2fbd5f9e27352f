"""Step-time overhead of ``ddpscope.ddp.instrument()`` over stock torch DDP, measured side by side.

Two ranks on gloo (one thread each). Every rank holds two copies of the same model: one wrapped in
plain ``torch.nn.parallel.DistributedDataParallel``, one wrapped and then ``instrument()``-ed (records
go to the agent with an in-memory exporter: the adapter's cost, not the disk spool's). Steps
(forward + backward + SGD step) alternate in short blocks, ABBA order, so drift and noise from other
processes hit both alike. Reported: median step time of each, the overhead of the median of per-round
ratios, and its spread (10th-90th percentile of the round ratios). Target: <= 1 %.

    .venv/bin/python -m bench.adapter --quick    # MLP of ~1 M parameters, under 2 minutes
    .venv/bin/python -m bench.adapter            # + a transformer of ~11 M parameters

Writes bench/results/adapter.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "adapter.json"
TARGET = 0.01


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "os": platform.platform(),
    }


# -- worker (one per rank) -----------------------------------------------------------------------


def build(kind: str) -> tuple[Any, Any]:
    """A model and a batch maker; both ranks build the same model from the same seed."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
        return model, lambda g: torch.randn(32, 512, generator=g)

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(1000, 384)
            layer = nn.TransformerEncoderLayer(384, 6, 1536, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
            self.head = nn.Linear(384, 1000)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(x)))

    return Transformer(), lambda g: torch.randint(0, 1000, (8, 64), generator=g)


def measure(kind: str, rounds: int, block: int, warmup: int) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpscope.ddp.adapter import instrument

    net_a, make_batch = build(kind)
    net_b, _ = build(kind)
    plain = DDP(net_a)
    inst = instrument(DDP(net_b))
    models = {"plain": plain, "instrumented": inst}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    times: dict[str, list[float]] = {"plain": [], "instrumented": []}
    ratios: list[float] = []

    def run(name: str, n: int, keep: bool) -> list[float]:
        model, opt, out = models[name], opts[name], []
        for _ in range(n):
            x = make_batch(gen)
            t0 = time.perf_counter()
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(time.perf_counter() - t0)
        if keep:
            times[name].extend(out)
        return out

    for name in models:
        run(name, warmup, keep=False)
    for r in range(rounds):
        order = ("plain", "instrumented") if r % 2 == 0 else ("instrumented", "plain")
        got = {name: run(name, block, keep=True) for name in order}
        ratios.append(statistics.median(got["instrumented"]) / statistics.median(got["plain"]))
    params = sum(p.numel() for p in net_a.parameters())
    qs = statistics.quantiles(ratios, n=10) if len(ratios) >= 2 else [ratios[0]] * 9
    return {
        "model": kind,
        "parameters": params,
        "steps_each": len(times["plain"]),
        "rounds": rounds,
        "block": block,
        "median_step_s": {k: round(statistics.median(v), 6) for k, v in times.items()},
        "overhead": round(statistics.median(ratios) - 1, 5),
        "overhead_p10_p90": [round(qs[0] - 1, 5), round(qs[-1] - 1, 5)],
        "step_s_p10_p90": {
            k: [round(q, 6) for q in statistics.quantiles(v, n=10)[::8]] for k, v in times.items()
        },
    }


def worker(plan: list[dict[str, Any]], out: str) -> None:
    import torch.distributed as dist

    from ddpscope import agent

    agent.configure(exporter=agent.InMemoryExporter(), rank=int(os.environ["RANK"]))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    results = [measure(**item) for item in plan]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# -- launcher --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="MLP only, under 2 minutes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.plan), args.worker)
        return 0

    from tests.support.procs import assert_all_ok, run_ranks

    plan = [{"kind": "mlp", "rounds": 40 if args.quick else 80, "block": 10, "warmup": 20}]
    if not args.quick:
        plan.append({"kind": "transformer", "rounds": 10, "block": 3, "warmup": 3})
    info = machine()
    load = os.getloadavg()[0]
    print(f"machine: {info['cpu']}, {info['cores']} cores, Python {info['python']}, load {load:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        started = time.monotonic()
        results = run_ranks(
            Path(__file__).resolve(),
            2,
            args=["--worker", out, "--plan", json.dumps(plan)],
            timeout_s=110 if args.quick else 900,
        )
        assert_all_ok(results)
        measured = json.loads(Path(out).read_text())
        elapsed = time.monotonic() - started
    for m in measured:
        med = m["median_step_s"]
        lo, hi = m["overhead_p10_p90"]
        print(
            f"{m['model']} ({m['parameters'] / 1e6:.2f} M params, 2 ranks gloo, {m['steps_each']} steps each): "
            f"plain {med['plain'] * 1e3:.2f} ms, instrumented {med['instrumented'] * 1e3:.2f} ms, "
            f"overhead {m['overhead'] * 100:+.2f} % (round ratios p10..p90 {lo * 100:+.2f} .. {hi * 100:+.2f} %)"
            f"  target <= {TARGET * 100:.0f} %"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "instrument(torch DDP) step-time overhead vs stock torch DDP, interleaved",
                "machine": info,
                "load_average_1m": round(load, 2),
                "quick": args.quick,
                "target_overhead": TARGET,
                "elapsed_s": round(elapsed, 1),
                "results": measured,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
