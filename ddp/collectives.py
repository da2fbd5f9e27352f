"""Collective recorder: a per-process-group sequence number, op, shapes, dtypes, times and call site
for every collective this process issues, the engine's own and the user's calls through
``torch.distributed``.

Engine usage (the engine records its own calls and marks them so they are not recorded twice)::

    seq = RECORDER.begin("default", "all_reduce", [tensor], reduce_op="SUM", source="engine", step=s)
    with RECORDER.engine_call():
        work = dist.all_reduce(tensor, async_op=True)
    ...
    RECORDER.end("default", seq, ok=True)

User calls are recorded once ``install()`` has patched the public ``torch.distributed`` functions
(see ``ddpscope.ddp._patch``). Every call emits a ``collective`` record *before* it enters torch: gloo
aborts the process on mismatched sizes, and the record of the call that killed it is the evidence a
post-mortem needs. Completion emits ``collective_end``, durable too: without it a post-mortem of a
killed rank would place it inside a collective it had left (~15-25 us a record with the caches cold,
``bench/cost_accounting.py``).

That record is made crash-durable before the call enters torch (``emit_durable``: stamped and copied
into the agent's memory-mapped write-ahead ring, no system call; the shipper reads the ring
if the process dies): gloo's abort comes ~1 ms after the call, inside the agent's 0.25 s batching
round, and a record still only in memory dies with the process. (It was a synchronous spool write
plus a wake-up of the shipper per collective, ~15 us and +40-80 us on a small all-reduce on 2 cores.) The engine's bucket
all-reduces get the same treatment: the layout check makes each bucket's shape equal on every rank,
but not every rank's *sequence* (a user collective, ``no_sync`` or a branch on one rank only puts a
bucket all-reduce against something else at the same seq, and either side may be the one aborted).
Only the clock's ping-pong (engine send/recv) skips it: fixed sizes, and it times round trips.

The engine's bucket all-reduces are *planned* (``plan``, once per bucket layout; ``begin_planned`` /
``end_planned`` each step): same group, op, shapes and dtypes every step, so their records are agent
templates and the hot path hands the agent three integers. It runs between a backward hook and the
all-reduce, with the caches cold from the backward pass, where every Python operation costs ~10x
its warm price: the ordinary ``begin`` + ``end`` measured ~105 us a bucket there, the planned pair
~40 us (``bench/cost_accounting.py``).

The recorder never raises into training: its own failures are counted in ``internal_errors`` and
logged once; the collective still runs.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from ddpscope.agent import RecordTemplate, emit, emit_durable, emit_templated, get_agent
from ddpscope.agent.clock import now_ns
from ddpscope.agent.log import get_logger
from ddpscope.ddp.issuing_threads import IssuingThreads
from ddpscope.ddp.progress import IN_STEP, PROGRESS, Progress
from ddpscope.ddp.signal_handlers import handling_signal

logger = get_logger(__name__)

MAX_USER_PLANS = 256
"""Distinct user calls remembered for planning (``begin_user``); more means shapes that keep changing."""
_UNSEEN = object()
_UNPLANNABLE = object()
RING_SIZE = 2000
"""Recent collectives kept in memory for the hang report (torch's Flight Recorder keeps 2000 too)."""
FOLD_WAIT_NS = 1_000_000_000
"""How long a folded end waits for its step record before the hang watchdog emits it on its own."""

# torch's ``Join`` (uneven inputs): a rank that ran out of data shadows its peers' collectives from
# join.py (its ``__exit__`` loop runs every Joinable's hooks), while the peers' side of those calls comes
# from their forward: their call sites differ by design. DDP's two join-only methods run in the peers'
# forward, outside join.py.
_JOIN_FILE = os.path.join("torch", "distributed", "algorithms", "join.py")
_DDP_FILE = os.path.join("torch", "nn", "parallel", "distributed.py")
_DDP_JOIN_METHODS = frozenset({"_check_global_requires_backward_grad_sync", "_find_common_rank"})
_USER, _INTERNAL, _JOIN, _DDP = 0, 1, 2, 3
"""Per-file verdicts of the call-site walk: the user's code, torch or ddpscope, join.py, DDP's module."""

_DDPSCOPE_DIRS = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep
    for p in (__file__, sys.modules["ddpscope.agent"].__file__ or "")
)


