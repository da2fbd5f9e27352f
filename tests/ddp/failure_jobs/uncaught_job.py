"""One process, no process group: an exception escapes the training loop at step 7, in backward.

    python uncaught_job.py OUT_DIR

The error hooks must turn it into a fatal ``rank_error`` that reaches OUT_DIR/rank<R>.jsonl before the
process exits, and the usual traceback must still be printed by the previous hook.
"""

from __future__ import annotations

import sys

import _capture

from ddpscope.ddp.errors import install_error_hooks
from ddpscope.ddp.progress import PROGRESS


def train() -> None:
    for step in range(10):
        PROGRESS.enter("forward", step)
        PROGRESS.enter("backward")
        if step == 7:
            raise FloatingPointError("loss is nan at step 7")  # SITE:raise


if __name__ == "__main__":
    _capture.capture(sys.argv[1], flusher=False)
    install_error_hooks()
    train()
