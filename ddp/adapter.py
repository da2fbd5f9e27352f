"""``instrument(torch_ddp_model)``: ddpscope's step records from stock torch DDP.

Usage (every rank, right after wrapping; a collective call like DDP's constructor)::

    model = torch.nn.parallel.DistributedDataParallel(net)
    model = instrument(model)                                # same object, now measured
    # or, with your own communication hook (torch allows one per model, so pass it through):
    model = instrument(model, comm_hook=fp16_compress_hook, comm_state=None)

What it attaches (torch's engine keeps doing all the work; gradients are bit-identical):

- an **observed process group** (``adapter_group``) given to torch's Reducer in place of its own: each
  bucket all-reduce the Reducer launches is recorded (launch time, a ``collective`` record) and runs on
  the real group. No comm hook, so torch keeps scaling while it copies gradients into the bucket;
- a **post-accumulate-grad hook** per parameter: its ready time (it fires just before the Reducer's), and
  the end of any bucket all-reduce that completed meanwhile;
- a **wrapper around the DDP module's** ``forward`` (an instance attribute: cheaper than module forward
  hooks), and a hook on the forward's outputs: backward start;
- two **queued autograd callbacks**: the first one, queued at backward start, runs before the Reducer's
  finalizer (queued later, once every bucket is launched); it gives each bucket still reducing a
  completion callback that stamps its end, and queues the second, which therefore runs after the
  finalizer waited for every all-reduce: that is backward end, and the ``step`` record.

With a user's comm hook (passed through ``instrument``) a comm hook wraps it and its future's ``then``
callback dates the end, as no observed group can see the hook's own collectives as this bucket's.

The bucket layout is torch's own (``adapter_layout``). Unused parameters of a synchronised step are
those whose post-accumulate hook never fired. ``no_sync()`` steps are recorded with ``synced=False``.

Cost and limits. Per bucket: one Python call from the Reducer and, for the buckets still reducing when
the gradients are done, one callback on a gloo thread; per parameter one hook. (A comm hook would cost
more: torch then copies gradients into the bucket unscaled, so the hook scales it in one more pass, and
takes the GIL for the hook, its ``then`` callback and its result; bench/adapter.py measures both.) An
all-reduce end is when the training thread noticed it or when its callback ran. The unused-parameter
bitmap all-reduce, the rebuild's bucket-index broadcast (both through the observed group) and torch's
buffer broadcast before each forward (a wrapper around DDP's method) are recorded as engine
collectives, as the engine records its own: a rank waiting there for a peer stuck before its forward
waits in a collective that peer never issued. The buffer broadcast is also counted as time blocked in
a collective, not as the waiting rank's own forward (``BlockedTime``).
Records name a rank and a step, not a model, so one model per process and job is measured: a second one
takes over from the first (see ``instrument``), its steps numbered on from the first's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ddpscope import agent
from ddpscope.agent import clock as agent_clock
from ddpscope.agent import lifecycle
from ddpscope.agent.clock import now_ns
from ddpscope.agent.log import get_logger
from ddpscope.ddp import monitor, peer_presence, watchdog
from ddpscope.ddp.adapter_group import ObservedGroup
from ddpscope.ddp.adapter_layout import (
    Layout,
    LayoutLearner,
    empty_layout,
    logged_rebuilt_layout,
    predict_initial,
    read_layout,
    reducer_parameters,
)
from ddpscope.ddp.clock import ClockEstimate, estimate_offset
from ddpscope.ddp.collectives import (
    RECORDER,
    PlannedCollective,
    dtype_name,
    future_failure,
    reduce_name,
    work_failure,
)
from ddpscope.ddp.compile_skip import call_model, runs_model
from ddpscope.ddp.drift import BACKWARD_CUT_SHORT, FROZEN_AFTER_WRAP, UNFINISHED_REDUCTION, FrozenAtWrap
from ddpscope.ddp.errors import report_error
from ddpscope.ddp.groups import global_rank, group_size, pg_name, replica_ranks
from ddpscope.ddp.nonfinite import GradientWatch, LossWatch, gradient_check_enabled, module_weights
from ddpscope.ddp.outputs import grad_tensors, hook_backward_start
from ddpscope.ddp.outside_forward import OutsideForward
from ddpscope.ddp.progress import PROGRESS, no_step
from ddpscope.ddp.rank_start import rank_start_record
from ddpscope.ddp.replicas import ReplicaDigest
from ddpscope.ddp.step_record import StepTimer, untimed_end
from ddpscope.ddp.train_mode import EvalModeWatch

logger = get_logger(__name__)

_ATTR = "_ddpscope_instrumentation"
_MIB = 1024 * 1024

CommHook = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]
"""A torch DDP communication hook: (state, dist.GradBucket) -> Future[Tensor]."""


def instrument(
    ddp: DistributedDataParallel, *, comm_hook: CommHook | None = None, comm_state: Any = None
) -> DistributedDataParallel:
    """Measure a torch ``DistributedDataParallel`` model; returns the same object.

    Call it on every rank before the first forward: it exchanges clock samples with rank 0. A model
    that already has a communication hook is refused (a hook's collectives do not show which bucket
    they reduce, so ddpscope times a hook by wrapping it): register nothing yourself and pass
    ``comm_hook``/``comm_state`` here instead. Instrumenting twice returns the model unchanged. One
    model per process and job is measured: a second, different model takes over and the previous one
    trains on unmeasured (measured again if instrumented again, unless it has a hook). In the same job
    (a model built again after unfreezing layers or re-creating the process group; a GAN's second model)
    it says so in the log and numbers its steps on from the previous model's; under a job configured
    since (``ddpscope.agent.configure(job=...)``) it starts from step 0.
    With ``DDPSCOPE_DISABLED=1`` nothing is attached (the user's ``comm_hook``, if given, is
    registered as torch would).
    """
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            f"instrument() expects a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(ddp).__name__}; ddpscope's own engine is ddpscope.ddp.DistributedDataParallel."
        )
    global _current
    config = agent.get_agent().config
    existing: Instrumentation | None = getattr(ddp, _ATTR, None)
    if existing is not None and not existing.reattachable:
        if comm_hook is not None:
            raise ValueError(
                "instrument(): this model is already instrumented; pass comm_hook the first time."
            )
        if existing.detached:
            raise ValueError(
                "instrument(): this model's measurement was detached when another model was instrumented "
                "under a new job, and its comm hook (yours, passed through ddpscope) stays registered: "
                "torch takes only one, so ddpscope cannot measure it again in this process."
            )
        return ddp
    if getattr(config, "disabled", False):
        if comm_hook is not None:
            ddp.register_comm_hook(comm_state, comm_hook)
        return ddp
    _refuse_unsupported(ddp)
    job = str(getattr(config, "job", ""))
    first_step = 0 if _current is None else _take_over(_current, job)
    monitor.enable()  # recorder patches, rank_error hooks, hang watchdog: as the engine does
    _current = Instrumentation(ddp, comm_hook, comm_state, job, first_step)
    setattr(ddp, _ATTR, _current)
    return ddp


_current: Instrumentation | None = None
"""The measured model of this process (one per process and job)."""


def _take_over(previous: Instrumentation, job: str) -> int:
    """Stop measuring ``previous`` for a new model; returns the step number the new model starts at.

    Under another job (``agent.configure(job=...)``, models measured one after the other, as
    bench/end_to_end.py does) the new model starts at 0. In the same job records carry no model, so the
    new one numbers its steps on from the previous one's: a model built again (after unfreezing layers,
    or after re-creating the process group) continues the job's steps; of a GAN's two models the one
    instrumented last is measured. Said in the log, never raised: training goes on either way."""
    previous.remove_hooks()
    if previous.job != job:
        logger.info(
            "ddpscope: job %s: no longer measuring the model instrumented for job %s", job, previous.job
        )
        return 0
    logger.warning(
        "ddpscope: instrument() of another DistributedDataParallel model in job %r: ddpscope now measures "
        "this one (from step %d on) and no longer the previous one, which trains on unmeasured. It measures "
        "one instrumented model per process and job (step records name a rank and a step, not a model): "
        "for a model built again, nothing to do; for models trained side by side (a GAN), instrument only "
        "the one to observe, or put them in one nn.Module under a single DistributedDataParallel.",
        job,
        previous.step_reached,
    )
    return previous.step_reached


def instrumentation(ddp: DistributedDataParallel) -> Instrumentation | None:
    """The ``Instrumentation`` attached by ``instrument()``, if any (tests, tools)."""
    return getattr(ddp, _ATTR, None)


def _refuse_unsupported(ddp: DistributedDataParallel) -> None:
    hooks = getattr(ddp, "_comm_hooks", None)
    builtin = ""
    if not hooks:
        try:
            builtin = str(ddp._get_ddp_logging_data().get("comm_hook") or "")
        except (AttributeError, RuntimeError):
            logger.debug("no DDP logging data to look for a built-in comm hook", exc_info=True)
    if hooks or builtin:
        name = getattr(hooks[0][0], "__qualname__", repr(hooks[0][0])) if hooks else builtin
        raise ValueError(
            f"instrument(): this DistributedDataParallel model already has a communication hook ({name}), "
            "and torch allows only one per model. Create the model without calling register_comm_hook() "
            "and pass your hook through ddpscope instead: instrument(model, comm_hook=your_hook, "
            "comm_state=your_state). (A built-in C++ hook has a Python twin in "
            "torch.distributed.algorithms.ddp_comm_hooks.default_hooks, e.g. fp16_compress_hook.)"
        )
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
        raise ValueError(
            "instrument(): this model does not use torch's C++ Reducer (compiled autograd or every "
            "parameter in delay_all_reduce_named_params), so there are no buckets to measure."
        )


REBUILD_READ_TRIES = 3
"""Forwards in which ``_relearn_layout`` looks again for a rebuild it could not read at once."""


def hook_name(hook: Any) -> str:
    """``name() at file.py:12`` of a comm hook (or of the function a ``functools.partial`` wraps)."""
    fn = getattr(hook, "func", hook)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    code = getattr(fn, "__code__", None)
    if code is None:
        return str(name)
    return f"{name}() at {RECORDER.relative_path(code.co_filename)}:{code.co_firstlineno}"


class Instrumentation:
    """The hooks and per-step state attached to one torch DDP model by ``instrument()``."""

    def __init__(
        self,
        ddp: DistributedDataParallel,
        comm_hook: CommHook | None,
        comm_state: Any,
        job: str = "",
        first_step: int = 0,
    ) -> None:
        self.ddp = ddp
        self.job = job
        """The agent's job when this model was instrumented."""
        self.detached = False
        """``remove_hooks()`` ran: nothing of this model is measured any more."""
        self._group = ddp.process_group
        self._pg = pg_name(self._group)
        self._rank = global_rank()
        self._user_hook = comm_hook
        self._user_state = comm_state
        self._plans: dict[tuple[int, int, Any], PlannedCollective] = {}
        """(bucket index, numel, dtype) -> its all-reduce's recorder plan (see ``_plan``)."""

        absent = peer_presence.missing(
            self._group, min(peer_presence.WAIT_S, watchdog.hang_timeout_setting())
        )
        if absent:
            # They would never join the ping-pong: train on with this rank's own clock (one host's ranks
            # share one; across hosts the timelines may be offset by the hosts' difference).
            logger.warning(
                "ddpscope: ranks %s run without ddpscope (DDPSCOPE_DISABLED set on their node only?): they are "
                "not observed, and the clocks are not aligned. Set DDPSCOPE_DISABLED alike on every rank.",
                absent,
            )
            estimate = ClockEstimate(0, 0, 0)
        else:
            estimate = estimate_offset(self._group)
        agent_clock.set_offset(estimate.offset_ns, estimate.error_ns)

        params, names = reducer_parameters(ddp)
        self.params = params
        ignored = getattr(ddp, "parameters_to_ignore", ()) or ()
        self._frozen = FrozenAtWrap(ddp.module, self._rank, ignored)
        self._train_mode = EvalModeWatch(ddp.module, self._rank)
        self._replicas = ReplicaDigest(ddp.module, params, self._rank, ignored, replica_ranks(self._group))
        self._base = empty_layout(params, names)
        self._learner = LayoutLearner(params)
        self._torch_rebuilt = bool(getattr(ddp, "_has_rebuilt_buckets", False))
        """torch's ``_has_rebuilt_buckets`` as last seen after a forward."""
        self._rebuild_unread = 0
        """Forwards left in which to read a rebuild torch made that could not be read at once (see
        ``_relearn_layout``); 0 when there is none."""
        self._set_layout(read_layout(ddp, self._learner, self._base) or predict_initial(ddp, self._base))

        self.timer = StepTimer(self._rank, self._bucket_bytes)
        self._step = first_step
        """The number the next training forward gets (no_sync forwards count too, as in the engine)."""
        self._cur = 0
        self._synced = True
        self._active = False
        """A synchronised backward is under way: pending buckets mean something."""
        self._syncs = 0
        """Synchronised backwards that reached their end: all-reduce rounds, the same count on every rank."""
        self._queued = False
        self._armed = False
        """A forward through the DDP model (synced or not) awaits its backward."""
        self._forwarding = False
        """torch's forward of a training step is running (its collectives belong to ``self._step``)."""
        self._cut_short: int | None = None
        """The step whose backward began and never reached its end, seen at the next forward (an exception
        in backward that the training loop caught): torch's Reducer raises there, blaming unused
        parameters."""
        self._outside = OutsideForward(names, self._rank)
        self._losses = LossWatch(self._rank, module_weights(ddp.module))
        """Says when the gradient the loss sends into the model's output turns NaN or Inf, and back."""
        self._gradients = GradientWatch(self._rank, self._losses) if gradient_check_enabled() else None
        """With ``DDPSCOPE_CHECK_GRADIENTS``: says when a bucket's gradients turn NaN or Inf, and back."""
        self._failure_reported: int | None = None
        """The step whose failed bucket all-reduce was reported (``_report_bucket_failure``)."""
        self._watched: dict[int, tuple[Any, PlannedCollective | None]] = {}
        """seq -> (future, plan) of each all-reduce whose end a completion callback is to record; the
        callback or the end of backward, whichever pops it first (atomic under the GIL), records it.
        The future, not the Work: holding no Work keeps torch's Work lifetimes as they were."""
        self._reset_step()

        agent.emit_durable(
            rank_start_record(
                rank=self._rank,
                world_size=group_size(),  # the job's world, not the DDP group's
                group=self._group,
                device=str(params[0].device) if params else "cpu",
                engine="torch",
                find_unused_parameters=ddp.find_unused_parameters,
                bucket_cap_mb=float(ddp.bucket_bytes_cap) / _MIB,
                clock=estimate,
                static_graph=bool(getattr(ddp, "static_graph", False)),
                unobserved_ranks=absent,
            )
        )
        self._emit_layout("initial", first_step)

        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_param_hook(i)) for i, p in enumerate(params)
        ]
        self._wrap_forward(ddp)
        self._record_buffer_broadcasts(ddp)
        self._watch_join(ddp)
        self._observed: ObservedGroup | None = None
        """The group torch's Reducer all-reduces through (see ``adapter_group``); None with a user's hook."""
        if comm_hook is None:
            self._observed = ObservedGroup(self._group, self._reducer_allreduce, self._reducer_broadcast)
            ddp.reducer._update_process_group(self._observed)
            ddp.register_comm_hook = self._adopt_comm_hook  # type: ignore[method-assign]
        else:
            # torch's own register_comm_hook: it also names the hook in _get_ddp_logging_data().
            ddp.register_comm_hook(None, self._comm_hook)
        PROGRESS.pending_buckets = self.pending_wire
        PROGRESS.settled = self.settled
        PROGRESS.partial_step = self.partial_wire

    @property
    def reattachable(self) -> bool:
        """Detached and without a comm hook (torch takes one per model): ``instrument()`` may measure
        this model again."""
        return self.detached and self._observed is not None

    # -- records ---------------------------------------------------------------------------------

    def _emit_layout(self, reason: str, step: int = 0) -> None:
        agent.emit_durable(
            {
                "kind": "layout",
                "rank": self._rank,
                "step": step,
                "reason": reason,
                "buckets": self.layout.wire(),
                # torch's unused-parameter error names "Parameter indices" into this list.
                "parameter_order": list(self._base.names),
            }
        )

    def _set_layout(self, layout: Layout) -> None:
        self.layout = layout
        self._bucket_bytes = layout.bucket_bytes
        self._new_bytes = True
        """The step timer still has the previous layout's bucket sizes."""

    @property
    def bucket_layout(self) -> list[dict[str, Any]]:
        """torch's current buckets in the wire shape (index, bytes, dtype, device, parameters)."""
        return self.layout.wire()

    # -- forward ---------------------------------------------------------------------------------

    def _reset_step(self) -> None:
        n = len(self.params)
        self._times = [0] * n
        # A bucket count can never exceed the parameter count, and a rebuild may change it mid-step.
        self._launch = [0] * n
        self._done = [0] * n
        self._seqs = [0] * n
        self._works: list[Any] = [None] * n
        self._launch_plans: list[PlannedCollective | None] = [None] * n
        self._next_launch = 0
        """Buckets of this step whose all-reduce torch launched (it launches them in index order)."""
        self._next_done = 0
        """Buckets of this step whose all-reduce end is recorded (in index order too)."""

    def _wrap_forward(self, ddp: DistributedDataParallel) -> None:
        """Steps begin and end around torch's ``forward``: an instance attribute over the method, which
        ``remove_hooks`` deletes again. Module forward hooks would do the same at ~35 us a step each
        (torch's ``_call_impl`` leaves its fast path for any hook; measured on the MLP benchmark: three
        hooks +2.3 % training-thread CPU, this wrapper +0.0 %)."""
        original = ddp.forward
        before, after, failed = self._before_forward, self._after_forward, self._forward_failed

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            before()
            try:
                output = call_model(original, args, kwargs)
            except Exception as e:
                failed(e)
                raise
            after(output)
            return output

        runs_model(forward)  # torch.compile still compiles torch's DDP forward and the model in it
        ddp.forward = forward  # type: ignore[method-assign]

    def _before_forward(self) -> None:
        if not torch.is_grad_enabled():
            # Evaluation: no backward follows. Each forward is progress for the hang watchdog: an
            # evaluation longer than the timeout is working, not hung.
            PROGRESS.tick()
            return
        if self._next_done < self._next_launch:
            self._watch_launched()  # the last backward raised before its end
        self._cut_short = self._cur if self._armed and self._queued else None
        self._synced = synced = bool(self.ddp.require_backward_grad_sync)
        self._active = False
        self._queued = False
        self._reset_step()
        self._frozen.check(self._step)
        self._train_mode.check(self._step, self._syncs)
        self._replicas.take(self._step, self._syncs)
        self.timer.forward_start(self._step, synced)
        PROGRESS.enter("forward", self._step)
        self._forwarding = True

    def _after_forward(self, output: Any) -> None:
        self._forwarding = False
        if not torch.is_grad_enabled():
            return
        self.timer.forward_end()
        PROGRESS.enter("after_forward")
        self._armed = True
        self._cur = self._step
        self._step += 1
        rebuilt = bool(getattr(self.ddp, "_has_rebuilt_buckets", False))
        if rebuilt != self._torch_rebuilt:
            # torch rebuilds in _pre_forward, in whichever forward comes first after the synced backward
            # that recorded the gradient order (often a no_sync() one): read the new buckets now.
            self._torch_rebuilt = rebuilt
            if rebuilt:
                self._relearn_layout()
        elif self._rebuild_unread:
            self._relearn_layout()
        if self._synced:
            self._active = True
        # A hook on the outputs marks backward start even when no parameter gets a gradient here.
        hook_backward_start(grad_tensors(output), self._on_output_grad)

    def _relearn_layout(self) -> None:
        """Read torch's rebuilt buckets. Its Reducer cannot show a bucket of sparse gradients; torch's
        logging data has the rebuilt buckets then, but only from the forward after the rebuild's, so the
        read is tried again in the next few forwards (the step in between keeps the old layout)."""
        first = not self._rebuild_unread
        try:
            layout = read_layout(self.ddp, self._learner, self._base) if first else None
            layout = layout or logged_rebuilt_layout(self.ddp, self._base)
        except Exception:
            self._rebuild_unread = 0
            logger.warning("ddpscope: reading torch's rebuilt buckets failed", exc_info=True)
            return
        if layout is None:
            self._rebuild_unread = REBUILD_READ_TRIES if first else self._rebuild_unread - 1
            if not self._rebuild_unread:
                logger.warning(
                    "ddpscope: could not read torch's rebuilt bucket layout (by step %d)", self._cur
                )
            return
        self._rebuild_unread = 0
        if layout.buckets != self.layout.buckets:
            self._set_layout(layout)
        # Said even when torch rebuilt the same buckets: the collector's advice on bucket order depends
        # on whether the one rebuild has happened.
        self._emit_layout("rebuilt", self._cur)

    def _forward_failed(self, exc: Exception) -> None:
        """torch's forward raised (the exception goes on to the caller). It is said now, not only if it
        kills the process: a loop that catches it and goes on leaves this rank one synced step behind
        its peers, and this record says why. When torch's unfinished-reduction error comes from
        parameters frozen after wrapping, or from a backward cut short by an exception the loop caught, a
        note on the exception (shown in the user's traceback and shipped with the record) says so: torch's
        advice there is find_unused_parameters."""
        self._forwarding = False
        unfinished = UNFINISHED_REDUCTION in lifecycle.exception_text(exc)
        if unfinished and self._cut_short is not None:
            with contextlib.suppress(Exception):
                exc.add_note(f"ddpscope: {BACKWARD_CUT_SHORT.format(step=self._cut_short)}")
        elif unfinished:
            frozen = [n for p, n in zip(self.params, self._base.names, strict=True) if not p.requires_grad]
            if frozen:
                with contextlib.suppress(Exception):
                    exc.add_note(f"ddpscope: parameters {FROZEN_AFTER_WRAP.format(names=frozen)}")
        report_error(exc, fatal=False)

    # -- backward --------------------------------------------------------------------------------

    def _on_output_grad(self, grad: Any) -> None:
        """A tensor hook (the gradient) or a node pre-hook (a tuple of gradients): either way, the
        first sign of backward. Not once the step is over: a second backward through the same outputs
        (``retain_graph=True``) is no step of torch's DDP, which all-reduces nothing in it; its parameter
        hooks say so (``unsynced_gradients``), and a second step record of the same step would count it
        twice."""
        if not self._armed:
            return
        if not self._queued:
            self._begin_backward()
        self._losses.check(grad, self._cur, self._syncs)

    def _begin_backward(self) -> None:
        self._queued = True
        self.timer.backward_start()
        PROGRESS.enter("backward")
        torch.autograd.Variable._execution_engine.queue_callback(self._after_gradients)

    def _after_gradients(self) -> None:
        if self._next_launch == 0 and not any(self._times):
            # An autograd.grad() or backward(inputs=...) through the outputs that accumulated into no
            # parameter (a gradient penalty's input gradient): torch's Reducer saw nothing of it, and the
            # step's backward is still to come.
            self._queued = False
            PROGRESS.enter("after_forward")
            return
        # Runs before torch's Reducer finalizer (queued later, once every bucket is launched); queue
        # the end behind it.
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self._observed is not None:
            self._watch_launched()

    def _make_param_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._armed:
                self._outside.note(index, self._cur)  # model.module(x): no step, torch ignores it too
                return
            if not self._queued:
                self._begin_backward()
            self._times[index] = now_ns()
            PROGRESS.counter += 1
            if self._next_done < self._next_launch:
                self._poll()

        return hook

    def _reducer_allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """torch's Reducer all-reduces bucket k (or, with ``find_unused_parameters``, its bitmap of used
        parameters; under ``Join``, a shadow of a peer's bucket): recorded, then run on the real group.
        Called from C++ through ``ObservedGroup``. The all-reduce is launched exactly once whatever
        goes wrong in the bookkeeping around it."""
        group = self._group
        k = self._next_launch
        called = now_ns()
        plan: PlannedCollective | None = None
        try:
            bucket = (
                self._active
                and k < len(self.layout.buckets)
                and len(tensors) == 1
                and (tensors[0].is_floating_point() or tensors[0].is_complex())
            )
            if bucket:
                if self._gradients is not None:
                    self._check_bucket(k, tensors[0])
                plan = self._plan(k, tensors[0])
                seq = RECORDER.begin_planned(plan, self._cur)
            else:
                step = None if self.detached else self._cur
                site, source = None, "engine"
                if not self._armed:  # outside any step: a Join shadowing its peers' buckets?
                    join_site, origin = RECORDER.call_origin(1)
                    if origin == "join":
                        site, source, step = join_site, "join", None
                op = reduce_name(opts.reduceOp)
                seq = RECORDER.begin(
                    self._pg,
                    "all_reduce",
                    tuple(tensors),
                    reduce_op=op,
                    source=source,
                    step=step,
                    call_site=site,
                )
        except Exception:
            logger.warning("ddpscope: recording an all-reduce of torch's Reducer failed", exc_info=True)
            return group.allreduce(tensors, opts)
        try:
            work = group.allreduce(tensors, opts)
        except Exception as e:
            RECORDER.end(self._pg, seq, ok=False, error=str(e))
            raise
        try:
            if plan is None:
                self._watch(work, seq, None)
            else:
                self._launch[k] = called
                self._seqs[k] = seq
                self._works[k] = work
                self._launch_plans[k] = plan
                self._next_launch = k + 1
                if k + 1 == len(self.layout.buckets):
                    PROGRESS.enter("allreduce")
        except Exception:
            logger.warning("ddpscope: recording an all-reduce of torch's Reducer failed", exc_info=True)
        return work

    def _poll(self) -> None:
        """Record the end of each bucket all-reduce that completed, in order, as of now (during
        backward, from the parameter hooks: the training thread is there anyway)."""
        works = self._works
        while self._next_done < self._next_launch:
            k = self._next_done
            work = works[k]
            if not work.is_completed():
                return
            error = work_failure(work)
            if error is None:
                self._done[k] = now_ns()
            self._record_end(self._seqs[k], self._launch_plans[k], error)
            works[k] = None
            self._next_done = k + 1

    def _watch_launched(self) -> None:
        """Every bucket all-reduce launched and not ended yet gets a completion callback that records
        its end. Called when the gradients are done (waiting here instead would delay torch's finalizer,
        which dates the end of backward compute as it starts), after backward, and before the next
        forward (for a backward that raised)."""
        try:
            self._poll()
            for k in range(self._next_done, self._next_launch):
                self._watch(self._works[k], self._seqs[k], self._launch_plans[k], self._done, k)
                self._works[k] = None
            self._next_done = self._next_launch
        except Exception:
            logger.warning("ddpscope: watching the bucket all-reduces failed", exc_info=True)

    def _watch(
        self, work: Any, seq: int, plan: PlannedCollective | None, done: list[int] | None = None, k: int = 0
    ) -> None:
        future = work.get_future()
        self._watched[seq] = (future, plan)
        future.add_done_callback(functools.partial(self._on_end, seq, plan, done, k))

    def _on_end(
        self, seq: int, plan: PlannedCollective | None, done: list[int] | None, k: int, future: Any
    ) -> None:
        """A watched all-reduce completed (on the thread that completed it, or at once if it had).
        ``done`` is its step's own list of end times, so a callback late for its step cannot touch the
        next one's."""
        at = now_ns()
        if self._watched.pop(seq, None) is None:
            return  # the end of backward recorded it already
        error = future_failure(future)
        if error is None and done is not None:
            done[k] = at
        try:
            # A failure is recorded now: torch's finalizer raises it into backward(), and the process
            # may die of it.
            self._record_end(seq, plan, error)
        except Exception:
            logger.warning("ddpscope: recording an all-reduce end failed", exc_info=True)

    def _record_end(self, seq: int, plan: PlannedCollective | None, error: str | None) -> None:
        """The ``collective_end`` of an all-reduce recorded with ``plan`` (None: recorded in full)."""
        if error is not None:
            RECORDER.end(self._pg, seq, ok=False, error=error)
            if plan is not None:
                self._report_bucket_failure(error)
        elif plan is None:
            RECORDER.end(self._pg, seq, ok=True)
        else:
            RECORDER.end_planned(plan, seq)

    def _report_bucket_failure(self, error: str) -> None:
        """A bucket all-reduce of this step failed (a peer died, a timeout): torch's finalizer raises it
        into ``backward()`` from C++, where ddpscope cannot report it as the engine reports its own, and a
        loop that catches it and retries (elastic-style) would leave no trace of it. Said once per step,
        as a non-fatal ``rank_error``: the collector then knows this rank lost its peer, and blames the
        peer. If the exception also ends the process, the excepthook reports that as well (fatal)."""
        step = self._cur
        if self._failure_reported == step:
            return
        self._failure_reported = step
        failure = RuntimeError(error)
        failure.add_note(f"ddpscope: a gradient all-reduce of torch's DDP failed at step {step}")
        report_error(failure, fatal=False)

    def _adopt_comm_hook(self, state: object, hook: CommHook) -> None:
        """``ddp.register_comm_hook(state, hook)`` called after ``instrument()``: the hook goes through
        ddpscope as if it had been passed to ``instrument()``. Registered behind ddpscope's back, torch
        would call it instead of all-reducing through the observed group, and no bucket all-reduce would
        be measured any more (every step's communication read as zero)."""
        ddp = self.ddp
        del ddp.register_comm_hook  # the instance attribute: torch's own method again
        ddp.register_comm_hook(None, self._comm_hook)  # torch's checks; it refuses a second hook
        self._user_hook, self._user_state = hook, state
        if self._observed is not None:
            ddp.reducer._update_process_group(self._group)
            self._observed = None
        logger.info("ddpscope: the comm hook registered after instrument() is timed by ddpscope")

    # No annotations on purpose: torch checks them against dist.GradBucket and Future at registration,
    # and postponed annotations (``from __future__ import annotations``) are strings to it.
    def _comm_hook(self, state, bucket):
        """The user's comm hook, timed: used only when ``instrument()`` was given one."""
        t = now_ns()
        k = bucket.index()
        buf = bucket.buffer()
        step = None if self.detached else self._cur  # a detached model's steps are counted no more
        site, source = RECORDER.call_origin(1) if not self._armed else (None, "engine")
        if source != "join" and step is not None and self._gradients is not None and self._active:
            self._check_bucket(k, buf)
        # The user's own collectives are this bucket's reduction, recorded once, as the first is issued.
        began: list[tuple[int, PlannedCollective | None]] = []
        begin = functools.partial(self._begin_hook_reduction, k, buf, step, site, source, began)
        with RECORDER.hook_call(begin):
            fut = self._user_hook(self._user_state, bucket)  # type: ignore[misc]  # set on this path
        seq, plan = began[0] if began else (0, None)
        self._launch[k] = t
        self._seqs[k] = seq
        if bucket.is_last() and not self.detached:
            PROGRESS.enter("allreduce")  # nothing of a detached model's would ever return it to idle
        return fut.then(functools.partial(self._on_reduced, k, seq, plan))

    def _begin_hook_reduction(
        self,
        k: int,
        buf: torch.Tensor,
        step: int | None,
        site: str | None,
        source: str,
        began: list[tuple[int, PlannedCollective | None]],
    ) -> None:
        """Begin the record of bucket k's reduction through the user's hook (``RECORDER.hook_call``)."""
        if source == "join":  # a joined rank shadowing its peers' bucket all-reduces (torch's Join)
            seq = RECORDER.begin(
                self._pg, "all_reduce", (buf,), reduce_op="SUM", source="join", call_site=site
            )
            began.append((seq, None))
        elif step is None:
            seq = RECORDER.begin(self._pg, "all_reduce", (buf,), reduce_op="SUM", source="engine", step=step)
            began.append((seq, None))
        else:
            plan = self._plan(k, buf)
            began.append((RECORDER.begin_planned(plan, step), plan))

    def _check_bucket(self, k: int, flat: torch.Tensor) -> None:
        """Bucket k's gradients, about to be all-reduced, checked for NaN and Inf: the non-finite ones are
        named from the parameters' own ``.grad``, which torch copies into the bucket and leaves as they
        are until the end of backward."""
        assert self._gradients is not None
        params, names = self.params, self._base.names
        indices = self.layout.buckets[k] if k < len(self.layout.buckets) else []
        self._gradients.bucket(
            self._cur, self._syncs, k, flat, lambda: [(i, names[i], params[i].grad) for i in indices]
        )

    def _plan(self, k: int, buf: torch.Tensor) -> PlannedCollective:
        """Bucket k's all-reduce plan, made the first time a bucket of this index, size and dtype is
        reduced: torch's buckets keep their size and dtype step after step (a rebuild makes new keys),
        so like the engine's the adapter hands the recorder integers instead of reading the bucket's
        shape and building a record with the caches cold from backward (~105 us a bucket)."""
        key = (k, buf.numel(), buf.dtype)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 4 * len(self.params) + 64:
                self._plans.clear()  # keys from layouts long gone
            plan = RECORDER.plan(
                self._pg,
                "all_reduce",
                shapes=[list(buf.shape)],
                dtypes=[dtype_name(buf.dtype)],
                reduce_op="SUM",
            )
            self._plans[key] = plan
        return plan

    def _on_reduced(
        self, k: int, seq: int, plan: PlannedCollective | None, fut: torch.futures.Future[Any]
    ) -> Any:
        """On a gloo thread when the user's hook for bucket k completes; the value goes back to torch."""
        try:
            value = fut.value()
        except Exception as e:
            if seq:
                self._record_end(seq, plan, str(e))
            else:  # the hook failed before it issued a collective
                self._report_bucket_failure(str(e))
            raise
        self._done[k] = now_ns()
        if seq:
            self._record_end(seq, plan, None)
        return value

    def _end_backward(self) -> None:
        """Second queued callback: after torch's finalizer waited for every bucket."""
        end = now_ns()
        if self._active:
            self._syncs += 1
        try:
            if self._observed is not None:
                # torch wakes from its wait before the last callbacks ran; they (or _end_completed) record
                # the ends, the step record takes backward's end for a bucket not stamped yet (static graph's first
                # step launches every bucket after the gradients: watched only now).
                self._watch_launched()
                done, launch = self._done, self._launch
                for k in range(self._next_launch):
                    if launch[k] and not done[k]:
                        done[k] = end
            self._end_completed()
            self.timer.emit(self._fill_timer(), backward_end_ns=end)
        except Exception:
            logger.warning("ddpscope: building the step record failed", exc_info=True)
        finally:
            self._losses.backward_done()
            if self._active and self._gradients is not None:
                self._gradients.backward_done()
            self._active = False
            self._queued = False
            self._armed = False
            PROGRESS.enter("idle")

    def _end_completed(self) -> None:
        """Record the end of every watched all-reduce that has completed: torch's finalizer waited for
        them, but their callbacks wait for the GIL on a gloo thread, and a process that exits right
        after its last backward would lose the last bucket's end with them."""
        for seq in list(self._watched):
            entry = self._watched.get(seq)
            if entry is None or not entry[0].done():
                continue
            if self._watched.pop(seq, None) is not None:
                self._record_end(seq, entry[1], future_failure(entry[0]))

    def _fill_timer(self) -> list[str]:
        """Hand this step's bucket times to the timer; returns the unused parameters' names."""
        timer = self.timer
        if not self._synced:
            return []
        buckets = self.layout.buckets
        times, launch, done, seqs = self._times, self._launch, self._done, self._seqs
        # A bucket whose parameters all went unused is ready when torch launches it.
        ready = [max([times[i] for i in b], default=0) or launch[k] for k, b in enumerate(buckets)]
        if self._new_bytes:
            # Only after a layout change (at most twice a job): it allocates the timer's arrays.
            timer.set_buckets(self._bucket_bytes)
            self._new_bytes = False
        for k in sorted(range(len(buckets)), key=ready.__getitem__):
            if ready[k]:
                timer.bucket_ready(k, ready[k])
        for k in range(len(buckets)):
            timer.allreduce_launched(k, seqs[k], launch[k])
            timer.allreduce_done(k, done[k])
        names = self._base.names
        return [names[i] for i, t in enumerate(times) if not t]

    # -- watchdog view ---------------------------------------------------------------------------

    def settled(self) -> set[tuple[str, int]]:
        """(pg, seq) of the bucket all-reduces torch launched that completed and whose end is not recorded
        yet (read from the watchdog thread). A rank stuck in its own backward code has launched earlier
        buckets that completed long ago, unseen while its hooks do not run: it is not waiting in them."""
        if not self._active:
            return set()
        works, seqs, pg = self._works, self._seqs, self._pg
        out = {
            (pg, seqs[k])
            for k in range(self._next_done, self._next_launch)
            if (work := works[k]) is not None and work.is_completed()
        }
        out.update((pg, seq) for seq, (future, _) in list(self._watched.items()) if future.done())
        return out

    def pending_wire(self) -> list[dict[str, Any]]:
        """Buckets not reduced yet, in the PENDING_BUCKET wire shape (read from the watchdog thread);
        none before backward begins (see ``Reducer.pending_wire``)."""
        if not self._active or not self._queued:
            return []
        names = self._base.names
        times, launch, done = self._times, self._launch, self._done
        out = []
        for k, members in enumerate(self.layout.buckets):
            if done[k]:
                continue
            launched = bool(launch[k])
            missing = [] if launched else [names[i] for i in members if not times[i]]
            entry: dict[str, Any] = {"index": k, "missing": missing, "launched": launched}
            if launched and not self._seqs[k] and self._user_hook is not None:
                entry["hook"] = hook_name(self._user_hook)  # it issued nothing: torch waits on its future
            out.append(entry)
        return out

    def partial_wire(self) -> dict[str, Any] | None:
        """The step in progress (``records.PARTIAL_STEP``, read from the watchdog thread): the timer has
        forward and backward, the bucket times are still in this adapter's arrays (``_fill_timer``
        hands them over at the end of backward)."""
        partial = self.timer.partial()
        if partial is None or not partial["synced"]:
            return partial
        buckets = self.layout.buckets
        n = len(buckets)
        ready, launch, done = [0] * n, [0] * n, [0] * n
        if self._active and self._queued:
            times, launched, finished, works = self._times, self._launch, self._done, self._works
            for k, members in enumerate(buckets):
                got = [times[i] for i in members]
                launch[k] = launched[k]
                # torch launches a bucket whose parameters went unused: it was ready then.
                ready[k] = max(got, default=0) if all(got) else launched[k]
                done[k] = finished[k] or (untimed_end(works[k]) if launched[k] else 0)
        partial.update(
            bucket_ready_ns=ready,
            allreduce_start_ns=launch,
            allreduce_end_ns=done,
            bucket_bytes=list(self._bucket_bytes),
        )
        return partial

    def _record_buffer_broadcasts(self, ddp: DistributedDataParallel) -> None:
        """Record torch's buffer broadcast (at the start of each forward; under ``Join`` also its final
        model sync), which runs in C++ on the model's group, out of the recorder's sight, and count it
        as time blocked in a collective (``collectives.BlockedTime``): a rank that waits there for a
        slow peer would otherwise show that peer's slowness as its own forward. An instance attribute
        over torch's method, which ``remove_hooks`` deletes again."""
        original = ddp._distributed_broadcast_coalesced
        pg = self._pg

        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            # torch's signature: (tensors, buffer_size, authoritative_rank=0)
            tensors = args[0] if args else kwargs.get("tensors", ())
            seq = self._begin_broadcast(
                tensors, args[2] if len(args) > 2 else kwargs.get("authoritative_rank", 0)
            )
            called_ns = now_ns()
            try:
                result = original(*args, **kwargs)
            except Exception as e:
                RECORDER.end(pg, seq, ok=False, error=str(e))
                raise
            finally:
                RECORDER.blocked_time().ns += now_ns() - called_ns
            RECORDER.end(pg, seq)
            return result

        ddp._distributed_broadcast_coalesced = recorded  # type: ignore[method-assign]

    def _begin_broadcast(self, tensors: Any, src: int) -> int:
        """Number and record a broadcast torch's DDP issues in C++ from group rank ``src``, as the engine
        records its own (``ddp/broadcast.py``): the tensors flattened per dtype, as the wire carries
        them, and a step while a training forward runs. Never raises."""
        try:
            numels: dict[torch.dtype, int] = {}
            for t in tensors:
                numels[t.dtype] = numels.get(t.dtype, 0) + t.numel()
            root = torch.distributed.get_global_rank(self._group, src)
        except Exception:
            logger.warning("ddpscope: reading a broadcast of torch's DDP failed", exc_info=True)
            numels, root = {}, None
        return RECORDER.begin(
            self._pg,
            "broadcast",
            (),
            shapes=[[n] for n in numels.values()],
            dtypes=[dtype_name(d) for d in numels],
            source="engine",
            step=self._step if self._forwarding else None,
            root=root,
        )

    def _reducer_broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """torch's Reducer broadcasts rank 0's rebuilt bucket indices (in the forward after the
        gradient order was recorded): recorded as the engine records its own, then run on the real
        group. Called from C++ through ``ObservedGroup``; launched exactly once whatever goes wrong
        in the bookkeeping around it."""
        seq = self._begin_broadcast(tensors, opts.rootRank)
        try:
            work = self._group.broadcast(tensors, opts)
        except Exception as e:
            RECORDER.end(self._pg, seq, ok=False, error=str(e))
            raise
        try:
            self._watch(work, seq, None)
        except Exception:
            logger.warning("ddpscope: recording a broadcast of torch's Reducer failed", exc_info=True)
        return work

    def _watch_join(self, ddp: DistributedDataParallel) -> None:
        """Under torch's ``Join``, a rank out of data shadows its peers' steps without counting their syncs, so
        its later sync counts name other moments than theirs: its replica digests stop at the first shadowed
        step. An instance attribute over torch's ``join_hook``, which ``remove_hooks`` deletes again."""
        original = ddp.join_hook
        stop = self._replicas.stop

        @functools.wraps(original)
        def join_hook(**kwargs: Any) -> Any:
            hook = original(**kwargs)
            main_hook = hook.main_hook

            def shadowing() -> None:
                stop()
                main_hook()

            hook.main_hook = shadowing
            return hook

        ddp.join_hook = join_hook  # type: ignore[method-assign]

    @property
    def step_reached(self) -> int:
        """The number this model's next training forward would get: where a model taking over goes on."""
        return self._step

    def remove_hooks(self) -> None:
        """Detach the hooks and give torch's Reducer its own process group back (a user's comm hook
        stays registered, as torch cannot unregister one; it keeps reducing, unmeasured)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.ddp.__dict__.pop("_distributed_broadcast_coalesced", None)
        self.ddp.__dict__.pop("forward", None)
        self.ddp.__dict__.pop("join_hook", None)
        self.ddp.__dict__.pop("register_comm_hook", None)
        if self._observed is not None:
            self.ddp.reducer._update_process_group(self._group)
        self._active = False
        self.detached = True
        if PROGRESS.pending_buckets == self.pending_wire:
            PROGRESS.pending_buckets = list
        if PROGRESS.settled == self.settled:
            PROGRESS.settled = set
        if PROGRESS.partial_step == self.partial_wire:
            PROGRESS.partial_step = no_step
