"""The zygote: one interpreter that imports torch once, then forks the rank processes of the test jobs.

Importing torch costs every rank 2.6-3.4 s of CPU before it does anything, and the suite starts hundreds of
ranks on 2 cores. A rank forked from here starts with torch already imported and runs its script as
``python script.py args`` would: ``__main__`` is the script, ``sys.argv`` and ``sys.path[0]`` are the
script's, its environment, working directory and standard streams are the ones the test asked for, an
uncaught exception goes through ``sys.excepthook`` and exits 1, ``atexit`` handlers run. What differs is
said in ``tests/support/preloaded.py``, which decides when a launch may come here.

Run as ``python zygote.py SOCKET`` (by ``preloaded.py``). Protocol, one connection a launch: the test sends
one JSON line (argv, env, cwd, new_session) with its stdin, stdout and stderr descriptors attached
(SCM_RIGHTS); the zygote answers with the rank's pid. The rank is forked by a short-lived launcher that
exits at once, so the rank is re-parented to the test process (a child subreaper): the test waits for it,
reads its exit status and signals it as any ``subprocess.Popen`` child.

The zygote itself stays single-threaded (forking a threaded process can copy a held lock) and never imports
ddpscope: what the product reads from the environment at import time is read in the rank, as it would be.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import socket
import sys
import time
from typing import Any

PR_SET_PDEATHSIG = 1
PRELOADED = ("torch", "torch.distributed", "torch.nn", "torch.nn.parallel", "torch.optim", "numpy")


def _serve(path: str) -> dict[str, Any]:
    """Answer launches until killed (by ``preloaded.Zygote.close``, or with the test process); return, in a
    rank, its request."""
    _die_with_parent()
    for name in PRELOADED:
        __import__(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            message, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
            while not message.endswith(b"\n"):
                more = conn.recv(1 << 16)
                if not more:
                    break
                message += more
            request = json.loads(message)
            rank_pid = _fork_rank(server, conn)
            if rank_pid == 0:
                request["fds"] = fds
                return request
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{rank_pid}\n".encode())


def _die_with_parent() -> None:
    """SIGKILL this zygote when the test process ends, however it ends (a forked child does not inherit it)."""
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the request took
        os._exit(0)


def _fork_rank(server: socket.socket, conn: socket.socket) -> int:
    """Fork the launcher, which forks the rank and exits: the rank's pid here, 0 in the rank."""
    if len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError("the zygote has a thread: forking could copy a held lock")
    read_end, write_end = os.pipe()
    launcher = os.fork()
    if launcher == 0:
        in_rank = False
        try:
            os.close(read_end)
            launcher_pid = os.getpid()
            rank = os.fork()
            if rank == 0:
                in_rank = True
                os.close(write_end)
                server.close()
                conn.close()
                _wait_for_new_parent(launcher_pid)
                return 0
            os.write(write_end, f"{rank}\n".encode())
        except BaseException:
            if in_rank:
                raise
            os._exit(1)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as reply:
        line = reply.readline()
    os.waitpid(launcher, 0)
    if not line.strip():
        raise RuntimeError("the launcher did not report the rank's pid")
    return int(line)


def _wait_for_new_parent(launcher_pid: int) -> None:
    """Wait until the launcher has exited and this process belongs to the test process: the rank must see
    the test as its parent from its first line (the default job id hashes the parent's pid)."""
    deadline = time.monotonic() + 10.0
    while os.getppid() == launcher_pid and time.monotonic() < deadline:
        time.sleep(0.0005)


def _become(request: dict[str, Any]) -> str:
    """Take the rank's streams, session, directory, environment and argv; return the script's path."""
    stdin, stdout, stderr = request["fds"]
    if request.get("new_session"):
        os.setsid()
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
    for fd in {stdin, stdout, stderr} - {0, 1, 2}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("cwd"):
        os.chdir(request["cwd"])
    script = request["argv"][1]
    sys.argv = list(request["argv"][1:])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    return str(script)


if __name__ == "__main__":
    _request = _serve(sys.argv[1])
    # From here on this process is a rank. The script's globals stay referenced until the interpreter
    # ends, as a __main__ module's do, so its objects outlive the atexit handlers as they would.
    _globals = runpy.run_path(_become(_request), run_name="__main__")
