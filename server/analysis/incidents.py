"""Cross-rank diagnosis: what went wrong in a job, which rank caused it, and where in the code.

``diagnose(snapshot, now_s)`` returns one ``Incident`` per diagnosis, oldest first. Kinds:

- ``rank_error`` / ``rank_crashed``: a rank raised (or died of a signal). Peers' "Connection reset by
  peer" or timeout errors are *victims*, attached to the origin as ``related``, never blamed. A rank
  that went quiet with no error and no exit just before its peers lost their connections crashed
  (SIGKILL, the OOM killer): ``rank_crashed`` with the peers' errors attached. The same error raised
  on several ranks (the engine's cross-rank unused-parameter check) is one incident, blamed on the
  ranks its message names. ``call_site`` is the innermost user frame of the stack.
- ``rank_exited_early``: a rank left cleanly (its loop ended, or SIGTERM with no other failure in the
  job) while peers that had got as far kept training and then lost their connection to it or hung;
  their lost connections are blamed on it.
- ``rank_silent``: no record for ``silent_after_s`` while other ranks are alive or waiting (SIGSTOP, a
  deadlocked data loader). ``job_silent``: every rank quiet without a clean exit.
- ``missing_collective``: ranks stuck in collective #N of a process group that other ranks never
  issued; culprits are the ranks that never entered it.
- ``mismatch``: at the same (group, sequence number) ranks issued different ops, reduce ops, shapes or
  dtypes, or the same collectives from the same code in a different order. The call-site rule: two
  ranks calling from different lines at #N is only an ordering bug when each rank also uses the other's
  line elsewhere in the window (same code, different order: gloo pairs them silently and returns wrong
  results); lines one rank never uses are different code paths, legitimately rank-dependent.
  A user collective paired with the engine's own all-reduce is a mismatch whatever its shape (the
  engine runs in lockstep). A send pairs with a recv; two sends (or recvs) at one number deadlock.
  Culprits are the minority; on a tie, the side whose call the others never make anywhere, else every
  rank but rank 0's side (the message says so). An extra or skipped collective is recognised by the
  shift it leaves in the sequence. A cycle of waits across process groups (each rank blocked in a
  collective of one group, waiting for a rank blocked in another) is a deadlock, one ``mismatch``
  naming the cycle (``wait_graph``).
- ``hang``: a hang report (active, or ``active=False`` once resolved) with phase, step, pending buckets,
  the parameters whose gradients never arrived, the in-flight collective and every thread's stack; its
  ``culprit_ranks`` come from the evidence above, read through the chain of waits: a peer that is
  itself blocked in another collective is replaced by the ranks it waits for.
- ``unused_parameters``: parameters that got no gradient on some ranks but not all, or named by the
  engine's "did not receive grad" error; grouped by ranks and bucket.
- a ``warning`` record's code, e.g. ``unsynced_gradients``: gradients a rank's DDP never all-reduced
  (``warning_incidents``); the same warning from several ranks is one incident.
- ``nonfinite_loss``: the rank whose loss went NaN or Inf first, before DDP's all-reduce spread it to every
  rank, and whether the ranks recovered (``nonfinite``); with ``DDPSCOPE_CHECK_GRADIENTS``,
  ``nonfinite_gradient``: the same of gradients that went NaN or Inf inside backward, with the bucket and
  the parameters.
- ``replicas_diverged`` and ``nonfinite_parameters``: the ranks' copies of the model compared through their
  ``replica_digest`` records (``replica_divergence``).
- ``models_differ``: ranks whose models list their parameters in different orders (same shapes, so
  torch's constructor accepts them and DDP averages different layers together), from their ``layout``
  records (``model_order``).
- ``settings_differ``: ranks whose ``rank_start`` disagree on settings that must agree (versions, world
  size, hang timeout, how the model is wrapped), the odd ones as culprits (``rank_settings``).
- ``job_id_shared``: two runs reporting under one job id at once, a rank with two live processes
  (``shared_job``).

After a restart under the same job id (torchrun ``--max-restarts``), the previous processes' incidents
are kept with ``active=False``, their message starting "Before the ranks restarted"; the job's status
and the current incidents count only the new processes.

Pure functions of a ``JobSnapshot``; no database, no HTTP.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpscope.agent.records import UNSYNCED_GRADIENTS
from ddpscope.agent.torch_waits import RENDEZVOUS_PLACE
from ddpscope.server.analysis.collective_diagnosis import (
    CollectiveIndex,
    mismatch_incidents,
    missing_incidents,
    sync_schedule_incidents,
)
from ddpscope.server.analysis.crash_loop import note_crash_loop, note_repeated_stop
from ddpscope.server.analysis.hang_diagnosis import hang_incidents, tags_differ, through_past_waits
from ddpscope.server.analysis.incident_model import (
    STOP_SIGNALS,
    UNEVEN_DATA_ADVICE,
    Incident,
    Record,
    capitalized,
    describe,
    error_brief,
    first_line,
    name_groups,
    never_issued,
    position,
    ranks_phrase,
    record_s,
    step_phrase,
    user_frame,
    where,
)
from ddpscope.server.analysis.memory import memory_incidents, note_memory, note_oom_loop
from ddpscope.server.analysis.mismatch_causes import SAME_LINE, SIZE_ABORT
from ddpscope.server.analysis.model_order import model_incidents
from ddpscope.server.analysis.native_wait import exiting, native_wait
from ddpscope.server.analysis.nonfinite import nonfinite_incidents
from ddpscope.server.analysis.rank_settings import settings_incidents
from ddpscope.server.analysis.replica_divergence import replica_incidents
from ddpscope.server.analysis.restart_race import stale_peer_address
from ddpscope.server.analysis.shared_job import shared_job_incidents, without_twins
from ddpscope.server.analysis.snapshot import (
    PER_PROCESS,
    JobSnapshot,
    RankSteps,
    UnusedParameter,
    parameter_order,
    process_starts,
    split_attempts,
    split_restart,
)
from ddpscope.server.analysis.stalled_culprits import note_stalled_culprits
from ddpscope.server.analysis.status import (
    DEFAULT_SILENT_AFTER_S,
    LOST_PEER_ERROR,
    MONITORED_BARRIER,
    TIMEOUT_ERROR,
    Liveness,
    is_secondary,
    liveness,
)
from ddpscope.server.analysis.store_file import leftover_store_file
from ddpscope.server.analysis.stuck import stuck_outside
from ddpscope.server.analysis.torch_errors import torch_error_advice
from ddpscope.server.analysis.wait_graph import WaitGraph, deadlock_incidents
from ddpscope.server.analysis.warning_incidents import reported_elsewhere, warning_incidents

__all__ = ["Incident", "diagnose"]

CLOCK_SLACK_S = 1.0
"""Tolerance when ordering events of different ranks: aligned clocks agree to microseconds on one host,
but records are emitted a little after the fact (an error is reported after its stack is formatted)."""

_TORCH_UNUSED = re.compile(
    r"(?:Parameters|Parameter indices) which did not receive grad for rank (\d+):\s*(.+)"
)
_TORCH_MODEL_DIFFERS = re.compile(
    r"DDP expects same model across all ranks, but Rank (\d+) has (\d+) params, while rank (\d+) has "
    r"inconsistent (\d+) params"
)
"""torch DDP's construction-time check: each rank compares its parameter count with one other rank's, so
every rank raises it, and only all the messages together tell the odd rank (``_odd_models``)."""
_LAYOUT_DIFFERS = re.compile(r"Ranks \[([\d, ]+)\] differ from rank \d+")
"""The engine's construction-time check: every rank raises it, naming the ranks whose model differs."""
_WITHOUT_DDPSCOPE = re.compile(r"DistributedDataParallel: ranks \[([\d, ]+)\] run without ddpscope")
_CHECKPOINT_FAILED = re.compile(r"CheckpointException ranks:dict_keys\(\[([\d, ]+)\]\)")
"""torch.distributed.checkpoint's error, raised on every rank, naming the ranks whose part of a save or
load failed (torch 2.13: ``CheckpointException ranks:dict_keys([1])``)."""
_LAST_ERROR = re.compile(r"^(\w+(?:Error|Exception|Exit)\b.*)$", re.M)
"""A formatted traceback's error lines (``FileNotFoundError: [Errno 2] ...``)."""
"""The engine's refusal of peers that run without ddpscope (``ddp/peer_presence.py``): they are the cause."""
FROZEN_AFTER_WRAP = "frozen (requires_grad=False) after"
"""What the engines' missing-gradient errors (and ddpscope's note on torch's) say of parameters frozen after
wrapping (``ddp/drift.py``)."""
BACKWARD_CUT_SHORT = "began on this rank and never finished"
"""What ddpscope's note on torch's unfinished-reduction error says when the previous backward raised and
was caught (``ddp/drift.py``): the parameters torch lists were not unused."""
_ENGINE_UNUSED = re.compile(
    r"parameters \[([^\]]*)\] in bucket\(s\) \[([^\]]*)\] received no gradient on rank\(s\) \[([^\]]*)\]"
)


