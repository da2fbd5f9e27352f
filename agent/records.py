"""The wire format: every record kind ddpscope ships, its fields and their types. The one definition.

The training side builds records as plain dicts; the collector validates incoming batches against
``RECORD_KINDS`` (``validate_record``) and never keeps a second copy of a field name. Standard library
only: the collector imports this module without torch.

A batch on the wire is ``{"schema": SCHEMA_VERSION, "records": [record, ...]}`` (JSON, usually gzip).
Every record carries the envelope fields (``kind``, ``job``, ``rank``, ``stream``, ``seq``, ``time_ns``);
``(job, rank, stream, seq)`` is its idempotency key, so a retry or a spool replay never stores it twice.
``stream`` names one agent incarnation (a new one after fork or restart); ``seq`` counts up within it.

Times are integer nanoseconds on the job's aligned clock: the rank's ``time.time_ns()`` plus the
offset to rank 0 estimated at start-up (see ``rank_start.clock_offset_ns``). Durations at the edges
(API, dashboard) are float seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 1
"""Bumped when a field changes meaning or a required field is added."""

MAX_JOB_LENGTH = 200
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Integers must fit the collector's BIGINT columns."""

# Field type codes. Kept as strings so the spec can be printed in errors and docs as it is.
INT, FLOAT, STR, BOOL = "int", "float", "str", "bool"
INTS, STRS, FLOATS = "list[int]", "list[str]", "list[float]"
INT_LISTS = "list[list[int]]"
COUNTS = "dict[str,int]"
OBJECTS = "list[object]"


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    type: str
    required: bool = True
    nullable: bool = False
    """None is a valid value (e.g. a collective's end time while it is still in flight)."""
    item: tuple[Field, ...] = ()
    """For ``list[object]``: the fields of each object."""
    max_length: int | None = None
    """For key strings the collector indexes: at most this many characters and no NUL."""
    doc: str = ""


ENVELOPE: tuple[Field, ...] = (
    Field("kind", STR, doc="one of RECORD_KINDS"),
    Field(
        "job", STR, max_length=MAX_JOB_LENGTH, doc="job id (DDPSCOPE_JOB, TORCHELASTIC_RUN_ID or generated)"
    ),
    Field("rank", INT, doc="global rank of the emitting process"),
    Field("stream", STR, max_length=64, doc="agent incarnation id; new after fork or restart"),
    Field("seq", INT, doc="position in the stream, from 0; with job, rank, stream the idempotency key"),
    Field("time_ns", INT, doc="aligned-clock time the record was emitted"),
)

BUCKET = (
    Field("index", INT),
    Field("bytes", INT),
    Field("dtype", STR),
    Field("device", STR),
    Field("parameters", STRS, doc="parameter names in the bucket, in bucket order"),
)

PENDING_BUCKET = (
    Field("index", INT),
    Field("missing", STRS, doc="parameters whose gradients never arrived"),
    Field("launched", BOOL, doc="all-reduce launched (waiting on peers) rather than waiting for grads"),
)

INFLIGHT = (
    Field("pg", STR),
    Field("coll_seq", INT),
    Field("op", STR),
    Field("shapes", INT_LISTS, required=False),
    Field("dtypes", STRS, required=False),
    Field("call_site", STR, nullable=True),
    Field("start_ns", INT),
)

THREAD_STACK = (
    Field("thread", STR, doc="thread name"),
    Field("stack", STR, doc="formatted Python stack, innermost frame last"),
)

