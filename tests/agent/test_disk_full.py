"""A spool the agent cannot write (a full filesystem, a path that is no directory) never stops training:
the process lives, says so once, and counts what it could not keep or sends it straight to the collector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.conftest import kill_shippers
from tests.agent.fake_collector import FakeCollector

CHILD = Path(__file__).with_name("disk_full_child.py")


@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: room for the spool's first segment, not for the 2.25 MiB write-ahead ring."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        kill_shippers(mount)
        subprocess.run(["umount", "-l", str(mount)], check=False)


def run_child(
    spool_dir: Path, url: str, count: int, flush_s: float = 10.0, env: dict[str, str] | None = None
) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, str(CHILD), str(spool_dir), url, str(count), str(flush_s)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=90,
        start_new_session=True,
    )
    assert done.returncode == 0, f"rc={done.returncode}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_full_filesystem_under_the_spool_costs_records_not_the_process(tiny_filesystem: Path) -> None:
    # The ring was once a sparse mapped file: its first write to a page the full tmpfs could not back
    # killed the process with SIGBUS.
    stats, stderr = run_child(tiny_filesystem, "http://127.0.0.1:9", 3000, flush_s=1.0)
    assert stats["emitted"] == 3000
    dropped = stats["dropped"].get("spool_error:heartbeat", 0)
    assert dropped > 0, stats
    assert "no write-ahead ring" in stderr
    assert stderr.count("cannot write the spool") == 1, stderr
    assert "Traceback" not in stderr, stderr


def test_a_spool_path_that_is_no_directory_sends_records_straight_to_the_collector(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with FakeCollector() as collector:
        stats, stderr = run_child(blocked / "spool", collector.url, 50)
        collector.wait_for(lambda c: len(c.of_kind("heartbeat")) == 50, timeout_s=20)
    assert stats["emitted"] == 50 and not stats["dropped"], stats
    assert stderr.count("cannot use the spool directory") == 1, stderr
    assert "sending records straight to the collector" in stderr
    assert "Traceback" not in stderr, stderr


def test_with_no_spool_and_no_collector_the_training_thread_never_waits_for_a_post(tmp_path: Path) -> None:
    # The first durable record used to make the exporter on the training thread and post it there: with
    # nothing listening, emit_durable retried for the export timeout (30 s) before training went on.
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    began = time.monotonic()
    stats, stderr = run_child(
        blocked / "spool", "http://127.0.0.1:9", 20, flush_s=0.1, env={"DDPSCOPE_HTTP_TIMEOUT_S": "1"}
    )
    assert stats["longest_emit_s"] < 0.5, stats
    assert stats["emitted"] == 20 and stats["dropped"], stats  # tried, and counted as not delivered
    # Posts from the exiting thread (force_flush, shutdown) wait one request's timeout, not 30 s each.
    assert time.monotonic() - began < 20
    assert "sending records straight to the collector" in stderr
    assert "records of this rank never reached the collector at http://127.0.0.1:9" in stderr, stderr
