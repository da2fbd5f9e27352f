"""Settings the ranks of one job must agree on, compared across their ``rank_start`` records.

``settings_incidents(snapshot)`` returns at most one ``settings_differ`` incident per job: every setting
on which the current processes disagree, with its values and the ranks holding each, the odd ranks as
culprits and what goes wrong because of it. Versions, the world size and the hang timeout must agree
across the whole job; how the model is wrapped (backend, engine, ``find_unused_parameters``,
``bucket_cap_mb``, ``static_graph``) only among the ranks of one DDP process group, since models on
disjoint subgroups (one per pipeline stage) are different models. A field a record lacks (an older
agent) is not compared. It never changes the job's status: nothing has failed yet.

Pure function of a ``JobSnapshot``; no database, no HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpscope.agent.rank_spans import ranks_text
from ddpscope.server.analysis.incident_model import Incident, Record, capitalized, ranks_phrase, record_s
from ddpscope.server.analysis.snapshot import PER_PROCESS, JobSnapshot, split_restart
from ddpscope.server.analysis.status import unobserved_ranks


@dataclass(frozen=True, slots=True)
class _Rule:
    fields: tuple[str, ...]
    per_group: bool
    """Compared among the ranks of one DDP process group only (``rank_start.process_group``)."""
    advice: str
    """What goes wrong and what to do; ``{fields}`` becomes the differing fields of the rule."""


RULES = (
    _Rule(
        ("torch_version", "python_version", "ddpscope_version"),
        False,
        "Ranks with different {fields} (a stale image or environment on one node) are a classic cause of "
        "DDP failures that make no sense, collectives that do not pair or results that do not agree: "
        "install the same wheel or image on every node.",
    ),
    _Rule(
        ("world_size",),
        False,
        "The ranks were launched with different WORLD_SIZE values and do not agree on how many peers they "
        "wait for: launch every rank with the same WORLD_SIZE.",
    ),
    _Rule(
        ("hang_timeout_s",),
        False,
        "A stall only the shorter hang timeout sees is reported by those ranks alone, and may end before "
        "the others report it: set DDPSCOPE_HANG_TIMEOUT the same on every rank.",
    ),
    _Rule(
        ("backend",),
        True,
        "Ranks on different process-group backends cannot reduce with each other: pass the same backend "
        "to init_process_group on every rank.",
    ),
    _Rule(
        ("engine",),
        True,
        "Models wrapped by ddpscope's DistributedDataParallel and by torch's (through instrument()) issue "
        "different gradient all-reduces, which pair wrongly or hang: wrap the model the same way on every "
        "rank.",
    ),
    _Rule(
        ("find_unused_parameters", "bucket_cap_mb", "static_graph"),
        True,
        "Ranks wrapped with different {fields} build different buckets, so their gradient all-reduces "
        "pair wrongly or hang: wrap the model with the same DistributedDataParallel arguments on every "
        "rank.",
    ),
)
"""Every setting compared, grouped by what goes wrong when it differs."""

SETTINGS = tuple(f for rule in RULES for f in rule.fields)

TORCH_BUCKET_ADVICE = (
    "torch's DistributedDataParallel puts every parameter in one bucket for its first iteration and then "
    "gives every rank rank 0's bucket layout, so the gradients are right, but the odd ranks' bucket_cap_mb "
    "is ignored: pass the same bucket_cap_mb on every rank, so that each rank's setting says what it runs."
)
"""Instead of the rule's advice when only ``bucket_cap_mb`` differs, among ranks of torch's DDP that
rebuild their buckets (``_torch_takes_rank_0_layout``): measured on torch 2.13, rank 1's 1 MB cap against
rank 0's 25 MB gave every rank one 6.3 MB bucket and the same parameters as equal caps, where with
``find_unused_parameters=True`` both ranks aborted in gloo."""


@dataclass(frozen=True, slots=True)
class Difference:
    field: str
    holders: dict[Any, list[int]]
    """Each value and the ranks holding it, in the order of each value's lowest rank."""
    right: Any
    """The value that counts as right: the most common one, on a tie the lowest rank's."""
    odd: list[int]
    """The minority: the ranks whose value is not the most common one."""
    reference: int | None
    """On a tie for the most common value, the lowest rank whose value counts as the right one."""
    group: str


