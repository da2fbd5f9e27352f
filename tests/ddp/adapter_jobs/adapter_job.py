"""Stock torch DDP with and without ``instrument()``, side by side in one job, per scenario.

    python adapter_job.py SCENARIO OUT_DIR

Each rank writes its records to OUT_DIR/rank<R>.jsonl (the failure jobs' JSON-lines exporter) and
what the test checks to OUT_DIR/rank<R>.json.

Scenarios:
  parity   a plain and an instrumented DDP model from the same seed, trained on the same batches
           (one no_sync() accumulation step included); DDP's own sampled timings of every step.
  unused   the same with find_unused_parameters=True and a branch used only on odd steps.
  userhook torch's fp16_compress_hook registered on the plain model and passed through instrument();
           and the refusal of a model that already has a hook.
  hookafter the same hook registered on the instrumented model after instrument(), then once more.
  hooklate a user's comm hook passed through instrument() returns, on rank 1 at step 2, a future of its own that
           a timer thread completes JOB_STALL_S later (all-reducing the bucket then): a hook that issued no
           collective when the hang report came. DDPSCOPE_HANG_TIMEOUT set by the test.
  hang     rank 1 sleeps inside backward at step 2 and between forward and backward at step 4 (JOB_STALL_S);
           DDPSCOPE_HANG_TIMEOUT set by the test.
  asview   gradient_as_bucket_view=True, gradients kept between steps (zero_grad(set_to_none=False)):
           torch then divides in the bucket instead of multiplying; run with 3 ranks to tell them apart.
  disabled DDPSCOPE_DISABLED=1 (set by the test): what instrument() attached, if anything.
  static   static_graph=True (torch delays the first step's all-reduces to the end of backward).
  sparse   an nn.Embedding with sparse gradients next to dense layers (a bucket of its own).
  join     uneven inputs under torch's Join: rank 1 runs out of batches two steps early, and its
           Join hook shadows the all-reduces of the steps it misses.
  bypass   rank 0 trains two steps through model.module (torch all-reduces nothing), rank 1 the same two
           under no_sync(); the warnings each rank logged.
  frozen_late  the first layer frozen after instrumenting: the note ddpscope adds to torch's error.
  cut_short  a hook raises in the backward of step 1 on every rank, the loop catches it and goes on:
           the note ddpscope adds to torch's error at step 2's forward.
  eval_mode rank 0 validates at step 1 (model.eval(), then model.train()) and at step 3, staying in eval mode.
  thawed   the first layer frozen when wrapped and unfrozen after two steps; the warnings, and whether
           the ranks' copies of that layer still agree.
  replicas rank 0 alone steps an LR scheduler after step 2, so the ranks' copies drift apart; a layer is
           added to the module after wrapping at step 5.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "failure_jobs"))
import _capture  # noqa: E402  (the failure jobs' JSON-lines exporter, shared)

from ddpscope.ddp.adapter import instrument, instrumentation  # noqa: E402
from tests.support.cut_short import train_through_a_caught_backward_failure  # noqa: E402
from tests.support.eval_mode import batchnorm_net, train_forgetting_train_mode  # noqa: E402
from tests.support.job_end import destroy_together  # noqa: E402

STEPS = 6
NO_SYNC_STEP = 3
STALL_S = float(os.environ.get("JOB_STALL_S", "3.0"))


def mlp(layers: int = 6, width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


class Branchy(nn.Module):
    """``odd`` takes part on odd steps only; ``never`` never does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(64, 64)
        self.odd = nn.Linear(64, 64)
        self.never = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        if self.step % 2:
            h = h + self.odd(h)
        return self.head(h)


def batch(rank: int, step: int, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, width, generator=g)


def timings(model: DDP) -> dict[str, Any]:
    data = model._get_ddp_logging_data()
    return {k: v for k, v in data.items() if isinstance(v, (int, str))}


def train_pair(
    plain: DDP, inst: DDP, rank: int, width: int, set_step: bool = False, set_to_none: bool = True
) -> list[dict[str, Any]]:
    """The same steps on both models; returns DDP's logging data read after each synced forward."""
    inst._set_ddp_runtime_logging_sample_rate(1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, inst)]
    logged = []
    for step in range(STEPS):
        x = batch(rank, step, width)
        for m, opt in zip((plain, inst), opts, strict=True):
            if set_step:
                m.module.step = step
            if step == NO_SYNC_STEP:
                with m.no_sync():
                    m(x).square().mean().backward()
                continue  # gradients accumulate into the next step
            out = m(x)
            if m is inst:
                logged.append({"read_at_step": step, **timings(m)})
            out.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    return logged


def compare(plain: DDP, inst: DDP) -> dict[str, Any]:
    pairs = list(zip(plain.module.parameters(), inst.module.parameters(), strict=True))
    return {
        "identical": all(torch.equal(a, b) for a, b in pairs),
        "max_diff": max(float((a - b).detach().abs().max()) for a, b in pairs),
    }


