"""The collective recorder on a real single-rank gloo process group (in this test process)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpscope import agent
from ddpscope.ddp import collectives, monitor
from ddpscope.ddp.collectives import RECORDER
from ddpscope.ddp.progress import PROGRESS
from tests.ddp.watchdog_support import in_memory_records
from tests.support.procs import free_port

HERE = os.path.basename(__file__)

Records = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="module")
def gloo() -> Iterator[None]:
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        created = True
    assert dist.get_world_size() == 1
    yield
    if created:
        # Creating the group started ddpscope's monitor (ddpscope.ddp wraps init_process_group): its
        # hooks and watchdog must not outlive this module's tests.
        monitor.disable()
        dist.destroy_process_group()


@pytest.fixture
def records(gloo: None) -> Iterator[Records]:
    """Install the recorder on a fresh in-memory agent; ``records(kind)`` flushes and returns them."""
    reading = in_memory_records(rank=0)
    read = next(reading)  # the agent first: install() asks it whether ddpscope is disabled
    RECORDER.reset()
    assert collectives.install()
    yield read
    collectives.uninstall()


def here(offset: int = 1) -> str:
    """The call site string of the line ``offset`` lines below the caller."""
    return f"{HERE}:{sys._getframe(1).f_lineno + offset}"


def test_user_collectives_are_numbered_with_op_shapes_dtypes_and_call_site(records: Records) -> None:
    t = torch.ones(3, 4)
    sites = [here()]
    dist.broadcast(t, src=0)
    sites.append(here())
    dist.all_gather([torch.zeros(5, dtype=torch.int64)], torch.ones(5, dtype=torch.int64))
    sites.append(here())
    dist.barrier()
    sites.append(here())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)

    begun = records("collective")
    assert [r["coll_seq"] for r in begun] == [1, 2, 3, 4]
    assert [r["op"] for r in begun] == ["broadcast", "all_gather", "barrier", "all_reduce"]
    assert [r["shapes"] for r in begun] == [[[3, 4]], [[5]], [], [[3, 4]]]
    assert [r["dtypes"] for r in begun] == [["float32"], ["int64"], [], ["float32"]]
    assert [r["reduce_op"] for r in begun] == [None, None, None, "MAX"]
    assert [r["call_site"].rsplit("/", 1)[-1] for r in begun] == sites
    assert {r["pg"] for r in begun} == {"default"} and {r["source"] for r in begun} == {"user"}
    ended = records("collective_end")
    assert [(r["coll_seq"], r["ok"]) for r in ended] == [(1, True), (2, True), (3, True), (4, True)]
    assert all(e["end_ns"] >= b["start_ns"] for b, e in zip(begun, ended, strict=True))
    assert PROGRESS.last_coll_seq == 4 and not PROGRESS.inflight


def test_the_collective_record_is_emitted_even_when_torch_rejects_the_call(records: Records) -> None:
    # A bad root rank makes torch raise inside the call: the issue-time record must already exist,
    # and the user's exception must reach the user unchanged.
    with pytest.raises((ValueError, RuntimeError)):
        dist.broadcast(torch.ones(2), src=5)
    (begun,) = records("collective")
    (ended,) = records("collective_end")
    assert begun["op"] == "broadcast" and ended["coll_seq"] == begun["coll_seq"]
    assert ended["ok"] is False and ended["error"]
    assert not PROGRESS.inflight


def test_engine_calls_are_recorded_once_by_the_engine_not_again_as_user_calls(records: Records) -> None:
    t = torch.ones(8)
    seq = RECORDER.begin("default", "all_reduce", [t], reduce_op="SUM", source="engine", step=3)
    with RECORDER.engine_call():
        dist.all_reduce(t)
        assert RECORDER.in_engine_call()
    RECORDER.end("default", seq, ok=True)
    assert not RECORDER.in_engine_call()
    dist.all_reduce(t)

    begun = records("collective")
    assert [(r["coll_seq"], r["source"], r["step"]) for r in begun] == [(1, "engine", 3), (2, "user", None)]


def test_an_async_collective_ends_when_its_wait_returns(records: Records) -> None:
    work = dist.all_reduce(torch.ones(5, dtype=torch.float64), async_op=True)
    assert PROGRESS.inflight
    work.wait()
    assert not PROGRESS.inflight
    (begun,) = records("collective")
    (ended,) = records("collective_end")
    assert begun["dtypes"] == ["float64"] and ended["ok"] is True
    assert ended["end_ns"] >= begun["start_ns"]


def test_time_inside_a_users_collectives_counts_as_blocked_but_not_the_engines_own(records: Records) -> None:
    blocked = RECORDER.blocked_time()
    before = blocked.ns
    dist.all_reduce(torch.ones(4))
    after_sync = blocked.ns
    dist.all_reduce(torch.ones(4), async_op=True).wait()
    after_wait = blocked.ns
    with RECORDER.engine_call():  # a bucket all-reduce: the step record has its own times
        dist.all_reduce(torch.ones(4))
    assert before < after_sync < after_wait == blocked.ns


def test_an_async_collective_nobody_waits_for_ends_at_the_next_poll(records: Records) -> None:
    work = dist.broadcast(torch.ones(2), src=0, async_op=True)
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert records("collective_end") == []
    RECORDER.poll()
    (ended,) = records("collective_end")
    assert ended["ok"] is True and not PROGRESS.inflight
    work.wait()  # a late wait ends nothing twice
    assert len(records("collective_end")) == 1


def test_a_new_group_has_its_own_sequence_under_a_name_every_rank_agrees_on(records: Records) -> None:
    group = dist.new_group([0])
    dist.all_reduce(torch.ones(2))
    dist.all_reduce(torch.ones(2), group=group)
    dist.all_reduce(torch.ones(2), group=group)
    begun = records("collective")
    assert [(r["pg"], r["coll_seq"], r["op"]) for r in begun] == [
        ("default", 1, "new_group"),  # every rank of the world makes it, in one order: one of its collectives
        ("default", 2, "all_reduce"),
        (f"pg:{group.group_name}", 1, "all_reduce"),
        (f"pg:{group.group_name}", 2, "all_reduce"),
    ]
    assert begun[0]["shapes"] == [[0]] and begun[0]["dtypes"] == []  # its members, as its one shape
    assert RECORDER.last_seq(f"pg:{group.group_name}") == 2 and RECORDER.last_seq() == 2


def test_a_group_created_with_local_synchronization_is_not_numbered_with_the_world(records: Records) -> None:
    dist.new_group([0], use_local_synchronization=True)  # only its members call it
    assert records("collective") == [] and RECORDER.last_seq() == 0


def test_a_destroyed_group_is_no_longer_awaited_and_its_numbering_restarts(records: Records) -> None:
    group = dist.new_group([0])
    name = f"pg:{group.group_name}"
    dist.all_reduce(torch.ones(2))
    work = dist.all_reduce(torch.ones(2), group=group, async_op=True)  # completes, never waited for
    RECORDER.begin(name, "all_reduce", [torch.ones(2)])  # issued, its completion never seen
    deadline = time.monotonic() + 10
    while not work.is_completed() and time.monotonic() < deadline:  # not Work.wait: that would end it
        time.sleep(0.001)
    dist.destroy_process_group(group)
    assert RECORDER.inflight() == [] and RECORDER.last_seq(name) == 0 and name not in RECORDER.group_ranks
    assert RECORDER.last_seq() == 2  # only that group's numbering restarts (new_group was default #1)
    ends = [(r["pg"], r["coll_seq"], r["ok"]) for r in records("collective_end")]
    # The async one ends as it ended; the unseen one keeps no end rather than a made-up failure.
    assert (name, 1, True) in ends and (name, 2, True) not in ends and (name, 2, False) not in ends


class _ShapeBomb(torch.Tensor):
    """A tensor whose Python ``shape`` raises: torch's C++ collective never asks for it."""

    @property
    def shape(self) -> Any:  # type: ignore[override]
        raise RuntimeError("shape exploded")


