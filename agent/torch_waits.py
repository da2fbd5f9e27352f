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


DATALOADER_FILE = "torch/utils/data/dataloader.py"
QUEUE_WAIT_FILES = (
    "queue.py",
    "queues.py",
    "threading.py",
    "selectors.py",
    "connection.py",
    "synchronize.py",
)
"""Where a thread waits for its DataLoader's workers: a frame of ``DATALOADER_FILE`` with only frames of these
(queues, locks, pipes) and frozen modules inside it. The agent reads it from live frames
(``site_profile.waits_for_loader``), the collector from a stack's text (``stuck.stack_waits_for_loader``)."""


@dataclass(frozen=True, slots=True)
class TorchWait:
    """Where a rank's main thread is blocked in torch's collective machinery."""

    place: str
    """``torch's backward pass``, ``torch.distributed (barrier)``, ..."""
    what: str
    """Which unrecorded collective usually blocks there."""
    advice: str | None = None
    """What to do about a rank still blocked there after its peers went on (None: find why the ranks'
    calls differ, the general advice)."""


STATE_BROADCAST_ADVICE = (
    "a rank still in DistributedDataParallel's state broadcast after its peers left it moved a different "
    "number of bytes than they did: the ranks' models differ in a parameter's or buffer's dtype, or in a "
    "buffer only some ranks have (torch's constructor compares only the parameters' shapes). Build the "
    "same model, in the same dtypes, on every rank"
)

RENDEZVOUS_PLACE = "init_process_group's rendezvous"
GROUP_CONSTRUCTION_PLACE = "a process group's construction"
RENDEZVOUS_ADVICE = (
    "start every rank of the job (WORLD_SIZE of them) with the same MASTER_ADDR and MASTER_PORT (or init_method), "
    "an address every host can reach: a rank that never started, died before init_process_group, or cannot reach "
    "that address holds every other rank in the rendezvous until the process group's timeout"
)

DDP_CONSTRUCTION_PLACE = "torch's DistributedDataParallel construction"
DDP_CONSTRUCTION_WHAT = (
    "torch's DistributedDataParallel constructor checks the parameters' shapes against every other rank's and "
    "broadcasts rank 0's parameters and buffers: it returns only once every rank of the group has reached its "
    "own DistributedDataParallel(...)"
)

_MACHINERY: tuple[tuple[re.Pattern[str], re.Pattern[str] | None, str, str, str | None], ...] = (
    (
        re.compile(r"(?:^|/)torch/distributed/utils\.py$"),
        re.compile(r"^_verify_param_shape_across_processes$"),
        DDP_CONSTRUCTION_PLACE + " ({function})",
        DDP_CONSTRUCTION_WHAT,
        None,
    ),
    (
        re.compile(r"(?:^|/)torch/distributed/utils\.py$"),
        re.compile(r"^_sync_params_and_buffers$|^_sync_module_states$"),
        "DistributedDataParallel's state broadcast (torch.distributed {function})",
        "the DistributedDataParallel constructor's broadcast of rank 0's parameters and buffers, in C++",
        STATE_BROADCAST_ADVICE,
    ),
    (
        re.compile(r"(?:^|/)torch/distributed/rendezvous\.py$"),
        None,
        RENDEZVOUS_PLACE + " (torch.distributed {function})",
        "init_process_group waits there until every rank of the job has reached the rendezvous store rank 0 "
        "hosts at MASTER_ADDR:MASTER_PORT (rank 0 until all have connected, the others until they get through "
        "to it)",
        RENDEZVOUS_ADVICE,
    ),
    (
        re.compile(r"(?:^|/)torch/autograd/(?:graph|__init__)\.py$"),
        None,
        "torch's backward pass",
        "torch's C++ Reducer waits there for the gradient all-reduce of a torch DistributedDataParallel "
        "model ddpscope does not observe (a second model, such as a GAN's discriminator, not passed to "
        "instrument())",
        None,
    ),
    (
        re.compile(r"(?:^|/)torch/nn/parallel/distributed\.py$"),
        None,
        "torch's DistributedDataParallel ({function})",
        "the buffer broadcast or bucket rebuild of a DistributedDataParallel model ddpscope does not observe",
        None,
    ),
    (
        re.compile(r"(?:^|/)torch/distributed/distributed_c10d\.py$"),
        re.compile(r"^_new_process_group_helper$|^_store_based_barrier$"),
        GROUP_CONSTRUCTION_PLACE + " (torch.distributed {function})",
        "the backend connects each rank of a new process group (init_process_group's, or new_group's) to "
        "every other there, and waits until all of them have come",
        "a rank still connecting after its peers left waits for a rank that died or never made this "
        "group, or the ranks disagree on its size (a WORLD_SIZE that differs between ranks): launch every "
        "rank with the same WORLD_SIZE, and make every rank create the same groups in the same order",
    ),
    (
        re.compile(r"(?:^|/)torch/distributed/(?:distributed_c10d|c10d_logger|utils)\.py$"),
        None,
        "torch.distributed ({function})",
        "most likely a DistributedDataParallel constructor's state broadcast, or a call through a name "
        "imported before ddpscope installed its recorder",
        None,
    ),
)
"""(innermost file, innermost function or any, where that is, what waits there, advice), first match
wins. Only calls that block on peers: not ``torch/distributed/checkpoint`` (file writes every rank makes
at once) nor data loading."""


def torch_wait(path: str, function: str) -> TorchWait | None:
    """The machinery a main thread whose innermost Python frame is ``function`` in ``path`` is blocked in,
    or None for any other frame."""
    path = path.replace("\\", "/")
    for pattern, functions, place, what, advice in _MACHINERY:
        if pattern.search(path) and (functions is None or functions.search(function)):
            return TorchWait(place.format(function=function), what, advice)
    return None
