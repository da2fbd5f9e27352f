"""Gradients that reach a DDP model's parameters with no forward through the wrapper.

``loss = model.module(x)`` (or a method of the inner module, ``model.module.compute_loss(batch)``) in a
training step runs backward into the parameters while DDP expects nothing: torch's Reducer ignores those
gradients without a word, so they are never all-reduced, and an optimizer step on them makes this rank's
parameters drift from its peers' for the rest of the run. Silent on gloo and NCCL alike. The engine and
``instrument()`` both see it from their per-parameter hooks: a gradient arriving while no forward through
the wrapper awaits its backward. ``no_sync()`` is not this (its forward goes through the wrapper).

Said once per model, at the end of that backward, naming every parameter it hit and the user's line.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ddpscope.ddp.collectives import RECORDER

logger = logging.getLogger(__name__)


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
            shown = ", ".join(repr(n) for n in names[:3]) + (
                f" and {len(names) - 3} more" if len(names) > 3 else ""
            )
            logger.warning(
                "ddpscope: the backward%s (rank %d, after step %d) gave %d parameter(s) of this "
                "DistributedDataParallel model a gradient without a forward through the model (%s): those "
                "gradients were not all-reduced. If an optimizer steps on them, this rank's parameters drift "
                "from the other ranks' from now on. Call the DDP model itself, not model.module(...) or a "
                "method of the inner module; for deliberate local accumulation use no_sync(). (Said once.)",
                f" at {site}" if site else "", self.rank, step, len(names), shown,
            )  # fmt: skip
        except Exception:
            logger.debug("ddpscope: the warning about gradients outside a DDP forward failed", exc_info=True)