class PlannedCollective:
    """A collective issued again and again with the same group, op, shapes and dtypes: an engine's
    bucket all-reduce (planned once per bucket layout by ``CollectiveRecorder.plan``) or a user's call
    repeated from one line (``begin_user``). Its ``collective`` and ``collective_end`` records are agent
    templates (``agent.template``): ``begin_planned`` and ``end_planned`` hand the agent a few integers
    instead of a dict, which with the caches cold from the backward pass costs ~30 us a bucket instead
    of ~105 us (``bench/cost_accounting.py``)."""

    __slots__ = ("pg", "fixed", "begin", "end", "folded")

    def __init__(self, pg: str, fixed: dict[str, Any], stepped: bool = True, folded: bool = False) -> None:
        self.pg = pg
        self.fixed = fixed
        """The begin record's fields but coll_seq, start_ns and step."""
        self.folded = folded
        """Its successful ends travel in the step record (see ``CollectiveRecorder.end_planned``)."""
        self.begin: RecordTemplate | None = None
        self.end: RecordTemplate | None = None
        try:
            if stepped:  # the engine's, or a user's call inside a step: begin_planned passes the step
                self.begin = RecordTemplate(fixed, ("coll_seq", "start_ns", "step"), time_field="start_ns")
            else:  # a user's call between steps carries none (begin_planned passes None)
                self.begin = RecordTemplate(
                    {**fixed, "step": None}, ("coll_seq", "start_ns"), time_field="start_ns"
                )
            self.end = RecordTemplate(
                {"kind": "collective_end", "pg": pg, "ok": True, "error": None},
                ("coll_seq", "end_ns"),
                time_field="end_ns",
            )
        except ValueError:
            # Not a valid record (say, a group name the wire format refuses): the recorder's ordinary
            # begin/end then record it, and its check drops and counts what is wrong.
            logger.warning("ddpscope: no record template for %r", fixed, exc_info=True)
            self.begin = self.end = None

    def record(self, seq: int, start_ns: int, step: int | None) -> dict[str, Any]:
        """The ``collective`` record of one call, as ``begin`` would have made it."""
        return {**self.fixed, "coll_seq": seq, "start_ns": start_ns, "step": step}


class BlockedTime:
    """Nanoseconds one thread has spent blocked in collectives that are not a step's gradient
    all-reduces: a user's synchronous calls and the ``wait()`` on their async ones, the engine's buffer
    broadcasts. The step timer reads it at each phase boundary, because a rank that waits there for a
    slow peer has that peer's slowness in its own phase times (a slow data loader on one rank of a
    model with BatchNorm shows on every *other* rank as a long forward, in the buffer broadcast).

    One object per thread (``CollectiveRecorder.blocked_time``), so that a collective issued by another
    thread, which does not hold up training, is not counted; the timer keeps the training thread's
    object and may read it from the thread that runs the end of backward."""

    __slots__ = ("ns",)

    def __init__(self) -> None:
        self.ns = 0


