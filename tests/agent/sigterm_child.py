"""A process for the SIGTERM tests: ``python sigterm_child.py MODE [N]``.

The agent is configured from DDPSCOPE_* and RANK/WORLD_SIZE/MASTER_* in the environment. Modes:

- ``blocked``: a 2-rank gloo job. Both ranks emit N heartbeats and spool them; rank 0 prints READY
  and enters an all-reduce that rank 1 never joins (rank 1 prints READY and sleeps), so rank 0's
  main thread waits in C until the process group times out.
- ``blocked_handler``: the same with the script's own SIGTERM handler, installed before the agent.
- ``fork``: the process forks a child that sleeps, prints ``CHILD <pid>``, waits for it, prints
  how it ended (``CHILD_STATUS <signal>``), stays a while and returns normally.
- ``asyncio``: an asyncio loop with a SIGUSR1 handler (which sets the signal wakeup fd) exists
  before the agent; the process checks the handler still fires, prints ``ASYNCIO OK`` and the
  threads, then READY, and waits to be killed.
- ``free``: emit N heartbeats, print the threads and READY, then wait (in Python) to be killed.
- ``ignored``: SIGTERM is ignored before the agent starts; the process signals itself, waits past the
  watcher's grace, emits one more heartbeat and prints whether SIGTERM is still ignored, then returns.
- ``probe``: configure the agent (in memory), print the signal wakeup fd found afterwards and the threads.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

from ddpscope import agent


def heartbeat(i: int) -> dict[str, object]:
    return {"kind": "heartbeat", "phase": "forward", "step": i, "last_coll_seq": i, "pid": os.getpid()}


def emit_and_spool(n: int) -> None:
    for i in range(n):
        agent.emit(heartbeat(i))
    assert agent.get_agent().flush_local(30.0)


def blocked(n: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    # The timeout is far beyond any test deadline: only SIGTERM can end rank 0's wait.
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    emit_and_spool(n)
    print("READY", flush=True)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(4))
        print("ALL_REDUCE RETURNED", flush=True)
    else:
        time.sleep(600)


def forked(n: int) -> None:
    emit_and_spool(n)
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    print(f"CHILD {pid}", flush=True)
    _, status = os.waitpid(pid, 0)
    print(f"CHILD_STATUS {os.waitstatus_to_exitcode(status)}", flush=True)
    time.sleep(1.5)  # a watcher fooled by the child's signal would end this process by now


def with_asyncio(n: int) -> None:
    loop = asyncio.new_event_loop()
    fired = loop.create_future()
    loop.add_signal_handler(signal.SIGUSR1, lambda: fired.set_result(True))
    agent.configure()
    emit_and_spool(n)
    loop.call_soon(os.kill, os.getpid(), signal.SIGUSR1)
    loop.run_until_complete(asyncio.wait_for(fired, 10))
    print("ASYNCIO OK", flush=True)
    threads()
    print("READY", flush=True)
    time.sleep(120)


def threads() -> None:
    print("THREADS", *sorted(t.name for t in threading.enumerate()), flush=True)


def probe() -> None:
    # In memory: a shipper started by a process that exits at once could outlive the test.
    agent.configure(exporter=agent.InMemoryExporter())
    agent.emit(heartbeat(0))
    print("WAKEUP_FD", signal.set_wakeup_fd(-1), flush=True)
    threads()


def main() -> None:
    mode = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    if mode == "blocked_handler":
        signal.signal(signal.SIGTERM, lambda signum, frame: print("USER HANDLER", flush=True))
    if mode == "ignored":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "asyncio":
        with_asyncio(n)
        return
    if mode == "probe":
        probe()
        return
    agent.configure()
    if mode in ("blocked", "blocked_handler"):
        blocked(n)
    elif mode == "fork":
        forked(n)
    elif mode == "ignored":
        emit_and_spool(n)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.5)
        agent.emit(heartbeat(n))
        print("STILL_IGNORED", signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, flush=True)
    elif mode == "free":
        emit_and_spool(n)
        threads()
        print("READY", flush=True)
        time.sleep(120)


if __name__ == "__main__":
    main()
