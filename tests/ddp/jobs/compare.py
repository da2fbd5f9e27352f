"""One rank of a job that trains the same model with torch's DDP and with ddpscope's, side by side.

Usage: compare.py SCENARIO[,SCENARIO...] STEPS OUTDIR. Both wrappers get identical initial weights and
the same per-rank inputs; after STEPS optimizer steps the rank adds, per scenario, the largest difference
per parameter and buffer, what .grad looked like, and every record the engine emitted to
OUTDIR/rank<R>.json. One process runs every scenario: starting torch costs seconds, a scenario does not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpscope import agent
from ddpscope.ddp import DistributedDataParallel
from tests.support.job_end import destroy_together

SCENARIOS, STEPS, OUTDIR = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
SCENARIO = ""


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(32, 48), nn.BatchNorm1d(48), nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class Branchy(nn.Module):
    """``branch`` is used on rank 0 only; ``never`` on no rank at all."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.branch, self.never, self.head = (
            nn.Linear(32, 32),
            nn.Linear(32, 32),
            nn.Linear(32, 32),
            nn.Linear(32, 8),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        if dist.get_rank() == 0:
            h = h + self.branch(h)
        return self.head(h)


class WindowBranch(nn.Module):
    """``extra`` is used in the first micro-batch of each accumulation window only (``use_extra``, set by
    the loop), never in the synchronised one: torch averages the gradient it accumulated."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.extra, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        if self.use_extra:
            h = h + self.extra(h)
        return self.head(h)


class LateUnused(nn.Module):
    """``never`` is registered last, so its own bucket comes first (small buckets): a bucket every parameter
    of which is unused."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head, self.never = nn.Linear(32, 32), nn.Linear(32, 8), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.trunk(x)))


@dataclasses.dataclass
class Outputs:
    logits: torch.Tensor
    aux: torch.Tensor


class DataclassOut(Branchy):
    """Returns a dataclass (torch's DDP finds the tensors in its fields)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return Outputs(self.head(h), self.branch(h))  # type: ignore[return-value]


class Frozen(Mlp):
    def __init__(self) -> None:
        super().__init__()
        self.layers[2].requires_grad_(False)


class TwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 8).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).double())


class MixedDtypes(nn.Module):
    """fp32 input layer and head around bf16 layers: gradients of both dtypes arrive from the first to the
    last, and the bf16 bucket is complete first."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(32, 32), nn.Linear(32, 8)
        self.mid = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(torch.relu(self.inp(x)).to(torch.bfloat16))
        return self.head(torch.relu(h).float())


