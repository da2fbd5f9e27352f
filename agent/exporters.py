"""The exporter interface (OpenTelemetry ``SpanExporter`` style) and the in-memory exporter.

An exporter receives batches of finished records (envelope stamped) and knows nothing about queues:

- ``export(batch) -> ExportResult``: deliver or durably hand over one batch;
- ``force_flush(timeout_s) -> bool``: True once everything exported so far has reached its destination;
- ``shutdown(timeout_s) -> None``: release resources; later exports fail.
"""

from __future__ import annotations

import enum
import threading
from typing import Any, Protocol


class ExportResult(enum.Enum):
    SUCCESS = "success"
    """Delivered (or durably queued for delivery)."""
    RETRY = "retry"
    """Not delivered, retries exhausted; the agent counts the records as dropped ('export_failed')."""
    FAILURE = "failure"
    """Permanently refused (e.g. HTTP 4xx); set aside, counted as dropped ('rejected')."""


class Exporter(Protocol):
    def export(self, batch: list[dict[str, Any]]) -> ExportResult: ...

    def force_flush(self, timeout_s: float = 5.0) -> bool: ...

    def shutdown(self, timeout_s: float = 5.0) -> None: ...


class InMemoryExporter:
    """Keeps every exported record in ``records`` (tests, and ``ddpscope demo`` style in-process use)."""

    crash_durable = False
    """Records here die with the process: exporting them early (``emit_durable``) protects nothing."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._closed = False

    def export(self, batch: list[dict[str, Any]]) -> ExportResult:
        with self._lock:
            if self._closed:
                return ExportResult.FAILURE
            self.records.extend(batch)
        return ExportResult.SUCCESS

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True

    def clear(self) -> None:
        with self._lock:
            self.records.clear()
