"""Fixtures for the dashboard's browser tests: a real collector subprocess and headless Chromium.

The collector is ``python -m ddpscope.cli.main serve`` on a free port with a fresh SQLite file; it is
started once per test session (every test uses its own job ids) and killed by process group on exit.
Each test gets a new browser page whose console errors and uncaught exceptions fail the test.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.collector_proc import CollectorProc
from tests.support.system import CHROMIUM, CHROMIUM_ARGS, missing

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
STARTUP_DEADLINE_S = 30.0


@contextlib.contextmanager
def running_collector(tmp: Path) -> Iterator[CollectorProc]:
    """Start a real collector on a fresh SQLite file; kill its process group on exit."""
    with CollectorProc(f"sqlite:///{tmp / 'ddpscope.db'}", log_path=tmp / "collector.log") as proc:
        proc.start(timeout_s=STARTUP_DEADLINE_S)
        yield proc


@pytest.fixture(scope="package")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorProc]:
    with running_collector(tmp_path_factory.mktemp("collector")) as c:
        yield c


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        missing(f"no Chromium at {CHROMIUM}")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@dataclass
class PageProblems:
    """What went wrong inside the page: console errors, uncaught exceptions, alert() calls."""

    console: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)
    """Substrings of console errors a test expects (e.g. the 404 of an unknown job's page)."""

    def unexpected(self) -> list[str]:
        console = [c for c in self.console if not any(a in c for a in self.allowed)]
        return console + self.errors + self.dialogs


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(90_000)  # see pages.WAIT_MS: the machine is shared
    pg = context.new_page()
    problems = PageProblems()
    pg.on(
        "console",
        lambda m: problems.console.append(f"{m.text} @ {m.location}") if m.type == "error" else None,
    )
    pg.on("pageerror", lambda e: problems.errors.append(f"uncaught: {e}"))

    def on_dialog(d: Any) -> None:
        problems.dialogs.append(f"dialog {d.type}: {d.message}")
        d.dismiss()

    pg.on("dialog", on_dialog)
    pg.problems = problems
    try:
        yield pg
    finally:
        context.close()
    assert not problems.unexpected(), f"the page reported problems: {problems.unexpected()}"


def screenshot(page: Any, name: str) -> Path:
    """Save a full-page screenshot under test-artifacts/ (git-ignored) and return its path."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
