"""What the agent reads of a ``file://`` rendezvous before ``init_process_group`` (``ddp/store_file.py``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from ddpscope.ddp import store_file


def test_only_an_existing_file_url_is_read_with_its_last_write_and_the_process_start() -> None:
    found = store_file.existing(f"file://{__file__}")
    assert found is not None and found["path"] == __file__
    assert found["mtime_ns"] == Path(__file__).stat().st_mtime_ns
    for other in ("env://", "tcp://127.0.0.1:29500", "file:///no/such/rendezvous", None, 42):
        assert store_file.existing(other) is None


def test_the_process_start_is_when_this_process_began_not_when_it_asked() -> None:
    before_ns = time.time_ns()
    child = subprocess.run(
        [sys.executable, "-c", "import time; time.sleep(1.0); from ddpscope.ddp import store_file; "
         "print(store_file.process_started_ns())"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    started = int(child.stdout.strip())
    # Started after this test's clock reading (ticks are 10 ms), well before its one-second sleep ended.
    assert before_ns - 20_000_000 <= started <= before_ns + 900_000_000, (started - before_ns) / 1e9
