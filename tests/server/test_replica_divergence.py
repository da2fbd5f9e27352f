"""The ranks' copies of the model, compared through their replica digests: drift and NaNs are named with
the step, the parameters and, when a majority agrees, the odd ranks."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.status import job_status
from tests.server.test_incidents import T0, JobRecords, kinds, only, started

ORDER = ["enc.weight", "head.weight", "head.bias"]
HEALTHY = [12.5, 3.25, 0.5]


def with_order(job: JobRecords, order: list[str] = ORDER) -> None:
    bucket = {"index": 0, "bytes": 40, "dtype": "float32", "device": "cpu", "parameters": order}
    for r in range(job.world):
        job.add("layout", r, T0 + 0.5, step=0, reason="initial", buckets=[bucket], parameter_order=order)


def digest(job: JobRecords, rank: int, step: int, norms: list[float], *, model: int = 0, group: int = 1,
           parameters: int = 3, syncs: int | None = None, replicas: list[int] | None = None) -> None:  # fmt: skip
    """One forward per synced step unless ``syncs`` says otherwise."""
    extra = {} if replicas is None else {"replicas": replicas}
    job.add("replica_digest", rank, T0 + 1 + step / 10, step=step, syncs=step if syncs is None else syncs,
            model=model, parameters=parameters, group=group, norms=norms, **extra)  # fmt: skip


def digests(job: JobRecords, steps: dict[int, dict[int, list[float]]]) -> None:
    """``{step: {rank: norms}}``; a rank missing from a step sends nothing there."""
    for step, by_rank in steps.items():
        for rank, norms in by_rank.items():
            digest(job, rank, step, norms)


def test_identical_digests_raise_nothing() -> None:
    job = started(4)
    with_order(job)
    digests(job, {s: dict.fromkeys(range(4), HEALTHY) for s in (0, 1, 2, 4, 8)})
    assert diagnose(job.snapshot(), T0 + 10) == []


def test_differences_in_the_last_bits_are_the_same_copy() -> None:
    # Hosts whose CPUs sum in another order: a few ulps apart, not a divergence.
    job = started(2)
    digests(job, {s: {0: HEALTHY, 1: [12.500000001, 3.25, 0.5000000002]} for s in (0, 1, 2)})
    assert diagnose(job.snapshot(), T0 + 10) == []


def test_one_rank_of_four_that_drifts_is_named_with_the_parameters_and_the_steps_around_it() -> None:
    job = started(4)
    with_order(job)
    odd = [12.5, 3.3, 0.51]
    digests(job, {s: dict.fromkeys(range(4), HEALTHY) for s in (0, 1, 2, 4)})
    digests(job, {8: {0: HEALTHY, 1: HEALTHY, 2: [12.5, 3.26, 0.5], 3: HEALTHY}})
    digests(job, {16: {0: HEALTHY, 1: HEALTHY, 2: odd, 3: HEALTHY}})
    d = only(diagnose(job.snapshot(), T0 + 10), "replicas_diverged")
    assert d.step == 8 and d.culprit_ranks == [2] and d.rank == 2
    assert d.parameters == ["head.weight"]  # what differed first
    assert "differ at step 8 (they were identical at step 4" in d.message
    assert "rank 2 holds a different copy from ranks 0, 1, 3" in d.message
    assert "At step 16, 2 of 3 parameters differ" in d.message
    assert "if rank == 0:" in d.message and "load on all" in d.message
    assert job_status(job.snapshot(), T0 + 10) != "failed"  # training goes on: no status change


def test_two_ranks_that_disagree_are_both_named_without_a_culprit() -> None:
    job = started(2)
    with_order(job)
    digests(job, {0: {0: HEALTHY, 1: HEALTHY}, 1: {0: HEALTHY, 1: [12.5, 3.5, 0.5]}})
    d = only(diagnose(job.snapshot(), T0 + 10), "replicas_diverged")
    assert d.culprit_ranks == [] and "ranks 0, 1 each hold a different copy, and no majority" in d.message


def test_copies_that_differ_at_the_first_forward_point_at_a_load_after_wrapping() -> None:
    job = started(2)
    with_order(job)
    digests(job, {0: {0: HEALTHY, 1: [13.0, 3.25, 0.5]}})
    d = only(diagnose(job.snapshot(), T0 + 10), "replicas_diverged")
    assert d.step == 0 and d.parameters == ["enc.weight"]
    assert "at the first forward (step 0)" in d.message and "checkpoint loaded on some ranks" in d.message


def test_copies_that_agree_again_are_healthy_now() -> None:
    # The state broadcast at the end of torch's Join (or a reload on every rank) makes them one again.
    job = started(2)
    digests(
        job, {0: {0: HEALTHY, 1: HEALTHY}, 4: {0: HEALTHY, 1: [1.0, 1.0, 1.0]}, 8: {0: HEALTHY, 1: HEALTHY}}
    )
    assert diagnose(job.snapshot(), T0 + 10) == []


def test_ranks_are_compared_at_equal_sync_counts_whatever_their_step_numbers() -> None:
    # Rank 0 ran an extra forward with autograd on (an evaluation without no_grad) after its step 1: from
    # then on its step numbers are one ahead of rank 1's, but the syncs happen in lockstep.
    job = started(2)
    after = [12.0, 3.0, 0.5]
    for syncs, norms in ((0, HEALTHY), (1, HEALTHY), (2, after), (4, after)):
        digest(job, 0, syncs + (1 if syncs >= 2 else 0), norms, syncs=syncs)
        digest(job, 1, syncs, norms, syncs=syncs)
    assert diagnose(job.snapshot(), T0 + 10) == []
    digest(job, 0, 9, [1.0, 1.0, 1.0], syncs=8)
    digest(job, 1, 8, after, syncs=8)
    d = only(diagnose(job.snapshot(), T0 + 10), "replicas_diverged")
    assert d.step == 9 and "identical at step 5" in d.message  # rank 0's step numbers, the lowest rank


def test_a_step_only_one_rank_reported_is_not_compared() -> None:
    job = started(2)
    digests(job, {0: {0: HEALTHY, 1: HEALTHY}, 4: {1: [1.0, 1.0, 1.0]}})
    assert diagnose(job.snapshot(), T0 + 10) == []


def test_runs_of_parameters_name_every_parameter_of_the_run_that_differs() -> None:
    job = started(2)
    order = [f"layers.{i}.weight" for i in range(6)]
    with_order(job, order)
    for rank, norms in ((0, [1.0, 2.0, 3.0]), (1, [1.0, 2.5, 3.0])):
        digest(job, rank, 0, [1.0, 2.0, 3.0], group=2, parameters=6)
        digest(job, rank, 1, norms, group=2, parameters=6)
    d = only(diagnose(job.snapshot(), T0 + 10), "replicas_diverged")
    assert d.parameters == ["layers.2.weight", "layers.3.weight"]


def test_without_a_parameter_order_entries_are_named_by_index() -> None:
    job = started(2)  # its layouts carry no parameter_order
    digests(job, {0: {0: HEALTHY, 1: [12.5, 3.25, 0.7]}})
    assert only(diagnose(job.snapshot(), T0 + 10), "replicas_diverged").parameters == ["parameter #2"]


def test_each_wrapped_model_is_compared_with_itself() -> None:
    # A GAN: two models per rank, digested at the same steps; only the discriminator drifts.
    job = started(2)
    for rank in (0, 1):
        digest(job, rank, 4, HEALTHY, model=0)
        digest(job, rank, 4, [2.0, 1.0, 0.5] if rank == 0 else [2.0, 1.0, 0.9], model=1)
    assert kinds(diagnose(job.snapshot(), T0 + 10)) == ["replicas_diverged"]


def test_models_of_ddp_on_disjoint_subgroups_are_compared_within_each_group_only() -> None:
    # Ranks 0 and 1 train one replica group, ranks 2 and 3 another: their copies differ by design.
    job = started(4)
    with_order(job)
    other = [1.0, 2.0, 3.0]
    for step in (0, 1, 2, 4):
        for rank in range(4):
            pair = [0, 1] if rank < 2 else [2, 3]
            norms = HEALTHY if rank < 2 else other
            if rank == 3 and step == 4:
                norms = [1.0, 2.0, 3.5]  # this group's second copy drifts
            digest(job, rank, step, norms, replicas=pair)
    (diverged,) = diagnose(job.snapshot(), T0 + 10)
    assert diverged.kind == "replicas_diverged"
    assert "ranks 2, 3 each hold a different copy" in diverged.message and "'head.bias'" in diverged.message
    assert "rank 0" not in diverged.message and "rank 1" not in diverged.message


def test_parameters_gone_nan_on_every_rank_are_dated_without_blaming_a_rank() -> None:
    job = started(2)
    with_order(job)
    nan = [-1.0, -1.0, 0.5]
    digests(job, {0: {0: HEALTHY, 1: HEALTHY}, 4: {0: HEALTHY, 1: HEALTHY}, 8: {0: nan, 1: nan}})
    n = only(diagnose(job.snapshot(), T0 + 10), "nonfinite_parameters")
    assert n.step == 8 and n.parameters == ["enc.weight", "head.weight"] and n.culprit_ranks == []
    assert n.message.startswith("Parameters became NaN between steps 4 and 8")
    assert "spreads one rank's non-finite gradient" in n.message
    assert "so the origin can be any rank" in n.message


def test_parameters_gone_nan_after_a_ranks_nan_loss_point_at_the_incident_that_names_it() -> None:
    job = started(2)
    with_order(job)
    nan = [-1.0, -1.0, 0.5]
    digests(job, {0: {0: HEALTHY, 1: HEALTHY}, 4: {0: HEALTHY, 1: HEALTHY}, 8: {0: nan, 1: nan}})
    message = "the gradient its loss sent into the model's output was NaN or Inf at step 6."
    job.add("warning", 1, T0 + 1.65, step=6, syncs=6, code="nonfinite_loss", message=message)
    incidents = diagnose(job.snapshot(), T0 + 10)
    n = only(incidents, "nonfinite_parameters")
    assert (
        n.culprit_ranks == []
        and "the nonfinite_loss incident names the rank whose loss went first" in n.message
    )
    assert only(incidents, "nonfinite_loss").culprit_ranks == [1]
    # With DDPSCOPE_CHECK_GRADIENTS, a NaN made inside rank 0's backward the step before is the origin named.
    job.add("warning", 0, T0 + 1.6, step=5, syncs=5, code="nonfinite_gradient", bucket=0, message="NaN.")
    n = only(diagnose(job.snapshot(), T0 + 10), "nonfinite_parameters")
    assert "the nonfinite_gradient incident names the rank whose gradients went first" in n.message


def test_an_infinite_norm_on_one_rank_only_names_that_rank() -> None:
    job = started(2)
    with_order(job)
    digests(job, {0: {0: HEALTHY, 1: HEALTHY}, 2: {0: HEALTHY, 1: [-2.0, 3.25, 0.5]}})
    incidents = diagnose(job.snapshot(), T0 + 10)
    n = only(incidents, "nonfinite_parameters")
    assert n.culprit_ranks == [1] and "infinite" in n.message and "on rank 1 only" in n.message
    assert only(incidents, "replicas_diverged").step == 2
