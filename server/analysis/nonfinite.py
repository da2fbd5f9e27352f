"""``nonfinite_loss`` warnings as one incident: the rank whose loss went NaN or Inf first, and whether the
ranks recovered.

DDP averages the ranks' gradients, so one rank's NaN or Inf loss is in every rank's gradients after that
step's all-reduce, and in every rank's parameters after the optimizer step: from then on every rank logs
``loss: nan``, and no log says where it began. Each rank says when a run of steps whose loss gradient is not
finite begins, and again when it ends (``finite_again_step``), with its count of synchronised backwards
(``syncs``, see ``ddp/nonfinite.py``), which the ranks share even when their step numbers differ.

The rule: runs are compared by ``syncs`` (by ``step`` when any run lacks it). The first episode begins at the
smallest; the ranks whose run begins there are its origin and the culprits, and the ranks whose run begins
later in the episode followed (the all-reduce reached them). When every rank of the job began at once, it is
nothing one rank's batch did but something the ranks share. An episode lasts while any of its runs has not
ended; runs that begin after every rank recovered are later episodes, counted in the same incident. The
incident changes nothing in the job's status: the job runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpscope.agent.records import NONFINITE_LOSS
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
    runs = _runs(snapshot)
    if not runs:
        return []
    by_syncs = all(r.syncs is not None for r in runs)
    episodes: list[list[_Run]] = []
    end = float("-inf")
    for run in sorted(runs, key=lambda r: (r.at(by_syncs), r.rank)):
        if not episodes or run.at(by_syncs) >= end:  # every run of the episode had ended
            episodes.append([])
            end = float("-inf")
        episodes[-1].append(run)
        end = max(end, run.end(by_syncs))
    first = episodes[0]
    lead = first[0]
    origin = sorted({r.rank for r in first if r.at(by_syncs) == lead.at(by_syncs)})
    ranks = sorted(set(range(snapshot.world_size)) | set(snapshot.ranks) | set(snapshot.rank_last_seen_s))
    at_once = len(ranks) > 1 and set(origin) >= set(ranks)
    still = sorted({r.rank for r in first if r.finite_again_step is None})
    if at_once:
        when = "the same synchronised backward" if by_syncs else "the same step"
        parts = [
            f"Every rank's loss was NaN or Inf from step {lead.step} at once ({when}): not one rank's data but "
            "something they share: parameters already non-finite (an update from infinite gradients of an "
            "operation in backward, such as sqrt or norm at zero), the learning rate, or the same bad data on "
            "every rank."
        ]
    else:
        parts = [_origin_sentence(origin, lead.step, [r for r in ranks if r not in origin], first)]
    if still:
        parts.append(
            f"The loss has not been finite since on {ranks_phrase(still)}: the parameters are NaN or Inf and "
            "training on is wasted."
        )
    else:
        again = max(r.finite_again_step or r.step for r in first)
        parts.append(
            f"Every rank's loss was finite again from step {again} (a loss scaler such as "
            "torch.amp.GradScaler skips such a step and lowers its scale: harmless if rare)."
        )
    if len(episodes) > 1:
        later = [e[0].step for e in episodes[1:]]
        steps = ", ".join(map(str, later[:MAX_LISTED])) + (" and later" if len(later) > MAX_LISTED else "")
        plural = "s" if len(later) > 1 else ""
        parts.append(f"{len(later)} later episode{plural} began at step{plural} {steps}.")
    restart = f"restart from a checkpoint taken before step {lead.step}"
    if not at_once:
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


def _runs(snapshot: JobSnapshot) -> list[_Run]:
    """Every run, its beginning and end warnings paired (same rank, step and syncs)."""
    runs: dict[tuple[int, int, int | None], _Run] = {}
    for w in snapshot.warnings:
        if w["code"] != NONFINITE_LOSS or w.get("step") is None:
            continue
        syncs = int(w["syncs"]) if w.get("syncs") is not None else None
        key = (int(w["rank"]), int(w["step"]), syncs)
        run = runs.setdefault(key, _Run(*key, record=w))
        if w.get("finite_again_step") is None:
            run.record = w
        else:
            run.finite_again_step = int(w["finite_again_step"])
    return list(runs.values())


def _origin_sentence(origin: list[int], step: int, others: list[int], episode: list[_Run]) -> str:
    """Case A: some ranks went first, while the others' losses were finite."""
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
    followed: dict[int, int] = {}  # rank -> the step its first run of the episode began
    for run in episode:
        if run.rank not in origin:
            followed.setdefault(run.rank, run.step)
    by_step: dict[int, list[int]] = {}
    for rank, s in followed.items():
        by_step.setdefault(s, []).append(rank)
    if len(by_step) > MAX_LISTED:
        text += f"; {ranks_phrase(followed)} followed from steps {min(by_step)} to {max(by_step)}"
    elif by_step:
        groups = [f"{ranks_phrase(rs)} from step {s}" for s, rs in sorted(by_step.items())]
        groups[0] = groups[0].replace(" from step", " followed from step")
        text += "; " + ", ".join(groups[:-1]) + (" and " if len(groups) > 1 else "") + groups[-1]
    return text + "."
