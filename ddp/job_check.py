"""Ranks of one torch job that report to ddpscope under different job ids, or to different collectors.

A rank started with another ``DDPSCOPE_JOB`` than its peers (or ranks on several hosts that each derive
their id from their own launcher) sends its records under a job of its own: the collector sees two jobs,
each missing ranks. A rank whose ``DDPSCOPE_URL`` differs sends them to another collector (code
``collectors_differ``; the collector leaves out URLs that turn out to reach it too). The ranks of a torch job share one thing ddpscope can use without a collective: the
default process group's c10d store. Each rank writes there the job id it reports under, and a daemon
thread reads its peers'. When they differ, every rank says so in a ``warning`` record (code
``job_ids_differ``) under its own job id, so each of the jobs gets the incident, naming every id with its
ranks and the ranks that are probably misconfigured.

Usage (``monitor.enable`` calls it; once per default process group, a no-op for a world of one)::

    from ddpscope.ddp import job_check
    job_check.start(delay_s=2.0)

The keys live under ``ddpscope/job_check/<torchrun restart count>/`` of the store torch keeps for the
default group (itself prefixed by torch; torchrun keeps one store across restarts, so the count keeps an
earlier attempt's keys apart): ``rank/<r>`` rank r's claim (JSON: job, where the id came from, host,
collector URL), ``n`` how many ranks have written theirs, ``job/<hash>`` how many ranks claim that id at that
collector. A rank whose id
every rank shares is done after a handful of store operations (no O(world) read at start-up); only when
the ids differ does it read every claim. The training thread does none of this: ``start`` returns at
once, and nothing here raises into training. The claims and the warning's words are in ``job_ids_text``.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ddpscope.agent import emit_durable, get_agent
from ddpscope.agent.log import get_logger
from ddpscope.agent.records import COLLECTORS_DIFFER, JOB_IDS_DIFFER
from ddpscope.ddp.collectives import disabled
from ddpscope.ddp.job_ids_text import Claim, collectors_message, id_source, job_ids_message

logger = get_logger(__name__)

CODE = JOB_IDS_DIFFER
PEER_WAIT_S = 60.0
"""How long a rank waits for its peers' ids: they may start monitoring later (at their DDP model)."""
POLL_FIRST_S, POLL_MAX_S = 0.05, 2.0
"""The first pause between looks at the store, doubled each time up to the last."""
SETTLE_S = 5.0
"""How long ids that differ must stay different before a rank says so: a script that sets the agent's job
after ``init_process_group`` may reach that line seconds later on a loaded rank than on its peers."""


def own_claim() -> Claim:
    config = get_agent().config
    job = str(config.job)
    return Claim(job, id_source(job, os.environ), socket.gethostname(), str(config.url).rstrip("/"))


