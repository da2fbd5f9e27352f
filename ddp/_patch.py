"""Wrap the public torch.distributed collectives so that user calls reach the collective recorder.

Both ``torch.distributed.X`` and ``torch.distributed.distributed_c10d.X`` are replaced: user code
calls the former, torch's own helpers (``all_gather_object``, FSDP, ...) the latter, and every one of
those calls consumes a sequence number on every rank alike. A name imported before ``install()``
(``from torch.distributed import all_reduce``) is not seen.

The wrapper reads its arguments by position from a table built once from each function's signature:
``inspect.Signature.bind`` costs ~10 us, a tuple index tens of nanoseconds.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpscope.agent.clock import now_ns
from ddpscope.agent.log import get_logger
from ddpscope.ddp.collectives import RECORDER, CollectiveRecorder, disabled, group_pg_name, reduce_name

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class OpSpec:
    tensor: str | None
    """The argument whose shapes must agree across ranks (a tensor or a list of tensors)."""
    reduce: str | None = None
    """The argument holding the reduce op, for reductions."""
    peer: str | None = None
    """Point-to-point: the argument naming the peer rank (dst or src); its ``tag`` is recorded too (a
    receive takes only a message sent with its tag)."""
    root: str | None = None
    """Rooted ops: the argument naming the root's global rank (src or dst); ``group_<root>`` names it
    as a rank in the group instead. Recorded as ``root`` so the collector sees ranks that disagree on
    it (each rank its own src: on gloo every rank then waits until the timeout)."""


# Which tensor is recorded: the one whose shape every rank must agree on. Rooted ops record the tensor
# every rank passes (gather_list / scatter_list exist on the root only and would look like a mismatch).
OPS: dict[str, OpSpec] = {
    "all_reduce": OpSpec("tensor", "op"),
    "broadcast": OpSpec("tensor", root="src"),
    "reduce": OpSpec("tensor", "op", root="dst"),
    "all_gather": OpSpec("tensor"),
    "all_gather_into_tensor": OpSpec("input_tensor"),
    "reduce_scatter": OpSpec("output", "op"),
    "reduce_scatter_tensor": OpSpec("input", "op"),
    "gather": OpSpec("tensor", root="dst"),
    "scatter": OpSpec("tensor", root="src"),
    "barrier": OpSpec(None),
    "monitored_barrier": OpSpec(None),  # gloo only; a rank that skips it is named in rank 0's error
    "all_to_all": OpSpec("input_tensor_list"),
    "all_to_all_single": OpSpec("input"),
    "send": OpSpec("tensor", peer="dst"),
    "recv": OpSpec("tensor", peer="src"),
    "isend": OpSpec("tensor", peer="dst"),
    "irecv": OpSpec("tensor", peer="src"),
}

_originals: dict[str, Callable[..., Any]] = {}


class _GroupNames:
    """Stable names for process groups: 'default' for the world, else 'pg:<torch's group_name>'.

    Keyed by id(), holding the group so the id cannot be reused: ProcessGroup objects cannot be
    weak-referenced. torch itself holds every group until ``destroy_process_group``, which forgets it
    here too (``forget``): a destroyed gloo group held on keeps its sockets and threads, which torch
    frees only with the object (~5 descriptors and 3 threads a group, measured), and tells the recorder,
    which restarts the group's numbering (``CollectiveRecorder.forget_groups``). The first sight of
    a non-default group registers its members with the recorder (``CollectiveRecorder.register_group``),
    which sends them on its records.
    """

    def __init__(self, recorder: CollectiveRecorder) -> None:
        self._names: dict[int, tuple[Any, str | None]] = {}
        self.recorder = recorder
        """Where members of newly seen groups are registered (``install`` sets the one it patches for)."""

    def name(self, group: Any) -> str | None:
        """The group's name, or None when this rank is not a member (torch then does nothing)."""
        if group is None:
            return "default"
        hit = self._names.get(id(group))
        if hit is not None and hit[0] is group:
            return hit[1]
        name, ranks = _group_name(group)
        if name is not None and ranks is not None:
            self.recorder.register_group(name, ranks)
        self._names[id(group)] = (group, name)
        return name

    def forget(self, group: Any, *, every: bool) -> None:
        """``group`` was destroyed; ``every``: all groups were (torch's call without a group, or with
        the world group)."""
        if every:
            self._names.clear()
            self.recorder.forget_groups(None)
            return
        hit = self._names.pop(id(group), None)
        # A group this table never named may still have been numbered, by the engine (``groups.pg_name``).
        name = hit[1] if hit is not None and hit[0] is group else group_pg_name(group)
        if name is not None and name != "default":
            self.recorder.forget_groups([name])


