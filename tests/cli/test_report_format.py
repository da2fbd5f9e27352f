"""How the terminal report lays out a hang's stacks."""

from __future__ import annotations

from ddpscope.cli.report import MEMORY_ROWS, _memory_section, _stack_tail


def test_a_hang_stack_shows_the_main_threads_innermost_frames_and_counts_the_other_threads() -> None:
    main = "\n".join(f'  File "/proj/train.py", line {n}, in f{n}' for n in range(20))
    stack = f'Thread MainThread:\n{main}\n\nThread loader:\n  File "/proj/data.py", line 3, in run'
    shown = _stack_tail(stack)
    assert shown[0] == "Thread MainThread (innermost frames)"
    assert shown[1:-1] == main.splitlines()[-8:] and "line 19" in shown[-2]
    assert shown[-1].startswith("... 1 other thread:") and not any("data.py" in s for s in shown)


def test_a_traceback_shows_its_last_lines() -> None:
    tb = (
        "Traceback (most recent call last):\n"
        + "\n".join(f"  line {n}" for n in range(12))
        + "\nValueError: x"
    )
    assert _stack_tail(tb) == tb.splitlines()[-8:]


def test_a_stack_whose_innermost_frames_are_all_library_code_is_led_by_the_users_call_site() -> None:
    user = '  File "/proj/train.py", line 42, in main\n    batch = next(it)'
    library = "\n".join(
        f'  File "/usr/lib/python3.11/multiprocessing/queues.py", line {n}, in get\n    res = self._recv()'
        for n in range(100, 110)
    )
    stack = f'Thread MainThread:\n{user}\n{library}\n\nThread loader:\n  File "/proj/data.py", line 3, in run'
    shown = _stack_tail(stack, call_site="/proj/train.py:42")
    assert shown[1:3] == user.splitlines()
    assert shown[3] == "  ... 7 frames inside libraries ..."
    assert shown[4:-1] == library.splitlines()[-6:] and len(shown) == 11
    # A call site already among the innermost frames changes nothing.
    assert _stack_tail(stack, call_site="/usr/lib/python3.11/multiprocessing/queues.py:109") == _stack_tail(
        stack
    )


def test_the_overlap_table_reads_step_times_of_synchronised_steps_only() -> None:
    from ddpscope.cli.report import _overlap_section

    synced = {"rank": 0, "synced": True, "step_s": 0.040, "comm_s": 0.025, "exposed_comm_s": 0.010}
    accumulating = {"rank": 0, "synced": False, "step_s": 0.014, "comm_s": 0.0, "exposed_comm_s": 0.0}
    steps = [{**synced, "overlap_ratio": 0.6}, *[{**accumulating, "overlap_ratio": None}] * 3]
    header, row, *rest = _overlap_section(steps)
    assert row.split()[:3] == ["0", "1", "40.0"]  # the one synced step, 40 ms
    assert rest[0] == "3 no_sync() step(s) (no all-reduce) are left out of the medians."


def test_exposed_communication_beside_a_straggler_is_blamed_on_it_not_on_the_bucket_size() -> None:
    from ddpscope.cli.report import _overlap_section

    # Rank 1 loads its batches slowly: rank 0 waits for it after its own backward, every step.
    fast = {"rank": 0, "synced": True, "step_s": 0.035, "comm_s": 0.031, "exposed_comm_s": 0.030}
    slow = {"rank": 1, "synced": True, "step_s": 0.005, "comm_s": 0.002, "exposed_comm_s": 0.001}
    steps = [{**fast, "overlap_ratio": 0.03}, {**slow, "overlap_ratio": 0.1}] * 4
    plain = _overlap_section(steps)[-1]
    assert "consider smaller buckets" in plain
    blamed = _overlap_section(steps, [1])[-1]
    assert "waiting for straggler rank 1 (see Stragglers)" in blamed, blamed
    assert "consider smaller buckets" not in blamed


def test_exposed_communication_with_buckets_already_small_does_not_advise_smaller_ones() -> None:
    from ddpscope.cli.report import _overlap_section

    step = {"rank": 0, "synced": True, "step_s": 0.010, "comm_s": 0.006, "exposed_comm_s": 0.005}
    verdict = _overlap_section([{**step, "overlap_ratio": 0.1}], [], [80] * 3000)[-1]
    assert "exposed comm 5.0 ms (50% of forward + backward)" in verdict, verdict
    assert "spread over 3000 small buckets (median 80 B)" in verdict, verdict
    assert "fewer, larger buckets (a larger bucket_cap_mb" in verdict, verdict  # a cap set far too small
    assert "consider smaller buckets" not in verdict
    few = _overlap_section([{**step, "overlap_ratio": 0.1}], [], [80] * 2)[-1]
    assert "the 2 buckets are already small (median 80 B)" in few and "larger" not in few
    big = _overlap_section([{**step, "overlap_ratio": 0.1}], [], [25 << 20])[-1]
    assert "consider smaller buckets" in big


