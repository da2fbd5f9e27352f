"""What a replica digest costs (``ddp/replicas.py``): one digest against one training step, side by side.

    .venv/bin/python -m bench.replicas [--quick]

In one process with one thread, for each of the engine benchmark's models (the ~1 M-parameter MLP and
the ~11 M transformer): a block of training steps (forward, backward, SGD step; no DDP, so nothing but
the model's own compute is in it) and a block of digests (``ReplicaDigest.norms``: ``_foreach_norm`` of
every parameter and the copy to the host), interleaved in rotating order. The figure is the median digest
over the median step, and that share spread over the schedule: one digest every ``EVERY`` steps once
training is past its first ``EVERY`` steps. Digests are never sent here (``norms`` only), so the agent's
cost is not in it: one record each, as for any other record.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import interleave, machine, machine_line, write_result
from bench.engine import _models
from ddpscope.ddp.replicas import EVERY, ReplicaDigest


def _timed(fn: Callable[[], Any], count: int) -> list[float]:
    times = []
    for _ in range(count):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def measure_model(model_cls: Any, make_batch: Any, rounds: int, per_block: int) -> dict[str, Any]:
    model = model_cls()
    params = [p for p in model.parameters() if p.requires_grad]
    digest = ReplicaDigest(model, params, rank=0)
    opt = torch.optim.SGD(params, lr=0.01)
    x, y = make_batch(torch.Generator().manual_seed(0))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = model(x)
        torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        opt.step()

    step()  # warm-up: allocations, lazy initialisation
    digest.norms()
    blocks = {"step": lambda: _timed(step, per_block), "digest": lambda: _timed(digest.norms, per_block)}
    samples, _ = interleave(blocks, rounds)
    step_s, digest_s = statistics.median(samples["step"]), statistics.median(samples["digest"])
    return {
        "parameters": len(params),
        "elements": sum(p.numel() for p in params),
        "step_ms": step_s * 1e3,
        "digest_ms": digest_s * 1e3,
        "digest_pct_of_step": 100 * digest_s / step_s,
        "amortized_pct": 100 * digest_s / step_s / EVERY,
    }


def measure(quick: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    rounds, per_block = (3, 3) if quick else (8, 6)
    out: dict[str, Any] = {"every": EVERY, "models": {}}
    for name, (model_cls, make_batch) in _models().items():
        out["models"][name] = measure_model(model_cls, make_batch, rounds, per_block)
        print(f"{name}: {out['models'][name]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    m = machine()
    print(machine_line(m), flush=True)
    result = {"machine": m, **measure(args.quick)}
    print(f"wrote {write_result('replicas', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
