"""How ``make test`` splits the suite into streams that run side by side on this 2-core machine.

Run one after another, the tests keep the machine only ~60 % busy: many of them wait on a hang timeout, a
collector restart, a backoff or a stopped process. ``tests/run_suite.py`` runs two streams at once and then
a third alone:

- **light**: every test not marked ``slow`` or ``browser``; the slow modules in ``IDLE_BOUND_MODULES``,
  whose processes sleep, block or are stopped most of the time (measured with each test's CPU over its wall
  time, under 0.8 core); and those in ``TIMING_FREE_MODULES``, busy but judged on results no load changes
  (bit-identical parameters, a record that arrives, a settings comparison), which even out the two streams;
- **heavy**: every other test: real multi-rank training jobs, the browser;
- **solo**: modules that start many ranks at once, or whose verdict rests on timing between the ranks of
  jobs that run at once (``SOLO_MODULES``), alone after both streams: a straggler must be the slow rank, not
  a busy machine, and nothing else should have to start beside 24 training ranks.

A new module is heavy unless it is listed here or carries none of those marks: the cautious default.
``pytest`` run directly runs every test in one process, as before; ``DDPSCOPE_TEST_STREAM`` selects one
stream (``tests/conftest.py``).
"""

from __future__ import annotations

from typing import Literal

Stream = Literal["light", "heavy", "solo"]
STREAMS: tuple[Stream, ...] = ("light", "heavy", "solo")
ENV = "DDPSCOPE_TEST_STREAM"

IDLE_BOUND_MODULES = frozenset(
    {
        "tests/reliability/test_collector_kills.py",  # collector restarts and backlogs: 0.59 core
        "tests/deploy/test_prometheus_e2e.py",  # Prometheus' scrape and rule intervals: 0.30
        "tests/reliability/test_network_faults.py",  # a proxy's faults and the agent's backoff: 0.15
        "tests/reliability/test_spool.py",  # outages the spool rides out: 0.41
        "tests/reliability/test_hostile_strings.py",  # 0.65
        "tests/reliability/test_training_kill.py",  # a SIGKILLed rank's spool delivered: 0.77
    }
)
"""Slow modules that mostly wait (CPU over wall time in one full run, in cores: comments)."""

TIMING_FREE_MODULES = frozenset(
    {
        "tests/test_packaging.py",  # a wheel built and installed
        "tests/ddp/test_errors_hooks.py",  # exceptions and exits become records
        "tests/ddp/test_abort_durability.py",  # a record that survives gloo's abort
        "tests/ddp/test_engine_parity.py",  # bit-identical to torch's DDP
        "tests/cli/test_examples.py",  # the examples train to the end under torchrun
        "tests/server/test_settings_differ_jobs.py",  # ranks started with other settings
        "tests/server/test_job_ids_differ_jobs.py",  # ranks started with another job id
    }
)
"""Slow modules that keep the CPU busy, on verdicts that do not depend on how busy the machine is.
``tests/reliability/test_fuzz_api.py`` (~90 s) was one and runs heavy now: on a machine 1.5 times slower than
the one these lists were measured on (pass 47), the light stream took 668-744 s against the heavy one's
497-555 s, and it alone decided when the solo stream could start."""

SOLO_MODULES = frozenset(
    {
        "tests/server/test_real_jobs.py",  # straggler verdicts from 4-rank jobs
        "tests/server/test_incidents_jobs.py",  # 24 ranks at once: 1.8 cores for 150 s
        "tests/server/test_nonfinite_jobs.py",  # 12 ranks at once
        # Each failed once beside the light stream (a run after pass 35's review): the all-reduce span held
        # to torch's sampled timings within 3 ms, a wait said within 6 s, a peer's report placed in time.
        "tests/ddp/test_adapter_jobs.py",
        "tests/ddp/test_before_ddp_jobs.py",
        "tests/server/test_plain_ddp_hang_jobs.py",
    }
)
"""Modules that fill the machine by themselves, or whose verdicts compare the ranks of jobs running at once:
run with nothing else on the machine. Beside 24 training ranks, a collector of the light stream once took over
30 s to answer its first request."""

_UNMARKED_HEAVY = ("slow", "browser")


def stream_of(path: str, marks: set[str]) -> Stream:
    """The stream of a test in module ``path`` (relative to the repository) with marks ``marks``."""
    if path in SOLO_MODULES:
        return "solo"
    if path in IDLE_BOUND_MODULES or path in TIMING_FREE_MODULES or not marks.intersection(_UNMARKED_HEAVY):
        return "light"
    return "heavy"
