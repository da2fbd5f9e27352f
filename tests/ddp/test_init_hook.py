"""Importing ddpscope.ddp wraps torch.distributed.init_process_group: monitoring starts with the group."""

from __future__ import annotations

import datetime
import inspect
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import ddpscope.agent
import ddpscope.ddp  # noqa: F401  (the import is what wraps init_process_group)
from ddpscope.ddp import errors, monitor
from ddpscope.ddp import watchdog as wd
from ddpscope.ddp.progress import PROGRESS
from tests.ddp.watchdog_support import Records, in_memory_records
from tests.support.procs import free_port


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=0)


@pytest.fixture(autouse=True)
def no_watchdog_left() -> Iterator[None]:
    # The wrapper starts the watchdog before the rendezvous: stopped here, inside the test that started
    # it, so that its parting heartbeat is not read by the next test.
    yield
    wd.stop_watchdog()


def test_both_torch_names_are_one_wrapper_with_torchs_signature_and_watching_again_changes_nothing() -> None:
    wrapper = dist.init_process_group
    assert dist.distributed_c10d.init_process_group is wrapper
    assert getattr(wrapper, "__ddpscope_init_hook__", False)
    original = inspect.unwrap(wrapper)
    assert original is not wrapper and wrapper.__name__ == "init_process_group"
    assert inspect.signature(wrapper) == inspect.signature(original)
    assert "device_id" in inspect.signature(wrapper).parameters
    assert monitor.watch_init_process_group() and dist.init_process_group is wrapper


