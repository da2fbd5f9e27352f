"""NaN and Inf in a rank's loss or gradients: said when a run of such steps begins and when it ends, so the
collector can name the rank it began on (``server/analysis/nonfinite.py``).

DDP averages the ranks' gradients, so a NaN in one rank's loss is in every rank's gradients after that
step's all-reduce, and in every rank's parameters after the optimizer step: from then on every rank logs
``loss: nan``, and nothing says which rank's batch began it. Both engines already hook the gradient the
loss sends into the model's output (the first sign of backward, ``outputs.py``); ``LossWatch`` checks
there that it is finite. The check is one sum of that gradient: NaN and Inf survive a sum, and a sum
costs ~7 us for a classifier's logits on this machine, where ``isfinite().all()`` costs ~37 us (and 70
times as much on a language model's logits). A half-precision gradient is summed in float32, whose
range no finite gradient's sum reaches.

A NaN can also arise inside backward while the loss is finite (sqrt or norm at zero, a log of an underflow,
an overflow in float16). ``GradientWatch``, on only with ``DDPSCOPE_CHECK_GRADIENTS=1`` because it sums every
gradient bucket before its all-reduce (one pass over all gradients a step), names the rank, the first bucket
whose gradients were not finite, and that bucket's parameters with non-finite gradients, nearest the output
first: backward reaches them first, so the operation that made the NaN lies between the nearest of them and
the loss. A step whose loss gradient was already not finite is the loss's doing, not backward's: it begins no
gradient run.

A run of non-finite steps is said twice, as ``warning`` records (code ``nonfinite_loss`` or
``nonfinite_gradient``): when it begins, and at the end of the first later backward that was finite again
(``finite_again_step``: a loss scaler such as ``torch.amp.GradScaler`` skips such a step). Each carries the
rank's count of synchronised backwards, which the ranks share whatever forwards each ran alone, so the
collector can tell the rank that went first from the ranks the all-reduce then reached. At most
``MAX_RUNS`` runs per model and kind are said.

On CUDA the loss check's answer is read without synchronising the host: the flag is copied to pinned host
memory behind an event and read at a later check once the event has completed. The gradient check, a
debugging mode, synchronises the host at each bucket. UNTESTED: this machine has no GPU.
"""

from __future__ import annotations

import cmath
import itertools
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ddpscope import agent
from ddpscope.agent.config import DDPSCOPE_CHECK_GRADIENTS
from ddpscope.agent.log import get_logger
from ddpscope.agent.records import NONFINITE_GRADIENT, NONFINITE_LOSS

logger = get_logger(__name__)

MAX_RUNS = 10
"""Runs of non-finite steps said per model and kind: a job under a loss scaler skips a step now and then for
days."""
MAX_NAMED = 8
"""Parameters a ``nonfinite_gradient`` warning names (the nearest the output)."""


def _sum(grad: torch.Tensor) -> torch.Tensor:
    if grad.dtype in (torch.float16, torch.bfloat16):
        return grad.sum(dtype=torch.float32)
    return grad.sum()


