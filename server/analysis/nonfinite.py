"""``nonfinite_loss`` and ``nonfinite_gradient`` warnings as incidents: the rank whose loss, or whose gradients
inside backward, went NaN or Inf first, and whether the ranks recovered.

DDP averages the ranks' gradients, so one rank's NaN or Inf loss is in every rank's gradients after that
step's all-reduce, and in every rank's parameters after the optimizer step: from then on every rank logs
``loss: nan``, and no log says where it began. Each rank says when a run of steps whose loss gradient is not
finite begins, and again when it ends (``finite_again_step``), with its count of synchronised backwards
(``syncs``, see ``ddp/nonfinite.py``), which the ranks share even when their step numbers differ. With
``DDPSCOPE_CHECK_GRADIENTS`` a rank says the same of its gradients before their all-reduce, in steps whose
loss was finite, with the bucket and the parameters.

The rule, for each kind: runs are compared by ``syncs`` (by ``step`` when any run lacks it). The first episode
begins at the smallest; the ranks whose run begins there are its origin and the culprits, and the ranks whose
run begins later in the episode followed (the all-reduce reached them). When every rank of the job began at
once, it is nothing one rank's batch did but something the ranks share; for the loss, a gradient run that
began no later says which rank's backward made the parameters NaN. An episode lasts while any of its runs
has not ended; runs that begin after every rank recovered are later episodes, counted in the same incident.
The incidents change nothing in the job's status: the job runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpscope.agent.records import NONFINITE_GRADIENT, NONFINITE_LOSS
from ddpscope.server.analysis.incident_model import Incident, Record, capitalized, ranks_phrase, record_s
from ddpscope.server.analysis.snapshot import JobSnapshot

MAX_LISTED = 5
"""Later episodes whose first step the message lists."""


@dataclass(slots=True)
class _Run:
    """One rank's run of steps with a non-finite loss gradient."""

    rank: int
    step: int
    syncs: int | None
    record: Record
    """The warning that said it began (the one that said it ended when that one is missing)."""
    finite_again_step: int | None = None

    def at(self, by_syncs: bool) -> int:
        return self.syncs if by_syncs and self.syncs is not None else self.step

    def end(self, by_syncs: bool) -> float:
        """Where the run ended, in the units of ``at`` (a run still going never ends). In syncs, at most as
        many syncs as steps passed: an end a little late, never early."""
        if self.finite_again_step is None:
            return float("inf")
        return self.at(by_syncs) + self.finite_again_step - self.step


def nonfinite_incidents(snapshot: JobSnapshot) -> list[Incident]:
    grads = _runs(snapshot, NONFINITE_GRADIENT)
    out = _gradient_incident(snapshot, grads)
    return _loss_incident(snapshot, _runs(snapshot, NONFINITE_LOSS), grads) + out


def _episodes(runs: list[_Run]) -> tuple[list[list[_Run]], bool]:
    """The runs grouped into episodes in order, and whether they were compared by sync count."""
    by_syncs = all(r.syncs is not None for r in runs)
    episodes: list[list[_Run]] = []
    end = float("-inf")
    for run in sorted(runs, key=lambda r: (r.at(by_syncs), r.rank)):
        if not episodes or run.at(by_syncs) >= end:  # every run of the episode had ended
            episodes.append([])
            end = float("-inf")
        episodes[-1].append(run)
        end = max(end, run.end(by_syncs))
    return episodes, by_syncs


def _first_episode(
    snapshot: JobSnapshot, runs: list[_Run]
) -> tuple[list[list[_Run]], bool, _Run, list[int], list[int], bool, list[int]]:
    """The episodes and how they were compared, then of the first: the run that led it, its origin ranks, the
    job's ranks, whether every one of them began at once, and the ranks that have not recovered."""
    episodes, by_syncs = _episodes(runs)
    first = episodes[0]
    lead = first[0]
    origin = sorted({r.rank for r in first if r.at(by_syncs) == lead.at(by_syncs)})
    ranks = sorted(set(range(snapshot.world_size)) | set(snapshot.ranks) | set(snapshot.rank_last_seen_s))
    at_once = len(ranks) > 1 and set(origin) >= set(ranks)
    still = sorted({r.rank for r in first if r.finite_again_step is None})
    return episodes, by_syncs, lead, origin, ranks, at_once, still


