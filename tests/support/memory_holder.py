"""A worker process that holds memory of its own, for the agent's memory tests. Stdlib only: a spawned
worker imports this module, and one that imported torch would hold a few hundred MiB more of its own."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any


def hold(mib: int, ready: Any, grandchild_mib: int = 0) -> None:
    """Holds ``mib`` MiB of its own (and starts a worker of its own holding ``grandchild_mib``), releases
    ``ready`` once per process, then waits to be killed."""
    held = bytearray(mib * 2**20)
    for i in range(0, len(held), 4096):
        held[i] = 1  # touched: resident, and this process's own
    if grandchild_mib:
        multiprocessing.get_context("spawn").Process(
            target=hold, args=(grandchild_mib, ready), daemon=True
        ).start()
    ready.release()
    time.sleep(60)