@dataclass(frozen=True, slots=True)
class _Named:
    """What an error message says is at fault: the ranks, and the parameters without a gradient."""

    ranks: tuple[int, ...]
    parameters: tuple[str, ...]
    bucket: int | None = None


def _odd_models(errors: Sequence[Record]) -> tuple[int, ...] | None:
    """The ranks whose parameter count differs from most ranks', from torch DDP's model check on every
    rank (each names itself and one peer); all the counted ranks when no count has a majority."""
    counts: dict[int, int] = {}
    for e in errors:
        m = _TORCH_MODEL_DIFFERS.search(str(e.get("message", "")))
        if m:
            counts[int(m.group(1))], counts[int(m.group(3))] = int(m.group(2)), int(m.group(4))
    if not counts:
        return None
    tally = Counter(counts.values())
    most = max(tally.values())
    usual = [n for n, k in tally.items() if k == most]
    if len(usual) > 1:
        return tuple(sorted(counts))
    return tuple(sorted(r for r, n in counts.items() if n != usual[0]))


def _first_failure(error: Record) -> str | None:
    """The first error line of a traceback that wraps another (torch.distributed.checkpoint carries each
    failed rank's traceback in its exception), when it is not the error itself."""
    lines = [m.group(1) for m in _LAST_ERROR.finditer(str(error.get("stack") or ""))]
    own = f"{error.get('error_type')}:"
    inner = [line for line in lines if not line.startswith(own)]
    return first_line(inner[-1])[:300] if inner else None


def _named(error: Record) -> _Named | None:
    """Parse the errors that name the ranks at fault: the engines' unused-parameter errors (torch's and
    ddpscope's), the engine's different-model check and torch's monitored_barrier timeout; None for
    other errors."""
    message = str(error.get("message", ""))
    m = _ENGINE_UNUSED.search(message)
    if m:
        buckets = [int(b) for b in re.findall(r"\d+", m.group(2))]
        ranks = tuple(int(r) for r in re.findall(r"\d+", m.group(3)))
        return _Named(ranks, tuple(re.findall(r"'([^']*)'", m.group(1))), buckets[0] if buckets else None)
    m = MONITORED_BARRIER.search(message)
    if m:
        return _Named(tuple(int(r) for r in re.findall(r"\d+", m.group(1))), ())
    m = (
        _LAYOUT_DIFFERS.search(message)
        or _WITHOUT_DDPSCOPE.search(message)
        or _CHECKPOINT_FAILED.search(message)
    )
    if m:
        return _Named(tuple(int(r) for r in re.findall(r"\d+", m.group(1))), ())
    m = _TORCH_UNUSED.search(message)
    if m and BACKWARD_CUT_SHORT not in f"{message} {error.get('stack') or ''}":  # notes are in the stack
        # Parameter names under TORCH_DISTRIBUTED_DEBUG=INFO, indices otherwise.
        items = [t for t in re.split(r"[,\s]+", m.group(2).strip()) if t]
        return _Named((int(m.group(1)),), tuple(t for t in items if not t.isdigit()) or tuple(items))
    return None


_IN_TORCH_DISTRIBUTED = re.compile(r"torch[/\\](?:distributed|nn[/\\]parallel)[/\\]")
"""A frame of torch.distributed or of torch's DDP (whose constructor broadcasts the model's state through
``torch/distributed/utils.py``): a fatal signal there is gloo's abort on a collective the ranks disagree on."""

_FATAL_SIGNAL = re.compile(r"SIG(?:SEGV|ABRT|FPE|BUS|ILL|KILL)|FatalSignal")
"""The ``error_type`` of a fatal signal's ``rank_error`` (the shipper reads faulthandler's output after the
rank died). Only the type says so: an exception's message may name a signal or an abort (a DataLoader
worker "killed by signal", a ValueError about "SIGMA") and still be an ordinary exception of the rank."""


def diagnose(
    snapshot: JobSnapshot, now_s: float, *, silent_after_s: float = DEFAULT_SILENT_AFTER_S
) -> list[Incident]:
    """Every incident in the job at ``now_s`` (aligned-clock seconds), oldest first."""
    settings = settings_incidents(snapshot)  # the whole snapshot: it sets aside ranks not restarted yet
    settings += shared_job_incidents(snapshot)  # the whole snapshot too: the older run is the evidence
    # A duplicated rank's second process is not the rank: its incident says what became of it.
    snapshot = without_twins(snapshot)
    starts = process_starts(snapshot)
    snapshot, previous = split_restart(snapshot)
    restart_s = min((t / 1e9 for r, (_, t) in starts.items() if r not in snapshot.retired), default=now_s)
    live = liveness(snapshot, now_s, silent_after_s=silent_after_s)
    colls = CollectiveIndex(snapshot, live)
    blame: dict[int, str] = {}
    out = _silent_incidents(snapshot, live, blame)
    out += _early_exit_incidents(snapshot, live, blame)
    mismatches = mismatch_incidents(colls, snapshot, blame)
    out += mismatches
    out += sync_schedule_incidents(colls, blame, mismatches)
    graph = WaitGraph(colls, live, {(i.pg, i.seq): i.culprit_ranks for i in mismatches if i.pg and i.seq})
    out += deadlock_incidents(graph, blame)
    missing = missing_incidents(colls, live, snapshot, blame, graph)
    out += missing
    out += _error_incidents(live, snapshot, colls, blame, mismatches, previous)
    out += hang_incidents(snapshot, live, colls, missing, blame, graph)
    out += _unused_incidents(snapshot, live)
    out += warning_incidents(snapshot)
    out += nonfinite_incidents(snapshot)
    out += replica_incidents(snapshot)
    out += model_incidents(snapshot)
    out += memory_incidents(
        snapshot, [r for r in live.ranks if r not in live.exits and r not in live.crashed]
    )
    note_memory(out, snapshot, live.last_alive_s)
    note_stalled_culprits(out, snapshot)
    out += settings
    note_crash_loop(out, snapshot, previous)
    history = _before_restart_incidents(previous, restart_s, silent_after_s)
    note_repeated_stop(out, history)
    note_oom_loop(out, history)
    out += [i for attempt in history for i in attempt]
    name_groups(out, colls.group_ranks)
    out.sort(key=lambda i: (i.time_s if i.time_s is not None else now_s, i.kind, i.rank or 0))
    return out


