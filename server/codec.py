"""Fast batch decoding: msgspec Structs generated at import from ``ddpscope.agent.records``.

The wire format has one definition (``records.RECORD_KINDS``); this module only translates it into
msgspec types so a batch is parsed and validated in C in one pass (TORCH-FACTS: msgspec decoding is
what lets one core take ~20 k step records/s). No field name is written here. ``tests/server`` checks
that this decoder accepts and rejects exactly what ``records.validate_record`` does.

``decode_batch(body) -> list[Struct]``; ``to_wire(struct) -> dict`` gives the wire-shaped dict back.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Union

import msgspec

from ddpscope.agent import records as wire
from ddpscope.agent import step_block
from ddpscope.server.packed import all_well_formed as all_packed_well_formed

# Integers the databases can store (BIGINT): a larger one is bad input (422), not a server error.
_INT64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]

_SCALARS: dict[str, Any] = {
    wire.INT: _INT64,
    wire.FLOAT: float,
    wire.STR: str,
    wire.BOOL: bool,
    wire.INTS: list[_INT64],
    wire.STRS: list[str],
    wire.FLOATS: list[float],
    wire.INT_LISTS: list[list[_INT64]],
    wire.COUNTS: dict[str, _INT64],
    wire.PACKED: bytes,  # base64 in JSON, decoded by msgspec in C
    wire.BYTES: bytes,
}

_NON_NEGATIVE = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_INT32 = Annotated[int, msgspec.Meta(ge=wire.INT32_MIN, le=wire.INT32_MAX)]
"""``Field.int32``: stored in an INTEGER column."""
_RANK = Annotated[int, msgspec.Meta(ge=0, le=wire.INT32_MAX)]
"""The envelope's rank: ``int32``, and never negative (as ``validate_record`` says)."""


def _key_string(max_length: int, pattern: str | None = None) -> Any:
    # Key strings go into VARCHAR columns; PostgreSQL refuses longer ones and any NUL, which would
    # be a 500 that the agent retries forever. The limits come from the wire format (Field.max_length,
    # Field.pattern: a job id with '/' would be stored and listed but could never be opened).
    return Annotated[str, msgspec.Meta(max_length=max_length, pattern=pattern or "^[^\x00]*$")]


class BatchError(ValueError):
    """A batch that does not decode; the message names the field (e.g. ``$.records[3].rank``)."""


def _field_type(field: wire.Field, owner: str) -> Any:
    if field.type == wire.OBJECTS:
        t: Any = list[_struct(f"{owner}_{field.name}", field.item)]  # type: ignore[misc]
    elif field.type == wire.OBJECT:
        t = _struct(f"{owner}_{field.name}", field.item)
    elif field.max_length is not None:
        t = _key_string(field.max_length, field.pattern)
    elif field.int32:
        t = _INT32
    else:
        t = _SCALARS[field.type]
    if field.nullable:
        t = Union[t, None]  # noqa: UP007 - built at runtime from a variable
    if not field.required:
        t = Union[t, msgspec.UnsetType]  # noqa: UP007
    return t


def _struct_fields(fields: tuple[wire.Field, ...], owner: str) -> list[tuple[Any, ...]]:
    # Required fields first: msgspec (like dataclasses) wants defaults last.
    out: list[tuple[Any, ...]] = []
    for f in sorted(fields, key=lambda f: not f.required):
        t = _field_type(f, owner)
        out.append((f.name, t) if f.required else (f.name, t, msgspec.UNSET))
    return out


def _struct(name: str, fields: tuple[wire.Field, ...], **kw: Any) -> type[msgspec.Struct]:
    return msgspec.defstruct(name, _struct_fields(fields, name), gc=False, **kw)


def _record_struct(kind: str) -> type[msgspec.Struct]:
    envelope = [
        (
            f.name,
            _RANK if f.name == "rank" else _NON_NEGATIVE if f.name == "seq" else _field_type(f, "envelope"),
        )
        for f in wire.ENVELOPE
        if f.name != "kind"  # the tag: msgspec picks the struct from it
    ]
    return msgspec.defstruct(
        f"Wire_{kind}",
        envelope + _struct_fields(wire.RECORD_KINDS[kind], kind),
        tag_field="kind",
        tag=kind,
        array_like=False,
        omit_defaults=True,
        gc=False,  # decoded records never form reference cycles: spare the collector's GC passes
    )


STRUCTS: dict[str, type[msgspec.Struct]] = {kind: _record_struct(kind) for kind in wire.RECORD_KINDS}
"""One Struct type per record kind; ``type(s).__struct_config__.tag`` is its kind."""

