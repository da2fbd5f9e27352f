"""Responses: analysis dataclasses encoded to JSON by msgspec, in C.

FastAPI's default path (``jsonable_encoder`` walking every nested dict, then ``json.dumps``) costs more
than the query itself for a 10 000-row steps page; msgspec encodes dataclasses, tuples and dicts
directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
from fastapi import Response


def item(obj: Any) -> Any:
    """A dataclass (nested) as plain dicts and lists, for callers that filter or merge items."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: item(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: item(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [item(v) for v in obj]
    return obj


def _fallback(obj: Any) -> Any:
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


_encoder = msgspec.json.Encoder(enc_hook=_fallback)


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _encoder.encode(content)


def items(objs: Any, **extra: Any) -> JSONResponse:
    return JSONResponse({"items": list(objs), **extra})
