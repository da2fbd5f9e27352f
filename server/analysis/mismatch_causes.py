"""Why a mismatch happened, where the records can tell: what gloo does with two transfers of different sizes,
and which ranks skipped a call that every rank makes each step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ddpscope.server.analysis.collective_keys import full_key
from ddpscope.server.analysis.incident_model import P2P_OPS, Record, describe, ranks_phrase

SIZE_ABORT = "gloo aborts on the size mismatch"
"""What a mismatch of shapes or dtypes says; a rank that then dies of SIGABRT died of it."""
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip
"""Bytes per element of the dtypes a transfer's size is worked out for."""


def transfer_bytes(c: Record) -> int | None:
    """Bytes a one-tensor record moves; None when a dtype is not in ``DTYPE_BYTES`` or it holds several."""
    shapes, dtypes = c.get("shapes") or [], c.get("dtypes") or []
    if len(shapes) != 1 or len(dtypes) != 1 or dtypes[0] not in DTYPE_BYTES:
        return None
    count = 1
    for n in shapes[0]:
        count *= int(n)
    return count * DTYPE_BYTES[dtypes[0]]


def size_consequence(a: Record, b: Record) -> str:
    """What gloo does with two records of different shapes or dtypes at one sequence number. A send and
    its recv are checked by bytes (measured on gloo: a recv larger than the send completes with only the
    sent bytes written; a smaller one aborts the receiver); collectives abort on any difference."""
    directions = (P2P_OPS.get(str(a.get("op"))), P2P_OPS.get(str(b.get("op"))))
    send, recv = (a, b) if directions[0] == "send" else (b, a)
    sent, room = transfer_bytes(send), transfer_bytes(recv)
    if set(directions) != {"send", "recv"} or sent is None or room is None or sent > room:
        return f"{SIZE_ABORT} (NCCL may hang or corrupt memory)"
    if sent < room:
        return (
            f"gloo completes it without a word, writing only the {sent} bytes sent into the {room}-byte "
            "receive buffer: the rest keeps its old values (a larger send would abort the receiver)"
        )
    return (
        f"the byte counts agree, so gloo completes it without a word and the receiver reads the sent "
        f"{'/'.join(send.get('dtypes') or [])} bytes as {'/'.join(recv.get('dtypes') or [])}: wrong values"
    )


ROUTINE_STEPS = 2
"""Earlier steps in which every rank must have made a call for it to count as made every step."""


@dataclass(frozen=True)
class Skipped:
    """Ranks in the engine's bucket all-reduce where the others are in a user call that every rank made in
    each of its earlier steps: the engine's ranks skipped that call this step."""

    issued: list[int]
    """The ranks in the user call: right."""
    call: Record
    step: int
    """The step the user call belongs to (its own, or that of the engine's records before it)."""
    went_on: int
    """The step whose bucket all-reduce the other ranks are in."""

    def sentence(self, skipped: list[int]) -> str:
        who, one = ranks_phrase(skipped), len(skipped) == 1
        return (
            f"Every rank issued {describe(self.call)} in each of its earlier steps, and "
            f"{ranks_phrase(self.issued)} did so in step {self.step}; {who} skipped it in step {self.step} and "
            f"went on to step {self.went_on}'s backward: a rank-dependent branch around it, or an exception "
            f"caught that jumped over it (an optimizer step skipped on {'that rank' if one else 'those ranks'}, "
            "a GradScaler or clipping decision taken per rank)"
        )

    @property
    def blame(self) -> str:
        return f"skipped {describe(self.call)} in step {self.step}, which every rank issues every step"


def steps_of(records: Mapping[int, Record]) -> dict[int, int]:
    """Sequence number -> the step each record belongs to: its own ``step``, or, for a call outside forward
    and backward (which carries none), the step of the record before it; records before any step are left out."""
    out: dict[int, int] = {}
    current: int | None = None
    for seq in sorted(records):
        own = records[seq].get("step")
        if isinstance(own, int):
            current = own
        if current is not None:
            out[seq] = current
    return out


def skipped_routine(recs: Mapping[int, Record], ranks: Mapping[int, Mapping[int, Record]]) -> Skipped | None:
    """The ranks in the engine's bucket all-reduce skipped the user call their peers are in, when every
    rank made that call (same op, shapes, dtypes, root and line) in each of at least ``ROUTINE_STEPS``
    earlier steps it has records of: the call is part of the step, so the ranks without it are the odd
    ones, not the ranks that issued it (``collective_diagnosis._left_loop`` tells the other story, a call
    made once after the loop)."""
    engine = [r for r, c in recs.items() if c.get("source") == "engine"]
    issued = sorted(r for r, c in recs.items() if c.get("source") == "user")
    if not engine or not issued or len(engine) + len(issued) != len(recs):
        return None
    call = recs[issued[0]]
    key = full_key(call)
    if any(full_key(recs[r]) != key for r in issued):
        return None
    steps = {r: steps_of(ranks.get(r, {})) for r in recs}
    step = steps[issued[0]].get(call["coll_seq"])
    went_on = recs[engine[0]].get("step")
    if step is None or not isinstance(went_on, int) or went_on < step:
        return None
    for r in recs:
        ran, made = set(), set()
        for seq, s in steps[r].items():
            if s < step:
                ran.add(s)
                if full_key(ranks[r][seq]) == key:
                    made.add(s)
        if len(made) < ROUTINE_STEPS or made != ran:
            return None
    return Skipped(issued, call, step, went_on)


SAME_LINE = "one line, run with a size or dtype that depends on the rank or its data"
"""What a mismatch at one call site says; a rank then aborted by gloo died of that line, not of a peer."""

SAME_LINE_ROOT = "one line, run with a root that depends on the rank"


def same_line(recs: Mapping[int, Record], reason: str) -> str | None:
    """The call site every rank issued the collective from, when that one line ran with different shapes
    or dtypes on the ranks (variable-length outputs gathered, a last partial batch, a per-rank count):
    the ranks agree on what to call and when, so none of them is the odd one, and the fix is in the line
    itself. Likewise a root (``src``/``dst``) computed per rank. None when the ranks differ in anything else
    (op, reduce op) or in their lines."""
    if any(part not in ("shapes", "dtypes", "roots") for part in reason.split(" and ")):
        return None
    sites = {c.get("call_site") for c in recs.values()}
    ops = {c.get("op") for c in recs.values()}
    if len(sites) != 1 or None in sites or len(ops) != 1 or next(iter(ops)) in P2P_OPS:
        return None
    if any(c.get("source") not in (None, "user") for c in recs.values()):
        return None  # the engine's or Join's: no line of the user's
    return str(next(iter(sites)))


def same_line_advice(reason: str, own_roots: bool = False) -> str:
    """What to do about one line issuing a collective with rank-dependent ``reason`` (shapes, dtypes,
    roots); ``own_roots`` when each rank passed its own rank as the root."""
    if reason == "roots":
        mine = (
            "Here each rank passed its own rank, so every rank took itself for the root. "
            if own_roots
            else ""
        )
        return (
            f"{mine}Every rank must pass the same root: a constant (usually 0) or a value every rank computes "
            "alike, never dist.get_rank() or a per-host setting."
        )
    fixes = []
    if "shapes" in reason:
        fixes.append(
            "exchange the sizes first and pad every rank's tensor to the largest (trim after), or gather Python "
            "objects with all_gather_object"
        )
    if "dtypes" in reason:
        fixes.append("cast to one dtype on every rank before the call (autocast or a dtype chosen per rank)")
    return f"Collectives need the same shape and dtype on every rank: {'; '.join(fixes)}."
