"""The wire format: every record kind ddpscope ships, its fields and their types. The one definition.

The training side builds records as plain dicts; the collector validates incoming batches against
``RECORD_KINDS`` (``validate_record``) and never keeps a second copy of a field name. Standard library
only: the collector imports this module without torch.

A batch on the wire is ``{"schema": SCHEMA_VERSION, "records": [record, ...]}`` (JSON, usually gzip).
Every record carries the envelope fields (``kind``, ``job``, ``rank``, ``stream``, ``seq``, ``time_ns``);
``(job, rank, stream, seq)`` is its idempotency key, so a retry or a spool replay never stores it twice.
``stream`` names one agent incarnation (a new one after fork or restart); ``seq`` counts up within it.

Times are integer nanoseconds on the job's aligned clock: the rank's wall clock (read through its monotonic
clock, so never stepped back: ``agent/clock.py``) plus the offset to rank 0 estimated at start-up (see
``rank_start.clock_offset_ns``). Durations at the edges (API, dashboard) are float seconds.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import operator
import re
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 1
"""Bumped when a field changes meaning or a required field is added."""

MAX_JOB_LENGTH = 200
JOB_PATTERN = r"^(?!\.\.?\Z)[^/\x00]+\Z"
"""A job id is one URL path segment: no '/', not '.' or '..', no NUL (a sender that breaks this is refused:
the job could never be opened). Other characters are stored and shown as inert text; the agent's own ids
also have no control character (agent/config.py)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Integers must fit the collector's BIGINT columns."""
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
"""The range of an ``int32`` field (``Field.int32``)."""

# Field type codes. Kept as strings so the spec can be printed in errors and docs as it is.
INT, FLOAT, STR, BOOL = "int", "float", "str", "bool"
INTS, STRS, FLOATS = "list[int]", "list[str]", "list[float]"
INT_LISTS = "list[list[int]]"
COUNTS = "dict[str,int]"
OBJECTS = "list[object]"
OBJECT = "object"
"""One nested object whose fields are ``Field.item``."""
PACKED = "packed-int64"
"""Base64 (in JSON) of ``pack_step_arrays``' blob: several integer lists without one JSON number each."""
BYTES = "bytes"
"""Base64 (in JSON) of any bytes; what they hold is the record kind's rule (``step_block``)."""


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    type: str
    required: bool = True
    nullable: bool = False
    """None is a valid value (e.g. a collective's end time while it is still in flight)."""
    item: tuple[Field, ...] = ()
    """For ``list[object]`` and ``object``: the fields of each object."""
    max_length: int | None = None
    """For key strings the collector indexes: at most this many characters and no NUL."""
    pattern: str | None = None
    """For key strings: a regular expression the whole value must match (the collector refuses others)."""
    int32: bool = False
    """For integers the collector stores in INTEGER columns: they must fit in 32 bits (PostgreSQL refuses
    more, a 503 the agent would retry forever)."""
    doc: str = ""


ENVELOPE: tuple[Field, ...] = (
    Field("kind", STR, doc="one of RECORD_KINDS"),
    Field(
        "job",
        STR,
        max_length=MAX_JOB_LENGTH,
        pattern=JOB_PATTERN,
        doc="job id (DDPSCOPE_JOB, TORCHELASTIC_RUN_ID or generated): one URL path segment, no '/'",
    ),
    Field("rank", INT, int32=True, doc="global rank of the emitting process"),
    Field("stream", STR, max_length=64, doc="agent incarnation id; new after fork or restart"),
    Field(
        "seq",
        INT,
        doc="position in the stream, from 0 (a record implied by another, agent/implied.py: from 2^62); "
        "with job, rank, stream the idempotency key",
    ),
    Field("time_ns", INT, doc="aligned-clock time the record was emitted"),
)

BUCKET = (
    Field("index", INT),
    Field("bytes", INT),
    Field("dtype", STR),
    Field("device", STR),
    Field("parameters", STRS, doc="parameter names in the bucket, in bucket order"),
)

PENDING_BUCKET = (
    Field("index", INT),
    Field("missing", STRS, doc="parameters whose gradients never arrived"),
    Field("launched", BOOL, doc="all-reduce launched (waiting on peers) rather than waiting for grads"),
    Field(
        "hook",
        STR,
        required=False,
        doc="launched through the user's comm hook (its name and where it is defined), which issued no "
        "collective: the reduction waits for the future the hook returned",
    ),
)

INFLIGHT = (
    Field("pg", STR),
    Field("coll_seq", INT),
    Field("op", STR),
    Field("shapes", INT_LISTS, required=False),
    Field("dtypes", STRS, required=False),
    Field("call_site", STR, nullable=True),
    Field("start_ns", INT),
)

UNTIMED_END = -1
"""A partial step's all-reduce end: it succeeded, but the rank had not recorded when (it polls lazily)."""

PARTIAL_STEP = (
    Field("step", INT),
    Field("synced", BOOL, doc="false in a no_sync() step: no bucket is all-reduced, the arrays are empty"),
    Field("forward_start_ns", INT),
    Field("forward_end_ns", INT, doc="0: the forward had not returned"),
    Field("backward_start_ns", INT, doc="0: backward had not begun"),
    Field("bucket_ready_ns", INTS, doc="per bucket; 0: a gradient still missing"),
    Field("allreduce_start_ns", INTS, doc="per bucket; 0: not launched"),
    Field(
        "allreduce_end_ns",
        INTS,
        doc="per bucket; 0: not finished (or failed); UNTIMED_END (-1): succeeded, at a time not recorded yet",
    ),
    Field("bucket_bytes", INTS),
)
"""The step a rank was in when it hung or failed, as far as it got: the step record it never sent."""