def _silent_incidents(snapshot: JobSnapshot, live: Liveness, blame: dict[int, str]) -> list[Incident]:
    out = []
    others_waiting = sorted(live.active_hangs)
    in_rendezvous = _in_rendezvous(live)
    for r in live.silent:
        age = live.age_s(r)
        if age is None and in_rendezvous:
            out.append(_never_joined_incident(snapshot, r, in_rendezvous))
            blame.setdefault(r, "never joined the rendezvous")
            continue
        if age is None:
            head = f"Rank {r} has never reported"
        else:
            head = f"Rank {r} has sent nothing for {age:.0f} s{where(snapshot, r)}"
        waiting = (
            f"while {ranks_phrase(others_waiting)} {'hangs' if len(others_waiting) == 1 else 'hang'} waiting"
            if others_waiting
            else "while the other ranks keep reporting"
        )
        out.append(
            Incident(
                kind="rank_silent",
                message=f"{head} {waiting}: it is stopped (SIGSTOP, a debugger), its Python thread holds the "
                "GIL (a regex backtracking, a C extension call that keeps it), it is deadlocked (e.g. a data "
                "loader) or cut off from the collector; dump its stack (py-spy dump --native --pid <pid>).",
                rank=r,
                step=position(snapshot, r)[0],
                culprit_ranks=[r],
                time_s=live.last_alive_s.get(r),
            )
        )
        blame.setdefault(r, "went silent")
    for r, quiet_s in sorted(live.stopped_silent.items()):
        if r not in live.silent:  # a rank still silent now was told above
            out.append(_stopped_silent_incident(snapshot, live, r, quiet_s))
            blame.setdefault(r, "went silent")
    if live.lost:
        quiet_s = live.now_s - max(live.last_alive_s.values(), default=live.now_s)
        never = [r for r in live.ranks if r not in live.last_alive_s]
        elsewhere = sorted(set(never) & reported_elsewhere(snapshot))
        if elsewhere and all(r in live.exits for r in live.last_alive_s):
            msg = (
                f"Every rank heard of has exited, and {ranks_phrase(elsewhere)} of the job's {len(live.ranks)} "
                f"sent {'its' if len(elsewhere) == 1 else 'their'} records elsewhere, under another job id or to "
                "another collector (see the job_ids_differ or collectors_differ incident)"
            )
            if rest := [r for r in never if r not in elsewhere]:
                msg += f"; {ranks_phrase(rest)} never reported"
        elif never and all(r in live.exits for r in live.last_alive_s):
            # Every rank heard of has exited: the job is over, and the ranks left are ones never heard of.
            msg = (
                f"Every rank heard of has exited, and {ranks_phrase(never)} of the job's {len(live.ranks)} never "
                "reported: never started (a launch that failed on its node), ran without ddpscope, or the world "
                "size counts ranks that were never launched (a WORLD_SIZE larger than the ranks started; see "
                "any settings_differ incident)"
            )
        else:
            msg = (
                f"No rank has reported for {quiet_s:.0f} s and not every rank exited cleanly: the job was killed, "
                "stopped, or lost its connection to the collector; check the scheduler and the ranks' logs"
            )
        if live.hangs_at_death:
            msg += (
                f". {capitalized(ranks_phrase(live.hangs_at_death))} hung until then (see the hang incidents)"
            )
        if live.dead:
            msg += f". After {live.dead_after_s:.0f} s of silence the job counts as dead (failed)"
        # One rank falling quiet well before the rest (stopped, deadlocked, while the others waited for
        # it and were killed later) is where to look first.
        seen = {r: live.last_alive_s[r] for r in live.ranks if r in live.last_alive_s and r not in live.exits}
        first = min(seen, key=seen.__getitem__, default=None)
        lead = (
            0.0
            if first is None
            else min((t for r, t in seen.items() if r != first), default=0.0) - seen[first]
        )
        culprits = []
        if first is not None and lead > live.silent_after_s:
            culprits = [first]
            msg += (
                f". Rank {first} fell quiet {lead:.0f} s before the others{where(snapshot, first)}: "
                "start with it (the others were probably waiting for it)"
            )
        out.append(
            Incident(
                kind="job_silent",
                message=msg + ".",
                rank=first if culprits else None,
                culprit_ranks=culprits,
                time_s=max(live.last_alive_s.values(), default=None),
            )
        )
    return out


def _awaited_after_loop(snapshot: JobSnapshot, r: int, stranded: Sequence[int]) -> Record | None:
    """The first collective a stranded peer made after its training loop (a user's call outside any step)
    and never completed, which rank ``r`` never issued."""
    issued = {(c["pg"], c["coll_seq"]) for c in snapshot.collectives if c["rank"] == r}
    for c in snapshot.collectives:
        if (
            c["rank"] in stranded
            and c.get("source") == "user"
            and c.get("step") is None
            and not c.get("ok")
            and ":p2p:" not in c["pg"]
            and (c["pg"], c["coll_seq"]) not in issued
        ):
            return c
    return None


def _in_rendezvous(live: Liveness) -> list[int]:
    """The ranks whose open hang report shows them waiting in ``init_process_group``'s rendezvous."""
    return sorted(
        r
        for r, h in live.active_hangs.items()
        if (wait := native_wait(h)) is not None and wait.place.startswith(RENDEZVOUS_PLACE)
    )


def _never_joined_incident(snapshot: JobSnapshot, r: int, waiting: Sequence[int]) -> Incident:
    """A rank never heard of while others wait for the job's ranks in the rendezvous: most likely one that
    never got there (the rendezvous cannot tell the collector which ranks it has)."""
    return Incident(
        kind="rank_silent",
        message=f"Rank {r} has never reported while {ranks_phrase(waiting)} "
        f"{'waits' if len(waiting) == 1 else 'wait'} in init_process_group's rendezvous for the ranks that have "
        "not joined it: it never started (a launch that failed on its node, or one that gave no process this "
        "RANK and two processes another: the second of those fails at once with EADDRINUSE on MASTER_PORT if "
        "its RANK is 0), is still running code of its own "
        "before init_process_group (a dataset downloaded or prepared on that rank alone), died before it, or "
        "cannot reach MASTER_ADDR:MASTER_PORT (a wrong address or port, a firewall); its launcher's log says "
        "which. Start every rank of the job with the same MASTER_ADDR and MASTER_PORT (or init_method), an "
        "address every host can reach. (A rank running without ddpscope, or importing it after "
        "init_process_group, never reports either.)",
        rank=r,
        step=position(snapshot, r)[0],
        culprit_ranks=[r],
        time_s=None,
    )


def _stopped_silent_incident(snapshot: JobSnapshot, live: Liveness, r: int, quiet_s: float) -> Incident:
    """A rank that had been silent for ``silent_after_s`` when a signal stopped it (``stopped_silent``): its
    exit must not make it look like a healthy rank cancelled with the rest."""
    exit_ = live.exits.get(r)
    silent_s = (live.stopped_at_s(r) or live.now_s) - quiet_s
    if exit_ is not None:
        head = (
            f"Rank {r} sent nothing for {silent_s:.0f} s{where(snapshot, r)} until it was "
            f"stopped by {STOP_SIGNALS[str(exit_.get('reason'))]}"
        )
    else:
        stopped = {o: e for o, e in live.exits.items() if e.get("reason") in STOP_SIGNALS}
        first = min(stopped.values(), key=record_s)
        head = (
            f"Rank {r} had sent nothing for {silent_s:.0f} s{where(snapshot, r)} when "
            f"{ranks_phrase(stopped)} {'was' if len(stopped) == 1 else 'were'} stopped by "
            f"{STOP_SIGNALS[str(first.get('reason'))]}, and it never reported an exit (killed after the "
            "signal, by SIGKILL, or still frozen)"
        )
    return Incident(
        kind="rank_silent",
        message=f"{head}: not even its heartbeat thread ran, so its Python thread held the GIL (a regex "
        "backtracking, a C extension call that keeps it) or the process was frozen (SIGSTOP, a debugger), "
        "and it was no healthy rank cancelled with its job. While such a rank is silent, py-spy dump --native "
        "--pid <pid> shows where it is.",
        rank=r,
        step=position(snapshot, r)[0],
        culprit_ranks=[r],
        time_s=quiet_s,
    )


