"""ddpscope: debugging and observability for PyTorch DistributedDataParallel jobs.

Training side (stdlib + torch)::

    from ddpscope.ddp import DistributedDataParallel   # drop-in for torch's DDP, every bucket measured
    from ddpscope.ddp import instrument                # or keep torch's DDP and observe it

Collector side (``pip install ddpscope[server]``, no torch)::

    ddpscope serve --db sqlite:///ddpscope.db
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