STOPPED_IN = Field(
    "partial_step",
    OBJECT,
    item=PARTIAL_STEP,
    required=False,
    nullable=True,
    doc="the unfinished step's times so far, when the rank hung or failed inside a step (null between steps)",
)
"""The field of the ``hang`` and ``rank_error`` reports that carries ``PARTIAL_STEP``."""

STORE_FILE = (
    Field("path", STR, max_length=1000),
    Field("mtime_ns", INT, doc="when the file was last written (the host's wall clock, ns)"),
    Field(
        "process_started_ns",
        INT,
        nullable=True,
        doc="when the reporting process started (the same clock); null where the platform cannot tell",
    ),
)

TRAINING_THREAD = Field(
    "thread",
    STR,
    required=False,
    doc="the name of the thread that trains, when it is not the main thread (a loop run on a thread of its own): "
    "the thread whose stack and CPU the record is about; absent for the main thread",
)

BLOCKED_CALL = Field(
    "blocked_call",
    OBJECT,
    required=False,
    item=(
        Field("syscall", STR, max_length=64, doc="the system call, by name (or 'syscall N')"),
        Field(
            "on",
            OBJECTS,
            required=False,
            item=(
                Field("fd", INT),
                Field(
                    "kind", STR, max_length=64, doc="tcp, tcp-listen, udp, unix, pipe, fifo, tty, file, ..."
                ),
                Field(
                    "name",
                    STR,
                    max_length=1000,
                    doc="the peer's host:port, the listening address, or the path",
                ),
                Field(
                    "role", STR, required=False, doc="'store': a connection to the default group's TCPStore"
                ),
            ),
            doc="the descriptors it waits on (a read's one, a poll's or select's first few)",
        ),
        Field("path", STR, required=False, max_length=1000, doc="the path it opens or stats"),
        Field("pid", INT, required=False, doc="the child process it waits for"),
        Field("command", STR, required=False, max_length=1000, doc="that child's command line"),
    ),
    doc="the system call the training thread was blocked in when the record was made, read from Linux's /proc "
    "(agent/blocked_call.py); absent when it was running, computing, or the platform cannot tell",
)

LOADER_WORKERS = Field(
    "loader_workers",
    OBJECTS,
    required=False,
    item=(Field("pid", INT), BLOCKED_CALL),
    doc="when the training thread waits in its DataLoader for the workers' next batch: each worker process and "
    "the system call it is blocked in (no blocked_call: it runs, or the kernel would not say)",
)

THREAD_STACK = (
    Field("thread", STR, doc="thread name"),
    Field("stack", STR, doc="formatted Python stack, innermost frame last"),
    Field(
        "daemon",
        BOOL,
        required=False,
        doc="a thread other than the main one: whether it is a daemon (one that is not keeps the process from "
        "exiting); absent for the main thread and threads started outside Python",
    ),
)

UNSYNCED_GRADIENTS = "unsynced_gradients"
"""Gradients a rank's DDP never all-reduced (``ddp/drift.py``): its parameters drift from its peers'."""
JOB_IDS_DIFFER = "job_ids_differ"
"""Ranks of one torch job report under different job ids (``ddp/job_check.py``): each id a job of its own."""
NONFINITE_LOSS = "nonfinite_loss"
"""The gradient a rank's loss sent into its model's output was NaN or Inf (``ddp/nonfinite.py``): said when
a run of such steps begins, and again (with ``finite_again_step``) when it ends."""
NONFINITE_GRADIENT = "nonfinite_gradient"
"""With ``DDPSCOPE_CHECK_GRADIENTS``: a rank's gradients were NaN or Inf before their all-reduce while its loss
was finite (``ddp/nonfinite.py``), with the bucket and the parameters; said as ``nonfinite_loss`` is."""
COLLECTIVES_FROM_THREADS = "collectives_from_threads"
"""Two threads of a rank issue collectives on one process group at once (``ddp/issuing_threads.py``): their
order differs between the ranks, so collectives pair with the wrong ones."""
COLLECTORS_DIFFER = "collectors_differ"
"""Ranks of one torch job under one job id send to different collectors (``ddp/job_check.py``): each
collector sees part of the job."""
TRAINS_IN_EVAL_MODE = "trains_in_eval_mode"
"""A rank ran training steps with its model in eval mode (``ddp/train_mode.py``): a ``model.eval()`` with no
``model.train()`` after it; its forward is another function than its peers'."""
WARNING_CODES = frozenset(
    {
        UNSYNCED_GRADIENTS,
        TRAINS_IN_EVAL_MODE,
        JOB_IDS_DIFFER,
        COLLECTORS_DIFFER,
        NONFINITE_LOSS,
        NONFINITE_GRADIENT,
        COLLECTIVES_FROM_THREADS,
    }
)
"""The ``warning`` record's codes ddpscope's training side sends (each an incident kind at the collector)."""

