"""``/metrics``: a scrape-time collector on a private registry, reading storage.

Every scrape reads the database (prometheus ``gc_collector`` pattern), so several collector processes
report the same numbers. Every per-job gauge comes from the analysis functions the API uses
(``status.liveness``, ``incidents.diagnose``, ``stragglers``, ``steps.page_metrics``), so /metrics,
the API and the dashboard cannot disagree.

Which jobs are exposed (``exposed``):

- a **running** or **hung** job, always: its alerts must keep firing for as long as it is stuck;
- an **ended** job (finished or failed) until ``retention_s`` after its newest record, by the
  collector's clock. That window lets a failure fire its alerts (``DDPRankSilent`` needs 60 s of
  silence and a few scrapes; a mismatch in a short job that finished between two scrapes must page
  too), and then the series disappear, so the alerts resolve instead of firing forever.

``ddpscope_rank_finished`` tells the rules which ranks exited without an error (done, or stopped by
SIGTERM while making progress): their silence means they are over, not stuck (deploy/alerts.yml). A rank
stopped while it hung is not finished: a hung job killed by its scheduler before ``DDPJobHang``'s ``for``
ran out still pages, through ``DDPRankSilent``.

The one thing remembered between scrapes is which jobs already left, with the state of their rows
then: such a job is skipped without loading its records until a new record changes its row
(``_fingerprint``). That is safe because an ended job's status depends on its records only, never on
time; without it every scrape would analyse every job ever stored (300 jobs: seconds per scrape).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.memory import by_rank as memory_by_rank
from ddpscope.server.analysis.memory import headroom
from ddpscope.server.analysis.status import Liveness, liveness
from ddpscope.server.analysis.steps import mean_overlap, page_metrics, page_timings
from ddpscope.server.analysis.stragglers import WINDOW_STEPS, stragglers
from ddpscope.server.settings import DEFAULT_METRICS_RETENTION_S
from ddpscope.server.storage import JobRow, Storage

logger = logging.getLogger(__name__)

JR = ["job", "rank"]

DIVERGED_KINDS = ("replicas_diverged", "nonfinite_parameters", "unsynced_gradients")
"""Incidents of ranks that no longer train one model: ``ddpscope_replicas_diverged`` is 1 while one holds. The
last is the drift a digest cannot see (gradients never all-reduced: a step through ``model.module``, a second
backward, every micro-batch under ``no_sync()``, a parameter added or unfrozen after wrapping)."""

Clock = Callable[[], float]
"""Seconds on the collector's clock (``time.time``); tests pass their own."""


def exposed(live: Liveness, last_seen_s: float, retention_s: float) -> bool:
    """Whether a job's series are on /metrics at ``live.now_s`` (see the module docstring)."""
    return not live.ended or live.now_s - last_seen_s <= retention_s


def _fingerprint(row: JobRow) -> tuple[Any, ...]:
    """Changes when a rank appears, stores a step, or sends a record newer than its newest."""
    return (row.last_seen_ns, tuple((r.rank, r.last_seen_ns, r.step_records) for r in row.ranks))


def _gauges() -> dict[str, GaugeMetricFamily]:
    return {
        "hang": GaugeMetricFamily(
            "ddpscope_hang_active",
            "1 while the rank hangs and is still running: its latest hang report is not followed by "
            "hang_resolved, an exit or a fatal error (a hang ended by a stop reads 0 here; the rank is then "
            "not finished either, see ddpscope_rank_finished)",
            labels=JR,
        ),
        "straggler": GaugeMetricFamily(
            "ddpscope_straggler", "1 when the rank is flagged as a straggler", labels=JR
        ),
        "step": GaugeMetricFamily("ddpscope_step_seconds", "Duration of the rank's latest step", labels=JR),
        "overlap": GaugeMetricFamily(
            "ddpscope_overlap_ratio", "All-reduce time hidden behind backward, recent steps", labels=JR
        ),
        "seen": GaugeMetricFamily(
            "ddpscope_last_seen_timestamp_seconds",
            "Time of the rank's newest record (aligned clock)",
            labels=JR,
        ),
        "finished": GaugeMetricFamily(
            "ddpscope_rank_finished",
            "1 once the rank exited without an error (rank_exit 'finished', 'sigterm' or 'sigint' after its latest "
            "start), unless it was stopped while it hung: a scheduler's time limit ending a hung job is a failure",
            labels=JR,
        ),
        "unused": GaugeMetricFamily(
            "ddpscope_unused_parameters", "Parameters seen without a gradient", labels=["job"]
        ),
        "diverged": GaugeMetricFamily(
            "ddpscope_replicas_diverged",
            "1 while the ranks' copies of the model differ, hold NaN or infinite parameters, or drift apart on "
            "gradients DDP never all-reduced (the replicas_diverged, nonfinite_parameters and unsynced_gradients "
            "incidents)",
            labels=["job"],
        ),
        "rss": GaugeMetricFamily(
            "ddpscope_rank_memory_bytes",
            "The rank's resident memory in its latest memory record (sent every 30 s)",
            labels=JR,
        ),
        "workers_rss": GaugeMetricFamily(
            "ddpscope_rank_workers_memory_bytes",
            "The private memory of the rank's worker processes (DataLoader workers) in its latest memory record; "
            "absent for a rank without workers",
            labels=JR,
        ),
        "headroom": GaugeMetricFamily(
            "ddpscope_memory_available_bytes",
            "Memory left where the rank runs, in its latest memory record: the host's MemAvailable, or what its "
            "memory cgroup's limit leaves when that is less; at 0 the kernel's OOM killer ends a process",
            labels=JR,
        ),
        "growth": GaugeMetricFamily(
            "ddpscope_memory_growth",
            "1 while a rank's memory grows steadily (the memory_growth incident): a leak on its way to the OOM killer",
            labels=["job"],
        ),
    }


