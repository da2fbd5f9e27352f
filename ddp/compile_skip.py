"""``torch.compile`` never traces ddpscope's own code; the user's model inside it still compiles.

Compiling a model wrapped by the engine, or a torch DDP model under ``instrument()``, puts ddpscope's
bookkeeping (clock reads, progress marks, the observed process group torch's Reducer calls back into)
inside the region Dynamo evaluates. Traced, it is a graph break at every clock read with a warning each,
and the observed group's methods, reached from torch's C++ Reducer while Dynamo's frame hook is on,
are compiled as frames of their own, which fails ("ProcessGroup name not set") and kills the step.

Every code object of ddpscope's training-side modules (functions, methods and the closures inside
them) is therefore marked the way ``torch.compiler.disable()`` marks one: Dynamo runs the frame and
everything it calls as they are (torch's own Python, such as a collective's options, included). The
frames that call the user's model (the engine's ``forward``, ``instrument()``'s wrapper around torch's)
are marked ``runs_model``: run as they are, but what they call is compiled as usual, which is how the
model inside still compiles. The marking goes through torch's C-level frame strategy, so Dynamo itself
(a 1.2 s import) is not loaded for it. On a torch without that entry point this does nothing.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ddpscope.agent.log import get_logger

logger = get_logger(__name__)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _functions(module: types.ModuleType) -> Iterator[types.FunctionType]:
    for value in vars(module).values():
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            yield value
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            for attr in vars(value).values():
                attr = getattr(attr, "__func__", attr)  # staticmethod, classmethod
                for f in (attr, getattr(attr, "fget", None), getattr(attr, "fset", None)):
                    if inspect.isfunction(f):
                        yield f


def call_model(model: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``model(*args, **kwargs)`` from a frame Dynamo compiles (the one function here left unmarked): from
    a ``runs_model`` frame, this is where torch.compile picks the user's model up again, whatever its
    class (an ``nn.Sequential`` called from a skipped frame would otherwise run uncompiled, torch's own
    module code never being a frame Dynamo starts at)."""
    return model(*args, **kwargs)


_LEFT_TO_DYNAMO = {call_model.__code__}
_RUNS_MODEL: set[types.CodeType] = set()
"""The code objects that call the user's model: their callees compile."""


def _strategies() -> tuple[Any, Any] | None:
    """(skip this frame and its callees, skip this frame only), or None on a torch without them."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy

        return (
            _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP),
            _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT),
        )
    except (ImportError, AttributeError, TypeError):
        return None


def _mark(code: types.CodeType, strategy: Any) -> bool:
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy

        set_code_exec_strategy(code, strategy)
        return True
    except Exception:  # never let this stop an import or a model's construction
        logger.debug("ddpscope: could not mark %s for torch.compile", code, exc_info=True)
        return False


def runs_model(function: Callable[..., Any]) -> None:
    """Mark ``function`` (one that calls the user's model) to run as it is while its callees compile."""
    strategies = _strategies()
    code = getattr(function, "__code__", None)
    if strategies is not None and code is not None:
        _RUNS_MODEL.add(code)
        _mark(code, strategies[1])


def skip_in_compile(modules: Iterable[types.ModuleType]) -> int:
    """Mark every code object of ``modules`` to be run, not traced, by Dynamo; return how many."""
    strategies = _strategies()
    if strategies is None:
        return 0
    whole, frame_only = strategies
    marked = 0
    for module in modules:
        for function in _functions(module):
            for code in _codes(function.__code__):
                if code in _LEFT_TO_DYNAMO:
                    continue
                if not _mark(code, frame_only if code in _RUNS_MODEL else whole):
                    return marked
                marked += 1
    return marked


def skip_ddpscope_in_compile() -> int:
    """``skip_in_compile`` over every loaded ``ddpscope.ddp`` and ``ddpscope.agent`` module."""
    prefixes = ("ddpscope.ddp", "ddpscope.agent")
    return skip_in_compile(
        m for name, m in list(sys.modules.items()) if name.startswith(prefixes) and m is not None
    )