RECORD_KINDS: dict[str, tuple[Field, ...]] = {
    # Once per rank at start-up and after every (re)configuration.
    "rank_start": (
        Field(
            "world_size",
            INT,
            int32=True,
            doc="the job's ranks, every one (not those of the DDP process group)",
        ),
        Field("backend", STR),
        Field("device", STR),
        Field("host", STR),
        Field("pid", INT),
        Field("engine", STR, doc="'ddpscope' (own engine) or 'torch' (instrument() adapter)"),
        Field("torch_version", STR),
        Field("ddpscope_version", STR),
        Field("python_version", STR),
        Field("find_unused_parameters", BOOL),
        Field("bucket_cap_mb", FLOAT),
        Field("clock_offset_ns", INT, doc="added to the rank's own clock to get rank 0's"),
        Field("clock_error_ns", INT, doc="half the best ping-pong round trip: bound on the offset error"),
        Field("process_group", STR, required=False),
        Field(
            "static_graph",
            BOOL,
            required=False,
            doc="torch's static_graph=True: parameters unused in every iteration are handled without find_unused_parameters",
        ),
        Field(
            "hang_timeout_s",
            FLOAT,
            required=False,
            doc="the rank's hang timeout (DDPSCOPE_HANG_TIMEOUT, its watchdog's); absent from older agents",
        ),
        Field(
            "group_timeout_s",
            FLOAT,
            required=False,
            doc="the timeout of the process group the model reduces over (init_process_group's timeout): "
            "shorter than hang_timeout_s, it ends a stall with an error before any hang report; absent when "
            "torch does not say",
        ),
        Field(
            "check_gradients",
            BOOL,
            required=False,
            doc="DDPSCOPE_CHECK_GRADIENTS: the rank checks its gradient buckets for NaN and Inf before their "
            "all-reduce (sends 'nonfinite_gradient' warnings); absent from older agents",
        ),
        Field("host_cpus", INT, required=False, doc="the host's CPUs (os.cpu_count())"),
        Field("cpus_allowed", INT, required=False, doc="the CPUs the rank's affinity allows it"),
        Field("threads", INT, required=False, doc="the rank's intra-op threads (torch.get_num_threads())"),
        Field(
            "unobserved_ranks",
            INTS,
            required=False,
            doc="global ranks of the model's DDP group that run without ddpscope (DDPSCOPE_DISABLED on their "
            "node: they never said otherwise in the store), so nothing of them is sent; absent when none",
        ),
    ),
    # The bucket layout, at start-up ("initial") and whenever buckets are rebuilt ("rebuilt").
    "layout": (
        Field("step", INT, doc="first step this layout applies to"),
        Field("reason", STR, doc="'initial' or 'rebuilt'"),
        Field("buckets", OBJECTS, item=BUCKET),
        Field(
            "parameter_order",
            STRS,
            required=False,
            doc="every parameter's name in the engine's index order (torch's 'Parameter indices' refer to it)",
        ),
    ),
    # One per rank per iteration; arrays are indexed by bucket index. The six integer arrays travel either
    # as lists or packed into ``arrays`` (what the agent sends): exactly one of the two forms.
    "step": (
        Field("step", INT),
        Field("synced", BOOL, doc="False under no_sync(): no all-reduce this step"),
        Field("forward_start_ns", INT),
        Field("forward_end_ns", INT),
        Field("backward_start_ns", INT),
        Field("backward_end_ns", INT, doc="backward() returned: all-reduces waited, grads written"),
        Field(
            "blocked_between_ns",
            INT,
            required=False,
            doc="time the training thread spent blocked in collectives other than the gradient all-reduces "
            "(a user's calls, buffer broadcasts) from the previous step's backward end to this forward start; "
            "absent means 0",
        ),
        Field("blocked_forward_ns", INT, required=False, doc="the same, within this forward"),
        Field("blocked_backward_ns", INT, required=False, doc="the same, from forward end to backward end"),
        Field("bucket_ready_ns", INTS, required=False, doc="last gradient of the bucket accumulated"),
        Field(
            "allreduce_start_ns",
            INTS,
            required=False,
            doc="launch; later than ready when an earlier bucket blocks",
        ),
        Field("allreduce_end_ns", INTS, required=False),
        Field("bucket_bytes", INTS, required=False),
        Field("ready_order", INTS, required=False, doc="bucket indices in the order they became ready"),
        Field("unused_parameters", STRS, doc="names of parameters that got no gradient this step"),
        Field(
            "collective_seqs",
            INTS,
            required=False,
            doc="collective sequence number of each bucket's all-reduce",
        ),
        Field(
            "arrays",
            PACKED,
            required=False,
            doc="the six arrays above packed (pack_step_arrays), in STEP_ARRAYS order",
        ),
    ),
    # Step records of one stream in columns (``step_block.py``): what the agent ships, and exactly the step
    # records it expands to. Envelope: the first step's seq, the newest step's time_ns.
    "step_block": (
        Field("count", INT, doc="steps in the block, 1 to step_block.MAX_STEPS"),
        Field(
            "columns",
            BYTES,
            doc="the steps' scalar fields as little-endian int64 columns of count values, in step_block.COLUMNS "
            "order (synced as 0 or 1)",
        ),
        Field("arrays", BYTES, doc="each step's packed arrays (pack_step_arrays), one after the other"),
        Field("array_sizes", INTS, doc="bytes of each step's packed arrays, in step order"),
        Field(
            "unused",
            OBJECTS,
            item=(Field("index", INT, doc="the step's position in the block"), Field("names", STRS)),
            doc="the steps that had unused parameters (any other step had none)",
        ),
    ),
    # Every collective the process issues (engine and user), at issue time: crash-durable evidence.
    "collective": (
        Field("pg", STR, max_length=200, doc="process group name"),
        Field("coll_seq", INT, doc="per-process-group sequence number, from 1"),
        Field("op", STR, doc="all_reduce, broadcast, all_gather, barrier, ..., new_group"),
        Field("reduce_op", STR, nullable=True),
        Field(
            "shapes",
            INT_LISTS,
            doc="the shapes of the tensors every rank must agree on; 'new_group' (a collective of the default "
            "group, which every rank calls): one list, the new group's member ranks",
        ),
        Field("dtypes", STRS),
        Field("call_site", STR, nullable=True, doc="file:line of the user's call"),
        Field("start_ns", INT),
        Field(
            "step",
            INT,
            nullable=True,
            doc="the engine's step; a user's call made inside a step (its forward to the end of its "
            "backward) carries that step, one between steps null",
        ),
        Field(
            "source",
            STR,
            doc="'engine', 'user' or 'join' (torch's Join machinery: a joined rank shadowing its peers)",
        ),
        Field(
            "root",
            INT,
            required=False,
            nullable=True,
            doc="global rank of the root of a rooted op: the src of broadcast and scatter, the dst of "
            "reduce and gather; absent (or null) when unknown, on other ops and on point-to-point ones (whose "
            "pg names the pair)",
        ),
        Field(
            "tag",
            INT,
            required=False,
            nullable=True,
            doc="a point-to-point op's tag (send, recv, isend, irecv); absent when 0, torch's default",
        ),
        Field(
            "group_ranks",
            INTS,
            required=False,
            doc="global ranks of the group's members, on every collective of a group other than the "
            "default one (whose members are all ranks, and which omits it)",
        ),
        Field(
            "signal",
            STR,
            required=False,
            max_length=16,
            doc="a user's call made from inside a Python signal handler: that signal's name ('SIGTERM'); "
            "absent otherwise",
        ),
    ),
    # Completion of a collective issued earlier.
    "collective_end": (
        Field("pg", STR, max_length=200),
        Field("coll_seq", INT),
        Field("end_ns", INT),
        Field("ok", BOOL),
        Field("error", STR, required=False, nullable=True),
    ),
    # Liveness and position, every DDPSCOPE_HEARTBEAT_S seconds.
    "heartbeat": (
        Field("phase", STR, doc="idle, forward, after_forward, backward, allreduce, optimizer"),
        Field("step", INT),
        Field("last_coll_seq", INT, doc="highest collective sequence number issued (default group)"),
        Field("pid", INT),
        Field(
            "world_size",
            INT,
            required=False,
            doc="size of the default process group; absent while there is none (and from older agents). "
            "Heartbeats begin when the group is created, so this is the job's size before any rank_start",
        ),
        Field(
            "silent_s",
            FLOAT,
            required=False,
            doc="seconds since the previous heartbeat, when over twice the interval: the watchdog's thread "
            "could not run (the main thread held the GIL, the process was stopped); absent otherwise",
        ),
    ),
    # No progress for DDPSCOPE_HANG_TIMEOUT seconds.
    "hang": (
        Field("phase", STR),
        Field("step", INT),
        Field("stalled_s", FLOAT),
        Field("pending_buckets", OBJECTS, item=PENDING_BUCKET),
        Field("inflight", OBJECTS, item=INFLIGHT),
        Field("stacks", OBJECTS, item=THREAD_STACK),
        Field("message", STR),
        Field(
            "exiting",
            BOOL,
            required=False,
            doc="true when the rank's script had ended and the process was shutting down (joining threads that "
            "are not daemons, running exit handlers): stuck on the way out",
        ),
        STOPPED_IN,
        Field(
            "main_cpu_s",
            FLOAT,
            required=False,
            nullable=True,
            doc="CPU seconds the training thread (the main thread unless ``thread`` names another) used during "
            "the stall (near 0: blocked, waiting); null where the platform cannot tell",
        ),
        TRAINING_THREAD,
        BLOCKED_CALL,
        LOADER_WORKERS,
    ),
    "hang_resolved": (
        Field("step", INT),
        Field("hang_s", FLOAT),
    ),
    # The training thread's stack in a stall of the rank's own (no progress, nothing in flight, after its first
    # step) from 0.5 s (or twice the rank's usual) and at each doubling, at most one stall in 5 s
    # (ddp/stall_sampler.py): where a rank that holds the others up now and then spends that time (/stalls).
    "stall_sample": (
        Field("step", INT, doc="the step the rank was in, or had last finished when idle"),
        Field("phase", STR),
        Field("stalled_s", FLOAT, doc="how long the stall had lasted when sampled"),
        Field("site", STR, nullable=True, doc="file:line of the innermost frame of user code"),
        Field("stack", STR, doc="the training thread's formatted Python stack, innermost frame last"),
        Field(
            "main_cpu_s",
            FLOAT,
            nullable=True,
            doc="CPU seconds the training thread used in the stall so far (near 0: blocked); null where unknown",
        ),
        TRAINING_THREAD,
        BLOCKED_CALL,
        LOADER_WORKERS,
    ),
    # Where the training thread spent its time, sampled at each watchdog tick after the first step and
    # counted per phase and line of user code (ddp/site_profile.py): the line a straggler's slow phase takes.
    "site_profile": (
        Field("step", INT, doc="the rank's step when the record was made"),
        Field("interval_s", FLOAT, doc="the time the samples were taken over, up to this record"),
        Field("samples", INT, doc="samples taken in that time (one a watchdog tick)"),
        Field(
            "sites",
            OBJECTS,
            item=(
                Field("phase", STR, doc="the rank's phase: idle (between steps), forward, backward, ..."),
                Field(
                    "site",
                    STR,
                    nullable=True,
                    doc="file:line of the innermost frame of user code; null: none",
                ),
                Field("n", INT, doc="samples taken there"),
                Field(
                    "loader",
                    BOOL,
                    required=False,
                    doc="true: waiting there for its DataLoader's workers (their Dataset reads hold the time)",
                ),
            ),
            doc="the most sampled (phase, line) pairs, most first",
        ),
        Field("other", INT, doc="samples at pairs not listed"),
    ),
    # An exception (or fatal signal) in training, shipped before the process exits.
    "rank_error": (
        Field("step", INT, nullable=True),
        Field("phase", STR),
        Field("error_type", STR),
        Field("message", STR),
        Field("stack", STR),
        Field("fatal", BOOL, doc="the process died of it (uncaught, abort, fatal signal)"),
        STOPPED_IN,
        Field(
            "thread",
            STR,
            required=False,
            max_length=200,
            doc="the name of the thread the exception ended, when not the main thread (the rank kept running); "
            "absent otherwise",
        ),
        Field(
            "store_file",
            OBJECT,
            item=STORE_FILE,
            required=False,
            doc="an error of init_process_group with a file:// init_method whose file existed before the call: "
            "its path, when it was last written and when the process started (a file written before: maybe an "
            "earlier run's rendezvous); absent otherwise",
        ),
    ),
    # Something that does not stop training but makes its result wrong: said once per cause and model.
    "warning": (
        Field("step", INT, nullable=True, doc="the step it was noticed in, or the last one before it"),
        Field(
            "code",
            STR,
            max_length=64,
            doc="what is wrong, for the incident's kind (WARNING_CODES): 'unsynced_gradients' (gradients DDP "
            "did not all-reduce, so this rank's parameters drift from its peers'), 'job_ids_differ' (ranks "
            "of one torch job report under different job ids), 'nonfinite_loss' (the gradient the rank's "
            "loss sent into its model's output was NaN or Inf, from ``step`` on) or 'nonfinite_gradient' "
            "(with DDPSCOPE_CHECK_GRADIENTS: the rank's gradients were NaN or Inf before their all-reduce while "
            "its loss was finite, from ``step`` on), 'collectives_from_threads' (two threads of the rank "
            "issue collectives on one process group at once, so their order differs between ranks) or "
            "'trains_in_eval_mode' (the rank's training steps ran with its model in eval mode, from ``step`` on)",
        ),
        Field(
            "pg",
            STR,
            max_length=200,
            required=False,
            doc="'collectives_from_threads': the process group whose collectives come from two threads",
        ),
        Field("message", STR, doc="what happened and what to do, without the rank (the collector adds it)"),
        Field(
            "parameters",
            STRS,
            required=False,
            doc="the parameters concerned, by name ('nonfinite_gradient': those of ``bucket`` whose gradient was "
            "not finite, nearest the output first, at most 8)",
        ),
        Field(
            "bucket",
            INT,
            required=False,
            doc="'nonfinite_gradient': the first bucket of the step whose gradients were not finite, by index",
        ),
        Field("call_site", STR, nullable=True, required=False, doc="file:line of the user's call at fault"),
        Field(
            "syncs",
            INT,
            required=False,
            doc="'nonfinite_loss', 'nonfinite_gradient': synchronised backwards the rank had completed before "
            "``step``'s backward, "
            "which ranks share whatever forwards each ran without syncing (see replica_digest)",
        ),
        Field(
            "finite_again_step",
            INT,
            required=False,
            doc="'nonfinite_loss', 'nonfinite_gradient': the first step after ``step`` whose loss gradient (or "
            "gradients) was finite again; sent "
            "in a second warning when the run of non-finite steps ends, absent while it lasts",
        ),
        Field(
            "nonfinite_weights",
            STRS,
            required=False,
            doc="'nonfinite_loss': the rank's parameters and buffers that were already NaN or Inf as ``step``'s "
            "forward ran, by name in the model's order, at most 8 (absent when all were finite)",
        ),
        Field(
            "nonfinite_weights_count",
            INT,
            required=False,
            doc="'nonfinite_loss': how many parameters and buffers were NaN or Inf (``nonfinite_weights`` "
            "names the first 8)",
        ),
    ),
    # A fingerprint of the rank's copy of the model (ddp/replicas.py), at the start of a training forward
    # on a schedule of sync counts every rank shares; the collector compares the ranks' digests of one count.
    "replica_digest": (
        Field("step", INT, doc="the training forward it was taken at, before the forward ran"),
        Field(
            "syncs",
            INT,
            doc="synchronised backwards (gradient all-reduce rounds) the rank had completed: what the collector "
            "compares ranks at, the same on every rank whatever forwards a rank ran without syncing",
        ),
        Field(
            "model",
            INT,
            doc="which wrapped model of the process, 0 for the first (every rank wraps its models in one order)",
        ),
        Field("parameters", INT, doc="how many parameters it covers: the layout's parameter_order"),
        Field("group", INT, doc="parameters per norm: 1, or runs of that many when a model has many"),
        Field(
            "norms",
            FLOATS,
            doc="2-norm of each parameter (or run of parameters) in parameter_order; -1 a NaN norm, -2 infinite",
        ),
        Field(
            "replicas",
            INTS,
            required=False,
            doc="the global ranks of the model's DDP process group when not every rank (DDP on subgroups): "
            "the ranks whose digests are compared with this one; absent: every rank of the job",
        ),
    ),
    # Clean end of a rank: the job is 'finished' once every rank has one.
    "rank_exit": (
        Field("step", INT, nullable=True),
        Field("reason", STR, doc="'finished', 'sigterm', 'sigint' (KeyboardInterrupt) or 'error'"),
    ),
    # A rank's memory and the host's (agent/memory.py): every DDPSCOPE_MEMORY_INTERVAL_S, and at once on a jump.
    "memory": (
        Field("step", INT, doc="the rank's step when sampled"),
        Field("rss_bytes", INT, doc="the process's resident memory"),
        Field(
            "anon_bytes",
            INT,
            required=False,
            doc="rss_bytes less the pages backed by files and shared memory (its heap and tensors): what a leak "
            "grows, while the code of its libraries pages in and out on its own",
        ),
        Field("available_bytes", INT, doc="the host's MemAvailable"),
        Field("total_bytes", INT, doc="the host's MemTotal"),
        Field(
            "limit_bytes",
            INT,
            required=False,
            doc="the memory cgroup's limit, when below the host's memory (a container, a Slurm job); absent otherwise",
        ),
        Field("cgroup_bytes", INT, required=False, doc="the memory cgroup's usage, beside limit_bytes"),
        Field(
            "workers_bytes",
            INT,
            required=False,
            doc="the private memory (not shared with the rank) of its child processes: DataLoader workers; "
            "absent when it has none",
        ),
        Field("workers", INT, required=False, doc="how many child processes workers_bytes counts"),
    ),
    # The agent's own accounting, cumulative since the stream started (the latest one wins).
    "agent_stats": (
        Field("emitted", INT),
        Field("dropped", COUNTS, doc="'reason:kind' -> records dropped"),
        Field("spool_bytes", INT),
    ),
}

