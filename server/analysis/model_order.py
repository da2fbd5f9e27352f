"""Ranks whose models list their parameters differently: ``models_differ``.

DDP pairs gradients across ranks by a parameter's position in ``module.parameters()``, not by its name.
torch's constructor compares only the shapes, so two ranks that build the same layers in a different
order (a ``ModuleDict`` or ``nn.Sequential`` filled from a dict, set or file listing whose order differs
by rank, a rank-dependent branch) pass its check whenever the swapped layers have the same shape: each
rank's gradient for one layer is averaged with another rank's gradient for a different layer, nothing
fails, and the model does not learn what it should. ddpscope's engine refuses such a model when it is
built; under ``instrument()`` the ranks' ``layout`` records (their ``parameter_order``) are compared here.

``model_incidents(snapshot)`` returns at most one incident per DDP process group (models on disjoint
subgroups, one per pipeline stage, are different models): the odd ranks as culprits, the first position
where each differs from the reference, and how many positions differ. Pure function of a ``JobSnapshot``
of the current processes (``split_restart``); no database, no HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddpscope.agent.rank_spans import ranks_text
from ddpscope.server.analysis.incident_model import Incident, record_s
from ddpscope.server.analysis.rank_settings import differences
from ddpscope.server.analysis.snapshot import JobSnapshot

ADVICE = (
    "DDP pairs gradients by position in module.parameters(), not by name, and torch checks only the shapes: "
    "each rank's gradient of one layer is averaged with another rank's gradient of a different layer, "
    "nothing fails and the model does not train as it should. Build the model the same way on every rank "
    "(a dict, set or file listing iterated in a rank-dependent order, or a rank-dependent branch, are the "
    "usual causes)."
)


def model_incidents(snapshot: JobSnapshot) -> list[Incident]:
    """One ``models_differ`` incident per process group whose ranks' parameter orders differ, else none."""
    orders = _first_orders(snapshot)
    # The ranks' orders as settings of their DDP group, compared as ``rank_settings`` compares its own.
    as_settings = {
        rank: {
            "parameter_order": order,
            "process_group": (snapshot.ranks.get(rank) or {}).get("process_group"),
        }
        for rank, (order, _) in orders.items()
    }
    out = []
    for d in differences(as_settings, "parameter_order", per_group=True):
        reference, others = d.right, [o for o in d.holders if o != d.right]
        parts = "; ".join(_difference(reference, d.holders[reference], o, d.holders[o]) for o in others)
        where = "" if d.group == "default" else f" in group {d.group}"
        at = _first_position(reference, others[0])
        out.append(
            Incident(
                kind="models_differ",
                message=f"The ranks' models list their parameters in different orders{where}: {parts}. {ADVICE}",
                rank=d.odd[0] if len(d.odd) == 1 else None,
                culprit_ranks=d.odd,
                # The two parameters DDP pairs wrongly at the first position that differs.
                parameters=[] if at is None else [reference[at], others[0][at]],
                time_s=max(orders[r][1] for rs in d.holders.values() for r in rs),
            )
        )
    return out


def _first_orders(snapshot: JobSnapshot) -> dict[int, tuple[tuple[str, ...], float]]:
    """Each rank's parameter names from its first layout record that carries them, with its time."""
    out: dict[int, tuple[tuple[str, ...], float]] = {}
    for lay in snapshot.layouts:
        rank = lay["rank"]
        if rank not in out and lay.get("parameter_order"):
            out[rank] = (tuple(lay["parameter_order"]), record_s(lay))
    return out


def _first_position(reference: Sequence[str], order: Sequence[str]) -> int | None:
    """The first position where two orders of the same length name different parameters."""
    if len(order) != len(reference):
        return None
    return next((i for i, (a, b) in enumerate(zip(reference, order, strict=True)) if a != b), None)


def _difference(
    reference: Sequence[str], ref_ranks: list[int], order: Sequence[str], ranks: list[int]
) -> str:
    """``at position 3 rank 1 has blocks.mid.weight where rank 0 has blocks.enc.weight (2 of 12 positions
    differ)``, or how many parameters each side has."""
    has, ref_has = ("has" if len(ranks) == 1 else "have"), ("has" if len(ref_ranks) == 1 else "have")
    i = _first_position(reference, order)
    if i is None:
        return (
            f"{ranks_text(ranks)} {has} {len(order)} parameters where {ranks_text(ref_ranks)} {ref_has} "
            f"{len(reference)}"
        )
    differ = sum(a != b for a, b in zip(reference, order, strict=True))
    return (
        f"at position {i} {ranks_text(ranks)} {has} {order[i]} where {ranks_text(ref_ranks)} {ref_has} "
        f"{reference[i]} ({differ} of {len(reference)} positions differ)"
    )