class CollectiveRecorder:
    """Numbers, records and tracks the collectives of one process (one instance: ``RECORDER``)."""

    def __init__(self, ring_size: int = RING_SIZE, progress: Progress = PROGRESS) -> None:
        self.progress = progress
        """Where in-flight collectives and the progress counter live (the process-wide one)."""
        # itertools.count.__next__ is atomic under the GIL: user threads may issue collectives too,
        # and this costs less than a lock on the hot path.
        self._counters: dict[str, Iterator[int]] = {}
        self._threads = IssuingThreads(site=lambda: self.call_site(3))
        self._local = threading.local()
        self._ring: collections.deque[dict[str, Any] | _Planned] = collections.deque(maxlen=ring_size)
        """Records, or for planned collectives (plan, seq, start_ns, step): built only when read."""
        self._ends: collections.deque[tuple[str, int, int, bool]] = collections.deque(maxlen=ring_size)
        self._folded: collections.deque[tuple[PlannedCollective, int, int]] = collections.deque()
        """(plan, seq, end_ns) of folded ends whose step record is not out yet (``end_planned``)."""
        self._pending: dict[tuple[str, int], Any] = {}
        """Async user collectives (pg, seq) -> torch Work, ended by ``waited()`` or ``poll()``."""
        self._pending_ids: dict[int, tuple[str, int]] = {}
        """id(Work) -> (pg, seq): lets the patched ``Work.wait`` find its collective."""
        self._user_plans: dict[tuple[Any, ...], Any] = {}
        """A user call's (pg, op, reduce_op, call site, root, (shape, dtype) per tensor) -> its plan; None
        once seen; ``_UNPLANNABLE`` when its records cannot be a template (``begin_user``)."""
        self._skip_files: dict[str, int] = {}
        """filename -> ``_USER``, ``_INTERNAL``, ``_JOIN`` or ``_DDP`` (``_walk``)."""
        self._sites: dict[tuple[str, int], str] = {}
        self._torch_dir: str | None = None
        self._cwd = os.getcwd() + os.sep
        self.internal_errors = 0
        """Failures inside the recorder itself (swallowed so training goes on)."""
        self.group_ranks: dict[str, list[int]] = {}
        """Non-default group name -> its members' global ranks, sent on each of its collectives (the
        collector keeps a window of recent ones, so a once-only field would age out). Filled by
        ``register_group`` (the patches and ``groups.pg_name`` see the group objects); kept by
        ``reset()``: groups outlive numbering, and a new group object re-registers its name."""

    # -- engine interface ------------------------------------------------------------------------

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

    @contextlib.contextmanager
    def hook_call(self, begin: Callable[[], None]) -> Iterator[None]:
        """``engine_call`` around a user's comm hook: its torch.distributed calls are the bucket's
        reduction, which the caller records once, and ``begin`` (that record's begin) runs right before
        the first of them is issued. A hook that issues none (local SGD skipping a step, or a hook that
        returns a future of its own making that never completes) so leaves no record of a collective it
        did not make: its peers' waits then name it as the rank that never issued theirs. (A hook that
        calls the ProcessGroup object's methods directly is not seen, and records no collective either.)"""
        local = self._local
        local.pending_begin = begin
        try:
            with self.engine_call():
                yield
        finally:
            local.pending_begin = None

    def first_call(self) -> None:
        """Called by the patched torch.distributed functions for a call made inside an engine call: runs
        ``hook_call``'s ``begin`` once, before the first such call of a hook. Never raises."""
        local = self._local
        begin = getattr(local, "pending_begin", None)
        if begin is not None:
            local.pending_begin = None
            try:
                begin()
            except Exception:
                self._failed("begin")

    def in_engine_call(self) -> bool:
        return getattr(self._local, "engine_depth", 0) > 0

    def blocked_time(self) -> BlockedTime:
        """The calling thread's ``BlockedTime`` (made on first use)."""
        local = self._local
        blocked: BlockedTime | None = getattr(local, "blocked", None)
        if blocked is None:
            blocked = local.blocked = BlockedTime()
        return blocked

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
        durable: bool | None = None,
        root: int | None = None,
        shapes: list[list[int]] | None = None,
        dtypes: list[str] | None = None,
        tag: int | None = None,
        signal: str | None = None,
    ) -> int:
        """Number a collective about to be issued, emit its ``collective`` record; return its seq.

        ``root`` is the global rank of a rooted op's src (broadcast, scatter) or dst (reduce, gather);
        ``tag`` a point-to-point op's tag, recorded when not 0 (torch's default); ``signal`` the signal
        whose handler made the call (``signal_handlers``).
        ``shapes`` and ``dtypes`` (the engine's, computed once per bucket) save reading them from the
        tensors: with the caches cold from a backward pass that alone costs ~20 us a call.

        ``durable`` (default: every collective but the engine's send/recv) makes the record
        crash-durable before returning, so it survives an abort inside the collective (see the
        module doc).
        Never raises: on an internal failure it returns the seq (or 0 if even numbering failed).
        """
        seq = 0
        try:
            seq = self._number(pg)
            try:
                if shapes is None or dtypes is None:
                    shapes = [list(t.shape) for t in tensors]
                    dtypes = [dtype_name(t.dtype) for t in tensors]
            except Exception:
                # Keep the sequence gap-free: a record without shapes beats no record.
                self._failed("begin")
                shapes, dtypes = [], []
            record = {
                "kind": "collective",
                "pg": pg,
                "coll_seq": seq,
                "op": op,
                "reduce_op": reduce_op,
                "shapes": shapes,
                "dtypes": dtypes,
                "call_site": call_site,
                "start_ns": now_ns(),
                "step": step,
                "source": source,
            }
            # Optional fields only when they apply: the default group's all_reduce pays two tests.
            if pg != "default":
                ranks = self.group_ranks.get(pg)
                if ranks is not None:
                    record["group_ranks"] = ranks
            if root is not None:
                record["root"] = root
            if tag:
                record["tag"] = tag
            if signal is not None:
                record["signal"] = signal
            progress = self.progress
            progress.inflight[(pg, seq)] = record
            if pg == "default":
                progress.last_coll_seq = seq
            progress.counter += 1
            self._ring.append(record)
            if durable is None:
                durable = source != "engine" or op not in _UNDURABLE_ENGINE_OPS
            if durable:
                emit_durable(record)
            else:
                emit(record)
        except Exception:
            self._failed("begin")
        return seq

    def plan(
        self,
        pg: str,
        op: str,
        *,
        shapes: list[list[int]],
        dtypes: list[str],
        reduce_op: str | None = None,
        source: str = "engine",
        call_site: str | None = None,
        root: int | None = None,
        stepped: bool = True,
        folded: bool = False,
        tag: int | None = None,
    ) -> PlannedCollective:
        """The plan of a collective issued again and again with these fields (see ``PlannedCollective``);
        ``stepped``: its calls pass ``begin_planned`` a step (the engine's, a user's inside a step), else None;
        ``folded``: the caller's step record carries its ends (``end_planned``)."""
        fixed: dict[str, Any] = {
            "kind": "collective",
            "pg": pg,
            "op": op,
            "reduce_op": reduce_op,
            "shapes": shapes,
            "dtypes": dtypes,
            "call_site": call_site,
            "source": source,
        }
        ranks = self.group_ranks.get(pg) if pg != "default" else None
        if ranks is not None:
            fixed["group_ranks"] = ranks
        if root is not None:
            fixed["root"] = root
        if tag:
            fixed["tag"] = tag
        return PlannedCollective(pg, fixed, stepped, folded)

    def begin_user(
        self,
        pg: str,
        op: str,
        tensors: Sequence[Any],
        *,
        reduce_op: str | None,
        call_site: str | None,
        root: int | None = None,
        source: str = "user",
        tag: int | None = None,
    ) -> tuple[int, PlannedCollective | None]:
        """``begin`` for a user's call through the patched ``torch.distributed``; returns its seq and the
        plan to end it with (``end_planned``), or None (``end``).

        A call repeated from the same line with the same group, op and tensor shapes and dtypes (a loss
        or metric all-reduce every step) is planned on its second sighting: the tensors' shapes are then
        only hashed, not copied into a record, and the record is an agent template, ~65 instead of
        ~115 us a call with the caches cold.

        A user's call made inside a training step (from its forward to the end of its backward: in a
        module's forward, a loss function, a backward hook) carries that step; one between steps carries
        none. The collector tells by it a rank that made an extra call inside its step from one that left
        its training loop. A call from a signal handler is recorded with that signal and never planned:
        the same line called from the loop is another matter. Never raises."""
        plans = self._user_plans
        progress = self.progress
        step = progress.step if source == "user" and progress.phase in IN_STEP else None
        signal = handling_signal() if source == "user" else None
        if signal is not None:
            seq = self.begin(
                pg, op, tensors, reduce_op=reduce_op, source=source, step=step, call_site=call_site,
                root=root, tag=tag, signal=signal,
            )  # fmt: skip
            return seq, None
        try:
            shapes = [(t.shape, t.dtype) for t in tensors]
            key = (pg, op, reduce_op, call_site, root, tag, source, step is not None, *shapes)
            plan = plans.get(key, _UNSEEN)
        except Exception:  # not tensors: the ordinary path records what it can, torch raises
            key, plan = None, None
        if isinstance(plan, PlannedCollective):
            return self.begin_planned(plan, step), plan
        seq = self.begin(
            pg,
            op,
            tensors,
            reduce_op=reduce_op,
            source=source,
            step=step,
            call_site=call_site,
            root=root,
            tag=tag,
        )
        if key is not None and plan is not _UNPLANNABLE:
            try:
                if len(plans) >= MAX_USER_PLANS:
                    plans.clear()  # shapes that keep changing: start over rather than grow
                made = None
                if plan is not _UNSEEN:  # the second sighting
                    made = self.plan(
                        pg, op, shapes=[list(t.shape) for t in tensors], dtypes=[dtype_name(t.dtype) for t in tensors],
                        reduce_op=reduce_op, source=source, call_site=call_site, root=root, stepped=step is not None,
                        tag=tag,
                    )  # fmt: skip
                # A plan the wire format refuses is not made again at every call (it logs a warning).
                plans[key] = made if made is None or made.begin is not None else _UNPLANNABLE
            except Exception:
                self._failed("begin")
        return seq, None

    def begin_planned(self, plan: PlannedCollective, step: int | None) -> int:
        """``begin`` for a planned collective: numbered, tracked and recorded (crash-durable) the same
        way, at a third of the cost in the caller. ``step``: None for a plan made with ``stepped=False``.
        Never raises."""
        if plan.begin is None:
            f = plan.fixed
            return self.begin(
                plan.pg, f["op"], (), reduce_op=f["reduce_op"], source=f["source"], step=step,
                shapes=f["shapes"], dtypes=f["dtypes"], call_site=f["call_site"], root=f.get("root"),
            )  # fmt: skip
        seq = 0
        try:
            pg = plan.pg
            seq = self._number(pg)
            start = now_ns()
            entry = (plan, seq, start, step)
            progress = self.progress
            progress.inflight[(pg, seq)] = entry
            if pg == "default":
                progress.last_coll_seq = seq
            progress.counter += 1
            self._ring.append(entry)
            emit_templated(plan.begin, (seq, start) if step is None else (seq, start, step))
        except Exception:
            self._failed("begin")
        return seq

    def end_planned(self, plan: PlannedCollective, seq: int) -> None:
        """``end(ok=True)`` for a planned collective (a failure goes through ``end``). Never raises.

        A ``folded`` plan's end is not emitted here: the engine's step record, made moments later on the
        same thread, carries each bucket's sequence number and end time, and the agent's worker makes the
        ``collective_end`` records from it (``agent/implied.py``; the shipper too, from the write-ahead ring
        after a crash). That spares the training thread a ring write and the worker a record per bucket, ~40 %
        of what the recorder costs a step. Until the step record is out the end waits here
        (``settle_folded``); a step that ends otherwise gets its ends emitted as ever (``flush_folded``): by a
        failed collective (``end``), an error report, the next step's start, or the hang watchdog (after
        ``FOLD_WAIT_NS`` or with its hang report)."""
        if plan.end is None:
            self.end(plan.pg, seq)
            return
        try:
            end_ns = now_ns()
            progress = self.progress
            progress.inflight.pop((plan.pg, seq), None)
            progress.counter += 1
            self._ends.append((plan.pg, seq, end_ns, True))
            if plan.folded:
                self._folded.append((plan, seq, end_ns))
            else:
                emit_templated(plan.end, (seq, end_ns))
        except Exception:
            self._failed("end")

    def settle_folded(self, carried: bool) -> None:
        """The step record is out: ``carried``, it holds the folded ends (made into records by the agent's
        worker), else (it went out the ordinary way, without them) they are emitted now. Never raises."""
        if not self._folded:
            return
        if carried:
            self._folded.clear()
        else:
            self.flush_folded()

    def flush_folded(self, before_ns: int | None = None) -> None:
        """Emit the folded ends still waiting for a step record (those that ended before ``before_ns``, or
        all): the watchdog's, the error paths' and a new step's way to say a bucket all-reduce is over when no
        step record will say it (at a step's start, what still waits belongs to a step whose backward raised).
        An end emitted twice (here and by the step record) is stored once. Safe from any thread; never
        raises."""
        folded = self._folded
        try:
            while folded and (before_ns is None or folded[0][2] < before_ns):
                plan, seq, end_ns = folded.popleft()
                if plan.end is not None:
                    emit_templated(plan.end, (seq, end_ns))
        except IndexError:
            pass  # the training thread settled them meanwhile
        except Exception:
            self._failed("flush_folded")

    def _number(self, pg: str) -> int:
        """The next sequence number on ``pg``; first ends the async collectives that completed, so
        their ends come before this collective's start."""
        counter = self._counters.get(pg)
        if counter is None:
            counter = self._counters.setdefault(pg, itertools.count(1))
        seq = next(counter)
        self._threads.note(pg, self.progress.step)
        if self._pending:
            self.poll()
        return seq

    def end(
        self, pg: str, seq: int, *, ok: bool = True, error: str | None = None, durable: bool = True
    ) -> None:
        """Mark collective (pg, seq) complete and emit ``collective_end`` (crash-durable unless not
        ``durable``: the clock's ping-pong, which times the gap the ring write would add). Safe from
        any thread."""
        try:
            if not ok and self._folded:
                self.flush_folded()  # this step's record will not come: its finished buckets say so first
            end_ns = now_ns()
            progress = self.progress
            progress.inflight.pop((pg, seq), None)
            if ok:
                progress.counter += 1
            else:
                progress.fail()  # the hang watchdog must not call this progress
            self._ends.append((pg, seq, end_ns, ok))
            record = {
                "kind": "collective_end",
                "pg": pg,
                "coll_seq": seq,
                "end_ns": end_ns,
                "ok": ok,
                "error": error,
            }
            if durable:
                emit_durable(record)
            else:
                emit(record)
        except Exception:
            self._failed("end")

    def register_group(self, pg: str, ranks: Sequence[int]) -> None:
        """Remember the members (global ranks) of non-default group ``pg`` for its records."""
        if pg != "default":
            members = [int(r) for r in ranks]
            if self.group_ranks.get(pg) != members:
                self.group_ranks[pg] = members
                self._user_plans.clear()  # their records carry the old members

    def forget_groups(self, pgs: Collection[str] | None) -> None:
        """Groups ``pgs`` were destroyed (None: every group, the world's included). torch names groups
        from a counter it restarts with the world group ("0", "1", ...), so a re-created group reuses a
        destroyed one's name: its numbering must restart at 1, as on a rank that never saw the old group
        (one that was not a member), or the collector would match #1 on one rank against #N on another.
        Its members go too. A collective whose completion was never seen (an async one nobody waited for,
        still queued when the group went) is no longer awaited: the hang watchdog must not wait for it
        forever, and its record keeps no end, which is what is known. Never raises."""
        try:
            # First the async ones that completed unseen: they end as they ended.
            self.poll()
            gone = (lambda pg: True) if pgs is None else set(pgs).__contains__
            for key in [k for k in self.progress.inflight if gone(k[0])]:
                self.progress.inflight.pop(key, None)
                work = self._pending.pop(key, None)
                if work is not None:
                    self._pending_ids.pop(id(work), None)
            for pg in [pg for pg in self._counters if gone(pg)]:
                del self._counters[pg]
            for pg in [pg for pg in self.group_ranks if gone(pg)]:
                del self.group_ranks[pg]
            self._user_plans.clear()  # they carry the old numbering's group and members
        except Exception:
            self._failed("forget_groups")

    # -- async completion ------------------------------------------------------------------------

    def track(self, pg: str, seq: int, work: Any) -> None:
        """Remember the Work of an async collective; it ends when ``Work.wait()`` returns (the patch in
        ``_patch`` calls ``waited``) or, if nobody waits, when ``poll()`` sees it completed.

        Not a future callback: a Python callback runs on a gloo thread and must take the GIL from the
        training thread, which cost 40-200 us per collective on a 2-core machine.
        """
        key = (pg, seq)
        self._pending[key] = work
        self._pending_ids[id(work)] = key

    def waited(self, work: Any, error: BaseException | None = None) -> None:
        """``work.wait()`` returned (or raised ``error``): end its collective if it is tracked."""
        key = self._pending_ids.pop(id(work), None)
        if key is not None and self._pending.pop(key, None) is not None:
            self.end(key[0], key[1], ok=error is None, error=None if error is None else str(error))

    def poll(self) -> None:
        """End every tracked async collective whose Work has completed (the end time is when this
        saw it: the next recorded collective or watchdog tick). Never raises."""
        try:
            for key, work in list(self._pending.items()):
                if not work.is_completed():
                    continue
                if self._pending.pop(key, None) is None:
                    continue  # another thread (the watchdog, a wait) got it first
                self._pending_ids.pop(id(work), None)
                error = work_failure(work)
                self.end(key[0], key[1], ok=error is None, error=error)
        except Exception:
            self._failed("poll")

    # -- reading ---------------------------------------------------------------------------------

    def recent(self, limit: int = 100) -> list[dict[str, Any]]:
        """The most recent collectives, oldest first, each a copy of its record plus ``end_ns`` and
        ``ok`` (None while in flight)."""
        ends = {(pg, seq): (end_ns, ok) for pg, seq, end_ns, ok in list(self._ends)}
        out = []
        for entry in list(self._ring)[-limit:]:
            record = _as_record(entry)
            end_ns, ok = ends.get((record["pg"], record["coll_seq"]), (None, None))
            item = {k: record[k] for k in _RECORD_FIELDS}
            item["end_ns"], item["ok"] = end_ns, ok
            out.append(item)
        return out

    def inflight(self) -> list[dict[str, Any]]:
        """Collectives issued and not completed, oldest first, in the wire shape ``INFLIGHT``."""
        records = sorted(map(_as_record, list(self.progress.inflight.values())), key=lambda r: r["start_ns"])
        return [{k: r[k] for k in _INFLIGHT_FIELDS} for r in records]

    def last_seq(self, pg: str = "default") -> int:
        """Highest sequence number issued on ``pg`` (0 before the first)."""
        counter = self._counters.get(pg)
        # itertools.count's repr is "count(N)" with N the next value; reading it consumes nothing.
        return int(repr(counter)[6:-1]) - 1 if counter is not None else 0

    # -- helpers ---------------------------------------------------------------------------------

    def call_site(self, depth: int = 1) -> str | None:
        """``file:line`` of the first frame outside torch and ddpscope, ``depth`` frames up."""
        return self.call_origin(depth + 1)[0]

    def relative_path(self, filename: str) -> str:
        """``filename`` as call sites show it: relative to the working directory when under it."""
        return filename.removeprefix(self._cwd)

    def call_origin(self, depth: int = 1) -> tuple[str | None, str]:
        """(``call_site(depth)``, ``"join"`` when the call comes from torch's ``Join`` machinery, else
        ``"user"``): the source a user's collective is recorded with."""
        try:
            try:
                frame: Any = sys._getframe(depth + 1)
            except ValueError:  # called near the bottom of the stack (e.g. from a module's top level)
                frame = sys._getframe(1)
            return self._walk(frame)
        except Exception:
            self._failed("call_site")
        return None, "user"

    def frame_site(self, frame: Any) -> str | None:
        """``file:line`` of ``frame`` or of the first frame above it outside torch and ddpscope."""
        return self._walk(frame)[0]

    def _walk(self, frame: Any) -> tuple[str | None, str]:
        """The call site above ``frame`` and the source (``call_origin``), in one walk of ``f_back``
        with cached per-file verdicts: a few hundred nanoseconds, where ``traceback.extract_stack``
        costs tens of microseconds. The frames passed on the way tell a ``Join`` call."""
        skip = self._skip_files
        source = "user"
        while frame is not None:
            code = frame.f_code
            filename = code.co_filename
            verdict = skip.get(filename)
            if verdict is None:
                verdict = skip[filename] = self._verdict(filename)
            if verdict == _USER:
                key = (filename, frame.f_lineno)
                site = self._sites.get(key)
                if site is None:
                    site = self._sites[key] = f"{self.relative_path(filename)}:{frame.f_lineno}"
                return site, source
            if verdict == _JOIN or (verdict == _DDP and code.co_name in _DDP_JOIN_METHODS):
                source = "join"
            frame = frame.f_back
        return None, source

    def _verdict(self, filename: str) -> int:
        if self._torch_dir is None:
            torch_mod = sys.modules.get("torch")
            self._torch_dir = os.path.dirname(getattr(torch_mod, "__file__", "") or "/nonexistent") + os.sep
        path = os.path.abspath(filename)
        if path.startswith(_DDPSCOPE_DIRS):
            return _INTERNAL
        if not path.startswith(self._torch_dir):
            return _USER
        if path.endswith(_JOIN_FILE):
            return _JOIN
        return _DDP if path.endswith(_DDP_FILE) else _INTERNAL

    def _failed(self, where: str) -> None:
        self.internal_errors += 1
        if self.internal_errors == 1:
            logger.warning(
                "ddpscope collective recorder failed in %s; training goes on", where, exc_info=True
            )
        else:
            logger.debug("ddpscope collective recorder failed in %s", where, exc_info=True)

    def reset(self) -> None:
        """Forget all numbering and history (tests; a new process group generation)."""
        self._counters.clear()
        self._ring.clear()
        self._ends.clear()
        self._folded.clear()
        self._pending.clear()
        self._pending_ids.clear()
        self.progress.inflight.clear()
        self.progress.last_coll_seq = 0
        self._user_plans.clear()


