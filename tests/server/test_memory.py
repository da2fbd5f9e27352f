"""A rank's memory: steady growth told from warm-up, and the OOM killer named (or ruled out) for a rank
that vanished, from ``memory`` records."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.memory import WORKERS, death_note, growth, memory_report
from tests.server.test_incidents import JobRecords, only, started

GiB, MiB = 2**30, 2**20
TOTAL = 24 * GiB


def sample(
    job: JobRecords, rank: int, t: float, rss: float, *, step: int = 0, available: float = 20 * GiB,
    limit: float | None = None, cgroup: float | None = None,
) -> None:  # fmt: skip
    extra = {} if limit is None else {"limit_bytes": int(limit), "cgroup_bytes": int(cgroup or 0)}
    job.add(
        "memory", rank, t, step=step, rss_bytes=int(rss), available_bytes=int(available), total_bytes=TOTAL,
        **extra,
    )  # fmt: skip


def samples(job: JobRecords, rank: int, t0: float, rss: Callable[[int], float], n: int = 20, dt: float = 30.0,
            **kw: float) -> float:  # fmt: skip
    """``n`` samples every ``dt`` s, the i-th of ``rss(i)`` bytes, 100 steps apart; returns the last time."""
    for i in range(n):
        sample(job, rank, t0 + i * dt, rss(i), step=100 * i, **kw)  # type: ignore[arg-type]
    return t0 + (n - 1) * dt


def test_memory_that_grows_at_a_steady_pace_is_a_leak_with_its_rate_per_minute_and_per_step() -> None:
    job = started(2)
    end = job.train(3)
    samples(job, 0, end, lambda i: 2 * GiB)  # flat
    last = samples(job, 1, end, lambda i: 2 * GiB + i * 50 * MiB)  # +50 MiB every 30 s, 100 steps
    job.heartbeat(0, last, step=1900)
    job.heartbeat(1, last, step=1900)
    m = only(diagnose(job.snapshot(), last + 1), "memory_growth")
    assert m.culprit_ranks == [1] and m.rank == 1 and m.active, m.message
    assert m.message.startswith("Rank 1's memory grew steadily from 2.0 GiB to 2.9 GiB in 10 min "), m.message
    assert "+100.0 MiB/min, 512.0 KiB a step" in m.message
    # 20 GiB available at 100 MiB/min: the host runs out in ~3.4 h.
    assert "The host's memory on node-1 had 20.0 GiB of 24.0 GiB left, which it fills in ~3.4 h" in m.message
    assert "loss.item()" in m.message


def test_a_resident_size_that_climbs_in_library_pages_is_no_leak_and_a_heap_that_climbs_is_named_as_one() -> (
    None
):
    # Under a busy host the rank's libraries were paged out and come back as it runs: its resident size
    # climbs 80 MiB while its anonymous memory (heap, tensors) stays flat.
    paged_in = [{"rank": 1, "time_ns": i * 10**9, "step": 20 * i, "rss_bytes": 180 * MiB + i * 4 * MiB,
                 "anon_bytes": 120 * MiB} for i in range(20)]  # fmt: skip
    assert growth(paged_in) is not None and growth(paged_in, "anon_bytes") is None
    job = started(2)
    end = job.train(3)
    for rec in paged_in:
        job.add("memory", 1, end + rec["time_ns"] / 1e9, step=rec["step"], rss_bytes=rec["rss_bytes"],
                anon_bytes=rec["anon_bytes"], available_bytes=20 * GiB, total_bytes=TOTAL)  # fmt: skip
    assert [i.kind for i in diagnose(job.snapshot(), end + 21) if i.kind == "memory_growth"] == []
    leaking = started(2)
    end = leaking.train(3)
    for i in range(20):
        leaking.add("memory", 1, end + i, step=20 * i, rss_bytes=300 * MiB + i * 12 * MiB,
                    anon_bytes=150 * MiB + i * 10 * MiB, available_bytes=20 * GiB, total_bytes=TOTAL)  # fmt: skip
    m = only(diagnose(leaking.snapshot(), end + 21), "memory_growth")
    assert m.message.startswith(
        "Rank 1's memory (its heap and tensors: not the libraries and files it maps) grew steadily from "
        "150.0 MiB to 340.0 MiB in 19 s"
    ), m.message


def test_a_workers_leak_is_named_though_the_ranks_own_memory_creeps_up_beside_it() -> None:
    # Under a loaded host rank 1's own memory climbed 76 MiB while its DataLoader worker kept 2 MiB a batch,
    # ten times as fast: the rank's creep was named and the workers' leak, the one that gets a worker
    # killed, was not looked at.
    job = started(2)
    end = job.train(3)
    for i in range(20):
        job.add("memory", 1, end + i * 0.5, step=10 * i, rss_bytes=300 * MiB + i * 4 * MiB,
                anon_bytes=150 * MiB + i * 4 * MiB, workers_bytes=20 * MiB + i * 20 * MiB, workers=1,
                available_bytes=20 * GiB, total_bytes=TOTAL)  # fmt: skip
    m = only(diagnose(job.snapshot(), end + 11), "memory_growth")
    assert m.message.startswith(
        "Rank 1's DataLoader workers' own memory (not shared with the rank; 1 of them) grew steadily from 20.0 MiB"
    ), m.message


def test_warm_up_that_flattens_noise_and_small_growth_are_not_leaks() -> None:
    warm_up = [{"rank": 0, "time_ns": i * 30 * 10**9, "step": i, "rss_bytes": int(4 * GiB * (1 - 0.5 ** (i / 2)))}
               for i in range(20)]  # fmt: skip
    noisy = [{"rank": 0, "time_ns": i * 30 * 10**9, "step": i, "rss_bytes": 3 * GiB + (i % 3) * 200 * MiB}
             for i in range(20)]  # fmt: skip
    small = [
        {"rank": 0, "time_ns": i * 30 * 10**9, "step": i, "rss_bytes": 3 * GiB + i * MiB} for i in range(20)
    ]
    few = [
        {"rank": 0, "time_ns": i * 30 * 10**9, "step": i, "rss_bytes": GiB + i * 100 * MiB} for i in range(5)
    ]
    assert [growth(s) for s in (warm_up, noisy, small, few)] == [None] * 4
    steady = [
        {"rank": 0, "time_ns": i * 30 * 10**9, "step": i, "rss_bytes": GiB + i * 100 * MiB} for i in range(8)
    ]
    found = growth(steady)
    assert found is not None and abs(found.bytes_per_s - 100 * MiB / 30) < 1


def test_a_killed_rank_whose_host_was_all_but_out_of_memory_is_put_down_to_the_oom_killer() -> None:
    job = started(2)
    end = job.train(5)
    samples(job, 1, end - 600, lambda i: 10 * GiB + i * 600 * MiB, available=512 * MiB)
    job.error(0, end + 0.03, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    crash = only(diagnose(job.snapshot(), end + 0.5), "rank_crashed")
    assert (
        "Its memory points at the kernel's OOM killer: rank 1 held 21.1 GiB and the host's memory had "
        in (crash.message)
    ), crash.message
    assert "512.0 MiB of 24.0 GiB left" in crash.message and "Killed process 1001" in crash.message


def test_a_rank_killed_between_samples_is_put_down_to_the_oom_killer_when_its_pace_fills_the_cgroup() -> None:
    """A Slurm job's cgroup of 16 GiB on a 24 GiB host: its limit, not the host, runs out. A blow-up (a gigabyte
    every 5 s), so only five samples, too few for a leak's test; the last came 25 s before the kill, with
    1 GiB left."""
    job = started(2)
    end = job.train(5)
    last = samples(job, 1, end - 25 - 4 * 5, lambda i: 11 * GiB + i * GiB, n=5, dt=5.0, limit=16 * GiB,
                   cgroup=15 * GiB)  # fmt: skip
    job.heartbeat(1, end, step=5)
    job.error(0, end + 0.03, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    crash = only(diagnose(job.snapshot(), end + 0.5), "rank_crashed")
    assert abs(last - (end - 25)) < 1e-6
    assert (
        "the memory cgroup's limit had 1.0 GiB of 16.0 GiB left (25 s before it went silent)" in crash.message
    )
    assert "grew +204.8 MiB/s, enough to fill it by then" in crash.message, crash.message
    # The same pace with 10 GiB left would have needed 50 s: not by then, and not named.
    job = started(2)
    end = job.train(5)
    samples(
        job, 1, end - 25 - 4 * 5, lambda i: 2 * GiB + i * GiB, n=5, dt=5.0, limit=16 * GiB, cgroup=6 * GiB
    )
    job.heartbeat(1, end, step=5)
    job.error(0, end + 0.03, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    assert "OOM killer:" not in only(diagnose(job.snapshot(), end + 0.5), "rank_crashed").message


def test_a_killed_rank_with_memory_to_spare_is_said_not_to_have_run_out() -> None:
    job = started(2)
    end = job.train(5)
    samples(job, 1, end - 60, lambda i: 2 * GiB, n=3)
    job.error(0, end + 0.03, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    crash = only(diagnose(job.snapshot(), end + 0.5), "rank_crashed")
    assert (
        "Not for lack of memory, as far as its last sample shows" in crash.message
        and "rank 1 held 2.0 GiB" in crash.message
    )


def test_a_rank_without_memory_records_gets_no_memory_note() -> None:
    job = started(2)
    assert death_note(job.snapshot(), 1, None) == ""


def test_a_job_that_went_quiet_whole_names_the_oom_killer_for_the_rank_whose_host_was_full() -> None:
    # The OOM killer took every rank at once (or the node went down): no rank fell quiet first.
    job = started(2)
    end = job.train(5)
    samples(job, 0, end - 600, lambda i: 2 * GiB, available=256 * MiB)
    samples(job, 1, end - 600, lambda i: 2 * GiB, available=256 * MiB)
    silent = only(diagnose(job.snapshot(), end + 600), "job_silent")
    assert "Rank 0: its memory points at the kernel's OOM killer: rank 0 held 2.0 GiB" in silent.message, (
        silent.message
    )


def test_a_failed_allocation_says_where_the_ranks_memory_and_its_hosts_stood() -> None:
    job = started(2)
    end = job.train(5)
    samples(job, 1, end - 300, lambda i: 3 * GiB + i * 500 * MiB, n=11, available=2 * GiB)
    job.error(1, end, "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes. "
              "Error code 12 (Cannot allocate memory)", step=5)  # fmt: skip
    err = only(diagnose(job.snapshot(), end + 0.5), "rank_error")
    assert "When last sampled, rank 1 held 7.9 GiB and the host's memory had 2.0 GiB of 24.0 GiB left " in (
        err.message
    ), err.message
    assert "(0 s before the error); the memory of the ranks on its host grew +1000.0 MiB/min." in err.message


def test_growth_paused_for_a_quarter_of_the_window_is_still_a_leak_but_not_once_it_stopped() -> None:
    def ramp(rss_mib: Callable[[int], int]) -> list[dict[str, int]]:
        return [
            {"rank": 0, "time_ns": i * 30 * 10**9, "step": i, "rss_bytes": GiB + rss_mib(i) * MiB}
            for i in range(20)
        ]

    paused = ramp(lambda i: 100 * min(i, 3) + 100 * max(0, i - 11))  # an evaluation from sample 3 to 11
    stopped = ramp(lambda i: 100 * min(i, 14))  # no growth in the last quarter: not leaking now
    assert growth(paused) is not None and growth(stopped) is None


def test_an_allocation_larger_than_the_host_is_said_to_be_a_size_computed_wrong() -> None:
    job = started(2)
    end = job.train(5)
    samples(job, 1, end - 60, lambda i: 300 * MiB, n=3)
    job.error(1, end, "DefaultCPUAllocator: can't allocate memory: you tried to allocate 51200000000000 bytes. "
              "Error code 12 (Cannot allocate memory)", step=5)  # fmt: skip
    err = only(diagnose(job.snapshot(), end + 0.5), "rank_error")
    assert (
        "The allocation alone asked for 46.6 TiB, more than the 24.0 GiB there are: a size computed wrong"
        in (err.message)
    ), err.message


def test_an_oom_kill_before_a_restart_stays_on_record_with_its_memory() -> None:
    job = started(2)
    end = job.train(5)
    samples(job, 1, end - 300, lambda i: 20 * GiB, n=11, available=256 * MiB)
    job.error(0, end + 0.03, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    for r in (0, 1):  # torchrun restarts both
        job.start(r, end + 10)
    job.train(3, t=end + 11)
    incidents = diagnose(job.snapshot(), end + 15)
    (before,) = [i for i in incidents if i.kind == "rank_crashed"]
    assert not before.active and before.message.startswith("Before the ranks restarted"), before
    assert "Its memory points at the kernel's OOM killer: rank 1 held 20.0 GiB" in before.message, (
        before.message
    )
    assert "says 'Out of memory: Killed process' and the rank's pid" in before.message


def test_an_oom_kill_that_ended_the_attempt_before_too_says_restarting_climbs_to_the_same_end() -> None:
    job = started(2)
    end = job.train(5)
    samples(job, 1, end - 300, lambda i: 20 * GiB, n=11, available=256 * MiB)
    job.error(0, end + 0.03, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    for r in (0, 1):
        job.start(r, end + 10)
    end2 = job.train(5, t=end + 11)
    samples(job, 1, end2 - 9, lambda i: 20 * GiB, n=10, dt=1.0, available=256 * MiB)  # after the restart
    job.error(0, end2 + 20.03, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    crashes = [i for i in diagnose(job.snapshot(), end2 + 20.5) if i.kind == "rank_crashed"]
    current = [i for i in crashes if i.active]
    assert (
        len(current) == 1 and "The OOM killer ended 1 earlier attempt of this job too" in current[0].message
    ), [i.message for i in crashes]


def test_a_leak_that_ran_to_the_end_of_the_job_is_named_though_memory_stayed_flat_while_the_rank_finished() -> (
    None
):
    # Rank 1 kept 100 MiB a step for 12 samples, then waited 12 more at its last step (a final flush, its peers).
    ramp = [{"rank": 1, "time_ns": i * 10**9, "step": min(i, 11) * 10, "rss_bytes": GiB + min(i, 11) * 100 * MiB}
            for i in range(24)]  # fmt: skip
    found = growth(ramp)
    assert found is not None and found.last["time_ns"] == 11 * 10**9


def test_a_leak_per_step_is_named_though_the_steps_slowed_down_in_the_second_half() -> None:
    # 2 MiB a step throughout; 30 steps per 30 s sample at first, then 8 (a busier host): per second the pace
    # falls to a quarter, per step it holds.
    samples, step, rss = [], 0, GiB
    for i in range(20):
        samples.append({"rank": 0, "time_ns": i * 30 * 10**9, "step": step, "rss_bytes": rss})
        moved = 30 if i < 10 else 8
        step, rss = step + moved, rss + moved * 2 * MiB
    found = growth(samples)
    assert found is not None and found.per_step is not None and abs(found.per_step - 2 * MiB) < 1


def test_the_memory_view_judges_growth_over_the_current_attempt_as_the_incident_does_but_charts_them_all() -> (
    None
):
    job = started(2)
    end = job.train(3)
    grew = samples(job, 1, end, lambda i: 2 * GiB + i * 50 * MiB)  # a leak until the restart
    for r in (0, 1):
        job.start(r, grew + 10)
    flat = samples(job, 1, grew + 11, lambda i: 2 * GiB, n=10)  # the restarted process holds steady
    memory = [r for r in job.records if r["kind"] == "memory"]
    starts = [r for r in job.records if r["kind"] == "rank_start"]
    (rank1,) = memory_report(memory, starts)
    assert not rank1.growing and rank1.bytes_per_min is None, rank1
    assert len(rank1.samples) == 30 and rank1.host == "node-1"
    assert not [i for i in diagnose(job.snapshot(), flat + 1) if i.kind == "memory_growth" and i.active]
    # The same climb in the current attempt is growth in both.
    samples(job, 0, flat + 1, lambda i: 2 * GiB + i * 50 * MiB)
    memory = [r for r in job.records if r["kind"] == "memory"]
    assert [m.growing for m in memory_report(memory, starts)] == [True, False]


def test_memory_the_dataloader_workers_keep_is_a_leak_of_the_rank_named_as_its_workers() -> None:
    job = started(2)
    end = job.train(3)
    for i in range(20):  # rank 1 flat at 2 GiB; its 4 workers' own memory +40 MiB every 30 s
        t = end + 30 * i
        job.add("memory", 1, t, step=100 * i, rss_bytes=2 * GiB, available_bytes=20 * GiB - i * 40 * MiB,
                total_bytes=TOTAL, workers_bytes=400 * MiB + i * 40 * MiB, workers=4)  # fmt: skip
        sample(job, 0, t, 2 * GiB, step=100 * i)
    m = only(diagnose(job.snapshot(), t + 1), "memory_growth")
    assert m.culprit_ranks == [1], m.message
    assert m.message.startswith(
        "Rank 1's DataLoader workers' own memory (not shared with the rank; 4 of them) grew steadily from "
        "400.0 MiB to 1.1 GiB in 10 min (+80.0 MiB/min, 409.6 KiB a step)"
    ), m.message
    assert "copy-on-read" in m.message and "loss.item()" not in m.message
    memory = [r for r in job.records if r["kind"] == "memory"]
    starts = [r for r in job.records if r["kind"] == "rank_start"]
    rank0, rank1 = memory_report(memory, starts)
    assert (rank0.growing_in, rank0.workers_bytes) == (None, None)
    assert (rank1.growing_in, rank1.workers_bytes) == ("workers", 400 * MiB + 19 * 40 * MiB)
    assert rank1.samples[-1][4] == rank1.workers_bytes and rank0.samples[-1][4] == 0


def test_a_rank_killed_while_its_workers_filled_the_cgroup_is_put_down_to_the_oom_killer_with_them() -> None:
    """The rank itself flat at 3 GiB; its 2 workers' own memory a gigabyte more every 5 s in a 16 GiB cgroup."""
    job = started(2)
    end = job.train(5)
    for i in range(5):
        job.add("memory", 1, end - 45 + 5 * i, step=5, rss_bytes=3 * GiB, available_bytes=20 * GiB,
                total_bytes=TOTAL, limit_bytes=16 * GiB, cgroup_bytes=(11 + i) * GiB, workers_bytes=(8 + i) * GiB,
                workers=2)  # fmt: skip
    job.error(0, end + 0.03, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    crash = only(diagnose(job.snapshot(), end + 0.5), "rank_crashed")
    assert (
        "rank 1 held 3.0 GiB (and its 2 DataLoader workers 12.0 GiB of their own) and the memory cgroup's limit "
        "had 1.0 GiB of 16.0 GiB left (25 s before it went silent)" in crash.message
    ), crash.message
    assert "grew +204.8 MiB/s, enough to fill it by then" in crash.message, crash.message


def test_workers_are_judged_over_their_latest_lifetime_so_their_end_neither_hides_nor_fakes_a_leak() -> None:
    def run(workers_mib: Callable[[int], int]) -> list[dict[str, Any]]:
        return [{"rank": 1, "time_ns": i * 10**9, "step": 10 * i, "rss_bytes": GiB,
                 "workers_bytes": workers_mib(i) * MiB, "workers": 1 if workers_mib(i) else 0}
                for i in range(30)]  # fmt: skip

    # A worker that kept 30 MiB a step until the rank's loop ended it (the last two samples: no worker).
    assert growth(run(lambda i: 0 if i >= 28 else 10 + 30 * i), WORKERS) is not None
    # Workers of an epoch each that climb and end with it: only the latest epoch's are judged (5 samples).
    assert growth(run(lambda i: 0 if i % 6 == 5 else 10 + 30 * (i % 6)), WORKERS) is None


def test_a_leak_is_named_though_the_ranks_teardown_freed_it_before_the_last_sample() -> None:
    job = started(2)
    end = job.train(3)
    last = samples(job, 1, end, lambda i: 2 * GiB + i * 50 * MiB, n=12)
    job.exit(1, last + 1, step=1150)
    sample(job, 1, last + 1.5, GiB, step=1150)  # after its last steps and its loop: what it kept is freed
    (m,) = [i for i in diagnose(job.snapshot(), last + 2) if i.kind == "memory_growth"]
    assert m.culprit_ranks == [1] and "grew steadily from 2.0 GiB to 2.5 GiB" in m.message, m.message
    records = [r for r in job.records if r["kind"] in ("memory", "rank_start", "rank_exit")]
    (rank1,) = memory_report(
        *[[r for r in records if r["kind"] == k] for k in ("memory", "rank_start", "rank_exit")]
    )
    assert rank1.growing and rank1.rss_bytes == GiB  # judged before the exit; its latest sample shown


def test_a_dataloader_worker_killed_by_the_oom_killer_says_how_much_the_ranks_workers_held() -> None:
    job = started(2)
    end = job.train(5)
    job.add("memory", 1, end - 2, step=5, rss_bytes=3 * GiB, available_bytes=300 * MiB, total_bytes=TOTAL,
            workers_bytes=18 * GiB, workers=4)  # fmt: skip
    job.error(1, end, "DataLoader worker (pid 29820) is killed by signal: Killed. ", step=5)
    err = only([i for i in diagnose(job.snapshot(), end + 0.5) if i.rank == 1], "rank_error")
    assert "rank 1 held 3.0 GiB (and its 4 DataLoader workers 18.0 GiB of their own) and the host's memory had " \
        "300.0 MiB of 24.0 GiB left" in err.message, err.message  # fmt: skip


def test_a_steady_climb_after_a_warm_up_jump_is_a_leak() -> None:
    """A real job's DataLoader workers reading a Python list of 3 M dicts (copy-on-read), as it sent them
    (step, MiB of the workers' own): their start's jump to 168 MiB, then ~8 MiB every 60 steps to the end."""
    real = [(50, 28.4), (106, 168.3), (166, 176.2), (236, 185.6), (297, 193.1), (357, 200.9), (428, 210.5),
            (486, 218.0), (547, 225.6), (619, 235.0), (679, 242.8), (738, 250.7), (809, 259.6), (869, 267.4),
            (929, 275.3), (999, 284.2), (1059, 292.0), (1119, 299.9), (1189, 308.8), (1251, 316.8), (1312, 325.0),
            (1381, 333.7)]  # fmt: skip
    samples = [{"rank": 0, "time_ns": i * 2 * 10**9, "step": step, "rss_bytes": GiB, "workers_bytes": int(mib * MiB),
                "workers": 2} for i, (step, mib) in enumerate(real)]  # fmt: skip
    found = growth(samples, WORKERS)
    assert found is not None and 0.12 * MiB < found.per_step < 0.15 * MiB, found  # type: ignore[operator]


def test_samples_a_busy_host_sent_within_a_jobs_first_steps_are_too_short_to_call_a_leak() -> None:
    # Other processes' memory rising sends a sample at every heartbeat: twelve in 6 s over three steps of a
    # rank's warm-up (its model, optimizer state, gloo's buffers) growing 10 MiB each. Over twelve steps, or
    # a minute, the same climb is judged.
    def samples(step_of: Callable[[int], int], dt_s: float) -> list[dict[str, Any]]:
        return [{"rank": 0, "time_ns": int(i * dt_s * 1e9), "step": step_of(i), "rss_bytes": GiB + i * 10 * MiB}
                for i in range(12)]  # fmt: skip

    assert growth(samples(lambda i: i // 4, 0.5)) is None
    assert growth(samples(lambda i: i, 0.5)) is not None  # a step a sample: a leak of 10 MiB a step
    assert growth(samples(lambda i: i // 4, 8.0)) is not None  # a minute and more
