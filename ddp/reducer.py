"""The gradient reducer: per-parameter hooks fill buckets, buckets are all-reduced in index order, and a
finalizer at the end of backward waits, checks and writes the averaged gradients back (or lends them
the reduced bucket memory: ``_write_back``).

Hot path (one call per parameter per backward, TORCH-FACTS: a Python hook costs ~1.5-2.4 us): a flag
test, one scaled copy into the bucket view, a counter decrement. Timestamps are taken per bucket, never
per parameter, and collective completion is observed by polling ``Work.is_completed()`` from the hooks
and the finalizer: a future callback runs on a gloo thread and has to win the GIL from the training
thread, which cost 40-200 us per collective on this machine (see collectives.py).

**A parameter without a gradient while ``find_unused_parameters=False``.** Stock DDP returns silently
and fails one iteration later, while its peers block in backward. Here the finalizer runs at the end of
*every* backward (it is queued by the first hook), so the rank that misses gradients notices at once.
It still joins every bucket all-reduce (sending zeros for the missing gradients) so that no peer hangs
and the collective sequence stays aligned, and it says what went wrong in *status slots* appended to
the last bucket: one per rank (set to 1 by a failing rank) and one per parameter (how many ranks missed
it). The last bucket is always launched last, so every rank learns, in the same all-reduce and without
an extra collective, which ranks and which parameters failed, and raises the same ``RuntimeError`` at
the end of that backward. No rank writes gradients from that step: never a silent wrong result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ddpscope.agent.log import get_logger
from ddpscope.ddp import errors
from ddpscope.ddp.buckets import Bucket, ParamSpec, assign_buckets, build_buckets, size_limits
from ddpscope.ddp.collectives import RECORDER, dtype_name, work_failure
from ddpscope.ddp.cuda_timing import CudaBucketEvents
from ddpscope.ddp.drift import FROZEN_AFTER_WRAP
from ddpscope.ddp.nonfinite import GradientWatch, LossWatch, NamedWeights, gradient_check_enabled
from ddpscope.ddp.outputs import grad_tensors, hook_backward_start
from ddpscope.ddp.outside_forward import OutsideForward
from ddpscope.ddp.progress import PROGRESS
from ddpscope.ddp.step_record import StepTimer, untimed_end

logger = get_logger(__name__)

REMEDY = (
    "Pass find_unused_parameters=True to DistributedDataParallel if some parameters are legitimately "
    "unused in some iterations, or make every trainable parameter contribute to the loss on every rank "
    "(freeze parameters you never train with requires_grad_(False))."
)


SPARSE_GRADIENTS = (
    "ddpscope DistributedDataParallel does not support sparse gradients{where}. Pass sparse=False to the "
    "embedding, or keep torch's own DistributedDataParallel and use ddpscope.ddp.instrument()."
)


class UnreducedGradientsError(RuntimeError):
    """Some rank produced no gradient for some parameters while ``find_unused_parameters=False``."""


SIGNATURE = -1.0
"""What every rank writes into the last status slot: summed, exactly ``-world_size``. Negative, where the
other slots hold 0 or 1 and a metric of counts or ones is positive."""


class MisalignedCollectivesError(RuntimeError):
    """A bucket all-reduce came back with values no rank sent in its status slots: another rank paired it
    with a different collective of the same size (gloo pairs collectives by order, not by purpose)."""


class Reducer:
    """Owns the buckets and the per-step reduction state of one wrapped module."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        *,
        group: Any,
        pg: str,
        rank: int,
        world_size: int,
        bucket_cap_mb: float | None,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        timer: StepTimer,
        weights: NamedWeights | None = None,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.group, self.pg, self.rank, self.world_size = group, pg, rank, world_size
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self.timer = timer
        self.specs = [ParamSpec.of(n, p) for n, p in zip(self.names, self.params, strict=True)]
        self.limits = size_limits(bucket_cap_mb)
        self.scale = 1.0 / world_size
        # The hot path calls the ProcessGroup directly: torch.distributed.all_reduce adds ~50-100 us of
        # Python checks per call, and the recorder's user-call patches wrap only those module functions.
        self._pg_obj = group if group is not None else dist.distributed_c10d._get_default_group()
        self._sum = dist.AllreduceOptions()
        self._sum.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        # Status slots only matter when a missing gradient is an error (see the module docstring): one per
        # rank, one per parameter, and the signature slot last.
        self.status_slots = 0 if find_unused_parameters else world_size + len(self.params) + 1
        self._blank_status: torch.Tensor | None = None
        """What a rank that missed nothing writes into the status slots (``_write_status``)."""
        self.step = 0
        self.active = False
        """A synchronised backward is expected: hooks fill buckets."""
        self.queued = False
        """The finalizer is queued for the backward in progress."""
        self.armed = False
        """A forward through the wrapper (synced or under no_sync) awaits its backward."""
        self.syncs = 0
        """Synchronised backwards finalized: all-reduce rounds, the same count on every rank."""
        self.outside = OutsideForward(self.names, rank)
        self.losses = LossWatch(rank, weights)
        """Says when the gradient the loss sends into the model's output turns NaN or Inf, and back."""
        self.gradients = GradientWatch(rank, self.losses) if gradient_check_enabled() else None
        """With ``DDPSCOPE_CHECK_GRADIENTS``: says when a bucket's gradients turn NaN or Inf, and back."""
        self.ready_log: list[int] | None = None
        """Parameter indices in gradient-ready order, recorded in synced backwards until the rebuild."""
        self.log_complete = False
        """The last synced backward succeeded on every rank: ``ready_log`` is safe to rebuild from."""
        self.rebuilt = find_unused_parameters  # torch never rebuilds with find_unused_parameters=True
        self.expected_unused: list[int] = []
        self.window_used = bytearray(len(self.params))
        """With ``find_unused_parameters``: parameters that got a gradient under ``no_sync()`` since the
        last synchronised backward. They count as used in the next one, as in torch: their accumulated
        gradient is averaged even if that last micro-batch does not reach them."""
        self.set_layout(assign_buckets(self.specs, self.limits))
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]
        PROGRESS.pending_buckets = self.pending_wire
        PROGRESS.settled = self.settled
        PROGRESS.partial_step = self.partial_wire

    # -- layout ----------------------------------------------------------------------------------

    def set_layout(self, assignment: Sequence[list[int]]) -> None:
        self.buckets: list[Bucket] = build_buckets(assignment, self.params, self.names, self.status_slots)
        self.where: list[tuple[Bucket, int]] = [(self.buckets[0], 0)] * len(self.params)
        for b in self.buckets:
            for pos, i in enumerate(b.param_indices):
                self.where[i] = (b, pos)
        self.timer.set_buckets([b.nbytes for b in self.buckets])
        # GPU buckets are timed with CUDA events (cuda_timing.py); None keeps the CPU path free of checks.
        on_gpu = any(b.device.type == "cuda" for b in self.buckets)
        # On the CPU each bucket's end is recorded on this thread just before the step record, which then
        # carries it (``CollectiveRecorder.end_planned``); CUDA's event times arrive later, on their own.
        fold = not on_gpu
        self.timer.ends_pg = self.pg if fold else None
        self.plans = [
            RECORDER.plan(
                self.pg,
                "all_reduce",
                reduce_op="SUM",
                shapes=[list(b.buffer.shape)],
                dtypes=[dtype_name(b.dtype)],
                folded=fold,
            )
            for b in self.buckets
        ]
        """Each bucket's all-reduce as the recorder plans it (its records made once per layout)."""
        self.cuda = CudaBucketEvents(len(self.buckets)) if on_gpu else None
        self._lendable = (
            [] if self.as_view else [b.param_indices[pos] for b in self.buckets for pos in b.lendable]
        )
        """Parameters whose reduced gradient may be lent rather than copied back (``_write_back``)."""
        self._reset_step_state()

    def rebuild(self, ready_order: Sequence[int]) -> None:
        """Re-bucket in an observed gradient-ready order (the same order on every rank)."""
        self.set_layout(assign_buckets(self.specs, self.limits, ready_order))
        self.rebuilt = True

    def wants_rebuild(self) -> bool:
        # Every rank agrees on log_complete (a failed step fails on every rank), so every rank takes
        # the rebuild, and its broadcast, at the same forward.
        return not self.rebuilt and self.log_complete

    def shadowed_synced_step(self) -> None:
        """A rank that joined (``ddp/join.py``) shadowed a synced step of its peers. That step succeeded
        on every rank, which is what makes the peers rebuild at their next forward: this rank must too,
        from its own log or, if it never ran a synced step, from the current bucket order (only rank
        0's order is used, and a joined rank 0 must have one to send)."""
        if not self.rebuilt and not self.log_complete:
            if self.ready_log is None or len(self.ready_log) != len(self.params):
                self.ready_log = [i for b in self.buckets for i in b.param_indices]
            self.log_complete = True

    def layout_wire(self) -> list[dict[str, Any]]:
        return [b.to_wire() for b in self.buckets]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- per step --------------------------------------------------------------------------------

    def _reset_step_state(self) -> None:
        n = len(self.params)
        self.accumulated = 0
        """Gradients accumulated under ``no_sync()`` in this step (a synced step counts them in ``ready``)."""
        self.ready = bytearray(n)
        self.used = bytearray(n)
        self.pending = [len(b.param_indices) for b in self.buckets]
        self.works: list[Any] = [None] * len(self.buckets)
        self.seqs = [0] * len(self.buckets)
        self.next_launch = 0
        self.next_done = 0
        self.failed: list[int] = []
        self.used_work: Any = None
        self.used_tensor: torch.Tensor | None = None
        self.fresh: set[int] = set()
        self.unmarked_unused = False
        """``expected_unused`` awaits the first parameter gradient of this backward to be marked ready."""

    def prepare_forward(self, step: int, synced: bool) -> None:
        if self.active and self.queued:
            # The error is this forward's: said at this step, not in the backward it left unfinished.
            PROGRESS.enter("forward", step)
            raise RuntimeError(
                f"DistributedDataParallel: the backward of step {self.step} did not finish reducing "
                "gradients (it raised before its end?). Gradients of that step are inconsistent across "
                "ranks; restart from a checkpoint."
            )
        self.step = step
        self.active = False
        self.queued = False
        self.expected_unused = []
        self._reset_step_state()
        self.timer.forward_start(step, synced)
        PROGRESS.enter("forward", step)

    def after_forward(self, outputs: Any, synced: bool) -> None:
        """Arm the hooks for the backward to come; find the unused parameters if asked to."""
        tensors = grad_tensors(outputs, limit=None if synced and self.find_unused else 64)
        self.armed = True
        PROGRESS.enter("after_forward")
        if synced:
            self.active = True
            if not self.rebuilt:
                self.ready_log = []
                self.log_complete = False
            if self.find_unused:
                used = _reachable_params(tensors)
                self.expected_unused = [i for i, p in enumerate(self.params) if id(p) not in used]
                tensors = tensors[:64]
        # A hook on the outputs marks the start of backward and queues the finalizer even when no
        # parameter hook fires on this rank (so an unsynced step is recorded too).
        hook_backward_start(tensors, self._on_output_grad)

    def _on_output_grad(self, grad: Any) -> None:
        """A tensor hook (the gradient) or a node pre-hook (a tuple of gradients): either way, the
        first sign of backward."""
        if not self.queued:
            self._begin_backward()
        self.losses.check(grad, self.step, self.syncs)

    def _begin_backward(self) -> None:
        self.queued = True
        self.timer.backward_start()
        PROGRESS.enter("backward")
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        if self.active and self._lendable:
            # Before any gradient of this backward accumulated: whose .grad this backward will create.
            self.fresh = {i for i in self._lendable if self.params[i].grad is None}
            for bucket in self.buckets:
                bucket.reclaim()
        if self.active and self.expected_unused:
            if len(self.expected_unused) < len(self.params):
                # Marked at the first parameter's gradient, as torch's reducer does: a backward that reaches
                # no parameter (a gradient penalty's input gradient) must launch nothing.
                self.unmarked_unused = True
            else:  # the loss reaches no parameter: no hook will come to mark them
                self._mark_expected_unused()

    def _mark_expected_unused(self) -> None:
        self.unmarked_unused = False
        for i in self.expected_unused:
            self._mark_unused(i)
        self._launch_ready()

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self.active:
                self._on_grad(index, param)
            elif not self.armed:
                self.outside.note(index, self.step)
            else:  # a no_sync() backward
                self.accumulated += 1
                if self.find_unused:
                    self.window_used[index] = 1  # used in this accumulation window

        return hook

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        PROGRESS.counter += 1
        if not self.queued:
            self._begin_backward()
        if self.unmarked_unused:
            self._mark_expected_unused()
        if self.ready[i]:
            raise RuntimeError(self._twice_message(i))
        self.ready[i] = 1
        self.used[i] = 1
        bucket, pos = self.where[i]
        view = bucket.views[pos]
        grad = param.grad
        if self.as_view and grad is not None and grad.data_ptr() == view.data_ptr():
            view.mul_(self.scale)  # the grad already lives in the bucket
        else:
            # Scale while copying (one pass), exactly as torch's reducer does before a SUM all-reduce.
            try:
                torch.mul(grad, self.scale, out=view)  # type: ignore[arg-type]  # a post-accumulate hook always has a grad
            except RuntimeError as e:
                if grad is not None and grad.is_sparse:  # from an autograd function, not a sparse embedding
                    raise ValueError(SPARSE_GRADIENTS.format(where=f" (parameter {self.names[i]!r})")) from e
                raise
            if self.as_view:
                param.grad = view
        if self.ready_log is not None:
            self.ready_log.append(i)
        b = bucket.index
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.timer.bucket_ready(b)
            if self.cuda is not None:
                self.cuda.bucket_ready(b)
            self._launch_ready()
        elif self.next_done < self.next_launch and self.cuda is None:
            self._poll()

    def _twice_message(self, i: int) -> str:
        """Why parameter ``i`` got a second gradient in one backward, with what to do about it."""
        head = f"DistributedDataParallel: parameter {self.names[i]!r} (step {self.step}) "
        if i in self.expected_unused:
            return (
                head + "received a gradient although the forward's output does not reach it, so it was "
                "counted as unused (find_unused_parameters=True). Reentrant activation checkpointing "
                "(torch.utils.checkpoint with use_reentrant=True) hides the parameters inside it from "
                "that search: pass use_reentrant=False."
            )
        return (
            head + "received its gradient twice in one backward: its module ran twice inside reentrant "
            "activation checkpointing (torch.utils.checkpoint with use_reentrant=True, where each run "
            "accumulates separately; pass use_reentrant=False), or two backwards ran over one forward "
            "(run one backward per forward)."
        )

    def _mark_unused(self, i: int) -> None:
        """A parameter that gets no gradient in this backward contributes zeros, or with
        ``find_unused_parameters`` the gradient it accumulated under ``no_sync()``, scaled, as torch's
        reducer does (without it, a missing gradient is an error and nothing is written back)."""
        if self.ready[i]:
            return
        self.ready[i] = 1
        bucket, pos = self.where[i]
        view = bucket.views[pos]
        grad = self.params[i].grad if self.find_unused else None
        if grad is None:
            view.zero_()
        elif self.as_view and grad.data_ptr() == view.data_ptr():
            view.mul_(self.scale)
        else:
            torch.mul(grad, self.scale, out=view)
        self.pending[bucket.index] -= 1
        if self.pending[bucket.index] == 0:
            self.timer.bucket_ready(bucket.index)
            if self.cuda is not None:
                self.cuda.bucket_ready(bucket.index)

    def _launch_ready(self) -> None:
        """Launch every bucket that is ready and whose predecessors are launched: strictly in order."""
        nb = len(self.buckets)
        while self.next_launch < nb and self.pending[self.next_launch] == 0:
            k = self.next_launch
            bucket = self.buckets[k]
            if bucket.status is not None:
                self._write_status(bucket.status)
            if self.gradients is not None:
                self.gradients.bucket(self.step, self.syncs, k, bucket.buffer, bucket.named_gradients)
            # Recorded (written ahead) before the launch, not after: against a peer's mismatched collective
            # gloo aborts this process soon after the launch (collectives.py), and the launch may hand the
            # core to gloo's thread first. Launching first measured no faster (docs/history.md, pass 39).
            seq = RECORDER.begin_planned(self.plans[k], self.step)
            try:
                self.works[k] = self._pg_obj.allreduce([bucket.buffer], self._sum)
            except Exception as e:  # a peer gone: the collective failed at once
                RECORDER.end(self.pg, seq, ok=False, error=str(e))
                raise
            self.seqs[k] = seq
            self.timer.allreduce_launched(k, seq)
            if self.cuda is not None:
                self.cuda.allreduce_launched(k)
            self.next_launch = k + 1
        if self.next_launch == nb and self.find_unused and self.used_work is None:
            # The global used bitmap: a parameter unused on every rank (in this backward and in the
            # no_sync() ones before it) keeps its .grad untouched.
            if any(self.window_used):
                self.used = bytearray(a | b for a, b in zip(self.used, self.window_used, strict=True))
            self.used_tensor = torch.frombuffer(bytearray(self.used), dtype=torch.uint8).to(torch.int32)
            self.used_seq = RECORDER.begin(
                self.pg, "all_reduce", (self.used_tensor,), reduce_op="SUM", source="engine", step=self.step
            )
            self.used_work = self._pg_obj.allreduce([self.used_tensor], self._sum)
        if self.next_done < self.next_launch and self.cuda is None:
            # On CUDA every bucket is waited in the finalizer, where its "done" event is recorded.
            self._poll()

    def shadow_buckets(self) -> list[torch.Tensor]:
        """What a rank joined under ``Join`` all-reduces in place of each bucket while its peers train:
        zeros, and in the status slots what a rank that missed nothing writes (the signature)."""
        shadows = [torch.zeros_like(b.buffer) for b in self.buckets]
        if self.buckets[-1].status is not None:
            shadows[-1][-1] = SIGNATURE
        return shadows

    def _write_status(self, status: torch.Tensor) -> None:
        # One copy from a ready-made [0, ..., 0, SIGNATURE] (~1 us), not zero_() and an indexed write (~4 us).
        blank = self._blank_status
        if blank is None or blank.dtype != status.dtype or blank.device != status.device:
            blank = self._blank_status = torch.zeros_like(status)
            blank[-1] = SIGNATURE
        status.copy_(blank)
        if self.failed:
            status[self.rank] = 1
            idx = torch.tensor([self.world_size + i for i in self.failed])
            status.index_fill_(0, idx, 1)

    def _poll(self) -> None:
        while self.next_done < self.next_launch:
            k = self.next_done
            work = self.works[k]
            if not work.is_completed():
                return
            if work_failure(work) is not None:
                # A peer died: gloo completes the work at once, failed. Left to the finalizer, whose
                # wait raises it into backward() as torch's Reducer does; marked done here, it was
                # never waited, and this rank went on training alone on its own gradients.
                return
            self._done(k)

    def _done(self, k: int) -> None:
        self.timer.allreduce_done(k)
        RECORDER.end_planned(self.plans[k], self.seqs[k])
        self.next_done = k + 1

    def _wait(self, work: Any, seq: int) -> None:
        try:
            work.wait()
        except Exception as e:
            RECORDER.end(self.pg, seq, ok=False, error=str(e))
            raise

    # -- end of backward -------------------------------------------------------------------------

    def _finalize(self) -> None:
        """Runs on the training thread after autograd accumulated every gradient of this backward."""
        if self._no_parameter_touched():
            # An autograd.grad() or backward(inputs=...) through the outputs that accumulated into no
            # parameter (a gradient penalty's input gradient): not the step's backward, which torch's
            # reducer never sees either (its hooks are on the parameters). The step waits for that one.
            self.queued = False
            PROGRESS.enter("after_forward")
            return
        try:
            if self.active:
                self.syncs += 1  # counted on every rank alike, also when the round then fails
                try:
                    self._finalize_synced()
                except Exception as exc:
                    # Said while the rank is still in the step it failed in (a peer died mid all-reduce):
                    # the record then carries that step so far, of which no step record will come (nor
                    # the bucket ends it would have carried: report_error sends them first).
                    errors.report_error(exc, fatal=False)
                    raise
            else:
                self.timer.emit()
        finally:
            self.losses.backward_done()
            if self.active and self.gradients is not None:
                self.gradients.backward_done()
            if self.active and self.find_unused:
                self.window_used = bytearray(len(self.params))  # the accumulation window ends here
            self.active = False
            self.queued = False
            self.armed = False
            PROGRESS.enter("idle")

    def _no_parameter_touched(self) -> bool:
        """No gradient reached a parameter in this backward. Nothing can have been launched then: a launch
        needs a bucket all ready, and marking an unused parameter ready (with ``find_unused_parameters``, at
        the first parameter's gradient, or at the start when the loss reaches none) sets its flag too."""
        if self.active:
            return self.ready.find(1) < 0
        return self.accumulated == 0

    def _finalize_synced(self) -> None:
        PROGRESS.enter("allreduce")
        missing = [i for i in range(len(self.params)) if not self.ready[i]]
        if missing and not self.find_unused:
            self.failed = missing
        for i in missing:
            self._mark_unused(i)
        self._launch_ready()
        for k in range(self.next_done, len(self.buckets)):
            self._wait(self.works[k], self.seqs[k])
            if self.cuda is not None:
                self.cuda.allreduce_done(k)
            self._done(k)
        global_used: list[int] | None = None
        if self.used_work is not None:
            self._wait(self.used_work, self.used_seq)
            RECORDER.end(self.pg, self.used_seq, ok=True)
            assert self.used_tensor is not None
            global_used = self.used_tensor.tolist()
        unused = [self.names[i] for i in range(len(self.params)) if not self.used[i]]
        status = self.buckets[-1].status
        if status is not None:
            flags = status.tolist()
            if not self._status_consistent(flags, status.dtype):
                self._fail_step(MisalignedCollectivesError(self._misaligned_message(flags)), unused)
            bad_ranks = [r for r in range(self.world_size) if flags[r]]
            if bad_ranks:
                failure = self._failure_message(bad_ranks, flags[self.world_size : -1])
                self._fail_step(UnreducedGradientsError(failure), unused)
        self._write_back(global_used)
        self.log_complete = self.ready_log is not None and len(self.ready_log) == len(self.params)
        self._device_times()
        self.timer.emit(unused)

    def _fail_step(self, error: RuntimeError, unused: list[str]) -> NoReturn:
        """End a synced step whose reduction went wrong without writing its gradients: its step record, then
        ``error``, shipped now with step and phase (the caller may catch it, or the process may die of it)."""
        self._device_times()
        self.timer.emit(unused)
        errors.report_error(error)
        raise error

    def _device_times(self) -> None:
        if self.cuda is None:
            return
        try:
            self.timer.set_bucket_times(*self.cuda.resolve())
        except RuntimeError:
            # An event never recorded (a bucket of a failed step): keep the host times for this step.
            logger.debug("CUDA bucket events unavailable for step %d", self.step, exc_info=True)

    def _write_back(self, global_used: list[int] | None) -> None:
        """Give every used parameter its averaged gradient.

        A gradient this backward created (``.grad`` was None when it began, as after torch's default
        ``zero_grad(set_to_none=True)``) of a large parameter is *lent* the reduced memory
        instead of having it copied back: one pass over the gradients saved, a tensor of the same shape
        and strides, not a view. The bucket takes the memory back at the next backward if the gradient was
        dropped by then, or else gets a fresh buffer (``Bucket.reclaim``). A ``.grad`` that existed before
        the backward keeps its identity and is copied into, as torch does.
        """
        copies_to: list[torch.Tensor] = []
        copies_from: list[torch.Tensor] = []
        fresh = self.fresh
        for bucket in self.buckets:
            for pos, i in enumerate(bucket.param_indices):
                if global_used is not None and global_used[i] == 0:
                    continue  # unused on every rank: .grad stays as it was (None stays None)
                p, view = self.params[i], bucket.views[pos]
                grad = p.grad
                if self.as_view:
                    if grad is None or grad.data_ptr() != view.data_ptr():
                        p.grad = view
                elif i in fresh and (grad is None or grad.is_contiguous()):
                    p.grad = bucket.lend(pos)  # the bucket reclaims its memory at the next backward
                elif grad is None:
                    p.grad = view.clone()
                else:
                    copies_to.append(grad)
                    copies_from.append(view)
        if copies_to:
            torch._foreach_copy_(copies_to, copies_from)

    def _status_consistent(self, flags: list[float], dtype: torch.dtype) -> bool:
        """Whether the summed status slots are what the ranks' own slots can add up to: each rank writes
        ``SIGNATURE`` into the last slot (so it sums to exactly that times the world size), 1 only into
        its own rank slot (so this rank's slot holds exactly what it sent) and 1 into the slot of each
        parameter it missed, so no parameter slot exceeds the number of failed ranks. Sums that break
        this came from a different collective another rank paired with this all-reduce: the signature
        catches one that looks like flags (a tensor of zeros), which the rest alone accepted."""
        world = self.world_size
        if not all(math.isfinite(f) and f == int(f) for f in flags):
            return False
        signature, flags = flags[-1], flags[:-1]
        # A 16-bit bucket sums integers exactly only up to 2 / eps (256 for bfloat16): past that, the
        # signature's sum is rounded and says nothing.
        if world * abs(SIGNATURE) <= 2 / torch.finfo(dtype).eps and signature != SIGNATURE * world:
            return False
        ranks, per_param = flags[:world], flags[world:]
        if any(f not in (0, 1) for f in ranks) or ranks[self.rank] != (1 if self.failed else 0):
            return False
        failed = sum(ranks)
        if any(not 0 <= f <= failed for f in per_param) or any(per_param[i] < 1 for i in self.failed):
            return False
        return failed == 0 or any(per_param)

    def _misaligned_message(self, flags: list[float]) -> str:
        last = len(self.buckets) - 1
        return (
            f"DistributedDataParallel (rank {self.rank}, step {self.step}): the gradient all-reduce of bucket "
            f"{last} (collective #{self.seqs[last]} of group {self.pg}) came back with sums in its status slots "
            f"that the {self.world_size} ranks cannot have sent (the signature slot holds {flags[-1]!r} where "
            f"they send {SIGNATURE * self.world_size!r}; this rank's own slot holds {flags[self.rank]!r}, it "
            f"sent {1 if self.failed else 0}): another rank paired it with a different "
            "collective of the same size. The ranks no longer issue the same collectives in the same order "
            "(a collective some ranks skip or add, an uneven number of batches without torch's Join), so "
            "this step's averaged gradients are wrong and were not written. ddpscope's collector names the "
            "rank and the line that differ (its mismatch incident)."
        )

    def _failure_message(self, bad_ranks: list[int], per_param: list[float]) -> str:
        names = [self.names[i] for i, c in enumerate(per_param) if c]
        buckets = sorted({self.where[i][0].index for i, c in enumerate(per_param) if c})
        mine = [self.names[i] for i in self.failed]
        who = "this rank" if mine else f"rank(s) {bad_ranks}"
        head = (
            f"DistributedDataParallel (rank {self.rank}, step {self.step}): parameters {names} in "
            f"bucket(s) {buckets} received no gradient on rank(s) {bad_ranks} during this backward, "
            f"and find_unused_parameters=False."
        )
        if mine:
            head += f" On this rank the missing parameters are {mine}."
        frozen = [self.names[i] for i in self.failed if not self.params[i].requires_grad]
        if frozen:
            head += f" Of them, {FROZEN_AFTER_WRAP.format(names=frozen)}"
        return (
            f"{head} Every rank still joined the gradient all-reduces (zeros for what {who} missed), and no "
            f"rank wrote gradients from this step. {REMEDY}"
        )

    # -- watchdog view ---------------------------------------------------------------------------

    def settled(self) -> set[tuple[str, int]]:
        """The bucket all-reduces (and the used-parameters all-reduce) that completed and were not
        ended yet (read from the watchdog thread)."""
        if not self.active:
            return set()
        works, seqs, pg = self.works, self.seqs, self.pg
        out = {
            (pg, seqs[k])
            for k in range(self.next_done, self.next_launch)
            if works[k] is not None and works[k].is_completed()
        }
        used = self.used_work
        if used is not None and used.is_completed():
            out.add((pg, self.used_seq))
        return out

    def pending_wire(self) -> list[dict[str, Any]]:
        """Buckets not reduced yet, in the PENDING_BUCKET wire shape (read from the watchdog thread).
        None before backward begins: a rank between its forward and its backward (computing the loss)
        awaits no gradient yet, and listing every parameter as missing would read as unused ones."""
        if not self.active or not self.queued:
            return []
        out = []
        ready, works, launched_upto = self.ready, self.works, self.next_launch
        for b in self.buckets:
            launched = b.index < launched_upto
            work = works[b.index]
            if launched and work is not None and work.is_completed():
                continue
            missing = [] if launched else [self.names[i] for i in b.param_indices if not ready[i]]
            out.append({"index": b.index, "missing": missing, "launched": launched})
        return out

    def partial_wire(self) -> dict[str, Any] | None:
        """The step in progress (``records.PARTIAL_STEP``, read from the watchdog thread). A bucket whose
        all-reduce succeeded but was not polled yet ends at ``UNTIMED_END``: done, at a time not recorded."""
        partial = self.timer.partial()
        if partial is None or not partial["synced"] or not (self.active and self.queued):
            return partial
        ends, works = partial["allreduce_end_ns"], self.works
        for k in range(self.next_done, min(self.next_launch, len(ends))):
            if not ends[k]:
                ends[k] = untimed_end(works[k])
        return partial


def _reachable_params(tensors: Sequence[torch.Tensor]) -> set[int]:
    """ids of the leaf tensors the autograd graph of ``tensors`` reaches (torch does this in C++)."""
    used: set[int] = set()
    seen: set[Any] = set()
    stack = []
    for t in tensors:
        if t.grad_fn is None:
            used.add(id(t))
        else:
            stack.append(t.grad_fn)
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            used.add(id(var))
        for nxt, _ in fn.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return used
