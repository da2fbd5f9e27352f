"""Per-step timing state that becomes one ``step`` record (agent/records.py) per rank per iteration.

Independent of any engine: ddpscope's own engine and the adapter for stock torch DDP both drive a
``StepTimer`` with the same verbs, so the two produce identical records::

    timer = StepTimer(rank=0)
    timer.set_buckets([4096, 1024])          # bytes per bucket, after every (re)layout
    timer.forward_start(step=0, synced=True)
    timer.forward_end()
    timer.backward_start()
    timer.bucket_ready(0); timer.allreduce_launched(0, coll_seq=7); timer.allreduce_done(0)
    ...
    timer.emit(unused_parameters=[])          # the record, crash-durable (or finish() for the dict)

The timer also reads, at each phase boundary, how long the training thread has been blocked in other
collectives (``collectives.BlockedTime``: a user's loss all-reduce, a buffer broadcast): the
``blocked_*_ns`` fields, which let the collector tell a rank's own work from its waiting for a peer.

Every time is ``ddpscope.agent.clock.now_ns()`` (the job's aligned clock) unless the caller passes one
(the CUDA path converts event times itself). A time of 0 means "did not happen in this step" (a bucket
that was never reduced because its step failed, or every bucket of an unsynchronised step).

Why ``emit`` goes through a record template (``agent/template.py``) rather than ``agent.emit``: an
ordinary record waits in memory for the agent's next round (up to 0.25 s), so a SIGKILL or an abort
loses the last steps before it, which are the ones a post-mortem wants. A template makes the record
crash-durable when ``emit`` returns, in the write-ahead ring, for the price of packing its integers:
the bucket arrays are fixed-length variables of a template made once per bucket layout (and set of
unused parameters), so the caller builds one tuple of integers and no dict.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ddpscope import agent
from ddpscope.agent.clock import now_ns
from ddpscope.agent.records import UNTIMED_END
from ddpscope.agent.template import RecordTemplate
from ddpscope.ddp.collectives import RECORDER, BlockedTime, work_failure

MAX_TEMPLATES = 8
"""Step templates kept per timer: one per (ready-order length, unused parameters) seen since the last
layout. A job whose unused set changes every step makes a new one each time; the cap bounds memory."""
_HEAD = (
    "step",
    "forward_start_ns",
    "forward_end_ns",
    "backward_start_ns",
    "backward_end_ns",
    "blocked_between_ns",
    "blocked_forward_ns",
    "blocked_backward_ns",
)
"""The scalar variables of every step template, in value order."""
_BUCKET_TIMES = ("bucket_ready_ns", "allreduce_start_ns", "allreduce_end_ns")


def untimed_end(work: Any) -> int:
    """``UNTIMED_END`` for a collective ``work`` that completed successfully, else 0 (still in flight, or
    failed: a failed all-reduce never finished, and its error is the report's own subject)."""
    try:
        # Not ``work.is_success()``: torch deprecates it with a warning printed into the user's log.
        return UNTIMED_END if work is not None and work.is_completed() and work_failure(work) is None else 0
    except Exception:
        return 0


class StepTimer:
    """Collects one iteration's timestamps; hot-path methods are a clock read and a list store."""

    __slots__ = (
        "rank",
        "step",
        "synced",
        "bucket_bytes",
        "_fwd_start",
        "_fwd_end",
        "_bwd_start",
        "_ready",
        "_launch",
        "_done",
        "_seqs",
        "_order",
        "_templates",
        "_blocked",
        "_blocked_at_end",
        "_blocked_between",
        "_blocked_at_start",
        "_blocked_at_forward_end",
        "ends_pg",
    )

    def __init__(self, rank: int, bucket_bytes: Sequence[int] = ()) -> None:
        self.rank = rank
        self.step = 0
        self.synced = True
        self.set_buckets(bucket_bytes)
        self._fwd_start = self._fwd_end = self._bwd_start = 0
        self._blocked: BlockedTime | None = None
        """The training thread's blocked time (the one that calls ``forward_start``)."""
        self._blocked_at_end: int | None = None
        """Its value when the previous step's record was made: the start of the between-steps span."""
        self._blocked_between = self._blocked_at_start = self._blocked_at_forward_end = 0
        self.ends_pg: str | None = None
        """The group of the bucket all-reduces whose ends this timer's step records carry (the recorder
        folded them: ``CollectiveRecorder.end_planned``); None: their ends go out on their own. Set by the
        engine before its first step."""

    def set_buckets(self, bucket_bytes: Sequence[int]) -> None:
        """Call after every (re)layout; takes effect from the next ``forward_start``."""
        self.bucket_bytes = list(bucket_bytes)
        self._templates: dict[tuple[int, tuple[str, ...]], RecordTemplate | None] = {}
        self._reset_buckets()

    def _reset_buckets(self) -> None:
        n = len(self.bucket_bytes)
        self._ready = [0] * n
        self._launch = [0] * n
        self._done = [0] * n
        self._seqs = [0] * n
        self._order: list[int] = []

    def forward_start(self, step: int, synced: bool = True, t_ns: int | None = None) -> None:
        RECORDER.flush_folded()  # ends of a step whose record never came (its backward raised)
        self.step = step
        self.synced = synced
        self._reset_buckets()
        self._fwd_start = now_ns() if t_ns is None else t_ns
        self._fwd_end = self._bwd_start = 0
        blocked = RECORDER.blocked_time()
        at = blocked.ns
        since = self._blocked_at_end
        self._blocked_between = at - since if since is not None and blocked is self._blocked else 0
        self._blocked = blocked
        self._blocked_at_start = self._blocked_at_forward_end = at

    def forward_end(self, t_ns: int | None = None) -> None:
        self._fwd_end = now_ns() if t_ns is None else t_ns
        if self._blocked is not None:
            self._blocked_at_forward_end = self._blocked.ns

    def backward_start(self, t_ns: int | None = None) -> None:
        """First call in a step wins: the engine calls it from whichever hook fires first."""
        if not self._bwd_start:
            self._bwd_start = now_ns() if t_ns is None else t_ns

    def bucket_ready(self, index: int, t_ns: int | None = None) -> None:
        self._ready[index] = now_ns() if t_ns is None else t_ns
        self._order.append(index)

    def allreduce_launched(self, index: int, coll_seq: int, t_ns: int | None = None) -> None:
        self._launch[index] = now_ns() if t_ns is None else t_ns
        self._seqs[index] = coll_seq

    def allreduce_done(self, index: int, t_ns: int | None = None) -> None:
        """Safe from a communication thread: a single list store."""
        self._done[index] = now_ns() if t_ns is None else t_ns

    def set_bucket_times(
        self, ready_ns: Sequence[int], launch_ns: Sequence[int], done_ns: Sequence[int]
    ) -> None:
        """Replace the host-clock bucket times (the CUDA path measures them with device events)."""
        self._ready, self._launch, self._done = list(ready_ns), list(launch_ns), list(done_ns)

    def is_done(self, index: int) -> bool:
        return self._done[index] != 0

    def partial(self) -> dict[str, Any] | None:
        """The step in progress as far as it got (``records.PARTIAL_STEP``: times of 0 did not happen
        yet), for a hang or error report: the step record this rank may never send. None before the
        first forward. Called from the watchdog thread: each list is copied whole under the GIL, so a
        time written meanwhile is either in the copy or not, never torn."""
        if not self._fwd_start:
            return None
        synced = self.synced
        return {
            "step": self.step,
            "synced": synced,
            "forward_start_ns": self._fwd_start,
            "forward_end_ns": self._fwd_end,
            "backward_start_ns": self._bwd_start,
            "bucket_ready_ns": list(self._ready) if synced else [],
            "allreduce_start_ns": list(self._launch) if synced else [],
            "allreduce_end_ns": list(self._done) if synced else [],
            "bucket_bytes": list(self.bucket_bytes) if synced else [],
        }

    def emit(self, unused_parameters: Sequence[str] = (), backward_end_ns: int | None = None) -> None:
        """Emit this iteration's step record (the one ``finish`` returns) through the agent, crash-
        durable when this returns. Call at the end of backward; never raises."""
        end = now_ns() if backward_end_ns is None else backward_end_ns
        try:
            synced = self.synced
            order = self._order
            key = (len(order) if synced else -1, tuple(unused_parameters))
            templates = self._templates
            template = templates[key] if key in templates else self._template(key)
            values: tuple[int, ...] = (
                self.step, self._fwd_start, self._fwd_end, self._bwd_start or end, end, *self._blocked_spans()
            )  # fmt: skip
            if template is not None:
                if synced:
                    values = (*values, *self._ready, *self._launch, *self._done, *order, *self._seqs)
                if len(values) == template.width:
                    agent.emit_templated(template, values)
                    RECORDER.settle_folded(carried=template.implies is not None)
                    return
        except Exception:  # the record below is the same one; only its durability is at stake
            pass
        agent.emit(self.finish(unused_parameters, end))
        RECORDER.settle_folded(carried=False)

    def _blocked_spans(self) -> tuple[int, int, int]:
        """Time blocked in other collectives (between steps, in forward, in backward) in this step;
        marks the start of the next between-steps span."""
        blocked = self._blocked
        if blocked is None:  # no forward_start yet
            return 0, 0, 0
        now = blocked.ns
        self._blocked_at_end = now
        forward_end = self._blocked_at_forward_end
        return self._blocked_between, forward_end - self._blocked_at_start, now - forward_end

    def _template(self, key: tuple[int, tuple[str, ...]]) -> RecordTemplate | None:
        """The template for steps of this shape (None when its fixed fields do not make a valid record,
        e.g. a parameter name the wire format refuses: ``emit`` then sends the dict, which the agent
        checks and counts)."""
        if len(self._templates) >= MAX_TEMPLATES:
            self._templates.clear()
        order_length, unused = key
        fixed: dict[str, Any] = {
            "kind": "step",
            "rank": self.rank,
            "synced": order_length >= 0,
            "unused_parameters": list(unused),
        }
        variables: list[str | tuple[str, int]] = list(_HEAD)
        if order_length < 0:
            # An unsynchronised step (no_sync) has no bucket arrays: the same empty lists ``finish`` sends.
            for name in (*_BUCKET_TIMES, "bucket_bytes", "ready_order", "collective_seqs"):
                fixed[name] = []
        else:
            n = len(self.bucket_bytes)
            fixed["bucket_bytes"] = list(self.bucket_bytes)
            variables += [(name, n) for name in _BUCKET_TIMES]
            variables += [("ready_order", order_length), ("collective_seqs", n)]
        try:
            template: RecordTemplate | None = RecordTemplate(fixed, variables)
        except ValueError:
            template = None
        if template is not None and order_length >= 0 and self.ends_pg is not None:
            template.implies = ("bucket_ends", self.ends_pg)  # agent/implied.py makes the ends
        self._templates[key] = template
        return template

    def finish(
        self, unused_parameters: Sequence[str] = (), backward_end_ns: int | None = None
    ) -> dict[str, Any]:
        """The ``step`` record for this iteration as a dict (``emit`` sends the same record)."""
        end = now_ns() if backward_end_ns is None else backward_end_ns
        synced = self.synced
        between, forward, backward = self._blocked_spans()
        return {
            "kind": "step",
            "rank": self.rank,
            "step": self.step,
            "synced": synced,
            "forward_start_ns": self._fwd_start,
            "forward_end_ns": self._fwd_end,
            # No hook fired (e.g. a backward that reached no parameter): backward is the finalizer alone.
            "backward_start_ns": self._bwd_start or end,
            "backward_end_ns": end,
            "blocked_between_ns": between,
            "blocked_forward_ns": forward,
            "blocked_backward_ns": backward,
            "bucket_ready_ns": list(self._ready) if synced else [],
            "allreduce_start_ns": list(self._launch) if synced else [],
            "allreduce_end_ns": list(self._done) if synced else [],
            "bucket_bytes": list(self.bucket_bytes) if synced else [],
            "ready_order": list(self._order) if synced else [],
            "unused_parameters": list(unused_parameters),
            "collective_seqs": list(self._seqs) if synced else [],
        }
