"""``nonfinite_loss`` warnings as one incident: the rank whose loss went NaN or Inf first (by sync count, else
by step), the ranks that followed, and whether they recovered. The real 2-rank jobs are in
``test_nonfinite_jobs.py``."""

from __future__ import annotations

from typing import Any

from ddpscope.server.analysis.incidents import Incident, diagnose
from ddpscope.server.analysis.status import job_status
from ddpscope.server.analysis.warning_incidents import warning_incidents
from tests.server.test_incidents import JobRecords

T0 = 1_700_000_000.0
NOW = T0 + 5
BEGAN = (
    "the gradient its loss sent into the model's output was NaN or Inf (a NaN or Inf loss or model output)."
)
ENDED = "its loss gradient was finite again."
"""What ``ddp/nonfinite.py`` writes, near enough: the collector reads the fields, never the text."""


def started(world: int) -> JobRecords:
    job = JobRecords(world=world)
    for rank in range(world):
        job.start(rank, T0)
        job.heartbeat(rank, T0 + 1)
    return job


def nan(
    job: JobRecords,
    rank: int,
    t: float,
    step: int,
    syncs: int | None = None,
    *,
    again: int | None = None,
    weights: list[str] | None = None,
) -> None:
    """A run of non-finite steps beginning at ``step`` (after ``syncs`` synced backwards), or, with ``again``,
    ending at that step; ``weights``: the parameters and buffers the step's forward already found NaN."""
    fields: dict[str, Any] = {} if syncs is None else {"syncs": syncs}
    if again is not None:
        fields["finite_again_step"] = again
    if weights:
        fields["nonfinite_weights"], fields["nonfinite_weights_count"] = weights, len(weights)
    job.add("warning", rank, t, step=step, code="nonfinite_loss", message=ENDED if again else BEGAN, **fields)


def only(job: JobRecords) -> Incident:
    (inc,) = [i for i in diagnose(job.snapshot(), NOW) if i.kind == "nonfinite_loss"]
    return inc


def test_one_rank_first_is_the_culprit_and_the_others_follow() -> None:
    job = started(4)
    for rank in (0, 1, 2):  # their warnings reached the collector first: the sync count decides, not the time
        nan(job, rank, T0 + 2, 121, 121)
    nan(job, 3, T0 + 2.5, 120, 120)
    inc = only(job)
    assert (inc.rank, inc.step, inc.culprit_ranks, inc.time_s) == (3, 120, [3], T0 + 2.5)
    assert inc.message == (
        "Rank 3's loss was NaN or Inf at step 120 (the gradient it sent into its model's output was not finite) "
        "while the losses of ranks 0, 1, 2 were still finite: its batch or its forward made it. DDP's all-reduce "
        "averaged it into every rank's gradients; ranks 0, 1, 2 followed from step 121. The loss has not been "
        "finite since "
        "on ranks 0, 1, 2, 3: the parameters are NaN or Inf and training on is wasted. Look at rank 3's batch "
        "of step 120 and at the forward and loss on it (a log or division near zero, an overflow in float16); "
        "restart from a checkpoint taken before step 120."
    )


def test_a_recovered_episode_says_a_loss_scaler_skipped_it_and_only_the_ranks_still_nan_are_named() -> None:
    job = started(2)
    nan(job, 1, T0 + 2, 3, 3)
    nan(job, 1, T0 + 2.1, 3, 3, again=4)
    inc = only(job)
    assert (inc.rank, inc.step, inc.culprit_ranks) == (1, 3, [1])
    assert "while rank 0's was still finite" in inc.message
    assert "followed" not in inc.message and "restart" not in inc.message
    assert "not been finite since" not in inc.message
    assert (
        "Every rank's loss was finite again from step 4 (a loss scaler such as torch.amp.GradScaler skips such "
        "a step and lowers its scale: harmless if rare)." in inc.message
    )
    job = started(2)  # rank 1 recovers at step 6, but rank 0 followed at step 4 and never recovered
    nan(job, 1, T0 + 2, 3, 3)
    nan(job, 0, T0 + 2.05, 4, 4)
    nan(job, 1, T0 + 2.1, 3, 3, again=6)
    inc = only(job)
    assert (inc.rank, inc.culprit_ranks) == (1, [1])
    assert "rank 0 followed from step 4. The loss has not been finite since on rank 0:" in inc.message
    assert "finite again" not in inc.message


