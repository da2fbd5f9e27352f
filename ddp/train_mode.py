"""A model trained in eval mode: ``model.eval()`` for a validation pass, and no ``model.train()`` after it.

Nothing fails. Dropout is off and BatchNorm normalizes with its running statistics (which it stops
updating), so the rank's forward is another function than in train mode; when only some ranks do it (a
validation run on rank 0 alone), DDP averages gradients of different functions and every rank's update is
wrong. Both engines call ``EvalModeWatch.check`` in every forward with gradients on; a forward in eval mode
counts once a backward followed it (a validation pass with gradients on but no backward is not training),
which the next forward sees. Said once per model, as a ``trains_in_eval_mode`` warning the collector turns
into an incident naming every rank that said it.
"""

from __future__ import annotations

import torch

from ddpscope.agent import emit
from ddpscope.agent.log import get_logger
from ddpscope.agent.records import TRAINS_IN_EVAL_MODE

logger = get_logger(__name__)

MESSAGE = (
    "the model was in eval mode (model.eval()) in the forward and backward of training steps: dropout is off "
    "and BatchNorm normalizes with its running statistics, which it no longer updates, "
    "so the rank computes another function than in train mode, and DDP averages its gradients with its "
    "peers'. Usually a model.eval() for validation with no model.train() after it: call model.train() "
    "before training."
)


class EvalModeWatch:
    """Watches one DDP model's module for training steps run in eval mode (see the module doc)."""

    __slots__ = ("module", "rank", "done", "_pending")

    def __init__(self, module: torch.nn.Module, rank: int) -> None:
        self.module = module
        self.rank = rank
        self.done = False
        self._pending: tuple[int, int] | None = None
        """(step, backwards counted then) of the last forward with gradients on, when it ran in eval mode."""

    def check(self, step: int, backwards: int) -> None:
        """In a forward with gradients on: ``backwards``, the model's count of backward passes so far."""
        if self.done:
            return
        try:
            pending = self._pending
            if pending is not None and backwards != pending[1]:
                self._warn(pending[0])
                return
            self._pending = None if self.module.training else (step, backwards)
        except Exception:
            self.done = True
            logger.debug("ddpscope: checking the model's train mode failed", exc_info=True)

    def _warn(self, step: int) -> None:
        self.done = True
        # The message without the step: ranks that say it at different steps make one incident.
        logger.warning("ddpscope: rank %d: %s", self.rank, MESSAGE)
        emit({"kind": "warning", "step": step, "code": TRAINS_IN_EVAL_MODE, "message": MESSAGE})
