"""Shared fixtures. Helpers that start processes live in tests/support/procs.py."""

from __future__ import annotations

import os

# One thread per rank and per test process: with more threads than cores, gloo steps get 3-4x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
