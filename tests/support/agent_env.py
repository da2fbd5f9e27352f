"""The environment of a process that runs the real agent in a test: only the test's DDPSCOPE_* settings
(none inherited from the caller), fast retries, one thread, unbuffered output."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def agent_env(url: str, spool_dir: Path, job: str, rank: int = 0, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPSCOPE_")}
    env.update(
        DDPSCOPE_URL=url,
        DDPSCOPE_SPOOL_DIR=str(spool_dir),
        DDPSCOPE_JOB=job,
        DDPSCOPE_HTTP_TIMEOUT_S="1",
        DDPSCOPE_RETRY_MAX_S="0.3",
        DDPSCOPE_SHIPPER_LINGER_S="60",
        RANK=str(rank),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env