def _early_exit_incidents(snapshot: JobSnapshot, live: Liveness, blame: dict[int, str]) -> list[Incident]:
    """A rank that left cleanly (its loop ended, or SIGTERM) while peers that had got as far as it had
    were still training, and those peers then failed or hung waiting for it. (Ranks that finish at
    different steps on purpose, under torch's ``Join``, leave their peers running: no incident.)"""
    out = []
    # A launcher SIGTERMs every rank once one fails (torchrun does): then the failure is the cause.
    other_cause = bool(live.crashed) or any(not is_secondary(e) for e in live.errors)
    for r, exit_ in sorted(live.exits.items()):
        reason = exit_.get("reason")
        stopped = reason in STOP_SIGNALS
        if not (stopped or reason == "finished") or (stopped and other_cause):
            continue
        if r in live.stopped_silent:
            continue  # silent before it was stopped: that is its incident (rank_silent), not the stop
        left_s = record_s(exit_)
        if stopped and _peer_failed_before(live, r, left_s):
            # The launcher's teardown: a peer died (even of a timeout waiting for this rank) and torchrun
            # stopped the rest. Why the peer waited is the hang's story, not an early exit.
            continue
        mine = snapshot.steps.get(r)
        last = mine.last_step if mine else None

        # A rank whose loop ended may linger (post-processing, a checkpoint) while its peers time out
        # waiting for the next step's all-reduce: its loop ended when its last step did.
        loop_end_s = mine.last_step_end_ns / 1e9 if mine and reason == "finished" else left_s
        stranded_ranks = [
            o for o in live.ranks if o != r and _stranded(snapshot, live, o, mine, left_s, loop_end_s)
        ]
        if not stranded_ranks:
            continue
        how = (
            f"was stopped by {STOP_SIGNALS[str(reason)]}"
            if stopped
            else "left its training loop and exited normally"
        )
        advice = (
            "Something outside the job stopped this rank alone (a preemption, a time or memory limit, "
            "torchrun's agent, a manual kill): check the scheduler's and the launcher's logs for it."
            if reason == "sigterm"
            else "Something interrupted this rank alone: Ctrl-C in its terminal, a launcher or script "
            "sending it SIGINT, or code raising KeyboardInterrupt itself (its log's traceback tells which); "
            "check who did (a KeyboardInterrupt ends training, it is not an error in it)."
            if reason == "sigint"
            else UNEVEN_DATA_ADVICE
        )
        caught = [e for e in live.errors if e["rank"] == r and not e.get("fatal") and not is_secondary(e)]
        if caught and reason == "finished":
            # The rank raised, its loop caught the exception and went on to the next batch: it ran one
            # synced step fewer than its peers for each, and so ran out of batches first.
            first = caught[0]
            when = step_phrase(first.get("step"), first.get("phase"), started=True)
            times = f" ({len(caught)} times)" if len(caught) > 1 else ""
            advice = (
                f"It raised{when}{times} and kept running: {first.get('error_type')}: "
                f"{first_line(first.get('message', '')).rstrip('.')} (see its rank_error). Its training loop "
                "caught the exception and skipped that step, so it ran fewer synced steps than its peers. "
                "Skip a batch on every rank or on none (e.g. all_reduce a skip flag), or let the error end the job."
            )
        elif skipped := _skipped_backwards(snapshot, r, stranded_ranks):
            advice = skipped
        elif around := _around_the_wrapper(snapshot, r, last):
            advice = around
        awaited = _awaited_after_loop(snapshot, r, stranded_ranks) if reason == "finished" else None
        if awaited is not None:
            # Its peers had finished training too: what they waited in is a call after the loop (a final
            # metric, a barrier before saving) this rank never made.
            advice = (
                "Make the calls after the training loop on every rank or on none (an all-reduce of a final "
                "metric, a barrier before saving), and destroy the process group only after the last one."
            )
        after = f" after step {last}" if last is not None else ""
        hung = [o for o in stranded_ranks if o in live.active_hangs]
        timed_out = [
            o
            for o in stranded_ranks
            if o not in hung and not LOST_PEER_ERROR.search(str(live.fatal.get(o, {}).get("message", "")))
        ]
        failed = [o for o in stranded_ranks if o not in hung and o not in timed_out]
        fate = " and ".join(
            part
            for part in (
                f"{ranks_phrase(failed)} then lost {'its connection' if len(failed) == 1 else 'their connections'} to it"
                if failed
                else "",
                f"{ranks_phrase(timed_out)} timed out waiting for it" if timed_out else "",
                f"{ranks_phrase(hung)} now hang waiting for it" if hung else "",
            )
            if part
        )
        out.append(
            Incident(
                kind="rank_exited_early",
                message=(
                    f"Rank {r} exited normally{after} without making {describe(awaited)} (collective "
                    f"#{awaited['coll_seq']} of group {awaited['pg']}), a call after training that rank "
                    f"{awaited['rank']} waited in; {fate}. {advice}"
                    if awaited is not None
                    else f"Rank {r} {how}{after} while {ranks_phrase(stranded_ranks)} "
                    f"{'was' if len(stranded_ranks) == 1 else 'were'} still training; {fate}. {advice}"
                ),
                rank=r,
                step=last,
                culprit_ranks=[r],
                time_s=left_s,
            )
        )
        blame.setdefault(r, "exited early")
    return out


def _skipped_backwards(snapshot: JobSnapshot, r: int, stranded: Sequence[int]) -> str | None:
    """Why rank ``r`` ran out of batches first, when it ran more forward passes without a backward than the
    ranks it left behind (a batch skipped after its forward: step numbers count forwards, step records
    backward passes); None otherwise."""

    def forwards_only(rank: int) -> int | None:
        steps = snapshot.steps.get(rank)
        return None if steps is None else steps.last_step + 1 - steps.count

    mine = forwards_only(r)
    theirs = [n for o in stranded if (n := forwards_only(o)) is not None]
    if mine is None or not theirs or mine <= max(theirs):
        return None
    extra = mine - max(theirs)
    return (
        f"It ran {extra} more forward pass{'es' if extra > 1 else ''} without a backward than "
        f"{ranks_phrase(stranded)} (its step numbers count forwards: its steps 0 to "
        f"{snapshot.steps[r].last_step} had {snapshot.steps[r].count} backward passes). A batch skipped "
        "after its forward (a `continue` before backward()) synchronizes nothing, so this rank ran out of "
        f"batches {extra} gradient sync{'s' if extra > 1 else ''} before its peers. Skip a batch on every rank "
        "or on none (e.g. all_reduce a skip flag first)."
    )


