"""A restarted job whose new processes cannot connect: gloo read a peer address the earlier attempt left.

torchrun restarts every worker of a job in place (``--max-restarts``), and the rendezvous store can outlive
the attempt: the static rendezvous (torchrun without ``--rdzv-backend``) keeps one store for good, and the
c10d rendezvous shares its store with the workers by default (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``). A
restarted rank's ``init_process_group`` then may read a peer's gloo address the earlier attempt wrote before
the new peer replaced it, connect to a port nobody listens on any more, and fail ("Gloo connectFullMesh
failed ... Connection refused, remote=[127.0.0.1]:37767") or wait until the group's timeout.

Measured on torch 2.13 (gloo, 2 ranks, one rank raising at step 5 of the first attempt): the static
rendezvous failed every restart; the c10d rendezvous failed 3 of 3 restarts under ddpscope and 1 of 3
without it (a race: ddpscope's start-up moves the ranks' timing), and none of 3 with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (pytorch/pytorch#135712 describes the shared store's restarts).

Pure functions over records; no database, no HTTP.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ddpscope.server.analysis.incident_model import Record
from ddpscope.server.analysis.snapshot import JobSnapshot, process_stream

_CONNECT_FAILED = re.compile(
    r"(?:connectFullMesh failed|Connection refused|failed to connect).*?remote=\[([^\]]+)\]:(\d+)", re.S
)
"""gloo's error when a rank cannot connect to a peer's address: the address it tried."""

ADVICE = (
    "Launch with torchrun --rdzv-backend c10d --rdzv-endpoint HOST:PORT and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
    "in the environment, which gives every attempt a store of its own (measured: restarts that failed so "
    "then succeed; pytorch/pytorch#135712)"
)


def refused_address(error: Record) -> tuple[str, str] | None:
    """(host, port) of the peer a rank's gloo could not connect to, from its error; None for other errors."""
    m = _CONNECT_FAILED.search(str(error.get("message", "")))
    return None if m is None else (m.group(1), m.group(2))


def stale_peer_address(failed: Sequence[Record], earlier: Iterable[Record]) -> str | None:
    """Why ``failed`` (errors of the processes after a restart) could not connect, when one of them tried a
    peer address that an error of the earlier attempt (``earlier``) names, so it belonged to a process that
    is gone; None otherwise."""
    said = " ".join(str(e.get("message", "")) for e in earlier)
    for v in failed:
        tried = refused_address(v)
        if tried is None:
            continue
        host, port = tried
        address = f"{host}:{port}"
        if f"[{host}]:{port}" not in said and address not in said:
            continue
        return (
            f"after the restart, rank {v['rank']} tried to connect to {address}, an address of the earlier "
            "attempt's processes (their errors name it): the rendezvous store outlived the attempt, and gloo read "
            "the address the earlier peer had left there before the new peer replaced it. "
            f"{ADVICE}"
        )
    return None


def relaunched_before_start(snapshot: JobSnapshot, rec: Record) -> bool:
    """``rec`` comes from a process of its rank that has not sent a ``rank_start``, while an earlier
    process of that rank did: a restart still in its set-up (a derived stream, ``<stream>.crash``, is its
    process's own)."""
    own = process_stream(str(rec.get("stream") or ""))
    earlier = {process_stream(str(s["stream"])) for s in snapshot.starts if s["rank"] == rec["rank"]}
    return bool(own) and bool(earlier) and own not in earlier


HANG_CAUSE = (
    "; this process is a restart of its rank (an earlier process of it ran this job): after a torchrun "
    "restart, gloo can read a peer address the earlier attempt left in a rendezvous store that outlived it, "
    "and wait for a process that is gone. "
)
