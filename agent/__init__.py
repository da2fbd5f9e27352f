"""The in-process agent: ``emit(record)`` never blocks and never raises into training.

Usage (training side; the engine and the adapter call ``emit`` for you)::

    from ddpscope import agent
    agent.emit({"kind": "rank_exit", "rank": 0, "step": 10, "reason": "finished"})
    agent.get_agent().force_flush(5.0)     # True once the collector has acknowledged everything
    agent.get_agent().config.heartbeat_s   # settings other parts read (hang_timeout_s, heartbeat_s, ...)

The agent stamps ``job``, ``stream``, ``seq``, ``time_ns`` and (when missing) ``rank`` on a copy of
each record on its worker thread; the caller's dict is never modified, but must not be changed after
it was emitted. By default records go to an append-only disk spool in rounds (every 0.25 s while
records keep coming; hang, hang_resolved and rank_error at once, also copied into a memory-mapped
write-ahead ring when emitted and printed on stderr) and a small shipper process per
agent POSTs them to ``DDPSCOPE_URL``, so they arrive even if this process is SIGKILLed or aborts
(a fatal signal's stacks come as a fatal ``rank_error``). ``Agent.flush_local(timeout_s)`` forces
the spool write now (before a deliberate crash or exit); ``make_durable()`` writes what was emitted
so far to the spool before returning (~10-20 us, lock-bounded), right after a record that may be the
last before an abort; ``emit_durable(record)`` does the same for one record at a fraction of the cost
(a memory-mapped write-ahead ring the shipper reads if this process dies; the collective recorder
calls it before each collective enters torch); ``emit_templated(template, values)`` is the same for a
record that differs from call to call only in integers (the engine's bucket all-reduces and its
step records; ``template.RecordTemplate``), cheaper still in the caller. Every record ddpscope
itself emits in training is crash-durable one of these ways (but the clock's start-up ping-pong and
``agent_stats``, which the worker sends); a plain ``emit`` of an ordinary kind, such as a user's own,
waits for the round. At exit and on
SIGTERM a rank emits ``rank_exit`` and flushes within 5 s; an uncaught exception becomes a fatal
``rank_error`` first.

Configuration comes from ``DDPSCOPE_*`` environment variables (see ``config``); ``configure(**kw)``
overrides them explicitly (``exporter=InMemoryExporter()`` keeps records in memory, for tests).
``DDPSCOPE_DISABLED=1`` turns everything into no-ops: no thread, no file, no hook.
"""

from ddpscope.agent._core import (
    Agent,
    ExportResult,
    InMemoryExporter,
    adopt_rank,
    configure,
    emit,
    emit_durable,
    emit_templated,
    get_agent,
    make_durable,
    shutdown,
)
from ddpscope.agent.template import RecordTemplate

__all__ = [
    "Agent",
    "RecordTemplate",
    "ExportResult",
    "InMemoryExporter",
    "adopt_rank",
    "configure",
    "emit",
    "emit_durable",
    "emit_templated",
    "get_agent",
    "make_durable",
    "shutdown",
]