def _around_the_wrapper(snapshot: JobSnapshot, r: int, last: int | None) -> str | None:
    """Why rank ``r`` ran out of batches first, when it said gradients reached its DDP model that no forward
    through the wrapper had prepared (``unsynced_gradients``): a training step through ``model.module``
    is no DDP step, so it ran a synced step fewer than its peers for each. None otherwise."""
    said = [
        w
        for w in snapshot.warnings
        if w["rank"] == r
        and w["code"] == UNSYNCED_GRADIENTS
        and (last is None or w.get("step") is None or w["step"] <= last)
    ]
    if not said:
        return None
    first = min(said, key=record_s)
    at = f" at {first['call_site']}" if first.get("call_site") else ""
    when = f" after step {first['step']}" if first.get("step") is not None else ""
    return (
        f"Its backward(){at}{when} gave the model gradients that no forward through the "
        "DistributedDataParallel wrapper had prepared (see the unsynced_gradients incident): a training step "
        "through model.module, or another path around the wrapper, is no DDP step and synchronizes nothing, "
        "so this rank ran out of batches a gradient sync before its peers. Call the DDP model itself for "
        "every training forward."
    )


TEARDOWN_AFTER_S = 0.05
"""A launcher stops the other ranks at least this long after one died (torchrun polls its workers)."""


def _peer_failed_before(live: Liveness, rank: int, stopped_s: float) -> bool:
    """Another rank died (a fatal error, or an exit with an error) before ``rank`` was stopped."""
    for o in live.ranks:
        if o == rank:
            continue
        fatal = live.fatal.get(o)
        exit_ = live.exits.get(o)
        died_s = [
            record_s(x) for x in (fatal, exit_ if exit_ and exit_.get("reason") == "error" else None) if x
        ]
        if died_s and min(died_s) < stopped_s - TEARDOWN_AFTER_S:
            return True
    return False


def _stranded(
    snapshot: JobSnapshot, live: Liveness, o: int, mine: RankSteps | None, left_s: float, loop_end_s: float
) -> bool:
    """Rank ``o`` had got as far as a rank that left (its steps ``mine``) at ``left_s`` (its loop ended at
    ``loop_end_s``), was still in the job, and then lost its connection to a peer, timed out waiting in
    a step the other never began, or hung. As far: as high a step number, or as many backward passes
    (step records): a rank that skipped a backward numbers its steps ahead of the syncs it ran."""
    theirs = snapshot.steps.get(o)
    last = mine.last_step if mine is not None else None
    if mine is not None and (
        theirs is None or (theirs.last_step < mine.last_step and theirs.count < mine.count)
    ):
        return False  # it had not got as far: the other rank leaving is not what stopped it
    other_exit = live.exits.get(o)
    if other_exit is not None and other_exit.get("reason") != "error":
        return False
    hang = live.active_hangs.get(o)
    if hang is not None and exiting(hang):
        return False  # it finished too, and waits in Python's exit for a thread of its own
    fatal = live.fatal.get(o)
    # A peer's lost connection after the exit; its own bug would be a primary error.
    if fatal is None or not is_secondary(fatal):
        return o in live.active_hangs
    if record_s(fatal) >= left_s - CLOCK_SLACK_S:
        return True
    # A timeout in a later step than the leaving rank's last, after that step: the leaving rank was out
    # of its loop (lingering before its exit) while this one waited for it.
    step = fatal.get("step")
    later_step = last is not None and step is not None and step > last
    return (later_step and record_s(fatal) >= loop_end_s - CLOCK_SLACK_S) or o in live.active_hangs


