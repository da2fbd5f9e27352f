"""The tensors of a forward's output that a backward will flow through.

Both engines (reducer.py and the ``instrument()`` adapter) put a gradient hook on them: it marks the
start of backward and queues the end-of-backward work even when no parameter of this rank gets a
gradient (an unsynchronised step, or a rank whose loss reaches no parameter).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def grad_tensors(outputs: Any, limit: int | None = 64) -> list[torch.Tensor]:
    """Tensors requiring grad in a forward's output, at most ``limit`` (None: every one). Walked as
    torch's DDP walks it (``_find_tensors``): nested tuples (named ones too), lists, dict values and
    dataclass fields.

    The limit bounds the walk over huge nested outputs: one hooked tensor is enough to see backward
    start, a few more cover outputs of which only some take part in the loss. Finding the unused
    parameters needs them all (None): a parameter reached only from a tensor left out would read as
    unused and then get its gradient after all.
    """
    found: list[torch.Tensor] = []
    stack = [outputs]
    while stack and (limit is None or len(found) < limit):
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad:
                found.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
    return found


def hook_backward_start(tensors: list[torch.Tensor], hook: Callable[[Any], None]) -> None:
    """Call ``hook`` when the backward reaches any of ``tensors``: with the gradient (a leaf output, a
    parameter itself) or the node's tuple of gradients (any other output)."""
    for t in tensors:
        node = t.grad_fn
        if node is None:
            t.register_hook(hook)
        else:
            # Bound in C++: ~2 us a step, where Tensor.register_hook's Python wrapper costs ~5 us.
            node.register_prehook(hook)
