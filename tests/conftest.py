"""Shared fixtures. Helpers that start processes live in tests/support/procs.py."""

from __future__ import annotations

import os

# One thread per rank and per test process: with more threads than cores, gloo steps get 3-4x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A rank's shipper process outlives it to deliver its spool (600 s in production when no collector
# answers). Tests start many ranks, some with no collector at all: keep the stragglers short-lived.
# Tests that need a longer outage set their own value.
os.environ.setdefault("DDPSCOPE_SHIPPER_LINGER_S", "20")