def _error_incidents(
    live: Liveness,
    snapshot: JobSnapshot,
    colls: CollectiveIndex,
    blame: dict[int, str],
    mismatches: Sequence[Incident] = (),
    previous: JobSnapshot | None = None,
) -> list[Incident]:
    """``previous``: what the processes before a restart left (``split_restart``), if any."""
    primaries = [e for e in live.errors if not is_secondary(e)]
    victims = [e for e in live.errors if is_secondary(e)]
    attached: set[int] = set()
    out = []
    # The same error raised on several ranks (the engine's cross-rank unused-parameter check fails
    # everywhere at once) is one diagnosis, blamed on the ranks its message names.
    # Unnamed errors with the same type and first line on several ranks (a bug in code every rank
    # runs, a shared bad input) are one diagnosis too, with every such rank an origin.
    named_of = {id(p): _named(p) for p in primaries}
    odd = _odd_models(primaries)
    if odd is not None:
        for p in primaries:
            if _TORCH_MODEL_DIFFERS.search(str(p.get("message", ""))):
                named_of[id(p)] = _Named(odd, ())
    groups: dict[Any, list[dict[str, Any]]] = {}
    for p in primaries:
        named = named_of[id(p)]
        key = (
            # torch's Reducer error names only the rank raising it: the same parameters missing on
            # several ranks is one diagnosis, blamed on them all.
            (p.get("error_type"), p.get("step"), tuple(sorted(named.parameters)) or named.ranks)
            if named
            else (p.get("error_type"), first_line(p.get("message", "")), p.get("fatal"))
        )
        groups.setdefault(key, []).append(p)
    for same in groups.values():
        named = named_of[id(same[0])]
        if named:
            culprits = sorted({r for e in same for r in (named_of[id(e)] or named).ranks})
        else:
            culprits = sorted({e["rank"] for e in same})
        p = next((e for e in same if e["rank"] in culprits), same[0])
        others = [e for e in same if e is not p]
        related = others + [
            v
            for v in victims
            if v["rank"] != p["rank"] and record_s(v) >= record_s(p) - CLOCK_SLACK_S and id(v) not in attached
        ]
        attached.update(id(v) for v in related)
        crash = bool(_FATAL_SIGNAL.fullmatch(str(p.get("error_type", ""))))
        # A step number above 0 says the rank got past its first step (the snapshot of the processes
        # before a restart has no step records to ask).
        began = p["rank"] in snapshot.steps or (p.get("step") or 0) > 0
        # faulthandler's report (a native crash) knows no step: say where the rank last got to.
        unplaced = crash and p.get("step") is None
        where_txt = (
            where(snapshot, p["rank"])
            if unplaced
            else step_phrase(p.get("step"), p.get("phase"), started=began)
        )
        if p.get("thread") and not p.get("fatal"):
            head = f"Rank {p['rank']}'s thread {p['thread']!r} died (the rank kept running){where_txt}"
        else:
            head = f"Rank {p['rank']} {'died' if p.get('fatal') else 'raised (and kept running)'}{where_txt}"
        msg = f"{head}: {p.get('error_type')}: {first_line(p.get('message', '')).rstrip('.')}"
        if BACKWARD_CUT_SHORT in str(p.get("stack") or ""):
            # torch's advice (unused parameters) is wrong here; ddpscope's note on the error says why.
            msg += f" ({_backward_cut_short(str(p['stack']))})"
        names = _resolved_names(named, snapshot) if named else []
        if named and names != list(named.parameters):
            msg += f" (parameter indices {', '.join(named.parameters)} are {', '.join(names)})"
        if others:
            msg += f"; {ranks_phrase(e['rank'] for e in others)} reported the same error"
        lost = [v for v in related if v not in others]
        if lost:
            msg += f"; {ranks_phrase(v['rank'] for v in lost)} then failed because of it (lost connection)"
        aborted_on = (
            next(
                (
                    m
                    for m in mismatches
                    if SIZE_ABORT in m.message and (m.time_s or 0.0) <= record_s(p) + CLOCK_SLACK_S
                ),
                None,
            )
            if crash
            else None
        )
        if aborted_on is not None:
            # gloo kills the rank that receives an unexpected size, whichever side issued the wrong one.
            culprits = list(aborted_on.culprit_ranks)
            cause = (
                f"the cause is {aborted_on.call_site}, which ran with a different size on each side"
                if SAME_LINE in aborted_on.message
                else f"the cause is on {ranks_phrase(culprits)}"
            )
            msg += (
                f". It aborted on the size mismatch at collective #{aborted_on.seq} of group {aborted_on.pg} "
                "(see the mismatch incident): gloo kills the rank that receives data of an unexpected size, "
                f"whichever side issued the wrong collective; {cause}"
            )
        elif (paired := _misaligned_by(p, mismatches)) is not None:
            # The engine found its bucket all-reduce paired with another collective: the mismatch's doing.
            culprits = list(paired.culprit_ranks)
            msg += (
                f". It was paired with another rank's different collective (see the mismatch incident at "
                f"collective #{paired.seq} of group {paired.pg}); the cause is on {ranks_phrase(culprits)}"
            )
        elif named and odd is not None and named.ranks == odd and len(odd) > 1:
            msg += (
                f". The ranks' models have different numbers of parameters, {ranks_phrase(odd)} each with its "
                "own and no majority to tell the odd one: compare how each rank builds its model (a layer "
                "or requires_grad=False that depends on the rank)"
            )
        elif named and p["rank"] not in culprits:
            msg += f". The cause is on {ranks_phrase(culprits)}"
        elif known := torch_error_advice(str(p.get("message", ""))):
            msg += f". {capitalized(known)}"
            if _CHECKPOINT_FAILED.search(str(p.get("message", ""))) and (inner := _first_failure(p)):
                msg += f". Rank {p['rank']}'s own failure: {inner}"
        elif others and not named:
            msg += ". Every rank listed raised it itself: the cause is in code they all run; start from the stack"
        else:
            msg += ". This rank is the origin: start from its stack"
        if aborted_on is None and crash and _IN_TORCH_DISTRIBUTED.search(p.get("stack") or ""):
            site = user_frame(p.get("stack"))
            msg += (
                f"; it died inside a torch.distributed call{f' at {site}' if site else ''}: gloo aborts when "
                "ranks disagree on a collective's size, so compare what each rank issued there"
            )
        msg += "."
        incident = _error_incident(
            "rank_crashed" if crash else "rank_error", p, msg, related, culprits=culprits
        )
        if unplaced:
            incident.step = position(snapshot, p["rank"])[0]
        if named:
            incident.parameters = names
            incident.bucket = named.bucket
        out.append(incident)
        if any(e.get("fatal") for e in same):
            raised = {e["rank"] for e in same}
            for r in culprits:
                # A rank the error names (an unused parameter, a skipped monitored_barrier) need not
                # have raised anything itself.
                blame.setdefault(
                    r,
                    "died of an error"
                    if r in raised
                    else f"is named as the cause by rank {p['rank']}'s error",
                )
    for r in live.crashed:
        last = colls.last(r, "default")
        step = position(snapshot, r)[0]
        cut_off = (
            f"{ranks_phrase(v['rank'] for v in victims)} then lost "
            f"{'its connection' if len({v['rank'] for v in victims}) == 1 else 'their connections'} to it"
        )
        if r in live.last_alive_s:
            msg = (
                f"Rank {r} stopped reporting with no error and no clean exit{where(snapshot, r)}, and {cut_off}: "
                "it was killed (SIGKILL, the OOM killer), crashed in native code or left through os._exit() "
                "(which runs no exit hook); check its log, its exit status and the host's kernel log."
            )
        else:
            # Nothing of it ever arrived, not even a heartbeat: ddpscope was not watching it yet, so how it
            # ended is unknown. An exception or an exit during set-up is likelier than a kill.
            msg = (
                f"Rank {r} never reported anything, and {cut_off}: it ended during its set-up, before "
                "ddpscope watched it (ddpscope starts with the process group when imported before "
                "init_process_group, else with the DDP model). It may have raised an exception, exited "
                "(sys.exit, a return from main), been killed (SIGKILL, the OOM killer) or crashed in native "
                "code; its log and exit status say which."
            )
        out.append(
            Incident(
                kind="rank_crashed",
                message=msg,
                rank=r,
                step=step,
                culprit_ranks=[r],
                call_site=last.get("call_site") if last else None,
                time_s=live.last_alive_s.get(r),
                related=[error_brief(v) for v in victims],
            )
        )
        blame.setdefault(r, "crashed")
        attached.update(id(v) for v in victims)
    left = [v for v in victims if id(v) not in attached]
    if left:
        first = left[0]
        culprits = sorted(blame)
        # A rank whose own hang report put it outside any collective before its peers gave up waiting
        # (asleep in forward, a stuck data loader): the timeout on the others is its doing.
        first_s = min(record_s(v) for v in left)
        stuck = stuck_outside(snapshot, at_s=first_s)
        if not culprits and stuck:
            culprits = sorted(stuck)
            cause = "; ".join(f"rank {r} was {st.phrase()}" for r, st in sorted(stuck.items()))
            cause = f"the cause is on {ranks_phrase(culprits)}: {cause}"
            for r in culprits:
                blame.setdefault(r, f"was {stuck[r].phrase()}")
        elif culprits:
            # A failed rank blamed elsewhere (the odd side of a mismatch) failed of its own doing.
            own = ""
            if {v["rank"] for v in left} >= set(culprits):
                own = " itself" if len(culprits) == 1 else " themselves"
            cause = f"the cause is on {ranks_phrase(culprits)}{own} (see the other incidents)"
        elif rendezvous := _rendezvous_short(left, live):
            culprits, cause = rendezvous
            cause = f"the cause is on {ranks_phrase(culprits)}: {cause}" if culprits else cause
            for r in culprits:
                blame.setdefault(r, "never joined the rendezvous")
        elif leftover := leftover_store_file(left, snapshot):
            cause = leftover
        elif awaited := _awaited_before(left, snapshot, live, colls):
            # What the failed ranks were waiting in when they gave up: a timeout's cause.
            culprits = sorted({r for _, _, held in awaited for r in held})
            cause = "; ".join(_awaited_phrase(v, c, held) for v, c, held in awaited)
            cause += "".join(f"; rank {r} {quiet}" for r in culprits if (quiet := live.silence(r, first_s)))
            cause = f"the cause is on {ranks_phrase(culprits)}: {cause}"
            for *_, held in awaited:
                for r, why in held.items():
                    blame.setdefault(r, why)
        elif tagged := _tags_at_failure(left, colls):
            culprits, why = tagged
            cause = f"the cause is on {ranks_phrase(culprits)}: {why.removeprefix('; ')}"
            for r in culprits:
                blame.setdefault(r, "waited in a transfer whose peer used another tag")
        elif previous is not None and (stale := stale_peer_address(left, previous.rank_errors)):
            cause = stale
        else:
            cause = "no rank reported a cause: look for a rank killed by the OS or a network failure"
        msg = (
            f"{capitalized(ranks_phrase(v['rank'] for v in left))} failed waiting for a peer ({first.get('error_type')}: "
            f"{first_line(first.get('message', ''))}); {cause}.{_timed_out_first(left, snapshot)}"
        )
        out.append(_error_incident("rank_error", first, msg, left[1:], culprits=culprits))
    return out


def _tags_at_failure(failed: Sequence[Record], colls: CollectiveIndex) -> tuple[list[int], str] | None:
    """``tags_differ`` for the send or receive a failed rank was in when it gave up (ended not ok)."""
    for v in failed:
        rank = v["rank"]
        for pg, by_rank in colls.by_pg.items():
            if ":p2p:" not in pg:
                continue
            for c in by_rank.get(rank, {}).values():
                if c.get("ok") is False and (found := tags_differ(c, rank, colls)) is not None:
                    return found
    return None


_STORE_SHORT = re.compile(r"waiting for clients\. (\d+)/(\d+) clients joined")
"""torch's TCPStore host (rank 0, at MASTER_ADDR:MASTER_PORT) when its rendezvous timed out."""
_STORE_UNREACHED = re.compile(r"timed out after \d+ ?ms while trying to connect to \(([^,]+), (\d+)\)")
"""A client rank of that store when it never got through to it."""