def parity(rank: int) -> dict[str, Any]:
    plain = DDP(mlp())
    inst = instrument(DDP(mlp()))
    logged = train_pair(plain, inst, rank, 256)
    state = instrumentation(inst)
    assert state is not None
    return {**compare(plain, inst), "logged": logged, "reducer_parameters": list(state.layout.names)}


def unused(rank: int) -> dict[str, Any]:
    plain = DDP(Branchy(), find_unused_parameters=True)
    inst = instrument(DDP(Branchy(), find_unused_parameters=True))
    train_pair(plain, inst, rank, 64, set_step=True)
    return compare(plain, inst)


def asview(rank: int) -> dict[str, Any]:
    plain = DDP(mlp(), gradient_as_bucket_view=True)
    inst = instrument(DDP(mlp(), gradient_as_bucket_view=True))
    train_pair(plain, inst, rank, 256, set_to_none=False)
    return compare(plain, inst)


def static(rank: int) -> dict[str, Any]:
    plain = DDP(mlp(), static_graph=True)
    inst = instrument(DDP(mlp(), static_graph=True))
    train_pair(plain, inst, rank, 256)
    return compare(plain, inst)


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 32, sparse=True)
        self.head = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed((x.abs() * 10).long().clamp(max=99)).mean(1))


def sparse(rank: int) -> dict[str, Any]:
    plain = DDP(Sparse())
    inst = instrument(DDP(Sparse()))
    logged = train_pair(plain, inst, rank, 16)
    state = instrumentation(inst)
    assert state is not None
    return {**compare(plain, inst), "logged": logged[-1:], "reducer_parameters": list(state.layout.names)}


def join(rank: int) -> dict[str, Any]:
    from torch.distributed.algorithms.join import Join

    models = (DDP(mlp()), instrument(DDP(mlp())))
    batches = STEPS - 2 * rank  # rank 1 runs out early
    for model in models:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with Join([model]):
            for step in range(batches):
                model(batch(rank, step, 256)).square().mean().backward()
                opt.step()
                opt.zero_grad()
    return compare(*models)


def hookafter(rank: int) -> dict[str, Any]:
    plain = DDP(mlp())
    plain.register_comm_hook(None, fp16_compress_hook)
    inst = instrument(DDP(mlp()))
    inst.register_comm_hook(None, fp16_compress_hook)  # after instrument(): ddpscope adopts it
    train_pair(plain, inst, rank, 256)
    try:
        inst.register_comm_hook(None, fp16_compress_hook)
        second = ""
    except RuntimeError as e:
        second = str(e)
    return {**compare(plain, inst), "second": second}


def userhook(rank: int) -> dict[str, Any]:
    plain = DDP(mlp())
    plain.register_comm_hook(None, fp16_compress_hook)
    inst = instrument(DDP(mlp()), comm_hook=fp16_compress_hook)
    train_pair(plain, inst, rank, 256)
    hooked = DDP(mlp(2, 16))
    hooked.register_comm_hook(None, fp16_compress_hook)
    try:
        instrument(hooked)
        refusal = ""
    except ValueError as e:
        refusal = str(e)
    return {**compare(plain, inst), "refusal": refusal}