URGENT_KINDS = frozenset({"hang", "hang_resolved", "rank_error"})
"""Kinds that take the agent's fast path: sent at once, also spooled and printed to stderr."""


class RecordError(ValueError):
    """A record that does not match the wire format; the message names the field."""


# -- packed step arrays ----------------------------------------------------------------------------
# A 50-bucket step carries 300 integers; as JSON numbers they cost the collector ~35 us per record to
# parse, more than storing the row. Packed, they are one base64 string that is checked in O(1) and
# stored as is: the collector's ``steps.arrays`` column holds exactly this blob.

STEP_ARRAYS = (
    "bucket_ready_ns",
    "allreduce_start_ns",
    "allreduce_end_ns",
    "bucket_bytes",
    "ready_order",
    "collective_seqs",
)
"""The step fields packed into ``arrays``, in blob order."""

BLOCKED_FIELDS = ("blocked_between_ns", "blocked_forward_ns", "blocked_backward_ns")
"""The step's time blocked in other collectives, by phase (optional on the wire; 0 when absent)."""

PACK_VERSION = 1
_PACK_HEADER = struct.Struct("<B" + "IBq" * len(STEP_ARRAYS))  # version; per array: length, width, base
_PACK_HEADER_SIZE = _PACK_HEADER.size
# Bytes per value -> array typecode. 0: every value equals the base (no bytes at all). 8: the values
# themselves. 1, 2, 4 when every value lies in [base, base + 2**(8*width)): the low bytes of each value,
# and the reader adds back the offset from the base (a step's times lie within seconds of each other:
# 4 bytes instead of 8). Taking low bytes, not subtracting, keeps packing in C (no per-value Python).
_TYPECODES = {1: "B", 2: "H", 4: "I" if array("I").itemsize == 4 else "L", 8: "q"}
_BIG_ENDIAN = sys.byteorder == "big"


