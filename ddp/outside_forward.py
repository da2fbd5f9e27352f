"""Gradients that reach a DDP model's parameters with no forward through the wrapper.

``loss = model.module(x)`` (or a method of the inner module, ``model.module.compute_loss(batch)``) in a
training step runs backward into the parameters while DDP expects nothing: torch's Reducer ignores those
gradients without a word, so they are never all-reduced, and an optimizer step on them makes this rank's
parameters drift from its peers' for the rest of the run. Silent on gloo and NCCL alike. The engine and
``instrument()`` both see it from their per-parameter hooks: a gradient arriving while no forward through
the wrapper awaits its backward. ``no_sync()`` is not this (its forward goes through the wrapper).

The same happens to a second ``backward()`` of one forward's output: only the first backward after a
forward through the wrapper is all-reduced, and the hooks cannot tell the two apart, so the warning
names both causes. Said once per model, at the end of that backward, naming every parameter it hit and
the user's line (``drift.warn_unsynced``: logged and sent to the collector).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddpscope.agent.log import get_logger
from ddpscope.ddp.collectives import RECORDER
from ddpscope.ddp.drift import shown, warn_unsynced

logger = get_logger(__name__)


class OutsideForward:
    """Per model: note the parameters a backward outside any DDP forward reached; warn once."""

    def __init__(self, names: Sequence[str], rank: int) -> None:
        self.names = names
        self.rank = rank
        self.warned = False
        self._hit: list[int] = []

    def note(self, index: int, step: int) -> None:
        """From a parameter hook, with no forward through the wrapper pending. Never raises."""
        if self.warned:
            return
        try:
            if not self._hit:
                site = RECORDER.call_site(1)  # the user's backward() line: hooks run in its thread
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._warn(site, step))
            self._hit.append(index)
        except Exception:  # a diagnostic never raises into training
            logger.debug("ddpscope: noting a gradient outside a DDP forward failed", exc_info=True)

    def _warn(self, site: str | None, step: int) -> None:
        # An autograd callback: anything raised here would surface in the user's backward().
        try:
            names = [self.names[i] for i in self._hit]
            self._hit = []
            self.warned = True
            warn_unsynced(
                self.rank,
                step,
                f"the backward(){f' at {site}' if site else ''} gave {len(names)} parameter(s) of a "
                f"DistributedDataParallel model a gradient that no forward through the model had prepared "
                f"({shown(names)}): those gradients were not all-reduced, and an optimizer step on them makes "
                "the ranks' copies of the model drift apart. Either the forward bypassed the wrapper "
                "(model.module(x) or a method of the inner module: call the DDP model itself), or this is a "
                "second backward() of one forward's output (retain_graph=True, or two losses backpropagated "
                "one after the other: add the losses and call backward() once). For deliberate local "
                "accumulation use no_sync().",
                names,
                site,
            )
        except Exception:
            logger.debug("ddpscope: the warning about gradients outside a DDP forward failed", exc_info=True)
