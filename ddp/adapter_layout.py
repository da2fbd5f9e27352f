"""torch's own bucket layout, as the ``instrument()`` adapter sees it.

torch's C++ Reducer shows its buckets to Python only through ``_get_zeros_like_grad_buckets``
(``GradBucket.parameters()`` of every bucket), so the adapter **reads** them there at ``instrument()``
time and again right after the forward in which torch rebuilt them (in the gradient-ready order of the
first synchronised backward, at the start of the next forward, which may be a ``no_sync()`` one).
Where that call is missing, the initial layout is **predicted** with the very functions torch's
constructor used (``_build_params_for_reducer``, ``compute_bucket_size_limits``,
``_compute_bucket_assignment_by_size``, buckets reversed).

A ``Layout`` holds, per bucket, the indices into the reducer's parameter list (torch's order: the
module's trainable parameters, shared ones once), plus names and bytes in the wire shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpscope.agent.log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Layout:
    """Buckets as lists of parameter indices (into the adapter's parameter list), in bucket order."""

    buckets: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]
    """Name of every parameter of the adapter's list (index -> name)."""
    nbytes: tuple[int, ...]
    """Bytes of every parameter (index -> bytes)."""
    dtypes: tuple[str, ...]
    devices: tuple[str, ...]

    @property
    def bucket_bytes(self) -> list[int]:
        return [sum(self.nbytes[i] for i in b) for b in self.buckets]

    def wire(self) -> list[dict[str, Any]]:
        """The BUCKET objects of a ``layout`` record (agent/records.py)."""
        out = []
        for index, members in enumerate(self.buckets):
            first = members[0] if members else 0
            out.append(
                {
                    "index": index,
                    "bytes": sum(self.nbytes[i] for i in members),
                    "dtype": self.dtypes[first],
                    "device": self.devices[first],
                    "parameters": [self.names[i] for i in members],
                }
            )
        return out

    def with_buckets(self, buckets: Sequence[Sequence[int]]) -> Layout:
        return Layout(tuple(tuple(b) for b in buckets), self.names, self.nbytes, self.dtypes, self.devices)


def reducer_parameters(ddp: Any) -> tuple[list[torch.Tensor], list[str]]:
    """The parameters torch's Reducer works on, in its order, with their names in ``ddp.module``.

    The Reducer receives every parameter that requires grad, module by module, shared ones once and
    ``_ddp_params_and_buffers_to_ignore`` left out (``_build_params_for_reducer``); the names come from
    ``named_modules`` in the same walk so a shared parameter keeps its first name.
    """
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    seen: set[int] = set()
    params: list[torch.Tensor] = []
    names: list[str] = []
    for module_name, module in ddp.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if not param.requires_grad or full in ignored or id(param) in seen:
                continue
            seen.add(id(param))
            params.append(param)
            names.append(full)
    return params, names


def empty_layout(params: Sequence[torch.Tensor], names: Sequence[str]) -> Layout:
    """No bucket yet, but the per-parameter facts every layout shares."""
    return Layout(
        (),
        tuple(names),
        tuple(p.numel() * p.element_size() for p in params),
        tuple(str(p.dtype).removeprefix("torch.") for p in params),
        tuple(str(p.device) for p in params),
    )


def predict_initial(ddp: Any, base: Layout) -> Layout:
    """The layout torch's constructor built, recomputed with torch's own functions.

    Falls back to one bucket holding every parameter (torch's choice for iteration 0 unless
    ``find_unused_parameters=True``) when a private helper is missing in this torch version.
    """
    count = len(base.names)
    try:
        params, expect_sparse = ddp._build_params_for_reducer()
        limits, _ = ddp._bucket_config.compute_bucket_size_limits(
            static_graph=bool(ddp.static_graph), find_unused_parameters=bool(ddp.find_unused_parameters)
        )
        assign = dist._compute_bucket_assignment_by_size  # type: ignore[attr-defined]  # private in torch
        indices, _ = assign(params, limits, expect_sparse)
        if sorted(i for b in indices for i in b) == list(range(count)):
            return base.with_buckets(list(reversed(indices)))
        logger.debug("predicted buckets do not cover the %d parameters; using one bucket", count)
    except (AttributeError, TypeError, RuntimeError):
        logger.debug("cannot recompute torch's initial buckets; using one bucket", exc_info=True)
    return base.with_buckets([list(range(count))])


def logged_rebuilt_layout(ddp: Any, base: Layout) -> Layout | None:
    """torch's rebuilt buckets as its DDP logging data gives them (``rebuilt_per_bucket_param_indices``,
    "0, 4 3 2 1": buckets split by commas, the Reducer's parameter indices by spaces), for when
    ``read_layout`` cannot tell: the Reducer's own view fails on a bucket of sparse gradients, which has no
    flat tensor to copy. None before a rebuild, or when the indices do not cover the parameters."""
    try:
        text = str(ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices") or "")
        buckets = [[int(i) for i in part.split()] for part in text.split(",") if part.strip()]
    except (AttributeError, RuntimeError, ValueError):
        logger.debug("cannot read torch's rebuilt buckets from its logging data", exc_info=True)
        return None
    if sorted(i for b in buckets for i in b) != list(range(len(base.names))):
        return None
    return base.with_buckets(buckets)


class LayoutLearner:
    """Assembles a layout from torch's GradBucket objects (the Reducer's, one per bucket)."""

    __slots__ = ("index_of", "_seen")

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.index_of = {id(p): i for i, p in enumerate(params)}
        """id(parameter) -> its index in the adapter's parameter list."""
        self._seen: dict[int, tuple[int, ...]] = {}

    def reset(self) -> None:
        self._seen = {}

    def observe(self, bucket: Any) -> None:
        """Remember which parameters ``bucket`` holds (one call per bucket and step)."""
        index_of = self.index_of
        self._seen[int(bucket.index())] = tuple(index_of.get(id(p), -1) for p in bucket.parameters())

    def result(self, base: Layout) -> Layout | None:
        """The observed layout, or None when the buckets seen so far do not form a complete layout."""
        seen = self._seen
        if not seen or sorted(seen) != list(range(len(seen))):
            return None
        buckets = [seen[k] for k in range(len(seen))]
        members = sorted(i for b in buckets for i in b)
        if members != list(range(len(base.names))):
            logger.debug("observed buckets do not cover the parameters exactly: %s", buckets)
            return None
        return base.with_buckets(buckets)


def read_layout(ddp: Any, learner: LayoutLearner, base: Layout) -> Layout | None:
    """torch's current buckets, read from its Reducer; None if this torch cannot tell.

    ``_get_zeros_like_grad_buckets`` is the Reducer's only view of its buckets from Python; it hands
    each bucket over with a zeroed copy of its gradients, so the call briefly allocates the size of
    the model's gradients (once at ``instrument()`` and once at torch's rebuild).
    """
    try:
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
    except (AttributeError, RuntimeError):
        logger.debug("cannot read torch's buckets from its Reducer", exc_info=True)
        return None
    learner.reset()
    for bucket in buckets:
        learner.observe(bucket)
    del buckets
    return learner.result(base)
