"""``/metrics``: a scrape-time collector on a private registry, reading storage.

Nothing is kept in process memory: every scrape reads the database (prometheus ``gc_collector``
pattern), so several collector processes report the same numbers and a finished job leaves
``/metrics`` by construction. Gauges use the same analysis functions as the API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ddpscope.server.analysis.collectives import mismatches
from ddpscope.server.analysis.jobs import diagnose, has_diagnosis, job_status
from ddpscope.server.analysis.snapshot import JobSnapshot
from ddpscope.server.analysis.steps import mean_overlap, step_metrics
from ddpscope.server.analysis.stragglers import WINDOW_STEPS, stragglers
from ddpscope.server.storage import Storage

logger = logging.getLogger(__name__)

JR = ["job", "rank"]


def hang_active(snap: JobSnapshot) -> dict[int, bool]:
    """Per rank: its latest hang report has no later ``hang_resolved``."""
    last_hang: dict[int, int] = {}
    last_resolved: dict[int, int] = {}
    for h in snap.hangs:
        last_hang[h["rank"]] = max(last_hang.get(h["rank"], 0), h["time_ns"])
    for h in snap.hang_resolved:
        last_resolved[h["rank"]] = max(last_resolved.get(h["rank"], 0), h["time_ns"])
    return {r: t > last_resolved.get(r, -1) for r, t in last_hang.items()}


class StorageCollector(Collector):
    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def describe(self) -> list[Metric]:
        return []  # values exist only at scrape time; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        storage = self.storage
        storage.flush_counts()
        counters = storage.counters()
        ingested = CounterMetricFamily(
            "ddpscope_ingested_records", "Records stored by the collectors (duplicates excluded)"
        )
        ingested.add_metric([], counters.get("ingested_records", 0))
        rejected = CounterMetricFamily(
            "ddpscope_rejected_batches", "Ingest batches refused, by reason", labels=["reason"]
        )
        for name, value in sorted(counters.items()):
            if name.startswith("rejected_batches:"):
                rejected.add_metric([name.split(":", 1)[1]], value)
        yield ingested
        yield rejected

        g: dict[str, Any] = {
            "hang": GaugeMetricFamily(
                "ddpscope_hang_active", "1 while the rank's latest hang report is unresolved", labels=JR
            ),
            "straggler": GaugeMetricFamily(
                "ddpscope_straggler", "1 when the rank is flagged as a straggler", labels=JR
            ),
            "step": GaugeMetricFamily(
                "ddpscope_step_seconds", "Duration of the rank's latest step", labels=JR
            ),
            "overlap": GaugeMetricFamily(
                "ddpscope_overlap_ratio", "All-reduce time hidden behind backward, recent steps", labels=JR
            ),
            "seen": GaugeMetricFamily(
                "ddpscope_last_seen_timestamp_seconds",
                "Time of the rank's newest record (aligned clock)",
                labels=JR,
            ),
            "unused": GaugeMetricFamily(
                "ddpscope_unused_parameters", "Parameters seen without a gradient", labels=["job"]
            ),
        }
        mism = CounterMetricFamily(
            "ddpscope_collective_mismatches",
            "Collectives on which ranks disagree (op, shapes, dtypes)",
            labels=["job"],
        )
        drops = CounterMetricFamily(
            "ddpscope_agent_dropped_records",
            "Records the agents dropped, by reason and kind",
            labels=[*JR, "reason", "kind"],
        )
        now_s = time.time()
        for row in storage.jobs():
            try:
                self._job(row.job, row.id, now_s, g, mism, drops)
            except Exception:  # one broken job must not take the whole scrape down
                logger.exception("metrics for job %s failed", row.job)
        yield from g.values()
        yield mism
        yield drops

    def _job(self, job: str, job_id: int, now_s: float, g: dict[str, Any], mism: Any, drops: Any) -> None:
        snap = self.storage.load_snapshot(job)
        if snap is None or job_status(snap, now_s) == "finished":
            return
        hangs = hang_active(snap)
        rows = self.storage.recent_steps(job_id, WINDOW_STEPS)
        flagged = {s.rank: s.flagged for s in stragglers(rows)}
        metrics_by_rank: dict[int, list[Any]] = {}
        for r in rows:
            metrics_by_rank.setdefault(r.rank, []).append(step_metrics(r))
        for rank in sorted(set(snap.rank_last_seen_s) | set(snap.ranks)):
            labels = [job, str(rank)]
            g["hang"].add_metric(labels, float(hangs.get(rank, False)))
            g["straggler"].add_metric(labels, float(flagged.get(rank, False)))
            g["seen"].add_metric(labels, snap.rank_last_seen_s.get(rank, 0.0))
            ms = metrics_by_rank.get(rank)
            if ms:
                g["step"].add_metric(labels, max(ms, key=lambda m: m.step).step_s)
                overlap = mean_overlap(ms)
                if overlap is not None:
                    g["overlap"].add_metric(labels, overlap)
        g["unused"].add_metric([job], float(len(snap.unused)))
        if has_diagnosis():
            n_mismatch = sum(_kind(i) == "mismatch" for i in diagnose(snap, now_s))
        else:
            n_mismatch = len(mismatches(snap.collectives))
        mism.add_metric([job], float(n_mismatch))
        totals: dict[tuple[int, str, str], int] = {}
        for stats in self.storage.fetch_records(job, ["agent_stats"]):
            for key, n in stats["dropped"].items():
                reason, _, kind = key.partition(":")
                k = (stats["rank"], reason, kind)
                totals[k] = totals.get(k, 0) + n
        for (rank, reason, kind), n in sorted(totals.items()):
            drops.add_metric([job, str(rank), reason, kind], float(n))


def _kind(incident: Any) -> Any:
    return incident.get("kind") if isinstance(incident, dict) else getattr(incident, "kind", None)


def make_registry(storage: Storage) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StorageCollector(storage))
    return registry