def _finite_again(subject: str, episode: list[_Run]) -> str:
    """The sentence for an episode every rank recovered from, from the step the last of them did."""
    again = max(r.finite_again_step or r.step for r in episode)
    return (
        f"{subject} finite again from step {again} (a loss scaler such as torch.amp.GradScaler skips such a step "
        "and lowers its scale: harmless if rare)."
    )


def _later(episodes: list[list[_Run]]) -> str | None:
    if len(episodes) < 2:
        return None
    later = [e[0].step for e in episodes[1:]]
    steps = ", ".join(map(str, later[:MAX_LISTED])) + (" and later" if len(later) > MAX_LISTED else "")
    plural = "s" if len(later) > 1 else ""
    return f"{len(later)} later episode{plural} began at step{plural} {steps}."


def _loss_incident(snapshot: JobSnapshot, runs: list[_Run], grads: list[_Run]) -> list[Incident]:
    if not runs:
        return []
    episodes, by_syncs, lead, origin, ranks, at_once, still = _first_episode(snapshot, runs)
    first = episodes[0]
    weights = _weights_went_first(origin, first)
    restart_step = lead.step
    if at_once:
        when = "the same synchronised backward" if by_syncs else "the same step"
        cause, restart_step = _shared_cause(snapshot, lead, grads, by_syncs, weights)
        parts = [
            f"Every rank's loss was NaN or Inf from step {lead.step} at once ({when}): not one rank's data but "
            f"something they share: {cause}"
        ]
    else:
        others = [r for r in ranks if r not in origin]
        parts = [
            _weights_sentence(origin, lead.step, others, weights, first)
            if weights
            else _origin_sentence(origin, lead.step, others, first)
        ]
    if still:
        parts.append(
            f"The loss has not been finite since on {ranks_phrase(still)}: the parameters are NaN or Inf and "
            "training on is wasted."
        )
    else:
        parts.append(_finite_again("Every rank's loss was", first))
    later = _later(episodes)
    if later:
        parts.append(later)
    restart = f"restart from a checkpoint taken before step {restart_step}"
    if not at_once and weights:
        # The weights went bad in the update before this step: a checkpoint taken since holds them.
        one = len(origin) == 1
        parts.append(
            f"Look at what {ranks_phrase(origin)} ran after {'its' if one else 'their'} last all-reduce before "
            f"step {lead.step} that {'its' if one else 'their'} peers did not"
            + (
                f"; restart from a checkpoint taken before the update that preceded step {lead.step}."
                if still
                else "."
            )
        )
    elif not at_once:
        one = len(origin) == 1
        parts.append(
            f"Look at {ranks_phrase(origin)}'s {'batch' if one else 'batches'} of step {lead.step} and at the "
            f"forward and loss on {'it' if one else 'them'} (a log or division near zero, an overflow in "
            f"float16){'; ' + restart if still else ''}."
        )
    elif still:
        parts.append(f"{capitalized(restart)}.")
    return [
        Incident(
            kind=NONFINITE_LOSS,
            message=" ".join(parts),
            rank=lead.rank,
            step=lead.step,
            culprit_ranks=ranks if at_once else origin,
            time_s=record_s(lead.record),
        )
    ]


