"""Unused-parameter incidents: one per skipped code path, with names, buckets and steps, also when
torch reports only parameter indices, one iteration late."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from tests.server.test_incidents import T0, JobRecords, kinds, only, started

ORDER = ["enc.weight", "head.weight", "head.bias"]
TORCH_ERROR = (
    "Expected to have finished reduction in the prior iteration before starting a new one. This error "
    "indicates that your module has parameters that were not used in producing loss. ...\n"
    "Parameter indices which did not receive grad for rank 1: 1 2\n"
    " In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL"
)


def with_parameter_order(job: JobRecords) -> None:
    buckets = [
        {"index": 0, "bytes": 40, "dtype": "float32", "device": "cpu", "parameters": ["head.bias"]},
        {
            "index": 1,
            "bytes": 4096,
            "dtype": "float32",
            "device": "cpu",
            "parameters": ["head.weight", "enc.weight"],
        },
    ]
    for r in range(job.world):
        job.add("layout", r, T0 + 0.5, step=0, reason="initial", buckets=buckets, parameter_order=ORDER)


def test_torchs_parameter_indices_are_named_and_dated_to_the_step_that_skipped_them() -> None:
    job = started(2)
    with_parameter_order(job)
    end = job.train(6)
    job.step(1, end, 6, unused=["head.weight", "head.bias"], seqs=[13, 14])
    job.add("rank_error", 1, end + 0.2, step=7, phase="forward", error_type="RuntimeError", message=TORCH_ERROR,
            stack="Traceback", fatal=True)  # fmt: skip
    incidents = diagnose(job.snapshot(), end + 1)
    err = only(incidents, "rank_error")
    assert "(parameter indices 1, 2 are head.weight, head.bias)" in err.message
    assert err.parameters == ["head.weight", "head.bias"]
    unused = only(incidents, "unused_parameters")  # the step record and the error: one diagnosis
    assert set(unused.parameters) == {"head.weight", "head.bias"} and unused.culprit_ranks == [1]


def test_torchs_late_error_alone_is_dated_to_the_previous_step() -> None:
    job = started(2)
    with_parameter_order(job)
    end = job.train(3)
    job.add("rank_error", 1, end, step=3, phase="forward", error_type="RuntimeError", message=TORCH_ERROR,
            stack="Traceback", fatal=True)  # fmt: skip
    unused = only(diagnose(job.snapshot(), end + 1), "unused_parameters")
    assert unused.step == 2 and "in step 2 (torch noticed at the start of step 3)" in unused.message
    assert unused.parameters == ["head.weight", "head.bias"] and "buckets 0, 1" in unused.message


def test_torchs_error_for_parameters_frozen_after_wrapping_on_every_rank_is_one_diagnosis_naming_the_cause() -> (
    None
):
    job = started(2)
    with_parameter_order(job)
    end = job.train(3)
    note = "ddpscope: parameters ['head.weight', 'head.bias'] were frozen (requires_grad=False) after DDP..."
    for rank in (0, 1):  # torch raises on every rank, each naming only itself
        job.add("rank_error", rank, end + rank / 100, step=3, phase="forward", error_type="RuntimeError",
                message=TORCH_ERROR.replace("for rank 1", f"for rank {rank}"), stack=f"Traceback\n{note}",
                fatal=True)  # fmt: skip
    incidents = diagnose(job.snapshot(), end + 1)
    err = only(incidents, "rank_error")
    assert err.culprit_ranks == [0, 1] and "rank 1 reported the same error" in err.message
    unused = only(incidents, "unused_parameters")
    assert unused.culprit_ranks == [0, 1] and "on ranks 0, 1 in step 2" in unused.message
    assert (
        "frozen (requires_grad=False) after DistributedDataParallel was built: build it again"
        in unused.message
    )


def test_torchs_error_after_a_backward_cut_short_by_a_caught_exception_names_no_unused_parameters() -> None:
    # A hook raised halfway through step 2's backward and the loop caught it: torch lists the parameters
    # that got no gradient, and ddpscope's note on its error says they were not unused.
    job = started(2)
    with_parameter_order(job)
    end = job.train(3)
    note = "ddpscope: the backward of step 2 began on this rank and never finished (it raised: ...)"
    job.add("rank_error", 1, end, step=3, phase="forward", error_type="RuntimeError", message=TORCH_ERROR,
            stack=f"Traceback\n{note}", fatal=True)  # fmt: skip
    incidents = diagnose(job.snapshot(), end + 1)
    assert "unused_parameters" not in kinds(incidents), [i.message for i in incidents]
    err = only(incidents, "rank_error")
    assert err.culprit_ranks == [1] and not err.parameters
    assert "(the backward of step 2 began on this rank and never finished (it raised: ...))" in err.message


def test_one_skipped_module_spread_over_two_buckets_is_one_incident_with_its_steps() -> None:
    job = started(2)
    t = T0 + 1
    for s in range(10):
        for r in range(2):
            unused = ["head.weight", "head.bias"] if r == 1 and s >= 4 and s % 2 == 0 else []
            job.step(r, t, s, unused=unused, seqs=[2 * s + 1, 2 * s + 2])
        t += 0.1
    incidents = diagnose(job.snapshot(), t)
    assert kinds(incidents) == ["unused_parameters"]
    unused = incidents[0]
    assert set(unused.parameters) == {"head.weight", "head.bias"} and "(bucket 0)" in unused.message
    assert "in 3 steps from step 4 to step 8" in unused.message and unused.step == 4
