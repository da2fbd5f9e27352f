"""HTTP routers, one module per resource: ``ingest``, ``jobs``, ``steps`` (steps, timeline, buckets,
stragglers, unused parameters), ``incidents`` (incidents, trace), ``health`` (/healthz, /metrics).
``create_app`` includes them all; each reads ``app.state.storage`` through ``deps``."""

__all__: list[str] = []
