"""The ranks' copies of the model compared (``replica_digest`` records, see ``ddp/replicas.py``).

Two incidents come from them:

- ``replicas_diverged``: the ranks' parameter norms differ, so they no longer train one model. Ranks are
  compared at equal sync counts. Named: the first step the digests differ, the last one before it where they
  agreed, the parameters that differ there, and the odd ranks when a majority agrees (with two ranks, or a
  tie, nobody is singled out). Looked for only when the newest comparison still differs: replicas that agree
  again (the state broadcast at the end of torch's ``Join``, a checkpoint reloaded on every rank) are healthy.
- ``nonfinite_parameters``: a parameter's norm became NaN or infinite. DDP's all-reduce spreads one rank's
  NaN gradient to every rank, so this names the parameters and the steps between which it happened; when a
  rank's loss (or, with ``DDPSCOPE_CHECK_GRADIENTS``, its gradients) went NaN or Inf first, the
  ``nonfinite_loss`` (``nonfinite_gradient``) incident names that rank, and this one says so.

Neither changes the job's status: the job runs on, producing a wrong model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from ddpscope.agent.records import NONFINITE_GRADIENT, NONFINITE_LOSS
from ddpscope.server.analysis.incident_model import Incident, Record, capitalized, ranks_phrase, record_s
from ddpscope.server.analysis.snapshot import JobSnapshot

RTOL = 1e-5
"""Two norms this close are the same copy: identical replicas give identical norms, bit for bit, on one
kind of host; hosts whose CPUs sum in another order can differ in the last bits. A real divergence grows
from step to step and soon exceeds it."""
NON_FINITE = {-1.0: "NaN", -2.0: "infinite"}
"""The wire's stand-ins for a NaN and an infinite norm (norms are never negative)."""
MAX_NAMED = 200


def replica_incidents(snapshot: JobSnapshot) -> list[Incident]:
    """Ranks are compared at equal sync counts (gradient all-reduce rounds done), which every rank shares;
    messages name the step the lowest of them took the digest at (step numbers can differ per rank).
    Only the ranks of one DDP group hold copies of one model: digests that name their group's ranks
    (``replicas``, DDP on subgroups) are compared within that group alone."""
    by_model: dict[tuple[int, tuple[int, ...]], dict[int, dict[int, Record]]] = {}
    for d in snapshot.digests:  # oldest first: a rank's later digest of one sync count wins
        model = (int(d["model"]), tuple(d.get("replicas") or ()))
        by_model.setdefault(model, {}).setdefault(int(d["syncs"]), {})[int(d["rank"])] = d
    names = _Names(snapshot)
    said = {w["code"] for w in snapshot.warnings} & {NONFINITE_LOSS, NONFINITE_GRADIENT}
    out: list[Incident] = []
    for _, moments in sorted(by_model.items()):
        ordered = []
        for syncs in sorted(moments):
            digests = _comparable(moments[syncs])
            ordered.append((int(digests[min(digests)]["step"]), digests))
        out += _diverged(ordered, names)
        out += _nonfinite(ordered, names, said)
    return out


def _comparable(digests: Mapping[int, Record]) -> dict[int, Record]:
    """The digests of one moment that cover the same parameters the same way (the shape most ranks sent)."""
    shape = Counter(_shape(d) for d in digests.values()).most_common(1)[0][0]
    return {r: d for r, d in digests.items() if _shape(d) == shape}


def _shape(d: Record) -> tuple[int, int, int]:
    return int(d["parameters"]), int(d["group"]), len(d["norms"])


def _same(a: float, b: float) -> bool:
    if a == b:
        return True
    if a < 0 or b < 0:  # a NaN or infinite stand-in equals only itself
        return False
    return abs(a - b) <= RTOL * max(a, b)


def _agree(digests: Mapping[int, Record]) -> bool:
    lists = [d["norms"] for d in digests.values()]
    first = lists[0]
    if all(n == first for n in lists):  # the healthy case, compared in C
        return True
    return all(all(_same(a, b) for a, b in zip(first, n, strict=True)) for n in lists[1:])


def _clusters(values: Mapping[int, float]) -> list[list[int]]:
    """Ranks grouped by the value they hold, largest group first."""
    groups: list[tuple[float, list[int]]] = []
    for r, v in sorted(values.items()):
        for ref, ranks in groups:
            if _same(ref, v):
                ranks.append(r)
                break
        else:
            groups.append((v, [r]))
    return sorted((ranks for _, ranks in groups), key=lambda g: (-len(g), g))


def _shown(names: Sequence[str]) -> str:
    """``'a', 'b', 'c' and 4 more``."""
    return ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class _Names:
    """Parameter names of a digest's entries: the rank's newest ``parameter_order`` (layout record) of as
    many parameters as the digest covers, else ``parameter #i``."""

    def __init__(self, snapshot: JobSnapshot) -> None:
        self.layouts = snapshot.layouts

    def of(self, digest: Record, entries: Sequence[int]) -> list[str]:
        count, group, rank = int(digest["parameters"]), int(digest["group"]), digest["rank"]
        orders = (lay.get("parameter_order") or [] for lay in reversed(self.layouts) if lay["rank"] == rank)
        order = next((o for o in orders if len(o) == count), None) or [
            f"parameter #{i}" for i in range(count)
        ]
        names: list[str] = []
        for e in entries:
            names += order[e * group : (e + 1) * group]
        return names


