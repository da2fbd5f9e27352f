"""The process group torch's Reducer talks to under ``instrument()``: the real one, seen through.

torch's C++ Reducer launches every bucket all-reduce as ``process_group_->allreduce(...)``. Giving it
this group instead (``reducer._update_process_group``, the hook torch keeps for elastic jobs) lets
``instrument()`` see each launch and keep its ``Work`` without registering a communication hook. That
matters for cost: with any comm hook registered, the Reducer stops scaling gradients by 1/world while
it copies them into their bucket, so a hook must scale the whole bucket in one more pass, and it
takes the GIL three times per bucket (hook, ``then`` callback on a gloo thread, reading the result).
Here torch keeps its own fused path and ``allreduce`` is one Python call per bucket.

``allreduce`` goes to the observer, ``broadcast`` (the rebuild's bucket indices) to the broadcast
observer when one is given. Every other collective torch's trampoline lets Python override
is passed to the real group from Python too, never left to the base class: the trampoline calls the
base class with the GIL held, and gloo's worker thread may need the GIL while it holds the lock its
queue takes (it frees a finished Work there), so a collective reaching gloo that way can deadlock
(measured: torch's rebuild broadcast hung both ranks within 10 steps). From Python the real group's
bindings release the GIL first. No backend is registered on this object, so a collective missing
here fails with torch's error instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

AllreduceObserver = Callable[[list[torch.Tensor], Any], Any]
"""(tensors, AllreduceOptions) -> Work: runs the all-reduce on the real group and returns its Work."""
BroadcastObserver = Callable[[list[torch.Tensor], Any], Any]
"""(tensors, BroadcastOptions) -> Work: runs the broadcast on the real group and returns its Work."""


class ObservedGroup(dist.ProcessGroup):
    """``inner`` as seen by torch's Reducer, with its all-reduces handed to ``observer`` (and its
    broadcasts to ``broadcast_observer``, if given)."""

    def __init__(
        self,
        inner: dist.ProcessGroup,
        observer: AllreduceObserver,
        broadcast_observer: BroadcastObserver | None = None,
    ) -> None:
        # torch's stub lists only the (store, rank, size) overload; pybind also has (rank, size).
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]
        self.inner = inner
        self._observer = observer
        self._broadcast_observer = broadcast_observer

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]  # torch's C++ signature
        return self._observer(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        if self._broadcast_observer is not None:
            return self._broadcast_observer(tensors, opts)
        return self.inner.broadcast(tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        return self.inner.allreduce_coalesced(tensors, opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        return self.inner.allgather(outputs, inputs, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Any:  # type: ignore[override]
        return self.inner.reduce_scatter(outputs, inputs, opts)

    def barrier(self, opts: Any) -> Any:  # type: ignore[override]
        return self.inner.barrier(opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self.inner.recv(tensors, src, tag)

    def getBackendName(self) -> str:  # noqa: N802  # the C++ name torch's trampoline looks up
        return str(self.inner.name())