def test_every_rank_at_once_is_something_they_share_not_one_ranks_batch() -> None:
    job = started(3)
    for rank in (2, 0, 1):
        nan(job, rank, T0 + 2 + rank / 10, 50, 50)
    inc = only(job)
    assert (inc.rank, inc.step, inc.culprit_ranks, inc.time_s) == (0, 50, [0, 1, 2], T0 + 2)
    assert inc.message.startswith(
        "Every rank's loss was NaN or Inf from step 50 at once (the same synchronised backward): not one "
        "rank's data but something they share: parameters already non-finite"
    )
    assert "Look at" not in inc.message
    assert inc.message.endswith("Restart from a checkpoint taken before step 50.")


def test_a_rank_whose_own_weights_were_already_nan_is_told_to_look_after_its_all_reduce_not_at_its_batch() -> (
    None
):
    job = started(
        2
    )  # rank 1 clipped its gradients on its own after step 9's all-reduce: NaN weights at step 10
    nan(job, 1, T0 + 2, 10, 10, weights=["0.weight", "0.bias"])
    nan(job, 0, T0 + 2.1, 11, 11, weights=["0.weight", "0.bias", "2.weight"])  # the all-reduce reached it
    inc = only(job)
    assert (inc.rank, inc.step, inc.culprit_ranks) == (1, 10, [1])
    assert inc.message.startswith(
        "Rank 1's loss was NaN or Inf at step 10 because its parameters or buffers already were as that step's "
        "forward ran (0.weight, 0.bias), while rank 0's loss was still finite: not its batch, but what changed "
        "its weights alone after the previous step's all-reduce"
    )
    assert "rank 0 followed from step 11" in inc.message
    assert "batch of step 10" not in inc.message
    assert inc.message.endswith(
        "Look at what rank 1 ran after its last all-reduce before step 10 that its peers did not; restart from a "
        "checkpoint taken before the update that preceded step 10."
    )


def test_weights_already_nan_on_every_rank_at_once_are_said_to_come_from_the_update_before() -> None:
    job = started(2)
    for rank in (0, 1):
        nan(job, rank, T0 + 2, 7, 7, weights=["fc.weight"])
    inc = only(job)
    assert inc.culprit_ranks == [0, 1]
    assert (
        "something they share: parameters or buffers that were NaN or Inf already as the step's forward ran "
        "(fc.weight), on every rank: the update before it made them so" in inc.message
    )
    assert "DDPSCOPE_CHECK_GRADIENTS=1 checks them" in inc.message


def test_a_batch_nan_is_still_the_batch_when_only_a_follower_had_nan_weights() -> None:
    job = started(2)
    nan(job, 1, T0 + 2, 3, 3)  # rank 1's batch: its weights were finite
    nan(job, 0, T0 + 2.1, 4, 4, weights=["0.weight"])  # rank 0's weights took the averaged NaN
    assert "its batch or its forward made it" in only(job).message


def test_some_ranks_at_once_while_another_was_finite_are_the_culprits() -> None:
    job = started(3)  # rank 2 never said anything: its loss stayed finite
    for rank in (1, 0):
        nan(job, rank, T0 + 2, 50, 50)
    inc = only(job)
    assert (inc.rank, inc.step, inc.culprit_ranks) == (0, 50, [0, 1])
    assert inc.message.startswith(
        "Ranks 0, 1's loss was NaN or Inf at step 50 (the gradients they sent into their models' outputs were "
        "not finite) while rank 2's was still finite: their batches or their forwards made it."
    )
    assert "Look at ranks 0, 1's batches of step 50" in inc.message