def test_a_failure_inside_the_recorder_never_reaches_training(records: Records) -> None:
    before = RECORDER.internal_errors
    t = torch.full((4,), 2.0).as_subclass(_ShapeBomb)
    dist.all_reduce(t)  # must not raise
    assert torch.equal(t.as_subclass(torch.Tensor), torch.full((4,), 2.0))
    assert RECORDER.internal_errors == before + 1
    dist.all_reduce(torch.ones(1))  # and the next call is recorded normally
    # One record per call, without shapes for the call whose shapes could not be read.
    assert [(r["coll_seq"], r["shapes"]) for r in records("collective")] == [(1, []), (2, [[1]])]
    assert [r["ok"] for r in records("collective_end")] == [True, True]


def test_install_is_idempotent_and_uninstall_restores_torch(gloo: None) -> None:
    original, original_wait = dist.all_reduce, dist.distributed_c10d.Work.wait
    assert collectives.install() and collectives.install()
    patched = dist.all_reduce
    assert patched is not original and dist.distributed_c10d.all_reduce is patched
    assert patched.__ddpscope_original__ is original  # type: ignore[attr-defined]
    assert dist.distributed_c10d.Work.wait is not original_wait
    collectives.uninstall()
    assert dist.all_reduce is original and dist.distributed_c10d.all_reduce is original
    assert dist.distributed_c10d.Work.wait is original_wait