def settings_incidents(snapshot: JobSnapshot) -> list[Incident]:
    """One ``settings_differ`` incident when the current processes disagree on a setting, else none.

    Takes the whole snapshot (not the half ``split_restart`` keeps): a rank that has not restarted yet is
    recognised by what the earlier processes left after its ``rank_start``."""
    starts: Mapping[int, Record] = _with_heartbeat_sizes(snapshot.ranks, snapshot.heartbeats)
    diffs = _all_differences(starts)
    if diffs:  # rare: only then is it worth dividing the records at a restart (every scrape diagnoses)
        starts = _with_heartbeat_sizes(current_starts(snapshot), snapshot.heartbeats)
        diffs = _all_differences(starts)
    unobserved = sorted(unobserved_ranks(snapshot) - set(snapshot.ranks))
    if not diffs:
        return [_unobserved_incident(unobserved, starts)] if unobserved else []
    culprits = sorted({r for d in diffs for r in d.odd})
    advice = []
    for rule in RULES:
        differing = [f for f in rule.fields if any(d.field == f for d in diffs)]
        if differing == ["bucket_cap_mb"] and all(
            _torch_takes_rank_0_layout(starts, d.group) for d in diffs if d.field == "bucket_cap_mb"
        ):
            advice.append(TORCH_BUCKET_ADVICE)
        elif differing:
            advice.append(rule.advice.format(fields=_or(differing)))
    message = (
        "The ranks disagree on settings that must be the same on every rank: "
        f"{'; '.join(_describe(d) for d in diffs)}. {' '.join(advice)}"
    )
    if unobserved:
        message += f" {_unobserved_sentence(unobserved)}"
        culprits = sorted({*culprits, *unobserved})
    compared = {r for d in diffs for rs in d.holders.values() for r in rs}
    return [
        Incident(
            kind="settings_differ",
            message=message,
            rank=culprits[0] if len(culprits) == 1 else None,
            culprit_ranks=culprits,
            time_s=max(record_s(starts[r]) for r in compared),
        )
    ]


def _unobserved_sentence(ranks: list[int]) -> str:
    return (
        f"{capitalized(ranks_phrase(ranks))} {'runs' if len(ranks) == 1 else 'run'} without ddpscope "
        "(DDPSCOPE_DISABLED set on that node only?): the others found no word of it in the store, so what runs "
        "there trains unobserved (no steps, hang reports or errors of theirs) and the clocks were not aligned. Set "
        "DDPSCOPE_DISABLED alike on every rank."
    )


def _unobserved_incident(ranks: list[int], starts: Mapping[int, Record]) -> Incident:
    """The ``settings_differ`` incident for ranks running without ddpscope beside ranks running it."""
    return Incident(
        kind="settings_differ",
        message=_unobserved_sentence(ranks),
        rank=ranks[0] if len(ranks) == 1 else None,
        culprit_ranks=ranks,
        time_s=min((record_s(s) for s in starts.values()), default=None),
    )


def _with_heartbeat_sizes(
    starts: Mapping[int, Record], heartbeats: Mapping[int, Record]
) -> Mapping[int, Record]:
    """``starts`` and, for each rank that has sent none, the world size its latest heartbeat says: a rank
    stuck in ``init_process_group`` (a WORLD_SIZE that differs between ranks keeps the rendezvous or the
    group's connection waiting) never builds its model, but its heartbeats carry the size it asked for."""
    extra = {
        r: {"world_size": h["world_size"], "time_ns": h["time_ns"]}
        for r, h in heartbeats.items()
        if r not in starts and h.get("world_size")
    }
    return {**starts, **extra} if extra else starts


