"""``RankPopen``: ``subprocess.Popen`` for ``python script.py`` ranks, forked from an interpreter that has
imported torch already (``zygote.py``) instead of exec'd, where that cannot change what the rank does.

Why: importing torch costs every rank 2.6-3.4 s of CPU, and the suite starts hundreds of ranks on 2 cores.

What stays as with an exec'd rank: the rank is this process's child (the zygote's launcher exits and the
rank is re-parented here, a child subreaper), so ``wait``, ``poll``, ``communicate``, exit codes (a signal's
as minus its number), ``kill`` and process groups (``start_new_session``) are plain ``Popen``; its stdin,
stdout and stderr are the pipes or descriptors asked for; ``__main__``, ``sys.argv``, ``sys.path[0]``, the
environment and the working directory are the script's; an uncaught exception reaches ``sys.excepthook`` and
exits 1; ``atexit`` handlers and interpreter shutdown run as usual.

What differs, and when a launch is exec'd as before instead:
- torch, numpy and what they import were imported under the zygote's environment. A zygote serves only
  launches that agree with it on every variable read at start-up (``PYTHON*``, ``TORCH*``, thread counts,
  the dynamic linker's, the allocator's): a launch that differs gets its own zygote.
- Traceback frames from ``runpy`` above the script's own, and ``/proc/PID/cmdline`` names ``zygote.py``.
- Anything but ``[sys.executable, "path/to/script.py", *args]`` with default ``Popen`` options is exec'd.
- ``DDPSCOPE_TEST_EXEC_RANKS=1`` execs every rank, to run the suite exactly as users start their jobs.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV_EXEC_RANKS = "DDPSCOPE_TEST_EXEC_RANKS"
ZYGOTE_SCRIPT = Path(__file__).with_name("zygote.py")
STARTUP_PREFIXES = ("PYTHON", "TORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS", "GOMP", "LD_", "MALLOC", "GLIBC")
"""Variables read while the interpreter, torch or numpy start: a zygote serves only launches that agree on them."""
READY_TIMEOUT_S = 120.0
"""A zygote that has not imported torch by then is given up on (its launches are exec'd)."""
LAUNCH_TIMEOUT_S = 30.0
PR_SET_CHILD_SUBREAPER = 36


def startup_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_PREFIXES)))


class Zygote:
    """One zygote process, for the launches whose start-up variables are ``env``'s."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="ddpscope-zygote-")
        self.path = os.path.join(self._dir, "socket")
        self.proc = subprocess.Popen(
            [sys.executable, str(ZYGOTE_SCRIPT), self.path],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT_S)
        if not ready or self.proc.stdout.readline().strip() != b"ready":
            self.close()
            raise RuntimeError(f"the zygote did not start within {READY_TIMEOUT_S} s")

    def launch(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, new_session: bool, fds: list[int]
    ) -> int:
        """Fork a rank running ``argv`` with these streams; its pid (a child of this process)."""
        request = {"argv": list(argv), "env": dict(env), "cwd": cwd, "new_session": new_session}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(LAUNCH_TIMEOUT_S)
            conn.connect(self.path)
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = conn.recv(64)
                if not chunk:
                    raise RuntimeError(f"the zygote closed the launch of {argv[1]} without a pid")
                reply += chunk
        return int(reply)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


_zygotes: dict[tuple[tuple[str, str], ...], Zygote | None] = {}
_lock = threading.Lock()


def _zygote(env: Mapping[str, str]) -> Zygote | None:
    """The zygote for ``env``'s start-up variables, started on first use; None if it cannot start."""
    key = startup_env(env)
    with _lock:
        if key not in _zygotes:
            if not _zygotes:
                atexit.register(close_all)
            try:
                become_subreaper()  # idempotent
                _zygotes[key] = Zygote(env)
            except Exception as e:  # exec'd instead: slower, never wrong
                logger.warning("ranks will be exec'd: %s", e)
                _zygotes[key] = None
        return _zygotes[key]


def _give_up(zygote: Zygote) -> None:
    """Exec the launches a failed zygote served, from now on."""
    with _lock:
        for key, z in _zygotes.items():
            if z is zygote:
                _zygotes[key] = None
    zygote.close()


def become_subreaper() -> None:
    """Orphans below this process come to it: a rank, once its launcher exits, is this process's child."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def close_all() -> None:
    with _lock:
        for z in _zygotes.values():
            if z is not None:
                z.close()
        _zygotes.clear()


def _script_argv(args: Any) -> list[str] | None:
    """``args`` as strings if it is ``[sys.executable, script.py, ...]``, else None."""
    if isinstance(args, (str, bytes, os.PathLike)):
        return None
    argv = [os.fsdecode(a) for a in args]
    if (
        len(argv) < 2
        or argv[0] != sys.executable
        or not argv[1].endswith(".py")
        or not os.path.isfile(argv[1])
    ):
        return None
    return argv


class RankPopen(subprocess.Popen):  # type: ignore[type-arg]
    """``subprocess.Popen``, forking ``python script.py`` launches from a zygote (see the module's text)."""

    def _execute_child(  # type: ignore[override]
        self,
        args: Any,
        executable: Any,
        preexec_fn: Any,
        close_fds: bool,
        pass_fds: Sequence[int],
        cwd: Any,
        env: Mapping[str, str] | None,
        startupinfo: Any,
        creationflags: int,
        shell: bool,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        restore_signals: bool,
        gid: Any,
        gids: Any,
        uid: Any,
        umask: int,
        start_new_session: bool,
        process_group: Any,
    ) -> None:
        argv = _script_argv(args)
        plain = (
            executable is None
            and preexec_fn is None
            and close_fds
            and not pass_fds
            and not shell
            and restore_signals
            and gid is None
            and gids is None
            and uid is None
            and umask < 0
            and process_group in (None, -1)
        )
        environment = dict(os.environ if env is None else env)
        zygote = _zygote(environment) if argv and plain and os.environ.get(ENV_EXEC_RANKS) != "1" else None
        if zygote is not None and argv is not None:
            streams = [p2cread, c2pwrite, errwrite]
            fds = [fd if fd != -1 else default for fd, default in zip(streams, (0, 1, 2), strict=True)]
            try:
                pid = zygote.launch(
                    argv, environment, None if cwd is None else os.fsdecode(cwd), start_new_session, fds
                )
            except (OSError, RuntimeError, ValueError) as e:
                logger.warning("exec'ing %s: the zygote failed (%s)", argv[1], e)
                _give_up(zygote)
            else:
                self.pid = pid
                self._child_created = True
                self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
                return
        super()._execute_child(  # type: ignore[misc]
            args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
            p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
            start_new_session, process_group,
        )  # fmt: skip
