"""The in-process agent: ``emit(record)`` never blocks and never raises into training.

Usage (training side; the engine and the adapter call ``emit`` for you)::

    from ddpscope import agent
    agent.emit({"kind": "rank_exit", "rank": 0, "step": 10, "reason": "finished"})
    agent.get_agent().force_flush(5.0)

Configuration comes from ``DDPSCOPE_*`` environment variables (see ``config``); ``configure(**kw)``
overrides them explicitly. ``DDPSCOPE_DISABLED=1`` turns everything into no-ops.
"""

from ddpscope.agent._core import (
    Agent,
    ExportResult,
    InMemoryExporter,
    configure,
    emit,
    get_agent,
    shutdown,
)

__all__ = ["Agent", "ExportResult", "InMemoryExporter", "configure", "emit", "get_agent", "shutdown"]
