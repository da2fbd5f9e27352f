"""What the engine's forward tells the watchdog and the collector: a forward under ``torch.no_grad()``
(an evaluation through the DDP wrapper) is progress, and an exception leaving the forward is reported
at once, since a training loop may catch it and go on one step behind its peers. And a bucket all-reduce
whose launch raises (a peer gone) still reaches the collector, as a collective that failed."""

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


class _RefusingGroup:
    """A process group whose all-reduce raises at launch, as gloo's does once a peer is gone."""

    def __init__(self, group: object) -> None:
        self._group = group

    def allreduce(self, *args: object) -> object:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:12345")

    def __getattr__(self, name: str) -> object:
        return getattr(self._group, name)


def test_a_bucket_all_reduce_whose_launch_raises_is_recorded_as_a_collective_that_failed(
    records: Records,
) -> None:
    model = DistributedDataParallel(Flaky())
    model(torch.randn(3, 4)).sum().backward()
    reducer = model._reducer
    reducer._pg_obj = _RefusingGroup(reducer._pg_obj)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        model(torch.randn(3, 4)).sum().backward()
    begins = {r["coll_seq"]: r for r in records("collective") if r["source"] == "engine" and r["step"] == 1}
    (failed,) = [r for r in records("collective_end") if not r["ok"]]
    assert failed["coll_seq"] in begins and "Connection closed by peer" in failed["error"]
