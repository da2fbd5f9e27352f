"""Telling a call made from inside a Python signal handler, by the handlers' code on the stack."""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest

from ddpscope.agent import lifecycle
from ddpscope.ddp.signal_handlers import handling_signal


@pytest.fixture
def usr1() -> Iterator[Callable[[Any], None]]:
    """Install a SIGUSR1 handler, deliver the signal, restore the old handler."""
    previous = signal.getsignal(signal.SIGUSR1)

    def deliver(handler: Any) -> None:
        signal.signal(signal.SIGUSR1, handler)
        os.kill(os.getpid(), signal.SIGUSR1)  # Python runs the handler at the next bytecode, here

    yield deliver
    signal.signal(signal.SIGUSR1, previous)


def test_no_signal_is_named_outside_a_handler(usr1: Callable[[Any], None]) -> None:
    signal.signal(signal.SIGUSR1, lambda s, f: None)
    assert handling_signal() is None


def test_a_call_from_a_handler_and_from_a_helper_it_calls_names_the_signal(
    usr1: Callable[[Any], None],
) -> None:
    seen: list[str | None] = []

    def helper() -> None:
        seen.append(handling_signal())

    def on_usr1(signum: int, frame: FrameType | None) -> None:
        seen.append(handling_signal())
        helper()

    usr1(on_usr1)
    assert seen == ["SIGUSR1", "SIGUSR1"]


def test_a_handler_given_as_a_partial_a_bound_method_or_a_callable_object_is_recognised(
    usr1: Callable[[Any], None],
) -> None:
    seen: list[str | None] = []

    class Trainer:
        def on_signal(self, signum: int, frame: FrameType | None, note: str = "") -> None:
            seen.append(handling_signal())

        def __call__(self, signum: int, frame: FrameType | None) -> None:
            seen.append(handling_signal())

    trainer = Trainer()
    for handler in (trainer.on_signal, functools.partial(trainer.on_signal, note="x"), trainer):
        usr1(handler)
    assert seen == ["SIGUSR1"] * 3


def test_a_handler_that_another_handler_chains_to_counts_as_the_outer_signal(
    usr1: Callable[[Any], None],
) -> None:
    """ddpscope's own SIGTERM flush runs a script's earlier handler from inside it: the outer handler's
    frame on the stack is enough."""
    seen: list[str | None] = []

    def users(signum: int, frame: FrameType | None) -> None:
        seen.append(handling_signal())

    def chaining(signum: int, frame: FrameType | None) -> None:
        users(signum, frame)

    usr1(chaining)
    assert seen == ["SIGUSR1"]


def test_a_scripts_sigterm_handler_run_by_ddpscopes_own_flush_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handler installed before ddpscope's agent: ddpscope's SIGTERM flush calls it."""
    seen: list[str | None] = []

    def users(signum: int, frame: FrameType | None) -> None:
        seen.append(handling_signal())

    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(lifecycle, "_prev_sigterm", users)
    monkeypatch.setattr(lifecycle, "_exit_reason", None)
    signal.signal(signal.SIGTERM, lifecycle._on_sigterm)
    try:
        # Called as Python would call it, not through a real SIGTERM: a watcher an earlier test's agent left
        # running in this process would take that signal for a rank's and end the test run.
        lifecycle._on_sigterm(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == ["SIGTERM"]