def test_disabled_means_no_patches(gloo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPSCOPE_DISABLED", "1")
    agent.configure()  # the agent's config reads the environment
    original = dist.all_reduce
    try:
        assert collectives.disabled() and collectives.install() is False
        assert dist.all_reduce is original
    finally:
        agent.configure(exporter=agent.InMemoryExporter(), disabled=False)


def test_recent_keeps_completion_and_inflight_lists_only_open_collectives(records: Records) -> None:
    dist.all_reduce(torch.ones(3))
    seq = RECORDER.begin("default", "all_reduce", [torch.ones(7)], source="engine", call_site="train.py:9")
    recent = RECORDER.recent(10)
    assert [(c["coll_seq"], c["ok"]) for c in recent] == [(1, True), (2, None)]
    assert recent[0]["end_ns"] >= recent[0]["start_ns"]
    (open_,) = RECORDER.inflight()
    assert (open_["coll_seq"], open_["shapes"], open_["call_site"]) == (seq, [[7]], "train.py:9")
    RECORDER.end("default", seq)
    assert RECORDER.inflight() == []


def test_the_ring_is_bounded(gloo: None) -> None:
    rec = collectives.CollectiveRecorder(ring_size=5, progress=type(PROGRESS)())
    for _ in range(12):
        rec.end("default", rec.begin("default", "barrier", []))
    assert [c["coll_seq"] for c in rec.recent(100)] == [8, 9, 10, 11, 12]


def test_the_collective_record_is_made_durable_before_torch_is_entered(
    records: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    # gloo aborts the process on mismatched sizes before any end: the issue-time record is the
    # evidence, so it must be crash-durable (emit_durable), not only queued, when torch is entered.
    from ddpscope.ddp import _patch

    handed: list[tuple[str, str]] = []
    monkeypatch.setattr(collectives, "emit", lambda r: handed.append(("emit", r["kind"])))
    monkeypatch.setattr(collectives, "emit_durable", lambda r: handed.append(("durable", r["kind"])))
    seen_at_call: list[list[tuple[str, str]]] = []

    def fake_all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        seen_at_call.append(list(handed))

    wrapped = _patch._make_wrapper(RECORDER, "all_reduce", _patch.OPS["all_reduce"], fake_all_reduce)
    wrapped(torch.ones(3), group=None)
    assert seen_at_call == [[("durable", "collective")]]
    assert handed == [("durable", "collective"), ("durable", "collective_end")]


def test_reduce_ops_are_named_alike_on_every_rank_even_as_reduce_op_objects(records: Records) -> None:
    dist.all_reduce(torch.ones(2), op=dist.ReduceOp(dist.ReduceOp.MIN))
    dist.all_reduce(torch.ones(2), dist.ReduceOp.PRODUCT)
    dist.reduce(torch.ones(2), dst=0)
    assert [r["reduce_op"] for r in records("collective")] == ["MIN", "PRODUCT", "SUM"]


def test_a_planned_collective_records_what_begin_and_end_would_and_is_tracked_alike(records: Records) -> None:
    plan = RECORDER.plan("default", "all_reduce", reduce_op="SUM", shapes=[[7]], dtypes=["float32"])
    planned = RECORDER.begin_planned(plan, 4)
    (open_,) = RECORDER.inflight()
    assert (open_["coll_seq"], open_["shapes"], open_["call_site"]) == (planned, [[7]], None)
    assert PROGRESS.last_coll_seq == planned
    RECORDER.end_planned(plan, planned)
    assert RECORDER.inflight() == []
    ordinary = RECORDER.begin(
        "default", "all_reduce", [torch.ones(7)], reduce_op="SUM", source="engine", step=4
    )
    RECORDER.end("default", ordinary)

    assert [(c["coll_seq"], c["ok"]) for c in RECORDER.recent(10)] == [(planned, True), (ordinary, True)]
    a, b = records("collective")
    moving = ("seq", "time_ns", "coll_seq", "start_ns")
    assert {k: v for k, v in a.items() if k not in moving} == {k: v for k, v in b.items() if k not in moving}
    assert a["time_ns"] == a["start_ns"]
    end_a, end_b = records("collective_end")
    assert (end_a["coll_seq"], end_a["ok"], end_a["error"]) == (planned, True, None)
    assert set(end_a) == set(end_b)


def test_a_plan_the_wire_format_refuses_falls_back_to_the_ordinary_records(records: Records) -> None:
    plan = RECORDER.plan("default", "all_reduce", reduce_op="SUM", shapes=[["x"]], dtypes=["float32"])  # type: ignore[list-item]
    assert plan.begin is None
    seq = RECORDER.begin_planned(plan, 1)
    RECORDER.end_planned(plan, seq)
    assert RECORDER.inflight() == [] and [c["ok"] for c in RECORDER.recent(5)] == [True]
    # The agent's own check drops and counts the bad record, as it does any emitted one.
    assert records("collective") == [] and len(records("collective_end")) == 1
    assert agent.get_agent().stats()["dropped"] == {"invalid:collective": 1}


def test_a_user_call_repeated_from_one_line_is_planned_and_records_what_it_did_before(
    records: Records,
) -> None:
    site = here(3)
    for step in range(4):
        t = torch.full((2, 3), float(step))
        dist.all_reduce(t)
        dist.broadcast(torch.ones(step % 2 + 1), src=0)  # two shapes in turn: two plans
    begins, ends = records("collective"), records("collective_end")
    shown = begins[0]["call_site"]
    assert shown.endswith(site)
    assert RECORDER._user_plans[
        (
            "default",
            "all_reduce",
            "SUM",
            shown,
            None,
            None,
            "user",
            False,
            (torch.Size([2, 3]), torch.float32),
        )
    ]
    assert [r["coll_seq"] for r in begins] == list(range(1, 9))
    assert sorted(r["coll_seq"] for r in ends) == list(range(1, 9)) and all(r["ok"] for r in ends)
    moving = ("seq", "time_ns", "coll_seq", "start_ns")
    reduces = [{k: v for k, v in r.items() if k not in moving} for r in begins[0::2]]
    assert reduces[0]["step"] is None
    assert all(r == reduces[0] for r in reduces), reduces  # ordinary (first two) and planned alike
    broadcasts = [{k: v for k, v in r.items() if k not in moving} for r in begins[1::2]]
    assert [(r["shapes"], r["root"]) for r in broadcasts] == [([[1]], 0), ([[2]], 0)] * 2
    assert RECORDER.inflight() == []


def test_a_call_from_a_signal_handler_carries_the_signal_even_from_a_line_the_loop_had_planned(
    records: Records,
) -> None:
    """A preemption handler that checkpoints with the same helper the loop calls: the helper's collective
    is planned from the loop, yet the handler's call must say it came from the handler."""
    previous = signal.getsignal(signal.SIGUSR1)

    def checkpoint() -> None:
        dist.all_reduce(torch.ones(2))

    signal.signal(signal.SIGUSR1, lambda signum, frame: checkpoint())
    try:
        for _ in range(3):
            checkpoint()
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs here, in this thread
        checkpoint()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    begins = records("collective")
    assert [r.get("signal") for r in begins] == [None, None, None, "SIGUSR1", None]
    assert len({r["call_site"] for r in begins}) == 1


def test_a_user_call_made_inside_a_step_carries_that_step_and_one_between_steps_carries_none(
    records: Records,
) -> None:
    phase, step = PROGRESS.phase, PROGRESS.step
    try:
        for s in (7, 8, 9):  # the second sighting on is planned: the step must survive the template
            PROGRESS.enter("forward", s)
            dist.all_reduce(torch.ones(3))  # say, in a module's forward
            PROGRESS.enter("backward")
            dist.all_reduce(torch.ones(2))  # say, in a tensor hook
            PROGRESS.enter("idle")
            dist.all_reduce(torch.ones(3))  # the loss, logged between steps
    finally:
        PROGRESS.phase, PROGRESS.step = phase, step
    begins = records("collective")
    assert [r["step"] for r in begins] == [7, 7, None, 8, 8, None, 9, 9, None]
    assert {r["source"] for r in begins} == {"user"}
    assert len({r["call_site"] for r in begins[0::3]} | {r["call_site"] for r in begins[2::3]}) == 2


def test_user_plans_are_forgotten_when_their_group_changes_members_and_bounded(records: Records) -> None:
    RECORDER.register_group("g", [0, 1])
    RECORDER._user_plans[("g",)] = None
    RECORDER.register_group("g", [0, 1])  # the same members: plans stay
    assert ("g",) in RECORDER._user_plans
    RECORDER.register_group("g", [0, 2])
    assert RECORDER._user_plans == {}
    for i in range(collectives.MAX_USER_PLANS + 5):
        dist.all_reduce(torch.ones(i + 1))  # a new shape every call: never planned
    assert len(RECORDER._user_plans) <= collectives.MAX_USER_PLANS
    assert all(v is None for v in RECORDER._user_plans.values())


def test_a_user_call_whose_records_cannot_be_a_template_is_tried_once_not_at_every_call(
    records: Records, caplog: pytest.LogCaptureFixture
) -> None:
    pg = "g" * 300  # longer than the wire format allows: the template is refused
    for _ in range(4):
        seq, plan = RECORDER.begin_user(
            pg, "all_reduce", [torch.ones(2)], reduce_op="SUM", call_site="x.py:1"
        )
        assert plan is None
        RECORDER.end(pg, seq)
    assert sum("no record template" in r.message for r in caplog.records) == 1
    assert (
        RECORDER._user_plans[
            (pg, "all_reduce", "SUM", "x.py:1", None, None, "user", False, (torch.Size([2]), torch.float32))
        ]
        is collectives._UNPLANNABLE
    )


def test_a_folded_end_waits_for_its_step_record_and_goes_out_on_its_own_if_none_carries_it(
    records: Records,
) -> None:
    plan = RECORDER.plan(
        "default", "all_reduce", reduce_op="SUM", shapes=[[7]], dtypes=["float32"], folded=True
    )
    carried, dropped, failed_before, failed = (RECORDER.begin_planned(plan, s) for s in range(4))
    RECORDER.end_planned(plan, carried)
    assert RECORDER.inflight()[0]["coll_seq"] == dropped  # ended in memory at once
    assert records("collective_end") == []
    RECORDER.settle_folded(carried=True)  # a step record that carries it: the worker makes the record
    RECORDER.end_planned(plan, dropped)
    RECORDER.settle_folded(carried=False)  # the step record went out without it
    RECORDER.end_planned(plan, failed_before)
    RECORDER.end("default", failed, ok=False, error="peer gone")  # a failure says what ended before it
    ends = [(e["coll_seq"], e["ok"]) for e in records("collective_end")]
    assert ends == [(dropped, True), (failed_before, True), (failed, False)]
    assert [(c["coll_seq"], c["ok"]) for c in RECORDER.recent(10)] == [
        (carried, True), (dropped, True), (failed_before, True), (failed, False)
    ]  # fmt: skip


def test_the_watchdog_flush_emits_only_the_folded_ends_older_than_it_asks(records: Records) -> None:
    plan = RECORDER.plan(
        "default", "all_reduce", reduce_op="SUM", shapes=[[7]], dtypes=["float32"], folded=True
    )
    old, new = RECORDER.begin_planned(plan, 1), RECORDER.begin_planned(plan, 1)
    RECORDER.end_planned(plan, old)
    cut = agent.clock.now_ns()
    time.sleep(0.002)
    RECORDER.end_planned(plan, new)
    RECORDER.flush_folded(before_ns=cut + 1)
    assert [e["coll_seq"] for e in records("collective_end")] == [old]
    RECORDER.flush_folded()
    assert [e["coll_seq"] for e in records("collective_end")] == [old, new]


def test_folded_ends_of_a_step_whose_record_never_came_go_out_when_the_next_step_starts(
    records: Records,
) -> None:
    from ddpscope.ddp.step_record import StepTimer

    plan = RECORDER.plan(
        "default", "all_reduce", reduce_op="SUM", shapes=[[7]], dtypes=["float32"], folded=True
    )
    seq = RECORDER.begin_planned(plan, 1)
    RECORDER.end_planned(plan, seq)  # then the backward raised: no step record
    StepTimer(rank=0).forward_start(2)
    assert [e["coll_seq"] for e in records("collective_end")] == [seq]


def test_a_logging_thread_all_reducing_beside_the_main_thread_is_said_with_the_call_site(
    records: Records,
) -> None:
    dist.all_reduce(torch.ones(2))
    started, release = threading.Event(), threading.Event()

    def logger() -> None:
        dist.all_reduce(torch.ones(3))
        started.set()
        release.wait(10)

    thread = threading.Thread(target=logger, name="logger", daemon=True)
    thread.start()
    assert started.wait(10)
    site = here()
    dist.all_reduce(torch.ones(2))
    release.set()
    thread.join(10)
    (said,) = [r for r in records("warning") if r["code"] == "collectives_from_threads"]
    assert said["pg"] == "default"
    assert "the main thread (this call at " in said["message"]
    assert f"{site}) and thread 'logger'" in said["message"]
