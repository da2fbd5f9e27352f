"""What the engine's forward tells the watchdog and the collector: a forward under ``torch.no_grad()``
(an evaluation through the DDP wrapper) is progress, and an exception leaving the forward is reported
at once, since a training loop may catch it and go on one step behind its peers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ddpscope.ddp import DistributedDataParallel
from ddpscope.ddp.progress import PROGRESS
from tests.ddp.watchdog_support import Records, one_rank_job_records


class Flaky(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 2)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("corrupt sample")
        return self.body(x)


@pytest.fixture
def records() -> Iterator[Records]:
    yield from one_rank_job_records()


def test_a_forward_under_no_grad_through_the_engine_is_progress_for_the_watchdog(records: Records) -> None:
    model = DistributedDataParallel(Flaky())
    model(torch.randn(3, 4)).sum().backward()
    before = PROGRESS.counter
    with torch.no_grad():
        model(torch.randn(3, 4))
    assert PROGRESS.counter > before


def test_an_exception_leaving_the_forward_is_reported_at_once_and_still_raised(records: Records) -> None:
    module = Flaky()
    model = DistributedDataParallel(module)
    model(torch.randn(3, 4)).sum().backward()
    module.fail = True
    with pytest.raises(ValueError, match="corrupt sample"):
        model(torch.randn(3, 4))
    (error,) = records("rank_error")
    assert (error["error_type"], error["message"], error["fatal"]) == ("ValueError", "corrupt sample", False)
    assert error["phase"] == "forward" and error["step"] == 1
    # The loop caught it and goes on: the next batch trains normally.
    module.fail = False
    model(torch.randn(3, 4)).sum().backward()


def test_two_engine_models_trained_in_turn_are_warned_about_once_and_one_after_the_other_not(
    records: Records, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddpscope.ddp import engine

    monkeypatch.setattr(engine, "_INTERLEAVING", engine._Interleaving())
    first, second = DistributedDataParallel(Flaky()), DistributedDataParallel(Flaky())

    def train(model: DistributedDataParallel) -> None:
        model(torch.randn(3, 4)).sum().backward()

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "two models" in r.getMessage()]

    for model in (first, first, second, second):  # one after the other, as a sweep does
        train(model)
    assert warnings() == []
    for model in (first, second, first, second):  # in turn, as a GAN does
        train(model)
    (said,) = warnings()
    assert "wrap the other in torch's DistributedDataParallel" in said
    for model in (first, second):
        model.remove_hooks()