def hooklate(rank: int) -> dict[str, Any]:
    step = [0]

    def late_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer().div_(dist.get_world_size())
        if rank == 1 and step[0] == 2:
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()

            def complete() -> None:
                dist.all_reduce(buf)
                fut.set_result(buf)

            threading.Timer(STALL_S, complete).start()
            return fut
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    model = instrument(DDP(mlp(2, 64)), comm_hook=late_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step[0] in range(4):
        model(batch(rank, step[0], 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {"hook_line": late_hook.__code__.co_firstlineno}


class Stall(nn.Module):
    """Identity whose gradient hook sleeps on the chosen rank and step: a rank stuck in backward."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1 and self.step == 2 and x.requires_grad:
            x.register_hook(lambda g: time.sleep(STALL_S))
        return x


def hang(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    stall = Stall(rank)
    layers = [nn.Linear(256, 256) for _ in range(6)]
    model = instrument(DDP(nn.Sequential(*layers[:2], stall, *layers[2:])))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        stall.step = step
        loss = model(batch(rank, step, 256)).square().mean()
        if rank == 1 and step == 4:
            time.sleep(STALL_S)  # between forward and backward: a slow loss, no gradient awaited yet
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {}


def disabled(rank: int) -> dict[str, Any]:
    model = DDP(mlp(2, 16))
    same = instrument(model, comm_hook=fp16_compress_hook)
    model(batch(rank, 0, 16)).sum().backward()
    return {
        "same_object": same is model,
        "instrumentation": instrumentation(model) is not None,
        "forward_hooks": len(model._forward_pre_hooks) + len(model._forward_hooks),
        "comm_hooks": [hook.__name__ for hook, _ in model._comm_hooks],
        "param_hooks": sum(
            len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()
        ),
    }


def bypass(rank: int) -> dict[str, Any]:
    logged = _capture.logged_warnings()
    torch.manual_seed(0)
    model = instrument(DDP(mlp(2, 16)))
    x = batch(rank, 0, 16)
    model(x).sum().backward()
    for _ in range(2):
        if rank == 0:
            model.module(x).sum().backward()  # the bug: a training step that bypasses the wrapper
        else:
            with model.no_sync():
                model(x).sum().backward()
    model(x).sum().backward()
    return {"warnings": logged}


def thawed(rank: int) -> dict[str, Any]:
    """The first layer frozen when wrapped, unfrozen after two steps: torch never all-reduces it."""
    logged = _capture.logged_warnings()
    inner = mlp(2, 16)
    inner[0].requires_grad_(False)
    model = instrument(DDP(inner))
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    for step in range(5):
        if step == 2:
            inner[0].requires_grad_(True)
        opt.zero_grad()
        model(batch(rank, step, 16)).sum().backward()
        opt.step()
    first = inner[0].weight.detach().clone()
    gathered = [torch.zeros_like(first) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, first)
    return {"warnings": logged, "first_equal": all(torch.equal(gathered[0], t) for t in gathered)}


def eval_mode(rank: int) -> dict[str, Any]:
    """Rank 0 validates at step 1 and goes back to train mode, validates again at step 3 and stays in eval
    mode (``tests/support/eval_mode.py``)."""
    logged = _capture.logged_warnings()
    train_forgetting_train_mode(instrument(DDP(batchnorm_net())), rank)
    return {"warnings": logged}


def penalty(rank: int) -> dict[str, Any]:
    """A gradient penalty (WGAN-GP): each step's ``autograd.grad`` of the output with respect to the input,
    through the DDP outputs, before the backward that reaches the parameters. Its graph task touches no
    parameter: torch's Reducer never sees it, and instrument() must not take it for the step's backward."""
    plain, inst = DDP(mlp(3, 32)), instrument(DDP(mlp(3, 32)))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, inst)]
    for step in range(STEPS):
        x = batch(rank, step, 32).requires_grad_()
        for m, opt in zip((plain, inst), opts, strict=True):
            out = m(x)
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            (out.square().mean() + (g.norm(2, dim=1) - 1).square().mean()).backward()
            opt.step()
            opt.zero_grad()
    return compare(plain, inst)


def replicas(rank: int) -> dict[str, Any]:
    """A rank-dependent update (``if rank == 0: scheduler.step()``) and a layer added after wrapping."""
    logged = _capture.logged_warnings()
    inner = mlp(2, 16)
    model = instrument(DDP(inner))
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(10):
        if step == 5:
            inner.add_module("extra", nn.Linear(16, 16))
        opt.zero_grad()
        model(batch(rank, step, 16)).sum().backward()
        opt.step()
        if rank == 0 and step >= 2:
            scheduler.step()
    return {"warnings": logged}


def frozen_late(rank: int) -> dict[str, Any]:
    """The first layer frozen on every rank after instrumenting: torch's Reducer fails the next step."""
    inner = mlp(2, 16)
    model = instrument(DDP(inner))
    inner[0].requires_grad_(False)
    try:
        for step in range(2):
            model(batch(rank, step, 16)).sum().backward()
        return {"notes": None}
    except RuntimeError as e:
        return {"notes": getattr(e, "__notes__", [])}


def cut_short(rank: int) -> dict[str, Any]:
    """An exception in backward that the training loop catches (an OOM-recovery pattern): torch's
    Reducer then blames unused parameters at the next forward, and ddpscope's note says otherwise."""
    inner = mlp(3, 16)
    model = instrument(DDP(inner))
    # Halfway through backward: the last layer has its gradients, the first never gets them.
    error, caught = train_through_a_caught_backward_failure(
        model, lambda step: batch(rank, step, 16), inner[1].weight
    )
    return {"notes": None if error is None else getattr(error, "__notes__", []), "caught": caught}


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    _capture.capture(out_dir)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    result = {
        "parity": parity,
        "unused": unused,
        "userhook": userhook,
        "hookafter": hookafter,
        "hang": hang,
        "hooklate": hooklate,
        "asview": asview,
        "disabled": disabled,
        "static": static,
        "sparse": sparse,
        "join": join,
        "bypass": bypass,
        "thawed": thawed,
        "eval_mode": eval_mode,
        "frozen_late": frozen_late,
        "cut_short": cut_short,
        "replicas": replicas,
        "penalty": penalty,
    }[scenario](rank)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    _capture.flush()
    destroy_together()


if __name__ == "__main__":
    main()
