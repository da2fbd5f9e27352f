"""The hang watchdog in one process: sampled by hand on a manual clock, and as a real thread."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ddpscope import agent
from ddpscope.agent.torch_waits import torch_wait
from ddpscope.ddp import watchdog as wd
from ddpscope.ddp.collectives import CollectiveRecorder
from ddpscope.ddp.progress import Progress
from tests.ddp.watchdog_support import ManualClock, Records, in_memory_records


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=3)


@pytest.fixture
def parts() -> tuple[Progress, CollectiveRecorder, ManualClock]:
    progress = Progress()
    return progress, CollectiveRecorder(progress=progress), ManualClock()


def make(parts: tuple[Progress, CollectiveRecorder, ManualClock], timeout_s: float = 5.0) -> wd.Watchdog:
    progress, recorder, clock = parts
    return wd.Watchdog(
        timeout_s=timeout_s, heartbeat_s=1.0, progress=progress, recorder=recorder, clock=clock
    )


def test_a_busy_rank_without_progress_gets_one_hang_report_naming_bucket_collective_and_parameters(
    records: Records, parts: tuple[Progress, CollectiveRecorder, ManualClock]
) -> None:
    progress, recorder, clock = parts
    dog = make(parts)
    progress.enter("backward", step=12)
    recorder.begin("default", "all_reduce", [torch.ones(4, 2)], source="engine", call_site="train.py:42")
    progress.pending_buckets = lambda: [
        {"index": 3, "missing": ["fc2.weight", "fc2.bias"], "launched": False},
        {"index": 4, "missing": [], "launched": True},
    ]
    dog.check()
    for _ in range(19):  # 4.75 s: not yet
        clock.now += 0.25
        dog.check()
    assert records("hang") == []
    for _ in range(21):  # well past the timeout: still exactly one report
        clock.now += 0.25
        dog.check()
    (hang,) = records("hang")
    assert hang["phase"] == "backward" and hang["step"] == 12 and hang["stalled_s"] >= 5.0
    assert hang["pending_buckets"][0]["missing"] == ["fc2.weight", "fc2.bias"]
    (inflight,) = hang["inflight"]
    assert (inflight["pg"], inflight["coll_seq"], inflight["call_site"]) == ("default", 1, "train.py:42")
    assert inflight["shapes"] == [[4, 2]] and inflight["dtypes"] == ["float32"]
    message = hang["message"]
    for part in (
        "rank 3",
        "5.0 s",
        "bucket 3",
        "step 12",
        "default#1 all_reduce at train.py:42",
        "fc2.weight",
    ):
        assert part in message
    assert any(s["thread"] == "MainThread" and "test_watchdog_unit.py" in s["stack"] for s in hang["stacks"])
    assert "the main thread waits at tests/ddp/test_watchdog_unit.py:" in message
    assert dog.hung and dog.hangs_reported == 1


def test_a_hang_inside_a_step_carries_the_step_so_far_and_one_between_steps_does_not(
    records: Records, parts: tuple[Progress, CollectiveRecorder, ManualClock]
) -> None:
    progress, _, clock = parts
    so_far = {"step": 12, "synced": True, "forward_start_ns": 5, "forward_end_ns": 6, "backward_start_ns": 7,
              "bucket_ready_ns": [8], "allreduce_start_ns": [9], "allreduce_end_ns": [0], "bucket_bytes": [64]}  # fmt: skip
    progress.partial_step = lambda: dict(so_far)
    for phase, step in (("backward", 12), ("idle", 12), ("backward", 13)):
        dog = make(parts)
        progress.enter(phase, step=step)
        dog.check()
        clock.now += 6.0
        dog.check()
    inside, between, other_step = records("hang")
    assert inside["partial_step"] == so_far
    # Between steps the last step's record went out already; a partial of another step is stale.
    assert between["partial_step"] is None and other_step["partial_step"] is None

    def broken() -> dict[str, Any]:
        raise RuntimeError("boom")

    progress.partial_step = broken
    assert progress.step_so_far() is None  # the report matters more than its partial step


def test_a_hang_report_says_how_much_cpu_the_main_thread_used_during_the_stall(
    records: Records, parts: tuple[Progress, CollectiveRecorder, ManualClock]
) -> None:
    progress, recorder, clock = parts
    cpu = [2.0]
    dog = wd.Watchdog(
        timeout_s=5.0,
        heartbeat_s=1.0,
        progress=progress,
        recorder=recorder,
        clock=clock,
        main_cpu_s=lambda: cpu[0],
    )
    progress.enter("after_forward", step=1)
    dog.check()
    cpu[0] = 2.25  # blocked, nearly: the collector reads a wait in torch's C++ from this
    clock.now += 6.0
    dog.check()
    (hang,) = records("hang")
    assert hang["main_cpu_s"] == 0.25


def test_a_rank_blocked_in_torchs_backward_says_it_waits_for_a_peer_not_that_it_is_stuck_itself() -> None:
    # A plain torch DDP model's C++ all-reduce: nothing ddpscope records is in flight, and the main thread's
    # innermost frame is torch's autograd entry point.
    wait = torch_wait("/venv/site-packages/torch/autograd/graph.py", "_engine_run_backward")
    assert wait is not None
    said = wd.hang_message(
        "0", "after_forward", 3, 6.0, [], [], "train.py:40", main_cpu_s=0.1, blocked_in=wait
    )
    assert "blocked in torch's backward pass" in said and "A peer that has not reached" in said
    assert "this rank itself is stuck" not in said
    # Busy there is computing (a long backward): its own work, said as before.
    busy = wd.hang_message(
        "0", "after_forward", 3, 6.0, [], [], "train.py:40", main_cpu_s=5.0, blocked_in=wait
    )
    assert "this rank itself is stuck" in busy and "it is busy" in busy
    # File writes every rank makes at once are no wait on a peer.
    assert torch_wait("/venv/site-packages/torch/distributed/checkpoint/state_dict_saver.py", "save") is None


def test_progress_after_a_hang_emits_hang_resolved_with_the_stall_duration(
    records: Records, parts: tuple[Progress, CollectiveRecorder, ManualClock]
) -> None:
    progress, _, clock = parts
    dog = make(parts, timeout_s=2.0)
    progress.enter("forward", step=4)
    dog.check()
    clock.now += 3.0
    dog.check()
    clock.now += 4.5
    dog.check()
    progress.enter("backward")
    dog.check()
    (resolved,) = records("hang_resolved")
    assert resolved["hang_s"] == pytest.approx(7.5) and resolved["step"] == 4
    assert not dog.hung
    clock.now += 1.0
    dog.check()
    assert len(records("hang_resolved")) == 1


def test_an_idle_rank_waiting_in_a_collective_is_hung(
    records: Records, parts: tuple[Progress, CollectiveRecorder, ManualClock]
) -> None:
    _, recorder, clock = parts
    dog = make(parts, timeout_s=1.0)
    recorder.begin("pg:1", "barrier", [], call_site="loop.py:7")
    dog.check()
    clock.now += 1.5
    dog.check()
    (hang,) = records("hang")
    assert hang["phase"] == "idle" and "pg:1#1 barrier at loop.py:7" in hang["message"]


def test_heartbeats_follow_the_configured_interval_with_phase_step_and_sequence(
    records: Records, parts: tuple[Progress, CollectiveRecorder, ManualClock]
) -> None:
    progress, recorder, clock = parts
    dog = make(parts)
    progress.enter("optimizer", step=9)
    recorder.end("default", recorder.begin("default", "all_reduce", [torch.ones(1)]))
    for _ in range(41):  # 0 .. 10 s in 0.25 s ticks, one heartbeat per second
        dog.check()
        clock.now += 0.25
    beats = records("heartbeat")
    assert len(beats) == 11
    assert {(b["phase"], b["step"], b["last_coll_seq"]) for b in beats} == {("optimizer", 9, 1)}


def test_a_heartbeat_after_its_thread_could_not_run_says_for_how_long(
    records: Records, parts: tuple[Progress, CollectiveRecorder, ManualClock]
) -> None:
    _, _, clock = parts
    dog = make(parts)
    for _ in range(3):  # on time: no silent_s
        dog.check()
        clock.now += 1.0
    clock.now += 14.0  # the main thread held the GIL (or the process was stopped): no tick ran
    dog.check()
    beats = records("heartbeat")
    assert ["silent_s" in b for b in beats] == [False, False, False, True]
    assert beats[-1]["silent_s"] == pytest.approx(15.0)  # from the heartbeat at 2 s to the one at 17 s


def test_a_rank_stuck_outside_collectives_names_its_last_collective(
    records: Records, parts: tuple[Progress, CollectiveRecorder, ManualClock]
) -> None:
    progress, recorder, clock = parts
    dog = make(parts, timeout_s=1.0)
    recorder.end("default", recorder.begin("default", "broadcast", [torch.ones(2)], call_site="data.py:12"))
    progress.enter("forward", step=8)
    dog.check()
    clock.now += 1.5
    dog.check()
    (hang,) = records("hang")
    assert "its last collective was default#1 broadcast at data.py:12" in hang["message"]
    assert "this rank itself is stuck" in hang["message"]


def test_a_rank_stuck_in_its_backward_code_is_not_said_to_be_in_an_all_reduce_that_already_completed(
    records: Records, parts: tuple[Progress, CollectiveRecorder, ManualClock]
) -> None:
    # The engine launched bucket 0's all-reduce and it completed, but the engine only ends it at its
    # next hook; the backward is stuck in user code before bucket 1 is ready.
    progress, recorder, clock = parts
    dog = make(parts, timeout_s=1.0)
    progress.enter("backward", step=5)
    seq = recorder.begin(
        "default", "all_reduce", [torch.ones(4)], source="engine", call_site="ddp/reducer.py:1"
    )
    progress.pending_buckets = lambda: [{"index": 1, "missing": ["l0.weight"], "launched": False}]
    progress.settled = lambda: {("default", seq)}
    dog.check()
    clock.now += 1.5
    dog.check()
    (hang,) = records("hang")
    assert hang["inflight"] == []
    message = hang["message"]
    assert "waiting for gradients of bucket 1 (step 5)" in message and "in flight" not in message
    assert "still computing or blocked" in message


def test_a_failing_pending_buckets_callback_does_not_cost_the_report(
    records: Records, parts: tuple[Progress, CollectiveRecorder, ManualClock]
) -> None:
    progress, _, clock = parts
    dog = make(parts, timeout_s=1.0)
    progress.enter("backward", step=1)

    def broken() -> list[dict[str, Any]]:
        raise KeyError("engine bug")

    progress.pending_buckets = broken
    dog.check()
    clock.now += 2.0
    dog.check()
    (hang,) = records("hang")
    assert hang["pending_buckets"] == [] and "backward" in hang["message"]


def test_the_thread_reports_a_hang_while_the_main_thread_waits_and_stops_cleanly(records: Records) -> None:
    progress = Progress()
    dog = wd.Watchdog(
        timeout_s=0.2, heartbeat_s=0.05, progress=progress, recorder=CollectiveRecorder(progress=progress)
    )
    progress.enter("allreduce", step=2)
    dog.start()
    try:
        deadline = time.monotonic() + 20
        while not dog.hung and time.monotonic() < deadline:
            threading.Event().wait(0.02)  # the main thread blocked in a C call that released the GIL
        assert dog.hung
        progress.tick()
        while dog.hung and time.monotonic() < deadline:
            threading.Event().wait(0.02)
    finally:
        dog.stop()
    assert not dog.running and dog.errors == 0
    assert len(records("hang")) == 1 and len(records("hang_resolved")) == 1
    assert len(records("heartbeat")) >= 2


def test_start_watchdog_reads_the_environment_and_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPSCOPE_HANG_TIMEOUT", "7.5")
    monkeypatch.setenv("DDPSCOPE_HEARTBEAT_S", "0.5")
    agent.configure(exporter=agent.InMemoryExporter(), rank=0)  # the agent's config reads them
    try:
        dog = wd.start_watchdog()
        assert dog.running and (dog.timeout_s, dog.heartbeat_s) == (7.5, 0.5)
        assert wd.start_watchdog() is dog
        other = wd.start_watchdog(timeout_s=3.0)
        assert other is not dog and not dog.running and other.running and other.timeout_s == 3.0
        assert wd.get_watchdog() is other
    finally:
        wd.stop_watchdog()
    assert wd.get_watchdog() is None and not other.running


def test_a_bad_environment_value_falls_back_to_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPSCOPE_HANG_TIMEOUT", "soon")
    monkeypatch.delenv("DDPSCOPE_HEARTBEAT_S", raising=False)
    agent.configure(exporter=agent.InMemoryExporter(), rank=0)
    try:
        dog = wd.start_watchdog()
        assert (dog.timeout_s, dog.heartbeat_s) == (300.0, 2.0)
    finally:
        wd.stop_watchdog()


def test_a_non_positive_explicit_timeout_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="hang_timeout_s"):
        wd.start_watchdog(timeout_s=0)


def test_a_timeout_under_the_floor_is_refused_when_explicit_and_raised_when_from_the_environment(
    monkeypatch,
) -> None:
    with pytest.raises(ValueError, match="at least 1.0"):
        wd.start_watchdog(timeout_s=0.001)
    monkeypatch.setenv("DDPSCOPE_HANG_TIMEOUT", "0.001")
    agent.configure(exporter=agent.InMemoryExporter(), rank=0)  # the agent's config reads it
    try:
        assert wd.hang_timeout_setting() == 1.0
    finally:
        agent.shutdown()


def test_with_no_agent_the_watchdog_reads_the_environment_as_the_agent_s_config_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent.shutdown()
    monkeypatch.setattr(wd, "get_agent", lambda: None)
    monkeypatch.setenv("DDPSCOPE_HANG_TIMEOUT", "0.001")
    monkeypatch.setenv("DDPSCOPE_HEARTBEAT_S", "-1")
    assert (wd.hang_timeout_setting(), wd.heartbeat_setting()) == (1.0, 2.0)
    monkeypatch.setenv("DDPSCOPE_HANG_TIMEOUT", "7.5")
    monkeypatch.setenv("DDPSCOPE_HEARTBEAT_S", "0.5")
    assert (wd.hang_timeout_setting(), wd.heartbeat_setting()) == (7.5, 0.5)
    with pytest.raises(ValueError, match=r"heartbeat_s must be > 0, got 0"):
        wd.heartbeat_setting(0)


def test_monitor_enable_turns_everything_on_and_disable_turns_it_off() -> None:
    import sys

    import torch.distributed as dist

    from ddpscope.ddp import monitor

    agent.configure(exporter=agent.InMemoryExporter(), rank=0)
    original_hook, original_all_reduce = sys.excepthook, dist.all_reduce
    try:
        dog = monitor.enable(hang_timeout_s=60, heartbeat_s=1)
        assert dog.running and dist.all_reduce is not original_all_reduce
        assert sys.excepthook is not original_hook
    finally:
        monitor.disable()
    assert not dog.running and dist.all_reduce is original_all_reduce and sys.excepthook is original_hook


def test_disabled_ddpscope_starts_no_thread_and_installs_no_hook() -> None:
    import sys

    import torch.distributed as dist

    from ddpscope.ddp import monitor

    agent.configure(disabled=True)
    original_hook, original_all_reduce = sys.excepthook, dist.all_reduce
    try:
        dog = monitor.enable()
        assert not dog.running
        assert sys.excepthook is original_hook and dist.all_reduce is original_all_reduce
    finally:
        monitor.disable()
        agent.configure(exporter=agent.InMemoryExporter(), rank=0)


def test_pending_buckets_in_loose_types_are_coerced_so_the_report_passes_the_wire_check(
    records: Records, parts: tuple[Progress, CollectiveRecorder, ManualClock]
) -> None:
    progress, _, clock = parts
    dog = make(parts, timeout_s=1.0)
    progress.enter("backward", step=5)
    progress.pending_buckets = lambda: [{"index": torch.tensor(2), "missing": ("fc.bias",), "launched": 0}]
    dog.check()
    clock.now += 2.0
    dog.check()
    (hang,) = records("hang")  # records() validates every record against the wire format
    assert hang["pending_buckets"] == [{"index": 2, "missing": ["fc.bias"], "launched": False}]


GC_DURING_FRAMES = """
import gc, sys, threading
from ddpscope.ddp.stacks import current_frames
class Holder:
    pass
gc.set_threshold(1, 1, 1)  # every allocation may start a collection, as any one can in a long run
for _ in range(200):
    holder = Holder()
    holder.local = threading.local()
    holder.me = holder  # a cycle: only the collector frees it, and with it the threading.local
    del holder
    current_frames()
print("ok")
"""


def test_reading_every_threads_frame_survives_a_collection_that_frees_a_thread_local() -> None:
    # On CPython < 3.11.9, sys._current_frames() itself stops for good here holding the GIL (gh-106883):
    # this froze a whole process in this suite. A subprocess, so a regression fails instead of hanging.
    done = subprocess.run(
        [sys.executable, "-c", GC_DURING_FRAMES], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr
