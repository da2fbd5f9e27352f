"""A rank of a 2-rank job whose rank 1 gets a batch with a NaN in it at step NAN_STEP (DDPSCOPE_URL,
DDPSCOPE_JOB from the env), or whose rank 1's backward makes one.

    python nan_batch.py spread|skipped|backward|update ddpscope|torch

The engine: ddpscope's, or torch's DDP observed by ``instrument()``.

``spread``: the loop steps the optimizer as usual, so the NaN the all-reduce averaged into every rank's
gradients is in every rank's parameters from then on: rank 0's loss is NaN from the next step. ``skipped``:
the loop skips the optimizer step when the (all-reduced, so the same on every rank) gradients are not
finite, as a loss scaler does: every rank is finite again from the next step. ``backward``: with
``DDPSCOPE_CHECK_GRADIENTS``, rank 1's batch holds a row of zeros at NAN_STEP, whose feature norm is 0: its loss
is finite, but the norm's backward divides 0 by 0 into ``proj.weight``'s gradient (and the optimizer steps, so
every rank's loss is NaN from the next step). ``update``: every batch is finite, but after the all-reduce of
step NAN_STEP - 1 rank 1 alone puts a NaN into one gradient and clips its gradients by their norm (a local
clip), so the optimizer makes every parameter of rank 1 NaN: its loss is NaN at NAN_STEP, rank 0's one step
later.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from ddpscope import agent
from tests.support.job_model import finish, wrap

STEPS = 8
NAN_STEP = 3


class Normed(nn.Module):
    """Logits plus each sample's feature norm, written by hand as the square root of a sum of squares: its
    backward divides 0 by 0 at a zero feature vector (``torch.linalg.vector_norm``'s returns 0 there)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32, bias=False)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.head(torch.relu(h)) + h.square().sum(dim=1, keepdim=True).sqrt()


def main() -> None:
    mode, engine = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if mode == "backward":
        agent.configure(check_gradients=True)  # DDPSCOPE_CHECK_GRADIENTS=1, the rest from the env
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Normed() if mode == "backward" else nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model = wrap(net, engine)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)
    for step in range(STEPS):
        opt.zero_grad()
        x = torch.randn(8, 16)
        if rank == 1 and step == NAN_STEP and mode != "update":
            if mode == "backward":
                x[2] = 0.0  # a finite loss, a NaN gradient
            else:
                x[2, 5] = float("nan")  # one bad sample in this rank's batch
        loss = (model(x) - 1).square().mean()
        loss.backward()
        if mode == "update" and rank == 1 and step == NAN_STEP - 1:
            first = next(iter(model.parameters()))
            assert first.grad is not None
            first.grad[0, 0] = float("nan")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        finite = all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)
        if finite or mode != "skipped":
            opt.step()
    finish(STEPS - 1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
