"""A real gloo DDP job SIGKILLed mid-training: what its ranks emitted still reaches the real collector.

Step records are crash-durable when the engine's ``emit`` returns (a record template in the write-ahead
ring, ``ddp/step_record.py``), so a SIGKILL loses none of them. Every rank prints each step (with the
host's monotonic clock) after its record was emitted: every printed step is owed, however close to the
kill it was printed.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.conftest import GLOO_JOB, Started, account, agent_env
from tests.support.collector_proc import CollectorProc
from tests.support.procs import kill_group, started_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

SEEN_STEP = 8
GRACE_S = 1.5
"""Time between seeing a step printed and the kill: six of the worker's busy rounds."""
RECENT_S = 0.5
"""Steps printed this close to the kill were still in the worker's round (0.25 s) when it came: the
ring alone had them. The test checks that there were some."""
SETTLE_S = 3.0
"""No new rows for this long after the owed ones arrived: the shippers (rounds ≤ 1 s) are done."""


def printed_steps(lines: list[str]) -> dict[int, float]:
    """``STEP n T`` lines of a rank's stdout as {step: monotonic time printed}."""
    return {int(x.split()[1]): float(x.split()[2]) for x in lines if x.startswith("STEP ")}


def unended_collectives(db: Path, job: str, rank: int, last_step: int) -> list[tuple[str, int]]:
    """The rank's collectives of steps up to ``last_step`` whose ``collective_end`` did not arrive."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        (job_id,) = con.execute("SELECT id FROM jobs WHERE job = ?", (job,)).fetchone()
        begun = con.execute(
            "SELECT pg, coll_seq, body FROM collectives WHERE job_id = ? AND rank = ?", (job_id, rank)
        ).fetchall()
        ended = set(
            con.execute(
                "SELECT pg, coll_seq FROM collective_ends WHERE job_id = ? AND rank = ?", (job_id, rank)
            )
        )
    finally:
        con.close()
    steps = [(pg, seq, json.loads(body).get("step")) for pg, seq, body in begun]
    assert any(step == last_step for _, _, step in steps), "no collective of the last printed step arrived"
    return sorted(
        (pg, seq)
        for pg, seq, step in steps
        if step is not None and step <= last_step and (pg, seq) not in ended
    )


def test_every_step_record_emitted_before_a_sigkill_reaches_the_collector_once_without_gaps(
    tmp_path: Path, collector: CollectorProc, started: Started, figures: dict[str, Any]
) -> None:
    db = Path(collector.db_url.removeprefix("sqlite:///"))
    url = collector.start()
    job = "sigkilled"
    env = agent_env(url, tmp_path / "spool", job)
    del env["RANK"]
    started.spool_dirs.append(tmp_path / "spool")
    with started_ranks(GLOO_JOB, 2, args=["100000", "0.02"], env=env) as ranks:
        deadline = time.monotonic() + 90
        assert ranks[0].stdout is not None
        head: list[str] = []
        while True:
            line = ranks[0].stdout.readline()
            assert line, f"rank 0 ended early: {ranks[0].communicate(timeout=10)[1][-3000:]}"
            head.append(line)
            if line.startswith(f"STEP {SEEN_STEP} "):
                break
            assert time.monotonic() < deadline, "the job did not reach the step in time"
        time.sleep(GRACE_S)
        killed_at = time.monotonic()
        for p in ranks:
            kill_group(p)  # the rank's own session: its shipper (another session) survives
        outputs = [p.communicate(timeout=10)[0] for p in ranks]
    printed = [printed_steps(head + outputs[0].splitlines()), printed_steps(outputs[1].splitlines())]
    owed = [set(p) for p in printed]
    recent = [{s for s, t in p.items() if t > killed_at - RECENT_S} for p in printed]
    assert all(SEEN_STEP in o for o in owed), "rank 1 printed nothing before the kill"
    assert all(recent), ("no step printed in the last round before the kill: nothing tested", recent)

    deadline = time.monotonic() + 60
    acc = account(db, job)
    while any(owed[r] - acc.per_rank.get(r, set()) for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.2)
        acc = account(db, job)
    settled_at = time.monotonic()
    while time.monotonic() - settled_at < SETTLE_S and time.monotonic() < deadline:
        time.sleep(0.2)
        latest = account(db, job)
        if latest.rows != acc.rows:
            acc, settled_at = latest, time.monotonic()

    delivered = [acc.per_rank.get(r, set()) for r in (0, 1)]
    lost = [set(printed[r]) - delivered[r] for r in (0, 1)]
    figures["training_sigkill"] = {
        "ranks_killed": 2,
        "steps_printed_before_kill": sum(len(p) for p in printed),
        "steps_printed_last_0_5_s": sum(len(r) for r in recent),
        "step_records_delivered": acc.rows,
        "printed_steps_lost": sum(len(x) for x in lost),
        "lost_printed_s_before_kill": sorted(
            round(killed_at - printed[r][s], 3) for r in (0, 1) for s in lost[r]
        ),
        "duplicates": acc.duplicates,
    }
    for r in (0, 1):
        assert not lost[r], (r, sorted(lost[r]), figures["training_sigkill"])
        # A printed step's bucket all-reduces had ended: their collective_end records are durable too.
        assert unended_collectives(db, job, r, max(printed[r])) == [], r
        # At most the step the kill interrupted between its emit and its print is delivered unprinted.
        assert delivered[r] == set(range(max(delivered[r]) + 1)), (r, sorted(delivered[r]))
    assert acc.duplicates == 0
