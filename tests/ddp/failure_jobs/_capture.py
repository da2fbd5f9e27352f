"""Shared by the failure job scripts: send this rank's records to a JSON-lines file; keep the warnings
ddpscope logs (``logged_warnings``).

The agent is configured with an exporter that appends every exported batch to ``<out>/rank<R>.jsonl``
and a thread flushes the agent every 50 ms, so a rank that is killed or aborts still leaves the
records it emitted up to its last moments.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from ddpscope import agent


class JsonLinesExporter:
    """The agent's exporter interface (export / force_flush / shutdown), writing JSON lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, batch: list[dict[str, Any]]) -> agent.ExportResult:
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            for record in batch:
                f.write(json.dumps(record) + "\n")
        return agent.ExportResult.SUCCESS

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        return None


def capture(out_dir: str, *, flusher: bool = True) -> None:
    rank = int(os.environ.get("RANK", "0"))
    agent.configure(exporter=JsonLinesExporter(os.path.join(out_dir, f"rank{rank}.jsonl")), rank=rank)
    if not flusher:
        return

    def flush_forever() -> None:
        while True:
            agent.get_agent().force_flush(1.0)
            threading.Event().wait(0.05)

    threading.Thread(target=flush_forever, name="test-flusher", daemon=True).start()


def flush() -> None:
    agent.get_agent().force_flush(5.0)


def logged_warnings() -> list[str]:
    """A list that fills with every warning ddpscope logs in this process from now on."""
    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    logging.getLogger("ddpscope").addHandler(Keep(logging.WARNING))
    return logged
