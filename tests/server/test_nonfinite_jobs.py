"""Real 2-rank gloo jobs whose rank 1 gets a batch with a NaN at step 3, under ddpscope's engine and under
torch's DDP with ``instrument()`` (``jobs/nan_batch.py``). DDP's all-reduce puts the NaN in rank 0's
gradients too, so every rank's log reads ``loss: nan``; the collector's ``nonfinite_loss`` incident names
rank 1 and step 3, and says whether the ranks recovered: not when the loop steps the optimizer on the NaN
(``spread``), yes when it skips that step as a loss scaler does (``skipped``). With ``DDPSCOPE_CHECK_GRADIENTS``,
a NaN rank 1's backward makes while its loss is finite (``backward``) is traced to rank 1, its bucket and the
parameter, and the NaN loss every rank has one step later points back at it. A NaN rank 1's own update put
in its parameters after the all-reduce (``update``) is told as that, not as its batch.

Every rank and the collector are killed by process group when the module's jobs are done."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.real_job import RealJob, jobs_at_one_collector

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "jobs" / "nan_batch.py"
JOBS = (
    ("spread", "ddpscope"),
    ("spread", "torch"),
    ("skipped", "torch"),
    ("backward", "ddpscope"),
    ("backward", "torch"),
    ("update", "ddpscope"),
)
WAIT_S = 150.0
"""Deadline for the diagnosis: 6 ranks import torch at once on 2 cores first."""


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], RealJob]]:
    """One job per (mode, engine), started at once against one real collector; killed at the end."""
    tmp = tmp_path_factory.mktemp("nonfinite")
    with jobs_at_one_collector(tmp, SCRIPT, JOBS, prefix="nan", hang_timeout_s=300, wait_s=WAIT_S) as started:
        yield started


def nonfinite_loss(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [i for i in incidents if i["kind"] == "nonfinite_loss"]


@pytest.mark.parametrize("engine", ["ddpscope", "torch"])
def test_the_rank_whose_batch_held_a_nan_is_named_with_its_step_though_every_rank_went_nan(
    jobs: dict[tuple[str, str], RealJob], engine: str
) -> None:
    j = jobs["spread", engine]
    assert j.exited_cleanly(), j.logs()
    assert j.settled_status() == "finished"  # a NaN stops nothing: the job runs on, on garbage
    (inc,) = j.wait_for("rank 1's NaN loss", nonfinite_loss)
    assert (inc["rank"], inc["step"], inc["culprit_ranks"]) == (1, 3, [1]), inc
    message = inc["message"]
    assert "step 3" in message and "rank 0" in message.lower(), inc  # rank 0 followed, from step 4
    assert "not been finite since" in message, inc
    # The parameters' digests see the NaN too, on every rank; the loss incident is the one that names rank 1.
    kinds = {i["kind"] for i in j.incidents()}
    assert kinds <= {"nonfinite_loss", "nonfinite_parameters"}, j.incidents()


def test_a_nan_step_the_loop_skipped_is_said_to_have_recovered(jobs: dict[tuple[str, str], RealJob]) -> None:
    j = jobs["skipped", "torch"]
    assert j.exited_cleanly(), j.logs()
    assert j.settled_status() == "finished"
    (inc,) = j.wait_for("rank 1's skipped NaN step", nonfinite_loss)
    assert (inc["rank"], inc["step"], inc["culprit_ranks"]) == (1, 3, [1]), inc
    assert "finite again from step 4" in inc["message"], inc
    # The optimizer never took the NaN: every rank's parameters stayed finite.
    assert [i["kind"] for i in j.incidents()] == ["nonfinite_loss"], j.incidents()


@pytest.mark.parametrize("engine", ["ddpscope", "torch"])
def test_a_nan_one_ranks_backward_made_under_a_finite_loss_is_traced_to_its_rank_and_parameter(
    jobs: dict[tuple[str, str], RealJob], engine: str
) -> None:
    j = jobs["backward", engine]
    assert j.exited_cleanly(), j.logs()
    assert j.settled_status() == "finished"

    def kind(name: str) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
        return lambda incidents: [i for i in incidents if i["kind"] == name]

    (grads,) = j.wait_for("rank 1's NaN gradients", kind("nonfinite_gradient"))
    assert (grads["rank"], grads["step"], grads["culprit_ranks"]) == (1, 3, [1]), grads
    assert "First on rank 1, in bucket 0: proj.weight (nearest the output first" in grads["message"], grads
    assert "rank 0's gradients were finite" in grads["message"], grads
    (loss,) = j.wait_for("every rank's NaN loss", nonfinite_loss)
    assert (loss["step"], loss["culprit_ranks"]) == (4, [0, 1]), loss
    assert "rank 1's gradients were NaN or Inf inside backward at step 3" in loss["message"], loss


def test_a_nan_one_ranks_own_update_put_in_its_parameters_is_not_blamed_on_its_batch(
    jobs: dict[tuple[str, str], RealJob],
) -> None:
    j = jobs["update", "ddpscope"]
    assert j.exited_cleanly(), j.logs()
    assert j.settled_status() == "finished"
    (inc,) = j.wait_for("rank 1's NaN loss", nonfinite_loss)
    assert (inc["rank"], inc["step"], inc["culprit_ranks"]) == (1, 3, [1]), inc
    message = inc["message"]
    assert "because its parameters or buffers already were as that step's forward ran (0.weight" in message, (
        inc
    )
    assert "while rank 0's loss was still finite" in message and "rank 0 followed from step 4" in message, inc
    assert "not its batch" in message and "Look at rank 1's batch" not in message, inc
    assert "Look at what rank 1 ran after its last all-reduce before step 3" in message, inc
