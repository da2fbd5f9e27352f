"""``ddpscope serve`` as a real process: uvicorn on loopback, real HTTP, real databases."""

from __future__ import annotations

import gzip
import json
import re
import sqlite3
import subprocess
import sys

import httpx
import pytest

from tests.server.live import live_collector
from tests.support.synth import batch, by_rank, synth_job


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpscope.cli.main", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _send(url: str, records: list, token: str | None = None) -> httpx.Response:
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(
        f"{url}/api/v1/ingest",
        content=gzip.compress(json.dumps(batch(records)).encode()),
        headers=headers,
        timeout=30,
    )


def test_help_names_the_default_database_file():
    out = _serve("--help")
    assert out.returncode == 0 and "ddpscope.db" in out.stdout and "postgresql+psycopg" in out.stdout


def test_a_public_host_without_a_token_refuses_to_start(tmp_path):
    out = _serve("--host", "0.0.0.0", "--db", f"sqlite:///{tmp_path}/c.db")
    assert out.returncode == 2
    assert "--token" in out.stderr and "--no-auth" in out.stderr
    assert not (tmp_path / "c.db").exists()


def test_a_taken_port_a_bad_port_and_an_unopenable_database_are_one_line_each_and_create_nothing(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = _serve("--port", port, "--db", f"sqlite:///{tmp_path}/c.db")
    assert (
        out.returncode == 2 and "cannot listen on 127.0.0.1:" in out.stderr and "another --port" in out.stderr
    )
    assert not (tmp_path / "c.db").exists()  # said before the database is created
    out = _serve("--port", "70000", "--db", f"sqlite:///{tmp_path}/c.db")
    assert out.returncode == 2 and "a TCP port is 1 to 65535" in out.stderr
    out = _serve("--port", port, "--db", f"sqlite:///{tmp_path}/missing/c.db")  # free again now
    assert out.returncode == 2 and "cannot open the database" in out.stderr and "Traceback" not in out.stderr


def test_a_real_server_ingests_gzip_batches_and_answers_the_api(db_url):
    records = synth_job(2, 6, 3, slow_rank=1, finished=False)
    with live_collector(db_url, args=["--token", "t0k"]) as url:
        assert _send(url, records).status_code == 401
        for rank_records in by_rank(records).values():
            r = _send(url, rank_records, token="t0k")
            assert r.status_code == 200 and r.json()["duplicates"] == 0
        (job,) = httpx.get(f"{url}/api/v1/jobs").json()["items"]
        assert (job["job"], job["world_size"], job["steps"]) == ("synth", 2, 6)
        assert len(httpx.get(f"{url}/api/v1/jobs/synth/steps").json()["items"]) == 12
        metrics = httpx.get(f"{url}/metrics").text
        assert f"ddpscope_ingested_records_total {float(len(records))}" in metrics


def test_a_database_that_refuses_writes_answers_503_and_healthz_says_so_until_a_write_succeeds(tmp_path):
    db = tmp_path / "c.db"
    first, second = by_rank(synth_job(2, 3, 2, finished=False)).values()
    with live_collector(f"sqlite:///{db}") as url:
        assert _send(url, first).status_code == 200
        # Another process holds the write lock (as a full disk, it refuses every write; reads still work).
        lock = sqlite3.connect(db, timeout=1, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            refused = _send(url, second)  # after the collector's 10 s busy timeout
            health = httpx.get(f"{url}/healthz", timeout=30)
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        assert refused.status_code == 503, refused.text
        assert "cannot write its database (database is locked)" in refused.json()["detail"]
        assert int(refused.headers["retry-after"]) > 0
        assert health.status_code == 503 and "refused the last write" in health.json()["detail"], health.text
        assert _send(url, second).status_code == 200
        assert httpx.get(f"{url}/healthz").status_code == 200
        assert len(httpx.get(f"{url}/api/v1/jobs/synth/steps").json()["items"]) == 6


def test_a_database_file_deleted_under_the_collector_is_refused_and_said_instead_of_acknowledged(tmp_path):
    db = tmp_path / "c.db"
    first, second = by_rank(synth_job(2, 3, 2, finished=False)).values()
    with live_collector(f"sqlite:///{db}") as url:
        assert _send(url, first).status_code == 200
        for path in tmp_path.glob("c.db*"):
            path.unlink()  # SQLite would go on writing into the unlinked file, lost at the restart
        refused = _send(url, second)
        # "deleted", or "replaced" when a reader's connection made the path again in between.
        assert refused.status_code == 503, refused.text
        assert re.search(r"was (deleted|replaced) while the collector ran", refused.json()["detail"])
        health = httpx.get(f"{url}/healthz")
        assert health.status_code == 503 and "restart the collector" in health.json()["detail"]


@pytest.mark.postgres
def test_two_collector_processes_share_one_postgresql(pg_server):
    db = pg_server.create_database("shared")
    records = synth_job(4, 5, 2, finished=False)
    with live_collector(db) as a, live_collector(db) as b:
        for rank, rank_records in by_rank(records).items():
            assert _send((a, b)[rank % 2], rank_records).status_code == 200
        for url in (a, b):
            (job,) = httpx.get(f"{url}/api/v1/jobs").json()["items"]
            assert job["world_size"] == 4 and job["steps"] == 5
            assert (
                f"ddpscope_ingested_records_total {float(len(records))}" in httpx.get(f"{url}/metrics").text
            )
