"""A rank's memory records: read from /proc and the memory cgroup, sent on an interval or at once on a jump,
beside the watchdog's heartbeats."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpscope.agent import memory
from ddpscope.agent.memory import MemoryReader, _cgroup_files
from ddpscope.ddp import watchdog as wd
from ddpscope.ddp.collectives import CollectiveRecorder
from ddpscope.ddp.progress import Progress
from tests.ddp.watchdog_support import ManualClock, Records, in_memory_records
from tests.support.memory_holder import hold


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=1)


def test_a_reading_has_this_process_and_its_host_and_is_sent_once_per_interval() -> None:
    reader = MemoryReader(interval_s=30.0)
    first = reader.due(0.0)
    assert first is not None and first["kind"] == "memory"
    assert (
        0 < first["rss_bytes"] < first["total_bytes"] and 0 < first["available_bytes"] <= first["total_bytes"]
    )
    assert reader.due(10.0) is None
    assert reader.due(31.0) is not None


def reader_of_a_resident_size(monkeypatch: pytest.MonkeyPatch) -> tuple[MemoryReader, list[int], int]:
    """A 30 s reader whose process's resident size is ``rss[0]`` (1 GiB, to be moved by the test), its first
    record sent at 0 s; and the host's memory."""
    rss = [2**30]
    monkeypatch.setattr(memory, "_statm", lambda: (rss[0], 0))
    reader = MemoryReader(interval_s=30.0)
    total = reader.due(0.0)["total_bytes"]  # type: ignore[index]
    return reader, rss, total


def test_a_jump_of_the_resident_size_is_sent_before_the_interval_is_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reader, rss, total = reader_of_a_resident_size(monkeypatch)
    rss[0] += int(0.01 * total)
    assert reader.due(1.0) is None
    rss[0] += int(0.02 * total)
    jumped = reader.due(2.0)
    assert jumped is not None and jumped["rss_bytes"] == rss[0]


def test_memory_that_falls_and_rises_again_each_step_is_sent_on_the_interval_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reader, rss, total = reader_of_a_resident_size(monkeypatch)
    swing = int(0.05 * total)  # a step's activations, freed and allocated again
    for t in range(1, 29, 2):
        rss[0] += -swing if t % 4 == 1 else swing
        assert reader.due(float(t)) is None, t


def test_a_rise_of_the_hosts_memory_in_use_is_sent_at_once_as_a_workers_leak_shows_only_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = [(16 * 2**30, 24 * 2**30)]  # (available, total)
    monkeypatch.setattr(memory, "_meminfo", lambda: host[0])
    monkeypatch.setattr(memory, "_cgroup_files", lambda: None)
    reader = MemoryReader(interval_s=30.0)
    assert reader.due(0.0) is not None
    host[0] = (host[0][0] - int(0.01 * host[0][1]), host[0][1])
    assert reader.due(2.0) is None
    host[0] = (host[0][0] - int(0.015 * host[0][1]), host[0][1])
    sent = reader.due(4.0)
    assert sent is not None and sent["available_bytes"] == host[0][0]


