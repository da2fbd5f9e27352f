"""Replica digests: each rank's fingerprint of its copy of the model, for the collector to compare.

DDP's one promise is that every rank holds the same parameters at the start of every forward: the state is
broadcast at construction, and from then on every rank applies the same update to the same averaged
gradients. Nothing in torch checks it, and many ordinary bugs break it silently, on gloo and NCCL alike:
an optimizer or LR-scheduler step, gradient clipping or a checkpoint load done under ``if rank == 0:``, a
manual update on some ranks, gradients DDP never all-reduced. The ranks then train different models and
nothing fails.

``ReplicaDigest.take`` runs at the start of every training forward and digests the first one after 0, 1, 2,
4, ... 64, then every 64th synchronised backward (gradient all-reduce round): a count every rank shares,
where step numbers can drift apart (a rank that runs an extra forward with autograd on, or accumulates under
``no_sync()``, numbers its steps differently but syncs in lockstep). It ships a ``replica_digest``
record with the 2-norm of each parameter DDP all-reduces, in the layout's ``parameter_order``: one
``torch._foreach_norm`` (0.16 ms for the 1 M-parameter benchmark MLP, 2.8 ms for the 11 M transformer: 0.05 %
and 0.01 % of a step once spread over 64 syncs; ``bench/replicas.py``). The collector compares the ranks' digests sync by sync
(``analysis/replica_divergence.py``); a digest costs no collective, so a rank that skips a check cannot make
its peers wait.

A model with more than ``MAX_ENTRIES`` parameters sends the norm of each run of ``group`` consecutive
parameters instead (still naming the parameters of a run that differs). A norm that is not finite travels as
``NAN_NORM`` or ``INF_NORM`` (JSON has no NaN), so the collector can also say when the parameters went NaN.

At the same checks it notices parameters added to the module after it was wrapped: DDP never all-reduces
them, a drift the digests cannot see (the parameters are not in them).

Digests follow the sync count, so a rank whose backwards never synchronise (every micro-batch under
``no_sync()``, the synced last one forgotten) takes none, while each optimizer step moves its parameters
apart from its peers'. Between two syncs the parameters of a healthy rank do not change (gradient
accumulation steps the optimizer after the synced backward), so after every ``UNSYNCED_CHECK`` training
forwards in a row without a sync, ``take`` compares the norms with those of the previous such check and says
so (``unsynced_gradients``) when they moved: two norm computations per 32 forwards, only in such a stretch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence

import torch

from ddpscope.agent import emit
from ddpscope.agent.log import get_logger
from ddpscope.ddp.drift import shown, warn_unsynced

logger = get_logger(__name__)

EVERY = 64
"""Synchronised backwards between digests once past the first ``EVERY`` (every power of two before)."""
MAX_ENTRIES = 512
"""Norms in one record, at most: a model with more parameters sends norms of runs of parameters."""
UNSYNCED_CHECK = 16
"""Training forwards in a row without a synchronised backward between two looks at the parameters: longer
than any usual gradient accumulation, so a healthy job never pays for it."""
NAN_NORM = -1.0
INF_NORM = -2.0
"""Norms are never negative: these two stand for a NaN and an infinite norm on the wire."""

_MODELS = itertools.count()
"""Ordinals of the models wrapped in this process: every rank wraps its models in one order (building DDP is
a collective call), so the n-th model of each rank is the same model."""


def digest_due(syncs: int) -> bool:
    """True at 0, 1, 2, 4, 8, ... ``EVERY`` and every multiple of ``EVERY`` synchronised backwards: the same
    moments on every rank, dense at the start (where a load after wrapping or a first update goes wrong), then
    cheap."""
    return syncs % EVERY == 0 or syncs & (syncs - 1) == 0


def wire_norm(value: float) -> float:
    if math.isfinite(value):
        return value
    return NAN_NORM if math.isnan(value) else INF_NORM


class ReplicaDigest:
    """The digests of one wrapped model on one rank; ``take`` at the start of every training forward."""

    def __init__(
        self,
        module: torch.nn.Module,
        params: Sequence[torch.Tensor],
        rank: int,
        ignored: Collection[str] = (),
        replicas: Sequence[int] | None = None,
    ) -> None:
        """``params``: the parameters DDP all-reduces, in the order of the layout's ``parameter_order``;
        ``ignored``: parameters the user excluded from DDP on purpose (``_ddp_params_and_buffers_to_ignore``);
        ``replicas``: the global ranks of the model's DDP group when that is not every rank (``groups.replica_ranks``)."""
        self.module = module
        self.params = list(params)
        self.rank = rank
        self.replicas = None if replicas is None else [int(r) for r in replicas]
        self.model = next(_MODELS)
        self.group = max(1, math.ceil(len(self.params) / MAX_ENTRIES))
        self._known = {id(p) for p in module.parameters()}
        self._ignored = set(ignored)
        self._told_added = False
        self._last: int | None = None
        """The sync count of the last digest: one per count, at its first training forward."""
        self.off = False
        """No more digests: one failed (an exotic tensor type), or this rank's sync count stopped matching
        its peers' (``stop``)."""
        self._stretch_syncs = -1
        self._stretch = 0
        """Training forwards since the sync count last moved (it was ``_stretch_syncs`` throughout)."""
        self._stretch_norms: list[float] | None = None
        self._told_unsynced = False

    def take(self, step: int, syncs: int) -> None:
        """Ship a digest if one is due after ``syncs`` synchronised backwards. Never raises."""
        if syncs != self._stretch_syncs:
            self._stretch_syncs, self._stretch, self._stretch_norms = syncs, 0, None
        else:
            self._stretch += 1
            if self._stretch % UNSYNCED_CHECK == 0 and not (self.off or self._told_unsynced):
                self._check_unsynced_updates(step)
        if self.off or syncs == self._last or not digest_due(syncs):
            return
        self._last = syncs
        try:
            record = {
                "kind": "replica_digest",
                "step": step,
                "syncs": syncs,
                "model": self.model,
                "parameters": len(self.params),
                "group": self.group,
                "norms": self.norms(),
            }
            if self.replicas is not None:
                record["replicas"] = self.replicas
            emit(record)
            if not self._told_added:
                self._check_added(step)
        except Exception:
            self._failed()

    def _failed(self) -> None:
        """A digest failed (an exotic tensor type): no more digests or looks, said once. Call in ``except``."""
        self.off = True
        logger.warning(
            "ddpscope: the replica digest failed; ranks' parameters are not compared", exc_info=True
        )

    def stop(self) -> None:
        """This rank shadowed its peers' steps under ``Join`` (it ran out of data): it does not count their
        all-reduce rounds as its own syncs, so its later counts name other moments than theirs."""
        self.off = True

    def norms(self) -> list[float]:
        with torch.no_grad():
            norms = torch._foreach_norm(self.params)
            # One copy to the host, in float64 so that runs of parameters add up without rounding.
            try:
                values = torch.stack(norms).to(device="cpu", dtype=torch.float64)
            except RuntimeError:  # parameters on several devices
                values = torch.stack([n.to(device="cpu", dtype=torch.float64) for n in norms])
        if self.group > 1:
            pad = -len(values) % self.group
            values = torch.nn.functional.pad(values, (0, pad)).view(-1, self.group).norm(dim=1)
        return [wire_norm(v) for v in values.tolist()]

    def _check_unsynced_updates(self, step: int) -> None:
        """Compare the parameters' norms with the previous look in this stretch without syncs: any change
        is an optimizer step on gradients DDP never all-reduced. Never raises."""
        try:
            norms = self.norms()
        except Exception:
            self._failed()
            return
        before, self._stretch_norms = self._stretch_norms, norms
        if before is None or before == norms:
            return
        self._told_unsynced = True
        names = {id(p): n for n, p in self.module.named_parameters()}
        moved = [
            names.get(id(p), f"#{i}")
            for i, p in enumerate(self.params)
            if before[i // self.group] != norms[i // self.group]
        ]
        warn_unsynced(
            self.rank,
            step,
            f"the last {self._stretch} training forwards ran without a synchronised backward (every backward "
            f"under no_sync(), or none), yet {len(moved)} parameter(s) DDP all-reduces changed meanwhile "
            f"({shown(moved)}): an optimizer step ran on gradients that were never all-reduced, so the ranks' "
            "copies of the model drift apart. Run the last micro-batch of each accumulation outside no_sync(), "
            "and step the optimizer only after it.",
            moved,
        )

    def _check_added(self, step: int) -> None:
        added = [
            n
            for n, p in self.module.named_parameters()
            if id(p) not in self._known and p.requires_grad and n not in self._ignored
        ]
        if not added:
            return
        self._told_added = True
        warn_unsynced(
            self.rank,
            step,
            f"{len(added)} parameter(s) were added to the module after it was wrapped in "
            f"DistributedDataParallel ({shown(added)}). DDP fixes the parameters it all-reduces when it is "
            "built, so their gradients stay local to each rank and an optimizer step on them makes the ranks' "
            "copies drift apart. Create every parameter before wrapping, or build the DistributedDataParallel "
            "model again after adding them.",
            added,
        )
