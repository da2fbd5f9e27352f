"""How the terminal report lays out a hang's stacks."""

from __future__ import annotations

from ddpscope.cli.report import _stack_tail


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
