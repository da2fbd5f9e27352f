"""A backward cut short by an exception the training loop catches (an OOM-recovery pattern).

Shared by the engine's and the adapter's job scripts: each DDP then refuses the next forward (the
engine itself, torch's Reducer blaming unused parameters), and the tests check what ddpscope says.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def train_through_a_caught_backward_failure(
    model: torch.nn.Module, batch: Callable[[int], torch.Tensor], hooked: torch.Tensor, steps: int = 3
) -> tuple[RuntimeError | None, list[int]]:
    """Train ``steps`` steps; in step 1 a gradient hook on ``hooked`` raises halfway through backward
    (the parameters after it in backward have their gradients, ``hooked`` and those before it never
    get theirs) and the loop catches it. Returns the error that ended the loop (None if none did) and
    the steps whose backward failed and was caught."""
    caught: list[int] = []

    def explode(grad: torch.Tensor) -> None:
        raise RuntimeError("out of memory (simulated)")

    try:
        for step in range(steps):
            out = model(batch(step))
            handle = hooked.register_hook(explode) if step == 1 else None
            try:
                out.sum().backward()
            except RuntimeError as e:
                if "out of memory" not in str(e):
                    raise
                caught.append(step)
            finally:
                if handle is not None:
                    handle.remove()
        return None, caught
    except RuntimeError as e:
        return e, caught