class JobCheck:
    """One rank's side of the check over one store; ``run`` is the whole of it, ``start`` runs it on a
    daemon thread. ``claim`` is read again at every look, so a script that configures the agent's job
    right after ``init_process_group`` publishes the id it then uses. ``alive`` is False once the default
    group is gone: the check stops touching a store its rank has left (a failed store operation writes
    a C++ stack trace to stderr).

    Every operation here answers at once (``check``, ``add``, ``set``, ``multi_get`` of keys known to
    exist; never a waiting ``get``), so the thread holds the store's client lock for one round trip. The
    hazard left: a store host that stops answering without closing the connection (SIGSTOPped, its
    network lost) blocks that round trip for good (measured: a ``check`` on a SIGSTOPped TCPStore host
    had not returned after 40 s, whatever the store's timeout), and the training thread's own later
    calls on the store then wait for the lock instead of timing out. The window is the check's few
    seconds, up to ``wait_s`` when a peer never says its id."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        claim: Callable[[], Claim] = own_claim,
        alive: Callable[[], bool] = lambda: True,
        restart: str = "0",
        wait_s: float = PEER_WAIT_S,
        delay_s: float = 0.0,
        settle_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.wait_s, self.delay_s = wait_s, delay_s
        self.settle_s = SETTLE_S if settle_s is None else settle_s
        self.message: str | None = None
        """The warning this rank sent, if any."""
        self.code = JOB_IDS_DIFFER
        """Its code: the ids differ, or (``collectors_differ``) one id goes to several collectors."""
        self._store, self._claim, self._alive, self._clock = store, claim, alive, clock
        self._prefix = f"ddpscope/job_check/{restart}/"
        self._published: Claim | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _key(self, rank: int) -> str:
        return f"{self._prefix}rank/{rank}"

    def _count_key(self, claim: Claim) -> str:
        """How many ranks send where ``claim`` does (its job at its collector)."""
        where = claim.destination.encode("utf-8", "surrogatepass")
        return f"{self._prefix}job/{hashlib.sha1(where).hexdigest()[:16]}"

    def _publish(self) -> Claim:
        """Write this rank's claim, or write it again if the agent's job changed since; return it."""
        claim, old = self._claim(), self._published
        if claim == old:
            return claim
        store = self._store
        store.set(self._key(self.rank), claim.encode())
        if old is None or claim.destination != old.destination:
            store.add(self._count_key(claim), 1)
            if old is None:
                store.add(self._prefix + "n", 1)  # after the claim: a counted rank's key is always there
            else:
                store.add(self._count_key(old), -1)
        self._published = claim
        return claim

    def run(self) -> str | None:
        """Publish, wait for the peers (up to ``wait_s``), compare; return the warning's message if the ids
        differ and still do ``settle_s`` later (the caller sends it). Raises what the store raises."""
        if self._stop.wait(self.delay_s) or not self._alive():
            return None
        claim = self._publish()
        started = self._clock()
        pause = POLL_FIRST_S
        while True:
            published = self._store.add(self._prefix + "n", 0)
            if published >= self.world_size or self._clock() - started >= self.wait_s:
                break
            if self._stop.wait(pause) or not self._alive():
                return None
            pause = min(POLL_MAX_S, pause * 2)
            claim = self._publish()
        if self._store.add(self._count_key(claim), 0) >= published:
            return None  # every rank heard from sends where this rank does: the common case ends here
        differ_since = self._clock()
        while self._clock() - differ_since < self.settle_s:
            if self._stop.wait(min(POLL_MAX_S, self.settle_s)) or not self._alive():
                return None
            claim = self._publish()
            published = self._store.add(self._prefix + "n", 0)
            if self._store.add(self._count_key(claim), 0) >= published:
                return None  # a peer (or this rank) set its job late: they agree now
        claims = self._read_claims()
        claims[self.rank] = claim
        message = job_ids_message(claims, self.world_size, self._clock() - started)
        if message is None and (message := collectors_message(claims)) is not None:
            self.code = COLLECTORS_DIFFER
        return message

    def _read_claims(self) -> dict[int, Claim]:
        store = self._store
        keys = [self._key(r) for r in range(self.world_size)]
        # Only keys that exist: a get of a missing key waits for it, for the store's whole timeout.
        present = keys if store.check(keys) else [k for k in keys if store.check([k])]
        claims = {}
        for key, raw in zip(present, store.multi_get(present) if present else [], strict=True):
            try:
                claims[int(key.rsplit("/", 1)[1])] = Claim.decode(raw)
            except (ValueError, KeyError, TypeError):
                logger.debug("ddpscope: unreadable job id claim under %s: %r", key, raw[:200])
        return claims

    def start(self) -> JobCheck:
        thread = threading.Thread(target=self._run, name="ddpscope-job-check", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # interpreter shutting down
            logger.debug("ddpscope: job id check not started", exc_info=True)
            return self
        self._thread = thread
        return self

    def wait(self, timeout_s: float) -> bool:
        """Wait for the check to end (tests, a script that exits early on purpose); True once it has."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        try:
            message = self.run()
        except Exception as e:
            # The thread boundary. A store gone (its host died, the job ended first) is for the peers'
            # reports to tell; anything else is ddpscope's own bug, said louder.
            log = logger.debug if isinstance(e, (OSError, *_store_errors())) else logger.warning
            log("ddpscope: the job id check of rank %d stopped", self.rank, exc_info=True)
            return
        if message is not None:
            self.message = message
            warn(self.rank, message, self.code)


