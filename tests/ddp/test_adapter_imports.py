"""The adapter and the engine share public modules, not each other's private names (issue #7)."""

from __future__ import annotations

import ast
from pathlib import Path

DDP = Path(__file__).resolve().parents[2] / "ddp"


def private_imports(path: Path) -> list[str]:
    """``module.name`` for every ``from ddpscope... import _name`` in a source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddpscope"):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_the_adapter_and_the_engine_import_no_private_name_of_another_ddpscope_module() -> None:
    for name in ("adapter.py", "adapter_layout.py", "engine.py", "rank_start.py", "outputs.py"):
        assert private_imports(DDP / name) == [], name


def test_the_private_import_finder_sees_one(tmp_path: Path) -> None:
    # The guard above must be able to fail: the pattern issue #7 removed is caught.
    source = tmp_path / "m.py"
    source.write_text("from ddpscope.ddp.engine import _version\nfrom ddpscope.ddp import groups\n")
    assert private_imports(source) == ["ddpscope.ddp.engine._version"]