def _diverged(ordered: list[tuple[int, dict[int, Record]]], names: _Names) -> list[Incident]:
    compared = [(step, ds) for step, ds in ordered if len(ds) > 1]
    if not compared or _agree(compared[-1][1]):
        return []  # never compared, or identical now
    last_equal: int | None = None
    for step, digests in compared:
        if _agree(digests):
            last_equal = step
            continue
        return [_diverged_incident(step, last_equal, digests, compared[-1], names)]
    return []


def _diverged_incident(
    step: int,
    last_equal: int | None,
    digests: dict[int, Record],
    newest: tuple[int, dict[int, Record]],
    names: _Names,
) -> Incident:
    ranks = sorted(digests)
    width = len(digests[ranks[0]]["norms"])
    odd: set[int] = set()
    entries: list[int] = []
    split: list[list[int]] = []
    for e in range(width):
        clusters = _clusters({r: float(digests[r]["norms"][e]) for r in ranks})
        if len(clusters) < 2:
            continue
        entries.append(e)
        split = split or clusters
        if len(clusters[0]) > len(clusters[1]):  # a majority holds one copy: the others are odd
            odd.update(r for c in clusters[1:] for r in c)
    first = digests[ranks[0]]
    params = names.of(first, entries)
    shown = _shown(params)
    if odd:
        majority = [r for r in ranks if r not in odd]
        who = f"{ranks_phrase(odd)} {'holds' if len(odd) == 1 else 'hold'} a different copy from {ranks_phrase(majority)}"
    elif all(len(c) == 1 for c in split):
        who = f"{ranks_phrase(ranks)} each hold a different copy, and no majority says which is right"
    else:
        who = ", ".join(
            f"{ranks_phrase(c)} hold {'one' if i == 0 else 'another'} copy" for i, c in enumerate(split)
        )
    if last_equal is None and step == 0:
        when = (
            "at the first forward (step 0), though DistributedDataParallel broadcast rank 0's state when it was "
            "built: the parameters changed on some ranks in between, such as a checkpoint loaded on some ranks "
            "only after wrapping"
        )
    elif last_equal is None:
        when = f"at step {step}, the first step compared"
    else:
        when = f"at step {step} (they were identical at step {last_equal}, the comparison before: it happened in between)"
    newest_step, newest_digests = newest
    spread = ""
    if newest_step != step:
        columns = list(zip(*(d["norms"] for d in newest_digests.values()), strict=True))
        now = sum(1 for column in columns if len(_clusters(dict(enumerate(map(float, column))))) > 1)
        unit = "norms" if first["group"] > 1 else "parameters"
        spread = f" At step {newest_step}, {now} of {len(columns)} {unit} differ."
    message = (
        f"The ranks' copies of the model differ {when}: {len(params)} parameter(s) ({shown}); {who}.{spread} DDP "
        "keeps the copies identical only while every rank applies the same update to the same averaged "
        "gradients, so something changed the parameters on some ranks only: an optimizer or LR-scheduler step, "
        "gradient clipping, a checkpoint load or a manual update under a rank-dependent condition "
        "(if rank == 0:), or gradients DDP never all-reduced (see any unsynced_gradients incident). From here "
        "the ranks train different models; nothing fails. Do every update on every rank (save on one rank, but "
        "load on all), and restart from a checkpoint taken before the divergence."
    )
    return Incident(
        kind="replicas_diverged",
        message=capitalized(message),
        rank=min(odd) if odd else ranks[0],
        step=step,
        parameters=params[:MAX_NAMED],
        culprit_ranks=sorted(odd),
        time_s=min(record_s(d) for d in digests.values()),
    )


def _nonfinite(ordered: list[tuple[int, dict[int, Record]]], names: _Names, said: set[str]) -> list[Incident]:
    """``said``: the warning codes by which some rank said its loss or its gradients went NaN or Inf
    (``nonfinite.py``): their incidents name the origin."""
    last_finite: int | None = None
    for step, digests in ordered:
        bad: dict[int, list[int]] = {}
        kinds: set[str] = set()
        for r, d in sorted(digests.items()):
            for e, v in enumerate(d["norms"]):
                if v in NON_FINITE:
                    bad.setdefault(e, []).append(r)
                    kinds.add(NON_FINITE[v])
        if not bad:
            last_finite = step
            continue
        ranks = sorted({r for rs in bad.values() for r in rs})
        everyone = len(ranks) == len(digests)
        params = names.of(digests[ranks[0]], sorted(bad))
        shown = _shown(params)
        since = f"between steps {last_finite} and {step}" if last_finite is not None else f"by step {step}"
        if NONFINITE_GRADIENT in said:
            origin = "the nonfinite_gradient incident names the rank whose gradients went first"
        elif NONFINITE_LOSS in said:
            origin = "the nonfinite_loss incident names the rank whose loss went first"
        else:
            origin = "the origin can be any rank"
        where = "on every rank: DDP's all-reduce spreads one rank's non-finite gradient to all of them, so " \
            f"{origin}" if everyone else f"on {ranks_phrase(ranks)} only"  # fmt: skip
        message = (
            f"Parameters became {' or '.join(sorted(kinds))} {since}: {shown}, {where}. Every later step "
            "trains on garbage. Look at the loss and the gradients of those steps (a learning rate too high, "
            "a division by zero or log of zero, a bad batch; torch.autograd.set_detect_anomaly(True) names "
            "the operation), or clip gradients and skip non-finite losses."
        )
        return [
            Incident(
                kind="nonfinite_parameters",
                message=message,
                rank=ranks[0],
                step=step,
                parameters=params[:MAX_NAMED],
                culprit_ranks=[] if everyone else ranks,
                time_s=min(record_s(d) for d in digests.values()),
            )
        ]
    return []
