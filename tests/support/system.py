"""System packages the tests use (PostgreSQL 15, Prometheus, Chromium).

`make test` installs them (.ci/system-deps) and sets DDPSCOPE_TEST_STRICT=1: there a missing package
is a failure, never a silent skip. A developer running pytest by hand without them gets a skip.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

STRICT = os.environ.get("DDPSCOPE_TEST_STRICT") == "1"


def missing(what: str) -> NoReturn:
    message = f"{what}: install it with `bash .ci/system-deps` (make test does)"
    if STRICT:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)