def _store_errors() -> tuple[type[BaseException], ...]:
    error = getattr(sys.modules.get("torch.distributed"), "DistError", None)
    return (error,) if isinstance(error, type) else ()


def warn(rank: int, message: str, code: str = CODE) -> None:
    """Log ``message`` (written without the rank) and ship it as a ``warning`` record. Never raises."""
    try:
        logger.warning("ddpscope: rank %d: %s", rank, message)
        emit_durable({"kind": "warning", "step": None, "code": code, "message": message})
    except Exception:
        logger.debug("ddpscope: the warning about differing job ids failed", exc_info=True)


# ------------------------------------------------------------------------------- one per default group

_lock = threading.Lock()
_checked: weakref.ref[Any] | None = None
"""The default process group the last check was started for."""
_current: JobCheck | None = None
_atexit_registered = False


def start(delay_s: float = 0.0) -> JobCheck | None:
    """Start the check for the current default process group unless it ran for it already; None when
    there is nothing to check (ddpscope disabled, no default group, a world of one, a store not known to
    be thread-safe). Never raises. ``delay_s``: how long to wait before publishing (a script may set the
    agent's job right after ``init_process_group``)."""
    try:
        return _start(delay_s)
    except Exception:
        logger.warning("ddpscope: the job id check did not start", exc_info=True)
        return None


def _start(delay_s: float) -> JobCheck | None:
    global _checked, _current, _atexit_registered
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or disabled():
        return None
    c10d = dist.distributed_c10d
    with _lock:
        world = c10d.GroupMember.WORLD
        if world is None or (_checked is not None and _checked() is world):
            return _current
        _checked, _current = weakref.ref(world), None
        if dist.get_world_size() < 2:
            return None
        store = c10d._get_default_store()
        if not _thread_safe(store):
            logger.debug("ddpscope: no job id check over a %s", type(store).__name__)
            return None
        group = weakref.ref(world)  # the thread must not keep a destroyed group alive
        _current = JobCheck(
            store,
            dist.get_rank(),
            dist.get_world_size(),
            alive=lambda: _same(c10d.GroupMember.WORLD, group()),
            restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
            delay_s=delay_s,
        ).start()
        if not _atexit_registered:
            # At exit the store's host may be exiting too (its answers: C++ stack traces); no join: a
            # round trip in flight must not hold up the exit.
            atexit.register(stop, 0.0)
            _atexit_registered = True
        return _current


def _same(world: Any, group: Any) -> bool:
    return group is not None and world is group


def _thread_safe(store: Any) -> bool:
    """Whether ``store`` is one of torch's own, whose every operation takes a lock (TCPStore's
    ``activeOpLock_``, FileStore's, HashStore's): the training thread may use it at the same time (a
    ``new_group``). A store written in Python by the user promises nothing."""
    from torch._C import _distributed_c10d as c10d  # where torch.distributed takes its stores from

    while isinstance(store, c10d.PrefixStore):
        store = store.underlying_store
    return isinstance(store, (c10d.TCPStore, c10d.FileStore, c10d.HashStore))


def current() -> JobCheck | None:
    """The check started for the current default process group, if one was."""
    dist = sys.modules.get("torch.distributed")
    world = getattr(getattr(dist, "distributed_c10d", None), "GroupMember", None)
    checked = _checked() if _checked is not None else None
    return _current if world is not None and _same(world.WORLD, checked) else None


def stop(timeout_s: float = 1.0) -> None:
    """Stop the running check, if any (at exit, ``monitor.disable``)."""
    current = _current
    if current is not None:
        current.stop(timeout_s)


def _forget_after_fork() -> None:
    # A forked child (a DataLoader worker) has no check thread and is no rank of its own.
    global _current, _lock
    _current = None
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