def test_under_a_cgroup_limit_a_rise_is_judged_against_the_limit_not_the_host(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(str(2**30))  # a 1 GiB container on a host many times larger
    usage.write_text(str(2**29))
    monkeypatch.setattr(memory, "_cgroup_files", lambda: (str(limit), str(usage)))
    reader = MemoryReader(interval_s=30.0)
    first = reader.due(0.0)
    assert first is not None and first["limit_bytes"] == 2**30 and first["total_bytes"] > 2**30
    usage.write_text(str(2**29 + 2**26))  # +64 MiB: 6 % of the limit, far under 2 % of the host
    sent = reader.due(2.0)
    assert sent is not None and sent["cgroup_bytes"] == 2**29 + 2**26


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_memory_cgroups_limit_is_found_in_its_own_directory_or_at_the_mounts_root(
    tmp_path: Path, version: str
) -> None:
    own = "/slurm/job_42/step_0"
    if version == "v1":
        proc = "12:memory:" + own + "\n11:cpu,cpuacct:" + own + "\n"
        base, limit, usage = tmp_path / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
    else:
        proc = "0::" + own + "\n"
        base, limit, usage = tmp_path, "memory.max", "memory.current"
    (tmp_path / "cgroup").write_text(proc)
    base.mkdir(exist_ok=True)
    (base / limit).write_text("8589934592\n")  # a container sees its cgroup at the root
    assert _cgroup_files(str(tmp_path / "cgroup"), str(tmp_path)) == (str(base / limit), str(base / usage))
    mine = base / own.lstrip("/")
    mine.mkdir(parents=True)
    (mine / limit).write_text("4294967296\n")
    assert _cgroup_files(str(tmp_path / "cgroup"), str(tmp_path)) == (str(mine / limit), str(mine / usage))
    (tmp_path / "cgroup").write_text("0::/\n" if version == "v1" else "3:cpu:/x\n")
    if version == "v2":
        assert _cgroup_files(str(tmp_path / "cgroup"), str(tmp_path)) is None


def test_a_cgroup_limit_below_the_hosts_memory_is_sent_with_its_usage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("536870912\n")
    monkeypatch.setattr(
        memory, "_cgroup_files", lambda: (str(tmp_path / "memory.max"), str(tmp_path / "memory.current"))
    )
    reading = MemoryReader(interval_s=30.0).due(0.0)
    assert reading is not None and reading["limit_bytes"] == 2**30 and reading["cgroup_bytes"] == 2**29
    (tmp_path / "memory.max").write_text("max\n")  # v2's "no limit"
    assert "limit_bytes" not in (MemoryReader(interval_s=30.0).due(0.0) or {})


def test_the_watchdog_sends_memory_with_the_step_beside_its_heartbeats(records: Records) -> None:
    progress, clock = Progress(), ManualClock()
    dog = wd.Watchdog(
        timeout_s=60.0, heartbeat_s=1.0, progress=progress, recorder=CollectiveRecorder(progress=progress),
        clock=clock, memory=MemoryReader(interval_s=5.0),
    )  # fmt: skip
    progress.enter("forward", step=7)
    for _ in range(12):  # heartbeats at 0, 1, ..., 11 s; memory at 0, 5 and 10 s
        dog.check()
        clock.now += 1.0
    sent = records("memory")
    assert [m["step"] for m in sent] == [7, 7, 7] and len(records("heartbeat")) == 12


def test_the_private_memory_of_the_ranks_worker_processes_and_theirs_is_sent_but_not_a_program_it_ran() -> (
    None
):
    # The test's own process may have workers already (another test's): counted apart.
    before_bytes, before_count = memory.workers_memory() or (0, 0)
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: its command line says multiprocessing
    ready = spawn.Semaphore(0)
    worker = spawn.Process(target=hold, args=(48, ready, 32))
    program = subprocess.Popen(  # a program the rank runs is no worker of its
        [sys.executable, "-c", "b = bytearray(64 * 2**20); b[::4096] = b'1' * len(b[::4096]); import time; time.sleep(60)"],
        start_new_session=True,
    )  # fmt: skip
    worker.start()
    try:
        assert ready.acquire(timeout=60) and ready.acquire(timeout=60), "the workers did not start"
        record = MemoryReader(interval_s=30.0).due(0.0)
        assert record is not None and record["workers"] == before_count + 2, record
        # Each holds its bytearray privately, plus an interpreter's own pages (a few MiB each).
        assert 80 * 2**20 <= record["workers_bytes"] - before_bytes <= 130 * 2**20, record
    finally:
        for pid in [*memory._children(worker.pid or 0), worker.pid or 0]:  # its worker, then it
            if pid:
                os.kill(pid, signal.SIGKILL)
        worker.join(timeout=10)
        program.kill()
        program.wait(timeout=10)


def test_a_forkservers_workers_are_counted_and_the_forkserver_is_not() -> None:
    before_bytes, before_count = memory.workers_memory() or (0, 0)
    forkserver = multiprocessing.get_context("forkserver")
    ready = forkserver.Semaphore(0)
    worker = forkserver.Process(target=hold, args=(48, ready))
    worker.start()
    try:
        assert ready.acquire(timeout=60), "the worker did not start"
        found = memory.workers_memory()
        assert found is not None and found[1] == before_count + 1, found
        assert 48 * 2**20 <= found[0] - before_bytes <= 80 * 2**20, found
    finally:
        worker.kill()
        worker.join(timeout=10)
