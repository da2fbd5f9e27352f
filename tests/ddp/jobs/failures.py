"""One rank of a job that makes the engine fail on purpose; writes what happened to OUTDIR/rank<R>.json.

Usage: failures.py SCENARIO OUTDIR
- ``mismatch``: rank 1 builds a model whose second layer is wider; the constructor must raise.
- ``bucket_cap``: the same model, but rank 1 passes another ``bucket_cap_mb``; the constructor must raise.
- ``missing_grad``: rank 1 skips a branch while find_unused_parameters=False; backward must raise on
  every rank, and the job must then go on (the collectives stayed aligned) with a step that is fine.
- ``disabled``: with ddpscope switched off the wrapper is torch's own DDP, and trains.
- ``progress``: a healthy step that samples what the hang watchdog would read (PROGRESS) mid-backward.
- ``bypass``: rank 0 trains two steps through ``model.module`` (no all-reduce), while rank 1 accumulates
  under ``no_sync()`` (no all-reduce either, so the collectives stay aligned); the warnings each rank logged.
- ``frozen_late``: a layer frozen on every rank after wrapping; the engine's error.
- ``misaligned``: rank 1 all-reduces a metric of the last bucket's size where rank 0 runs a backward; the
  engine's error on rank 0. ``misaligned_zeros``: the same with a tensor of zeros, which looks like flags.
- ``cut_short``: a hook raises in the backward of step 1 on every rank and the loop catches it; the next
  forward's error, and where the rank said it was.
- ``thawed``: a layer frozen when wrapped is unfrozen after two steps; the warnings, and whether the
  ranks' copies of that layer still agree.
- ``replicas``: rank 0 alone steps an LR scheduler after step 2, so the ranks' copies drift apart; a layer
  is added to the module after wrapping at step 5.
- ``rebuilt``: a model trained 3 steps, then wrapped again (a new DistributedDataParallel of the same module,
  as after unfreezing layers) and trained 2 more; then two models built together and trained in turn (a GAN).
- ``never_synced``: a healthy accumulation of 40 micro-batches under ``no_sync()`` and one synced, then 40
  micro-batches all under ``no_sync()`` with an optimizer step after every second one (the synced last
  micro-batch forgotten).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpscope import agent
from ddpscope.ddp import DistributedDataParallel
from tests.support.cut_short import train_through_a_caught_backward_failure
from tests.support.eval_mode import batchnorm_net, train_forgetting_train_mode
from tests.support.job_end import destroy_together

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "failure_jobs"))
import _capture  # noqa: E402  (the failure jobs' shared helpers)

SCENARIO, OUTDIR = sys.argv[1], sys.argv[2]


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.branch, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.skip_branch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        if not self.skip_branch:
            h = h + self.branch(h)
        return self.head(h)


def mismatch(rank: int) -> dict[str, Any]:
    width = 16 if rank == 1 else 8
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, width), nn.Linear(width, 2))
    try:
        DistributedDataParallel(model)
    except ValueError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def bucket_cap(rank: int) -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    try:
        DistributedDataParallel(model, bucket_cap_mb=25 if rank == 1 else 1)
    except ValueError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def missing_grad(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Branchy()
    model = DistributedDataParallel(module, bucket_cap_mb=0.0005)  # several buckets
    module.skip_branch = rank == 1
    x = torch.randn(4, 8)
    out: dict[str, Any] = {"layout": model.bucket_layout}
    try:
        model(x).sum().backward()
        out["error"] = None
    except RuntimeError as e:
        out["error"], out["message"] = type(e).__name__, str(e)
        out["traceback"] = traceback.format_exc()
    out["branch_grad_none"] = module.branch.weight.grad is None
    # The collectives stayed aligned, so a healthy step afterwards works on every rank.
    module.skip_branch = False
    module.zero_grad(set_to_none=True)
    model(x).sum().backward()
    out["after_ok"] = True
    return out


def misaligned(rank: int) -> dict[str, Any]:
    return _misaligned(rank, torch.ones)


def misaligned_zeros(rank: int) -> dict[str, Any]:
    return _misaligned(rank, torch.zeros)


def _misaligned(rank: int, fill: Any) -> dict[str, Any]:
    """After two healthy steps, rank 1 all-reduces a metric of exactly the last bucket's size (its
    parameters and status slots) where rank 0 runs its next backward: gloo pairs the two silently."""
    torch.manual_seed(0)
    module = Branchy()
    model = DistributedDataParallel(module)
    x = torch.randn(4, 8)
    for _ in range(2):  # the second forward broadcasts the rebuilt bucket order: a collective of its own
        model(x).sum().backward()
    assert len(model.bucket_layout) == 1, model.bucket_layout
    params = list(module.parameters())
    out: dict[str, Any] = {"error": None}
    if rank == 1:
        # The status slots: one per rank, one per parameter (find_unused_parameters=False), the signature.
        dist.all_reduce(fill(sum(p.numel() for p in params) + dist.get_world_size() + len(params) + 1))
        return out
    try:
        model(x).sum().backward()
    except RuntimeError as e:
        out["error"], out["message"] = type(e).__name__, str(e)
    return out


def frozen_late(rank: int) -> dict[str, Any]:
    """The branch frozen on every rank after wrapping: DDP still waits for its gradients."""
    torch.manual_seed(0)
    module = Branchy()
    model = DistributedDataParallel(module)
    module.branch.requires_grad_(False)
    try:
        model(torch.randn(4, 8)).sum().backward()
        return {"message": None}
    except RuntimeError as e:
        return {"message": str(e)}


def cut_short(rank: int) -> dict[str, Any]:
    """An exception in backward that the training loop catches (an OOM-recovery pattern): the engine
    refuses the next forward, whose gradients would be averaged with a step the peers never finished."""
    torch.manual_seed(0)
    module = Branchy()
    model = DistributedDataParallel(module)
    # Halfway through backward: the head has its gradients, the trunk never gets them.
    error, caught = train_through_a_caught_backward_failure(
        model, lambda step: torch.randn(4, 8), module.trunk.weight
    )
    return {"message": None if error is None else str(error), "caught": caught}


def progress(rank: int) -> dict[str, Any]:
    from ddpscope.ddp.progress import PROGRESS

    torch.manual_seed(0)
    module = Branchy()
    model = DistributedDataParallel(module, bucket_cap_mb=0.0005)
    seen: dict[str, Any] = {}

    def sample(_: torch.Tensor) -> None:
        # head.bias is the first gradient to arrive: every bucket is still pending here.
        seen["phase"], seen["step"] = PROGRESS.phase, PROGRESS.step
        seen["pending"] = PROGRESS.pending_buckets()

    module.head.bias.register_post_accumulate_grad_hook(sample)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    model(x).sum().backward()  # step 1: the hook samples again, after the rebuild
    return {
        "mid_backward": seen,
        "after": {"phase": PROGRESS.phase, "pending": PROGRESS.pending_buckets()},
        "layout": model.bucket_layout,
    }


def bypass(rank: int) -> dict[str, Any]:
    logged = _capture.logged_warnings()
    torch.manual_seed(0)
    model = DistributedDataParallel(Branchy())
    x = torch.randn(4, 8)
    model(x).sum().backward()  # a synced step
    for _ in range(2):
        if rank == 0:
            model.module(x).sum().backward()  # the bug: a training step that bypasses the wrapper
        else:
            with model.no_sync():  # deliberate local accumulation: nothing to say
                model(x).sum().backward()
    model(x).sum().backward()  # a synced step again
    return {"warnings": logged}


def thawed(rank: int) -> dict[str, Any]:
    """A layer frozen when the model is wrapped and unfrozen after two steps (a fine-tuning schedule):
    its gradients stay local, so the ranks' copies of it drift apart."""
    logged = _capture.logged_warnings()
    torch.manual_seed(0)
    inner = Branchy()
    inner.trunk.requires_grad_(False)
    model = DistributedDataParallel(inner)
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    for step in range(5):
        if step == 2:
            inner.trunk.requires_grad_(True)
        torch.manual_seed(100 + 10 * rank + step)  # each rank its own data
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    trunk = inner.trunk.weight.detach().clone()
    gathered = [torch.zeros_like(trunk) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, trunk)
    return {"warnings": logged, "trunk_equal": all(torch.equal(gathered[0], t) for t in gathered)}


