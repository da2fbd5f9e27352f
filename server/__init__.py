"""The ddpscope collector: ingest, storage, analysis, HTTP API and /metrics. Runs without torch.

Usage::

    ddpscope serve [--db URL] [--host 127.0.0.1] [--port 8321] [--token T] [--no-auth]

or, embedded (tests, other servers)::

    from ddpscope.server import Settings, create_app
    app = create_app(Settings(db_url="sqlite:///ddpscope.db"))

Storage can be used on its own (``Storage.open(url)``; read API in ``storage.py``'s docstring), and
the analysis functions in ``ddpscope.server.analysis`` are pure functions over rows and snapshots.
Names are resolved lazily so that importing one analysis module does not import FastAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpscope.server.app import create_app
    from ddpscope.server.settings import Settings
    from ddpscope.server.storage import Storage

__all__ = ["Settings", "Storage", "create_app"]

_LAZY = {
    "create_app": "ddpscope.server.app",
    "Settings": "ddpscope.server.settings",
    "Storage": "ddpscope.server.storage",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ddpscope.server' has no attribute {name!r}")
