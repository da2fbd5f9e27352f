"""Collective recorder: a per-process-group sequence number, op, shapes, dtypes, times and call site
for every collective this process issues. (Minimal interface; issue 5 completes it.)

Engine usage::

    seq = RECORDER.begin("default", "all_reduce", [tensor], reduce_op="SUM", source="engine", step=s)
    ...launch...
    RECORDER.end("default", seq, ok=True)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ddpscope.agent import emit
from ddpscope.agent.clock import now_ns
from ddpscope.ddp.progress import PROGRESS


class CollectiveRecorder:
    def __init__(self) -> None:
        self._seqs: dict[str, int] = {}
        # begin() runs on the training thread, end() may run on a gloo worker thread.
        self._lock = threading.Lock()
        self._local = threading.local()

    @contextlib.contextmanager
    def engine_call(self) -> Iterator[None]:
        """Mark torch.distributed calls made inside as the engine's own: the engine records them
        with begin()/end() itself, so the patched user-facing functions must not record them again."""
        local = self._local
        depth = getattr(local, "engine_depth", 0)
        local.engine_depth = depth + 1
        try:
            yield
        finally:
            local.engine_depth = depth

    def in_engine_call(self) -> bool:
        return getattr(self._local, "engine_depth", 0) > 0

    def begin(
        self,
        pg: str,
        op: str,
        tensors: Sequence[Any],
        *,
        reduce_op: str | None = None,
        source: str = "user",
        step: int | None = None,
        call_site: str | None = None,
    ) -> int:
        with self._lock:
            seq = self._seqs.get(pg, 0) + 1
            self._seqs[pg] = seq
        record = {
            "kind": "collective",
            "pg": pg,
            "coll_seq": seq,
            "op": op,
            "reduce_op": reduce_op,
            "shapes": [list(t.shape) for t in tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "call_site": call_site,
            "start_ns": now_ns(),
            "step": step,
            "source": source,
        }
        PROGRESS.inflight[(pg, seq)] = record
        if pg == "default":
            PROGRESS.last_coll_seq = seq
        PROGRESS.tick()
        emit(record)
        return seq

    def end(self, pg: str, seq: int, *, ok: bool = True, error: str | None = None) -> None:
        PROGRESS.inflight.pop((pg, seq), None)
        PROGRESS.tick()
        emit({"kind": "collective_end", "pg": pg, "coll_seq": seq, "end_ns": now_ns(), "ok": ok, "error": error})


RECORDER = CollectiveRecorder()
