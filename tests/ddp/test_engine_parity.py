"""Same results as torch: real gloo jobs train one model with torch's DDP and one with ddpscope's,
from the same seeds and inputs, and compare every parameter and buffer afterwards."""

from __future__ import annotations

from typing import Any

import pytest

from tests.ddp.engine_jobs import run_job

pytestmark = pytest.mark.slow

SCENARIOS = [
    "mlp", "batchnorm", "unused", "no_sync", "frozen", "dtypes", "mixed_dtypes", "bucket_view",
    "small_buckets", "wide", "wide_keep_grads", "wide_no_sync", "join", "join_divide", "join_early",
    "join_unused", "join_no_sync", "unused_no_sync", "dataclass_out", "batchnorm_no_sync", "batchnorm_eval",
    "gradient_penalty", "gradient_penalty_no_sync", "gradient_penalty_unused",
]  # fmt: skip
FOUR_RANK_SCENARIOS = ["mlp", "batchnorm", "unused", "no_sync", "dtypes", "join", "join_divide"]
STEPS = "4"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_job("compare.py", 2, [",".join(SCENARIOS), STEPS], tmp_path_factory.mktemp("parity2"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_job(
        "compare.py", 4, [",".join(FOUR_RANK_SCENARIOS), STEPS], tmp_path_factory.mktemp("parity4")
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_ranks_end_bit_identical_to_torch_ddp(two_ranks: list[dict[str, Any]], scenario: str) -> None:
    for rank in two_ranks:
        result = rank[scenario]
        worst = {k: v for k, v in result["diffs"].items() if v != 0.0}
        assert result["exact"], f"rank {result['rank']}: differs from torch in {worst}"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_ranks_leave_every_grad_equal_to_torchs_with_the_same_strides(
    two_ranks: list[dict[str, Any]], scenario: str
) -> None:
    for rank in two_ranks:
        grads = rank[scenario]["grads"]
        assert all(g["equal"] for g in grads.values()), f"rank {rank[scenario]['rank']}: {grads}"


@pytest.mark.parametrize("scenario", ["wide", "wide_keep_grads", "wide_no_sync"])
def test_lent_gradients_behave_like_torchs_copied_ones(
    two_ranks: list[dict[str, Any]], scenario: str
) -> None:
    for rank in two_ranks:
        shape = rank[scenario]["grad_shape"]
        ours, theirs = shape["ours"], shape["theirs"]
        # The reduced bucket memory was lent (both weights' grads live in it), not copied back, unless
        # the .grad existed before the synced backward (accumulated under no_sync): that one is copied
        # into, keeping its identity as torch does ...
        assert ours["weights_share_storage"] == (scenario != "wide_no_sync")
        assert not theirs["weights_share_storage"]
        # ... and nothing a user can see differs: not a view, detach_() works, a .grad kept across steps
        # keeps its value (set_to_none) or the same .grad is updated in place step after step (kept).
        for key in ("is_view", "detach_ok", "held_grads_intact", "identities"):
            assert ours[key] == theirs[key], (key, ours, theirs)
    expected_identities = 1 if scenario == "wide_keep_grads" else int(STEPS)
    assert two_ranks[0][scenario]["grad_shape"]["ours"]["identities"] == expected_identities


@pytest.mark.parametrize("scenario", FOUR_RANK_SCENARIOS)
def test_four_ranks_match_torch_ddp(four_ranks: list[dict[str, Any]], scenario: str) -> None:
    # With 4 ranks gloo's ring sums each element in an order that depends on its offset in the
    # buffer, and torch runs its first step with a single bucket: allow float rounding, no more.
    for rank in four_ranks:
        result = rank[scenario]
        worst = max(result["diffs"].values())
        assert worst <= 1e-6, f"rank {result['rank']}: max difference {worst} in {result['diffs']}"


def test_a_parameter_unused_on_every_rank_keeps_its_grad_none(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        grads = rank["unused"]["grads"]
        assert grads["never.weight"]["ours_none"] and grads["never.weight"]["theirs_none"]
        # Used on rank 0 only: reduced everywhere, so every rank has a gradient.
        assert not grads["branch.weight"]["ours_none"] and not grads["branch.weight"]["theirs_none"]


def test_frozen_parameters_are_left_out_of_the_buckets(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        result = rank["frozen"]
        bucketed = [name for b in result["layout"] for name in b["parameters"]]
        assert "layers.2.weight" not in bucketed and "layers.0.weight" in bucketed
        assert result["grads"]["layers.2.weight"]["ours_none"] is True


def test_each_dtype_gets_its_own_bucket(two_ranks: list[dict[str, Any]]) -> None:
    layout = two_ranks[0]["dtypes"]["layout"]
    assert sorted(b["dtype"] for b in layout) == ["float32", "float64"]
    for b in layout:
        prefix = "b." if b["dtype"] == "float64" else "a."
        assert all(name.startswith(prefix) for name in b["parameters"])


def test_with_mixed_dtypes_the_rebuilt_buckets_are_torchs_and_become_ready_in_index_order(
    two_ranks: list[dict[str, Any]],
) -> None:
    from ddpscope.server.rows import step_rows_from_wire

    for rank in two_ranks:
        result = rank["mixed_dtypes"]
        # bf16 first: its bucket is complete before the fp32 one, whose last gradient is the input layer's.
        assert [b["dtype"] for b in result["layout"]] == ["bfloat16", "float32"]
        assert [b["parameters"] for b in result["layout"]] == result["torch_layout"]
        rebuilt = [r for r in step_rows_from_wire(result["records"]) if r.step >= 1]
        assert rebuilt and all(r.ready_order == [0, 1] for r in rebuilt)


def test_the_collector_finds_the_engines_mixed_dtype_buckets_in_order_and_advises_nothing(
    two_ranks: list[dict[str, Any]],
) -> None:
    from ddpscope.server.analysis.buckets import bucket_stats
    from ddpscope.server.rows import step_rows_from_wire

    records = [r for rank in two_ranks for r in rank["mixed_dtypes"]["records"]]
    stats = bucket_stats([r for r in records if r["kind"] == "layout"], step_rows_from_wire(records))
    assert [(b.dtype, b.steps, b.out_of_order, b.advice) for b in stats] == [
        ("bfloat16", 2 * (int(STEPS) - 1), 0, None),
        ("float32", 2 * (int(STEPS) - 1), 0, None),
    ]


@pytest.mark.parametrize("scenario", ["join", "join_early", "join_unused", "join_no_sync"])
def test_uneven_inputs_under_join_leave_the_collector_nothing_to_report(
    two_ranks: list[dict[str, Any]], scenario: str
) -> None:
    from ddpscope.server.analysis.incidents import diagnose
    from ddpscope.server.analysis.snapshot import snapshot_from_records

    records = [r for rank in two_ranks for r in rank[scenario]["records"]]
    # The rank that joined shadowed its peer's steps: the same sequence numbers, from other lines.
    joined = [r for r in records if r["kind"] == "collective" and r["source"] == "join"]
    assert {r["rank"] for r in joined} == {0, 1} and any(r["op"] == "all_reduce" for r in joined)
    incidents = diagnose(
        snapshot_from_records("compare", records), max(r["time_ns"] for r in records) / 1e9 + 1
    )
    # Branchy's branch is used on rank 0 only, by design: that incident is true, and the only one.
    wrong = [i for i in incidents if not (scenario == "join_unused" and i.kind == "unused_parameters")]
    assert wrong == [], [i.message for i in wrong]