def test_ranks_whose_step_numbers_differ_are_compared_by_syncs() -> None:
    job = started(2)
    nan(job, 1, T0 + 2, 100, 51)  # a lower step, but one sync later
    nan(job, 0, T0 + 2.5, 200, 50)
    inc = only(job)
    assert (inc.rank, inc.step, inc.culprit_ranks) == (0, 200, [0])
    assert "rank 1 followed from step 100" in inc.message


def test_records_without_syncs_are_compared_by_step() -> None:
    job = started(2)
    nan(job, 0, T0 + 2, 8)
    nan(job, 1, T0 + 2.5, 7)
    nan(job, 1, T0 + 2.6, 7, again=9)
    nan(job, 0, T0 + 2.7, 8, again=9)
    inc = only(job)
    assert (inc.rank, inc.step, inc.culprit_ranks, inc.time_s) == (1, 7, [1], T0 + 2.5)
    assert "rank 0 followed from step 8" in inc.message
    assert "Every rank's loss was finite again from step 9" in inc.message
    assert "later episode" not in inc.message


def test_a_later_episode_is_counted_in_the_same_incident() -> None:
    job = started(2)
    nan(job, 1, T0 + 2, 3, 3)
    nan(job, 1, T0 + 2.1, 3, 3, again=4)
    nan(job, 0, T0 + 3, 40, 40)  # after every rank recovered: a new episode, not a follower
    nan(job, 0, T0 + 3.1, 40, 40, again=41)
    nan(job, 1, T0 + 4, 90, 90)
    inc = only(job)
    assert (inc.rank, inc.step, inc.culprit_ranks) == (1, 3, [1])
    assert "followed" not in inc.message
    assert "Every rank's loss was finite again from step 4" in inc.message
    assert "2 later episodes began at steps 40, 90." in inc.message


def test_the_generic_warning_path_makes_no_second_incident_of_these_warnings() -> None:
    job = started(2)
    nan(job, 1, T0 + 2, 3, 3)
    nan(job, 0, T0 + 2.1, 4, 4)
    job.add("warning", 0, T0 + 2.2, step=4, code="unsynced_gradients", message="gradients not all-reduced.")
    assert [i.kind for i in warning_incidents(job.snapshot())] == ["unsynced_gradients"]
    kinds = sorted(i.kind for i in diagnose(job.snapshot(), NOW))
    assert kinds == ["nonfinite_loss", "unsynced_gradients"]


def test_the_job_status_is_what_it_was_without_the_warnings() -> None:
    job = JobRecords(world=2)
    for rank in (0, 1):
        job.start(rank, T0)
    t = job.train(5)
    before = job_status(job.snapshot(), t)
    nan(job, 1, t - 0.3, 2, 2)
    nan(job, 0, t - 0.2, 3, 3)
    assert before == job_status(job.snapshot(), t) == "running"


def bad_gradients(
    job: JobRecords,
    rank: int,
    t: float,
    step: int,
    syncs: int,
    *,
    again: int | None = None,
    parameters: tuple[str, ...] = ("proj.weight",),
) -> None:
    """With DDPSCOPE_CHECK_GRADIENTS: rank ``rank``'s gradients in bucket 1 were NaN before their all-reduce."""
    fields: dict[str, Any] = {"syncs": syncs}
    if again is None:
        fields.update(bucket=1, parameters=list(parameters))
    else:
        fields["finite_again_step"] = again
    job.add(
        "warning", rank, t, step=step, code="nonfinite_gradient", message="its gradients were NaN.", **fields
    )


def checking_gradients(job: JobRecords) -> JobRecords:
    for r in job.records:
        if r["kind"] == "rank_start":
            r["check_gradients"] = True
    return job