AnyRecord = Union[tuple(STRUCTS.values())]  # type: ignore[valid-type]  # noqa: UP007

Batch = msgspec.defstruct("Batch", [("schema", int), ("records", list[AnyRecord])])  # type: ignore[valid-type]

_decoder = msgspec.json.Decoder(Batch)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_schema_only = msgspec.json.Decoder(msgspec.defstruct("BatchHead", [("schema", Any)]))


def decode_batch(body: bytes) -> list[Any]:
    """Parse and validate a JSON batch; return its records as Structs or raise ``BatchError``."""
    try:
        batch: Any = _decoder.decode(body)
    except msgspec.ValidationError as e:
        _check_schema(body)
        message = str(e).replace("$.", "batch.", 1)
        if message.endswith(".job`") and "matching regex" in message:
            message = (
                f"{message.rpartition(' - at ')[2].strip('`')}: a job id must be 1-{wire.MAX_JOB_LENGTH} "
                "characters with no '/' and no NUL, and not '.' or '..' (it is one URL path segment); the "
                "agent makes DDPSCOPE_JOB so by itself"
            )
        raise BatchError(message) from None
    except msgspec.DecodeError as e:
        raise BatchError(f"body is not valid JSON: {e}") from None
    if batch.schema != wire.SCHEMA_VERSION:
        _check_schema(body)
    records: list[Any] = batch.records
    _check_step_arrays(records)
    # JSON may escape a lone UTF-16 surrogate, which no database text column can store (a 500 the agent
    # would retry forever). Only a body with such an escape pays for the re-encoding check; a body
    # without any backslash (the agent's: base64 and plain text) is cleared by a one-byte find (memchr,
    # 30 µs a MB, where the regex takes 700).
    if b"\\" in body and _SURROGATE_ESCAPE.search(body):
        try:
            msgspec.json.encode(records)
        except msgspec.EncodeError:
            raise BatchError(
                "a string holds a lone UTF-16 surrogate (\\ud800-\\udfff): strings must be valid Unicode"
            ) from None
    return records


_STEP = STRUCTS["step"]
_STEP_BLOCK = STRUCTS["step_block"]
_UNSET = msgspec.UNSET


def _check_step_arrays(records: list[Any]) -> None:
    # The cross-field rules of the wire format (``records.step_arrays_problem``, ``step_block.problem``);
    # msgspec checked the types.
    for i, record in enumerate(records):
        r: Any = record  # a generated Struct: mypy cannot see its fields
        if type(record) is _STEP_BLOCK:
            problem = step_block.problem(
                r.count,
                r.columns,
                r.arrays,
                r.array_sizes,
                [u.index for u in r.unused],
                all_packed_well_formed,
            )
            if problem:
                raise BatchError(f"batch.records[{i}].{problem}")
            continue
        if type(record) is not _STEP:
            continue
        if (  # the agent's form, checked without building lists: packed arrays and no lists
            r.arrays is not _UNSET
            and r.bucket_ready_ns is _UNSET
            and r.allreduce_start_ns is _UNSET
            and r.allreduce_end_ns is _UNSET
            and r.bucket_bytes is _UNSET
            and r.ready_order is _UNSET
            and r.collective_seqs is _UNSET
            and wire.packed_problem(r.arrays) is None
        ):
            continue
        packed = r.arrays is not _UNSET
        problem = wire.step_arrays_problem(packed, [getattr(r, n) is not _UNSET for n in wire.STEP_ARRAYS])
        if problem is None and packed:
            detail = wire.packed_problem(r.arrays)
            problem = detail and f"arrays: {detail}"
        if problem:
            raise BatchError(f"batch.records[{i}].{problem}")


def _check_schema(body: bytes) -> None:
    # A batch from a newer agent fails on its records first; name the real cause instead.
    try:
        head: Any = _schema_only.decode(body)
        schema = head.schema
    except msgspec.MsgspecError:
        return
    if schema != wire.SCHEMA_VERSION:
        raise BatchError(
            f"batch.schema: version {schema!r} is not supported; this collector speaks {wire.SCHEMA_VERSION}"
        )


def kind_of(record: msgspec.Struct) -> str:
    return str(record.__struct_config__.tag)


def to_wire(record: msgspec.Struct) -> dict[str, Any]:
    """The wire-shaped dict of a decoded record (unset optional fields left out)."""
    out: dict[str, Any] = msgspec.to_builtins(record)
    return out
