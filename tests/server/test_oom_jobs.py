"""A real kernel OOM kill: rank 1 of a 2-rank gloo job moves itself into a memory cgroup of 400 MiB and keeps
4 MiB a step (``jobs/leak.py oom``) until the kernel's OOM killer sends it SIGKILL, under ddpscope's engine and
under torch's DDP with ``instrument()``. The collector must name the OOM killer, from the rank's last memory
records, with the cgroup's limit and the kernel's log line.

Making a memory cgroup needs root and a writable cgroup hierarchy (v1 or v2), which this machine
has; elsewhere the module is skipped, saying why (no package could provide it). The cgroup is removed after
the jobs, whose ranks and collector are killed by process group."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.real_job import RealJob, jobs_at_one_collector

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "jobs" / "leak.py"
JOBS = (("oom", "ddpscope"), ("oom", "torch"))
LIMIT_BYTES = 400 * 2**20
WAIT_S = 150.0


def made_cgroup() -> Path | None:
    """A new memory cgroup limited to ``LIMIT_BYTES`` (v1's memory hierarchy, else v2's), or None."""
    name = f"ddpscope-test-{uuid.uuid4().hex[:8]}"
    for directory, limit in ((Path("/sys/fs/cgroup/memory") / name, "memory.limit_in_bytes"),
                             (Path("/sys/fs/cgroup") / name, "memory.max")):  # fmt: skip
        try:
            directory.mkdir()
        except OSError:
            continue
        try:
            (directory / limit).write_text(str(LIMIT_BYTES))
            if limit == "memory.limit_in_bytes":
                with contextlib.suppress(OSError):  # no swap to escape into
                    (directory / "memory.memsw.limit_in_bytes").write_text(str(LIMIT_BYTES))
            return directory
        except OSError:
            directory.rmdir()
    return None


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], RealJob]]:
    cgroup = made_cgroup()
    if cgroup is None:
        pytest.skip("no memory cgroup can be made here (needs root and a writable cgroup hierarchy)")
    tmp = tmp_path_factory.mktemp("oom")
    try:
        with jobs_at_one_collector(
            tmp,
            SCRIPT,
            JOBS,
            prefix="oom",
            hang_timeout_s=300,
            wait_s=WAIT_S,
            env={"LEAK_CGROUP": str(cgroup)},
        ) as started:
            yield started
    finally:
        with contextlib.suppress(OSError):  # emptied once its processes are gone
            cgroup.rmdir()


def crashed(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [i for i in incidents if i["kind"] == "rank_crashed" and "OOM killer:" in i["message"]]


@pytest.mark.parametrize("engine", ["ddpscope", "torch"])
def test_a_rank_the_kernels_oom_killer_ended_is_named_with_its_cgroups_limit(
    jobs: dict[tuple[str, str], RealJob], engine: str
) -> None:
    j = jobs["oom", engine]
    (inc,) = j.wait_for("rank 1's OOM kill", crashed)
    assert inc["rank"] == 1 and inc["culprit_ranks"] == [1], inc
    message = inc["message"]
    assert "Its memory points at the kernel's OOM killer: rank 1 held " in message, message
    assert "the memory cgroup's limit had " in message and "of 400.0 MiB left" in message, message
    assert "'Memory cgroup out of memory: Killed process " in message, message
    assert j.procs[1].wait(timeout=WAIT_S) == -9, j.logs()  # SIGKILL, from the kernel
