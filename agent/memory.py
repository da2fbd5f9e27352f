"""A rank's memory, and the memory it may grow into: the evidence for a leak and for the OOM killer.

A rank the kernel's out-of-memory killer ends gets SIGKILL: no traceback, no exit hook, nothing in the
job's logs. Its peers then fail on a lost connection, and "killed, crashed in native code, or os._exit()"
is all anyone can say, unless the rank's memory was watched on the way there. So the watchdog's thread
samples it at each heartbeat (``/proc/self/statm``, ``/proc/meminfo``, the cgroup: ~30 us) and sends a
``memory`` record every ``DDPSCOPE_MEMORY_INTERVAL_S`` (30 s), and at once when its resident size, or the memory in use where
the OOM killer judges (the memory cgroup when it has a limit, else the host), rose by more than 2 % of
that memory since the last one (a blow-up can go from healthy to killed in seconds; a DataLoader
worker's shows only in the memory in use). Rises only: a step's activations freed and allocated again
would otherwise send a record at every heartbeat:

- ``rss_bytes``: the process's resident memory; ``anon_bytes``: the part not backed by files or shared memory
  (its heap and tensors, where a leak grows; the code of its libraries pages in and out on its own);
- ``workers_bytes`` / ``workers``: the memory of its worker processes that is their own: the children it
  forked or started through ``multiprocessing`` (DataLoader workers; a forkserver's children, not the
  forkserver), not a program it ran (``subprocess``) nor ddpscope's shipper, by their command lines;
  ``Private_Clean + Private_Dirty`` of ``/proc/<pid>/smaps_rollup`` (~3 ms a worker, read with each
  record, not each heartbeat). A forked worker's resident size counts every page it shares with the rank,
  so summing those would count the rank's memory once per worker; what a worker keeps, or copies from the
  rank by touching it (Python objects' reference counts: copy-on-read), is private;
- ``available_bytes`` / ``total_bytes``: the host's ``MemAvailable`` and ``MemTotal`` (``/proc/meminfo``),
  since the killer acts on the host's memory, which other ranks and processes share;
- ``limit_bytes`` / ``cgroup_bytes``: the memory cgroup's limit and usage, when it has a limit below the
  host's memory (a container, a Slurm job's cgroup): the killer acts there first.

Linux only: elsewhere ``MemoryReader.read`` returns None and nothing is sent. Never raises.
"""

from __future__ import annotations

import os
from typing import Any

MEMORY_JUMP = 0.02
"""A rise of the resident size or of the memory in use, as a fraction of the memory the OOM killer judges
(the cgroup's limit, else the host's), that is sent without waiting."""

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            text = f.read(64).strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:  # cgroup v2's "max": no limit
        return None


