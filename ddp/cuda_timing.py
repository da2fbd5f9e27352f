"""Bucket times from CUDA events, for buckets on a GPU (NCCL). UNTESTED: this machine has no GPU.

On CUDA the host-side moments the CPU path uses are meaningless: the host enqueues a gradient copy or
an all-reduce long before the device runs it. So each moment is a CUDA event recorded on the current
stream instead:

- ready: after the last gradient copy into the bucket was enqueued (the copy runs on the current stream);
- launch: just before the all-reduce is issued (NCCL's stream waits on the current stream there);
- done: after ``work.wait()`` in the finalizer, which makes the current stream wait for NCCL's stream,
  so the event completes when the reduction has completed on the device.

Events only give durations between each other, so one anchor turns them into aligned-clock times: the
finalizer synchronises on the last "done" event and reads ``now_ns()`` at once; every other event is
placed ``elapsed_time`` before it. The synchronisation makes the host wait for the last reduction at
the end of backward, which the optimizer step would wait for anyway on the same stream.
"""

from __future__ import annotations

import torch

from ddpscope.agent.clock import now_ns


class CudaBucketEvents:
    """Per-step CUDA events for every bucket; ``resolve()`` converts them to aligned-clock ns."""

    def __init__(self, num_buckets: int) -> None:
        self.reset(num_buckets)

    def reset(self, num_buckets: int) -> None:
        self.ready = [torch.cuda.Event(enable_timing=True) for _ in range(num_buckets)]
        self.launch = [torch.cuda.Event(enable_timing=True) for _ in range(num_buckets)]
        self.done = [torch.cuda.Event(enable_timing=True) for _ in range(num_buckets)]

    def bucket_ready(self, index: int) -> None:
        self.ready[index].record()

    def allreduce_launched(self, index: int) -> None:
        self.launch[index].record()

    def allreduce_done(self, index: int) -> None:
        """Call right after ``work.wait()`` for this bucket."""
        self.done[index].record()

    def resolve(self) -> tuple[list[int], list[int], list[int]]:
        """(ready, launch, done) in aligned-clock ns; synchronises on the last all-reduce."""
        anchor = self.done[-1]
        anchor.synchronize()
        anchor_ns = now_ns()

        def at(event: torch.cuda.Event) -> int:
            # elapsed_time is in milliseconds, from `event` to the anchor.
            return anchor_ns - int(event.elapsed_time(anchor) * 1e6)

        return [at(e) for e in self.ready], [at(e) for e in self.launch], [at(e) for e in self.done]
