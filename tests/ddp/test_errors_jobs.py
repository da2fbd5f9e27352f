"""An exception on one rank of a real 2-rank gloo job becomes rank_error records on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ddp.failure_jobs.runner import run_job, site

pytestmark = pytest.mark.slow


def test_an_exception_on_one_rank_is_a_fatal_rank_error_and_its_peer_reports_the_broken_collective(
    tmp_path: Path,
) -> None:
    run = run_job("raise", tmp_path)
    assert run.results[1].returncode == 1, run.output()
    (err,) = run.of(1, "rank_error")
    assert (err["error_type"], err["step"], err["phase"], err["fatal"]) == ("ValueError", 2, "forward", True)
    assert err["message"] == "bad batch on rank 1 at step 2"
    assert site("raise").split(":")[1] in err["stack"] and "raise_error" in err["stack"]
    # Rank 0 was waiting in its step-2 all-reduce: it fails there, and says so.
    assert run.results[0].returncode not in (0, None), run.output()
    failed = [r for r in run.of(0, "collective_end") if not r["ok"]]
    assert [r["coll_seq"] for r in failed] == [3]
    (peer_err,) = run.of(0, "rank_error")
    assert peer_err["fatal"] is True and peer_err["step"] == 2