RECORD_KINDS: dict[str, tuple[Field, ...]] = {
    # Once per rank at start-up and after every (re)configuration.
    "rank_start": (
        Field("world_size", INT),
        Field("backend", STR),
        Field("device", STR),
        Field("host", STR),
        Field("pid", INT),
        Field("engine", STR, doc="'ddpscope' (own engine) or 'torch' (instrument() adapter)"),
        Field("torch_version", STR),
        Field("ddpscope_version", STR),
        Field("python_version", STR),
        Field("find_unused_parameters", BOOL),
        Field("bucket_cap_mb", FLOAT),
        Field("clock_offset_ns", INT, doc="added to local time_ns to get rank 0's clock"),
        Field("clock_error_ns", INT, doc="half the best ping-pong round trip: bound on the offset error"),
        Field("process_group", STR, required=False),
    ),
    # The bucket layout, at start-up ("initial") and whenever buckets are rebuilt ("rebuilt").
    "layout": (
        Field("step", INT, doc="first step this layout applies to"),
        Field("reason", STR, doc="'initial' or 'rebuilt'"),
        Field("buckets", OBJECTS, item=BUCKET),
    ),
    # One per rank per iteration; arrays are indexed by bucket index.
    "step": (
        Field("step", INT),
        Field("synced", BOOL, doc="False under no_sync(): no all-reduce this step"),
        Field("forward_start_ns", INT),
        Field("forward_end_ns", INT),
        Field("backward_start_ns", INT),
        Field("backward_end_ns", INT, doc="backward() returned: all-reduces waited, grads written"),
        Field("bucket_ready_ns", INTS, doc="last gradient of the bucket accumulated"),
        Field("allreduce_start_ns", INTS, doc="launch; later than ready when an earlier bucket blocks"),
        Field("allreduce_end_ns", INTS),
        Field("bucket_bytes", INTS),
        Field("ready_order", INTS, doc="bucket indices in the order they became ready"),
        Field("unused_parameters", STRS, doc="names of parameters that got no gradient this step"),
        Field("collective_seqs", INTS, doc="collective sequence number of each bucket's all-reduce"),
    ),
    # Every collective the process issues (engine and user), at issue time: crash-durable evidence.
    "collective": (
        Field("pg", STR, max_length=200, doc="process group name"),
        Field("coll_seq", INT, doc="per-process-group sequence number, from 1"),
        Field("op", STR, doc="all_reduce, broadcast, all_gather, barrier, ..."),
        Field("reduce_op", STR, nullable=True),
        Field("shapes", INT_LISTS),
        Field("dtypes", STRS),
        Field("call_site", STR, nullable=True, doc="file:line of the user's call"),
        Field("start_ns", INT),
        Field("step", INT, nullable=True),
        Field("source", STR, doc="'engine' or 'user'"),
    ),
    # Completion of a collective issued earlier.
    "collective_end": (
        Field("pg", STR, max_length=200),
        Field("coll_seq", INT),
        Field("end_ns", INT),
        Field("ok", BOOL),
        Field("error", STR, required=False, nullable=True),
    ),
    # Liveness and position, every DDPSCOPE_HEARTBEAT_S seconds.
    "heartbeat": (
        Field("phase", STR, doc="idle, forward, backward, allreduce, optimizer"),
        Field("step", INT),
        Field("last_coll_seq", INT, doc="highest collective sequence number issued (default group)"),
        Field("pid", INT),
    ),
    # No progress for DDPSCOPE_HANG_TIMEOUT seconds.
    "hang": (
        Field("phase", STR),
        Field("step", INT),
        Field("stalled_s", FLOAT),
        Field("pending_buckets", OBJECTS, item=PENDING_BUCKET),
        Field("inflight", OBJECTS, item=INFLIGHT),
        Field("stacks", OBJECTS, item=THREAD_STACK),
        Field("message", STR),
    ),
    "hang_resolved": (
        Field("step", INT),
        Field("hang_s", FLOAT),
    ),
    # An exception (or fatal signal) in training, shipped before the process exits.
    "rank_error": (
        Field("step", INT, nullable=True),
        Field("phase", STR),
        Field("error_type", STR),
        Field("message", STR),
        Field("stack", STR),
        Field("fatal", BOOL, doc="the process died of it (uncaught, abort, fatal signal)"),
    ),
    # Clean end of a rank: the job is 'finished' once every rank has one.
    "rank_exit": (
        Field("step", INT, nullable=True),
        Field("reason", STR, doc="'finished', 'sigterm' or 'error'"),
    ),
    # The agent's own accounting, cumulative since the stream started (the latest one wins).
    "agent_stats": (
        Field("emitted", INT),
        Field("dropped", COUNTS, doc="'reason:kind' -> records dropped"),
        Field("spool_bytes", INT),
    ),
}

