"""The ``Incident`` record and the words incidents are written in (shared by the diagnosis modules)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddpscope.agent.records import WARNING_CODES
from ddpscope.server.analysis.snapshot import JobSnapshot

Record = Mapping[str, Any]

INCIDENT_KINDS = (
    frozenset(
        {
            "hang",
            "mismatch",
            "missing_collective",
            "rank_error",
            "rank_crashed",
            "rank_exited_early",
            "rank_silent",
            "job_silent",
            "unused_parameters",
            "replicas_diverged",
            "nonfinite_parameters",
            "settings_differ",
            "models_differ",
            "job_id_shared",
            "duplicate_rank",
            "memory_growth",
        }
    )
    | WARNING_CODES
)
"""Every ``Incident.kind`` the diagnosis makes: its own, and the warning codes (``warning_incidents``)."""


@dataclass(kw_only=True, slots=True)
class Incident:
    """One diagnosis (the ``incidents`` endpoint's item)."""

    kind: str
    message: str
    """A sentence a person can act on: what happened, who caused it, where to look."""
    rank: int | None = None
    """The rank the evidence comes from (the hanging rank, the failed rank, ...)."""
    step: int | None = None
    seq: int | None = None
    """Collective sequence number within ``pg``."""
    pg: str | None = None
    group_ranks: list[int] = field(default_factory=list)
    """The global ranks ``pg`` holds, when its records say (not for the default group: every rank)."""
    bucket: int | None = None
    parameters: list[str] = field(default_factory=list)
    culprit_ranks: list[int] = field(default_factory=list)
    call_site: str | None = None
    """file:line of the collective (or call) at fault, when known."""
    stack: str | None = None
    time_s: float | None = None
    """Aligned-clock time the evidence begins (hang report, error, last record of a silent rank)."""
    active: bool = True
    """False for a hang that has since resolved: history, not a current problem."""
    related: list[dict[str, Any]] = field(default_factory=list)
    """Other ranks' errors tied to this one: ``rank``, ``error_type``, ``message``, ``time_s``."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def name_groups(incidents: Iterable[Incident], members: Mapping[str, Sequence[int]]) -> None:
    """Say which ranks a process group holds: on the incident of that group (``group_ranks``) and where its
    message first names it ("group pg:2" -> "group pg:2 (ranks 0, 2)"). A name like ``pg:2`` says
    nothing of who is in it, and "rank 1 never issued it" reads differently once one knows rank 3 is not
    even a member."""
    for inc in incidents:
        if inc.pg is not None and inc.pg in members:
            inc.group_ranks = sorted(members[inc.pg])
        for pg, ranks in members.items():
            m = re.search(rf"\bgroup {re.escape(pg)}(?![\w:.-])", inc.message)
            if m is not None:
                inc.message = f"{inc.message[: m.end()]} ({ranks_phrase(ranks)}){inc.message[m.end() :]}"


def ranks_phrase(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def capitalized(text: str) -> str:
    """``text`` with its first letter upper-case: a message that opens with ``ranks_phrase`` (lowercase,
    as it is also used mid-sentence) is still a sentence."""
    return text[:1].upper() + text[1:]


UNEVEN_DATA_ADVICE = (
    "Every rank must run the same synced steps and collectives: look for a rank-dependent break, "
    "return or branch around a collective, "
    "uneven data per rank (a sampler without drop_last, a shard shorter than the others), or wrap "
    "the loop in torch.distributed.algorithms.Join for uneven inputs."
)
"""What to do about a rank that left its training loop before its peers."""


STOP_SIGNALS = {"sigterm": "SIGTERM", "sigint": "SIGINT or an uncaught KeyboardInterrupt"}
"""``rank_exit`` reasons of a rank stopped by a signal from outside, and how messages name the signal."""


ROOTED_OPS = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}
"""Ops with a root rank, and the name of their root argument (a collective record's ``root``)."""


P2P_OPS = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
"""Point-to-point ops, by direction."""


NEW_GROUP = "new_group"
"""``torch.distributed.new_group``, recorded as a collective of the default group: every rank calls it."""


def describe(c: Record) -> str:
    """``all_reduce(SUM) [4] float32 at train.py:57``; ``broadcast(src=1) [8] float32``,
    ``reduce(SUM, dst=0) [4] float32`` for rooted ops whose record has a root."""
    site = f" at {c['call_site']}" if c.get("call_site") else ""
    if c.get("op") == NEW_GROUP:
        # Its one "shape" is the new group's member ranks (ddp/_patch.py).
        members = ", ".join(map(str, (c.get("shapes") or [[]])[0]))
        return f"new_group(ranks=[{members}]){site}"
    arg, root = ROOTED_OPS.get(c.get("op") or ""), c.get("root")
    args = [a for a in (c.get("reduce_op"), f"{arg}={root}" if arg and root is not None else None) if a]
    if c.get("tag"):
        args.append(f"tag={c['tag']}")  # point-to-point, when not torch's default 0
    op = c.get("op", "?") + (f"({', '.join(args)})" if args else "")
    shapes = c.get("shapes")
    shape_txt = " " + ", ".join("[" + ",".join(map(str, s)) + "]" for s in shapes) if shapes else ""
    dtypes = sorted(set(c.get("dtypes") or []))
    what = f"{op}{shape_txt}{' ' + ','.join(dtypes) if dtypes else ''}"
    if c.get("source") == "engine" and c.get("op") in P2P_OPS:
        # The only point-to-point calls ddpscope makes: a user never wrote them, so say what they are.
        what = f"ddpscope's start-up clock sync ({what}) inside DistributedDataParallel(...)"
    return f"{what}{site}"


def never_issued(pg: str, seq: int) -> str:
    """Why a member holds up a collective: the reason every diagnosis gives in the same words (the
    timeout error tells a direct culprit from one found through other waits by it)."""
    return f"never issued collective #{seq} of group {pg}"


def record_s(record: Record) -> float:
    return float(record["time_ns"]) / 1e9


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _own_modules() -> str:
    """``agent/clock.py|ddp/engine.py|...``: ddpscope's training-side files, listed from this install
    (not imported: the server never imports torch)."""
    root = Path(__file__).resolve().parents[2]
    names = sorted(f"{d}/{p.name}" for d in ("agent", "ddp") for p in (root / d).glob("*.py"))
    return "|".join(re.escape(n) for n in names) or "(?!)"


_LIBRARY = re.compile(rf"site-packages|dist-packages|/lib/python\d|<frozen|/(?:{_own_modules()})$")
"""Frames that are not the user's: installed packages, the standard library, ddpscope's agent and engine
(an editable install keeps them in the repository's agent/ and ddp/ folders; a user's own folder
named ddp/ is still the user's)."""


def user_frame(stack: str | None) -> str | None:
    """``file:line`` of the innermost frame of user code in a Python traceback or a faulthandler dump.

    Tracebacks list the innermost frame last; faulthandler ("most recent call first") lists it first,
    and its first thread is the one that crashed.
    """
    if not stack:
        return None
    if "most recent call first" in stack:
        blocks = [b for b in stack.split("\n\n") if "most recent call first" in b]
        blocks.sort(key=lambda b: not b.startswith("Current thread"))
        frames = [f for b in blocks for f in _FRAME.findall(b)]
    else:
        frames = list(reversed(_FRAME.findall(stack)))
    for path, line in frames:
        if not _LIBRARY.search(path):
            return f"{path}:{line}"
    return None


def first_line(text: str, limit: int = 500) -> str:
    """The first non-empty line, cut at a word boundary with an ellipsis beyond ``limit`` characters. An
    exception torch re-raised from another process or thread ("Caught ValueError in DataLoader worker
    process 0", then the "Original Traceback") gets the original's last line too: what went wrong."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    if len(lines) > 2 and line.startswith("Caught ") and lines[1].startswith("Original Traceback"):
        line = f"{line.rstrip('.')}: {lines[-1]}"
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " …"


def error_brief(e: Record) -> dict[str, Any]:
    return {
        "rank": e["rank"],
        "error_type": e.get("error_type"),
        "message": e.get("message"),
        "time_s": record_s(e),
    }


AFTER_FORWARD = "between forward and backward"
"""The ``after_forward`` phase in words: the model's forward returned and backward has not begun."""


def phase_words(phase: Any) -> str:
    """``in backward``; for ``after_forward``, where that is."""
    return AFTER_FORWARD if phase == "after_forward" else f"in {phase}"


def step_phrase(step: Any, phase: Any, *, started: bool = True) -> str:
    """`` at step 7 in backward``; `` after step 7 (between steps: ...)`` for the ``idle`` phase, which
    starts when a step's gradients are reduced and lasts until the next forward; `` before its first
    step ...`` when the rank never completed a step (``started`` False: set-up, the DDP constructor)."""
    if phase == "idle" and not started:
        return (
            " before its first step (during set-up: building the model, the DDP constructor, the first batch)"
        )
    if phase == "idle":
        between = "between steps: optimizer, data loading or other code outside forward and backward"
        return f" after step {step} ({between})" if step is not None else f" ({between})"
    at = f" at step {step}" if step is not None else ""
    known = known_phase(phase)
    return at + (f" {phase_words(known)}" if known else "")


def known_phase(phase: Any) -> str | None:
    """A report's phase, None for none or "unknown" (a crash read from a fatal signal's file after the
    process died: nothing said which phase it was in)."""
    return None if phase in (None, "", "unknown") else str(phase)


def position(snapshot: JobSnapshot, rank: int) -> tuple[int | None, str | None]:
    """(step, phrase): the newest evidence of where a rank got to, from its last heartbeat, its last
    step record or its last collective, whichever is newest. Heartbeats come every few seconds and
    step records leave the process in rounds, so a rank killed a few fast steps in may have shipped
    neither lately; its collective records are crash-durable (written before each call enters torch)
    and carry the step they belong to."""
    candidates: list[tuple[int, int | None, str]] = []
    done = snapshot.steps.get(rank)
    if done is not None:
        candidates.append((done.last_step_end_ns, done.last_step, f"last completed step {done.last_step}"))
    hb = snapshot.heartbeats.get(rank)
    if hb is not None:
        candidates.append(
            (int(hb["time_ns"]), hb.get("step"), f"last heartbeat: phase {hb['phase']}, step {hb['step']}")
        )
    last = _newest_collective(snapshot, rank)
    if last is not None:
        candidates.append(
            (
                int(last["start_ns"]),
                last["step"],
                f"last collective #{last['coll_seq']} {last['op']} in step {last['step']}",
            )
        )
    if not candidates:
        return None, None
    _, step, phrase = max(candidates, key=lambda c: c[0])
    return step, phrase


def _newest_collective(snapshot: JobSnapshot, rank: int) -> Record | None:
    """The rank's latest collective that names its step (one pass; called for culprits only)."""
    newest: Record | None = None
    for c in snapshot.collectives:
        if c["rank"] != rank or c.get("step") is None or c.get("start_ns") is None:
            continue
        if newest is None or c["start_ns"] > newest["start_ns"]:
            newest = c
    return newest


def where(snapshot: JobSnapshot, rank: int) -> str:
    """'(last heartbeat: phase backward, step 7; pid 123 on host-a)'."""
    hb = snapshot.heartbeats.get(rank)
    start = snapshot.ranks.get(rank, {})
    phrase = position(snapshot, rank)[1]
    parts = [phrase] if phrase else []
    pid = (hb or {}).get("pid") or start.get("pid")
    if pid:
        parts.append(f"pid {pid}" + (f" on {start['host']}" if start.get("host") else ""))
    if not parts and not start:
        # No rank_start: the engine (or instrument()) never finished setting up on this rank.
        parts.append(
            "during set-up, before DistributedDataParallel(...) returned"
            if rank in snapshot.rank_last_seen_s
            else "it never reported anything"
        )
    return f" ({'; '.join(parts)})" if parts else ""
