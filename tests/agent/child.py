"""A training-like process for the agent's crash tests: ``python child.py MODE [N]``.

The agent is configured from DDPSCOPE_* and RANK in the environment the test sets. Modes:
``kill`` / ``sigterm``: emit N records, print READY, then wait to be killed; ``sigterm_chain``: the
same with the script's own SIGTERM handler, which stops the loop;
``abort``: emit N records, then ``os.abort()``; ``raise``: emit N records, then an uncaught error;
``exit``: emit N records and return normally; ``os_exit``: the same, ended by ``os._exit(0)``; ``flood``: emit N records as fast as possible and
print the peak RSS growth; ``job``: a gloo job of N steps, one step record per step per rank;
``dataloader``: a torch DataLoader with 2 forked workers that emit from the workers;
``durable_abort`` / ``durable_exit``: N collective records through ``emit_durable`` (the worker's
round far away), then ``os.abort()`` or a normal exit; ``kill_unflushed``: N records emitted, READY
printed at once (no flush), then wait to be killed; ``kill_ringed``: N collective records through
``emit_durable`` (the worker's round far away), READY at once, wait to be killed; with
CHILD_STARVE_WORKER set the worker is never woken early.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time

from ddpscope import agent


def rank_error(i: int) -> dict[str, object]:
    return {"kind": "rank_error", "step": i, "phase": "forward", "error_type": "ValueError",
            "message": f"caught at step {i}", "stack": "...", "fatal": False}  # fmt: skip


def heartbeat(i: int) -> dict[str, object]:
    return {"kind": "heartbeat", "phase": "forward", "step": i, "last_coll_seq": i, "pid": os.getpid()}


def crash_here() -> None:
    os.abort()


def step_record(step: int) -> dict[str, object]:
    t = time.time_ns()
    return {
        "kind": "step",
        "step": step,
        "synced": True,
        "forward_start_ns": t,
        "forward_end_ns": t,
        "backward_start_ns": t,
        "backward_end_ns": t,
        "bucket_ready_ns": [t],
        "allreduce_start_ns": [t],
        "allreduce_end_ns": [t],
        "bucket_bytes": [64],
        "ready_order": [0],
        "unused_parameters": [],
        "collective_seqs": [step + 1],
    }


def collective(seq: int) -> dict[str, object]:
    return {
        "kind": "collective", "pg": "default", "coll_seq": seq, "op": "all_reduce", "reduce_op": "SUM",
        "shapes": [[16]], "dtypes": ["float32"], "call_site": "train.py:7", "start_ns": time.time_ns(),
        "step": seq, "source": "user",
    }  # fmt: skip


def run_durable(n: int, mode: str) -> None:
    from ddpscope.agent import _core

    # The exporter (and its ring) exists once the worker has run its first round.
    assert agent.get_agent().flush_local(30.0)
    for i in range(1, n + 1):
        assert _core.emit_durable(collective(i))
    if mode == "durable_abort":
        crash_here()


def run_job(steps: int) -> None:
    import torch
    import torch.distributed as dist

    from tests.support.job_end import destroy_together

    dist.init_process_group("gloo")
    t = torch.ones(16)
    for step in range(steps):
        dist.all_reduce(t)
        agent.emit(step_record(step))
    dist.barrier()
    destroy_together()


def run_dataloader() -> None:
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Emitting(Dataset[int]):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> int:
            agent.emit(heartbeat(1000 + i))  # from a forked worker: its own stream
            return i

    torch.multiprocessing.set_start_method("fork", force=True)
    for epoch in range(2):
        for batch in DataLoader(Emitting(), batch_size=4, num_workers=2):
            agent.emit(heartbeat(epoch * 100 + int(batch[0])))
    print("DONE", flush=True)


def main() -> None:
    mode = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    stop = []
    if mode == "sigterm_chain":
        # The training script's own handler, installed before the agent: the agent must chain to it.
        signal.signal(
            signal.SIGTERM, lambda signum, frame: (print("USER HANDLER", flush=True), stop.append(1))
        )
    agent.configure()
    if mode == "job":
        run_job(n)
        return
    if mode == "dataloader":
        run_dataloader()
        return
    if mode.startswith("durable_"):
        run_durable(n, mode)
        return
    if mode == "kill_ringed":
        from ddpscope.agent import emit_durable

        assert agent.get_agent().flush_local(30.0)  # the exporter (and its ring) exists
        if os.environ.get("CHILD_STARVE_WORKER"):
            # A worker thread that never gets to run before the kill (a loaded machine): the wake-ups
            # go nowhere, and only the callers themselves can move records from the ring to the spool.
            agent.get_agent()._worker.nudge = lambda: None  # type: ignore[attr-defined]
        for i in range(1, n + 1):
            emit_durable(collective(i))
        print("READY", flush=True)
        time.sleep(120)
        return
    if mode == "kill_unflushed":
        # No flush: what the worker has not spooled yet is only in memory and, for urgent records,
        # in the write-ahead ring.
        assert agent.get_agent().flush_local(30.0)  # the exporter (and its ring) exists
        for i in range(n):
            agent.emit(heartbeat(i))
            agent.emit(rank_error(i))
        print("READY", flush=True)
        time.sleep(120)
        return
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i in range(n):
        agent.emit(heartbeat(i))
    if mode == "flood":
        grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(f"RSS_GROWTH_KB {grown_kb}", flush=True)
        return
    if mode == "exit":
        return
    if mode == "os_exit":
        os._exit(0)  # a script's guard against a teardown that may hang: atexit never runs
    if mode == "raise":
        raise ValueError("loss is nan at step 3")
    # On disk, not only in memory (the worker does this every 20 ms; on a loaded machine the
    # first round can take longer because it starts the shipper).
    assert agent.get_agent().flush_local(30.0)
    if mode == "abort":
        crash_here()
    print("READY", flush=True)
    deadline = time.monotonic() + 120
    while not stop and time.monotonic() < deadline:
        time.sleep(0.01)
    agent.emit(heartbeat(n))  # training goes on after a handled SIGTERM: still delivered


if __name__ == "__main__":
    main()