URGENT_KINDS = frozenset({"hang", "hang_resolved", "rank_error"})
"""Kinds that take the agent's fast path: sent at once, also spooled and printed to stderr."""


class RecordError(ValueError):
    """A record that does not match the wire format; the message names the field."""


_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    INT: (int,),
    FLOAT: (int, float),
    STR: (str,),
    BOOL: (bool,),
}


def _check_value(path: str, value: Any, field: Field) -> None:
    if value is None:
        if field.nullable:
            return
        raise RecordError(f"{path}: must not be null (expected {field.type})")
    t = field.type
    if t in _SCALAR_TYPES:
        # bool is an int in Python; an int field must not silently accept True.
        if t != BOOL and isinstance(value, bool) or not isinstance(value, _SCALAR_TYPES[t]):
            raise RecordError(f"{path}: expected {t}, got {type(value).__name__}")
        if isinstance(value, int) and t == INT and not INT64_MIN <= value <= INT64_MAX:
            raise RecordError(f"{path}: {value} does not fit in a signed 64-bit integer")
        if (
            isinstance(value, str)
            and field.max_length is not None
            and (len(value) > field.max_length or "\x00" in value)
        ):
            raise RecordError(f"{path}: must be at most {field.max_length} characters with no NUL")
        return
    if t == COUNTS:
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in value.items()
        ):
            raise RecordError(f"{path}: expected an object of string -> int")
        return
    if not isinstance(value, list):
        raise RecordError(f"{path}: expected {t}, got {type(value).__name__}")
    if t == OBJECTS:
        for i, item in enumerate(value):
            _check_fields(f"{path}[{i}]", item, field.item)
        return
    inner = {INTS: INT, STRS: STR, FLOATS: FLOAT, INT_LISTS: INTS}[t]
    inner_field = Field(field.name, inner)
    for i, item in enumerate(value):
        _check_value(f"{path}[{i}]", item, inner_field)


def _check_fields(path: str, obj: Any, fields: tuple[Field, ...]) -> None:
    if not isinstance(obj, Mapping):
        raise RecordError(f"{path}: expected an object, got {type(obj).__name__}")
    for field in fields:
        if field.name not in obj:
            if field.required:
                raise RecordError(f"{path}.{field.name}: required field is missing")
            continue
        _check_value(f"{path}.{field.name}", obj[field.name], field)


def validate_record(record: Any, where: str = "record") -> str:
    """Check one record against the wire format; return its kind or raise ``RecordError``.

    Unknown extra fields are allowed (a newer agent may send more); missing or mistyped ones are not.
    """
    if not isinstance(record, Mapping):
        raise RecordError(f"{where}: expected an object, got {type(record).__name__}")
    kind = record.get("kind")
    if kind not in RECORD_KINDS:
        raise RecordError(f"{where}.kind: unknown kind {kind!r}; expected one of {sorted(RECORD_KINDS)}")
    _check_fields(where, record, ENVELOPE)
    _check_fields(where, record, RECORD_KINDS[kind])
    if record["seq"] < 0 or record["rank"] < 0:
        raise RecordError(f"{where}: seq and rank must be >= 0")
    return str(kind)


def validate_batch(batch: Any) -> list[Mapping[str, Any]]:
    """Check a whole batch; return its records or raise ``RecordError`` naming the first bad field."""
    if not isinstance(batch, Mapping):
        raise RecordError("batch: expected an object with 'schema' and 'records'")
    schema = batch.get("schema")
    if schema != SCHEMA_VERSION:
        raise RecordError(
            f"batch.schema: version {schema!r} is not supported; this collector speaks {SCHEMA_VERSION}"
        )
    records = batch.get("records")
    if not isinstance(records, list):
        raise RecordError("batch.records: expected a list of records")
    for i, record in enumerate(records):
        validate_record(record, f"records[{i}]")
    return records


def idempotency_key(record: Mapping[str, Any]) -> tuple[str, int, str, int]:
    return (record["job"], record["rank"], record["stream"], record["seq"])
