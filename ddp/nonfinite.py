"""A rank whose loss goes NaN or Inf: said when it begins and when it ends, so the collector can name the
rank it began on (``server/analysis/nonfinite.py``).

DDP averages the ranks' gradients, so a NaN in one rank's loss is in every rank's gradients after that
step's all-reduce, and in every rank's parameters after the optimizer step: from then on every rank logs
``loss: nan``, and nothing says which rank's batch began it. Both engines already hook the gradient the
loss sends into the model's output (the first sign of backward, ``outputs.py``); ``LossWatch`` checks
there that it is finite. The check is one sum of that gradient: NaN and Inf survive a sum, and a sum
costs ~7 us for a classifier's logits on this machine, where ``isfinite().all()`` costs ~37 us (and 70
times as much on a language model's logits). A half-precision gradient is summed in float32, whose
range no finite gradient's sum reaches.

A run of non-finite steps is said twice, as ``warning`` records (code ``nonfinite_loss``): when it begins,
and at the end of the first later backward whose gradient was finite again (``finite_again_step``: a loss scaler such as
``torch.amp.GradScaler`` skips such a step). Each carries the rank's count of synchronised backwards,
which the ranks share whatever forwards each ran alone, so the collector can tell the rank that went
first from the ranks the all-reduce then reached. At most ``MAX_RUNS`` runs per model are said.

On CUDA the answer is read without synchronising the host: the flag is copied to pinned host memory
behind an event and read at a later check once the event has completed. UNTESTED: this machine has no GPU.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

from ddpscope import agent
from ddpscope.agent.records import NONFINITE_LOSS

logger = logging.getLogger(__name__)

MAX_RUNS = 10
"""Runs of non-finite steps said per model: a job under a loss scaler skips a step now and then for days."""


def _sum(grad: torch.Tensor) -> torch.Tensor:
    if grad.dtype in (torch.float16, torch.bfloat16):
        return grad.sum(dtype=torch.float32)
    return grad.sum()


class LossWatch:
    """Per model: watches the gradient its loss sends into its output in every training backward."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._run: tuple[int, int] | None = None
        """(step, syncs) where the current run of non-finite steps began; None while finite."""
        self._runs = 0
        """Runs begun, the current one included: those beyond ``MAX_RUNS`` are not said."""
        self._step = -1
        """The step checked last, and whether any of its gradients was non-finite (a model with several
        outputs is checked once per output): a run ends only when a whole step was finite."""
        self._step_bad = False
        self._pending: deque[tuple[torch.Tensor, Any, int, int]] = deque()
        """CUDA: (pinned host flag, event, step, syncs) of checks whose answer is still on its way."""
        self._spare: list[torch.Tensor] = []
        """CUDA: pinned host flags read already, to be written again (a pinned allocation is not free)."""

    def check(self, grad: Any, step: int, syncs: int) -> None:
        """From the output-gradient hook of step ``step``'s backward, after ``syncs`` synchronised backwards:
        ``grad`` is a tensor or a node's tuple of gradients (None where an output got none). Never raises."""
        try:
            if self._pending:
                self._read_pending()
            grads = [
                g
                for g in (grad if isinstance(grad, tuple) else (grad,))
                if isinstance(g, torch.Tensor) and (g.is_floating_point() or g.is_complex())
            ]
            if grads and grads[0].is_cuda:
                self._defer(grads, step, syncs)
            else:
                self._observe(all(bool(_sum(g).isfinite()) for g in grads), step, syncs)
        except Exception:  # a diagnostic never raises into training
            logger.debug("ddpscope: checking the loss gradient failed", exc_info=True)

    def backward_done(self) -> None:
        """From the end of a training backward, when every output's gradient was checked: a step finite
        throughout ends a run at once (on CUDA, at the next check, when its answer has arrived)."""
        if self._run is not None and not self._step_bad and not self._pending:
            self._end(self._step)

    def _defer(self, grads: list[torch.Tensor], step: int, syncs: int) -> None:
        total = _sum(grads[0])
        for g in grads[1:]:
            total = total + _sum(g).to(total.device)  # NaN and Inf survive the addition too
        flag = self._spare.pop() if self._spare else torch.empty((), dtype=torch.bool, pin_memory=True)
        flag.copy_(total.isfinite(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((flag, event, step, syncs))

    def _read_pending(self) -> None:
        while self._pending and self._pending[0][1].query():
            flag, _, step, syncs = self._pending.popleft()
            self._observe(bool(flag), step, syncs)
            self._spare.append(flag)

    def _observe(self, finite: bool, step: int, syncs: int) -> None:
        if step != self._step:
            if self._run is not None and not self._step_bad:
                self._end(self._step)  # the last step checked was finite throughout
            self._step, self._step_bad = step, False
        if not finite:
            self._step_bad = True
            if self._run is None:
                self._run = (step, syncs)
                self._runs += 1
                if self._runs <= MAX_RUNS:
                    self._say(step, syncs, None)

    def _end(self, finite_step: int) -> None:
        assert self._run is not None
        start, start_syncs = self._run
        self._run = None
        if self._runs <= MAX_RUNS:  # its beginning was said
            self._say(start, start_syncs, finite_step)

    def _say(self, step: int, syncs: int, finite_again_step: int | None) -> None:
        if finite_again_step is None:
            message = (
                f"the gradient its loss sent into the model's output was NaN or Inf at step {step} (a NaN or Inf "
                "loss or model output); DDP's all-reduce puts it in every rank's gradients."
            )
            logger.warning("ddpscope: rank %d: %s", self._rank, message)
        else:
            message = (
                f"its loss gradient was finite again from step {finite_again_step}, after NaN or Inf from step "
                f"{step}."
            )
            logger.info("ddpscope: rank %d: %s", self._rank, message)
        record: dict[str, Any] = {
            "kind": "warning",
            "step": step,
            "code": NONFINITE_LOSS,
            "message": message,
            "syncs": syncs,
        }
        if finite_again_step is not None:
            record["finite_again_step"] = finite_again_step
        # Durable: a loop that stops on a NaN loss often dies right after it.
        agent.emit_durable(record)