def _rendezvous_short(failed: Sequence[Record], live: Liveness) -> tuple[list[int], str] | None:
    """``(culprits, why)`` when ranks failed in ``init_process_group``'s rendezvous: rank 0's store waited
    for ranks that never came ("1/2 clients joined": the ranks nothing was ever heard of), or a rank never
    reached the store (rank 0's side: never started, or out of reach). None for any other failure."""
    for v in failed:
        message = str(v.get("message", ""))
        if short := _STORE_SHORT.search(message):
            joined, expected = int(short.group(1)), int(short.group(2))
            missing = [r for r in range(expected) if r not in live.last_alive_s]
            return missing, (
                f"init_process_group's rendezvous timed out with {joined} of {expected} ranks joined; "
                f"{'those named' if missing else 'the others'} never started, were still running code of their "
                "own before init_process_group for longer than its timeout (a dataset downloaded or prepared on "
                "one rank alone), died before it, or cannot reach MASTER_ADDR:MASTER_PORT (a launch that failed "
                "on another node, a wrong address or port, a firewall)"
            )
        if unreached := _STORE_UNREACHED.search(message):
            host, port = unreached.group(1), unreached.group(2)
            culprits = [] if 0 in live.last_alive_s else [0]
            return culprits, (
                f"init_process_group could not reach the rendezvous store at {host}:{port} (MASTER_ADDR:MASTER_PORT, "
                "served by rank 0): rank 0 never started or died before it, or the address, the port or a "
                "firewall is wrong for this host"
            )
    return None


def _timed_out_first(failed: Sequence[Record], snapshot: JobSnapshot) -> str:
    """What to change when the failed ranks' process group timed out before their hang timeout, with no
    hang report before the error (its stacks would have shown where the ranks were): "" otherwise."""
    if not any(TIMEOUT_ERROR.search(str(v.get("message", ""))) for v in failed):
        return ""  # a peer that died ends the wait at once: the timeouts played no part
    if any(h["rank"] == v["rank"] and record_s(h) <= record_s(v) for v in failed for h in snapshot.hangs):
        return ""
    shorter = []
    for v in failed:
        start = snapshot.ranks.get(v["rank"], {})
        group_s, hang_s = start.get("group_timeout_s"), start.get("hang_timeout_s")
        if group_s is not None and hang_s is not None and group_s < hang_s:
            shorter.append((group_s, hang_s))
    if not shorter:
        return ""
    group_s, hang_s = min(shorter)
    return (
        f" No hang report came first: the process group's timeout ({group_s:g} s) is shorter than "
        f"DDPSCOPE_HANG_TIMEOUT ({hang_s:g} s), so torch ended the wait before ddpscope took every thread's "
        f"stack; set DDPSCOPE_HANG_TIMEOUT below {group_s:g} s on every rank."
    )


def _misaligned_by(error: Record, mismatches: Sequence[Incident]) -> Incident | None:
    """The mismatch behind the engine's ``MisalignedCollectivesError`` (its bucket all-reduce came back
    holding another collective's values): the first one found before the error, if any."""
    if error.get("error_type") != "MisalignedCollectivesError":
        return None
    before = [
        m for m in mismatches if m.seq is not None and (m.time_s or 0.0) <= record_s(error) + CLOCK_SLACK_S
    ]
    return min(before, key=lambda m: m.time_s or 0.0, default=None)


def _awaited_before(
    failed: Sequence[Record], snapshot: JobSnapshot, live: Liveness, colls: CollectiveIndex
) -> list[tuple[int, Record, dict[int, str]]]:
    """For each failed rank that was waiting in a collective when it gave up (its last hang report before
    the error shows it there or, when the error came before any hang report, as a process group's
    timeout shorter than the hang timeout does, its own record of the collective that failed or was
    still open): (rank, that collective, the ranks that held it up there, with why): the members that
    never issued it or, when such a member was itself blocked waiting for another rank then, that rank
    (see ``through_past_waits``). Empty when none did."""
    out: list[tuple[int, Record, dict[int, str]]] = []
    for v in failed:
        rank = v["rank"]
        if any(rank == o[0] for o in out):
            continue  # its second error (a bucket's failure reported, then the exception that ended it)
        reports = [
            h
            for h in snapshot.hangs
            if h["rank"] == rank and record_s(h) <= record_s(v) and h.get("inflight")
        ]
        c: Record
        if reports:
            inflight = min(max(reports, key=record_s)["inflight"], key=lambda x: x["start_ns"])
            pg, seq = inflight["pg"], inflight["coll_seq"]
            # The collective record has what the compact in-flight entry may lack (call site, step).
            c = {**inflight, **colls.by_pg.get(pg, {}).get(rank, {}).get(seq, {})}
        else:
            gave_up_in = _gave_up_in(rank, record_s(v), colls)
            if gave_up_in is None:
                continue
            c, pg, seq = gave_up_in, gave_up_in["pg"], gave_up_in["coll_seq"]
        never = never_issued(pg, seq)
        missing = {m: never for m in colls.behind(pg, seq, live) if m != rank}
        missing.update(_entered_after(rank, c, record_s(v), colls))
        if missing:
            out.append(
                (rank, c, through_past_waits(missing, snapshot, live, colls, record_s(v), keep={rank}))
            )
    return out


def _entered_after(rank: int, c: Record, error_s: float, colls: CollectiveIndex) -> dict[int, str]:
    """The members that issued ``c`` only once ``rank``, waiting in it since ``c``'s start, had given up
    at ``error_s``: a process group timeout shorter than a peer's stall (a slow checkpoint on one rank)
    fails the waiting ranks, and the late one then loses its connection in the same collective."""
    start_s = c["start_ns"] / 1e9
    late = {}
    for m, by_seq in colls.by_pg.get(c["pg"], {}).items():
        other = by_seq.get(c["coll_seq"])
        if m == rank or other is None:
            continue
        other_s = other["start_ns"] / 1e9
        if other_s >= error_s - CLOCK_SLACK_S and other_s - start_s > CLOCK_SLACK_S:
            late[m] = f"entered it {other_s - start_s:.1f} s after rank {rank}, when rank {rank} had given up"
    return late


def _gave_up_in(rank: int, error_s: float, colls: CollectiveIndex) -> Record | None:
    """The rank's oldest collective that failed, or was still open, when its error came at ``error_s``:
    what a timeout or a lost connection interrupted."""
    found: Record | None = None
    for by_rank in colls.by_pg.values():
        for c in by_rank.get(rank, {}).values():
            if c["start_ns"] / 1e9 > error_s + CLOCK_SLACK_S or (c.get("end_ns") is not None and c.get("ok")):
                continue
            if found is None or c["start_ns"] < found["start_ns"]:
                found = c
    return found


def _backward_cut_short(stack: str) -> str:
    """ddpscope's note on torch's unfinished-reduction error, from the stack that carries it."""
    line = next(x for x in stack.splitlines() if BACKWARD_CUT_SHORT in x)
    return line.strip().removeprefix("|").strip().removeprefix("ddpscope: ").rstrip(".")


def _awaited_phrase(rank: int, c: Record, held: Mapping[int, str]) -> str:
    """ "rank 2 was waiting in X, which rank 0 never issued", or, for a rank held up through another's
    wait, "..., held up by rank 1, which entered ... late, holding up rank 0 ..."."""
    never = never_issued(c["pg"], c["coll_seq"])
    direct = [r for r, why in held.items() if why == never]
    parts = [f"which {ranks_phrase(direct)} never issued"] if direct else []
    parts += [f"held up by rank {r}, which {why}" for r, why in held.items() if r not in direct]
    return (
        f"rank {rank} was waiting in {describe(c)}, collective #{c['coll_seq']} of group {c['pg']}, "
        + "; ".join(parts)
    )


