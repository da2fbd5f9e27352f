"""Bucket assignment and buffers, checked against torch's own C++ assignment."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpscope.ddp.buckets import (
    FIRST_BUCKET_BYTES,
    LEND_MAX_CPU_BUFFER_BYTES,
    LEND_MIN_BYTES,
    MIB,
    ParamSpec,
    assign_buckets,
    build_buckets,
    size_limits,
)

DTYPES = (torch.float32, torch.float64, torch.float16)

tensor_lists = st.lists(
    st.tuples(st.integers(1, 3000), st.sampled_from(DTYPES)), min_size=1, max_size=25
).map(lambda specs: [torch.zeros(n, dtype=d) for n, d in specs])
limit_lists = st.sampled_from([[1024], [512, 4096], [64, 256, 100_000], [10**9]])


def specs_of(tensors: list[torch.Tensor]) -> list[ParamSpec]:
    return [ParamSpec.of(f"p{i}", t) for i, t in enumerate(tensors)]


@settings(max_examples=200, deadline=None)
@given(tensor_lists, limit_lists)
def test_initial_assignment_is_torch_assignment_reversed(
    tensors: list[torch.Tensor], limits: list[int]
) -> None:
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
    assert assign_buckets(specs_of(tensors), limits) == list(reversed(theirs))


@settings(max_examples=200, deadline=None)
@given(tensor_lists, limit_lists, st.randoms(use_true_random=False))
def test_rebuilt_assignment_matches_torch_for_an_observed_ready_order(
    tensors: list[torch.Tensor], limits: list[int], rnd
) -> None:
    order = list(range(len(tensors)))
    rnd.shuffle(order)
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [tensors[i] for i in order], limits, [False] * len(order), order
    )
    ours = assign_buckets(specs_of(tensors), limits, order)
    if len({t.dtype for t in tensors}) == 1:
        assert ours == theirs
    else:
        # The same buckets, in torch's order within each dtype; torch interleaves the dtypes' last
        # buckets as an unordered_map iterates, ddpscope as they become ready (the next test).
        assert sorted(ours) == sorted(theirs)
        for dtype in DTYPES:
            assert [b for b in ours if tensors[b[0]].dtype == dtype] == [
                b for b in theirs if tensors[b[0]].dtype == dtype
            ]


@settings(max_examples=200, deadline=None)
@given(tensor_lists, limit_lists, st.randoms(use_true_random=False))
def test_rebuilt_buckets_are_in_the_order_they_become_ready(
    tensors: list[torch.Tensor], limits: list[int], rnd
) -> None:
    order = list(range(len(tensors)))
    rnd.shuffle(order)
    ready_at = {index: pos for pos, index in enumerate(order)}
    buckets = assign_buckets(specs_of(tensors), limits, order)
    last_gradient = [max(ready_at[i] for i in b) for b in buckets]
    assert last_gradient == sorted(last_gradient)


def _torch_rebuild(tensors: list[torch.Tensor], order: list[int]) -> list[list[int]]:
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [tensors[i] for i in order], [FIRST_BUCKET_BYTES], [False] * len(order), order
    )
    return theirs


def test_with_fp32_layers_around_bf16_ones_the_rebuild_puts_the_bf16_bucket_first_as_torch_does() -> None:
    # The red team's model: fp32 input layer and head, bf16 in between. Gradients arrive head first and
    # input layer last, so the bf16 bucket is complete before the fp32 one.
    fp32, bf16 = torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)
    tensors = [fp32, fp32, bf16, bf16, bf16, bf16, fp32, fp32]
    order = list(reversed(range(len(tensors))))
    ours = assign_buckets(specs_of(tensors), [FIRST_BUCKET_BYTES], order)
    assert ours == [[5, 4, 3, 2], [7, 6, 1, 0]] == _torch_rebuild(tensors, order)


def test_a_rebuild_puts_a_bf16_heads_bucket_first_as_it_becomes_ready_where_torch_puts_it_last() -> None:
    fp32, bf16 = torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)
    tensors = [fp32, fp32, bf16, bf16]
    order = [3, 2, 1, 0]
    assert assign_buckets(specs_of(tensors), [FIRST_BUCKET_BYTES], order) == [[3, 2], [1, 0]]
    # torch 2.13 puts the fp32 bucket first: its first gradient arrives last, and all of bucket 1's
    # arrive before it (bucket 1 then waits for bucket 0 every step).
    assert _torch_rebuild(tensors, order) == [[1, 0], [3, 2]]


def test_default_cap_has_a_small_first_bucket_and_an_explicit_cap_does_not() -> None:
    assert size_limits(None) == [FIRST_BUCKET_BYTES, 25 * MIB]
    assert size_limits(25) == [25 * MIB]
    assert size_limits(0.5) == [MIB // 2]


def test_each_dtype_gets_its_own_buckets() -> None:
    tensors = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(10)]
    buckets = assign_buckets(specs_of(tensors), [10**9])
    assert sorted(buckets) == [[0, 2], [1]]


def test_bucket_views_alias_one_flat_buffer_in_bucket_order() -> None:
    params = [torch.ones(2, 3), torch.ones(4), torch.ones(5)]
    names = ["a", "b", "c"]
    (bucket,) = build_buckets([[2, 0]], params, names)
    assert bucket.names == ["c", "a"]
    assert bucket.nbytes == (5 + 6) * 4
    assert [v.shape for v in bucket.views] == [torch.Size([5]), torch.Size([2, 3])]
    bucket.views[1].fill_(7.0)
    assert bucket.buffer[5:].tolist() == [7.0] * 6
    assert bucket.status is None


def test_only_the_last_bucket_carries_status_slots() -> None:
    params = [torch.ones(3), torch.ones(4)]
    first, last = build_buckets([[1], [0]], params, ["a", "b"], status_slots=5)
    assert first.status is None and first.buffer.numel() == 4
    assert last.status is not None and last.status.numel() == 5 and last.buffer.numel() == 8
    assert last.to_wire() == {
        "index": 1,
        "bytes": 12,
        "dtype": "float32",
        "device": "cpu",
        "parameters": ["a"],
    }


def test_only_large_parameters_in_buckets_mostly_made_of_them_are_lent() -> None:
    big, small = LEND_MIN_BYTES, 16  # float32 elements: a large parameter is 4 x LEND_MIN_BYTES
    params = [torch.zeros(n) for n in (big, small, big, *(small,) * 12)]
    names = [f"p{i}" for i in range(len(params))]
    # Bucket 0: two large and one small parameter, lent where large. Bucket 1: small ones only, and
    # bucket 2: one large among 12 small (renewing the buffer would cost more than the copy saved).
    lent_big, small_only, diluted = build_buckets(
        [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9, 10], [0, *range(3, 15)]], params, names
    )
    assert lent_big.lendable == [0, 2]
    assert small_only.lendable == [] and diluted.lendable == []


def test_a_cpu_buffer_glibc_would_map_afresh_each_step_is_never_lent() -> None:
    near = torch.zeros(LEND_MAX_CPU_BUFFER_BYTES // 4 - 1)
    over = torch.zeros(LEND_MAX_CPU_BUFFER_BYTES // 4)
    assert build_buckets([[0]], [near], ["w"])[0].lendable == [0]
    assert build_buckets([[0]], [over], ["w"])[0].lendable == []


def test_a_lent_gradient_still_held_keeps_its_memory_and_the_bucket_gets_new_memory() -> None:
    params = [torch.zeros(LEND_MIN_BYTES // 4), torch.zeros(LEND_MIN_BYTES // 4)]
    (bucket,) = build_buckets([[0, 1]], params, ["a", "b"])
    bucket.views[0].fill_(1.0)
    lent = bucket.lend(0)
    assert lent._base is None and lent.shape == params[0].shape and lent.stride() == params[0].stride()
    bucket.reclaim()
    bucket.views[0].fill_(2.0)
    assert torch.equal(lent, torch.ones_like(lent))
    assert lent.detach_() is lent  # a view would refuse this


def test_a_lent_gradient_held_only_through_a_view_still_keeps_its_memory() -> None:
    params = [torch.zeros(LEND_MIN_BYTES // 4), torch.zeros(LEND_MIN_BYTES // 4)]
    (bucket,) = build_buckets([[0, 1]], params, ["a", "b"])
    bucket.views[1].fill_(1.0)
    flat = bucket.lend(1).view(-1)[:3]  # the lent tensor itself is gone, a view of it is not
    bucket.reclaim()
    bucket.views[1].fill_(2.0)
    assert flat.tolist() == [1.0, 1.0, 1.0]


def test_memory_lent_to_gradients_that_were_dropped_is_taken_back_without_allocating() -> None:
    params = [torch.zeros(LEND_MIN_BYTES // 4), torch.zeros(LEND_MIN_BYTES // 4)]
    (bucket,) = build_buckets([[0, 1]], params, ["a", "b"])
    before = bucket.buffer.data_ptr()
    grads = [bucket.lend(0), bucket.lend(1)]
    del grads  # what zero_grad(set_to_none=True) does before the next forward
    bucket.reclaim()
    assert bucket.buffer.data_ptr() == before
    bucket.reclaim()  # nothing lent since: nothing to do
    assert bucket.buffer.data_ptr() == before


def test_a_dropped_loan_is_lent_again_as_the_same_tensor() -> None:
    params = [torch.zeros(LEND_MIN_BYTES // 4)]
    (bucket,) = build_buckets([[0]], params, ["w"])
    first = bucket.lend(0)
    params[0].grad = first
    first_id = id(first)
    del first
    params[0].grad = None  # zero_grad(set_to_none=True)
    bucket.reclaim()
    again = bucket.lend(0)
    assert id(again) == first_id and again.data_ptr() == bucket.views[0].data_ptr()


def test_a_loan_still_attached_as_a_gradient_keeps_its_memory() -> None:
    params = [torch.zeros(LEND_MIN_BYTES // 4)]
    (bucket,) = build_buckets([[0]], params, ["w"])
    bucket.views[0].fill_(1.0)
    params[0].grad = bucket.lend(0)  # only the .grad slot holds it besides the bucket (no Python name)
    bucket.reclaim()
    bucket.views[0].fill_(2.0)
    assert params[0].grad is not None and params[0].grad.eq(1.0).all()
    assert bucket.lend(0).data_ptr() != params[0].grad.data_ptr()


def test_a_loan_an_autograd_graph_saved_keeps_its_memory() -> None:
    params = [torch.zeros(LEND_MIN_BYTES // 4)]
    (bucket,) = build_buckets([[0]], params, ["w"])
    bucket.views[0].fill_(1.0)
    x = torch.ones_like(params[0], requires_grad=True)
    y = (bucket.lend(0) * x).sum()  # the graph holds the loan in C++ only
    bucket.reclaim()
    bucket.views[0].fill_(2.0)
    y.backward()
    assert x.grad is not None and x.grad.eq(1.0).all()
