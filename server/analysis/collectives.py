"""Cross-rank matching of collectives: ranks must issue the same collective at each sequence number.

``mismatches`` finds the (process group, sequence number) pairs where ranks disagree on the op, the
reduce op, the shapes or the dtypes. It feeds ``ddpscope_collective_mismatches_total`` when the
incidents module (which explains each mismatch) is not installed; it is the same test.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Mismatch:
    pg: str
    coll_seq: int
    signatures: dict[int, str]
    """rank -> 'op reduce_op shapes dtypes' as that rank issued it (the shapes as ``agreed_shapes`` compares
    them)."""


UNEVEN_OPS = frozenset({"all_to_all", "all_to_all_single"})
"""Ops whose tensors may differ in their first dimension from rank to rank (split sizes, a mixture of
experts' tokens per expert): only the rest of each shape, and the number of tensors, must agree."""


def agreed_shapes(c: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
    """The part of ``c``'s shapes every rank must agree on."""
    shapes = c.get("shapes") or []
    if c.get("op") in UNEVEN_OPS:
        return tuple(tuple(s[1:]) for s in shapes)
    return tuple(tuple(s) for s in shapes)


def signature(c: Mapping[str, Any]) -> str:
    return f"{c['op']} {c.get('reduce_op')} {agreed_shapes(c)} {c.get('dtypes')}"


def mismatches(collectives: Iterable[Mapping[str, Any]]) -> list[Mismatch]:
    groups: dict[tuple[str, int], dict[int, str]] = defaultdict(dict)
    for c in collectives:
        groups[(c["pg"], c["coll_seq"])][c["rank"]] = signature(c)
    return [
        Mismatch(pg, seq, sigs) for (pg, seq), sigs in sorted(groups.items()) if len(set(sigs.values())) > 1
    ]
