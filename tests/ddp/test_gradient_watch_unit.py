"""``GradientWatch`` in one process: with ``DDPSCOPE_CHECK_GRADIENTS``, each gradient bucket of a synchronised
backward is checked before its all-reduce; a run of steps with non-finite gradients is said when it begins
(with the bucket and the parameters, nearest the output first) and when it ends. A step whose loss gradient
was already non-finite is the loss's doing and begins no run. The real 2-rank jobs are in
``tests/server/test_nonfinite_jobs.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ddpscope import agent
from ddpscope.agent.records import NONFINITE_GRADIENT
from ddpscope.ddp.nonfinite import MAX_NAMED, GradientWatch, LossWatch, gradient_check_enabled
from tests.ddp.watchdog_support import Records, in_memory_records

NAN = float("nan")


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=1)


class Model:
    """Two buckets of named gradients, as an engine lays them out (bucket 0 holds the last parameters)."""

    def __init__(self) -> None:
        self.grads = {i: torch.ones(3) for i in range(4)}
        self.buckets = [[3, 2], [1, 0]]

    def named(self, k: int) -> list[tuple[int, str, torch.Tensor | None]]:
        return [(i, f"layer{i}.weight", self.grads[i]) for i in self.buckets[k]]

    def flat(self, k: int) -> torch.Tensor:
        return torch.cat([self.grads[i] for i in self.buckets[k]])


def backward(
    watch: GradientWatch, losses: LossWatch, model: Model, step: int, loss_grad: torch.Tensor | None = None
) -> None:
    """One synchronised backward: the loss gradient, each bucket before its all-reduce, the end."""
    losses.check(torch.ones(2) if loss_grad is None else loss_grad, step, step)
    for k in range(len(model.buckets)):
        watch.bucket(step, step, k, model.flat(k), lambda k=k: model.named(k))  # type: ignore[misc]
    losses.backward_done()
    watch.backward_done()


def said(records: Records) -> list[dict[str, object]]:
    return [r for r in records("warning") if r["code"] == NONFINITE_GRADIENT]


def test_a_nan_made_inside_backward_names_its_bucket_and_parameters_nearest_the_output_first(
    records: Records,
) -> None:
    losses = LossWatch(rank=1)
    watch, model = GradientWatch(1, losses), Model()
    backward(watch, losses, model, 0)
    model.grads[1] = torch.tensor([1.0, NAN, 2.0])
    model.grads[0] = torch.tensor([float("inf"), 0.0, 0.0])
    backward(watch, losses, model, 1)
    (began,) = said(records)
    assert (began["step"], began["syncs"], began["bucket"]) == (1, 1, 1)
    assert began["parameters"] == ["layer1.weight", "layer0.weight"]
    assert "finite_again_step" not in began
    assert "while its loss was finite" in str(began["message"]) and "layer1.weight" in str(began["message"])
    model.grads[0] = model.grads[1] = torch.ones(3)
    backward(watch, losses, model, 2)
    ended = said(records)[1]
    assert (ended["step"], ended["syncs"], ended["finite_again_step"]) == (1, 1, 2)


def test_a_step_whose_loss_was_already_nan_begins_no_gradient_run(records: Records) -> None:
    losses = LossWatch(rank=1)
    watch, model = GradientWatch(1, losses), Model()
    model.grads = {i: torch.full((3,), NAN) for i in range(4)}  # what a NaN loss gives every gradient
    backward(watch, losses, model, 0, loss_grad=torch.tensor([NAN, 1.0]))
    backward(watch, losses, model, 1, loss_grad=torch.tensor([NAN, 1.0]))
    assert said(records) == []
    assert [r["code"] for r in records("warning")] == ["nonfinite_loss"]


def test_a_gradient_run_goes_on_through_the_nan_losses_it_caused_until_a_finite_step(
    records: Records,
) -> None:
    losses = LossWatch(rank=1)
    watch, model = GradientWatch(1, losses), Model()
    model.grads[3] = torch.tensor([NAN, 0.0, 0.0])
    backward(watch, losses, model, 0)  # backward made it, the loss was finite
    model.grads = {i: torch.full((3,), NAN) for i in range(4)}
    backward(watch, losses, model, 1, loss_grad=torch.tensor([NAN]))  # the parameters are NaN now
    assert [(r["step"], r.get("finite_again_step"), r["bucket"]) for r in said(records)] == [(0, None, 0)]
    model.grads = {i: torch.ones(3) for i in range(4)}
    backward(watch, losses, model, 2)
    assert [(r["step"], r.get("finite_again_step")) for r in said(records)] == [(0, None), (0, 2)]


def test_at_most_the_nearest_parameters_are_named_and_later_buckets_of_a_bad_step_are_not_read(
    records: Records,
) -> None:
    losses = LossWatch(rank=1)
    watch = GradientWatch(1, losses)
    n = MAX_NAMED + 3
    named = [(i, f"p{i}", torch.tensor([NAN])) for i in range(n)]
    asked: list[int] = []

    def names(k: int) -> list[tuple[int, str, torch.Tensor | None]]:
        asked.append(k)
        return list(named)

    losses.check(torch.ones(1), 0, 0)
    watch.bucket(0, 0, 0, torch.tensor([NAN]), lambda: names(0))
    watch.bucket(0, 0, 1, torch.tensor([NAN]), lambda: names(1))
    (began,) = said(records)
    assert began["parameters"] == [f"p{i}" for i in range(n - 1, n - 1 - MAX_NAMED, -1)]
    assert asked == [0]


def test_a_parameter_without_a_gradient_is_skipped_and_a_broken_one_never_raises(records: Records) -> None:
    losses = LossWatch(rank=1)
    watch = GradientWatch(1, losses)
    losses.check(torch.ones(1), 0, 0)
    watch.bucket(0, 0, 0, torch.tensor([NAN]), lambda: [(0, "a", None), (1, "b", torch.tensor([NAN]))])
    assert said(records)[0]["parameters"] == ["b"]

    def broken() -> list[tuple[int, str, torch.Tensor | None]]:
        raise RuntimeError("boom")

    watch.bucket(5, 5, 0, object(), broken)  # type: ignore[arg-type]
    watch.bucket(6, 6, 0, torch.tensor([NAN]), broken)  # raises inside: swallowed, training goes on


def test_the_check_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDPSCOPE_CHECK_GRADIENTS", raising=False)
    agent.configure(exporter=agent.InMemoryExporter(), rank=0, job="gradients-off")
    try:
        assert not gradient_check_enabled()
        agent.configure(exporter=agent.InMemoryExporter(), rank=0, job="gradients-on", check_gradients=True)
        assert gradient_check_enabled()
    finally:
        agent.shutdown()
    monkeypatch.setenv("DDPSCOPE_CHECK_GRADIENTS", "1")
    agent.configure(exporter=agent.InMemoryExporter(), rank=0, job="gradients-env")
    try:
        assert gradient_check_enabled()
    finally:
        agent.shutdown()
