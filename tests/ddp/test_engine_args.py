"""torch keyword arguments the engine accepts, and the ones it refuses with a way out."""

from __future__ import annotations

import pytest
from torch import nn

from ddpscope.ddp.engine import _check_unsupported


def test_torch_arguments_left_at_harmless_values_are_accepted() -> None:
    _check_unsupported(
        {"device_ids": None, "output_device": None, "dim": 0, "static_graph": False, "init_sync": True},
        nn.Linear(2, 2),
    )


def test_device_ids_naming_the_device_the_module_already_lives_on_is_accepted() -> None:
    _check_unsupported({"device_ids": ["cpu"], "output_device": "cpu"}, nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("key", "value", "remedy"),
    [
        ("static_graph", True, "find_unused_parameters=True"),
        ("device_ids", ["cuda:1"], "move the module to its device"),
        ("mixed_precision", object(), "module.to(dtype)"),
        ("init_sync", False, "always broadcast from rank 0"),
    ],
)
def test_unsupported_values_raise_value_error_saying_what_to_do(key: str, value: object, remedy: str) -> None:
    with pytest.raises(ValueError, match=key) as info:
        _check_unsupported({key: value}, nn.Linear(2, 2))
    assert remedy in str(info.value)
    assert "instrument()" in str(info.value)


def test_an_unknown_keyword_is_a_type_error_like_any_python_call() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'bucket_size'"):
        _check_unsupported({"bucket_size": 3}, nn.Linear(2, 2))


def test_a_sparse_embedding_is_refused_at_wrapping_naming_it_and_the_way_out() -> None:
    from ddpscope.ddp import DistributedDataParallel

    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    # Before any process group is needed: it once trained until its first backward and died there in an
    # internal assertion of torch's ("self.is_sparse() INTERNAL ASSERT FAILED").
    with pytest.raises(
        ValueError, match=r"sparse gradients \(embeddings with sparse=True: \['0'\]\)"
    ) as info:
        DistributedDataParallel(model)
    assert "sparse=False" in str(info.value) and "instrument()" in str(info.value)


def test_a_lazy_module_not_run_yet_is_refused_at_wrapping_naming_its_parameters_and_the_way_out() -> None:
    from ddpscope.ddp import DistributedDataParallel

    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    # Before any process group is needed: it once died in the layout check on torch's "Can't access the
    # shape of an uninitialized parameter", which blames load_state_dict.
    with pytest.raises(ValueError, match=r"not created yet \(0.weight, 0.bias\)") as info:
        DistributedDataParallel(model)
    assert "Run one forward" in str(info.value)
