"""Where torch blocks on its peers in C++, out of ddpscope's sight: the Python frames of its collective
machinery, as the innermost frame of a blocked main thread shows them.

ddpscope records the collectives of the model it observes and the user's ``torch.distributed`` calls, not
those torch issues in C++ for a model it does not observe: a second model left as plain
``DistributedDataParallel`` (a GAN's discriminator) all-reduces its gradients from torch's C++ Reducer
inside ``backward()`` and broadcasts its buffers through ``dist._broadcast_coalesced``. A rank blocked
there has nothing in flight, as a rank stuck in its own code has; the frame tells them apart.

Standard library only, like the wire format: the hang watchdog says it in the rank's own sentence and
the collector (``server/analysis/native_wait.py``) reads it from the report's stack.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BLOCKED_CPU_SHARE = 0.1
"""Below this share of its stall on the CPU, the main thread was blocked, waiting; above, busy (inside
backward, that is computing, not waiting)."""


def blocked(cpu_s: float | None, stalled_s: float) -> bool | None:
    """Whether a main thread that used ``cpu_s`` of CPU during a ``stalled_s`` stall was blocked (True)
    or busy (False); None when that is unknown (no CPU figure, or no stall)."""
    if cpu_s is None or stalled_s <= 0:
        return None
    return cpu_s < BLOCKED_CPU_SHARE * stalled_s


@dataclass(frozen=True, slots=True)
class TorchWait:
    """Where a rank's main thread is blocked in torch's collective machinery."""

    place: str
    """``torch's backward pass``, ``torch.distributed (barrier)``, ..."""
    what: str
    """Which unrecorded collective usually blocks there."""


_MACHINERY = (
    (
        re.compile(r"(?:^|/)torch/autograd/(?:graph|__init__)\.py$"),
        "torch's backward pass",
        "torch's C++ Reducer waits there for the gradient all-reduce of a torch DistributedDataParallel "
        "model ddpscope does not observe (a second model, such as a GAN's discriminator, not passed to "
        "instrument())",
    ),
    (
        re.compile(r"(?:^|/)torch/nn/parallel/distributed\.py$"),
        "torch's DistributedDataParallel ({function})",
        "the buffer broadcast or bucket rebuild of a DistributedDataParallel model ddpscope does not observe",
    ),
    (
        re.compile(r"(?:^|/)torch/distributed/(?:distributed_c10d|c10d_logger|utils)\.py$"),
        "torch.distributed ({function})",
        "a collective ddpscope did not record (a DistributedDataParallel constructor's state broadcast, "
        "or a call through a name imported before ddpscope installed its recorder)",
    ),
)
"""(innermost file, where that is, what waits there). Only calls that block on peers: not
``torch/distributed/checkpoint`` (file writes every rank makes at once) nor data loading."""


def torch_wait(path: str, function: str) -> TorchWait | None:
    """The machinery a main thread whose innermost Python frame is ``function`` in ``path`` is blocked in,
    or None for any other frame."""
    path = path.replace("\\", "/")
    for pattern, place, what in _MACHINERY:
        if pattern.search(path):
            return TorchWait(place.format(function=function), what)
    return None
