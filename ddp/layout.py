"""The cross-rank check that every rank wraps the same model, run before any state is broadcast.

Broadcasting parameters of different sizes would abort gloo (``EnforceNotMet``, SIGABRT) and different
bucket layouts would silently reduce unrelated gradients together, so every rank first compares a digest
of its parameter list (names, shapes, dtypes, requires_grad, order; buffers too when they are broadcast)
and of the constructor arguments that decide its collectives (``bucket_cap_mb``: the bucket sizes;
``find_unused_parameters``: an extra bitmap all-reduce; ``broadcast_buffers``: a broadcast per forward).
Only when digests differ are the full lists exchanged, so that the ``ValueError`` raised on *every* rank
names the first differing entry and the ranks that differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddpscope.ddp.collectives import RECORDER


def describe(
    named_params: Iterable[tuple[str, torch.Tensor]],
    named_buffers: Iterable[tuple[str, Any]] = (),
    settings: Mapping[str, Any] | None = None,
) -> list[str]:
    """One line per setting, then per parameter (and buffer): what must be identical on every rank."""
    lines = [f"{_SETTING}{key}={value!r}" for key, value in (settings or {}).items()]
    for name, p in named_params:
        frozen = "" if p.requires_grad else " (frozen)"
        lines.append(f"parameter {name} {str(p.dtype).removeprefix('torch.')}{list(p.shape)}{frozen}")
    for name, b in named_buffers:
        if b is not None:
            lines.append(f"buffer {name} {str(b.dtype).removeprefix('torch.')}{list(b.shape)}")
    return lines


def _all_gather(t: torch.Tensor, group: Any, pg: str, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    with RECORDER.engine_call():
        seq = RECORDER.begin(pg, "all_gather", [t], source="engine")
        ok = False
        try:
            dist.all_gather(out, t, group=group)
            ok = True
        finally:
            RECORDER.end(pg, seq, ok=ok)
    return out


def first_difference(per_rank: Sequence[Sequence[str]]) -> tuple[int, dict[int, str]]:
    """Position of the first entry that is not the same on every rank, and each rank's entry there."""
    longest = max(len(lines) for lines in per_rank)
    for pos in range(longest + 1):
        entries = {r: (lines[pos] if pos < len(lines) else "nothing") for r, lines in enumerate(per_rank)}
        if len(set(entries.values())) > 1:
            return pos, entries
    raise ValueError("the lists are identical")


_SETTING = "setting "


def mismatch_message(per_rank: Sequence[Sequence[str]]) -> str:
    pos, entries = first_difference(per_rank)
    reference = entries[0]
    differing = [r for r, e in entries.items() if e != reference]
    shown = "; ".join(f"rank {r} has {entries[r]}" for r in [0, *differing][:8])
    if reference.startswith(_SETTING):
        key = reference.removeprefix(_SETTING).split("=")[0]
        shown = "; ".join(f"rank {r} has {entries[r].removeprefix(_SETTING)}" for r in [0, *differing][:8])
        return (
            f"DistributedDataParallel: the ranks wrap the model with different arguments. Ranks {differing} "
            f"differ from rank 0 in {key}: {shown}. Pass the same {key} on every rank: it decides the "
            "collectives each rank issues (bucket sizes, the unused-parameter bitmap, buffer broadcasts), and "
            "ranks that issue different ones abort in gloo or reduce unrelated gradients together."
        )
    # Positions count from the first parameter, as module.parameters() does: the setting lines come first.
    settings = sum(1 for line in per_rank[0] if line.startswith(_SETTING))
    reordered = ""
    if all(sorted(lines) == sorted(per_rank[0]) for lines in per_rank):
        # Same parameters, another order: layers made by iterating something whose order is the process's own.
        reordered = (
            " Each rank has the same parameters, in another order: layers built by iterating a set (whose order "
            "follows each process's hash seed, PYTHONHASHSEED), a directory listing or another rank-dependent "
            "order; iterate a sorted list instead."
        )
    return (
        f"DistributedDataParallel: the ranks do not wrap the same model. Ranks {differing} differ from "
        f"rank 0 at position {pos - settings} of the parameter list: {shown}. Every rank must build the same model "
        f"(same parameter names, shapes, dtypes, requires_grad and order) before wrapping it.{reordered}"
    )


def check_same_layout(lines: Sequence[str], group: Any, pg: str) -> None:
    """Raise ``ValueError`` on every rank when any rank's ``lines`` differ (a collective call)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    text = "\n".join(lines).encode()
    digest = int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)
    gathered = _all_gather(torch.tensor([digest, len(text)], dtype=torch.int64), group, pg, world)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    # Rare path: every rank saw the same digests, so every rank takes it and the collectives match.
    longest = max(int(g[1]) for g in gathered)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    texts = _all_gather(buf, group, pg, world)
    per_rank = [
        bytes(t[: int(g[1])].tolist()).decode().split("\n") if int(g[1]) else []
        for t, g in zip(texts, gathered, strict=True)
    ]
    raise ValueError(mismatch_message(per_rank))