def _shared_cause(
    snapshot: JobSnapshot, lead: _Run, grads: list[_Run], by_syncs: bool, weights: list[str] | None
) -> tuple[str, int]:
    """What every rank's loss going NaN at once comes from, as far as the gradient checks tell, and the step a
    checkpoint to restart from must predate. ``weights``: the parameters and buffers every rank's forward
    already found NaN or Inf, if each said so."""
    earlier = [g for g in grads if g.at(by_syncs) <= lead.at(by_syncs)]
    if weights and not earlier:
        shown = ", ".join(weights[:MAX_LISTED]) + (", ..." if len(weights) > MAX_LISTED else "")
        checked = bool(snapshot.ranks) and all(s.get("check_gradients") for s in snapshot.ranks.values())
        return (
            f"parameters or buffers that were NaN or Inf already as the step's forward ran ({shown}), on every "
            "rank: the update before it made them so (the learning rate, an optimizer's state, "
            + (
                "an overflow in the update: no rank's gradients were NaN or Inf before their all-reduce, "
                "DDPSCOPE_CHECK_GRADIENTS was on)."
                if checked
                else "or gradients an operation in backward made NaN or Inf, such as sqrt or norm at zero: "
                "DDPSCOPE_CHECK_GRADIENTS=1 checks them before their all-reduce)."
            ),
            lead.step,
        )
    if earlier:
        first = min(g.at(by_syncs) for g in earlier)
        began = [g for g in earlier if g.at(by_syncs) == first]
        return (
            f"parameters an update made NaN or Inf: {ranks_phrase(g.rank for g in began)}'s gradients were NaN "
            f"or Inf inside backward at step {began[0].step} (the {NONFINITE_GRADIENT} incident names the "
            "parameters).",
            min(g.step for g in began),
        )
    checked = bool(snapshot.ranks) and all(s.get("check_gradients") for s in snapshot.ranks.values())
    if checked:
        return (
            "parameters the optimizer's update made NaN or Inf (no rank's gradients were NaN or Inf before "
            "their all-reduce: DDPSCOPE_CHECK_GRADIENTS was on), the learning rate, or the same bad data on "
            "every rank.",
            lead.step,
        )
    return (
        "parameters already non-finite (an update from infinite gradients of an operation in backward, such as "
        "sqrt or norm at zero), the learning rate, or the same bad data on every rank. To find the rank and "
        "the parameters whose gradients went NaN or Inf first, run again from a checkpoint taken before step "
        f"{lead.step} with DDPSCOPE_CHECK_GRADIENTS=1 (every gradient bucket checked before its all-reduce).",
        lead.step,
    )


def _gradient_incident(snapshot: JobSnapshot, runs: list[_Run]) -> list[Incident]:
    """Ranks whose gradients went NaN or Inf inside backward while their losses were finite (only ranks with
    ``DDPSCOPE_CHECK_GRADIENTS`` say so)."""
    if not runs:
        return []
    episodes, _, lead, origin, ranks, at_once, still = _first_episode(snapshot, runs)
    first = episodes[0]
    one = len(origin) == 1
    where = _bucket_phrase(lead)
    if at_once:
        parts = [
            f"Every rank's gradients were NaN or Inf before their all-reduce at step {lead.step} at once, while "
            "their losses were finite: not one rank's data but something they share, such as a parameter "
            f"under a sqrt or norm that reached zero, or the same bad data on every rank.{where}"
        ]
    else:
        others = [r for r in ranks if r not in origin]
        whose = "its" if one else "their"
        text = (
            f"{capitalized(ranks_phrase(origin))}'s gradients were NaN or Inf before their all-reduce at step "
            f"{lead.step} while {whose} loss{'' if one else 'es'} {'was' if one else 'were'} finite"
        )
        if others:
            text += f" and {ranks_phrase(others)}'s gradients were finite"
        parts = [
            f"{text}: {whose} backward made them.{where} DDP's all-reduce averaged them into every rank's "
            f"gradients{_followed(origin, first)}."
        ]
    if still:
        parts.append(
            f"The gradients have not been finite since on {ranks_phrase(still)}: the parameters are NaN or Inf "
            f"and training on is wasted; restart from a checkpoint taken before step {lead.step}."
        )
    else:
        parts.append(_finite_again("The gradients were", first))
    later = _later(episodes)
    if later:
        parts.append(later)
    subject = "one rank" if at_once else ranks_phrase(origin)
    parts.append(
        f"To find the line, run {subject}'s step {lead.step} again on the same batch under "
        "torch.autograd.detect_anomaly(), which names the forward operation whose backward made the first NaN."
    )
    return [
        Incident(
            kind=NONFINITE_GRADIENT,
            message=" ".join(parts),
            rank=lead.rank,
            step=lead.step,
            culprit_ranks=ranks if at_once else origin,
            time_s=record_s(lead.record),
        )
    ]


def _bucket_phrase(run: _Run) -> str:
    """Where rank ``run.rank`` saw it first: the bucket and its non-finite parameters, nearest the output first."""
    bucket = run.record.get("bucket")
    names = list(run.record.get("parameters") or [])
    if bucket is None:
        return ""
    text = f" First on rank {run.rank}, in bucket {bucket}"
    if not names:
        return text + "."
    return (
        f"{text}: {', '.join(names)} (nearest the output first: the operation that made it lies between "
        f"{names[0]}'s layer and the loss)."
    )


