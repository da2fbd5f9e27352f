"""PLACEHOLDER agent: a bounded deque drained into an exporter. Replaced by the full agent (issue 3).

Kept API: emit(record), configure(**overrides) -> Agent, get_agent(), shutdown(timeout_s),
Agent.force_flush(timeout_s) -> bool, Agent.shutdown(timeout_s), InMemoryExporter().records.
"""

from __future__ import annotations

import collections
import enum
import itertools
import os
import threading
import uuid
from typing import Any

from ddpscope.agent.clock import now_ns


class ExportResult(enum.Enum):
    SUCCESS = "success"
    RETRY = "retry"
    FAILURE = "failure"


class InMemoryExporter:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def export(self, batch: list[dict[str, Any]]) -> ExportResult:
        with self._lock:
            self.records.extend(batch)
        return ExportResult.SUCCESS

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        return None


class Agent:
    def __init__(self, *, job: str | None = None, rank: int | None = None, exporter: Any = None) -> None:
        self.job = job or os.environ.get("DDPSCOPE_JOB") or os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
        self.rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
        self.exporter = exporter or InMemoryExporter()
        self.stream = uuid.uuid4().hex[:16]
        self._seq = itertools.count()
        self._queue: collections.deque[dict[str, Any]] = collections.deque(maxlen=100_000)

    def emit(self, record: dict[str, Any]) -> None:
        record.setdefault("time_ns", now_ns())
        record.setdefault("rank", self.rank)
        record["job"] = self.job
        record["stream"] = self.stream
        record["seq"] = next(self._seq)
        self._queue.append(record)

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        batch = []
        while self._queue:
            batch.append(self._queue.popleft())
        if batch:
            self.exporter.export(batch)
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.force_flush(timeout_s)


_agent: Agent | None = None


def configure(**overrides: Any) -> Agent:
    global _agent
    _agent = Agent(**overrides)
    return _agent


def get_agent() -> Agent:
    global _agent
    if _agent is None:
        _agent = Agent()
    return _agent


def emit(record: dict[str, Any]) -> None:
    try:
        get_agent().emit(record)
    except Exception:  # the agent never raises into training
        pass


def shutdown(timeout_s: float = 5.0) -> None:
    if _agent is not None:
        _agent.shutdown(timeout_s)
