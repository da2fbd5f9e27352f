"""Analysis dataclasses -> JSON-ready dicts (private fields, starting with '_', left out)."""

from __future__ import annotations

import dataclasses
from typing import Any


def item(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: item(getattr(obj, f.name)) for f in dataclasses.fields(obj) if not f.name.startswith("_")
        }
    if isinstance(obj, dict):
        return {k: item(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [item(v) for v in obj]
    return obj


def items(objs: Any) -> dict[str, list[Any]]:
    return {"items": [item(o) for o in objs]}