def eval_mode(rank: int) -> dict[str, Any]:
    """Rank 0 validates (model.eval()) at step 1 and goes back to train mode, validates again at step 3 and
    stays in eval mode (``tests/support/eval_mode.py``)."""
    logged = _capture.logged_warnings()
    train_forgetting_train_mode(DistributedDataParallel(batchnorm_net()), rank)
    return {"warnings": logged}


def replicas(rank: int) -> dict[str, Any]:
    """A rank-dependent update (``if rank == 0: scheduler.step()``) and a layer added after wrapping."""
    logged = _capture.logged_warnings()
    torch.manual_seed(0)
    inner = Branchy()
    model = DistributedDataParallel(inner)
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(10):
        if step == 5:
            inner.add_module("extra", nn.Linear(8, 8))
        torch.manual_seed(100 + 10 * rank + step)  # each rank its own data
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        if rank == 0 and step >= 2:
            scheduler.step()
    return {"warnings": logged}


def never_synced(rank: int) -> dict[str, Any]:
    """A long accumulation done right, then one that never synchronises while the optimizer steps."""
    logged = _capture.logged_warnings()
    torch.manual_seed(0)
    inner = Branchy()
    model = DistributedDataParallel(inner)
    opt = torch.optim.SGD(inner.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)  # each rank its own data
    for _ in range(40):
        with model.no_sync():
            (model(torch.randn(4, 8)).square().mean() / 41).backward()
    (model(torch.randn(4, 8)).square().mean() / 41).backward()
    opt.step()
    opt.zero_grad()
    for micro in range(40):
        with model.no_sync():
            model(torch.randn(4, 8)).square().mean().backward()
        if micro % 2 == 1:
            opt.step()
            opt.zero_grad()
    return {"warnings": logged}


