"""Analysis: pure functions over stored rows and job snapshots that return dataclasses.

``snapshot`` (JobSnapshot, load_snapshot), ``steps`` (per-step timing definitions), ``timeline``,
``buckets`` (layout, out-of-order, order penalty), ``stragglers``, ``unused``, ``trace`` (Perfetto),
``collectives`` (cross-rank mismatch test), ``jobs`` (summaries; calls ``status.job_status``), and
``status`` / ``incidents`` (the cross-rank diagnosis). The API, /metrics and the dashboard all use
these same definitions.
"""

__all__: list[str] = []
