"""Errors in training become rank_error records: reported, captured, and from uncaught exceptions."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpscope.agent.records import validate_record
from ddpscope.ddp import errors
from ddpscope.ddp.progress import PROGRESS
from tests.ddp.watchdog_support import in_memory_records

JOBS = Path(__file__).parent / "failure_jobs"
Records = Callable[..., list[dict[str, Any]]]


@pytest.fixture
def records() -> Iterator[Records]:
    saved = (PROGRESS.phase, PROGRESS.step)
    yield from in_memory_records(rank=2)
    PROGRESS.phase, PROGRESS.step = saved


def fail_deep(message: str) -> None:
    raise RuntimeError(message)


def test_report_error_emits_step_phase_type_message_and_stack(records: Records) -> None:
    PROGRESS.enter("optimizer", step=41)
    try:
        fail_deep("Expected to have finished reduction in the prior iteration")
    except RuntimeError as exc:
        assert errors.report_error(exc) is True
    (err,) = records("rank_error")
    assert (err["step"], err["phase"], err["error_type"], err["fatal"]) == (
        41,
        "optimizer",
        "RuntimeError",
        False,
    )
    assert err["message"] == "Expected to have finished reduction in the prior iteration"
    assert "fail_deep" in err["stack"] and err["stack"].rstrip().endswith("prior iteration")


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no text")


def test_an_exception_whose_str_raises_is_still_reported_by_type_and_stack(records: Records) -> None:
    # It was lost: report_error died on str(exc) and logged "could not report an error".
    try:
        raise _Unprintable()
    except _Unprintable as exc:
        assert errors.report_error(exc) is True
    (err,) = records("rank_error")
    assert err["error_type"] == "_Unprintable"
    assert err["message"] == "<exception str() failed: ValueError>"
    assert "raise _Unprintable()" in err["stack"]


def test_the_same_exception_is_reported_once_per_fatality(records: Records) -> None:
    exc = ValueError("x")
    assert errors.report_error(exc) is True
    assert errors.report_error(exc) is False
    assert errors.report_error(exc, fatal=True) is True
    assert [e["fatal"] for e in records("rank_error")] == [False, True]


def test_capture_errors_reports_and_lets_the_exception_propagate(records: Records) -> None:
    with pytest.raises(KeyError), errors.capture_errors():
        PROGRESS.enter("forward", step=3)
        raise KeyError("batch")

    @errors.capture_errors(fatal=False)
    def step() -> None:
        fail_deep("in a decorated function")

    with pytest.raises(RuntimeError):
        step()
    with pytest.raises(SystemExit), errors.capture_errors():
        raise SystemExit(0)  # leaving on purpose is not an error
    reported = records("rank_error")
    assert [(e["error_type"], e["fatal"], e["step"]) for e in reported] == [
        ("KeyError", True, 3),
        ("RuntimeError", False, 3),
    ]


def test_an_uncaught_exception_in_a_thread_becomes_a_non_fatal_rank_error_naming_the_thread(
    records: Records,
) -> None:
    seen: list[str] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: seen.append(args.thread.name if args.thread else "")
    try:
        with errors.error_hooks():
            thread = threading.Thread(target=fail_deep, args=("loader died",), name="loader")
            thread.start()
            thread.join()
    finally:
        threading.excepthook = previous
    (err,) = records("rank_error")
    assert (err["message"], err["fatal"], err["thread"]) == ("loader died", False, "loader")
    assert seen == ["loader"]  # the previous hook still ran


def test_install_is_idempotent_and_uninstall_restores_the_hooks() -> None:
    before = (sys.excepthook, threading.excepthook, sys.exit)
    errors.install_error_hooks()
    errors.install_error_hooks()
    assert sys.excepthook is not before[0] and sys.exit is not before[2]
    errors.uninstall_error_hooks()
    assert (sys.excepthook, threading.excepthook, sys.exit) == before


def test_the_wrapped_sys_exit_raises_the_same_system_exit() -> None:
    with errors.error_hooks():
        for status in (None, 0, 3, "bye"):
            with pytest.raises(SystemExit) as caught:
                sys.exit(status)
            assert caught.value.code == status
    errors._exit_call.clear()


def _run_uncaught(tmp_path: Path, how: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    proc = subprocess.run(
        [sys.executable, str(JOBS / "uncaught_job.py"), str(tmp_path), how],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "RANK": "0"},
    )
    lines = (tmp_path / "rank0.jsonl").read_text().splitlines()
    return proc, [json.loads(line) for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "code", "message"),
    [
        ("exit-code", 3, "sys.exit(3): exit status 3"),
        ("exit-message", 1, "loss is nan at step 7, aborting (sys.exit with this message): exit status 1"),
    ],
)
def test_a_failing_sys_exit_is_a_fatal_error_with_its_step_phase_and_line_not_a_clean_exit(
    tmp_path: Path, how: str, code: int, message: str
) -> None:
    proc, records = _run_uncaught(tmp_path, how)
    assert proc.returncode == code, proc.stderr
    (err,) = [r for r in records if r["kind"] == "rank_error"]
    validate_record(err)
    assert (err["step"], err["phase"], err["error_type"], err["fatal"]) == (7, "backward", "SystemExit", True)
    assert err["message"] == message
    assert "uncaught_job.py" in err["stack"] and "in train" in err["stack"]
    (exit_,) = [r for r in records if r["kind"] == "rank_exit"]
    assert exit_["reason"] == "error"


@pytest.mark.slow
def test_a_sys_exit_caught_by_the_script_is_not_reported(tmp_path: Path) -> None:
    proc, records = _run_uncaught(tmp_path, "exit-caught")
    assert proc.returncode == 0, proc.stderr
    assert [r for r in records if r["kind"] == "rank_error"] == []
    assert [r["reason"] for r in records if r["kind"] == "rank_exit"] == ["finished"]


@pytest.mark.slow
def test_a_keyboard_interrupt_is_a_stop_from_outside_not_an_error_nor_a_normal_finish(tmp_path: Path) -> None:
    proc, records = _run_uncaught(tmp_path, "interrupt")
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr
    assert [r for r in records if r["kind"] == "rank_error"] == []
    assert [r["reason"] for r in records if r["kind"] == "rank_exit"] == ["sigint"]


@pytest.mark.slow
def test_an_uncaught_exception_reaches_the_records_before_the_process_exits(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(JOBS / "uncaught_job.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "RANK": "0"},
    )
    assert proc.returncode == 1, proc.stderr
    assert "FloatingPointError: loss is nan at step 7" in proc.stderr  # the usual traceback still prints
    lines = (tmp_path / "rank0.jsonl").read_text().splitlines()
    (err,) = [r for r in map(json.loads, lines) if r["kind"] == "rank_error"]
    validate_record(err)
    assert (err["step"], err["phase"], err["error_type"], err["fatal"]) == (
        7,
        "backward",
        "FloatingPointError",
        True,
    )
    assert "uncaught_job.py" in err["stack"] and "in train" in err["stack"]


def test_a_long_message_keeps_its_head_and_its_last_line(records: Records) -> None:
    # torch re-raises a DataLoader worker's exception with the worker's whole traceback in the message:
    # its last line says what went wrong.
    message = (
        "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
    )
    message += '  File "worker.py", line 1, in fetch\n' * 300 + "ValueError: corrupt record 27 in shard-1.bin"
    errors.report_error(ValueError(message))
    (reported,) = records("rank_error")
    assert len(reported["message"]) <= errors.MAX_MESSAGE_CHARS
    assert reported["message"].startswith("Caught ValueError in DataLoader worker process 0.")
    assert reported["message"].endswith("ValueError: corrupt record 27 in shard-1.bin")
