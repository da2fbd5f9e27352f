"""System packages the tests use (PostgreSQL 15, Prometheus, Chromium).

`make test` installs them (.ci/system-deps) and sets DDPSCOPE_TEST_STRICT=1: there a missing package
is a failure, never a silent skip. A developer running pytest by hand without them gets a skip.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

STRICT = os.environ.get("DDPSCOPE_TEST_STRICT") == "1"

# Debian's Chromium, driven by playwright (never `playwright install`); without the background-networking
# flags it keeps trying to reach the internet, which this machine does not have.
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def missing(what: str) -> NoReturn:
    message = f"{what}: install it with `bash .ci/system-deps` (make test does)"
    if STRICT:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)
