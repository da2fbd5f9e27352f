"""Gradient buckets: which parameters share one flat all-reduce buffer, and the buffers themselves.

The assignment follows torch's ``compute_bucket_assignment_by_size`` (reducer.cpp) step for step, so a
ddpscope job reduces exactly the same byte ranges as stock DDP and sums in the same order on gloo:
walk the parameters in the given order, one open bucket per (dtype, device), close a bucket once it
reaches its size limit (the first limit for the first bucket of each key, then the next one). The one
departure is the order of a rebuild's buckets when dtypes are mixed (``assign_buckets``): the same buckets,
each placed where it becomes ready.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

MIB = 1024 * 1024
FIRST_BUCKET_BYTES = MIB
"""torch's ``_DEFAULT_FIRST_BUCKET_BYTES``: the small bucket used when ``bucket_cap_mb`` is not given."""
LEND_MIN_BYTES = 64 * 1024
"""A reduced gradient is lent its bucket memory instead of copied back (``Bucket.lend``) from this size
up, and a bucket lends only when its lendable bytes reach this much per parameter it holds: making a
tensor costs ~2-3 us of Python, about what copying 32 KiB costs once caches are cold."""
LEND_MAX_CPU_BUFFER_BYTES = 32 * MIB
"""No lending from a CPU buffer this big: glibc's malloc maps such a buffer fresh from the kernel every
time (its largest mmap threshold on 64-bit), so whenever a bucket cannot take its lent memory back
(``Bucket.reclaim``: a gradient still held) the page faults of the new buffer cost more than the copy saved
(measured with a new buffer every step, a step's allocations simulated: 25 MiB lend/copy 0.82, 40 MiB 2.0).
Where the memory is taken back, lending from a 44 MiB bucket timed the same as copying (0.952 and 0.945 of
torch's step, 2 ranks), so the limit costs nothing there."""


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What bucketing needs to know about one parameter (its index is its position in the list)."""

    name: str
    nbytes: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, name: str, p: torch.Tensor) -> ParamSpec:
        return cls(name, p.numel() * p.element_size(), p.dtype, p.device)


def size_limits(bucket_cap_mb: float | None) -> list[int]:
    """Byte limits per bucket, as torch: a 1 MiB first bucket only when the cap is left at its default."""
    if bucket_cap_mb is None:
        return [FIRST_BUCKET_BYTES, 25 * MIB]
    cap = int(bucket_cap_mb * MIB)
    if cap <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    return [cap]


def assign_buckets(
    specs: Sequence[ParamSpec], limits: Sequence[int], ready_order: Sequence[int] | None = None
) -> list[list[int]]:
    """Group parameter indices into buckets; bucket 0 is the one expected to be ready first.

    Without ``ready_order`` the parameters are walked in definition order, the buckets sorted by their
    lowest index and then reversed (gradients arrive roughly in reverse definition order). With a
    ``ready_order`` (observed in an earlier backward) the buckets are in the order they become ready in it.
    """
    order = list(range(len(specs))) if ready_order is None else list(ready_order)
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    limit_pos: dict[tuple[torch.dtype, torch.device], int] = {}
    result: list[list[int]] = []
    for index in order:
        spec = specs[index]
        key = (spec.dtype, spec.device)
        indices, size = open_buckets.get(key, ([], 0))
        indices.append(index)
        size += spec.nbytes
        pos = limit_pos.setdefault(key, 0)
        if size >= limits[pos]:
            result.append(indices)
            open_buckets.pop(key, None)
            limit_pos[key] = min(pos + 1, len(limits) - 1)
        else:
            open_buckets[key] = (indices, size)
    result.extend(indices for indices, _ in open_buckets.values() if indices)
    if ready_order is None:
        result.sort(key=min)
        result.reverse()
    else:
        # Each bucket goes where it becomes ready: when its last gradient (its last index) arrives. That
        # is torch's order within each dtype. torch appends each dtype's last bucket in the iteration
        # order of an unordered_map (for float dtypes on one device the reverse of the order their first
        # gradients arrive, otherwise as their hashes fall), so with mixed dtypes its buckets can wait
        # for a lower index that becomes ready after them.
        position = {index: pos for pos, index in enumerate(order)}
        result.sort(key=lambda indices: position[indices[-1]])
    return result


class Bucket:
    """One flat buffer holding the gradients of a few parameters, reduced by one all-reduce."""

    __slots__ = (
        "index",
        "param_indices",
        "names",
        "dtype",
        "device",
        "nbytes",
        "buffer",
        "views",
        "status",
        "lendable",
        "_shapes",
        "_slots",
        "_numel",
        "_lent",
        "_loans",
        "_own_refs",
        "_storage",
    )

    def __init__(
        self,
        index: int,
        param_indices: list[int],
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        status_slots: int = 0,
    ) -> None:
        self.index = index
        self.param_indices = param_indices
        self.names = [names[i] for i in param_indices]
        first = params[param_indices[0]]
        self.dtype = first.dtype
        self.device = first.device
        self._shapes = [params[i].shape for i in param_indices]
        # Status slots ride at the end of the buffer: one per rank, so a rank can tell the others in the
        # same all-reduce that its backward went wrong (see reducer.py), without an extra collective.
        self._slots = status_slots
        self._numel = sum(s.numel() for s in self._shapes) + status_slots
        sizes = [s.numel() * first.element_size() for s in self._shapes]
        self.nbytes = sum(sizes)
        big = [pos for pos, n in enumerate(sizes) if n >= LEND_MIN_BYTES]
        worth_it = sum(sizes[pos] for pos in big) >= LEND_MIN_BYTES * len(param_indices)
        if self.device.type == "cpu" and self._numel * first.element_size() >= LEND_MAX_CPU_BUFFER_BYTES:
            worth_it = False
        self.lendable = big if worth_it else []
        """Positions whose reduced gradient is worth lending rather than copying back (see ``lend``):
        making a tensor per lent parameter costs more than copying a small one."""
        self._lent = False
        self._allocate(torch.zeros)

    def _allocate(self, factory: Any) -> None:
        self.buffer = factory(self._numel, dtype=self.dtype, device=self.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for shape in self._shapes:
            n = shape.numel()
            self.views.append(self.buffer[offset : offset + n].view(shape))
            offset += n
        self.status = self.buffer[offset:] if self._slots else None
        self._loans: list[torch.Tensor | None] = [None] * len(self._shapes)
        """The tensor lent at each position, kept to be lent again while nobody else holds it: making
        one costs ~40 us with the caches cold from backward, checking one ~2 us."""
        self._storage = _storage_handle(self.buffer)
        self._own_refs = _storage_refs(self._storage)
        """How many references this bucket itself holds to its memory (the buffer, its views, its loans)."""

    def named_gradients(self) -> list[tuple[int, str, torch.Tensor]]:
        """Each parameter's (index, name, gradient in this buffer), for naming the non-finite ones."""
        return list(zip(self.param_indices, self.names, self.views, strict=True))

    def lend(self, pos: int) -> torch.Tensor:
        """The reduced gradient at ``pos`` as a tensor of its own on this buffer's memory.

        Not an autograd view (``_base`` is None), so ``detach_()`` and ``requires_grad_()`` work on it
        as on any gradient. Once a position is lent, call ``reclaim`` before the buffer is written
        again: the lent memory belongs to the gradient until nothing refers to it any more.
        """
        self._lent = True
        loan = self._loans[pos]
        if loan is None:
            view = self.views[pos]
            loan = torch.empty(0, dtype=self.dtype, device=self.device).set_(
                self.buffer.untyped_storage(), view.storage_offset(), view.shape, view.stride()
            )
            if _CAN_KEEP_LOANS:
                self._loans[pos] = loan
                self._own_refs += 1
        return loan

    def reclaim(self) -> None:
        """Make the buffer this bucket's own again before a backward writes it, after ``lend``.

        When nothing but the bucket refers to the lent memory any more (the gradients were dropped, as
        ``zero_grad(set_to_none=True)`` does before every forward), the bucket keeps it: no allocation,
        and no page faults from memory the kernel maps afresh (measured on the transformer benchmark:
        650-3,900 faults a step with a new buffer each step, against none for torch's Reducer). A lent
        gradient someone still holds, even through a view, keeps its memory: the bucket gets a new,
        uninitialised buffer (every element is written before launch).
        """
        if not self._lent:
            return
        self._lent = False
        if _storage_refs(self._storage) != self._own_refs or not _loans_free(self._loans):
            self._allocate(torch.empty)

    def to_wire(self) -> dict[str, Any]:
        """The BUCKET shape of agent/records.py."""
        return {
            "index": self.index,
            "bytes": self.nbytes,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "parameters": list(self.names),
        }


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _storage_handle(tensor: torch.Tensor) -> int | None:
    """What ``_storage_refs`` asks torch about: the storage's address, stable while the buffer lives
    (read once: each ``untyped_storage()`` makes a Python object)."""
    return int(tensor.untyped_storage()._cdata) if _USE_COUNT is not None else None


