"""The start of a test job's rank: ddpscope's monitors on, then the gloo group (torch imported here)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpscope.ddp import collectives
from ddpscope.ddp.errors import install_error_hooks
from ddpscope.ddp.watchdog import start_watchdog


def start_monitored_rank() -> int:
    """Error hooks, the collective recorder and the hang watchdog, then the gloo group from the launcher's
    environment and a fixed seed; returns the rank. The engine and ``instrument()`` may start the monitors
    themselves: each is idempotent, and a job must not depend on it."""
    install_error_hooks()
    collectives.install()
    start_watchdog()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    return dist.get_rank()