def _group_name(group: Any) -> tuple[str | None, list[int] | None]:
    """(name, members' global ranks) of ``group``; (None, None) when this rank is not a member,
    ("default", None) for the world."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    if group is c10d.GroupMember.NON_GROUP_MEMBER:
        return None, None
    if group is c10d.GroupMember.WORLD or group is c10d._get_default_group():
        return "default", None
    ranks = dist.get_process_group_ranks(group)
    if dist.get_rank() not in ranks:
        return None, None
    # The engine's name too (ddpscope.ddp.groups.pg_name): one group, one sequence counter.
    return group_pg_name(group), ranks


GROUP_NAMES = _GroupNames(RECORDER)


def pg_name(group: Any = None) -> str:
    """The name the recorder uses for ``group`` (None: the default group)."""
    return GROUP_NAMES.name(group) or "non-member"


def _position(params: list[str], name: str | None) -> int:
    """Where argument ``name`` stands in a signature's ``params``; -1 when it is not there (or None)."""
    return params.index(name) if name in params else -1


def _arg(
    args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str | None, default: Any = None
) -> Any:
    """A call's argument ``name``, passed at position ``pos`` or by keyword; ``default`` when not passed."""
    if 0 <= pos < len(args):
        return args[pos]
    return kwargs.get(name, default) if name else default