_Planned = tuple[PlannedCollective, int, int, int | None]
"""How the recorder keeps a planned collective in flight and in its ring: (plan, seq, start_ns, step)."""


def _as_record(entry: dict[str, Any] | _Planned) -> dict[str, Any]:
    return entry if isinstance(entry, dict) else entry[0].record(entry[1], entry[2], entry[3])


_RECORD_FIELDS = (
    "pg",
    "coll_seq",
    "op",
    "reduce_op",
    "shapes",
    "dtypes",
    "call_site",
    "start_ns",
    "step",
    "source",
)
_INFLIGHT_FIELDS = ("pg", "coll_seq", "op", "shapes", "dtypes", "call_site", "start_ns")

_UNDURABLE_ENGINE_OPS = frozenset({"send", "recv"})
"""Engine ops whose record need not reach the spool before the call: the clock's fixed-size
ping-pong, where a spool write on one side would lengthen the round trip it measures."""

_DTYPE_NAMES: dict[Any, str] = {}
_REDUCE_NAMES: dict[Any, str] = {}


def work_failure(work: Any) -> str | None:
    """A completed Work's error message, or None if it succeeded. Read from its future: torch
    deprecates ``Work.exception()`` and ``is_success()`` with a warning printed into the user's log."""
    try:
        future = work.get_future()
    except Exception:  # a Work type without a future (torch's base Work): ask it the old way
        exc = work.exception() if hasattr(work, "exception") else None
        return None if exc is None else str(exc)
    return future_failure(future)


