"""What ``instrument()``'s forward hooks tell the watchdog and the collector, as the engine's forward
does: a forward under ``torch.no_grad()`` is progress, and an exception leaving the forward is
reported at once (a training loop may catch it and go on one step behind its peers)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from ddpscope.ddp import instrument
from ddpscope.ddp.progress import PROGRESS
from tests.ddp.test_watchdog_engine_forward import Flaky
from tests.ddp.watchdog_support import Records, one_rank_job_records


@pytest.fixture
def records() -> Iterator[Records]:
    yield from one_rank_job_records()


def test_a_forward_under_no_grad_through_instrumented_torch_ddp_is_progress_for_the_watchdog(
    records: Records,
) -> None:
    model = instrument(DistributedDataParallel(Flaky()))
    model(torch.randn(3, 4)).sum().backward()
    before = PROGRESS.counter
    with torch.no_grad():
        model(torch.randn(3, 4))
    assert PROGRESS.counter > before
    model.__dict__["_ddpscope_instrumentation"].remove_hooks()


def test_an_exception_leaving_instrumented_torch_ddp_s_forward_is_reported_at_once_and_still_raised(
    records: Records,
) -> None:
    module = Flaky()
    model = instrument(DistributedDataParallel(module))
    model(torch.randn(3, 4)).sum().backward()
    module.fail = True
    with pytest.raises(ValueError, match="corrupt sample"):
        model(torch.randn(3, 4))
    (error,) = records("rank_error")
    assert (error["error_type"], error["message"], error["fatal"]) == ("ValueError", "corrupt sample", False)
    assert error["phase"] == "forward"
    # The loop caught it and goes on: the next batch trains, and nothing more is reported.
    module.fail = False
    model(torch.randn(3, 4)).sum().backward()
    assert len(records("rank_error")) == 1
    model.__dict__["_ddpscope_instrumentation"].remove_hooks()


def test_a_forward_called_while_the_script_handles_another_exception_reports_nothing(
    records: Records,
) -> None:
    model = instrument(DistributedDataParallel(Flaky()))
    try:
        raise KeyError("the script's own, already handled")
    except KeyError:
        model(torch.randn(3, 4)).sum().backward()
    assert records("rank_error") == []
    model.__dict__["_ddpscope_instrumentation"].remove_hooks()


def test_every_bucket_all_reduce_has_its_end_recorded_by_the_time_backward_returns(
    records: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = instrument(DistributedDataParallel(Flaky()))
    state = model.__dict__["_ddpscope_instrumentation"]
    # As if every completion callback still waited for the GIL on a gloo thread when the process exits
    # right after its last backward: the end of backward records the ends itself.
    monkeypatch.setattr(state, "_on_end", lambda *args: None)
    monkeypatch.setattr(type(state), "_poll", lambda self: None)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
    begun = {
        r["coll_seq"] for r in records("collective") if r["source"] == "engine" and r["op"] == "all_reduce"
    }
    ended = {r["coll_seq"]: r for r in records("collective_end")}
    assert begun and all(ended[seq]["ok"] for seq in begun), (begun, ended)
    state.remove_hooks()


def test_a_second_backward_through_the_same_outputs_is_no_second_step_record(records: Records) -> None:
    # Two losses backpropagated one after the other from one forward (retain_graph=True): torch's DDP
    # all-reduces in the first only; the second is said as unsynced gradients, not as the step again.
    model = instrument(DistributedDataParallel(Flaky()))
    for _ in range(2):
        out = model(torch.randn(3, 4))
        out.square().mean().backward(retain_graph=True)
        out.abs().mean().backward()
    assert [r["step"] for r in records("step")] == [0, 1]
    assert [w["code"] for w in records("warning")] == ["unsynced_gradients"]
    model.__dict__["_ddpscope_instrumentation"].remove_hooks()
