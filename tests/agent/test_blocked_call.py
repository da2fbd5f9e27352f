"""What a blocked thread waits on, read from Linux's /proc: each test blocks a real thread in one kind of call
and asks what ``blocked_call.read`` and ``words`` say about it."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpscope.agent import blocked_call
from ddpscope.agent.records import validate_record
from tests.support.procs import until_asleep

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")


def _blocked(target: Callable[[], object]) -> threading.Thread:
    """A daemon thread running ``target``, once the kernel says it sleeps (in a system call)."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    until_asleep(thread.native_id)
    return thread


def _read(target: Callable[[], object], store: tuple[str, int] | None = None) -> dict[str, Any] | None:
    thread = _blocked(target)
    assert thread.native_id is not None
    return blocked_call.read(thread.native_id, store)


@pytest.fixture
def silent_server() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A listening socket that accepts one connection and never writes to it, and that connection's client."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    yield server, client
    for s in (client, accepted, server):
        s.close()


def test_a_read_from_a_tcp_peer_that_never_answers_names_the_peer_address(
    silent_server: tuple[socket.socket, socket.socket],
) -> None:
    server, client = silent_server
    call = _read(lambda: client.recv(10))
    host, port = server.getsockname()
    assert call == {
        "syscall": "recvfrom",
        "on": [{"fd": client.fileno(), "kind": "tcp", "name": f"{host}:{port}"}],
    }
    said = blocked_call.words(call)
    assert said == (
        f"waiting on a TCP connection to {host}:{port} (recvfrom) for the other side to answer (a call without "
        "a timeout waits for good)"
    )
    assert validate_record({"kind": "stall_sample", "blocked_call": call, **_SAMPLE}) == "stall_sample"


_SAMPLE = {"job": "j", "rank": 0, "stream": "s", "seq": 0, "time_ns": 1, "step": 1, "phase": "idle",
           "stalled_s": 1.0, "site": None, "stack": "", "main_cpu_s": 0.0}  # fmt: skip


def test_a_select_on_the_process_groups_store_connection_is_said_as_a_wait_for_the_store(
    silent_server: tuple[socket.socket, socket.socket],
) -> None:
    server, client = silent_server
    host, port = server.getsockname()
    call = _read(lambda: select.select([client], [], []), store=(host, port))
    assert call is not None and call["syscall"] in ("select", "pselect6")
    assert call["on"] == [{"fd": client.fileno(), "kind": "tcp", "name": f"{host}:{port}", "role": "store"}]
    said = blocked_call.words(call)
    assert said is not None and f"waiting on the process group's store at {host}:{port}" in said
    assert "store.wait() or store.get() of a key no rank has set yet" in said


def test_a_store_given_by_host_name_is_matched_on_its_port(
    silent_server: tuple[socket.socket, socket.socket],
) -> None:
    server, client = silent_server
    port = server.getsockname()[1]
    call = _read(lambda: select.select([client], [], []), store=("localhost", port))
    assert call is not None and call["on"][0]["role"] == "store"
    other = _read(lambda: select.select([client], [], []), store=("10.9.9.9", port))
    assert other is not None and "role" not in other["on"][0]  # an IP literal must match too


def test_a_listening_socket_waits_for_a_connection_no_one_makes() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    try:
        call = _read(server.accept)
        host, port = server.getsockname()
        assert call is not None and call["on"] == [
            {"fd": server.fileno(), "kind": "tcp-listen", "name": f"{host}:{port}"}
        ]
        assert f"waiting for a connection on {host}:{port}" in (blocked_call.words(call) or "")
    finally:
        server.close()


def test_a_read_from_an_empty_pipe_and_a_write_to_a_full_one_say_which_end_is_silent() -> None:
    r, w = os.pipe()
    try:
        call = _read(lambda: os.read(r, 1))
        assert call == {"syscall": "read", "on": [{"fd": r, "kind": "pipe", "name": ""}]}
        assert "a pipe (read) for its other end to write (a subprocess" in (blocked_call.words(call) or "")
        os.set_blocking(w, True)
        full = _read(lambda: os.write(w, b"x" * (1 << 20)))
        assert full is not None and full["syscall"] == "write"
        assert "for its other end to read (it is full)" in (blocked_call.words(full) or "")
    finally:
        os.close(r)
        os.close(w)


def test_opening_a_named_pipe_no_one_opens_names_the_path(tmp_path: Path) -> None:
    fifo = tmp_path / "handoff"
    os.mkfifo(fifo)
    call = _read(fifo.read_text)
    assert call == {"syscall": "openat", "path": str(fifo)}
    assert f"in openat of {fifo} (a named pipe waits there for its other end to open" in (
        blocked_call.words(call) or ""
    )
    with open(fifo, "w"):  # lets the thread go
        pass


def test_waiting_for_a_child_process_names_it_and_its_command() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        call = _read(child.wait)
        assert call == {"syscall": "wait4", "pid": child.pid, "command": "sleep 30"}
        assert (
            blocked_call.words(call)
            == f"waiting for its child process {child.pid} (sleep 30) to exit (wait4)"
        )
    finally:
        child.kill()
        child.wait()


def test_a_held_lock_and_a_sleep_are_named_as_such() -> None:
    lock = threading.Lock()
    lock.acquire()
    try:
        call = _read(lock.acquire)
        assert call == {"syscall": "futex"}
        assert (blocked_call.words(call) or "").startswith("waiting on a lock or condition variable (futex)")
    finally:
        lock.release()
    nap = _read(lambda: time.sleep(30))
    assert nap is not None and blocked_call.words(nap) == f"sleeping ({nap['syscall']})"


def test_a_thread_that_is_gone_or_unknown_gives_nothing() -> None:
    assert blocked_call.read(None) is None
    assert blocked_call.read(2**22 + 12345) is None  # no such task
    assert blocked_call.words(None) is None and blocked_call.words({}) is None


def test_socket_table_addresses_are_read_in_the_kernels_byte_order() -> None:
    assert blocked_call._address("0100007F:73AB") == "127.0.0.1:29611"
    assert blocked_call._address("0000000000000000FFFF00000100007F:8674") == "127.0.0.1:34420"
    assert blocked_call._address("00000000000000000000000001000000:0050") == "::1:80"
    assert blocked_call._address("not-hex:zz") == "not-hex:zz"


def test_a_child_process_blocked_in_a_read_of_a_named_pipe_is_read_from_its_own_proc(tmp_path: Path) -> None:
    # A DataLoader worker stuck in a read (a network mount that stopped answering, here a named pipe no one
    # writes): the rank reads what its child waits on, as it reads its own threads.
    fifo = tmp_path / "shard-17.bin"
    os.mkfifo(fifo)
    code = "import os, sys; f = os.open(sys.argv[1], os.O_RDWR); os.read(f, 1)"  # O_RDWR: open does not wait
    child = subprocess.Popen([sys.executable, "-c", code, str(fifo)])
    try:
        deadline = time.monotonic() + 10
        call = None
        while time.monotonic() < deadline and (call is None or call.get("syscall") != "read"):
            time.sleep(0.05)
            call = blocked_call.read_process(child.pid)
        assert call == {"syscall": "read", "on": [{"fd": 3, "kind": "fifo", "name": str(fifo)}]}, call
        assert f"waiting on the named pipe {fifo} (read) for its other end to write" in (
            blocked_call.words(call) or ""
        )
    finally:
        child.kill()
        child.wait()
    assert blocked_call.read_process(child.pid) is None  # gone