def _cgroup_files(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> tuple[str, str] | None:
    """(limit file, usage file) of this process's memory cgroup, v1 or v2; None when there is none."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):  # v1: a hierarchy of its own
            return _existing(
                os.path.join(root, "memory"), path, "memory.limit_in_bytes", "memory.usage_in_bytes"
            )
        if hierarchy == "0" and not controllers:
            unified = path
    if unified is not None:  # v2
        return _existing(root, unified, "memory.max", "memory.current")
    return None


def _existing(base: str, path: str, limit: str, usage: str) -> tuple[str, str] | None:
    """The cgroup's own files, else the mount root's: a container sees its cgroup at the root, where the
    path ``/proc/self/cgroup`` names does not exist."""
    for directory in (os.path.join(base, path.lstrip("/")), base):
        if os.path.exists(os.path.join(directory, limit)):
            return os.path.join(directory, limit), os.path.join(directory, usage)
    return None


def _meminfo() -> tuple[int, int] | None:
    """(MemAvailable, MemTotal) in bytes."""
    available = total = None
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemTotal:"):
                    total = int(line.split()[1]) * 1024
                elif line.startswith(b"MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                if total is not None and available is not None:
                    return available, total
    except (OSError, ValueError, IndexError):
        return None
    return None


MAX_WORKERS = 64
"""Child processes read at most per record: a rank with more is not a DataLoader's (a process pool)."""


def _children(pid: int) -> list[int]:
    """The processes ``pid``'s threads started (``/proc/<pid>/task/*/children``), empty when unknown."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        pass
    return out


def _private_bytes(pid: int) -> int | None:
    """``pid``'s memory that no other process maps (its unique set), from ``smaps_rollup``."""
    private = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
                    private += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return private


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def _is_worker(cmdline: bytes | None, own: bytes | None) -> bool:
    """A process forked from the rank (its command line is the rank's) or started by ``multiprocessing``
    (spawn, forkserver): a DataLoader's worker, a pool's."""
    return (
        cmdline is not None
        and (cmdline == own or b"multiprocessing" in cmdline)
        and b"resource_tracker" not in cmdline  # multiprocessing's own helper, not a worker
    )


def worker_pids(pid: int | None = None) -> list[int]:
    """The worker processes among the descendants of ``pid`` (this process): its DataLoader workers, a
    forkserver's children (not the forkserver), at most ``MAX_WORKERS``."""
    pid = os.getpid() if pid is None else pid
    own = _cmdline(pid)
    children = [(c, _cmdline(c)) for c in _children(pid)]
    todo = [
        (c, b"multiprocessing.forkserver" in (cmdline or b""))
        for c, cmdline in children
        if _is_worker(cmdline, own)
    ]
    found: list[int] = []
    while todo and len(found) < MAX_WORKERS:
        child, forkserver = todo.pop()
        todo += [(c, False) for c in _children(child)]  # a forkserver's workers carry its command line
        if not forkserver:  # it starts the workers; its own memory is what it imported, once
            found.append(child)
    return found


def workers_memory(pid: int | None = None) -> tuple[int, int] | None:
    """(private bytes, count) of the worker processes among the descendants of ``pid`` (this process): its
    DataLoader workers, a forkserver's children. None when it has none."""
    total = seen = 0
    for child in worker_pids(pid):
        private = _private_bytes(child)
        if private is None:  # exited meanwhile
            continue
        total, seen = total + private, seen + 1
    return (total, seen) if seen else None


def _statm() -> tuple[int, int] | None:
    """(resident, resident shared) bytes of this process, from ``/proc/self/statm``. Resident less shared is
    its anonymous memory: its heap and tensors, where a leak grows; the rest (the code of torch's libraries,
    paged in as new code paths run and again after the kernel dropped them) grows and shrinks on its own."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return int(fields[1]) * _PAGE, int(fields[2]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class MemoryReader:
    """Decides when a ``memory`` record is due and reads it. One per watchdog; used from its thread."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._sent_at: float | None = None
        self._sent_rss = 0
        self._sent_in_use = 0

    def due(self, now: float) -> dict[str, Any] | None:
        """The ``memory`` record to send now (without ``kind``'s envelope fields), or None.

        Each heartbeat reads the cheap part (~30 us: the rank's resident size, the host's memory, the
        cgroup's); the workers' private memory (~3 ms each) only when a record goes out."""
        try:
            record = _reading()
            if record is None:
                return None
            in_use, room = _in_use(record)
            rose = max(record["rss_bytes"] - self._sent_rss, in_use - self._sent_in_use) > MEMORY_JUMP * room
            if self._sent_at is not None and now - self._sent_at < self.interval_s and not rose:
                return None
            workers = workers_memory()
            if workers is not None:
                record["workers_bytes"], record["workers"] = workers
            self._sent_at, self._sent_rss, self._sent_in_use = now, record["rss_bytes"], in_use
            return record
        except Exception:  # a /proc oddity must never stop the watchdog's heartbeat
            return None


def _reading() -> dict[str, Any] | None:
    """A ``memory`` record without the workers' memory: this process's, the host's and the cgroup's."""
    statm = _statm()
    info = _meminfo()
    if statm is None or info is None:
        return None
    (rss, shared), (available, total) = statm, info
    record: dict[str, Any] = {
        "kind": "memory",
        "rss_bytes": rss,
        "anon_bytes": max(0, rss - shared),
        "available_bytes": available,
        "total_bytes": total,
    }
    cgroup = _cgroup_files()  # looked up at each reading (~10 us): a process may be moved into another
    if cgroup is not None:
        limit = _read_int(cgroup[0])
        if limit is not None and 0 < limit < total:
            usage = _read_int(cgroup[1])
            record["limit_bytes"] = limit
            if usage is not None:
                record["cgroup_bytes"] = usage
    return record


def _in_use(record: dict[str, Any]) -> tuple[int, int]:
    """(the memory in use, the memory it may grow into) where the OOM killer judges: the memory cgroup's
    usage and limit when it has one, else the host's. A rank's DataLoader workers, and every other
    process there, add to it, so their growth is sent without waiting too."""
    if "limit_bytes" in record:
        return int(record.get("cgroup_bytes", 0)), int(record["limit_bytes"])
    return int(record["total_bytes"] - record["available_bytes"]), int(record["total_bytes"])