def rebuilt(rank: int) -> dict[str, Any]:
    """A model wrapped again mid-training: its steps go on from the first wrapper's."""
    torch.manual_seed(0)
    inner = Branchy()
    first = DistributedDataParallel(inner)
    for _ in range(3):
        first(torch.randn(4, 8)).sum().backward()
    second = DistributedDataParallel(inner)  # built again: the same job goes on with it
    for _ in range(2):
        second(torch.randn(4, 8)).sum().backward()
    agent.configure(exporter=agent.InMemoryExporter(), job="failures-rebuilt-gan", rank=rank)
    del first, second
    generator, discriminator = DistributedDataParallel(Branchy()), DistributedDataParallel(Branchy())
    gan = [generator._first_step, discriminator._first_step]
    for _ in range(2):
        generator(torch.randn(4, 8)).sum().backward()
        discriminator(torch.randn(4, 8)).sum().backward()
    return {"gan_first_steps": gan}


def disabled(rank: int) -> dict[str, Any]:
    agent.configure(disabled=True)
    model = DistributedDataParallel(nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    return {"type": f"{type(model).__module__}.{type(model).__name__}"}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    exporter = agent.InMemoryExporter()
    agent.configure(exporter=exporter, job=f"failures-{SCENARIO}", rank=rank)
    result = {
        "mismatch": mismatch,
        "bucket_cap": bucket_cap,
        "missing_grad": missing_grad,
        "progress": progress,
        "disabled": disabled,
        "bypass": bypass,
        "thawed": thawed,
        "eval_mode": eval_mode,
        "never_synced": never_synced,
        "rebuilt": rebuilt,
        "frozen_late": frozen_late,
        "cut_short": cut_short,
        "misaligned": misaligned,
        "misaligned_zeros": misaligned_zeros,
        "replicas": replicas,
    }[SCENARIO](rank)
    agent.get_agent().force_flush(5.0)
    result["records"] = exporter.records
    with open(os.path.join(OUTDIR, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    destroy_together()


if __name__ == "__main__":
    main()
