"""The layout-mismatch diagnosis (the collective part runs in tests/ddp/test_engine_failures.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpscope.ddp.layout import describe, first_difference, mismatch_message


def test_describe_lists_names_dtypes_shapes_and_frozen_parameters_then_buffers() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    model[0].bias.requires_grad_(False)
    lines = describe(model.named_parameters(), model.named_buffers())
    assert lines[:2] == ["parameter 0.weight float32[2, 3]", "parameter 0.bias float32[2] (frozen)"]
    assert "buffer 1.num_batches_tracked int64[]" in lines


def test_the_first_difference_is_reported_with_every_ranks_entry() -> None:
    per_rank = [["a f32[2]", "b f32[3]"], ["a f32[2]", "b f32[3]"], ["a f32[2]", "b f32[4]"]]
    pos, entries = first_difference(per_rank)
    assert pos == 1
    assert entries == {0: "b f32[3]", 1: "b f32[3]", 2: "b f32[4]"}


def test_a_rank_with_fewer_parameters_is_reported_as_having_nothing_there() -> None:
    pos, entries = first_difference([["a", "b"], ["a"]])
    assert (pos, entries[1]) == (1, "nothing")


def test_the_mismatch_message_names_the_parameter_and_the_differing_ranks() -> None:
    message = mismatch_message(
        [["parameter w float32[2]"], ["parameter w float32[2]"], ["parameter w float64[2]"]]
    )
    assert "Ranks [2] differ from rank 0" in message
    assert "rank 2 has parameter w float64[2]" in message
    assert "rank 0 has parameter w float32[2]" in message


def test_a_constructor_argument_that_differs_is_named_before_any_parameter() -> None:
    model = nn.Linear(2, 2)
    lines = [describe(model.named_parameters(), settings={"bucket_cap_mb": cap}) for cap in (None, None, 4.0)]
    assert lines[0][0] == "setting bucket_cap_mb=None"
    message = mismatch_message(lines)
    assert "Ranks [2] differ from rank 0 in bucket_cap_mb" in message
    assert "rank 0 has bucket_cap_mb=None; rank 2 has bucket_cap_mb=4.0" in message


def test_the_position_of_a_differing_parameter_counts_parameters_only_not_the_settings_before_them() -> None:
    settings = {"bucket_cap_mb": 25, "find_unused_parameters": False, "broadcast_buffers": True}
    models = [
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
    ]
    models[1][1].double()
    lines = [describe(m.named_parameters(), settings=settings) for m in models]
    message = mismatch_message(lines)
    # module.parameters() of rank 1: 0.weight, 0.bias, 1.weight (float64): position 2.
    assert "at position 2 of the parameter list: rank 0 has parameter 1.weight float32[2, 2]" in message


def test_identical_lists_have_no_difference() -> None:
    with pytest.raises(ValueError):
        first_difference([["a"], ["a"]])


def test_describe_skips_buffers_that_are_none() -> None:
    assert describe([], [("running_mean", None), ("x", torch.zeros(1))]) == ["buffer x float32[1]"]


def test_the_same_parameters_in_another_order_are_named_as_a_rank_dependent_iteration_order() -> None:
    heads = ["alpha", "beta", "gamma"]
    lines = [
        describe(nn.ModuleDict({n: nn.Linear(2, 2) for n in order}).named_parameters())
        for order in (heads, heads[::-1])
    ]
    message = mismatch_message(lines)
    assert "Each rank has the same parameters, in another order" in message and "PYTHONHASHSEED" in message
    other = mismatch_message([["parameter w float32[2]"], ["parameter v float32[2]"]])
    assert "in another order" not in other
