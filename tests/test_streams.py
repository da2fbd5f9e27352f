"""The streams ``make test`` runs (``tests/streams.py``) name modules that exist, and every test falls in one.
(``tests/run_suite.py`` prints how many tests each stream ran.)"""

from __future__ import annotations

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