def test_the_wrapper_passes_every_argument_through_and_then_enables_the_monitor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[Any] = []

    def init_process_group(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "torch's result"

    monkeypatch.setattr(monitor, "enable", lambda **kw: calls.append(("enable", kw)))
    wrapped = monitor._wrap(init_process_group)
    result = wrapped("gloo", timeout=5, device_id=3, world_size=2, rank=1)
    assert result == "torch's result"
    assert calls[0] == (("gloo",), {"timeout": 5, "device_id": 3, "world_size": 2, "rank": 1})
    assert calls[1][0] == "enable" and len(calls) == 2


def test_an_error_of_the_users_call_passes_through_unchanged_and_enables_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    enabled: list[object] = []
    error = ValueError("trying to initialize the default process group twice!")

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(monitor, "enable", lambda **kw: enabled.append(kw))
    with pytest.raises(ValueError) as caught:
        monitor._wrap(init_process_group)("gloo")
    assert caught.value is error and enabled == []


def test_a_rendezvous_that_timed_out_is_reported_before_it_reaches_the_script(
    records: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before the group exists nothing else of this rank reaches the collector: the error is said here.
    error = dist.DistStoreError("Timed out after 26 seconds waiting for clients. 1/2 clients joined.")

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(monitor, "enable", lambda **kw: None)
    with pytest.raises(dist.DistStoreError) as caught:
        monitor._wrap(init_process_group)("gloo")
    assert caught.value is error
    (reported,) = records("rank_error")
    assert reported["error_type"] == "DistStoreError" and "1/2 clients joined" in reported["message"]
    assert reported["fatal"] is False  # the script may catch it and retry; uncaught, it is said again


def test_a_failed_rendezvous_on_a_file_that_was_there_before_says_when_it_was_written_also_when_fatal(
    records: Records, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # torch's FileStore wants a file that does not exist: one there before may be an earlier run's.
    store = tmp_path / "rdv store"
    store.write_bytes(b"an earlier run's keys")
    error = RuntimeError("Gloo connectFullMesh failed with ... Connection refused, remote=[127.0.0.1]:4499$1")

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(monitor, "enable", lambda **kw: None)
    with pytest.raises(RuntimeError):
        monitor._wrap(init_process_group)("gloo", init_method=f"file://{store}".replace(" ", "%20"), rank=1)
    errors.report_error(error, fatal=True)  # uncaught, it ends the process: said again with the file
    said = [r["store_file"] for r in records("rank_error")]
    assert len(said) == 2 and said[0] == said[1]
    assert said[0]["path"] == str(store) and said[0]["mtime_ns"] == store.stat().st_mtime_ns
    started = said[0]["process_started_ns"]
    assert started is not None and started <= time.time_ns() - int(
        time.perf_counter() * 0
    )  # not ahead of now
    error = RuntimeError("Timed out waiting for clients")
    with pytest.raises(RuntimeError):  # env:// (and tcp://) keep nothing on disk: nothing to say
        monitor._wrap(init_process_group)("gloo", init_method="env://")
    assert "store_file" not in records("rank_error")[-1]


def test_a_failure_of_ddpscope_after_the_group_exists_is_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(**kwargs: Any) -> None:
        raise RuntimeError("ddpscope bug")

    monkeypatch.setattr(monitor, "enable", broken)
    with caplog.at_level(logging.WARNING, logger="ddpscope"):
        assert monitor._wrap(lambda: "group made")() == "group made"
    assert "could not start monitoring after init_process_group" in caplog.text


@pytest.fixture
def fresh_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process-wide progress as a new process has it, no step yet: earlier tests in this process
    (an engine's forward) leave theirs."""
    for name, fresh in (("began", False), ("step", 0), ("phase", "idle")):
        monkeypatch.setattr(PROGRESS, name, fresh)


def test_creating_the_default_group_starts_the_error_hooks_the_recorder_and_the_watchdog(
    records: Records, fresh_progress: None
) -> None:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    monitor.disable()  # whatever an earlier test left running: what follows is the group's doing
    hook, all_reduce = sys.excepthook, dist.all_reduce
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        dog = wd.get_watchdog()
        assert dog is not None and dog.running
        assert any(t.name == "ddpscope-watchdog" for t in threading.enumerate())
        assert (
            getattr(sys.excepthook, "__module__", "") == "ddpscope.ddp.errors" and sys.excepthook is not hook
        )
        assert dist.all_reduce is not all_reduce
    finally:
        monitor.disable()
        dist.destroy_process_group()
    # Stopped before its first (deferred) heartbeat, the watchdog sent one on the way out.
    (beat,) = records("heartbeat")
    assert beat["world_size"] == 1 and beat["phase"] == "idle"


def test_an_ordinary_rendezvous_sends_nothing_and_heartbeats_start_one_interval_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nothing under the environment's identity while the group is made (a script may configure its own
    # right after); then heartbeats, which say the world size asked for before torch's group says it.
    exporter = ddpscope.agent.InMemoryExporter()
    ddpscope.agent.configure(exporter=exporter, rank=1, heartbeat_s=0.1, hang_timeout_s=30.0)
    monkeypatch.setattr(monitor, "enable", lambda **kw: None)
    during: list[dict[str, Any]] = []

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.6)  # six heartbeat intervals
        ddpscope.agent.get_agent().force_flush(5.0)
        during.extend(exporter.records)

    monitor._wrap(init_process_group)("gloo", world_size=3, rank=1)
    assert during == []
    deadline = time.monotonic() + 10
    while not any(r["kind"] == "heartbeat" for r in exporter.records) and time.monotonic() < deadline:
        ddpscope.agent.get_agent().force_flush(1.0)
        time.sleep(0.05)
    beats = [r for r in exporter.records if r["kind"] == "heartbeat"]
    assert beats and beats[0]["world_size"] == 3 and beats[0]["rank"] == 1


def test_a_rank_whose_peer_never_starts_is_reported_in_the_rendezvous_at_the_hang_timeout_not_torchs(
    fresh_progress: None,
) -> None:
    # Rank 0 of two, alone: torch's store waits for rank 1 until the group's timeout (30 min by default).
    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    monitor.disable()
    exporter = ddpscope.agent.InMemoryExporter()
    ddpscope.agent.configure(exporter=exporter, rank=0, hang_timeout_s=1.0, heartbeat_s=0.5)
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="1/2 clients joined"):
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=2,
            timeout=datetime.timedelta(seconds=4),
        )
    assert time.monotonic() - started >= 4
    wd.stop_watchdog()
    ddpscope.agent.get_agent().force_flush(5.0)
    kinds = [r["kind"] for r in exporter.records]
    (hang,) = [r for r in exporter.records if r["kind"] == "hang"]
    assert "init_process_group's rendezvous" in hang["message"]
    assert "before its process group exists" in hang["message"]
    assert 1.0 <= hang["stalled_s"] < 3.0 and hang["step"] == 0
    # Ended in the store's timeout, not in progress: the rank_error says so, no hang_resolved.
    assert "hang_resolved" not in kinds and kinds.index("hang") < kinds.index("rank_error")
    assert {r["world_size"] for r in exporter.records if r["kind"] == "heartbeat"} == {2}


def test_the_thread_that_makes_the_process_group_is_the_one_whose_waits_are_read_until_a_step_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A launcher that runs the whole script on a worker thread: its rendezvous and DDP construction waits
    # happen there, before any step notes the training thread.
    monkeypatch.setattr(monitor, "enable", lambda **kw: None)
    monkeypatch.setattr(PROGRESS, "trainer", None)
    seen: list[int | None] = []

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        seen.append(PROGRESS.trainer)

    worker = threading.Thread(target=monitor._wrap(init_process_group), args=("gloo",), name="launcher")
    worker.start()
    worker.join(10)
    assert seen == [worker.ident]