def _finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or Inf: its sum is finite (on CUDA this synchronises the host). The sum is
    read as a Python number and tested there: ``isfinite`` on a 0-d tensor dispatches several kernels,
    ~5 us in a warm loop and tens of us at the start of a backward, against ~0.2 us for ``item()``."""
    total = _sum(t).item()
    return cmath.isfinite(total) if isinstance(total, complex) else math.isfinite(total)


def gradient_check_enabled() -> bool:
    """``DDPSCOPE_CHECK_GRADIENTS``: the agent's config (``agent.configure(check_gradients=True)``), else the
    environment. Read when a model is wrapped."""
    try:
        config = getattr(agent.get_agent(), "config", None)
    except Exception:
        config = None
    if config is not None:
        return bool(getattr(config, "check_gradients", False))
    return os.environ.get(DDPSCOPE_CHECK_GRADIENTS, "").strip().lower() in ("1", "true", "yes", "on")


class _Runs:
    """One rank's runs of steps with something non-finite, each said when it begins and when it ends."""

    code = ""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._run: tuple[int, int] | None = None
        """(step, syncs) where the current run of non-finite steps began; None while finite."""
        self._runs = 0
        """Runs begun, the current one included: those beyond ``MAX_RUNS`` are not said."""
        self._step = -1
        """The step checked last, and whether anything of it was non-finite (a model with several outputs,
        or several buckets, is checked more than once a step): a run ends only when a whole step was finite."""
        self._step_bad = False

    def _observe(
        self,
        finite: bool,
        step: int,
        syncs: int,
        details: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``details`` of a run that begins here (a callable: asked only then); None: this check cannot
        begin a run."""
        if step != self._step:
            if self._run is not None and not self._step_bad:
                self._end(self._step)  # the last step checked was finite throughout
            self._step, self._step_bad = step, False
        if not finite:
            self._step_bad = True
            if self._run is None and details is not None:
                self._run = (step, syncs)
                self._runs += 1
                if self._runs <= MAX_RUNS:
                    self._say(step, syncs, None, details() if callable(details) else details)

    def _end(self, finite_step: int) -> None:
        assert self._run is not None
        start, start_syncs = self._run
        self._run = None
        if self._runs <= MAX_RUNS:  # its beginning was said
            self._say(start, start_syncs, finite_step, {})

    def _began(self, step: int, details: dict[str, Any]) -> str:
        raise NotImplementedError

    def _ended(self, step: int, finite_again_step: int) -> str:
        raise NotImplementedError

    def _say(self, step: int, syncs: int, finite_again_step: int | None, details: dict[str, Any]) -> None:
        if finite_again_step is None:
            message = self._began(step, details)
            logger.warning("ddpscope: rank %d: %s", self._rank, message)
        else:
            message = self._ended(step, finite_again_step)
            logger.info("ddpscope: rank %d: %s", self._rank, message)
        record: dict[str, Any] = {
            "kind": "warning",
            "step": step,
            "code": self.code,
            "message": message,
            "syncs": syncs,
            **details,
        }
        if finite_again_step is not None:
            record["finite_again_step"] = finite_again_step
        # Durable: a loop that stops on a NaN loss often dies right after it.
        agent.emit_durable(record)


NamedWeights = Callable[[], Iterable[tuple[str, "torch.Tensor"]]]
"""The model's parameters and buffers by name, in the model's order: looked at only when a run of non-finite
losses begins."""


def module_weights(module: torch.nn.Module) -> NamedWeights:
    """``module``'s parameters, then its buffers, by name (read when asked: a parameter replaced since is seen)."""
    return lambda: itertools.chain(module.named_parameters(), module.named_buffers())


class LossWatch(_Runs):
    """Per model: watches the gradient its loss sends into its output in every training backward.

    When a run begins, ``weights`` (if given) are looked at too: a loss that is NaN because the rank's own
    parameters or buffers already were is not its batch's doing. The all-reduce keeps every rank's
    parameters equal, so only what a rank does to them alone after it (a local gradient clip or rescale, an
    optimizer state of its own, a write to the weights) makes one rank's parameters NaN while its peers' are
    finite. The look costs one sum per tensor, once per run (at most ``MAX_RUNS``). On CUDA the loss check's
    answer arrives a step late, after the optimizer stepped on the NaN, so the weights are not looked at.
    """

    code = NONFINITE_LOSS

    def __init__(self, rank: int, weights: NamedWeights | None = None) -> None:
        super().__init__(rank)
        self._weights = weights
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
                self._observe(all(_finite(g) for g in grads), step, syncs, self._weights_details)
        except Exception:  # a diagnostic never raises into training
            logger.debug("ddpscope: checking the loss gradient failed", exc_info=True)

    def _weights_details(self) -> dict[str, Any]:
        """``nonfinite_weights``: the parameters and buffers that were not finite as this backward began
        (the forward used them), the first ``MAX_NAMED`` in the model's order, and how many there were."""
        if self._weights is None:
            return {}
        try:
            bad = [
                name
                for name, t in self._weights()
                if (t.is_floating_point() or t.is_complex()) and t.numel() and not _finite(t.detach())
            ]
        except Exception:  # a model whose tensors cannot be read this way: the warning goes without them
            logger.debug("ddpscope: looking at the weights of a NaN loss failed", exc_info=True)
            return {}
        return {"nonfinite_weights": bad[:MAX_NAMED], "nonfinite_weights_count": len(bad)} if bad else {}

    def backward_done(self) -> None:
        """From the end of a training backward, when every output's gradient was checked: a step finite
        throughout ends a run at once (on CUDA, at the next check, when its answer has arrived)."""
        if self._run is not None and not self._step_bad and not self._pending:
            self._end(self._step)

    def was_finite(self, step: int) -> bool:
        """Whether every loss gradient of ``step`` checked so far was finite (on CUDA, waiting for the
        answers still on their way): a gradient that is not finite in such a step arose inside backward."""
        while self._pending:
            self._pending[0][1].synchronize()
            self._read_pending()
        return self._step != step or not self._step_bad

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
            self._observe(bool(flag), step, syncs, {})
            self._spare.append(flag)

    def _began(self, step: int, details: dict[str, Any]) -> str:
        text = (
            f"the gradient its loss sent into the model's output was NaN or Inf at step {step} (a NaN or Inf "
            "loss or model output); DDP's all-reduce puts it in every rank's gradients."
        )
        names = details.get("nonfinite_weights")
        if names:
            text += (
                f" {details['nonfinite_weights_count']} of its parameters and buffers were NaN or Inf already "
                f"as the step's forward ran ({', '.join(names)})."
            )
        return text

    def _ended(self, step: int, finite_again_step: int) -> str:
        return f"its loss gradient was finite again from step {finite_again_step}, after NaN or Inf from step {step}."


NamedGradients = Callable[[], Sequence[tuple[int, str, "torch.Tensor | None"]]]
"""A bucket's parameters as (index in the model's parameters, name, this rank's gradient before the
all-reduce): asked for only when the bucket's sum was not finite."""


class GradientWatch(_Runs):
    """Per model, with ``DDPSCOPE_CHECK_GRADIENTS``: checks every gradient bucket of a synchronised backward
    before its all-reduce, on the rank's own gradients."""

    code = NONFINITE_GRADIENT

    def __init__(self, rank: int, losses: LossWatch) -> None:
        super().__init__(rank)
        self._losses = losses

    def bucket(self, step: int, syncs: int, index: int, flat: torch.Tensor, named: NamedGradients) -> None:
        """Bucket ``index`` of step ``step`` is about to be all-reduced; ``flat`` holds its gradients. Never
        raises."""
        try:
            if step == self._step and self._step_bad:
                return  # this step's first non-finite bucket is said; the rest add nothing but cost
            if _finite(flat):
                self._observe(True, step, syncs)
                return
            details = None
            if self._run is None and self._losses.was_finite(step):
                details = {"bucket": index, "parameters": _nonfinite_names(named())}
            self._observe(False, step, syncs, details)
        except Exception:  # a diagnostic never raises into training
            logger.debug("ddpscope: checking a gradient bucket failed", exc_info=True)

    def backward_done(self) -> None:
        """From the end of a synchronised backward, after its last bucket was checked."""
        if self._run is not None and not self._step_bad:
            self._end(self._step)

    def _began(self, step: int, details: dict[str, Any]) -> str:
        names = details["parameters"]
        where = (
            f": {', '.join(names)} (nearest the output first; the operation that made it lies between "
            f"{names[0]}'s layer and the loss)"
            if names
            else ""
        )
        return (
            f"its gradients in bucket {details['bucket']} were NaN or Inf before their all-reduce at step {step}, "
            f"while its loss was finite{where}; DDP's all-reduce puts them in every rank's gradients."
        )

    def _ended(self, step: int, finite_again_step: int) -> str:
        return f"its gradients were finite again from step {finite_again_step}, after NaN or Inf from step {step}."


def _nonfinite_names(named: Sequence[tuple[int, str, torch.Tensor | None]]) -> list[str]:
    """The parameters whose gradient is not finite, nearest the output (latest in the model) first."""
    bad = [(i, name) for i, name, g in named if g is not None and not _finite(g)]
    return [name for _, name in sorted(bad, reverse=True)[:MAX_NAMED]]