def _pack_one(values: Sequence[int]) -> tuple[int, int, bytes]:
    """(bytes per value, base, little-endian data) for one array, the narrowest that holds it."""
    if not values:
        return 0, 0, b""
    lo, hi = min(values), max(values)
    if lo < INT64_MIN or hi > INT64_MAX:
        raise OverflowError(f"{lo if lo < INT64_MIN else hi} does not fit in a signed 64-bit integer")
    span = hi - lo
    if span == 0:
        return 0, lo, b""
    width = 1 if span < 1 << 8 else 2 if span < 1 << 16 else 4 if span < 1 << 32 else 8
    if width < 8 and lo > INT64_MAX - ((1 << 8 * width) - 1):
        width = 8  # keep the O(1) check "base + any offset fits int64" true for every blob we make
    whole = array("q", values)
    if _BIG_ENDIAN:
        whole.byteswap()
    if width == 8:
        return 8, 0, whole.tobytes()
    chunks = array(_TYPECODES[width], whole.tobytes())  # each value's bytes, low ones first
    return width, lo, chunks[:: 8 // width].tobytes()


def pack_step_arrays(arrays: Sequence[Sequence[int]]) -> bytes:
    """The six integer lists -> one compact blob (``STEP_ARRAYS`` order): a version byte; per array its
    length, bytes per value and base (little-endian); then each array's values: their low 1, 2 or 4
    bytes when the array spans less than that, or whole 8-byte values. ``OverflowError`` beyond int64."""
    head: list[int] = [PACK_VERSION]
    datas = []
    for values in arrays:
        width, base, data = _pack_one(values)
        head += (len(values), width, base)
        datas.append(data)
    return _PACK_HEADER.pack(*head) + b"".join(datas)


_BASE_LIMIT = {0: INT64_MAX, 8: INT64_MAX, **{w: INT64_MAX - ((1 << 8 * w) - 1) for w in (1, 2, 4)}}
"""Largest base for each width such that base + any offset still fits int64 (width 8 ignores base)."""
_WIDTHS = frozenset(_BASE_LIMIT)
_SAFE_BASE = min(_BASE_LIMIT.values())


def packed_problem(blob: bytes) -> str | None:
    """What is wrong with a packed blob, or None. Reads only the header: O(1) in the number of values,
    and every value a well-formed blob can hold is a signed 64-bit integer."""
    if len(blob) < _PACK_HEADER_SIZE:
        return f"packed arrays of {len(blob)} bytes are shorter than their {_PACK_HEADER_SIZE}-byte header"
    head = _PACK_HEADER.unpack_from(blob)
    counts, widths, bases = head[1::3], head[2::3], head[3::3]
    # The collector runs this once per step record: the common case in a few C-level calls.
    if (
        head[0] == PACK_VERSION
        and _WIDTHS.issuperset(widths)
        and max(bases) <= _SAFE_BASE
        and len(blob) == _PACK_HEADER_SIZE + sum(map(operator.mul, counts, widths))
    ):
        return None
    if head[0] != PACK_VERSION:
        return f"packed arrays of format version {head[0]}; this side reads version {PACK_VERSION}"
    for name, width, base in zip(STEP_ARRAYS, widths, bases, strict=True):
        limit = _BASE_LIMIT.get(width)
        if limit is None:
            return f"{name} is packed with {width} bytes per value; expected 0, 1, 2, 4 or 8"
        if base > limit:
            return f"{name}'s packed base {base} lets values exceed a signed 64-bit integer"
    expected = _PACK_HEADER_SIZE + sum(c * w for c, w in zip(counts, widths, strict=True))
    if len(blob) != expected:
        return f"packed arrays are {len(blob)} bytes but their header announces {expected}"
    return None


def packed_all_well_formed(blobs: bytes, sizes: Sequence[int]) -> bool:
    """Whether every blob of ``blobs`` (packed arrays one after the other, ``sizes`` bytes each) passes
    ``packed_problem``: the same rules, checked for all headers at once in C-level loops (a block of
    steps at the collector). False does not say which: ask ``packed_problem`` of each."""
    if not sizes or min(sizes) < _PACK_HEADER_SIZE or sum(sizes) != len(blobs):
        return False
    starts = itertools.accumulate(sizes[:-1], initial=0)
    fields = list(zip(*map(_PACK_HEADER.unpack_from, itertools.repeat(blobs), starts), strict=True))
    if set(fields[0]) != {PACK_VERSION}:
        return False
    expected: list[int] = [_PACK_HEADER_SIZE] * len(sizes)
    for i in range(len(STEP_ARRAYS)):
        counts, widths, bases = fields[1 + 3 * i : 4 + 3 * i]
        if not _WIDTHS.issuperset(widths) or max(bases) > _SAFE_BASE:
            return False
        expected = list(map(operator.add, expected, map(operator.mul, counts, widths)))
    return expected == list(sizes)


def _stored_arrays(blob: bytes) -> list[tuple[array[int] | None, int, int, int]]:
    """The arrays of a well-formed blob as stored: ``(data, length, width, base)``, ``data`` None for
    width 0 (every value is the base)."""
    head = _PACK_HEADER.unpack_from(blob)
    view, at = memoryview(blob), _PACK_HEADER_SIZE
    out: list[tuple[array[int] | None, int, int, int]] = []
    for i in range(len(STEP_ARRAYS)):
        n, width, base = head[1 + 3 * i : 4 + 3 * i]
        if width == 0:
            out.append((None, n, 0, base))
            continue
        data = array(_TYPECODES[width])
        data.frombytes(view[at : at + n * width])
        at += n * width
        if _BIG_ENDIAN:
            data.byteswap()
        out.append((data, n, width, base))
    return out


def unpack_step_arrays(blob: bytes) -> tuple[list[int], ...]:
    """A blob from ``pack_step_arrays`` -> the six lists (``RecordError`` if it is malformed)."""
    problem = packed_problem(blob)
    if problem:
        raise RecordError(problem)
    return tuple(
        [base] * n if data is None else data.tolist() if width == 8 else _restore(data, width, base)
        for data, n, width, base in _stored_arrays(blob)
    )


def _restore(low_bytes: array[int], width: int, base: int) -> list[int]:
    """Values from their low bytes and the array's base."""
    if not low_bytes:
        return []
    mask = (1 << 8 * width) - 1
    low = base & mask
    if min(low_bytes) >= low:  # no value wrapped past the base's low bytes
        if low == base:  # a small non-negative base (indices, counts): the low bytes are the values
            return low_bytes.tolist()
        if not _BIG_ENDIAN:
            # Each value is the base with its low bytes replaced. Done in C: the base's bytes
            # repeated, then every value's low chunk written in.
            chunks = array(low_bytes.typecode, base.to_bytes(8, "little", signed=True)) * len(low_bytes)
            chunks[:: 8 // width] = low_bytes
            return array("q", chunks.tobytes()).tolist()
    return [base + ((v - low) & mask) for v in low_bytes]


def step_arrays_problem(packed_present: bool, lists_present: Sequence[bool]) -> str | None:
    """A step must carry its arrays in exactly one form: the six lists, or ``arrays``. Returns
    ``"<field>: <what is wrong>"`` or None."""
    if not packed_present:
        for name, present in zip(STEP_ARRAYS, lists_present, strict=True):
            if not present:
                return (
                    f"{name}: required field is missing (send the six arrays as lists, or packed in 'arrays')"
                )
        return None
    if any(lists_present):
        return "arrays: send the six arrays either as lists or packed in 'arrays', not both"
    return None


def packed_step_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A step record with its six lists replaced by ``arrays`` (base64), as the agent ships it.
    Returns the record unchanged (a copy) when it cannot be packed, so validation names the problem."""
    out = dict(record)
    try:
        lists = [out.pop(name) for name in STEP_ARRAYS]
        blob = pack_step_arrays(lists)
    except (KeyError, TypeError, OverflowError):
        return dict(record)
    out["arrays"] = base64.b64encode(blob).decode("ascii")
    return out


_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    INT: (int,),
    FLOAT: (int, float),
    STR: (str,),
    BOOL: (bool,),
}


def _check_value(path: str, value: Any, field: Field) -> None:
    if value is None:
        if field.nullable:
            return
        raise RecordError(f"{path}: must not be null (expected {field.type})")
    t = field.type
    if t in _SCALAR_TYPES:
        # bool is an int in Python; an int field must not silently accept True.
        if t != BOOL and isinstance(value, bool) or not isinstance(value, _SCALAR_TYPES[t]):
            raise RecordError(f"{path}: expected {t}, got {type(value).__name__}")
        if isinstance(value, int) and t == INT and not INT64_MIN <= value <= INT64_MAX:
            raise RecordError(f"{path}: {value} does not fit in a signed 64-bit integer")
        if isinstance(value, int) and field.int32 and not INT32_MIN <= value <= INT32_MAX:
            raise RecordError(f"{path}: {value} does not fit in a signed 32-bit integer")
        if (
            isinstance(value, str)
            and field.max_length is not None
            and (len(value) > field.max_length or "\x00" in value)
        ):
            raise RecordError(f"{path}: must be at most {field.max_length} characters with no NUL")
        if isinstance(value, str) and field.pattern is not None and not re.match(field.pattern, value):
            raise RecordError(f"{path}: {value!r} does not match {field.pattern}")
        return
    if t == PACKED:
        if not isinstance(value, str):
            raise RecordError(f"{path}: expected base64 text of packed arrays, got {type(value).__name__}")
        try:
            blob = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise RecordError(f"{path}: not valid base64") from None
        problem = packed_problem(blob)
        if problem:
            raise RecordError(f"{path}: {problem}")
        return
    if t == BYTES:
        if not isinstance(value, str):
            raise RecordError(f"{path}: expected base64 text, got {type(value).__name__}")
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise RecordError(f"{path}: not valid base64") from None
        return
    if t == COUNTS:
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in value.items()
        ):
            raise RecordError(f"{path}: expected an object of string -> int")
        return
    if t == OBJECT:
        _check_fields(path, value, field.item)
        return
    if not isinstance(value, list):
        raise RecordError(f"{path}: expected {t}, got {type(value).__name__}")
    if t == OBJECTS:
        for i, item in enumerate(value):
            _check_fields(f"{path}[{i}]", item, field.item)
        return
    inner = {INTS: INT, STRS: STR, FLOATS: FLOAT, INT_LISTS: INTS}[t]
    inner_field = Field(field.name, inner)
    for i, item in enumerate(value):
        _check_value(f"{path}[{i}]", item, inner_field)


def _check_fields(path: str, obj: Any, fields: tuple[Field, ...]) -> None:
    if not isinstance(obj, Mapping):
        raise RecordError(f"{path}: expected an object, got {type(obj).__name__}")
    for field in fields:
        if field.name not in obj:
            if field.required:
                raise RecordError(f"{path}.{field.name}: required field is missing")
            continue
        _check_value(f"{path}.{field.name}", obj[field.name], field)


def validate_record(record: Any, where: str = "record") -> str:
    """Check one record against the wire format; return its kind or raise ``RecordError``.

    Unknown extra fields are allowed (a newer agent may send more); missing or mistyped ones are not.
    """
    if not isinstance(record, Mapping):
        raise RecordError(f"{where}: expected an object, got {type(record).__name__}")
    kind = record.get("kind")
    if kind not in RECORD_KINDS:
        raise RecordError(f"{where}.kind: unknown kind {kind!r}; expected one of {sorted(RECORD_KINDS)}")
    _check_fields(where, record, ENVELOPE)
    _check_fields(where, record, RECORD_KINDS[kind])
    if record["seq"] < 0 or record["rank"] < 0:
        raise RecordError(f"{where}: seq and rank must be >= 0")
    if kind == "step":
        problem = step_arrays_problem("arrays" in record, [name in record for name in STEP_ARRAYS])
        if problem:
            raise RecordError(f"{where}.{problem}")
    elif kind == "step_block":
        # Imported here: step_block builds on this module's packing, and this is its one rule.
        from ddpscope.agent import step_block

        problem = step_block.problem(
            record["count"],
            base64.b64decode(record["columns"]),
            base64.b64decode(record["arrays"]),
            record["array_sizes"],
            [u["index"] for u in record["unused"]],
        )
        if problem:
            raise RecordError(f"{where}.{problem}")
    return str(kind)


def validate_batch(batch: Any) -> list[Mapping[str, Any]]:
    """Check a whole batch; return its records or raise ``RecordError`` naming the first bad field."""
    if not isinstance(batch, Mapping):
        raise RecordError("batch: expected an object with 'schema' and 'records'")
    schema = batch.get("schema")
    if schema != SCHEMA_VERSION:
        raise RecordError(
            f"batch.schema: version {schema!r} is not supported; this collector speaks {SCHEMA_VERSION}"
        )
    records = batch.get("records")
    if not isinstance(records, list):
        raise RecordError("batch.records: expected a list of records")
    for i, record in enumerate(records):
        validate_record(record, f"records[{i}]")
    return records


def idempotency_key(record: Mapping[str, Any]) -> tuple[str, int, str, int]:
    return (record["job"], record["rank"], record["stream"], record["seq"])


SHIPPER_STREAM_MARK = ".shipper-"
"""A shipper's own records (its ``agent_stats``) go in ``<stream>.shipper-<pid>``: see ``shipper_stream``."""


def shipper_stream(stream: str, pid: int) -> str:
    """The stream of the shipper (process ``pid``) that ships the agent stream ``stream``."""
    return f"{stream}{SHIPPER_STREAM_MARK}{pid}"


def is_shipper_stream(stream: str) -> bool:
    """Whether a record came from a rank's shipper rather than the rank's process. The shipper outlives
    its rank to send what the rank left, so its records' times say nothing of the rank being alive."""
    return SHIPPER_STREAM_MARK in stream