def _torch_takes_rank_0_layout(starts: Mapping[int, Record], group: str) -> bool:
    """Every rank of DDP process group ``group`` wraps its model in torch's DDP (``instrument()``) that
    rebuilds its buckets after the first iteration (no ``find_unused_parameters``, or ``static_graph``):
    torch then broadcasts rank 0's layout to every rank (its Reducer's ``sync_bucket_indices``), and
    before that puts every parameter in one bucket, so a rank's own ``bucket_cap_mb`` never decides a
    collective. (Per-bucket caps, torch's ``bucket_cap_mb_list``, would; ``rank_start`` does not say.)"""
    members = [s for s in starts.values() if _group_of(s) == group]
    return bool(members) and all(
        s.get("engine") == "torch"
        and (s.get("static_graph") is True or s.get("find_unused_parameters") is False)
        for s in members
    )


def _group_of(start: Record) -> str:
    """The DDP process group a ``rank_start`` wraps its model over (older agents: the default one)."""
    return str(start.get("process_group") or "default")


def current_starts(snapshot: JobSnapshot) -> dict[int, Record]:
    """The latest ``rank_start`` of each rank whose current process sent it. After a restart, a rank whose
    latest one is older than the last record the earlier processes left (``split_restart``) still shows
    its earlier process (its new one has not built its model yet, or never will): left out, so a job
    restarted with a new image is not compared with the image it replaced."""
    current, _ = split_restart(snapshot)
    if current is snapshot:
        return dict(snapshot.ranks)
    kept = {id(r) for name in PER_PROCESS for r in getattr(current, name)}
    kept |= {id(h) for h in current.heartbeats.values()}
    earlier = [r for name in PER_PROCESS for r in getattr(snapshot, name) if id(r) not in kept]
    earlier += [h for h in snapshot.heartbeats.values() if id(h) not in kept]
    end_ns = max((int(r["time_ns"]) for r in earlier), default=None)
    return {rank: s for rank, s in snapshot.ranks.items() if end_ns is None or int(s["time_ns"]) > end_ns}


def _all_differences(starts: Mapping[int, Record]) -> list[Difference]:
    return [d for rule in RULES for f in rule.fields for d in differences(starts, f, rule.per_group)]


def differences(starts: Mapping[int, Record], field: str, per_group: bool) -> list[Difference]:
    """Per process group (``per_group``) or across the job, the values of ``field`` the ranks' records
    disagree on, with the ranks holding each and the odd ones: the most common value is right, on a
    tie the lowest rank's. Records without the field are left out."""
    groups: dict[str, dict[int, Any]] = {}
    for rank, start in sorted(starts.items()):
        value = start.get(field)
        if value is None:
            continue  # an older agent's record: nothing to compare
        group = _group_of(start) if per_group else "default"
        groups.setdefault(group, {})[rank] = value
    out = []
    for group, values in sorted(groups.items()):
        holders: dict[Any, list[int]] = {}
        for rank, value in values.items():
            holders.setdefault(value, []).append(rank)
        if len(holders) < 2:
            continue
        most = max(len(rs) for rs in holders.values())
        tied = [v for v, rs in holders.items() if len(rs) == most]
        # On a tie the value of the lowest rank among the tied ones counts as right: rank 0's, usually.
        right = tied[0]
        odd = sorted(r for v, rs in holders.items() if v != right for r in rs)
        reference = holders[right][0] if len(tied) > 1 else None
        out.append(Difference(field, holders, right, odd, reference, group))
    return out


def _describe(d: Difference) -> str:
    """``hang_timeout_s is 8 on rank 0 but 300 on ranks 1-3``, the group when not the default one, and
    how a tie was settled. "but" and "and" between the values: commas already separate ranks."""
    first, *others = (f"{_value(v)} on {ranks_text(rs)}" for v, rs in d.holders.items())
    text = f"{d.field} is {first} but {' and '.join(others)}"
    if d.group != "default":
        text += f" in group {d.group}"
    if d.reference is not None:
        text += (
            f" (a tie: {ranks_text(d.odd)}, which "
            f"{'differs' if len(d.odd) == 1 else 'differ'} from rank {d.reference}, "
            f"{'is' if len(d.odd) == 1 else 'are'} named)"
        )
    return text


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.15g}"  # 300.0 reads 300, 0.1 stays 0.1
    return str(value)


def _or(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
