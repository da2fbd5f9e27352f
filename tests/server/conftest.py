"""Collector fixtures: a real SQLite file and a real PostgreSQL 15 (one server per session, a fresh
database per test), the app through TestClient, and helpers to post synthetic batches."""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ddpscope.server.app import create_app
from ddpscope.server.codec import decode_batch
from ddpscope.server.settings import Settings
from ddpscope.server.storage import Storage
from tests.support import postgres
from tests.support.synth import batch
from tests.support.system import missing

_db_names = itertools.count()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[postgres.PostgresServer]:
    if not postgres.available():
        missing(f"PostgreSQL 15 binaries not found in {postgres.PG_BIN}")
    with postgres.running_postgres() as server:
        yield server


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database: a SQLite file, or a new database on the session's PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'collector.db'}"
    server: postgres.PostgresServer = request.getfixturevalue("pg_server")
    return server.create_database(f"t{next(_db_names)}")


@pytest.fixture
def storage(db_url: str) -> Iterator[Storage]:
    st = Storage.open(db_url)
    yield st
    st.close()


def make_client(db_url: str, **settings: Any) -> TestClient:
    return TestClient(create_app(Settings(db_url=db_url, **settings)))


@pytest.fixture
def client(db_url: str) -> Iterator[TestClient]:
    with make_client(db_url) as c:
        yield c


def decoded(records: list[dict[str, Any]]) -> list[Any]:
    """Records as the ingest route hands them to storage."""
    return decode_batch(json.dumps(batch(records)).encode())


def post(
    client: TestClient, records: list[dict[str, Any]], *, gzip_body: bool = False, **headers: str
) -> Any:
    body = json.dumps(batch(records)).encode()
    hdrs = {"Content-Type": "application/json", **headers}
    if gzip_body:
        body = gzip.compress(body)
        hdrs["Content-Encoding"] = "gzip"
    return client.post("/api/v1/ingest", content=body, headers=hdrs)
