"""Gradients that DDP never all-reduces, so the rank's parameters drift from its peers' without an error.

Torch's Reducer (and the engine, which keeps its contract) all-reduces the gradients of the parameters
that required a gradient when the model was wrapped, in the first backward after a forward through the
wrapper. Anything else stays local to the rank, silently, on gloo and NCCL alike:

- a parameter frozen at wrap time and unfrozen later (a fine-tuning schedule that thaws layers);
- a backward that no forward through the wrapper prepared (``outside_forward``).

(Freezing after wrapping is the opposite: DDP waits for a gradient that never comes, an error.)

``warn_unsynced`` says so twice: a warning in this process's log and a ``warning`` record, which the
collector turns into an ``unsynced_gradients`` incident naming every rank that said it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from ddpscope.agent import emit
from ddpscope.agent.log import get_logger
from ddpscope.agent.records import UNSYNCED_GRADIENTS

logger = get_logger(__name__)

CODE = UNSYNCED_GRADIENTS
MAX_NAMES = 200
"""Parameter names carried by a record (a thawed backbone can have thousands)."""


FROZEN_AFTER_WRAP = (
    "{names} were frozen (requires_grad=False) after DistributedDataParallel was built, and it "
    "all-reduces the parameters that required a gradient then: build it again after freezing (torch's "
    "DDP has the same rule)."
)
"""The opposite mistake, said in the engines' missing-gradient errors: a parameter frozen after wrapping
gets no gradient while DDP waits for it (the collector reads "frozen (requires_grad=False) after")."""
UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"
"""torch's Reducer error for a previous backward that left parameters without a gradient."""
BACKWARD_CUT_SHORT = (
    "the backward of step {step} began on this rank and never finished (it raised: an exception your "
    "training loop caught and went on?), so torch's Reducer still waited for the gradients it did not "
    "produce; the parameters torch lists were not unused. The gradients of step {step} differ across ranks: "
    "restart from a checkpoint, or let such an exception end the job."
)
"""Said on torch's unfinished-reduction error when the previous backward was cut short, where torch's
advice (find_unused_parameters) is wrong (the collector reads "began on this rank and never finished")."""


def shown(names: Sequence[str]) -> str:
    """``'a', 'b', 'c' and 4 more``."""
    return ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def warn_unsynced(
    rank: int, step: int | None, message: str, parameters: Sequence[str], call_site: str | None = None
) -> None:
    """Log ``message`` (written without the rank) and ship it as a ``warning`` record. Never raises."""
    try:
        logger.warning("ddpscope: rank %d: %s", rank, message)
        emit(
            {
                "kind": "warning",
                "step": step,
                "code": CODE,
                "message": message,
                "parameters": list(parameters[:MAX_NAMES]),
                "call_site": call_site,
            }
        )
    except Exception:  # a diagnostic never raises into training
        logger.debug("ddpscope: the warning about unsynced gradients failed", exc_info=True)


class FrozenAtWrap:
    """The parameters that did not require a gradient when the model was wrapped, watched for being
    unfrozen. ``check`` runs in every training forward and looks at ``PER_CHECK`` of them in turn, so a
    model with thousands of frozen parameters (an adapter fine-tune) pays a few microseconds a step and
    hears about a thawed layer within ``len / PER_CHECK`` steps. Said once per model."""

    PER_CHECK = 64

    def __init__(self, module: torch.nn.Module, rank: int, ignored: Collection[str] = ()) -> None:
        """``ignored``: parameters the user excluded from DDP on purpose (``_ddp_params_and_buffers_to_ignore``)."""
        frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad and n not in ignored]
        self.names = [n for n, _ in frozen]
        self.params = [p for _, p in frozen]
        self.rank = rank
        self.done = not self.params
        self._next = 0

    def check(self, step: int) -> None:
        if self.done:
            return
        try:
            start = self._next
            end = min(len(self.params), start + self.PER_CHECK)
            self._next = 0 if end == len(self.params) else end
            for i in range(start, end):
                if self.params[i].requires_grad:
                    self._warn(step)
                    return
        except Exception:
            self.done = True
            logger.debug("ddpscope: checking frozen parameters failed", exc_info=True)

    def _warn(self, step: int) -> None:
        self.done = True
        thawed = [n for n, p in zip(self.names, self.params, strict=True) if p.requires_grad]
        warn_unsynced(
            self.rank,
            step,
            f"{len(thawed)} parameter(s) that were frozen (requires_grad=False) when the model was wrapped in "
            f"DistributedDataParallel now require a gradient ({shown(thawed)}). DDP fixes the parameters it "
            "all-reduces when it is built, so their gradients stay local to each rank and an optimizer step "
            "on them makes the ranks' copies drift apart. Build the DistributedDataParallel model again "
            "after unfreezing (torch's has the same rule).",
            thawed,
        )