class StorageCollector(Collector):
    """Reads every job from ``storage`` at scrape time; see the module docstring for which are shown."""

    def __init__(
        self, storage: Storage, *, retention_s: float = DEFAULT_METRICS_RETENTION_S, clock: Clock = time.time
    ) -> None:
        self.storage = storage
        self.retention_s = retention_s
        self.clock = clock
        self._gone: dict[str, tuple[Any, ...]] = {}
        """Jobs that left /metrics: job -> ``_fingerprint`` of its row when it left."""

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

        g = _gauges()
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
        now_s = self.clock()
        gone: dict[str, tuple[Any, ...]] = {}  # rebuilt each scrape, so deleted jobs are forgotten
        for row in storage.jobs():
            fingerprint = _fingerprint(row)
            if self._gone.get(row.job) == fingerprint:
                gone[row.job] = fingerprint
                continue
            try:
                if not self._job(row.job, row.id, now_s, g, mism, drops):
                    gone[row.job] = fingerprint
            except Exception:  # one broken job must not take the whole scrape down
                logger.exception("metrics for job %s failed", row.job)
        self._gone = gone
        yield from g.values()
        yield mism
        yield drops

    def _job(
        self, job: str, job_id: int, now_s: float, g: dict[str, GaugeMetricFamily], mism: Any, drops: Any
    ) -> bool:
        """Add the job's series; False when it is not exposed (ended, past its retention)."""
        snap = self.storage.load_snapshot(job)
        if snap is None:
            return True  # deleted since the job list was read: nothing to remember
        live = liveness(snap, now_s)
        if not exposed(live, snap.last_seen_s, self.retention_s):
            return False
        # One step more than the window: straggler scoring reads each step's predecessor.
        page = self.storage.recent_step_page(job_id, WINDOW_STEPS + 1)
        flagged = {s.rank: s.flagged for s in stragglers(page_timings(page))}
        first_in_window = (int(page.step.max()) if len(page) else 0) - WINDOW_STEPS + 1
        metrics_by_rank: dict[int, list[Any]] = {}
        for m in page_metrics(page):
            if m.step >= first_in_window:
                metrics_by_rank.setdefault(m.rank, []).append(m)
        # Ranks that reported something: a rank never seen has no last-seen time to compare with, and
        # a 0 there would page DDPRankSilent for a rank that is merely slow to start.
        for rank in sorted(set(live.last_alive_s) | set(snap.ranks)):
            labels = [job, str(rank)]
            exit_ = live.exits.get(rank)
            g["hang"].add_metric(labels, float(rank in live.active_hangs))
            g["straggler"].add_metric(labels, float(flagged.get(rank, False)))
            g["seen"].add_metric(labels, live.last_alive_s.get(rank, 0.0))
            # 'sigterm' and 'sigint' count: a cancelled or preempted job is 'finished' for the API too, not a
            # failure; but not a rank stopped while it hung, waited or was silent (the API's 'failed'): its
            # silence pages.
            stuck = rank in live.stopped_hangs or rank in live.stopped_waits or rank in live.stopped_silent
            finished = exit_ is not None and exit_.get("reason") != "error" and not stuck
            g["finished"].add_metric(labels, float(finished))
            ms = metrics_by_rank.get(rank)
            if ms:
                g["step"].add_metric(labels, max(ms, key=lambda m: m.step).step_s)
                overlap = mean_overlap(ms)
                if overlap is not None:
                    g["overlap"].add_metric(labels, overlap)
        for rank, samples in memory_by_rank(snap.memory).items():
            latest = samples[-1]
            g["rss"].add_metric([job, str(rank)], float(latest["rss_bytes"]))
            if latest.get("workers"):
                g["workers_rss"].add_metric([job, str(rank)], float(latest.get("workers_bytes") or 0))
            g["headroom"].add_metric([job, str(rank)], float(headroom(latest)[0]))
        g["unused"].add_metric([job], float(len(snap.unused)))
        # Active only: after a restart the old processes' mismatch is history and must stop paging.
        active = [i.kind for i in diagnose(snap, now_s) if i.active]
        mism.add_metric([job], float(active.count("mismatch")))
        g["diverged"].add_metric([job], float(any(k in DIVERGED_KINDS for k in active)))
        g["growth"].add_metric([job], float("memory_growth" in active))
        totals: dict[tuple[int, str, str], int] = {}
        for stats in self.storage.fetch_records(job, ["agent_stats"]):
            for key, n in stats["dropped"].items():
                reason, _, kind = key.partition(":")
                k = (stats["rank"], reason, kind)
                totals[k] = totals.get(k, 0) + n
        for (rank, reason, kind), n in sorted(totals.items()):
            drops.add_metric([job, str(rank), reason, kind], float(n))
        return True


def make_registry(
    storage: Storage, *, retention_s: float = DEFAULT_METRICS_RETENTION_S, clock: Clock = time.time
) -> CollectorRegistry:
    """A private registry whose only collector reads ``storage`` at scrape time.

    ``retention_s`` is ``Settings.metrics_retention_s``; ``clock`` is the collector's clock (tests pass
    a fixed one to look 15 minutes ahead without waiting).
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StorageCollector(storage, retention_s=retention_s, clock=clock))
    return registry
