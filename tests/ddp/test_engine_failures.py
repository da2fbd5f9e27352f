"""Wrong setups fail loudly and on every rank, and nobody hangs."""

from __future__ import annotations

from typing import Any

import pytest

from tests.ddp.engine_jobs import run_job
from tests.support.eval_mode import FORGETS_AT

pytestmark = pytest.mark.slow


def test_a_different_parameter_on_one_rank_raises_value_error_on_every_rank_naming_it(tmp_path) -> None:
    ranks = run_job("failures.py", 3, ["mismatch"], tmp_path, timeout_s=90)
    for rank in ranks:
        assert rank["error"] == "ValueError"
        assert "Ranks [1] differ from rank 0" in rank["message"]
        assert "rank 0 has parameter 1.weight float32[8, 8]" in rank["message"]
        assert "rank 1 has parameter 1.weight float32[16, 8]" in rank["message"]


def test_a_different_bucket_cap_on_one_rank_raises_value_error_on_every_rank_before_any_bucket_is_reduced(
    tmp_path,
) -> None:
    # Different caps give different buckets: gloo would abort on the first all-reduce of different sizes.
    ranks = run_job("failures.py", 2, ["bucket_cap"], tmp_path, timeout_s=90)
    for rank in ranks:
        assert rank["error"] == "ValueError"
        assert "Ranks [1] differ from rank 0 in bucket_cap_mb" in rank["message"]
        assert "rank 0 has bucket_cap_mb=1; rank 1 has bucket_cap_mb=25" in rank["message"]


def test_a_parameter_without_gradient_on_one_rank_fails_that_backward_on_every_rank(tmp_path) -> None:
    ranks = run_job("failures.py", 2, ["missing_grad"], tmp_path, timeout_s=90)
    for rank in ranks:
        message = rank["message"]
        assert rank["error"] == "UnreducedGradientsError"
        assert "['branch.weight', 'branch.bias']" in message
        assert "bucket(s) [0, 1]" in message
        assert "rank(s) [1]" in message
        assert "find_unused_parameters=True" in message
        # The collectives stayed aligned: the next, healthy step ran on both ranks.
        assert rank["after_ok"] is True
    assert "On this rank the missing parameters are" in ranks[1]["message"]
    assert "On this rank" not in ranks[0]["message"]
    # The failed step is still recorded, with the missing parameters named.
    failed = next(r for r in ranks[1]["records"] if r["kind"] == "step")
    assert failed["step"] == 0 and failed["unused_parameters"] == ["branch.weight", "branch.bias"]


@pytest.mark.parametrize(
    ("scenario", "evidence"),
    [
        # gloo pairs collectives by order: the metric's ones land in the status slots, where they once read
        # as every parameter missing on every rank (a false UnreducedGradientsError).
        ("misaligned", "the signature slot holds 0.0 where they send -2.0; this rank's own slot holds 1.0"),
        # Zeros looked like "no rank missed anything": the step wrote the metric's zeros plus its own
        # gradients as the average, silently.
        ("misaligned_zeros", "the signature slot holds -1.0 where they send -2.0"),
    ],
)
def test_a_bucket_all_reduce_paired_with_another_ranks_metric_of_the_same_size_is_caught_not_read_as_flags(
    tmp_path, scenario, evidence
) -> None:
    rank0, rank1 = run_job("failures.py", 2, [scenario], tmp_path, timeout_s=90)
    assert rank1["error"] is None
    assert rank0["error"] == "MisalignedCollectivesError", rank0
    assert evidence in rank0["message"], rank0["message"]
    assert "paired it with a different collective of the same size" in rank0["message"]
    (error,) = [r for r in rank0["records"] if r["kind"] == "rank_error"]
    assert error["error_type"] == "MisalignedCollectivesError"


def test_a_layer_frozen_after_wrapping_is_named_as_the_cause_of_its_missing_gradients(tmp_path) -> None:
    ranks = run_job("failures.py", 2, ["frozen_late"], tmp_path, timeout_s=90)
    for rank in ranks:
        assert (
            "Of them, ['branch.weight', 'branch.bias'] were frozen (requires_grad=False) after "
            "DistributedDataParallel was built" in rank["message"]
        )
        (error,) = [r for r in rank["records"] if r["kind"] == "rank_error"]
        assert error["phase"] == "allreduce"  # where it was raised: the end of backward


