"""The sentence of a hang report: where a rank is stuck and what to look at next.

``hang_message`` builds it from what the watchdog sampled (``watchdog.py``): phase, step, pending
buckets, collectives in flight, the main thread's line, its CPU during the stall and the torch
machinery it is blocked in, if any (``agent/torch_waits.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ddpscope.agent.blocked_call import words as blocked_call_words
from ddpscope.agent.blocked_call import workers_words
from ddpscope.agent.torch_waits import TorchWait, blocked

ENV_HANG_TIMEOUT = "DDPSCOPE_HANG_TIMEOUT"
"""Seconds without progress before a hang report; default 300."""

_PHASE_WORDS = {
    "forward": "forward",
    "after_forward": "its own code between forward and backward (the loss, or other code after the model's forward)",
    "backward": "backward",
    "allreduce": "all-reduce",
    "optimizer": "the optimizer step",
}


def _where(phase: str, step: int, began: bool, pending: list[dict[str, Any]], stuck_here: bool) -> str:
    """Where the rank is, as the end of "has made no progress for N s ..."."""
    if pending:
        first = pending[0]
        if first.get("launched"):
            return f"in all-reduce of bucket {first.get('index')} (step {step})"
        return f"in backward, waiting for gradients of bucket {first.get('index')} (step {step})"
    if phase != "idle":
        return f"in {_PHASE_WORDS.get(phase, phase)} (step {step})"
    if not began:  # only with a collective in flight: an idle rank in set-up is not reported
        return "before its first step"
    return f"between steps, after step {step}" + (
        " (the optimizer step, data loading or its own code)" if stuck_here else ""
    )


def thread_words(thread: str | None) -> str:
    """ "the main thread", or the training thread by name when training runs on another one
    (``training_thread.py``)."""
    return "the main thread" if thread is None else f"the training thread '{thread}'"


def _cpu_words(
    cpu_s: float, stalled_s: float, thread: str | None, call: Mapping[str, Any] | None = None
) -> str:
    """Blocked or busy: the first question about a rank stuck in its own code. ``call``: the system call
    it is blocked in (a ``blocked_call`` field), which says on what."""
    used = f"{thread_words(thread)} used {cpu_s:.1f} s of CPU meanwhile"
    if blocked(cpu_s, stalled_s):
        on = blocked_call_words(call) or "waiting (on a data loader, a queue, a lock, a file or a socket)"
        return f"{used}: it is blocked, {on}"
    return (
        f"{used}: it is busy, not waiting (work longer than the timeout, or a loop that never ends; "
        f"if that work is expected, raise {ENV_HANG_TIMEOUT})"
    )


def hang_message(
    rank: str,
    phase: str,
    step: int,
    stalled_s: float,
    pending: list[dict[str, Any]],
    inflight: list[dict[str, Any]],
    main_site: str | None = None,
    last: dict[str, Any] | None = None,
    *,
    began: bool = True,
    main_cpu_s: float | None = None,
    blocked_in: TorchWait | None = None,
    thread: str | None = None,
    blocked_call: Mapping[str, Any] | None = None,
    loader_workers: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The sentence of a hang report: where this rank is stuck and what to look at next.

    ``began``: a step has begun (else an idle rank is still in set-up); ``main_cpu_s``: CPU seconds the
    main thread used during the stall, said when no collective is in flight (blocked or busy);
    ``blocked_in``: the torch machinery the main thread's innermost frame is in, if any
    (``agent/torch_waits.py``): blocked there, the rank waits for a peer in a collective not recorded;
    ``thread``: the training thread's name when it is not the main thread (the one sampled);
    ``blocked_call``: the system call that thread is blocked in (``agent/blocked_call.py``);
    ``loader_workers``: its DataLoader's workers and what each is blocked in, when it waits for them.
    """
    who = thread_words(thread)
    missing = [name for b in pending for name in b.get("missing", ())]
    waits_unseen = (
        blocked_in is not None
        and not inflight
        and not pending
        and blocked(main_cpu_s, stalled_s) is not False
    )
    stuck_here = not inflight and not missing and not waits_unseen
    where = _where(phase, step, began, pending, stuck_here)
    parts = [f"rank {rank} has made no progress for {stalled_s:.1f} s {where}"]
    if inflight:
        shown = [
            f"{c['pg']}#{c['coll_seq']} {c['op']}" + (f" at {c['call_site']}" if c.get("call_site") else "")
            for c in inflight[:3]
        ]
        more = f" (+{len(inflight) - 3} more)" if len(inflight) > 3 else ""
        verb = "is" if len(inflight) == 1 else "are"
        parts.append(f"collective {', '.join(shown)}{more} {verb} in flight")
    if missing:
        extra = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
        parts.append(f"parameters whose gradients never arrived: {', '.join(missing[:10])}{extra}")
    if last and not inflight:
        # Where this rank stands in the collective order: peers waiting in a later seq point here.
        at = f" at {last['call_site']}" if last.get("call_site") else ""
        parts.append(f"its last collective was {last['pg']}#{last['coll_seq']} {last['op']}{at}")
    if main_site:
        parts.append(f"{who} waits at {main_site}")
    if main_cpu_s is not None and not inflight and not waits_unseen:
        parts.append(_cpu_words(main_cpu_s, stalled_s, thread, blocked_call))
    if workers := workers_words(loader_workers):
        parts.append(f"it waits for its DataLoader's workers: {workers}")
    text = "; ".join(parts) + "."
    if inflight:
        first = inflight[0]
        text += (
            f" Look for a rank that has not issued {first['pg']}#{first['coll_seq']}: one that is stuck, "
            "dead, or issued a different collective at that sequence number."
        )
    elif waits_unseen and blocked_in is not None:
        text += (
            f" No collective ddpscope records is in flight, but {who} is blocked in {blocked_in.place}:"
            f" {blocked_in.what}. A peer that has not reached that collective holds this rank up (the collector"
            " names it from the peers' reports)."
        )
    elif missing:
        text += (
            f" Either the backward pass is still computing or blocked before them (see {who}'s "
            "stack) or those parameters took no part in this step's forward on this rank."
        )
    else:
        text += (
            f" No collective is in flight: this rank itself is stuck; see {who}'s stack."
            " Peers waiting in a collective are waiting for it."
        )
    return text