def _error_incident(
    kind: str, e: Record, msg: str, related: Sequence[Record], *, culprits: list[int] | None = None
) -> Incident:
    return Incident(
        kind=kind,
        message=msg,
        rank=e["rank"],
        step=e.get("step"),
        culprit_ranks=[e["rank"]] if culprits is None else culprits,
        call_site=user_frame(e.get("stack")),
        stack=e.get("stack"),
        time_s=record_s(e),
        related=[error_brief(v) for v in related],
    )


def _before_restart_incidents(
    previous: JobSnapshot | None, restart_s: float, silent_after_s: float
) -> list[list[Incident]]:
    """The diagnosis of the processes that ran before the ranks restarted (torchrun ``--max-restarts``,
    a job resubmitted under the same id), as history: ``active=False``, and not what the job's status
    rests on. "It crashed at 3 a.m. and came back" must stay on record.

    Each earlier attempt (``snapshot.split_attempts``) is diagnosed like a job of its own at the moment
    the next one began: a SIGKILLed rank is found by the same silence-before-the-victims rule, and a hang
    in the first attempt is not hidden by the second one's failure to connect. Staleness verdicts
    (silent ranks) are dropped: by then every old process has stopped reporting by definition. One list per
    attempt, oldest first."""
    if previous is None:
        return []
    attempts = split_attempts(previous)
    ends = [_began_s(a) for a in attempts[1:]] + [restart_s]
    out: list[list[Incident]] = []
    for k, (attempt, ended_s) in enumerate(zip(attempts, ends, strict=True)):
        which = f"In attempt {k + 1} of {len(attempts) + 1}, before" if len(attempts) > 1 else "Before"
        out.append([])
        for incident in diagnose(attempt, ended_s, silent_after_s=silent_after_s):
            if incident.kind in ("rank_silent", "job_silent") or not incident.active:
                continue
            ago = f" ({ended_s - incident.time_s:.0f} s before it)" if incident.time_s is not None else ""
            incident.message = f"{which} the ranks restarted{ago}: {incident.message}"
            incident.active = False
            out[-1].append(incident)
    return out


def _began_s(attempt: JobSnapshot) -> float:
    """When the first process of an earlier attempt was first heard from (the end of the attempt before)."""
    return min(
        (r["time_ns"] / 1e9 for f in PER_PROCESS for r in getattr(attempt, f)),
        default=attempt.last_seen_s,
    )


# ------------------------------------------------------------------------------------ unused parameters


def _bucket_of(snapshot: JobSnapshot, rank: int | None) -> dict[str, int]:
    layouts = [lay for lay in snapshot.layouts if rank is None or lay["rank"] == rank] or snapshot.layouts
    if not layouts:
        return {}
    return {p: b["index"] for b in layouts[-1].get("buckets") or [] for p in b.get("parameters") or []}


def _resolved_names(named: _Named, snapshot: JobSnapshot) -> list[str]:
    """Parameter names of an error: torch without TORCH_DISTRIBUTED_DEBUG gives indices only, which the
    layout's parameter order turns back into names."""
    order = parameter_order(snapshot, named.ranks[0]) if named.ranks else []
    return [order[int(p)] if p.isdigit() and int(p) < len(order) else p for p in named.parameters]


def _buckets_phrase(buckets: Sequence[int]) -> str:
    if not buckets:
        return ""
    return f" (bucket{'s' if len(buckets) > 1 else ''} {', '.join(map(str, buckets))})"


def _unused_incidents(snapshot: JobSnapshot, live: Liveness) -> list[Incident]:
    stepping = sorted(snapshot.steps)
    groups: dict[tuple[int, ...], list[UnusedParameter]] = {}
    for u in snapshot.unused:
        # Unused everywhere is a property of the model (harmless with find_unused_parameters=True and
        # reported by the unused-parameters endpoint); unused on some ranks is a divergence to look at.
        # One skipped module is one incident, whichever buckets its parameters fell into.
        if len(stepping) > 1 and set(u.ranks) < set(stepping):
            groups.setdefault(tuple(u.ranks), []).append(u)
    out = []
    for ranks, items in sorted(groups.items()):
        names = [u.name for u in items]
        bucket_of = _bucket_of(snapshot, ranks[0])
        buckets = sorted({bucket_of[n] for n in names if n in bucket_of})
        used_on = [r for r in stepping if r not in ranks]
        first = min((u.first_step for u in items if u.first_step is not None), default=None)
        last = max((u.last_step for u in items if u.last_step is not None), default=None)
        steps = max(u.steps for u in items)
        when = (
            f", in {steps} step{'s' if steps > 1 else ''} from step {first} to step {last}"
            if first is not None and last != first
            else f", in step {first}"
            if first is not None
            else ""
        )
        out.append(
            Incident(
                kind="unused_parameters",
                message=f"{', '.join(names[:10])}{' …' if len(names) > 10 else ''} got no gradient on "
                f"{ranks_phrase(ranks)} but did on {ranks_phrase(used_on)}{_buckets_phrase(buckets)}{when}: "
                "the ranks run different code paths; "
                + (
                    "find_unused_parameters=True keeps this correct, but check the branch is intended."
                    if snapshot.find_unused_parameters
                    else "without find_unused_parameters=True this hangs or fails the next step."
                ),
                rank=ranks[0],
                step=first,
                bucket=buckets[0] if buckets else None,
                parameters=names,
                culprit_ranks=list(ranks),
            )
        )
    reported = {frozenset(i.parameters) for i in out}
    # The errors that name parameters without a gradient, one incident per set of parameters: torch's
    # Reducer raises on every rank, each naming only itself.
    named_errors: dict[frozenset[str], list[tuple[Record, _Named, list[str]]]] = {}
    for e in live.errors:
        named = _named(e)
        if named is None or not named.parameters:
            continue
        names = _resolved_names(named, snapshot)
        if frozenset(names) not in reported:
            named_errors.setdefault(frozenset(names), []).append((e, named, names))
    for same in named_errors.values():
        err, named, names = same[0]
        culprits = sorted({r for _, n, _ in same for r in n.ranks})
        bucket_of = _bucket_of(snapshot, culprits[0])
        buckets = (
            [named.bucket]
            if named.bucket is not None
            else sorted({bucket_of[n] for n in names if n in bucket_of})
        )
        step = err.get("step")
        when = f" in step {step}" if step is not None else ""
        if step is not None and "prior iteration" in str(err.get("message", "")):
            # torch notices at the next forward that the previous backward never finished its reduction.
            step -= 1
            when = f" in step {step} (torch noticed at the start of step {step + 1})"
        frozen = any(FROZEN_AFTER_WRAP in f"{x.get('message', '')} {x.get('stack', '')}" for x, _, _ in same)
        advice = (
            "they were frozen (requires_grad=False) after DistributedDataParallel was built: build it again "
            "after freezing, or pass find_unused_parameters=True."
            if frozen
            else "use them on every rank or pass find_unused_parameters=True."
        )
        out.append(
            Incident(
                kind="unused_parameters",
                message=f"Parameters {', '.join(names[:10])} received no gradient on "
                f"{ranks_phrase(culprits)}{when}{_buckets_phrase(buckets)}, so the gradient reduction could not "
                f"finish; {advice}",
                rank=culprits[0],
                step=step,
                bucket=buckets[0] if buckets else None,
                parameters=names,
                culprit_ranks=culprits,
                stack=err.get("stack"),
                time_s=record_s(err),
            )
        )
    return out
