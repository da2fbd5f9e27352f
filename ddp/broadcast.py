"""Coalesced broadcast of module state from rank 0: parameters at construction, buffers before forward.

Tensors are grouped by (dtype, device) and flattened into chunks of at most ``chunk_bytes`` (torch uses
250 MiB for the same job), so a model with hundreds of small buffers costs a few collectives, not hundreds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddpscope.agent.clock import now_ns
from ddpscope.ddp.collectives import RECORDER

CHUNK_BYTES = 250 * 1024 * 1024


def _chunks(tensors: Sequence[torch.Tensor], chunk_bytes: int) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        chunks = groups.setdefault(key, [[]])
        nbytes = t.numel() * t.element_size()
        if chunks[-1] and sizes.get(key, 0) + nbytes > chunk_bytes:
            chunks.append([])
            sizes[key] = 0
        chunks[-1].append(t)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [c for chunks in groups.values() for c in chunks if c]


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    *,
    group: Any,
    pg: str,
    src_rank: int = 0,
    step: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Overwrite ``tensors`` in place with ``src_rank``'s values (group rank); a collective call."""
    if not tensors:
        return
    src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    is_src = dist.get_rank(group) == src_rank
    for chunk in _chunks([t.detach() for t in tensors], chunk_bytes):
        single = len(chunk) == 1 and chunk[0].is_contiguous()
        flat = chunk[0] if single else _flatten_dense_tensors(chunk)
        with RECORDER.engine_call():
            seq = RECORDER.begin(pg, "broadcast", [flat], source="engine", step=step)
            ok = False
            called_ns = now_ns()
            try:
                dist.broadcast(flat, src=src, group=group)
                ok = True
            finally:
                RECORDER.end(pg, seq, ok=ok)
            # Time the ranks that got here first spend waiting for the last one (StepTimer's phases).
            RECORDER.blocked_time().ns += now_ns() - called_ns
        if not single and not is_src:
            for t, synced in zip(chunk, _unflatten_dense_tensors(flat, chunk), strict=True):
                t.copy_(synced)
