"""The line a rank's phase was sampled at most, from its watchdog's ``site_profile`` records.

``stragglers.py`` says which rank is slow and in which phase (forward, backward, between steps), and
``stalls.py`` which rank stalls now and then and where the extra time goes, from step timings. Every rank's
watchdog also counts, at each tick, its phase and the innermost line of user code its training thread is at
(``ddp/site_profile.py``). Of a rank's samples in the phase that holds its extra time, the line with the most
is where the time goes: its data augmentation between steps, a layer of its forward. Named only when it holds
a real share of them (``MIN_SHARE``, at least ``MIN_SAMPLES``): a phase spread over many lines has no one line
to read. Where the line is a loop's ``for batch in loader`` waiting for its DataLoader's workers, it says so:
the time goes in their Dataset reads.

For a stall the samples are of the whole phase, its stalls and its ordinary steps alike: the stall samples
(``stall_sample``, taken inside stalls) come first, and these are read only where there are none.

Pure function of the records; no database, no HTTP.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # both carry a SampledSite: imported for their types only
    from ddpscope.server.analysis.stalls import Stall
    from ddpscope.server.analysis.stragglers import Straggler

PROGRESS_PHASES = {
    "forward": ("forward", "after_forward"),
    "backward": ("backward",),
    "between_steps": ("idle", "optimizer"),
}
"""A straggler's phase -> the watchdog's phases it covers (the loss, after forward, counts with forward)."""
MIN_SAMPLES = 4
MIN_SHARE = 0.3
LOOKBACK_NS = 120 * 1_000_000_000
"""Records this long before the straggler window's first step count too: a record comes every minute at most,
and covers the time before it."""


@dataclass(slots=True)
class SampledSite:
    """Where a straggler's slow phase was sampled most."""

    site: str
    samples: int
    """Samples at ``site`` in that phase."""
    of: int
    """All of the rank's samples in that phase, in the records read."""
    loader: bool = False
    """Most samples at ``site`` waited for the rank's DataLoader workers: their Dataset reads hold the time."""


def sampled_site(profiles: Iterable[Mapping[str, Any]], rank: int, phase: str) -> SampledSite | None:
    """The line ``rank``'s ``site_profile`` records sample most in the straggler phase ``phase``, if one holds
    ``MIN_SHARE`` of them."""
    wanted = PROGRESS_PHASES.get(phase, ())
    counts: Counter[str] = Counter()
    in_loader: Counter[str] = Counter()
    of = 0
    for record in profiles:
        if record.get("rank") != rank:
            continue
        for x in record.get("sites") or ():
            if x.get("phase") in wanted:
                of += int(x["n"])
                if x.get("site"):
                    counts[str(x["site"])] += int(x["n"])
                    in_loader[str(x["site"])] += int(x["n"]) if x.get("loader") else 0
    if not counts:
        return None
    site, n = counts.most_common(1)[0]
    if n < MIN_SAMPLES or n < MIN_SHARE * of:
        return None
    return SampledSite(site, n, of, loader=2 * in_loader[site] > n)


def with_sites(found: Sequence[Straggler], profiles: Iterable[Mapping[str, Any]]) -> list[Straggler]:
    """``found``, each flagged straggler carrying the line its slow phase was sampled at as ``sampled``."""
    records = list(profiles)
    for s in found:
        if s.flagged and s.phase is not None:
            s.sampled = sampled_site(records, s.rank, s.phase)
    return list(found)


def with_profiled(found: Sequence[Stall], profiles: Iterable[Mapping[str, Any]]) -> list[Stall]:
    """``found``, each stall no stall sample placed carrying the line its phase was sampled at as
    ``profiled``."""
    records = list(profiles)
    for s in found:
        if s.sampled is None or not s.sampled.site:
            s.profiled = sampled_site(records, s.rank, s.phase)
    return list(found)
