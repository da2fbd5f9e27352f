"""Unused parameters: aggregated by name over ranks and steps.

A parameter that gets no gradient forces ``find_unused_parameters=True`` (an autograd-graph traversal
every step) or, without it, a hang. Conversely ``find_unused_parameters=True`` with nothing ever unused
costs that traversal for nothing; ``advice`` says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ddpscope.server.analysis.snapshot import UnusedParameter


def aggregate_unused(rows: Iterable[tuple[int, int, Sequence[str]]]) -> list[UnusedParameter]:
    """``rows`` are (rank, step, unused names) per step record; most frequently unused first."""
    ranks: dict[str, set[int]] = {}
    steps: dict[str, set[int]] = {}
    for rank, step, names in rows:
        for name in names:
            ranks.setdefault(name, set()).add(rank)
            steps.setdefault(name, set()).add(step)
    items = [
        UnusedParameter(name, sorted(ranks[name]), len(steps[name]), min(steps[name]), max(steps[name]))
        for name in steps
    ]
    items.sort(key=lambda u: (-u.steps, u.name))
    return items


@dataclass(slots=True)
class UnusedReport:
    items: list[UnusedParameter]
    find_unused_parameters: bool
    advice: str | None
    """A sentence when the configuration and the observations disagree, else None."""


def unused_report(
    items: list[UnusedParameter], find_unused_parameters: bool, steps_seen: int, static_graph: bool = False
) -> UnusedReport:
    """Combine the aggregate with the engine setting into something a person can act on."""
    advice = None
    if static_graph and items and not find_unused_parameters:
        # torch's static graph learns in the first iteration which parameters go unused and marks them
        # ready itself in every later one: no hang, no error.
        advice = (
            f"{len(items)} parameter(s) got no gradient; static_graph=True handles parameters unused in every "
            "iteration (torch learned them in the first one), not a set that changes from step to step"
        )
    elif find_unused_parameters and not items and steps_seen > 0:
        advice = (
            f"find_unused_parameters=True but no parameter was ever unused in {steps_seen} step records: "
            "set it to False to skip an autograd-graph traversal every step"
        )
    elif items and not find_unused_parameters:
        advice = (
            f"{len(items)} parameter(s) got no gradient while find_unused_parameters=False: "
            "this hangs or fails the next forward; set find_unused_parameters=True or use them"
        )
    return UnusedReport(items, find_unused_parameters, advice)
