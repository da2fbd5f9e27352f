"""Stalls now and then: a rank that holds the others up in a few steps, not in most (synthetic steps)."""

from __future__ import annotations

import random
from collections.abc import Callable

from ddpscope.server.analysis.profile_sites import SampledSite, with_profiled
from ddpscope.server.analysis.stalls import intermittent_stalls
from ddpscope.server.analysis.stragglers import stragglers
from ddpscope.server.rows import StepRow

MS = 1_000_000


def _steps(
    world: int = 4, steps: int = 60, extra_ms: Callable[[int, int], int] = lambda rank, step: 0, seed: int = 5
) -> list[StepRow]:
    """Lock-step steps of ~40 ms; ``extra_ms(rank, step)`` delays that rank's forward (host work before it):
    the others then wait in the all-reduce, as they do in a real job."""
    rng = random.Random(seed)
    rows, end = [], 0
    for step in range(steps):
        starts = {r: end + rng.randint(2, 4) + extra_ms(r, step) for r in range(world)}
        last_ready = max(starts.values()) + 30
        comm_end = last_ready + 8
        for r, fs in starts.items():
            ready = [(fs + 20) * MS, (fs + 30) * MS]
            ends = [(max(fs + 20, last_ready - 10) + 8) * MS, comm_end * MS]
            rows.append(
                StepRow(
                    r, step, True, fs * MS, (fs + 10) * MS, (fs + 10) * MS, (comm_end + 1) * MS,
                    ready, list(ready), ends, [100, 100], [0, 1], [0, 1],
                )
            )  # fmt: skip
        end = comm_end + 1
    return rows


def test_a_rank_whose_data_read_stalls_every_tenth_batch_is_named_with_the_interval_and_the_phase() -> None:
    rows = _steps(extra_ms=lambda rank, step: 300 if rank == 1 and step % 10 == 5 else 0)
    assert [s.rank for s in stragglers(rows) if s.flagged] == []  # its median step is everyone's
    (stall,) = intermittent_stalls(rows)
    assert (stall.rank, stall.every, stall.stalls, stall.phase) == (1, 10, 6, "between_steps")
    assert 0.29 < stall.median_excess_s < 0.31 and stall.share > 0.3
    assert stall.sentence().startswith("rank 1 stalls every 10 steps (6 times, 30")
    assert "ms longer than the others each time, typically), between steps" in stall.sentence()


def test_stalls_at_no_fixed_interval_are_counted_instead() -> None:
    late = {7, 19, 23, 41, 50}
    (stall,) = intermittent_stalls(
        _steps(extra_ms=lambda rank, step: 200 if rank == 2 and step in late else 0)
    )
    assert stall.every is None and "in 5 of 58 steps" in stall.sentence()


def test_a_loaded_host_where_every_rank_loses_the_cpu_now_and_then_names_nobody() -> None:
    rng = random.Random(11)
    hiccups = {(rng.randrange(4), rng.randrange(2, 60)) for _ in range(16)}
    rows = _steps(extra_ms=lambda rank, step: 80 if (rank, step) in hiccups else 0)
    assert intermittent_stalls(rows) == []


def test_short_or_rare_stalls_and_a_steady_straggler_are_not_stalls() -> None:
    assert intermittent_stalls(_steps(extra_ms=lambda r, s: 30 if r == 1 and s % 10 == 5 else 0)) == []
    assert intermittent_stalls(_steps(extra_ms=lambda r, s: 300 if r == 1 and s in (10, 40) else 0)) == []
    steady = _steps(extra_ms=lambda r, s: 50 if r == 3 else 0)
    assert [s.rank for s in stragglers(steady) if s.flagged] == [3] and intermittent_stalls(steady) == []


def _sample(rank: int, step: int, phase: str, stalled_s: float, site: str | None, cpu: float | None) -> dict:
    stack = (
        f'  File "/proj/train.py", line 40, in <module>\n    save(model)\n  File "/proj/{site}", in save\n'
    )
    return {"kind": "stall_sample", "rank": rank, "step": step, "phase": phase, "stalled_s": stalled_s,
            "site": site, "stack": stack, "main_cpu_s": cpu}  # fmt: skip


def test_the_stalls_samples_name_the_line_the_rank_spent_them_on_and_whether_it_was_blocked() -> None:
    rows = _steps(extra_ms=lambda rank, step: 300 if rank == 1 and step % 10 == 5 else 0)
    samples = [
        # Idle after step 14: the stall of step 15, between steps. Two samples at the checkpoint's line,
        # one a moment later in the data read.
        _sample(1, 14, "idle", 0.5, "ckpt.py:7", 0.01),
        _sample(1, 14, "idle", 1.0, "ckpt.py:7", 0.02),
        _sample(1, 24, "idle", 0.5, "ckpt.py:7", 0.01),
        _sample(1, 44, "idle", 0.5, "data.py:3", 0.01),
        _sample(1, 30, "idle", 0.5, "train.py:9", 0.5),  # step 31 was no stall: not counted
        _sample(2, 14, "idle", 0.5, "other.py:1", 0.5),  # another rank's
    ]
    (stall,) = intermittent_stalls(rows, samples=samples)
    site = stall.sampled
    assert site is not None
    assert (site.site, site.samples, site.of, site.stalls, site.blocked) == ("ckpt.py:7", 3, 4, 3, True)
    assert "ckpt.py" in site.stack
    assert (
        "Sampled 0.5 s and more into 3 of those stalls, its main thread was at ckpt.py:7 in 3 of 4 samples, "
        "blocked (I/O, a lock, a sleep or a queue): look at that line" in stall.sentence()
    )


