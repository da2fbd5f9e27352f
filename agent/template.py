"""Record templates: a record emitted again and again whose fields stay the same but for a few integers.

The engine's bucket all-reduce is the case: the same op, group, shapes and dtypes every step; only the
collective's sequence number, start time and step change. The recorder emits that record between a
backward hook and the all-reduce, when the caches are cold from the backward pass, and there building
the dict, stamping a copy and marshalling it into the write-ahead ring cost ~90 us a call
(``bench/cost_accounting.py``; a warm loop says 3 us). With a template the caller passes a tuple of
integers: the agent packs them into a ring slot next to the template's bytes, encoded once per agent
(~25 us cold for the recorder's whole ``begin``), and the worker thread builds the full record, the
same one ``emit`` would have sent, later and warm.

    BEGIN = RecordTemplate({"kind": "collective", "pg": "default", ...}, ("coll_seq", "start_ns", "step"),
                           time_field="start_ns")
    agent.emit_templated(BEGIN, (seq, start_ns, step))          # crash-durable like emit_durable

A variable may also be a list of integers of a fixed length, ``(name, n)``: the step record's bucket
arrays (``ddp/step_record.py``), whose template is one per bucket layout. The values are then flat.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ddpscope.agent.implied import Implies
from ddpscope.agent.records import RECORD_KINDS, URGENT_KINDS, RecordError, validate_record
from ddpscope.agent.ring import Variable, fill, width

_ENVELOPE_SAMPLE = {"job": "j", "stream": "s", "seq": 1, "time_ns": 1, "rank": 0}


class RecordTemplate:
    """The fixed fields of one record kind and its integer fields (``Variable``: a name, or a name and
    a list length).

    Checked once, here, against the wire format (with every variable field set to 1), so the records
    built from it need no per-record check. Raises ``ValueError`` naming what is wrong.
    """

    __slots__ = ("fixed", "variables", "width", "time_index", "encoded", "implies")

    def __init__(
        self, fixed: Mapping[str, Any], variables: Sequence[Variable], *, time_field: str | None = None
    ) -> None:
        kind = fixed.get("kind")
        if kind not in RECORD_KINDS:
            raise ValueError(f"record template: unknown kind {kind!r}")
        if kind in URGENT_KINDS:
            raise ValueError(f"record template: {kind!r} records are urgent; emit them with emit()")
        if not all(type(v) is str or (type(v) is tuple and len(v) == 2 and v[1] >= 0) for v in variables):
            raise ValueError(f"record template: variables must be names or (name, length): {variables!r}")
        names = [v if type(v) is str else v[0] for v in variables]
        overlap = set(fixed) & set(names)
        if overlap:
            raise ValueError(f"record template: {sorted(overlap)} are both fixed and variable")
        self.fixed = dict(fixed)
        self.variables = tuple(variables)
        self.width = width(self.variables)
        """How many integers a record takes."""
        self.time_index = None
        """Which value is the record's time (its ``time_ns``); None: the agent reads the clock."""
        if time_field is not None:
            if time_field not in self.variables:
                raise ValueError(f"record template: time field {time_field!r} is not a scalar variable")
            at = self.variables.index(time_field)
            self.time_index = width(self.variables[:at])
        self.encoded: Any = None
        """The agent's encoding for its write-ahead ring, with the stream it was made for (an agent
        incarnation encodes it at its first use: the envelope is part of the bytes)."""
        self.implies: Implies | None = None
        """What each record of this template implies (``agent/implied.py``): records the worker makes
        from it and sends after it, and the shipper makes again from the ring after a crash."""
        try:
            validate_record({**_ENVELOPE_SAMPLE, **self.expand((1,) * self.width)})
        except RecordError as e:
            raise ValueError(f"record template: {e}") from None

    def expand(self, values: Sequence[Any]) -> dict[str, Any]:
        """The record without its envelope, as ``emit`` would take it."""
        return {**self.fixed, **fill(self.variables, values)}