def future_failure(future: Any) -> str | None:
    """A completed future's error message, or None if it succeeded."""
    try:
        future.value()
    except Exception as e:
        return str(e)
    return None


def group_pg_name(group: Any) -> str:
    """``"pg:<torch's group name>"`` for a non-default group (its id when torch gave it none): the name
    its collectives are numbered under, the same on every rank of it (torch names groups in creation
    order). Read from the object, so it works on a destroyed group too."""
    name = getattr(group, "group_name", None)
    return f"pg:{name}" if name else f"pg:{id(group):x}"


def dtype_name(dtype: Any) -> str:
    """A dtype as records name it (``float32``), the same on every rank."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def reduce_name(red: Any) -> str:
    """'SUM', 'MAX', ...: the same on every rank (a ReduceOp object's repr holds its address)."""
    red = getattr(red, "op", red)  # a ReduceOp object (e.g. premul-sum) wraps its RedOpType
    try:
        name = _REDUCE_NAMES.get(red)
    except TypeError:
        return str(red).rsplit(".", 1)[-1]
    if name is None:
        name = _REDUCE_NAMES[red] = str(red).rsplit(".", 1)[-1]
    return name


RECORDER = CollectiveRecorder()
"""The process-wide recorder; the engine, the adapter, the patches and the watchdog share it."""


def disabled() -> bool:
    """True when ddpscope is switched off (``DDPSCOPE_DISABLED=1`` or ``configure(disabled=True)``):
    then no patches, no hooks and no watchdog thread are installed."""
    try:
        config = getattr(get_agent(), "config", None)
        if config is not None and hasattr(config, "disabled"):
            return bool(config.disabled)
    except Exception:
        logger.debug("no agent config; reading DDPSCOPE_DISABLED", exc_info=True)
    return os.environ.get("DDPSCOPE_DISABLED", "").strip().lower() in ("1", "true", "yes", "on")


def install() -> bool:
    """Patch the public torch.distributed collectives so user calls are recorded. Idempotent.

    Returns True when the patches are in place (False when torch.distributed is unavailable or
    ``DDPSCOPE_DISABLED=1``).
    """
    from ddpscope.ddp import _patch

    return _patch.install(RECORDER)


def uninstall() -> None:
    """Restore the original torch.distributed functions (tests)."""
    from ddpscope.ddp import _patch

    _patch.uninstall()
