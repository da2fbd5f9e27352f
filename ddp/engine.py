"""``DistributedDataParallel``: a drop-in for torch's wrapper that measures every bucket of every step.

Construction (a collective step, every rank of the group calls it): clock ping-pong with rank 0, the
cross-rank layout check, the state broadcast from rank 0, the bucket layout; then a ``rank_start`` and
a ``layout`` record. Each forward may rebuild the buckets once (after the first synchronised backward,
in rank 0's observed gradient-ready order, as torch does), broadcasts buffers from rank 0, runs the
module and arms the reducer; each backward ends with one ``step`` record (reducer.py). Uneven inputs:
``with model.join():`` (torch's ``Join``; the protocol is in join.py).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parameter import is_lazy

from ddpscope import agent
from ddpscope.agent import clock as agent_clock
from ddpscope.agent.log import get_logger
from ddpscope.ddp import monitor, peer_presence, watchdog
from ddpscope.ddp.broadcast import broadcast_coalesced
from ddpscope.ddp.clock import estimate_offset
from ddpscope.ddp.collectives import disabled
from ddpscope.ddp.compile_skip import call_model, runs_model
from ddpscope.ddp.drift import FrozenAtWrap
from ddpscope.ddp.errors import report_error
from ddpscope.ddp.groups import global_rank, group_size, pg_name, replica_ranks
from ddpscope.ddp.join import EngineJoinHook, find_common_rank, send_sync_flag
from ddpscope.ddp.layout import check_same_layout, describe
from ddpscope.ddp.nonfinite import module_weights
from ddpscope.ddp.progress import PROGRESS
from ddpscope.ddp.rank_start import rank_start_record
from ddpscope.ddp.reducer import SPARSE_GRADIENTS, Reducer
from ddpscope.ddp.replicas import ReplicaDigest
from ddpscope.ddp.step_record import StepTimer
from ddpscope.ddp.train_mode import EvalModeWatch

logger = get_logger(__name__)

# torch keyword arguments that change nothing here when left at these values.
_HARMLESS_DEFAULTS: dict[str, Any] = {
    "device_ids": None,
    "output_device": None,
    "dim": 0,
    "check_reduction": False,
    "static_graph": False,
    "init_sync": True,
    "mixed_precision": None,
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "device_mesh": None,
    "skip_all_reduce_unused_params": False,
    "bucket_cap_mb_list": None,
    "batched_grad_copy": False,
    "forward_sync_buffers": None,
}

_REMEDIES: dict[str, str] = {
    "device_ids": "move the module to its device before wrapping it and drop device_ids",
    "output_device": "drop output_device; outputs stay where the module puts them",
    "dim": "split the batch yourself; only dim=0 semantics are supported",
    "static_graph": "drop it; buckets are rebuilt after the first iteration anyway, and "
    "find_unused_parameters=True handles parameters that are never used (for reentrant activation "
    "checkpointing, pass use_reentrant=False to torch.utils.checkpoint)",
    "init_sync": "drop it; the state is always broadcast from rank 0 at construction",
    "mixed_precision": "cast the module yourself (module.to(dtype)); each dtype gets its own buckets",
    "bucket_cap_mb_list": "use bucket_cap_mb",
}


class _Interleaving:
    """Notices two engine models training in turn in one process (a GAN's generator and discriminator):
    their step records share the rank's stream. Models trained one after the other (a sweep) do not
    mix, so only a model that trains again after another one did is told about, once per process."""

    def __init__(self) -> None:
        self.last: weakref.ref[DistributedDataParallel] | None = None
        self.warned = False

    def forward(self, model: DistributedDataParallel) -> None:
        last = self.last
        if last is not None and last() is model:
            return
        self.last = weakref.ref(model)
        if last is None or last() is None or model._step == model._first_step or self.warned:
            return
        self.warned = True
        logger.warning(
            "ddpscope: rank %d trains two models wrapped in ddpscope's DistributedDataParallel in turn. Both "
            "models' step records go to the rank's one stream, each numbered by its model: the collector's "
            "per-step views (steps, timeline, stragglers) mix them. Collectives, hangs and incidents stay "
            "exact. To measure one model's steps only, wrap the other in torch's DistributedDataParallel.",
            model._global_rank,
        )


_INTERLEAVING = _Interleaving()

WITHOUT_DDPSCOPE = (
    "DistributedDataParallel: ranks {ranks} run without ddpscope (DDPSCOPE_DISABLED set in their "
    "environment, on their node only?), so their DistributedDataParallel is torch's own, whose construction "
    "and gradient all-reduces differ from ddpscope's engine: the job would hang. Set DDPSCOPE_DISABLED alike "
    "on every rank (or use torch's DDP with ddpscope.ddp.instrument(), which trains on beside such ranks)."
)

_MODELS: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
"""The engine models of this process: a model built while others live numbers its steps on from theirs."""


def _first_step(job: str) -> int:
    """The step a model built now starts at: where the live engine models of the same job have got to. A
    model built again (after unfreezing layers, after re-creating the process group) continues the job's
    steps instead of repeating its numbers; models built together (a GAN's two) all start at 0."""
    return max((m._step for m in list(_MODELS) if m._job == job), default=0)


def _check_unsupported(unsupported: dict[str, Any], module: nn.Module) -> None:
    for key, value in unsupported.items():
        if key not in _HARMLESS_DEFAULTS:
            raise TypeError(f"DistributedDataParallel() got an unexpected keyword argument {key!r}")
        if key == "check_reduction":
            continue  # deprecated in torch and ignored there too
        if key == "device_ids" and value is not None:
            devices = {p.device for p in module.parameters()}
            wanted = {torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in value}
            if len(value) == 1 and devices == wanted:
                continue  # the module already lives on that one device: nothing to do
        if key == "output_device" and value is not None and unsupported.get("device_ids"):
            continue
        if value is _HARMLESS_DEFAULTS[key] or value == _HARMLESS_DEFAULTS[key]:
            continue
        remedy = _REMEDIES.get(key, "drop the argument")
        raise ValueError(
            f"ddpscope DistributedDataParallel does not support {key}={value!r}: {remedy}. "
            "(Or keep torch's own DistributedDataParallel and use ddpscope.ddp.instrument().)"
        )


def _check_dense_gradients(module: nn.Module) -> None:
    """Refuse, before any collective, the modules torch's DDP knows to give sparse gradients: the engine's
    buckets are dense (torch all-reduces each sparse gradient on its own)."""
    sparse = [
        name or "(the module itself)"
        for name, m in module.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    ]
    if sparse:
        raise ValueError(SPARSE_GRADIENTS.format(where=f" (embeddings with sparse=True: {sparse})"))


def _check_materialized(module: nn.Module) -> None:
    """Refuse, before any collective, parameters a lazy module has not created yet (``nn.LazyLinear`` before
    its first forward): they have no shape to bucket or broadcast."""
    lazy = [name for name, p in module.named_parameters() if is_lazy(p)]
    lazy += [name for name, b in module.named_buffers() if is_lazy(b)]
    if lazy:
        raise ValueError(
            f"DistributedDataParallel: {len(lazy)} parameter(s) or buffer(s) of this module are not created yet "
            f"({', '.join(lazy[:5])}{', ...' if len(lazy) > 5 else ''}): a lazy module (nn.LazyLinear, "
            "nn.LazyConv2d, ...) makes them at its first forward. Run one forward with a batch of the real shape "
            "before wrapping the module, on every rank."
        )


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism with per-bucket measurements; see the module docstring.

    ``bucket_cap_mb=None`` means torch's default: 25 MiB buckets with a 1 MiB first bucket.
    With ddpscope disabled (``DDPSCOPE_DISABLED=1``) the constructor returns torch's own
    ``DistributedDataParallel`` instead: same training, no hooks, nothing recorded.
    """

    def __new__(cls, module: nn.Module, **kwargs: Any) -> Any:
        if disabled():
            kwargs.setdefault("bucket_cap_mb", None)
            return nn.parallel.DistributedDataParallel(module, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
        **unsupported: Any,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)  # nn.Module's __init__ does not call on along the MRO
        _check_unsupported(unsupported, module)
        _check_dense_gradients(module)
        _check_materialized(module)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs a process group: call "
                "torch.distributed.init_process_group() before wrapping the module."
            )
        # Recorder patches, rank_error hooks, hang watchdog and heartbeats: before the engine's first collective.
        monitor.enable()
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        """Broadcast the buffers at the next forward: after a synchronised training forward only, as in
        torch (its attribute of the same name). An evaluation, or a ``no_sync()`` micro-batch, leaves the
        buffers as they are for the forward after it: uneven evaluation loops stay collective-free."""
        self._divide_by_initial_world_size = True
        self._pg = pg_name(process_group)
        self._rank = dist.get_rank(process_group)
        self._world = dist.get_world_size(process_group)
        self._global_rank = global_rank()
        self._job = str(getattr(agent.get_agent().config, "job", ""))
        self._step = self._first_step = _first_step(self._job)
        _MODELS.add(self)

        named = list(module.named_parameters())
        trainable = [(n, p) for n, p in named if p.requires_grad]
        if not trainable:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module has no parameter that requires a gradient."
            )

        self._frozen = FrozenAtWrap(module, self._global_rank)
        self._train_mode = EvalModeWatch(module, self._global_rank)
        # Before ddpscope's first collective: ranks without ddpscope run torch's own DDP, which never
        # joins it, and would leave these ranks waiting until the group's timeout.
        absent = peer_presence.missing(process_group, wait_s=watchdog.hang_timeout_setting())
        if absent:
            raise RuntimeError(WITHOUT_DDPSCOPE.format(ranks=absent))
        estimate = estimate_offset(process_group)
        agent_clock.set_offset(estimate.offset_ns, estimate.error_ns)
        buffers = list(module.named_buffers()) if broadcast_buffers else []
        # A module without buffers skips the per-forward walk of its tree (torch decides once too).
        self._has_buffers = any(b is not None for b in module.buffers())
        settings = {
            "bucket_cap_mb": bucket_cap_mb,
            "find_unused_parameters": find_unused_parameters,
            "broadcast_buffers": broadcast_buffers,
        }
        check_same_layout(describe(named, buffers, settings), process_group, self._pg)
        broadcast_coalesced([p for _, p in named] + [b for _, b in buffers], group=process_group, pg=self._pg)

        self._timer = StepTimer(self._global_rank)
        self._reducer = Reducer(
            [p for _, p in trainable],
            [n for n, _ in trainable],
            group=process_group,
            pg=self._pg,
            rank=self._rank,
            world_size=self._world,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            timer=self._timer,
            weights=module_weights(module),
        )
        self._replicas = ReplicaDigest(
            module, [p for _, p in trainable], self._global_rank, replicas=replica_ranks(process_group)
        )
        first = trainable[0][1]
        agent.emit_durable(
            rank_start_record(
                rank=self._global_rank,
                world_size=group_size(),  # the job's world, not the DDP group's
                group=process_group,
                device=str(first.device),
                engine="ddpscope",
                find_unused_parameters=find_unused_parameters,
                bucket_cap_mb=25.0 if bucket_cap_mb is None else float(bucket_cap_mb),
                clock=estimate,
            )
        )
        self._emit_layout("initial")

    # -- records ---------------------------------------------------------------------------------

    def _emit_layout(self, reason: str) -> None:
        agent.emit_durable(
            {
                "kind": "layout",
                "rank": self._global_rank,
                "step": self._step,
                "reason": reason,
                "buckets": self._reducer.layout_wire(),
                "parameter_order": self._reducer.names,
            }
        )

    @property
    def bucket_layout(self) -> list[dict[str, Any]]:
        """The current buckets in the wire shape (index, bytes, dtype, device, parameters)."""
        return self._reducer.layout_wire()

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        joining = self._join_config.enable
        if not torch.is_grad_enabled():
            # Evaluation: no gradients to reduce, but buffers are synced as torch does. Each forward is
            # progress for the hang watchdog: an evaluation longer than the timeout is working, not hung.
            PROGRESS.tick()
            if joining:
                Join.notify_join_context(self)
                if self._reducer.wants_rebuild():  # a joined rank rebuilds at each iteration it shadows
                    self._rebuild_buckets()
            self._sync_buffers()
            self.require_forward_param_sync = False
            if joining:
                send_sync_flag(self, False)
            return call_model(self.module, args, kwargs)
        synced = self.require_backward_grad_sync
        reducer = self._reducer
        _INTERLEAVING.forward(self)
        self._frozen.check(self._step)
        self._train_mode.check(self._step, reducer.syncs)
        self._replicas.take(self._step, reducer.syncs)
        if joining:
            self._notify_join(reducer)
        # Under Join a rank that joined cannot know whether this forward is synced when it rebuilds
        # (the flag comes later): rebuild in any forward then, as torch always does.
        if (synced or joining) and reducer.wants_rebuild():
            self._rebuild_buckets()
        try:
            reducer.prepare_forward(self._step, synced)
        except RuntimeError as exc:
            report_error(exc, fatal=False)  # a loop that catches it goes on with a rank out of step
            raise
        self._sync_buffers()
        self.require_forward_param_sync = synced
        if joining:
            send_sync_flag(self, synced)
        try:
            out = call_model(self.module, args, kwargs)
        except Exception as exc:
            # Said now, not only if it kills the process: a training loop that catches it and goes on to
            # the next batch leaves this rank one synced step behind its peers, and this record is the
            # only trace of why (the collector ties it to the hang or the early exit that follows).
            report_error(exc, fatal=False)
            raise
        self._timer.forward_end()
        reducer.after_forward(out, synced)
        self._step += 1
        return out

    def _rebuild_buckets(self) -> None:
        """Adopt rank 0's observed gradient-ready order so every rank builds the same buckets."""
        order_log = self._reducer.ready_log
        assert order_log is not None
        order = torch.tensor(order_log, dtype=torch.int64)
        broadcast_coalesced([order], group=self.process_group, pg=self._pg, step=self._step)
        self._reducer.rebuild(order.tolist())
        self._emit_layout("rebuilt")
        logger.info("ddpscope: buckets rebuilt in gradient-ready order at step %d", self._step)

    def _sync_buffers(self, *, joined: bool = False) -> None:
        """Broadcast buffers from rank 0 or, under Join, from the highest rank still training (a rank
        that joined has stale buffers), if the last forward was a synchronised training one
        (``require_forward_param_sync``); ``joined``: called for a rank that joined (``join.py``)."""
        if not self.require_forward_param_sync:
            return
        if not self.broadcast_buffers or self._world == 1 or not self._has_buffers:
            return
        buffers = [b for b in self.module.buffers() if b is not None]
        if not buffers:
            return
        src = find_common_rank(self, not joined) if self._join_config.enable else 0
        # In-place writes must not invalidate tensors autograd saved (torch does the same).
        with torch.no_grad(), _unsafe_preserve_version_counter(tuple(buffers)):
            broadcast_coalesced(
                buffers,
                group=self.process_group,
                pg=self._pg,
                src_rank=src,
                step=None if joined else self._step,
            )

    # -- uneven inputs (torch's Join; the protocol is in join.py) ---------------------------------

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Train on uneven inputs: ``with model.join(): for batch in my_shard: ...``. A rank that runs
        out of batches shadows its peers' collectives until they are done too; then every rank takes
        the model of the last rank to finish. Gradients are divided by the world size, or with
        ``divide_by_initial_world_size=False`` by the number of ranks still training. Same meaning
        and arguments as torch's ``DistributedDataParallel.join``."""
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return EngineJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._reducer.params[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _notify_join(self, reducer: Reducer) -> None:
        """Tell ranks that joined that this one still trains; with ``divide_by_initial_world_size=False``
        learn how many still do, the divisor of this step's gradients."""
        work = Join.notify_join_context(self)
        if work is not None and not self._divide_by_initial_world_size:
            work.wait()
            reducer.scale = 1.0 / float(work.result()[0].item())
        else:
            reducer.scale = 1.0 / self._world

    def _broadcast_state(self, src_rank: int) -> None:
        """Every parameter (and buffer, with ``broadcast_buffers``) from ``src_rank``: the end of Join."""
        tensors: list[torch.Tensor] = list(self.module.parameters())
        if self.broadcast_buffers:
            tensors += [b for b in self.module.buffers() if b is not None]
        with torch.no_grad():
            broadcast_coalesced(tensors, group=self.process_group, pg=self._pg, src_rank=src_rank)

    # -- gradient accumulation -------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the gradient all-reduce for the backwards inside: gradients accumulate locally."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def remove_hooks(self) -> None:
        """Detach the engine from the module's parameters (the module keeps working on its own)."""
        self._reducer.remove_hooks()


runs_model(DistributedDataParallel.forward)  # torch.compile still compiles the wrapped module
