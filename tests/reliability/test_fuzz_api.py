"""Fuzzing the collector's HTTP API on a live collector: no 5xx, and a refused batch stores nothing."""

from __future__ import annotations

import gzip
import http.client
import json
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, text

from tests.support import postgres
from tests.support.collector_proc import CollectorProc
from tests.support.synth import batch, synth_job
from tests.support.system import missing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )


RECORD_TABLES = (
    "jobs",
    "ranks",
    "steps",
    "step_unused",
    "collectives",
    "collective_ends",
    "heartbeats",
    "agent_stats",
    "events",
)
"""Every table a batch writes to (``counters`` excluded: refusals are counted there on purpose)."""


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CollectorProc, Path]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    db = tmp / "collector.db"
    with CollectorProc(f"sqlite:///{db}", log_path=tmp / "collector.log") as c:
        c.start()
        conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=10)
        status, _ = _post(conn, json.dumps(batch(synth_job(2, 4, 3, job="seeded"))).encode(), {})
        assert status == 200
        yield c, db


def _post(conn: http.client.HTTPConnection, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    for attempt in (1, 2):
        try:
            conn.request(
                "POST", "/api/v1/ingest", body=body, headers={"Content-Type": "application/json", **headers}
            )
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException):
            # The server may close a kept-alive connection after refusing a body: reconnect once.
            conn.close()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


_COUNT_ALL = "SELECT " + ", ".join(f"(SELECT count(*) FROM {t})" for t in RECORD_TABLES)


def _rows(con: sqlite3.Connection) -> dict[str, int]:
    return dict(zip(RECORD_TABLES, con.execute(_COUNT_ALL).fetchone(), strict=True))


def test_requests_generated_from_the_openapi_schema_never_get_a_server_error(
    live: tuple[CollectorProc, Path], figures: dict[str, Any]
) -> None:
    collector, _ = live
    schema = schemathesis.openapi.from_url(collector.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 10
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    started = time.monotonic()

    def fuzz(op: Any) -> None:
        @given(case=op.as_strategy(), real_job=st.booleans())
        @fuzz_settings(150)
        def call(case: Any, real_job: bool) -> None:
            # Half the time the job exists, so the analysis behind each route runs on fuzzed queries.
            if real_job and case.path_parameters and "job" in case.path_parameters:
                case.path_parameters["job"] = "seeded"
            response = case.call(timeout=15)
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                errors.append(f"{op.method.upper()} {response.request.url} -> {response.status_code}")

        call()

    for op in operations:
        fuzz(op)
    figures["fuzz_openapi"] = {
        "operations": len(operations),
        "requests": sum(statuses.values()),
        "server_errors": sum(n for s, n in statuses.items() if s >= 500),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "seconds": round(time.monotonic() - started, 1),
    }
    assert sum(statuses.values()) >= 900
    assert not errors, errors[:10]
    assert collector.healthy()


# -- ingest bodies --------------------------------------------------------------------------------

HOSTILE_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30, -1]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", "x" * 5000, "\x00", "\ud7ff\ue000", "'; DROP TABLE steps; --", "<script>"]),
    st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=4),
    st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.lists(st.lists(st.integers(), max_size=3), max_size=3),
)

BASE = synth_job(1, 2, 2, job="fuzzed", collectives=True)


