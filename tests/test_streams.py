"""The streams ``make test`` runs (``tests/streams.py``) name modules that exist, and every test falls in one;
the runner (``tests/run_suite.py``, which prints how many tests each stream ran) kills what a stream left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests import streams

ROOT = Path(__file__).resolve().parent.parent


def test_every_module_the_streams_name_exists() -> None:
    named = streams.IDLE_BOUND_MODULES | streams.TIMING_FREE_MODULES | streams.SOLO_MODULES
    assert [m for m in sorted(named) if not (ROOT / m).is_file()] == []
    assert not streams.SOLO_MODULES & (streams.IDLE_BOUND_MODULES | streams.TIMING_FREE_MODULES)


def test_a_slow_module_nobody_listed_is_heavy_and_an_unmarked_one_light() -> None:
    assert streams.stream_of("tests/server/test_new_jobs.py", {"slow"}) == "heavy"
    assert streams.stream_of("tests/browser/test_new_page.py", {"browser"}) == "heavy"
    assert streams.stream_of("tests/server/test_new_unit.py", {"postgres"}) == "light"
    assert streams.stream_of("tests/server/test_real_jobs.py", {"slow"}) == "solo"


ORPHAN_MAKER = """
import os, subprocess, sys
from tests.run_suite import end_leftovers
from tests.support.preloaded import become_subreaper

become_subreaper()
# A middle process starts a sleeper in a session of its own and exits, as a killed stream leaves a rank.
middle = subprocess.Popen([sys.executable, "-c",
    "import subprocess; print(subprocess.Popen(['sleep', '300'], start_new_session=True, "
    "stdout=subprocess.DEVNULL).pid)"],
    stdout=subprocess.PIPE, text=True)
orphan = int(middle.communicate()[0])
killed = end_leftovers(grace_s=0.5)
print(orphan in killed, os.path.exists(f"/proc/{orphan}"))
"""


def test_the_suite_runner_kills_by_pid_what_a_stream_left_behind_in_a_session_of_its_own() -> None:
    done = subprocess.run(
        [sys.executable, "-c", ORPHAN_MAKER], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"], done.stdout  # killed, and gone