def test_a_stall_sampled_busy_in_its_forward_says_so_and_one_never_sampled_says_what_to_look_at() -> None:
    rows = _steps(extra_ms=lambda rank, step: 300 if rank == 1 and step % 10 == 5 else 0)
    busy = [_sample(1, 15, "forward", 0.5, "model.py:20", 0.45)]
    (stall,) = intermittent_stalls(rows, samples=busy)
    assert stall.sampled is not None and stall.sampled.blocked is False
    assert "its main thread was at model.py:20 in 1 of 1 samples, busy on the CPU" in stall.sentence()
    assert "that stall" in stall.sentence()
    (unsampled,) = intermittent_stalls(rows)
    assert unsampled.sampled is None and "Look at what that rank does then" in unsampled.sentence()


def test_a_stall_spent_waiting_for_the_dataloaders_workers_says_the_time_goes_in_the_workers() -> None:
    rows = _steps(extra_ms=lambda rank, step: 300 if rank == 1 and step % 10 == 5 else 0)
    torch = "/venv/lib/python3.11/site-packages/torch/utils/data"
    stack = (
        '  File "/proj/train.py", line 16, in <module>\n    for step, x in enumerate(loader):\n'
        f'  File "{torch}/dataloader.py", line 733, in __next__\n    data = self._next_data()\n'
        f'  File "{torch}/dataloader.py", line 1479, in _next_data\n    idx, data = self._get_data()\n'
        '  File "/usr/lib/python3.11/multiprocessing/queues.py", line 113, in get\n    if not self._poll(timeout):\n'
        '  File "/usr/lib/python3.11/selectors.py", line 415, in select\n    fd_event_list = self._selector.poll(t)\n'
    )
    slow_read = {"syscall": "read", "on": [{"fd": 7, "kind": "file", "name": "/mnt/nfs/shard-3.bin"}]}
    workers = [{"pid": 4242, "blocked_call": slow_read}]
    samples = [{**_sample(1, s, "idle", 0.5, "train.py:16", 0.0), "stack": stack} for s in (14, 24)]
    samples[-1]["loader_workers"] = workers  # the latest sample at the line says what the workers did
    (stall,) = intermittent_stalls(rows, samples=samples)
    assert stall.sampled is not None and stall.sampled.loader
    assert "(its workers: worker 4242 waiting on the file /mnt/nfs/shard-3.bin (read)" in stall.sentence()
    assert (
        "its main thread was at train.py:16, waiting for its DataLoader's workers to deliver the next batch, in 2 "
        "of 2 samples, blocked (I/O, a lock, a sleep or a queue) (its workers: "
        in stall.sentence()
        and "a lock another process holds): the time goes in the workers, in the Dataset's __getitem__ or "
        "collate_fn"
        in stall.sentence()
    ), stall.sentence()


def test_a_stall_sampled_blocked_in_a_read_names_the_file_it_waited_on() -> None:
    rows = _steps(extra_ms=lambda rank, step: 300 if rank == 1 and step % 10 == 5 else 0)
    nfs = {"syscall": "read", "on": [{"fd": 7, "kind": "file", "name": "/mnt/nfs/shard-17.bin"}]}
    samples = [{**_sample(1, s, "idle", 0.5, "data.py:3", 0.01), "blocked_call": nfs} for s in (14, 24)]
    (stall,) = intermittent_stalls(rows, samples=samples)
    assert stall.sampled is not None and stall.sampled.waits_on is not None
    assert (
        "its main thread was at data.py:3 in 2 of 2 samples, blocked, waiting on the file /mnt/nfs/shard-17.bin "
        "(read): a slow or unresponsive file system (a network mount)" in stall.sentence()
    ), stall.sentence()


def test_a_stall_sampled_on_the_thread_a_rank_trains_on_names_that_thread() -> None:
    rows = _steps(extra_ms=lambda rank, step: 300 if rank == 1 and step % 10 == 5 else 0)
    on_trainer = [{**_sample(1, 14, "idle", 0.5, "ckpt.py:7", 0.01), "thread": "trainer"}]
    (stall,) = intermittent_stalls(rows, samples=on_trainer)
    assert stall.sampled is not None and stall.sampled.thread == "trainer"
    assert "its training thread 'trainer' was at ckpt.py:7 in 1 of 1 samples" in stall.sentence()


def test_stalls_no_stall_sample_caught_are_placed_by_the_watchdogs_samples_of_the_whole_phase() -> None:
    # Three DataLoader workers, one with slow reads: every third batch comes 60 ms late, too short for a stall
    # sample; the site_profile records still saw the loop waiting for the workers between steps.
    rows = _steps(extra_ms=lambda rank, step: 60 if rank == 1 and step % 3 == 0 else 0)
    (stall,) = intermittent_stalls(rows)
    assert stall.sampled is None
    profile = {"kind": "site_profile", "rank": 1, "sites": [
        {"phase": "idle", "site": "train.py:16", "n": 19, "loader": True}, {"phase": "forward", "site": "m.py:3", "n": 1},
    ]}  # fmt: skip
    (placed,) = with_profiled([stall], [profile])
    assert placed.profiled == SampledSite("train.py:16", 19, 19, loader=True)
    assert (
        "Its watchdog's samples of all its time between steps (its stalls and its other steps alike) place it at "
        "train.py:16, waiting for its DataLoader's workers to deliver the next batch, in 19 of 19: the time goes "
        "in the workers" in placed.sentence()
    ), placed.sentence()
