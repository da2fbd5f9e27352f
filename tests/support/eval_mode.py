"""A training loop where rank 0 validates and forgets ``model.train()``, for both engines' job scripts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VALIDATES_AT = 1
"""Every rank validates with gradients on and no backward, then goes back to train mode: not a finding.
(On one rank alone that forward would broadcast the buffers to nobody: a hang.)"""
FORGETS_AT = 3
"""Rank 0 validates again, under no_grad, and stays in eval mode: every training step from here is."""
STEPS = 6


def batchnorm_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))


def train_forgetting_train_mode(model: Any, rank: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        if step == VALIDATES_AT:
            model.eval()
            model(torch.randn(8, 8)).sum()  # gradients on, no backward
            model.train()
        if step == FORGETS_AT and rank == 0:
            model.eval()
            with torch.no_grad():
                model(torch.randn(8, 8))
        torch.manual_seed(100 + 10 * rank + step)
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