def incident(job: JobRecords, kind: str) -> Incident:
    (inc,) = [i for i in diagnose(job.snapshot(), NOW) if i.kind == kind]
    return inc


def test_a_nan_made_inside_one_ranks_backward_names_that_rank_its_bucket_and_parameters() -> None:
    job = checking_gradients(started(3))
    bad_gradients(job, 1, T0 + 2, 30, 30, parameters=("proj.weight", "embed.weight"))
    for rank in (0, 1, 2):  # the optimizer step put it in every rank's parameters
        nan(job, rank, T0 + 2.5, 31, 31)
    inc = incident(job, "nonfinite_gradient")
    assert (inc.rank, inc.step, inc.culprit_ranks, inc.time_s) == (1, 30, [1], T0 + 2)
    assert inc.message.startswith(
        "Rank 1's gradients were NaN or Inf before their all-reduce at step 30 while its loss was finite and "
        "ranks 0, 2's gradients were finite: its backward made them. First on rank 1, in bucket 1: proj.weight, "
        "embed.weight (nearest the output first: the operation that made it lies between proj.weight's layer "
        "and the loss). DDP's all-reduce averaged them into every rank's gradients."
    )
    assert "have not been finite since on rank 1" in inc.message
    assert "restart from a checkpoint taken before step 30" in inc.message
    assert inc.message.endswith(
        "To find the line, run rank 1's step 30 again on the same batch under torch.autograd.detect_anomaly(), "
        "which names the forward operation whose backward made the first NaN."
    )
    loss = incident(job, "nonfinite_loss")  # every rank at once, one step later: it points back
    assert loss.culprit_ranks == [0, 1, 2]
    assert (
        "something they share: parameters an update made NaN or Inf: rank 1's gradients were NaN or Inf inside "
        "backward at step 30 (the nonfinite_gradient incident names the parameters)." in loss.message
    )
    assert loss.message.endswith("Restart from a checkpoint taken before step 30.")  # not 31: it began at 30


def test_every_rank_at_once_without_the_gradient_check_says_how_to_find_the_rank() -> None:
    job = started(2)
    for rank in (0, 1):
        nan(job, rank, T0 + 2, 50, 50)
    message = incident(job, "nonfinite_loss").message
    assert (
        "run again from a checkpoint taken before step 50 with DDPSCOPE_CHECK_GRADIENTS=1 (every gradient bucket "
        "checked before its all-reduce)." in message
    )
    job = checking_gradients(started(2))  # the check was on and found nothing before: not backward's doing
    for rank in (0, 1):
        nan(job, rank, T0 + 2, 50, 50)
    message = incident(job, "nonfinite_loss").message
    assert (
        "no rank's gradients were NaN or Inf before their all-reduce: DDPSCOPE_CHECK_GRADIENTS was on"
        in message
    )
    assert "DDPSCOPE_CHECK_GRADIENTS=1" not in message


def test_gradients_every_rank_made_at_once_and_recovered_from_are_something_they_share() -> None:
    job = checking_gradients(started(2))
    for rank in (0, 1):
        bad_gradients(job, rank, T0 + 2, 7, 7)
        bad_gradients(job, rank, T0 + 2.1, 7, 7, again=8)
    inc = incident(job, "nonfinite_gradient")
    assert (inc.rank, inc.step, inc.culprit_ranks) == (0, 7, [0, 1])
    assert inc.message.startswith(
        "Every rank's gradients were NaN or Inf before their all-reduce at step 7 at once, while their losses "
        "were finite: not one rank's data but something they share"
    )
    assert "The gradients were finite again from step 8" in inc.message
    assert "run one rank's step 7 again" in inc.message
    assert [i.kind for i in diagnose(job.snapshot(), NOW)] == ["nonfinite_gradient"]
    assert warning_incidents(job.snapshot()) == []
