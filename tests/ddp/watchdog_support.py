"""What the watchdog unit tests share: a clock the test moves by hand, and the records the watchdog
emitted through an in-memory agent."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ddpscope import agent
from ddpscope.agent.records import validate_record
from ddpscope.ddp.collectives import CollectiveRecorder
from ddpscope.ddp.progress import Progress
from ddpscope.ddp.watchdog import Watchdog

Records = Callable[..., list[dict[str, Any]]]


def one_step(progress: Progress, recorder: CollectiveRecorder, step: int) -> None:
    """What the engine does in a step: phases, a bucket all-reduce, back to idle."""
    progress.enter("forward", step)
    progress.enter("backward")
    recorder.end("default", recorder.begin("default", "all_reduce", [torch.ones(8)], source="engine"))
    progress.enter("allreduce")
    progress.enter("idle")


def wait(dog: Watchdog, clock: ManualClock, seconds: float) -> None:
    """Move ``clock`` on by ``seconds`` in the watchdog's 0.25 s ticks, sampling at each."""
    for _ in range(round(seconds / 0.25)):
        clock.now += 0.25
        dog.check()


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def in_memory_records(rank: int) -> Iterator[Records]:
    """Configure the agent with an in-memory exporter for ``rank``; yield a reader that flushes and
    returns the records (of the given kinds, or all), each checked against the wire format."""
    exporter = agent.InMemoryExporter()
    agent.configure(exporter=exporter, rank=rank)

    def read(*kinds: str) -> list[dict[str, Any]]:
        agent.get_agent().force_flush(5.0)
        for r in exporter.records:
            validate_record(r)
        return [r for r in exporter.records if not kinds or r["kind"] in kinds]

    yield read


def one_rank_job_records() -> Iterator[Records]:
    """``in_memory_records`` in a 1-rank gloo group (created here unless one exists), for tests that
    build a real engine or instrument torch DDP; afterwards the monitor the engine enabled is disabled,
    so its error hooks and patches do not leak into later tests."""
    import torch.distributed as dist

    from ddpscope.ddp import monitor
    from tests.support.procs import free_port

    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        created = True
    try:
        yield from in_memory_records(0)
    finally:
        monitor.disable()
        agent.shutdown()
        if created:
            dist.destroy_process_group()