def _runs(snapshot: JobSnapshot, code: str) -> list[_Run]:
    """Every run of warnings ``code``, its beginning and end warnings paired (same rank, step and syncs)."""
    runs: dict[tuple[int, int, int | None], _Run] = {}
    for w in snapshot.warnings:
        if w["code"] != code or w.get("step") is None:
            continue
        syncs = int(w["syncs"]) if w.get("syncs") is not None else None
        key = (int(w["rank"]), int(w["step"]), syncs)
        run = runs.setdefault(key, _Run(*key, record=w))
        if w.get("finite_again_step") is None:
            run.record = w
        else:
            run.finite_again_step = int(w["finite_again_step"])
    return list(runs.values())


def _weights_went_first(origin: list[int], episode: list[_Run]) -> list[str] | None:
    """The parameters and buffers the origin ranks' forwards already found NaN or Inf, when every origin rank
    said so (``nonfinite_weights``), else None: then its batch or forward made the NaN."""
    leads: dict[int, _Run] = {}
    for run in episode:
        leads.setdefault(run.rank, run)
    names: list[str] = []
    for rank in origin:
        said = leads[rank].record.get("nonfinite_weights")
        if not said:
            return None
        names += [n for n in said if n not in names]
    return names


def _weights_sentence(
    origin: list[int], step: int, others: list[int], names: list[str], episode: list[_Run]
) -> str:
    """Case A': some ranks went first because their own weights already were NaN or Inf: the all-reduce keeps
    every rank's parameters equal, so what made them so ran on those ranks alone after it."""
    one = len(origin) == 1
    whose = "its" if one else "their"
    text = (
        f"{capitalized(ranks_phrase(origin))}'s loss was NaN or Inf at step {step} because {whose} parameters or "
        f"buffers already were as that step's forward ran ({', '.join(names[:MAX_LISTED])}"
        f"{', ...' if len(names) > MAX_LISTED else ''})"
    )
    if others:
        text += f", while {ranks_phrase(others)}'s {'loss was' if len(others) == 1 else 'losses were'} still finite"
    return (
        f"{text}: not {whose} batch, but what changed {whose} weights alone after the previous step's all-reduce, "
        "which leaves every rank's gradients equal: a gradient clip or rescale computed on one rank, an optimizer "
        "state of its own, a write to the weights or the running statistics (a checkpoint loaded on one rank, a "
        f"forward in train mode on a bad batch). DDP's all-reduce then averaged it into every rank's gradients"
        f"{_followed(origin, episode)}."
    )


def _origin_sentence(origin: list[int], step: int, others: list[int], episode: list[_Run]) -> str:
    """Case A: some ranks went first, while the others' losses were finite (and their weights were, or they
    did not say: ``_weights_sentence`` otherwise)."""
    one = len(origin) == 1
    text = (
        f"{capitalized(ranks_phrase(origin))}'s loss was NaN or Inf at step {step} ("
        + (
            "the gradient it sent into its model's output was not finite"
            if one
            else "the gradients they sent into their models' outputs were not finite"
        )
        + ")"
    )
    if not others:
        return f"{text}: {'its batch or its forward' if one else 'their batches or their forwards'} made it."
    still_finite = (
        f"{ranks_phrase(others)}'s was" if len(others) == 1 else f"the losses of {ranks_phrase(others)} were"
    )
    made = "its batch or its forward" if one else "their batches or their forwards"
    text += (
        f" while {still_finite} still finite: {made} made it. DDP's all-reduce averaged it into every rank's "
        "gradients"
    )
    return text + _followed(origin, episode) + "."


def _followed(origin: list[int], episode: list[_Run]) -> str:
    """ "; rank 0 followed from step 4", for the ranks of ``episode`` outside ``origin`` (or "")."""
    followed: dict[int, int] = {}  # rank -> the step its first run of the episode began
    for run in episode:
        if run.rank not in origin:
            followed.setdefault(run.rank, run.step)
    by_step: dict[int, list[int]] = {}
    for rank, s in followed.items():
        by_step.setdefault(s, []).append(rank)
    if len(by_step) > MAX_LISTED:
        return f"; {ranks_phrase(followed)} followed from steps {min(by_step)} to {max(by_step)}"
    if not by_step:
        return ""
    groups = [f"{ranks_phrase(rs)} from step {s}" for s, rs in sorted(by_step.items())]
    groups[0] = groups[0].replace(" from step", " followed from step")
    return "; " + ", ".join(groups[:-1]) + (" and " if len(groups) > 1 else "") + groups[-1]