class Wide(nn.Module):
    """Parameters of 512 KiB: their buckets lend the reduced memory to the gradients (buckets.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(32, 4096), nn.Linear(4096, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


MODELS = {
    "mlp": Mlp,
    "batchnorm": WithBatchNorm,
    "unused": Branchy,
    "no_sync": Mlp,
    "frozen": Frozen,
    "dtypes": TwoDtypes,
    "mixed_dtypes": MixedDtypes,
    "bucket_view": Mlp,
    "small_buckets": Mlp,
    "wide": Wide,
    "wide_keep_grads": Wide,
    "wide_no_sync": Wide,
    "unused_no_sync": WindowBranch,
    "dataclass_out": DataclassOut,
    "batchnorm_no_sync": WithBatchNorm,
    # Evaluation after each step, one more batch on each higher rank, then a metric all-reduce: torch
    # broadcasts buffers in the first evaluation forward only, so the uneven loops do not pair up.
    "batchnorm_eval": WithBatchNorm,
    # Uneven inputs under Join (``batches``): rank 0 joins first, the last rank first, the first after
    # one step (before the bucket rebuild it must then take part in), with unused parameters, with
    # accumulation, and with gradients divided by the ranks still training.
    "join": WithBatchNorm,
    "join_divide": Mlp,
    "join_early": Mlp,
    "join_unused": Branchy,
    "join_no_sync": Mlp,
    # A gradient penalty (WGAN-GP): autograd.grad of the output with respect to the input, through the
    # DDP outputs, before the backward that reaches the parameters; under no_sync() too.
    "gradient_penalty": Mlp,
    "gradient_penalty_no_sync": Mlp,
    # With find_unused_parameters and a bucket of unused parameters only: the input-gradient pass must not
    # launch it (torch marks unused parameters ready at the first parameter's hook).
    "gradient_penalty_unused": LateUnused,
}


def options() -> dict[str, Any]:
    if SCENARIO in ("unused", "join_unused", "unused_no_sync", "dataclass_out"):
        return {"find_unused_parameters": True}
    if SCENARIO == "bucket_view":
        return {"gradient_as_bucket_view": True}
    if SCENARIO in ("small_buckets", "join_early"):
        return {"bucket_cap_mb": 0.01}
    if SCENARIO == "gradient_penalty_unused":
        return {"find_unused_parameters": True, "bucket_cap_mb": 0.001}
    return {}


def batches(rank: int) -> int:
    """Optimizer steps this rank runs: STEPS, or under Join a number that differs per rank."""
    world = dist.get_world_size()
    if SCENARIO in ("join", "join_no_sync"):
        return STEPS + 2 * rank
    if SCENARIO == "join_divide":
        return STEPS + 2 * (world - 1 - rank)
    if SCENARIO == "join_early":
        return 1 if rank == 0 else STEPS + 1
    if SCENARIO == "join_unused":
        return STEPS + rank
    return STEPS


def train(model: nn.Module, rank: int) -> dict[str, Any]:
    """Train; return what the gradients looked like along the way."""
    if SCENARIO.startswith("join"):
        with model.join(divide_by_initial_world_size=SCENARIO != "join_divide"):  # type: ignore[operator]
            out = _train(model, rank)
        # An even epoch after it: the ranks that joined early now number their steps behind the others.
        _train(model, rank, EVEN_EPOCH)
        return out
    return _train(model, rank)


EVEN_EPOCH = 2
"""Steps every rank trains after an uneven epoch under Join."""


def _train(model: nn.Module, rank: int, steps: int | None = None) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    weight = model.module.fc1.weight if SCENARIO.startswith("wide") else None  # type: ignore[union-attr]
    held: list[tuple[torch.Tensor, torch.Tensor]] = []  # a .grad kept across steps, and its value then
    identities: set[int] = set()
    for _ in range(batches(rank) if steps is None else steps):
        opt.zero_grad(set_to_none=SCENARIO not in ("bucket_view", "wide_keep_grads"))
        micro = 3 if "no_sync" in SCENARIO else 1
        for m in range(micro):
            x = torch.randn(16, 32, generator=gen)
            if SCENARIO == "unused_no_sync":
                model.module.use_extra = m == 0  # type: ignore[union-attr]
            if m < micro - 1:
                with model.no_sync():  # type: ignore[operator]
                    step_loss(model, x).backward()
            else:
                step_loss(model, x).backward()
        if weight is not None and weight.grad is not None:
            held.append((weight.grad, weight.grad.clone()))
            identities.add(id(weight.grad))
        opt.step()
        if SCENARIO == "batchnorm_eval":
            evaluate(model, rank, gen)
    if weight is None or weight.grad is None:
        return {}
    grad = weight.grad
    return {
        "held_grads_intact": all(torch.equal(g, value) for g, value in held),
        "identities": len(identities),
        "is_view": grad._base is not None,
        "weights_share_storage": grad.untyped_storage().data_ptr()
        == model.module.fc2.weight.grad.untyped_storage().data_ptr(),  # type: ignore[union-attr]
        "detach_ok": grad.detach_() is grad,
    }


def step_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not SCENARIO.startswith("gradient_penalty"):
        return loss(model(x))
    x.requires_grad_()
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return loss(out) + (g.norm(2, dim=1) - 1).pow(2).mean()


def loss(out: Any) -> torch.Tensor:
    if isinstance(out, Outputs):
        return out.logits.pow(2).mean() + out.aux.pow(2).mean()
    return out.pow(2).mean()


def evaluate(model: nn.Module, rank: int, gen: torch.Generator) -> None:
    model.eval()
    metric = torch.zeros(1)
    with torch.no_grad():
        for _ in range(1 + rank):
            metric += model(torch.randn(16, 32, generator=gen)).pow(2).mean()
    dist.all_reduce(metric)
    model.train()


def run_scenario(rank: int) -> dict[str, Any]:
    exporter = agent.InMemoryExporter()
    agent.configure(exporter=exporter, job="compare", rank=rank)
    torch.manual_seed(0)
    reference = MODELS[SCENARIO]()
    ours_module = MODELS[SCENARIO]()
    ours_module.load_state_dict(reference.state_dict())
    if rank != 0:
        # Different starting weights on the other ranks: the broadcast from rank 0 must fix them.
        with torch.no_grad():
            for p in ours_module.parameters():
                p.add_(1.0)
    theirs = nn.parallel.DistributedDataParallel(reference, **options())
    ours = DistributedDataParallel(ours_module, **options())
    # Interleaved step by step would also work; whole runs keep each engine's collectives together.
    grad_shape = {"theirs": train(theirs, rank), "ours": train(ours, rank)}
    agent.get_agent().force_flush(5.0)
    diffs = {}
    theirs_state, ours_state = theirs.state_dict(), ours.state_dict()
    assert list(theirs_state) == list(ours_state), (list(theirs_state), list(ours_state))
    for name, value in theirs_state.items():
        diffs[name] = (value.double() - ours_state[name].double()).abs().max().item()
    exact = all(torch.equal(value, ours_state[name]) for name, value in theirs_state.items())
    theirs_params = dict(theirs.module.named_parameters())
    grads = {
        name: {
            "ours_none": p.grad is None,
            "theirs_none": theirs_params[name].grad is None,
            "equal": _same(p.grad, theirs_params[name].grad),
        }
        for name, p in ours.module.named_parameters()
    }
    return {
        "rank": rank,
        "diffs": diffs,
        "exact": exact,
        "grads": grads,
        "layout": ours.bucket_layout,
        "torch_layout": _torch_layout(theirs),
        "records": exporter.records,
        "grad_shape": grad_shape,
    }


def _torch_layout(ddp: nn.parallel.DistributedDataParallel) -> list[list[str]]:
    """Parameter names per bucket of torch's Reducer, in bucket order."""
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    return [[names[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(torch.equal(a, b)) and a.stride() == b.stride()


def main() -> None:
    global SCENARIO
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    for SCENARIO in SCENARIOS:
        out[SCENARIO] = run_scenario(rank)
    with open(os.path.join(OUTDIR, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    destroy_together()


if __name__ == "__main__":
    main()
