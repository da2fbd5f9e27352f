"""Ranks of the job that run without ddpscope, found before ddpscope's own collectives.

``DDPSCOPE_DISABLED=1`` on some nodes only (an image or a launcher script that differs) leaves those ranks
without ddpscope: they never join the clock ping-pong ddpscope runs when a DDP model is built, so their
peers waited in it until the process group's timeout and the job died of ddpscope. The ranks that run it
say so in the default group's c10d store (``announce``, from ``monitor.enable``: as soon as the group exists,
so a peer slow to reach its model has long said it, and in any case before the model that asks); ``missing`` waits a bounded time for every member of a
DDP group to have said so, and one decision per model built on that group (``compare_set`` on one key: the
first rank to decide decides for all, so a rank that arrives late cannot run the ping-pong its peers
skipped). ``instrument()`` then skips the ping-pong and trains on; ddpscope's engine refuses, since the
ranks without it run torch's own DDP, whose collectives differ from the engine's.

Keys live under ``ddpscope/presence/<torchrun restart count>/`` of the default group's store. Never raises:
a store that fails, or none, counts as every rank present (the behaviour before this check).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from ddpscope.agent.log import get_logger
from ddpscope.ddp.groups import global_rank, pg_name

logger = get_logger(__name__)

WAIT_S = 30.0
"""How long ``instrument()`` waits for its group's announcements (at most; the hang timeout if shorter)
before deciding some peers run without ddpscope. The engine waits the hang timeout: it refuses then."""
POLL_FIRST_S, POLL_MAX_S = 0.01, 1.0

_decisions: dict[str, int] = {}
"""pg name -> models built on it so far in this process: every rank builds its models in one order."""


def _store() -> Any | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


def _prefix() -> str:
    return f"ddpscope/presence/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def announce() -> None:
    """Say in the store that this rank runs ddpscope. Idempotent; never raises."""
    try:
        store = _store()
        if store is not None:
            store.set(f"{_prefix()}rank/{global_rank()}", "1")
    except Exception:
        logger.debug("ddpscope: could not announce this rank in the store", exc_info=True)


def missing(group: Any = None, wait_s: float = WAIT_S) -> list[int]:
    """The global ranks of ``group`` that run without ddpscope, as one decision every rank of it shares
    for the model being built now; [] when all run it (or when the store cannot tell). Never raises."""
    try:
        return _missing(group, wait_s)
    except Exception:
        logger.debug("ddpscope: could not tell which ranks run ddpscope", exc_info=True)
        return []


def _missing(group: Any, wait_s: float) -> list[int]:
    import torch.distributed as dist

    store = _store()
    if store is None or dist.get_world_size(group) < 2:
        return []
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    name = pg_name(group)
    built = _decisions.get(name, 0)
    _decisions[name] = built + 1
    keys = [f"{_prefix()}rank/{r}" for r in members]
    decision_key = f"{_prefix()}decision/{name}/{built}"
    deadline = time.monotonic() + wait_s
    pause = POLL_FIRST_S
    absent: list[int] = []
    while True:
        # One round trip a look (``check`` is true when every key exists); each member's own key is read
        # only at the deadline, to name the missing: no O(world) reads at start-up.
        decided = store.check([decision_key])
        if decided or store.check(keys):
            break
        if time.monotonic() >= deadline:
            absent = [r for r, k in zip(members, keys, strict=True) if not store.check([k])]
            break
        time.sleep(pause)
        pause = min(pause * 2, POLL_MAX_S)
    mine = ",".join(map(str, absent))
    # The first decision stands: a late rank follows what its peers did ("" = every rank runs ddpscope).
    value = store.compare_set(decision_key, "", mine or "none") if not decided else store.get(decision_key)
    text = value.decode() if isinstance(value, bytes) else str(value)
    return [] if text in ("", "none") else [int(r) for r in text.split(",")]
