"""``instrument()`` at its edges, one scenario per run.

    python edge_job.py SCENARIO OUT_DIR

Each rank writes its records to OUT_DIR/rank<R>.jsonl (the failure jobs' JSON-lines exporter) and
what the test checks to OUT_DIR/rank<R>.json.

Scenarios:
  accumulate  gradient accumulation: no_sync() on three steps of four, so torch rebuilds its buckets
              in a no_sync() forward; torch's own logging data at the end. Then instrument() again on
              the first returns it, and a second model under another job (records to
              OUT_DIR/second<R>.jsonl) is measured alone.
  takeover    a model trained 8 steps, then another model instrumented in the same job (one built again)
              trained 4, then the first trained 4 more: the second takes over, its steps numbered on.
  peer_dies   rank 1 dies (os._exit) while rank 0 waits in a bucket all-reduce past the hang timeout.
  waits       a model with BatchNorm; rank 1 is slow before each forward (rank 0 waits for it in
              torch's buffer broadcast) and before the loss all-reduce after each step (rank 0 waits
              in that): the step records' blocked_* fields must hold rank 0's waits.
  join        uneven inputs under torch's Join (``model.join()``): rank 0 has 3 batches, rank 1 has 6,
              a model with BatchNorm; the same training uninstrumented first, for the parameters.
  dtypes      fp32 layers under a bf16 head, DTYPE_STEPS synced steps; torch's logging data at the end.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "failure_jobs"))
import _capture  # noqa: E402  (the failure jobs' JSON-lines exporter, shared)

from ddpscope import agent  # noqa: E402
from ddpscope.ddp.adapter import instrument, instrumentation  # noqa: E402
from tests.support.job_end import destroy_together  # noqa: E402

STEPS = 12
SYNC_EVERY = 4
PEER_DIES_AFTER_S = float(os.environ.get("JOB_PEER_DIES_AFTER_S", "3.0"))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(1000 * rank + step))


def train(model: DDP, rank: int, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = batch(rank, step)
        if step % SYNC_EVERY != SYNC_EVERY - 1:
            with model.no_sync():
                model(x).square().mean().backward()
            continue
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def accumulate(rank: int, out_dir: str) -> dict[str, Any]:
    # Small buckets: several of them once torch rebuilds (it starts with one holding everything).
    model = instrument(DDP(mlp(), bucket_cap_mb=0.1))
    train(model, rank, STEPS)
    logged = model._get_ddp_logging_data()
    state = instrumentation(model)
    assert state is not None
    result: dict[str, Any] = {
        "logged": {k: v for k, v in logged.items() if isinstance(v, (int, str))},
        "reducer_parameters": list(state.layout.names),
    }
    other = DDP(mlp())
    result["again_is_same"] = instrument(model) is model
    _capture.flush()
    # Models measured one after the other, each under its own job (bench/end_to_end.py does this).
    second_out = os.path.join(out_dir, f"second{rank}.jsonl")
    agent.configure(exporter=_capture.JsonLinesExporter(second_out), rank=rank, job="edge-second")
    instrument(other)
    train(other, rank, SYNC_EVERY)
    train(model, rank, SYNC_EVERY)  # the first model still trains, no longer measured
    result["first_detached"] = state.detached
    agent.get_agent().force_flush(5.0)
    # Without a comm hook of its own a detached model can be measured again.
    third_out = os.path.join(out_dir, f"third{rank}.jsonl")
    agent.configure(exporter=_capture.JsonLinesExporter(third_out), rank=rank, job="edge-third")
    result["reattached"] = instrument(model) is model and instrumentation(model) is not state
    train(model, rank, SYNC_EVERY)
    agent.get_agent().force_flush(5.0)
    return result


def takeover(rank: int, out_dir: str) -> dict[str, Any]:
    logged = _capture.logged_warnings()
    first = instrument(DDP(mlp(), bucket_cap_mb=0.1))
    train(first, rank, 8)
    state = instrumentation(first)
    second = instrument(DDP(mlp(), bucket_cap_mb=0.1))  # built again: the same job goes on with it
    train(second, rank, SYNC_EVERY)
    train(first, rank, SYNC_EVERY)  # still trains, unmeasured
    return {"warnings": logged, "first_detached": state is not None and state.detached}


def peer_dies(rank: int, out_dir: str) -> dict[str, Any]:
    model = instrument(DDP(mlp()))
    for step in range(2):  # past step 1, whose forward rebuilds the buckets (a broadcast)
        model(batch(rank, step)).square().mean().backward()
    if rank == 1:
        time.sleep(PEER_DIES_AFTER_S)
        _capture.flush()
        os._exit(3)  # dies while rank 0 waits for it in the next step's all-reduce
    model(batch(rank, 2)).square().mean().backward()  # raises: the peer closed the connection
    return {}


WAIT_FORWARD_S = 0.05
WAIT_BETWEEN_S = 0.03


def waits(rank: int, out_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = instrument(DDP(nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))))
    for step in range(6):
        if rank == 1:
            time.sleep(WAIT_FORWARD_S)
        loss = model(batch(rank, step)).square().mean()
        loss.backward()
        if rank == 1:
            time.sleep(WAIT_BETWEEN_S)
        dist.all_reduce(loss.detach())
    return {}


JOIN_BATCHES = (3, 6)


def _join_train(model: DDP, rank: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(JOIN_BATCHES[rank]):
            opt.zero_grad()
            model(batch(rank, step)).square().mean().backward()
            opt.step()
    # An even epoch after it: rank 0, which joined early, now numbers its steps behind rank 1.
    for step in range(2):
        opt.zero_grad()
        model(batch(rank, 100 + step)).square().mean().backward()
        opt.step()
    return [float(p.detach().double().sum()) for p in model.parameters()]


def join(rank: int, out_dir: str) -> dict[str, Any]:
    def bn_mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))

    plain = _join_train(DDP(bn_mlp()), rank)
    _capture.flush()
    agent.configure(exporter=_capture.JsonLinesExporter(os.path.join(out_dir, f"joined{rank}.jsonl")), rank=rank,
                    job="edge-join")  # fmt: skip
    return {"plain": plain, "instrumented": _join_train(instrument(DDP(bn_mlp())), rank)}


DTYPE_STEPS = 5


class Bf16Head(nn.Module):
    """fp32 layers under a bf16 head: the head's gradients arrive first, then all the fp32 ones."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).to(torch.bfloat16)).float()


def dtypes(rank: int, out_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = instrument(DDP(Bf16Head()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(DTYPE_STEPS):
        model(batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    logged = model._get_ddp_logging_data()
    return {"logged": {k: v for k, v in logged.items() if isinstance(v, (int, str))}}


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    _capture.capture(out_dir)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    scenarios = {
        "accumulate": accumulate,
        "takeover": takeover,
        "peer_dies": peer_dies,
        "waits": waits,
        "join": join,
        "dtypes": dtypes,
    }
    result = scenarios[scenario](rank, out_dir)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    _capture.flush()
    destroy_together()


if __name__ == "__main__":
    main()
