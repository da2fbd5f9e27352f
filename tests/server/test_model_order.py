"""Ranks whose models list their parameters in different orders (``models_differ``), over synthetic
snapshots: DDP pairs gradients by position, so same-shape layers built in a rank-dependent order are
averaged with each other while nothing fails."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from tests.server.test_incidents import T0, JobRecords, kinds, only

ORDER = [
    "embed.weight",
    "blocks.enc.weight",
    "blocks.enc.bias",
    "blocks.mid.weight",
    "blocks.mid.bias",
    "head.weight",
]
SWAPPED = [
    "embed.weight",
    "blocks.mid.weight",
    "blocks.mid.bias",
    "blocks.enc.weight",
    "blocks.enc.bias",
    "head.weight",
]


def job_with_orders(*orders: list[str], group: str | None = None) -> JobRecords:
    job = JobRecords(len(orders))
    for rank, order in enumerate(orders):
        job.start(rank)
        job.add("layout", rank, T0 + 0.5, step=0, reason="initial", buckets=[], parameter_order=order)
    job.train(3)
    return job


def test_a_rank_whose_same_shape_layers_come_in_another_order_is_named_with_the_first_position() -> None:
    job = job_with_orders(ORDER, SWAPPED, ORDER)
    incidents = diagnose(job.snapshot(), T0 + 2)
    differs = only(incidents, "models_differ")
    assert differs.culprit_ranks == [1] and differs.rank == 1
    assert differs.parameters == ["blocks.enc.weight", "blocks.mid.weight"]
    assert (
        "at position 1 rank 1 has blocks.mid.weight where ranks 0, 2 have blocks.enc.weight "
        "(4 of 6 positions differ)" in differs.message
    ), differs.message
    assert "by position in module.parameters(), not by name" in differs.message


def test_ranks_with_the_same_parameter_order_get_no_models_differ_incident() -> None:
    assert "models_differ" not in kinds(diagnose(job_with_orders(ORDER, ORDER).snapshot(), T0 + 2))


def test_a_rank_with_more_parameters_says_how_many_each_side_has() -> None:
    job = job_with_orders(ORDER, [*ORDER, "extra.weight"])
    differs = only(diagnose(job.snapshot(), T0 + 2), "models_differ")
    assert "rank 1 has 7 parameters where rank 0 has 6" in differs.message
    assert differs.culprit_ranks == [1] and differs.parameters == []


def test_models_on_different_process_groups_are_not_compared() -> None:
    # Pipeline stages: each subgroup wraps its own model.
    job = JobRecords(2)
    for rank, order in enumerate((ORDER, SWAPPED)):
        job.start(rank)
        job.add("layout", rank, T0 + 0.5, step=0, reason="initial", buckets=[], parameter_order=order)
    for rec in job.records:
        if rec["kind"] == "rank_start":
            rec["process_group"] = f"pg:{rec['rank']}"
    assert "models_differ" not in kinds(diagnose(job.snapshot(), T0 + 2))
