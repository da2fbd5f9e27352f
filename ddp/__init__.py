"""The training side of ddpscope: an instrumented DistributedDataParallel engine.

Usage (import it before ``torch.distributed.init_process_group``: monitoring then starts as soon as the
process group exists, see ``monitor.watch_init_process_group``)::

    from ddpscope.ddp import DistributedDataParallel as DDP
    model = DDP(model, find_unused_parameters=False)   # same signature as torch's common arguments
    loss = model(x).sum(); loss.backward()            # one 'step' record per backward via agent.emit()

    from ddpscope.ddp import instrument                # or keep torch's DDP and observe it
    model = instrument(torch.nn.parallel.DistributedDataParallel(model))

Every collective the engine issues is numbered by ``collectives.RECORDER``; ``progress.PROGRESS`` tells
the hang watchdog where this rank is. ``StepTimer`` (step_record.py) builds step records for any engine.
"""

from ddpscope.ddp import monitor
from ddpscope.ddp.adapter import instrument
from ddpscope.ddp.compile_skip import skip_ddpscope_in_compile
from ddpscope.ddp.engine import DistributedDataParallel
from ddpscope.ddp.groups import pg_name
from ddpscope.ddp.step_record import StepTimer

skip_ddpscope_in_compile()  # every training-side module is loaded by now (see compile_skip.py)
# Error hooks, recorder and watchdog from the moment the default group exists, not only from DDP's
# construction: a rank that fails, exits or waits before that is reported too.
monitor.watch_init_process_group()

__all__ = ["DistributedDataParallel", "StepTimer", "instrument", "pg_name"]
