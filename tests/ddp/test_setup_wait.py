"""Before the first step, the hang watchdog reports a main thread that waits for its peers inside torch's
distributed machinery, and nothing else of set-up; heartbeats carry the world size. Sampled by hand on a
manual clock, with the main thread's innermost frame given by the test."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest

from ddpscope.agent.records import RecordError, validate_record
from ddpscope.agent.torch_waits import TorchWait
from ddpscope.ddp import errors, setup_wait
from ddpscope.ddp import watchdog as wd
from ddpscope.ddp.collectives import CollectiveRecorder
from ddpscope.ddp.progress import Progress
from tests.ddp.watchdog_support import ManualClock, Records, in_memory_records

TORCH = "/venv/lib/python3.11/site-packages/torch"


@functools.cache
def _function(path: str, function: str, in_ddp_init: bool) -> Callable[[], FrameType]:
    scope: dict[str, Any] = {"sys": sys}
    exec(compile(f"def {function}():\n    return sys._getframe()\n", path, "exec"), scope)
    if not in_ddp_init:
        return scope[function]  # type: ignore[no-any-return]
    exec(
        compile("def __init__(inner):\n    return inner()\n", f"{TORCH}/nn/parallel/distributed.py", "exec"),
        scope,
    )
    return lambda: scope["__init__"](scope[function])  # type: ignore[no-any-return]


def frame_in(path: str, function: str, *, in_ddp_init: bool = False) -> FrameType:
    """The frame object of a new call of ``function`` in ``path`` (from torch DDP's ``__init__`` when
    ``in_ddp_init``): what the watchdog reads of a blocked main thread. Calls of one function share
    its code object, as in a real process."""
    return _function(path, function, in_ddp_init)()


def in_ddp_constructor() -> FrameType:
    return frame_in(f"{TORCH}/distributed/utils.py", "_verify_param_shape_across_processes", in_ddp_init=True)


class Main:
    """The main thread as the watchdog sees it: its innermost frame and its CPU clock."""

    def __init__(self, frame: FrameType) -> None:
        self.frame: FrameType | None = frame
        self.cpu_s = 10.0

    def make(self, clock: ManualClock, progress: Progress, timeout_s: float = 5.0) -> wd.Watchdog:
        return wd.Watchdog(
            timeout_s=timeout_s,
            heartbeat_s=1.0,
            progress=progress,
            recorder=CollectiveRecorder(progress=progress),
            clock=clock,
            main_cpu_s=lambda: self.cpu_s,
            main_frame=lambda: self.frame,
            world_size=lambda: 2,
        )


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=1)


def run(
    dog: wd.Watchdog, clock: ManualClock, seconds: float, main: Main | None = None, busy: bool = False
) -> None:
    for _ in range(round(seconds / 0.25)):
        clock.now += 0.25
        if busy and main is not None:
            main.cpu_s += 0.25
        dog.check()


def test_a_main_thread_blocked_in_torchs_ddp_constructor_is_reported_as_waiting_for_its_peers(
    records: Records, clock: ManualClock, progress: Progress
) -> None:
    main = Main(in_ddp_constructor())
    dog = main.make(clock, progress)
    dog.check()
    run(dog, clock, 4.75)
    assert records("hang") == []
    run(dog, clock, 5.0)  # well past the timeout: still one report
    (hang,) = records("hang")
    assert (hang["phase"], hang["step"], hang["inflight"], hang["pending_buckets"]) == ("idle", 0, [], [])
    assert hang["stalled_s"] >= 5.0 and hang["main_cpu_s"] == 0.0
    message = hang["message"]
    assert message.startswith("rank 1 has waited 5.0 s for its peers inside torch's DistributedDataParallel")
    assert "construction (_verify_param_shape_across_processes), before its first step" in message
    assert "This rank is not stuck itself" in message and "itself is stuck" not in message
    assert dog.hung and dog.hangs_reported == 1


def test_set_up_in_the_users_own_code_is_never_reported_however_long_it_takes(
    records: Records, clock: ManualClock, progress: Progress
) -> None:
    main = Main(frame_in("/home/me/train.py", "load_checkpoint"))
    dog = main.make(clock, progress)
    run(dog, clock, 60.0)
    # Torch's own set-up code that waits on nobody (a checkpoint read) is set-up too.
    main.frame = frame_in(f"{TORCH}/serialization.py", "load")
    run(dog, clock, 60.0)
    assert records("hang") == [] and not dog.hung


def test_a_main_thread_busy_in_torchs_code_is_working_not_waiting(
    records: Records, clock: ManualClock, progress: Progress
) -> None:
    main = Main(frame_in(f"{TORCH}/nn/parallel/distributed.py", "_build_params_for_reducer"))
    dog = main.make(clock, progress)
    run(dog, clock, 30.0, main, busy=True)
    assert records("hang") == []


def test_successive_calls_into_torch_are_not_one_long_wait(
    records: Records, clock: ManualClock, progress: Progress
) -> None:
    # A plain torch DDP model trained without instrument(), whose main thread barely uses the CPU (the
    # work is on a device): every backward() is a new call, mostly waiting; together they last far
    # longer than the timeout. Between two, the thread runs the forward and the optimizer step.
    main = Main(frame_in(f"{TORCH}/autograd/graph.py", "_engine_run_backward"))
    dog = main.make(clock, progress)
    for _ in range(120):
        main.frame = frame_in(f"{TORCH}/autograd/graph.py", "_engine_run_backward")
        run(dog, clock, 1.0)
        main.frame = frame_in("/home/me/train.py", "forward")
        run(dog, clock, 0.25)
    assert records("hang") == []
    main.frame = frame_in(f"{TORCH}/autograd/graph.py", "_engine_run_backward")
    run(dog, clock, 6.0)  # one backward() that does not return is a wait
    (hang,) = records("hang")
    assert "inside torch's backward pass, with no step of a model ddpscope measures yet" in hang["message"]


def test_the_wait_is_resolved_once_the_main_thread_has_left_that_call(
    records: Records, clock: ManualClock, progress: Progress
) -> None:
    main = Main(in_ddp_constructor())
    dog = main.make(clock, progress)
    dog.check()
    run(dog, clock, 8.0)
    main.frame = frame_in("/home/me/train.py", "main")  # the constructor returned at 8 s
    run(dog, clock, 0.75)
    assert records("hang_resolved") == []  # not before the grace period: it might be an exception
    run(dog, clock, 1.0)
    (resolved,) = records("hang_resolved")
    assert resolved["hang_s"] == pytest.approx(8.25)
    assert not dog.hung
    run(dog, clock, 10.0)
    assert len(records("hang")) == 1 and len(records("hang_resolved")) == 1


def test_a_wait_that_ends_in_a_fatal_error_is_not_resolved(
    records: Records, clock: ManualClock, progress: Progress
) -> None:
    main = Main(in_ddp_constructor())
    dog = main.make(clock, progress)
    dog.check()
    run(dog, clock, 6.0)
    main.frame = frame_in("/home/me/train.py", "main")
    # The peer died: gloo raised out of the constructor and the error hooks reported it.
    errors.report_error(RuntimeError("Connection closed by peer"), fatal=True)
    run(dog, clock, 3.0)
    assert len(records("hang")) == 1 and records("hang_resolved") == []
    assert not dog.hung


def test_from_the_first_step_on_the_usual_rule_reports_the_same_wait_once(
    records: Records, clock: ManualClock, progress: Progress
) -> None:
    main = Main(frame_in(f"{TORCH}/autograd/graph.py", "_engine_run_backward"))
    dog = main.make(clock, progress)
    progress.enter("backward", step=3)
    dog.check()
    run(dog, clock, 8.0)
    (hang,) = records("hang")
    assert hang["phase"] == "backward" and "blocked in torch's backward pass" in hang["message"]


def test_a_recorded_collective_in_flight_before_the_first_step_is_reported_once_with_it(
    records: Records, clock: ManualClock, progress: Progress
) -> None:
    main = Main(frame_in(f"{TORCH}/distributed/distributed_c10d.py", "barrier"))
    dog = main.make(clock, progress)
    dog._recorder.begin("default", "barrier", [], call_site="train.py:9")
    dog.check()
    run(dog, clock, 8.0)
    (hang,) = records("hang")
    assert [c["op"] for c in hang["inflight"]] == ["barrier"]


def test_heartbeats_carry_the_world_size_once_a_group_exists(
    records: Records, clock: ManualClock, progress: Progress
) -> None:
    size: list[int | None] = [None]
    dog = wd.Watchdog(
        timeout_s=5.0, heartbeat_s=1.0, progress=progress, clock=clock, world_size=lambda: size[0]
    )
    dog.check()
    size[0] = 4
    clock.now += 1.0
    dog.check()
    before, after = records("heartbeat")
    assert "world_size" not in before and after["world_size"] == 4


def test_a_watchdog_stopped_before_its_first_heartbeat_sends_one_as_it_stops(
    records: Records, progress: Progress
) -> None:
    dog = wd.Watchdog(timeout_s=5.0, heartbeat_s=1.0, progress=progress, world_size=lambda: 2)
    dog.start(first_heartbeat_s=60.0)
    dog.stop()
    (beat,) = records("heartbeat")
    assert beat["world_size"] == 2


def test_a_heartbeat_without_world_size_still_validates_and_a_wrong_one_does_not() -> None:
    envelope = {"job": "j", "rank": 0, "stream": "s", "seq": 0, "time_ns": 1}
    old = {**envelope, "kind": "heartbeat", "phase": "idle", "step": 0, "last_coll_seq": 0, "pid": 7}
    assert validate_record(old) == "heartbeat"
    assert validate_record({**old, "world_size": 8}) == "heartbeat"
    with pytest.raises(RecordError, match="world_size"):
        validate_record({**old, "world_size": "8"})
    codec = pytest.importorskip("ddpscope.server.codec")
    body = json.dumps({"schema": 1, "records": [old, {**old, "seq": 1, "world_size": 8}]}).encode()
    first, second = codec.decode_batch(body)
    assert "world_size" not in codec.to_wire(first) and codec.to_wire(second)["world_size"] == 8


def test_where_names_the_ddp_construction_and_falls_back_to_the_frame_torch_waits_in() -> None:
    construction = setup_wait.where(in_ddp_constructor())
    assert construction is not None and construction.place.startswith(
        "torch's DistributedDataParallel construction"
    )
    plain = setup_wait.where(frame_in(f"{TORCH}/distributed/distributed_c10d.py", "all_reduce"))
    assert plain is not None and plain.place == "torch.distributed (all_reduce)"
    assert setup_wait.where(frame_in("/home/me/train.py", "main")) is None


@pytest.mark.parametrize("left", [False, True], ids=["still-waiting", "left"])
def test_stopping_the_watchdog_resolves_a_reported_wait_only_once_the_main_thread_has_left_it(
    records: Records, clock: ManualClock, progress: Progress, left: bool
) -> None:
    main = Main(in_ddp_constructor())
    dog = main.make(clock, progress)
    dog.check()
    run(dog, clock, 6.0)
    dog.start()  # the manual clock stands still: the thread's own samples change nothing
    clock.now += 0.5
    if left:
        main.frame = frame_in("/home/me/train.py", "main")
    dog.stop()
    assert len(records("hang")) == 1
    assert [r["hang_s"] for r in records("hang_resolved")] == ([pytest.approx(6.5)] if left else [])


def test_a_wait_on_the_thread_that_builds_the_model_names_that_thread_when_it_is_not_the_main_one() -> None:
    place = TorchWait("torch's DistributedDataParallel construction (x)", "it waits")
    said = setup_wait.message(
        "0", 5.0, place, main_site="train.py:9", main_cpu_s=0.0, last=None, thread="trainer"
    )
    assert "the training thread 'trainer' waits at train.py:9" in said
    main = setup_wait.message("0", 5.0, place, main_site="train.py:9", main_cpu_s=0.0, last=None)
    assert "the main thread waits at train.py:9" in main