def test_the_forward_after_a_backward_cut_short_is_refused_and_reported_at_its_own_step(tmp_path) -> None:
    ranks = run_job("failures.py", 2, ["cut_short"], tmp_path, timeout_s=90)
    for rank in ranks:
        assert rank["caught"] == [1]
        assert "the backward of step 1 did not finish reducing gradients" in rank["message"]
        (error,) = [r for r in rank["records"] if r["kind"] == "rank_error"]
        # Raised by step 2's forward, not in the backward of step 1 that the loop walked away from.
        assert (error["step"], error["phase"]) == (2, "forward")
        assert error["fatal"] is False


def test_the_watchdog_sees_the_phase_and_the_parameters_each_pending_bucket_still_waits_for(tmp_path) -> None:
    ranks = run_job("failures.py", 2, ["progress"], tmp_path, timeout_s=90)
    for rank in ranks:
        seen = rank["mid_backward"]
        assert (seen["phase"], seen["step"]) == ("backward", 1)
        by_index = {b["index"]: b for b in seen["pending"]}
        assert sorted(by_index) == [b["index"] for b in rank["layout"]]
        missing = [name for b in seen["pending"] for name in b["missing"]]
        # The sampling hook runs after the engine's own: head.bias has just arrived.
        assert "head.bias" not in missing and "trunk.weight" in missing
        assert not any(b["launched"] for b in seen["pending"])
        assert rank["after"] == {"phase": "idle", "pending": []}


def test_with_ddpscope_disabled_the_wrapper_is_torchs_own_ddp(tmp_path) -> None:
    ranks = run_job("failures.py", 2, ["disabled"], tmp_path, timeout_s=90)
    for rank in ranks:
        assert rank["type"] == "torch.nn.parallel.distributed.DistributedDataParallel"
        assert [r for r in rank["records"] if r["kind"] in ("rank_start", "step")] == []


def test_a_training_step_through_model_module_is_called_out_once_on_that_rank_and_no_sync_is_not(
    tmp_path,
) -> None:
    ranks = run_job("failures.py", 2, ["bypass"], tmp_path, timeout_s=90)
    (warning,) = ranks[0]["warnings"]  # two such backwards, one warning
    assert warning.startswith("ddpscope: rank 0: the backward() at tests/ddp/jobs/failures.py:")
    assert (
        "gave 6 parameter(s)" in warning and "'head.bias', 'head.weight', 'branch.bias' and 3 more" in warning
    )
    assert "not all-reduced" in warning and "model.module(x)" in warning and "second backward()" in warning
    assert ranks[1]["warnings"] == []
    # The same, for the collector: one record naming the step, every parameter and the user's line.
    (record,) = [r for r in ranks[0]["records"] if r["kind"] == "warning"]
    assert record["code"] == "unsynced_gradients" and record["step"] == 0  # the last step before it
    assert sorted(record["parameters"]) == sorted(
        ["trunk.weight", "trunk.bias", "branch.weight", "branch.bias", "head.weight", "head.bias"]
    )
    assert record["call_site"].startswith("tests/ddp/jobs/failures.py:")
    assert not [r for r in ranks[1]["records"] if r["kind"] == "warning"]


def test_a_layer_unfrozen_after_wrapping_is_called_out_once_on_every_rank_as_its_copies_drift(
    tmp_path,
) -> None:
    ranks = run_job("failures.py", 2, ["thawed"], tmp_path, timeout_s=90)
    for rank in ranks:
        assert not rank["trunk_equal"]  # what torch's DDP does too: the thawed layer is never all-reduced
        (warning,) = rank["warnings"]
        assert "2 parameter(s) that were frozen (requires_grad=False) when the model was wrapped" in warning
        assert (
            "'trunk.weight', 'trunk.bias'" in warning
            and "Build the DistributedDataParallel model again" in warning
        )
        (record,) = [r for r in rank["records"] if r["kind"] == "warning"]
        assert record["code"] == "unsynced_gradients" and record["step"] == 2
        assert record["parameters"] == ["trunk.weight", "trunk.bias"]


def test_an_accumulation_that_never_synchronises_while_the_optimizer_steps_is_called_out_once_per_rank(
    tmp_path,
) -> None:
    ranks = run_job("failures.py", 2, ["never_synced"], tmp_path, timeout_s=90)
    for rank in ranks:
        # The 40 healthy micro-batches before say nothing: the parameters did not move between syncs.
        (record,) = [r for r in rank["records"] if r["kind"] == "warning"]
        assert record["code"] == "unsynced_gradients" and record["step"] > 41
        assert sorted(record["parameters"]) == sorted(
            ["trunk.weight", "trunk.bias", "branch.weight", "branch.bias", "head.weight", "head.bias"]
        )
        assert "training forwards ran without a synchronised backward" in record["message"]
        assert "outside no_sync()" in record["message"]


def test_a_model_wrapped_again_numbers_its_steps_on_and_models_wrapped_together_start_at_zero(
    tmp_path,
) -> None:
    ranks = run_job("failures.py", 2, ["rebuilt"], tmp_path, timeout_s=90)
    for rank in ranks:
        # Each wrapper numbered from 0 before: steps 0, 1, 2, 0, 1 mixed two models in the per-step views.
        assert [r["step"] for r in rank["records"] if r["kind"] == "step"] == [0, 1, 2, 3, 4]
        initial = [r["step"] for r in rank["records"] if r["kind"] == "layout" and r["reason"] == "initial"]
        assert initial == [0, 3]
        assert rank["gan_first_steps"] == [0, 0]


def digests_by_step(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in records if r["kind"] == "replica_digest"}


def test_a_rank_dependent_update_shows_in_the_replica_digests_and_a_layer_added_after_wrapping_is_called_out(
    tmp_path,
) -> None:
    ranks = run_job("failures.py", 2, ["replicas"], tmp_path, timeout_s=90)
    digests = [digests_by_step(rank["records"]) for rank in ranks]
    # Dense at the start, then every 64th step; the same steps on every rank.
    assert sorted(digests[0]) == sorted(digests[1]) == [0, 1, 2, 4, 8]
    order = next(r for r in ranks[0]["records"] if r["kind"] == "layout")["parameter_order"]
    assert order == ["trunk.weight", "trunk.bias", "branch.weight", "branch.bias", "head.weight", "head.bias"]
    for step in (0, 1, 2):  # identical copies: identical norms, bit for bit
        assert digests[0][step]["norms"] == digests[1][step]["norms"]
        assert (digests[0][step]["parameters"], digests[0][step]["group"]) == (6, 1)
    for step in (4, 8):  # rank 0's learning rate halved after step 2: every parameter differs
        assert all(a != b for a, b in zip(digests[0][step]["norms"], digests[1][step]["norms"], strict=True))
    for rank in ranks:
        (warning,) = [r for r in rank["records"] if r["kind"] == "warning"]
        assert warning["step"] == 8 and warning["parameters"] == ["extra.weight", "extra.bias"]
        assert "added to the module after it was wrapped" in warning["message"]


@pytest.mark.parametrize(
    ("mode", "said"),
    [
        ("unused", "although the forward's output does not reach it"),
        ("twice", "ran twice inside reentrant activation checkpointing"),
    ],
)
def test_reentrant_activation_checkpointing_is_named_with_the_way_out(mode: str, said: str, tmp_path) -> None:
    # Before, both read "received its gradient twice ...; run one backward per forward": a false cause.
    from pathlib import Path

    from tests.support.procs import assert_all_ok, run_ranks

    script = Path(__file__).parent / "jobs" / "reentrant.py"
    # No collector: the records wait in a spool of the test's own, its shipper gives up after 1 s.
    env = {
        "DDPSCOPE_URL": "http://127.0.0.1:9",
        "DDPSCOPE_SPOOL_DIR": str(tmp_path),
        "DDPSCOPE_SHIPPER_LINGER_S": "1",
    }
    (result,) = run_ranks(script, 1, args=[mode], env=env, timeout_s=60)
    assert_all_ok([result])
    assert said in result.stdout and "use_reentrant=False" in result.stdout, result.stdout


def test_training_steps_after_a_model_eval_on_one_rank_are_called_out_on_that_rank_once(tmp_path) -> None:
    ranks = run_job("failures.py", 2, ["eval_mode"], tmp_path, timeout_s=90)
    for rank in (0, 1):
        records = [
            r for r in ranks[rank]["records"] if r["kind"] == "warning" and r["code"] == "trains_in_eval_mode"
        ]
        if rank == 1:
            assert records == [] and ranks[1]["warnings"] == []
            continue
        (record,) = records  # not the validation at step 1, which went back to train mode
        # Step numbers count forwards with gradients on: the validation at VALIDATES_AT was one.
        assert record["step"] == FORGETS_AT + 1, record
        assert (
            "model.eval()" in record["message"] and "call model.train() before training" in record["message"]
        )
        (warning,) = ranks[0]["warnings"]
        assert "eval mode" in warning
