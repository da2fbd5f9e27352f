"""``LossWatch`` in one process: the gradient the loss sends into the model's output, checked in every
training backward, makes one warning when a run of NaN/Inf steps begins and one when it ends. The real
2-rank jobs and their incident are in ``tests/server/test_nonfinite_jobs.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ddpscope.agent.records import NONFINITE_LOSS
from ddpscope.ddp.nonfinite import MAX_RUNS, LossWatch, module_weights
from tests.ddp.watchdog_support import Records, in_memory_records

FINE = torch.ones(4, 3)
NAN = torch.tensor([[1.0, float("nan")]])
INF = torch.tensor([float("inf"), 1.0])


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=2)


def said(records: Records) -> list[tuple[int, int, int | None]]:
    """(step, syncs, finite_again_step) of each nonfinite_loss warning, in order."""
    return [
        (r["step"], r["syncs"], r.get("finite_again_step"))
        for r in records("warning")
        if r["code"] == NONFINITE_LOSS
    ]


def backward(watch: LossWatch, step: int, syncs: int, *grads: object) -> None:
    """One training backward: each hooked output's gradient, then the end of backward."""
    for g in grads:
        watch.check(g, step, syncs)
    watch.backward_done()


def test_finite_gradients_say_nothing(records: Records) -> None:
    watch = LossWatch(rank=2)
    for step in range(5):
        backward(watch, step, step, FINE, (FINE, None))
    assert said(records) == []


def test_a_run_of_nan_steps_is_said_when_it_begins_and_when_a_finite_backward_ends_it(
    records: Records,
) -> None:
    watch = LossWatch(rank=2)
    backward(watch, 0, 0, FINE)
    backward(watch, 1, 1, NAN)
    assert said(records) == [(1, 1, None)]  # at once: a loop that stops on a NaN loss may die right here
    backward(watch, 2, 2, INF)
    backward(watch, 3, 3, FINE)
    assert said(records) == [(1, 1, None), (1, 1, 3)]
    (first, _) = [r for r in records("warning")]
    assert (
        "NaN or Inf at step 1" in first["message"] and "rank 2" not in first["message"]
    )  # the collector adds it


def test_a_run_that_begins_names_the_parameters_and_buffers_already_nan_as_its_forward_ran(
    records: Records,
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    watch = LossWatch(rank=2, weights=module_weights(model))
    backward(watch, 0, 0, NAN)  # a NaN batch: the weights are finite, and no field says otherwise
    backward(watch, 1, 1, FINE)
    with torch.no_grad():
        model[0].weight[1, 2] = float("nan")
        model[1].running_var.fill_(float("inf"))
    backward(watch, 2, 2, NAN)
    backward(watch, 3, 3, NAN)  # the same run: looked at once
    began = [r for r in records("warning") if r.get("finite_again_step") is None]
    assert [r["step"] for r in began] == [0, 2]
    assert "nonfinite_weights" not in began[0]
    assert began[1]["nonfinite_weights"] == ["0.weight", "1.running_var"]
    assert began[1]["nonfinite_weights_count"] == 2
    assert "2 of its parameters and buffers were NaN or Inf already" in began[1]["message"]


def test_weights_that_cannot_be_read_leave_the_warning_without_them(records: Records) -> None:
    def broken() -> Iterator[tuple[str, torch.Tensor]]:
        raise RuntimeError("a parameter on a device that went away")

    watch = LossWatch(rank=2, weights=broken)
    backward(watch, 0, 0, NAN)
    (began,) = records("warning")
    assert began["step"] == 0 and "nonfinite_weights" not in began


def test_one_non_finite_output_of_several_makes_its_step_non_finite_whatever_the_order(
    records: Records,
) -> None:
    watch = LossWatch(rank=2)
    backward(watch, 4, 2, NAN)
    # Step 5: the first output's gradient is finite, the second's is not: the run goes on.
    backward(watch, 5, 3, FINE, (None, INF))
    assert said(records) == [(4, 2, None)]
    backward(watch, 6, 4, FINE, FINE)
    assert said(records) == [(4, 2, None), (4, 2, 6)]


def test_a_tuple_of_gradients_with_none_and_integer_entries_is_checked_on_its_floating_ones(
    records: Records,
) -> None:
    watch = LossWatch(rank=2)
    backward(watch, 0, 0, (None, torch.ones(2, dtype=torch.int64), NAN))
    assert said(records) == [(0, 0, None)]


def test_half_precision_gradients_whose_sum_overflows_float16_are_finite(records: Records) -> None:
    watch = LossWatch(rank=2)
    big = torch.full((64,), 60000.0, dtype=torch.float16)  # finite; their sum is beyond float16's range
    backward(watch, 0, 0, big, big.to(torch.bfloat16))
    assert said(records) == []
    backward(watch, 1, 1, torch.tensor([float("inf")], dtype=torch.float16))
    assert said(records) == [(1, 1, None)]


def test_only_the_first_runs_are_said_and_each_said_run_is_ended(records: Records) -> None:
    watch = LossWatch(rank=2)
    for run in range(MAX_RUNS + 3):
        backward(watch, 2 * run, run, NAN)
        backward(watch, 2 * run + 1, run + 1, FINE)
    got = said(records)
    assert len(got) == 2 * MAX_RUNS
    assert got[-2:] == [
        (2 * (MAX_RUNS - 1), MAX_RUNS - 1, None),
        (2 * (MAX_RUNS - 1), MAX_RUNS - 1, 2 * MAX_RUNS - 1),
    ]


def test_a_broken_gradient_object_never_raises_into_training(records: Records) -> None:
    class Broken(torch.Tensor):
        def sum(self, *args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("boom")

    watch = LossWatch(rank=2)
    backward(watch, 0, 0, torch.ones(3).as_subclass(Broken))
    assert said(records) == []
