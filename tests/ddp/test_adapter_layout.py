"""The adapter's view of torch's buckets, without processes: the wire shape and layout learning."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpscope.agent.records import validate_record
from ddpscope.ddp.adapter import instrument
from ddpscope.ddp.adapter_layout import LayoutLearner, empty_layout


class FakeGradBucket:
    """What the learner reads from ``dist.GradBucket``: its index and its parameters."""

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self._index, self._params = index, params

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return self._params


def model_params() -> tuple[list[torch.Tensor], list[str]]:
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2).to(torch.float64))
    named = list(net.named_parameters())
    return [p for _, p in named], [n for n, _ in named]


def test_a_learned_layout_becomes_a_valid_layout_record_in_bucket_order() -> None:
    params, names = model_params()
    base = empty_layout(params, names)
    learner = LayoutLearner(params)
    learner.observe(FakeGradBucket(1, [params[0], params[1]]))
    learner.observe(FakeGradBucket(0, [params[3], params[2]]))
    layout = learner.result(base)
    assert layout is not None
    buckets = layout.wire()
    assert [b["parameters"] for b in buckets] == [["1.bias", "1.weight"], ["0.weight", "0.bias"]]
    assert [b["bytes"] for b in buckets] == [(2 + 16) * 8, (32 + 8) * 4] == layout.bucket_bytes
    assert [b["dtype"] for b in buckets] == ["float64", "float32"]
    record = {"kind": "layout", "job": "j", "rank": 0, "stream": "s", "seq": 0, "time_ns": 1}
    record.update(step=1, reason="rebuilt", buckets=buckets)
    assert validate_record(record) == "layout"


def test_an_incomplete_observation_is_not_taken_for_a_layout() -> None:
    params, names = model_params()
    base = empty_layout(params, names)
    learner = LayoutLearner(params)
    learner.observe(FakeGradBucket(1, params[:2]))  # bucket 0 never seen
    assert learner.result(base) is None
    learner.reset()
    learner.observe(FakeGradBucket(0, params[:3]))  # one parameter in no bucket
    assert learner.result(base) is None


def test_instrument_refuses_a_module_that_is_not_torch_ddp_and_points_to_the_engine() -> None:
    with pytest.raises(TypeError, match="ddpscope.ddp.DistributedDataParallel"):
        instrument(nn.Linear(2, 2))  # type: ignore[arg-type]