def _storage_refs(storage: int | None) -> int:
    """How many tensors and storages share a buffer's memory (-1 when this torch cannot tell, which
    ``Bucket.reclaim`` reads as "someone else": a new buffer, never memory a gradient still uses)."""
    if _USE_COUNT is None or storage is None:
        return -1
    return int(_USE_COUNT(storage))


def _loan_refs(loans: list[torch.Tensor | None]) -> list[int]:
    """Python references to each kept loan, counted from this same code (see ``_FREE_LOAN_REFS``)."""
    return [sys.getrefcount(loan) for loan in loans if loan is not None]


_CAN_KEEP_LOANS = hasattr(torch.Tensor, "_use_count") and _USE_COUNT is not None
"""torch tells how many C++ references a tensor has: a lent tensor can be kept and lent again."""
_FREE_LOAN_REFS = _loan_refs([torch.empty(0)])[0]
"""What ``_loan_refs`` counts for a tensor only its list holds, measured on this interpreter rather
than assumed (the count of references a call itself adds differs between Python versions)."""


def _loans_free(loans: list[torch.Tensor | None]) -> bool:
    """Nobody but the bucket holds its kept loans: no Python reference besides the bucket's, no C++
    one (a ``.grad`` slot, autograd) besides each tensor's own Python object's. A view of one counts
    on the storage instead (``_storage_refs``)."""
    if any(n != _FREE_LOAN_REFS for n in _loan_refs(loans)):
        return False
    return all(loan._use_count() == 1 for loan in loans if loan is not None)  # type: ignore[attr-defined]  # untyped in torch's stubs


def build_buckets(
    assignment: Sequence[list[int]],
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    status_slots: int = 0,
) -> list[Bucket]:
    """Allocate the buffers; only the last bucket (the last to be launched) carries status slots."""
    last = len(assignment) - 1
    return [
        Bucket(i, list(indices), params, names, status_slots if i == last else 0)
        for i, indices in enumerate(assignment)
    ]
