"""What a blocked thread waits on, as the kernel sees it: the system call it sits in, and on what.

A rank stuck in its own code with its training thread blocked shows only its innermost Python line, and a
line such as ``store.wait(["ckpt-done"])``, ``sock.recv(100)`` or ``open(path)`` hides the C call beneath it.
Linux says which system call a thread is in (``/proc/self/task/<tid>/syscall``: its number and arguments)
and what each file descriptor is (``/proc/self/fd``, ``/proc/net/*``), so a hang report can say "waiting
on a TCP connection to 10.0.0.5:443" or "waiting for the process group's store at 127.0.0.1:29500"
instead of "a lock, I/O, a queue or a sleep".

The descriptors a ``poll``/``select`` waits on are in the thread's own memory; they are read through
``/proc/self/mem``, which answers an unmapped address with an error rather than a crash. Everything here
runs on the watchdog's thread at report time, never per step; any failure (another platform, a thread that
moved on meanwhile, a ``/proc`` that refuses) gives None or a shorter answer, never an exception.

Standard library only: the watchdog calls ``read``; ``words`` says a ``blocked_call`` field in the rank's
own hang message and in the collector's diagnoses alike.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import stat
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

MAX_FDS = 8
"""At most this many descriptors of one poll/select/epoll are described (a server loop may wait on
hundreds; the first few say what kind of wait it is)."""
MAX_NET_LINES = 200_000
"""A /proc/net table read is cut here: a host with more sockets than that describes some fds as "socket"."""

_X86_64 = {
    0: "read", 1: "write", 2: "open", 4: "stat", 6: "lstat", 7: "poll", 17: "pread64", 18: "pwrite64",
    19: "readv", 20: "writev", 23: "select", 34: "pause", 35: "nanosleep", 40: "sendfile", 42: "connect",
    43: "accept", 44: "sendto", 45: "recvfrom", 46: "sendmsg", 47: "recvmsg", 61: "wait4", 65: "semop",
    70: "msgrcv", 72: "fcntl", 73: "flock", 74: "fsync", 75: "fdatasync", 128: "rt_sigtimedwait",
    130: "rt_sigsuspend", 202: "futex", 208: "io_getevents", 217: "getdents64", 220: "semtimedop",
    230: "clock_nanosleep", 232: "epoll_wait", 247: "waitid", 257: "openat", 262: "newfstatat",
    270: "pselect6", 271: "ppoll", 275: "splice", 281: "epoll_pwait", 288: "accept4", 295: "preadv",
    296: "pwritev", 299: "recvmmsg", 332: "statx", 426: "io_uring_enter", 441: "epoll_pwait2",
    449: "futex_waitv",
}  # fmt: skip
_AARCH64 = {
    4: "io_getevents", 22: "epoll_pwait", 25: "fcntl", 32: "flock", 56: "openat", 61: "getdents64",
    63: "read", 64: "write", 65: "readv", 66: "writev", 67: "pread64", 68: "pwrite64", 69: "preadv",
    70: "pwritev", 71: "sendfile", 72: "pselect6", 73: "ppoll", 76: "splice", 79: "newfstatat",
    82: "fsync", 83: "fdatasync", 95: "waitid", 98: "futex", 101: "nanosleep", 115: "clock_nanosleep",
    133: "rt_sigsuspend", 137: "rt_sigtimedwait", 188: "msgrcv", 192: "semtimedop", 193: "semop",
    202: "accept", 203: "connect", 206: "sendto", 207: "recvfrom", 211: "sendmsg", 212: "recvmsg",
    242: "accept4", 243: "recvmmsg", 260: "wait4", 291: "statx", 426: "io_uring_enter",
    441: "epoll_pwait2", 449: "futex_waitv",
}  # fmt: skip
SYSCALLS: dict[str, dict[int, str]] = {
    "x86_64": _X86_64,
    "amd64": _X86_64,
    "aarch64": _AARCH64,
    "arm64": _AARCH64,
}
"""The blocking system calls worth naming, by number, per architecture (others are said by number)."""

_FD_FIRST = frozenset(
    {
        *("read", "readv", "pread64", "preadv", "recvfrom", "recvmsg", "recvmmsg", "accept", "accept4"),
        *("write", "writev", "pwrite64", "pwritev", "sendto", "sendmsg", "connect", "splice"),
        *("fcntl", "flock", "fsync", "fdatasync", "getdents64"),
    }
)
"""System calls whose first argument is the descriptor they wait on."""
_PATH_ARG = {"open": 0, "stat": 0, "lstat": 0, "openat": 1, "newfstatat": 1, "statx": 1}
"""System calls on a path: which argument points to it."""
_EPOLL = frozenset({"epoll_wait", "epoll_pwait", "epoll_pwait2"})
_TCP_LISTEN = "0A"


def read(
    native_id: int | None, store: tuple[str, int] | None = None, *, pid: int | None = None
) -> dict[str, Any] | None:
    """The system call thread ``native_id`` of this process (of process ``pid``, one of its DataLoader
    workers, say) is blocked in, as a ``blocked_call`` record field: ``syscall`` (its name, or "syscall N"),
    and when it can tell, ``on`` (the descriptors it waits on: ``fd``, ``kind``, ``name``, and ``role`` "store"
    for a connection to ``store``, the default process group's TCPStore as (host, port)), ``path`` (a path it
    opens or stats) or ``pid`` and ``command`` (a child it waits for). None when the thread is running, gone,
    or the platform cannot tell."""
    if native_id is None or not sys.platform.startswith("linux"):
        return None
    proc = "/proc/self" if pid is None else f"/proc/{pid}"
    try:
        with open(f"{proc}/task/{native_id}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return None
    if not fields or fields[0] in ("running", "-1"):
        return None
    try:
        number = int(fields[0])
        args = [int(a, 16) for a in fields[1:7]]
    except ValueError:
        return None
    name = SYSCALLS.get(platform.machine().lower(), {}).get(number, f"syscall {number}")
    call: dict[str, Any] = {"syscall": name}
    with contextlib.suppress(Exception):  # a thread that moved on, a /proc that refuses: the name is news
        _describe_arguments(call, name, args, store, proc)
    return call


def read_process(pid: int, store: tuple[str, int] | None = None) -> dict[str, Any] | None:
    """``read`` of process ``pid``'s main thread (a child: a parent may read its children's ``/proc``)."""
    return read(pid, store, pid=pid)


def _describe_arguments(
    call: dict[str, Any], name: str, args: Sequence[int], store: tuple[str, int] | None, proc: str
) -> None:
    fds: list[int] = []
    if name in _FD_FIRST and len(args) > 0:
        fds = [args[0]]
    elif name in ("poll", "ppoll") and len(args) > 1:
        fds = _poll_fds(proc, args[0], args[1])
    elif name in ("select", "pselect6") and len(args) > 3:
        fds = _select_fds(proc, args[0], args[1:4])
    elif name in _EPOLL and len(args) > 0:
        fds = _epoll_fds(proc, args[0])
    elif name in _PATH_ARG and len(args) > _PATH_ARG[name]:
        path = _c_string(proc, args[_PATH_ARG[name]])
        if path:
            call["path"] = path
    elif name == "wait4" and len(args) > 0 and _signed(args[0]) > 0:
        _child(call, args[0])
    elif name == "waitid" and len(args) > 1 and args[0] == 1:  # P_PID
        _child(call, args[1])
    if fds:
        sockets = _SocketTables()
        call["on"] = [_fd_entry(proc, fd, sockets, store) for fd in fds[:MAX_FDS]]


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _memory(proc: str, address: int, size: int) -> bytes:
    with open(f"{proc}/mem", "rb", buffering=0) as mem:
        mem.seek(address)
        return mem.read(size)


def _c_string(proc: str, address: int, limit: int = 512) -> str | None:
    raw = _memory(proc, address, limit)
    end = raw.find(b"\0")
    return None if end <= 0 else raw[:end].decode(errors="replace")


def _poll_fds(proc: str, address: int, count: int) -> list[int]:
    """The descriptors of a ``struct pollfd`` array (int fd; short events; short revents)."""
    count = min(count, MAX_FDS)
    raw = _memory(proc, address, 8 * count)
    return [fd for (fd, _, _) in struct.iter_unpack("ihh", raw[: 8 * (len(raw) // 8)]) if fd >= 0]


def _select_fds(proc: str, nfds: int, sets: Sequence[int]) -> list[int]:
    """The descriptors set in a select's read, write and except bitmaps (each ``nfds`` bits long)."""
    nfds = min(nfds, 1024)
    size = (nfds + 7) // 8
    found: list[int] = []
    for address in sets:
        if not address:
            continue
        bits = _memory(proc, address, size)
        found += [fd for fd in range(nfds) if bits[fd // 8] >> (fd % 8) & 1 and fd not in found]
    return found


def _epoll_fds(proc: str, epfd: int) -> list[int]:
    """The descriptors registered with epoll instance ``epfd`` (its fdinfo's ``tfd:`` lines)."""
    with open(f"{proc}/fdinfo/{epfd}") as f:
        return [int(line.split()[1]) for line in f if line.startswith("tfd:")][:MAX_FDS]


def _child(call: dict[str, Any], pid: int) -> None:
    call["pid"] = pid
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").strip().decode(errors="replace")
    except OSError:
        return
    if command:
        call["command"] = command[:200]


def _fd_entry(proc: str, fd: int, sockets: _SocketTables, store: tuple[str, int] | None) -> dict[str, Any]:
    try:
        target = os.readlink(f"{proc}/fd/{fd}")
    except OSError:
        return {"fd": fd, "kind": "closed", "name": ""}
    if target.startswith("socket:["):
        kind, name = sockets.find(target[8:-1])
        entry = {"fd": fd, "kind": kind, "name": name}
        if store is not None and kind == "tcp" and _is_address(name, store):
            entry["role"] = "store"
        return entry
    if target.startswith("pipe:["):
        return {"fd": fd, "kind": "pipe", "name": ""}
    if target.startswith("anon_inode:"):
        return {"fd": fd, "kind": target[len("anon_inode:") :].strip("[]") or "anon", "name": ""}
    if target.startswith(("/dev/pts/", "/dev/tty")) or target == "/dev/console":
        return {"fd": fd, "kind": "tty", "name": target}
    kind = "file"
    try:
        if stat.S_ISFIFO(os.stat(f"{proc}/fd/{fd}").st_mode):
            kind = "fifo"
    except OSError:
        pass
    return {"fd": fd, "kind": kind, "name": target[:300]}


def _is_address(peer: str, store: tuple[str, int]) -> bool:
    """Whether ``peer`` ("host:port") is the store's address: the port must match, and the host too when the
    store was given an IP literal (a host name is not resolved here: a DNS lookup could block)."""
    host, _, port = peer.rpartition(":")
    store_host, store_port = store
    if port != str(store_port):
        return False
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in store_host else socket.AF_INET, store_host)
    except OSError:
        return True  # a host name: the port alone decides
    return host == store_host or (store_host.startswith(("127.", "::1")) and host.startswith(("127.", "::1")))


class _SocketTables:
    """The host's socket tables (/proc/net), read once per report and only if a socket is described."""

    def __init__(self) -> None:
        self._by_inode: dict[str, tuple[str, str]] | None = None

    def find(self, inode: str) -> tuple[str, str]:
        if self._by_inode is None:
            self._by_inode = _read_tables()
        return self._by_inode.get(inode, ("socket", ""))


def _read_tables() -> dict[str, tuple[str, str]]:
    found: dict[str, tuple[str, str]] = {}
    for table, kind in (("tcp", "tcp"), ("tcp6", "tcp"), ("udp", "udp"), ("udp6", "udp")):
        for cols in _rows(f"/proc/net/{table}"):
            if len(cols) < 10:
                continue
            if kind == "tcp" and cols[3] == _TCP_LISTEN:
                found[cols[9]] = ("tcp-listen", _address(cols[1]))
            else:
                found[cols[9]] = (kind, _address(cols[2]))
    for cols in _rows("/proc/net/unix"):
        if len(cols) >= 7:
            found[cols[6]] = ("unix", cols[7] if len(cols) > 7 else "")
    return found


def _rows(path: str) -> list[list[str]]:
    try:
        with open(path) as f:
            next(f, None)  # the header
            return [line.split() for _, line in zip(range(MAX_NET_LINES), f, strict=False)]
    except OSError:
        return []


def _address(field: str) -> str:
    """ "0100007F:73AB" (IPv4) or 32 hex digits and a port (IPv6), in the kernel's byte order, as host:port."""
    hex_ip, _, hex_port = field.partition(":")
    try:
        raw = bytes.fromhex(hex_ip)
        port = int(hex_port, 16)
    except ValueError:
        return field
    # Each 32-bit word is in host byte order.
    words = [raw[i : i + 4] for i in range(0, len(raw), 4)]
    if sys.byteorder == "little":
        words = [w[::-1] for w in words]
    packed = b"".join(words)
    if len(packed) == 16 and packed[:12] == b"\0" * 10 + b"\xff\xff":
        packed = packed[12:]  # an IPv4-mapped IPv6 address: said as IPv4
    try:
        host = socket.inet_ntop(socket.AF_INET if len(packed) == 4 else socket.AF_INET6, packed)
    except (OSError, ValueError):
        return field
    return f"{host}:{port}"


# -- words ------------------------------------------------------------------------------------------------

_SLEEPS = frozenset({"nanosleep", "clock_nanosleep"})
_SIGNALS = frozenset({"pause", "rt_sigsuspend", "rt_sigtimedwait"})
_LOCKS = frozenset({"futex", "futex_waitv"})


def words(call: Mapping[str, Any] | None) -> str | None:
    """What a ``blocked_call`` field says a thread waits on, in words ("waiting for the process group's store
    at 127.0.0.1:29500 (poll) ..."); None when there is nothing to say beyond "blocked"."""
    if not call:
        return None
    syscall = str(call.get("syscall", ""))
    on = [e for e in call.get("on") or () if isinstance(e, Mapping)]
    if on:
        return _fd_words(on, syscall)
    if call.get("path"):
        return (
            f"in {syscall} of {call['path']} (a named pipe waits there for its other end to open, any other path "
            "on a slow or unresponsive file system: a network mount)"
        )
    if call.get("pid") is not None:
        command = f" ({call['command']})" if call.get("command") else ""
        return f"waiting for its child process {call['pid']}{command} to exit ({syscall})"
    if syscall in ("wait4", "waitid"):
        return f"waiting for a child process to exit ({syscall})"
    if syscall in _LOCKS:
        return (
            f"waiting on a lock or condition variable ({syscall}): another thread holds the lock, or never sets "
            "what this one waits for (a queue, an event, a future)"
        )
    if syscall in _SLEEPS:
        return f"sleeping ({syscall})"
    if syscall in _SIGNALS:
        return f"waiting for a signal ({syscall})"
    return f"in the system call {syscall}" if syscall else None


MAX_WORKERS_SAID = 4


def workers_words(workers: Sequence[Mapping[str, Any]]) -> str | None:
    """What a ``loader_workers`` field says a DataLoader's workers were doing ("worker 1151 waiting on the
    file /mnt/nfs/shard-17.bin (read): ..."); None when it names none. The rank's own hang message and the
    collector's diagnoses say it alike."""
    workers = [w for w in workers if isinstance(w, Mapping)]
    if not workers:
        return None
    said = []
    for w in workers[:MAX_WORKERS_SAID]:
        call = w.get("blocked_call")
        what = words(call) if isinstance(call, Mapping) else None
        said.append(
            f"worker {w.get('pid')} "
            + (
                what
                or "running, not blocked (computing: a slow transform or decode, or a loop that does not end)"
            )
        )
    more = f"; and {len(workers) - MAX_WORKERS_SAID} more" if len(workers) > MAX_WORKERS_SAID else ""
    return "; ".join(said) + more


_WRITES = frozenset({"write", "writev", "pwrite64", "pwritev", "sendto", "sendmsg", "sendfile"})


def _fd_words(on: Sequence[Mapping[str, Any]], syscall: str) -> str:
    store = next((e for e in on if e.get("role") == "store"), None)
    if store is not None:
        return (
            f"waiting on the process group's store at {store.get('name')} ({syscall}): a store.wait() or "
            "store.get() of a key no rank has set yet (the rank meant to set it has not got there, or spells the "
            "key differently), or a barrier through the store that another rank has not reached"
        )
    first = on[0]
    kind, name = str(first.get("kind", "")), str(first.get("name") or "")
    more = f" (and {len(on) - 1} more)" if len(on) > 1 else ""
    at = f"{more} ({syscall})"
    # A write blocks on a full buffer, a read on an empty one: the other end is not reading, or not writing.
    answer = "read what this one writes" if syscall in _WRITES else "answer"
    if kind == "tcp":
        return (
            f"waiting on a TCP connection to {name}{at} for the other side to {answer} (a call without a timeout "
            "waits for good)"
        )
    if kind == "tcp-listen":
        return f"waiting for a connection on {name}{at} that no one makes"
    if kind == "udp":
        return f"waiting on a UDP socket{' to ' + name if name else ''}{at}"
    if kind == "unix":
        return f"waiting on a Unix socket{' ' + name if name else ''}{at} for the process at its other end to {answer}"
    if kind in ("pipe", "fifo"):
        pipe = "a pipe" if kind == "pipe" else f"the named pipe {name}"
        end = "read (it is full)" if syscall in _WRITES else "write"
        return f"waiting on {pipe}{at} for its other end to {end} (a subprocess, or a worker's queue)"
    if kind == "tty":
        return f"waiting on the terminal {name}{at}: input() or a prompt waits for someone to type"
    if kind == "file":
        return (
            f"waiting on the file {name}{at}: a slow or unresponsive file system (a network mount), or a lock "
            "another process holds"
        )
    return f"waiting on {kind or 'a descriptor'}{' ' + name if name else ''}{at}"
