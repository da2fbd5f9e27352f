"""Warnings from training (``warning`` records) as incidents: problems that stop nothing but make the
result wrong, such as gradients a rank's DDP never all-reduced (its parameters drift from its peers').

The training side says each once per cause and model, in words without the rank; the same warning from
several ranks is one incident naming them all. The incident's kind is the warning's ``code``. Its culprits
are the ranks that said it, but for ``job_ids_differ`` and ``collectors_differ`` (``ddp/job_check.py``): every rank whose job ids
differ from a peer's says it, under its own job id, and the ranks at fault are those the message calls
"Probably misconfigured: ranks 1, 4-6" (the others said it too, in the job of the majority).
``nonfinite_loss`` and ``nonfinite_gradient`` warnings are not grouped here: ``nonfinite.py`` compares the
ranks' runs to find the first.
"""

from __future__ import annotations

import re
from typing import Any

from ddpscope.agent.rank_spans import parse_ranks
from ddpscope.agent.records import (
    COLLECTORS_DIFFER,
    JOB_IDS_DIFFER,
    NONFINITE_GRADIENT,
    NONFINITE_LOSS,
    TRAINS_IN_EVAL_MODE,
)
from ddpscope.server.analysis.incident_model import Incident, capitalized, ranks_phrase, record_s
from ddpscope.server.analysis.snapshot import JobSnapshot

_MISCONFIGURED = re.compile(r"Probably misconfigured: ranks? ([0-9][0-9, -]*)")


def warning_incidents(snapshot: JobSnapshot) -> list[Incident]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for w in snapshot.warnings:
        if w["code"] in (
            NONFINITE_LOSS,
            NONFINITE_GRADIENT,
        ):  # one incident of every rank's runs (nonfinite_incidents)
            continue
        groups.setdefault((str(w["code"]), str(w["message"])), []).append(dict(w))
    out = []
    for (code, message), same in groups.items():
        culprits = _culprits(snapshot, code, message, sorted({w["rank"] for w in same}))
        if code == COLLECTORS_DIFFER and not culprits:
            continue  # every rank reached this collector: the URLs that differ name the same one
        first = min(same, key=lambda w: (w["time_ns"], w["rank"]))
        ranks = sorted({w["rank"] for w in same})
        steps = [w["step"] for w in same if w.get("step") is not None]
        when = f" (step {min(steps)})" if steps else ""
        parameters: list[str] = []
        for w in same:
            parameters += [p for p in w.get("parameters") or () if p not in parameters]
        if code == TRAINS_IN_EVAL_MODE and (
            others := [r for r in range(snapshot.world_size) if r not in ranks]
        ):
            message += f" ({capitalized(ranks_phrase(others))} trained in train mode: the ranks ran different forwards.)"
        out.append(
            Incident(
                kind=code,
                message=f"{capitalized(ranks_phrase(ranks))}{when}: {message}",
                rank=first["rank"],
                step=min(steps) if steps else None,
                parameters=parameters,
                culprit_ranks=culprits,
                call_site=first.get("call_site"),
                time_s=record_s(first),
            )
        )
    return out


def _culprits(snapshot: JobSnapshot, code: str, message: str, said: list[int]) -> list[int]:
    """The ranks at fault: those that said it, but for the job id check's warnings. For ``job_ids_differ``
    the ranks its message calls probably misconfigured; for ``collectors_differ`` the ranks this collector
    has not heard from, whichever side the message calls misconfigured: from here they are the ones
    sending elsewhere, and URLs that differ but reach this same collector (a host name on some nodes, an
    address on others) leave none."""
    if code == JOB_IDS_DIFFER:
        return misconfigured_ranks(message)
    if code == COLLECTORS_DIFFER:
        return [r for r in range(snapshot.world_size) if r not in snapshot.rank_last_seen_s]
    return said


def reported_elsewhere(snapshot: JobSnapshot) -> set[int]:
    """Ranks whose records go elsewhere by the job id check (another job id, another collector), so this
    job's collector never hears of them."""
    out: set[int] = set()
    for w in snapshot.warnings:
        if w["code"] in (JOB_IDS_DIFFER, COLLECTORS_DIFFER):
            out.update(_culprits(snapshot, str(w["code"]), str(w["message"]), []))
    return out


def misconfigured_ranks(message: str) -> list[int]:
    """The ranks ``ranks 1, 4-6`` in the job id warning's "Probably misconfigured: ..." (none if absent)."""
    m = _MISCONFIGURED.search(message)
    return parse_ranks(m.group(1)) if m else []
