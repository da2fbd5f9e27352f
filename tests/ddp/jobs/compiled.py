"""``torch.compile`` over the engine and over torch's DDP under ``instrument()``, next to eager torch DDP.

    python compiled.py OUT_DIR

Copies of one MLP from one seed train three steps on the same batches: torch's DDP eager (the reference),
torch's DDP compiled (how many graphs Dynamo makes of it), torch's DDP under ``instrument()`` compiled and
ddpscope's engine compiled. Backend
"eager": Dynamo traces (where both problems were) without generating code. Each rank writes the
parameter sums, how many graphs Dynamo compiled, every warning raised and its step records' steps.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddpscope import agent
from ddpscope.ddp import DistributedDataParallel, instrument
from tests.support.job_end import destroy_together


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def train(model: nn.Module, run: Any, rank: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))
        opt.zero_grad()
        run(x).sum().backward()
        opt.step()
    return [p.detach().sum().item() for p in model.parameters()]


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    exporter = agent.InMemoryExporter()
    agent.configure(exporter=exporter, job="compiled", rank=rank)
    import torch._dynamo

    stats = torch._dynamo.utils.counters["stats"]
    result: dict[str, Any] = {"reference": train(ref := TorchDDP(mlp()), ref, rank)}
    plain = TorchDDP(mlp())
    train(plain, torch.compile(plain, backend="eager"), rank)
    result["torch_graphs"] = stats["unique_graphs"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        observed = instrument(TorchDDP(mlp()))
        result["instrumented"] = train(observed, torch.compile(observed, backend="eager"), rank)
        result["instrumented_graphs"] = stats["unique_graphs"] - result["torch_graphs"]
        engine = DistributedDataParallel(mlp())
        result["engine"] = train(engine, torch.compile(engine, backend="eager"), rank)
        result["engine_graphs"] = (
            stats["unique_graphs"] - result["torch_graphs"] - result["instrumented_graphs"]
        )
    result["warnings"] = [str(w.message)[:300] for w in caught]
    agent.get_agent().force_flush(5.0)
    result["steps"] = [r["step"] for r in exporter.records if r["kind"] == "step"]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    destroy_together()


if __name__ == "__main__":
    main()