def test_exposed_communication_of_one_bucket_beside_a_long_backward_advises_splitting_it() -> None:
    from ddpscope.cli.report import _overlap_section

    # 3,000 small parameters (258 KiB) in one bucket, a 60 ms backward, 4 ms of all-reduce after it.
    step = {"rank": 0, "synced": True, "step_s": 0.105, "backward_s": 0.060, "comm_s": 0.004,
            "exposed_comm_s": 0.004, "overlap_ratio": 0.0}  # fmt: skip
    verdict = _overlap_section([step], [], [258 << 10])[-1]
    assert "already small" not in verdict, verdict
    assert (
        "the gradients (258 KiB) fit in 1 bucket, whose all-reduce starts only once the backward" in verdict
    )
    assert "the backward (60.0 ms) is long enough to hide the communication (4.0 ms)" in verdict
    assert "a smaller bucket_cap_mb (about 0.063, four buckets)" in verdict
    # A backward too short to hide it: splitting would only add per-call cost.
    short = _overlap_section([{**step, "backward_s": 0.005}], [], [258 << 10])[-1]
    assert "already small" in short and "smaller bucket_cap_mb" not in short


# A real faulthandler dump of a rank gloo aborted (a size mismatch): the abort came from a gloo thread,
# so no thread is "Current" and the newest Python thread, ddpscope's watchdog, comes first.
ABORT_DUMP = """Fatal Python error: Aborted

Thread 0x00007fa8b880f6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 629 in wait
  File "/site-packages/ddpscope/ddp/watchdog.py", line 352 in _run
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Thread 0x00007fa8b90106c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/site-packages/ddpscope/agent/worker.py", line 117 in _run

Thread 0x00007fa8daa18b80 (most recent call first):
  File "/site-packages/ddpscope/ddp/_patch.py", line 255 in wait
  File "/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/site-packages/ddpscope/ddp/_patch.py", line 187 in wrapper
  File "/proj/train.py", line 20 in <module>

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)"""


def test_a_crash_dump_shows_the_thread_running_the_call_site_innermost_frame_last() -> None:
    shown = _stack_tail(ABORT_DUMP, call_site="/proj/train.py:20")
    assert shown[0] == "Thread 0x00007fa8daa18b80 (most recent call last) (innermost frames)"
    assert "train.py" in shown[1] and '_patch.py", line 255 in wait' in shown[-2]
    assert shown[-1] == "... 2 other threads: see the incidents API or the dashboard"
    # The call site as the collector names it, relative to the job's working directory, finds it too.
    assert _stack_tail(ABORT_DUMP, call_site="train.py:20") == shown


def test_a_crash_dump_without_a_call_site_shows_faulthandlers_current_thread() -> None:
    current = ABORT_DUMP.replace("Thread 0x00007fa8b90106c0", "Current thread 0x00007fa8b90106c0")
    shown = _stack_tail(current)
    assert shown[0] == "Current thread 0x00007fa8b90106c0 (most recent call last) (innermost frames)"
    assert "worker.py" in shown[-3] and 'threading.py", line 331 in wait' in shown[-2]


def test_the_memory_section_lists_growing_ranks_first_and_says_how_many_more_there_are() -> None:
    gib = 1 << 30
    ranks = [
        {
            "rank": r,
            "rss_bytes": gib + r,
            "available_bytes": 20 * gib,
            "total_bytes": 24 * gib,
            "growing": False,
        }
        for r in range(20)
    ]
    ranks[17].update(growing=True, growing_in="rank", bytes_per_min=100 * (1 << 20))
    ranks[3].update(growing=True, growing_in="workers", bytes_per_min=1 << 20, workers_bytes=3 * gib)
    lines = _memory_section(ranks)
    assert lines[1] == "== Memory (20 ranks)"
    assert any(line.split()[:2] == ["17", "1.0"] and line.endswith("+100.0 MiB/min") for line in lines), lines
    assert any(
        line.split()[:4] == ["3", "1.0", "GiB", "3.0"]
        and line.endswith("+1.0 MiB/min (its DataLoader workers)")
        for line in lines
    ), lines
    assert len(lines) == 3 + MEMORY_ROWS + 1 and lines[-1].startswith(
        "... 4 more ranks, none of them growing"
    )
    assert _memory_section([])[-1] == "no memory records (each rank sends one every 30 s, on Linux)"
