"""Rank lists in words, ``rank 3``, ``ranks 0, 2`` or ``ranks 0-511, 513-1023``, and back.

The training side writes them into warnings the collector reads (``job_ids_differ`` names the ranks it
blames this way), and the collector writes them into incidents: one format, defined here, next to the
wire format both sides share. Runs of three or more ranks are spans, so a setting that differs on one
rank of 1,024 names the other 1,023 in a few characters.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_PARSED_RANKS = 1 << 17
"""``parse_ranks`` returns at most this many: the text comes from the network, and ``0-99999999`` must
not cost a list of a hundred million."""


def ranks_text(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0, 2`` or ``ranks 0-511, 513-1023`` (runs of three or more as spans)."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    start = 0
    for i in range(1, len(rs) + 1):
        if i == len(rs) or rs[i] != rs[i - 1] + 1:
            run = rs[start:i]
            parts += [f"{run[0]}-{run[-1]}"] if len(run) > 2 else [str(r) for r in run]
            start = i
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(parts)


def parse_ranks(text: str) -> list[int]:
    """The ranks of ``ranks_text``'s list part (``1, 4-6``), sorted; parts that are not ranks or spans
    are skipped, and numbers of 10 digits or more (no job has that many ranks) too."""
    ranks: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if low.isdigit() and (not high or high.isdigit()) and max(len(low), len(high)) < 10:
            first = int(low)
            ranks.update(range(first, min(int(high or low), first + MAX_PARSED_RANKS) + 1))
        if len(ranks) > MAX_PARSED_RANKS:
            break
    return sorted(ranks)[:MAX_PARSED_RANKS]
