"""Records a record implies: sent after it without the caller emitting them.

The engine's step record names each bucket all-reduce it waited for (``collective_seqs``) and when each
ended (``allreduce_end_ns``): everything a ``collective_end`` record says but the group, which the
template carries (``RecordTemplate.implies``). Emitting those ends separately cost the training thread
a write-ahead ring write per bucket, with the caches cold from backward, and the worker a record each
(``ddp/collectives.py``, ``end_planned``). So the step record implies them: the agent's worker makes them
from it, warm, and so does the shipper from the write-ahead ring after a crash (the ring's copy of the
template keeps the implication under ``IMPLIES_KEY``, which no record sent carries).

An implied record's ``seq`` is made from its parent's (``implied_seq``), so the worker's copy and the
shipper's replay of it share one idempotency key, and it never meets the agent's own counter.
"""

from __future__ import annotations

from typing import Any

from ddpscope.agent.records import UNTIMED_END

IMPLIES_KEY = "\x00implies"
"""Where the write-ahead ring's copy of a template keeps its ``implies`` (not a wire field: the reader
pops it)."""
SEQ_BASE = 1 << 62
"""Implied records number from here: far above any stream's own count."""
PER_PARENT = 1 << 10
"""Implied records one parent may have (a step's buckets: fewer than its parameters, at most 1024 here)."""

Implies = tuple[str, str]
"""(what, argument): ``("bucket_ends", pg)`` is the only kind."""


def implied_seq(parent_seq: int, index: int) -> int:
    return SEQ_BASE + parent_seq * PER_PARENT + index


def implied_records(implies: Implies, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The records ``record`` (with its envelope) implies, with theirs: same job, rank and stream."""
    what, pg = implies
    if what != "bucket_ends":
        return []
    envelope = {"job": record["job"], "rank": record["rank"], "stream": record["stream"]}
    out = []
    ends = zip(record["collective_seqs"], record["allreduce_end_ns"], strict=False)
    for k, (coll_seq, end_ns) in enumerate(ends):
        if coll_seq > 0 and end_ns > 0 and end_ns != UNTIMED_END and k < PER_PARENT:
            out.append(
                {"kind": "collective_end", "pg": pg, "coll_seq": coll_seq, "end_ns": end_ns, "ok": True,
                 "error": None, **envelope, "seq": implied_seq(record["seq"], k), "time_ns": end_ns}
            )  # fmt: skip
    return out