@st.composite
def mutated_batch(draw: st.DrawFn) -> tuple[bytes, dict[str, str], int]:
    """A batch with a few records mutated (field changed, removed or added) or a broken body."""
    records = [dict(r) for r in draw(st.lists(st.sampled_from(BASE), min_size=1, max_size=8))]
    job = "fuzz-" + draw(st.text(alphabet="abcdef0123456789", min_size=6, max_size=6))
    seq0 = draw(st.integers(min_value=0, max_value=10**6))
    for i, r in enumerate(records):
        r["job"], r["seq"] = job, seq0 + i
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        r = records[draw(st.integers(min_value=0, max_value=len(records) - 1))]
        action = draw(st.sampled_from(["set", "set", "set", "delete", "add"]))
        name = draw(st.sampled_from(sorted(r)))
        if action == "delete":
            del r[name]
        elif action == "add":
            r[draw(st.text(min_size=1, max_size=8))] = draw(HOSTILE_VALUES)
        else:
            r[name] = draw(HOSTILE_VALUES)
    doc: Any = batch(records)
    shape = draw(st.sampled_from(["ok"] * 6 + ["schema", "records", "truncate", "garbage", "gzip"]))
    if shape == "schema":
        doc["schema"] = draw(HOSTILE_VALUES)
    elif shape == "records":
        doc["records"] = draw(HOSTILE_VALUES)
    body = json.dumps(doc).encode()
    headers: dict[str, str] = {}
    if shape == "truncate":
        body = body[: draw(st.integers(min_value=0, max_value=len(body) - 1))]
    elif shape == "garbage":
        body = draw(st.binary(max_size=200))
    elif shape == "gzip":
        body = gzip.compress(body)
        body = body[: draw(st.integers(min_value=len(body) // 2, max_value=len(body)))]
        headers["Content-Encoding"] = "gzip"
    return body, headers, len(records)


def fuzz_ingest(port: int, rows: Callable[[], dict[str, int]], examples: int) -> dict[str, Any]:
    """POST ``examples`` mutated batches; return the figures and the failures (5xx, partial writes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    started = time.monotonic()

    @given(mutated_batch())
    @fuzz_settings(examples)
    def send(case: tuple[bytes, dict[str, str], int]) -> None:
        body, headers, _n = case
        before = rows()
        status, text = _post(conn, body, headers)
        statuses[status] += 1
        after = rows()
        if status >= 500:
            failures.append(f"{status} {text[:200]!r} for {body[:300]!r}")
        elif status != 200 and after != before:
            changed = {t: after[t] - before[t] for t in after if after[t] != before[t]}
            failures.append(f"refused with {status} but stored {changed}: {body[:300]!r}")

    try:
        send()
    finally:
        conn.close()
    return {
        "requests": sum(statuses.values()),
        "server_errors": sum(n for s, n in statuses.items() if s >= 500),
        "partial_writes": sum("but stored" in f for f in failures),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "seconds": round(time.monotonic() - started, 1),
        "failures": failures[:5],
    }


def test_mutated_ingest_batches_never_get_a_server_error_nor_store_part_of_a_refused_batch(
    live: tuple[CollectorProc, Path], figures: dict[str, Any]
) -> None:
    collector, db = live
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10, isolation_level=None)
    try:
        result = fuzz_ingest(collector.port, lambda: _rows(con), 2000)
    finally:
        con.close()
    failures = result.pop("failures")
    figures["fuzz_ingest"] = result
    assert result["requests"] >= 1800
    assert not failures, failures
    assert result["statuses"].get("200", 0) > 0 and result["statuses"].get("422", 0) > 0


@pytest.mark.postgres
def test_mutated_ingest_batches_never_get_a_server_error_on_postgresql(
    tmp_path: Path, figures: dict[str, Any]
) -> None:
    if not postgres.available():
        missing(f"PostgreSQL 15 binaries not found in {postgres.PG_BIN}")
    with postgres.running_postgres() as pg:
        url = pg.create_database("fuzz")
        engine = create_engine(url)
        with CollectorProc(url, log_path=tmp_path / "collector.log") as collector, engine.connect() as con:
            collector.start()

            def rows() -> dict[str, int]:
                counts = con.execute(text(_COUNT_ALL)).one()
                con.rollback()  # a fresh snapshot for the next count
                return dict(zip(RECORD_TABLES, counts, strict=True))

            result = fuzz_ingest(collector.port, rows, 250)
        engine.dispose()
    failures = result.pop("failures")
    figures["fuzz_ingest_postgresql"] = result
    assert result["requests"] >= 220
    assert not failures, failures