def _make_wrapper(
    rec: CollectiveRecorder, op: str, spec: OpSpec, fn: Callable[..., Any]
) -> Callable[..., Any]:
    params = list(inspect.signature(fn).parameters)

    def locate(name: str | None) -> int:
        return _position(params, name)

    t_pos, r_pos, g_pos = locate(spec.tensor), locate(spec.reduce), locate("group")
    a_pos, p_pos = locate("async_op"), locate(spec.peer)
    tag_pos = locate("tag") if spec.peer else -1
    root_name = spec.root
    group_root_name = f"group_{root_name}" if root_name else None
    o_pos, go_pos = locate(root_name), locate(group_root_name)
    always_async = op in ("isend", "irecv")
    names = GROUP_NAMES
    local = rec._local

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Nested calls are not new collectives: torch re-enters the (patched) function itself when a
        # tensor subclass handles __torch_function__. Calls in an engine call are recorded by the engine
        # (a user's comm hook: its bucket's record begins before the hook's first call).
        if getattr(local, "engine_depth", 0) or getattr(local, "in_user_call", False):
            rec.first_call()
            return fn(*args, **kwargs)
        pg = None
        seq = 0
        plan = None
        tag = None
        try:
            pg = names.name(_arg(args, kwargs, g_pos, "group"))
            if pg is not None:
                if p_pos >= 0:
                    # A point-to-point pair is its own channel: other ranks never see these calls.
                    import torch.distributed as dist

                    peer = _arg(args, kwargs, p_pos, spec.peer)
                    me = dist.get_rank()
                    pair = "any" if peer is None else f"{min(me, peer)}-{max(me, peer)}"
                    pg = f"{pg}:p2p:{pair}"
                    if tag_pos >= 0:
                        tag = _arg(args, kwargs, tag_pos, "tag")
                tensors = _arg(args, kwargs, t_pos, spec.tensor) if t_pos >= 0 else None
                if tensors is None:
                    tensors = ()
                elif not isinstance(tensors, (list, tuple)):
                    tensors = (tensors,)
                reduce_op = None
                if r_pos >= 0:
                    red = _arg(args, kwargs, r_pos, spec.reduce)
                    reduce_op = "SUM" if red is None else reduce_name(red)
                site, source = rec.call_origin(1)
                # Unrooted ops (all_reduce, ...): None, which the record leaves out.
                root = (
                    None
                    if root_name is None
                    else _root(args, kwargs, o_pos, root_name, go_pos, group_root_name, g_pos)
                )
                seq, plan = rec.begin_user(
                    pg, op, tensors, reduce_op=reduce_op, call_site=site, root=root, source=source,
                    tag=tag if isinstance(tag, int) else None,
                )  # fmt: skip
        except Exception:
            rec._failed(op)
            pg = None
        if pg is None or not seq:
            return fn(*args, **kwargs)
        local.in_user_call = True
        called_ns = now_ns()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            rec.end(pg, seq, ok=False, error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            local.in_user_call = False
        if result is not None and (always_async or (a_pos >= 0 and _arg(args, kwargs, a_pos, "async_op"))):
            rec.track(pg, seq, result)
            return result
        rec.blocked_time().ns += now_ns() - called_ns
        if plan is not None:
            rec.end_planned(plan, seq)
        else:
            rec.end(pg, seq)
        return result

    wrapper.__ddpscope_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _root(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    pos: int,
    name: str,
    group_pos: int,
    group_name: str | None,
    g_pos: int,
) -> int | None:
    """The global rank of a rooted op's root, from ``src``/``dst`` or from ``group_src``/``group_dst``
    (a rank in the group); None when neither is given or it cannot be read (torch raises then)."""
    try:
        root = _arg(args, kwargs, pos, name)
        if root is not None:
            return int(root)
        group_root = _arg(args, kwargs, group_pos, group_name)
        if group_root is None:
            return None
        group = _arg(args, kwargs, g_pos, "group")
        if group is None:
            return int(group_root)
        import torch.distributed as dist

        return int(dist.get_global_rank(group, int(group_root)))
    except Exception:  # a bad argument: torch reports it; the record goes without a root
        logger.debug("ddpscope could not read the root of a collective", exc_info=True)
        return None


def _patch_work_wait(rec: CollectiveRecorder, work_type: Any) -> None:
    """End a user's async collective when its ``Work.wait()`` returns: the precise end time.

    Every wait in the process goes through this (torch's own synchronous calls wait in Python too);
    while no user async collective is pending the extra cost is one call and one dict truth test.
    """
    original = work_type.wait
    pending = rec._pending
    pending_ids = rec._pending_ids

    @functools.wraps(original)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not pending or id(self) not in pending_ids:
            return original(self, *args, **kwargs)
        called_ns = now_ns()
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            rec.waited(self, exc)
            raise
        rec.blocked_time().ns += now_ns() - called_ns  # the wait on a user's async collective blocks
        rec.waited(self)
        return result

    _originals["Work.wait"] = original
    work_type.wait = wait


def _patch_new_group(rec: CollectiveRecorder, c10d: Any, dist: Any) -> None:
    """Record ``new_group`` as a collective of the default group: ``op`` 'new_group', and as its one
    "shape" the new group's member ranks.

    Unless ``use_local_synchronization=True``, torch requires every rank of the world to call it, in the
    same order and with the same ranks, members or not: it names groups by the order of these calls, so
    ranks that create groups in different orders wait to connect groups their peers never create (until
    the timeout), or pair a group with another. Numbered with the world's collectives, a group created
    out of order is a mismatch at one sequence number, with both call sites. With
    ``use_local_synchronization`` only the members call it: it is not numbered.
    """
    original = getattr(c10d, "new_group", None)
    if original is None:
        return
    params = list(inspect.signature(original).parameters)
    ranks_pos, local_pos, sort_pos = (
        _position(params, n) for n in ("ranks", "use_local_synchronization", "sort_ranks")
    )
    local = rec._local

    @functools.wraps(original)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        if getattr(local, "engine_depth", 0) or getattr(local, "in_user_call", False):
            return original(*args, **kwargs)
        seq = 0
        try:
            if (
                not _arg(args, kwargs, local_pos, "use_local_synchronization", False)
                and c10d.is_initialized()
            ):
                ranks = _arg(args, kwargs, ranks_pos, "ranks")
                members = list(range(dist.get_world_size())) if ranks is None else [int(r) for r in ranks]
                if _arg(args, kwargs, sort_pos, "sort_ranks", True):
                    members.sort()
                site, source = rec.call_origin(1)
                seq = rec.begin(
                    "default", "new_group", (), shapes=[members], dtypes=[], call_site=site, source=source
                )
        except Exception:  # a bad argument: torch reports it; the call goes unrecorded
            rec._failed("new_group")
            seq = 0
        if not seq:
            return original(*args, **kwargs)
        local.in_user_call = True  # its barrier, when torch runs one, is part of it
        called_ns = now_ns()
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            rec.end("default", seq, ok=False, error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            local.in_user_call = False
        rec.blocked_time().ns += now_ns() - called_ns  # it waits for every rank of the world
        rec.end("default", seq)
        return result

    new_group.__ddpscope_original__ = original  # type: ignore[attr-defined]
    _originals["new_group"] = original
    c10d.new_group = new_group
    if getattr(dist, "new_group", None) is original:
        dist.new_group = new_group


def _patch_destroy(c10d: Any, dist: Any) -> None:
    """Forget a group's name (and the group object with it) once torch destroyed it."""
    original = getattr(c10d, "destroy_process_group", None)
    if original is None:
        return

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        group = args[0] if args else kwargs.get("group")
        # Asked before the call: once the world group is destroyed, GroupMember.WORLD reads None.
        every = group is None or group is c10d.GroupMember.WORLD
        try:
            return original(*args, **kwargs)
        finally:
            with contextlib.suppress(Exception):
                GROUP_NAMES.forget(group, every=every)

    _originals["destroy_process_group"] = original
    c10d.destroy_process_group = destroy_process_group
    if getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group


def install(rec: CollectiveRecorder) -> bool:
    if disabled():
        return False
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    if not dist.is_available():
        return False
    GROUP_NAMES.recorder = rec
    if _originals:
        return True
    c10d = dist.distributed_c10d
    for op, spec in OPS.items():
        fn = getattr(c10d, op, None)
        if fn is None:
            continue
        _originals[op] = fn
        wrapped = _make_wrapper(rec, op, spec, fn)
        setattr(c10d, op, wrapped)
        if getattr(dist, op, None) is fn:
            setattr(dist, op, wrapped)
    _patch_new_group(rec, c10d, dist)
    _patch_destroy(c10d, dist)
    work_type = getattr(c10d, "Work", None)
    if work_type is not None:
        try:
            _patch_work_wait(rec, work_type)
        except (AttributeError, TypeError):  # a torch whose Work refuses new attributes: poll() covers it
            logger.debug("ddpscope could not wrap Work.wait", exc_info=True)
    logger.debug("ddpscope recorder patched %d torch.distributed functions", len(_originals))
    return True


def uninstall() -> None:
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    wait = _originals.pop("Work.wait", None)
    if wait is not None:
        work_type: Any = c10d.Work
        work_type.wait = wait
    for op, fn in _originals.items():
        wrapped = getattr(c10d, op, None)
        setattr(c10d, op, fn)
        if getattr(dist, op, None) is wrapped:
            setattr(dist, op, fn)
    _originals.clear()
