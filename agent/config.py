"""Agent configuration: explicit argument > ``DDPSCOPE_*`` environment variable > default.

Every variable name is a constant here with its default in the docstring. ``Config.from_env(environ)``
takes any mapping, so tests pass a plain dict. A bad environment value logs a warning and falls back
to the default (a typo in a launcher script must not stop a training job); a bad explicit argument
raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import tempfile
import unicodedata
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ddpscope.agent.log import get_logger
from ddpscope.agent.records import MAX_JOB_LENGTH

logger = get_logger(__name__)

DDPSCOPE_URL = "DDPSCOPE_URL"
"""Collector base URL; records are POSTed to ``<url>/api/v1/ingest``. Default ``http://127.0.0.1:8321``."""
DDPSCOPE_JOB = "DDPSCOPE_JOB"
"""Job id. Default ``TORCHELASTIC_RUN_ID`` (unless torchrun's placeholder ``none``), else derived
from the launch (see ``default_job_id``). An invalid value is made valid by ``sanitized_job_id``
(the same in every rank) and the warning names the id used."""
DDPSCOPE_TOKEN = "DDPSCOPE_TOKEN"
"""Bearer token sent with every ingest request. Default: none."""
DDPSCOPE_SPOOL_DIR = "DDPSCOPE_SPOOL_DIR"
"""Where batches wait until the collector acknowledges them. Default ``<tmp>/ddpscope-<uid>/<job>``."""
DDPSCOPE_HANG_TIMEOUT = "DDPSCOPE_HANG_TIMEOUT"
"""Seconds without progress before the watchdog (ddp/) emits a hang report, at least ``MIN_HANG_TIMEOUT_S``
(a smaller value is raised to it, with a warning). Default 300."""
MIN_HANG_TIMEOUT_S = 1.0
"""The shortest hang timeout: under a second, ordinary work between progress marks (a slow batch, a
checkpoint write, the interpreter's own pauses) reads as a hang, and every step prints a hang report and
its resolution."""
DDPSCOPE_HEARTBEAT_S = "DDPSCOPE_HEARTBEAT_S"
"""Seconds between heartbeats emitted by the watchdog (ddp/). Default 2.0."""
DDPSCOPE_MEMORY_INTERVAL_S = "DDPSCOPE_MEMORY_INTERVAL_S"
"""Seconds between the watchdog's ``memory`` records (agent/memory.py); a jump is sent at once. Default 30."""
DDPSCOPE_DISABLED = "DDPSCOPE_DISABLED"
"""``1`` (or true/yes/on) turns the agent into a null object: no threads, no files, no hooks. Default unset."""
DDPSCOPE_QUEUE_SIZE = "DDPSCOPE_QUEUE_SIZE"
"""Records held in memory before ``emit`` starts dropping (and counting). Default 100000."""
DDPSCOPE_SPOOL_MAX_MB = "DDPSCOPE_SPOOL_MAX_MB"
"""Disk cap of one rank's spool in MiB; over it the oldest batches are dropped and counted. Default 256."""
DDPSCOPE_FLUSH_INTERVAL_S = "DDPSCOPE_FLUSH_INTERVAL_S"
"""Delay of the worker's spool round after an idle spell (busy rounds are at least 0.25 s apart): the
crash-loss window of records that are not written ahead (``emit`` of an ordinary kind). Default 0.02."""
DDPSCOPE_HTTP_TIMEOUT_S = "DDPSCOPE_HTTP_TIMEOUT_S"
"""Timeout of one ingest request (connect + answer). Default 10."""
DDPSCOPE_RETRY_MAX_S = "DDPSCOPE_RETRY_MAX_S"
"""Cap of the exponential backoff between retries, in seconds. Default 5."""
DDPSCOPE_SHIPPER_LINGER_S = "DDPSCOPE_SHIPPER_LINGER_S"
"""How long the shipper keeps retrying after its rank is gone; then the spool stays on disk for the
next agent of the same job. Default 600."""
DDPSCOPE_CHECK_GRADIENTS = "DDPSCOPE_CHECK_GRADIENTS"
"""``1`` (or true/yes/on): both engines check every gradient bucket for NaN and Inf before its all-reduce,
to name the rank, bucket and parameters where a NaN arose inside backward (``ddp/nonfinite.py``). A
debugging mode: one pass over all gradients a step (~25 us per MiB on this machine's CPU). Default unset."""
DDPSCOPE_NOTICE_AFTER_S = "DDPSCOPE_NOTICE_AFTER_S"
"""Seconds the collector may accept nothing (unreachable, busy, failing) before the rank's stderr
gets one line about it (read by the shipper). A wrong URL or a refused batch is told at once.
Default 30."""

DEFAULT_URL = "http://127.0.0.1:8321"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def default_job_id(environ: Mapping[str, str]) -> str:
    """The job id every rank of one launch agrees on without talking to each other.

    In order, the first that applies:

    1. torchrun's ``TORCHELASTIC_RUN_ID`` (unless its placeholder ``none``, left by a static
       rendezvous without ``--rdzv-id``).
    2. ``slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>`` when the ranks are several tasks of one ``srun``
       step (``SLURM_STEP_NUM_TASKS`` > 1: one rank per task, or one torchrun per node): those
       tasks, on every host, share that pair and nothing else, and every ``srun`` is a new step.
       A single-task step (``srun torchrun`` on one node, an interactive ``srun --pty bash``)
       starts all its ranks under one launcher, where rule 3 tells consecutive launches apart.
    3. A hash of ``MASTER_ADDR:MASTER_PORT``, ``WORLD_SIZE`` and the parent pid: the ranks of one
       launch on one host share their launcher (torchrun, ``mp.spawn``). ``MASTER_ADDR:MASTER_PORT``
       alone would merge every run on the default port 29500, so the launcher's pid stays; ranks
       on several hosts, or each under its own parent, must set ``DDPSCOPE_JOB``.
    4. A random id (a single process with no launcher).

    The result is always a valid job id (``sanitized_job_id``).
    """
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id if _valid_job(run_id) else sanitized_job_id(run_id)
    slurm_job, slurm_step = environ.get("SLURM_JOB_ID"), environ.get("SLURM_STEP_ID")
    if slurm_job and slurm_step and _int(environ.get("SLURM_STEP_NUM_TASKS")) > 1:
        return sanitized_job_id(f"slurm-{slurm_job}.{slurm_step}")
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if addr and port:
        key = f"{addr}:{port}:{environ.get('WORLD_SIZE', '')}:{os.getppid()}"
        return "job-" + hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return "job-" + uuid.uuid4().hex[:12]


def sanitized_job_id(job: str) -> str:
    """A valid job id made from an invalid one, the same in every rank (no randomness, no pid).

    ``/``, control characters and undecodable bytes (lone surrogates) become ``_``; ``.`` and ``..``
    (dot segments a URL would resolve away) become ``_`` and ``__``; an empty id becomes ``job``;
    an id over ``MAX_JOB_LENGTH`` keeps its start and ends in ``-`` and a hash of the whole id, so
    two long ids that differ only near their end stay two jobs. A valid id is returned unchanged.
    """
    text = "".join("_" if _forbidden(c) else c for c in job)
    if text in ("", ".", ".."):
        text = text.replace(".", "_") or "job"
    if len(text) > MAX_JOB_LENGTH:
        digest = hashlib.sha1(job.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        text = text[: MAX_JOB_LENGTH - len(digest) - 1] + "-" + digest
    return text


def default_spool_dir(job: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)
    if len(safe.encode()) > 100 or safe in (".", ".."):
        # A directory name has at most 255 bytes (a 200-character id can take 800): keep a
        # readable start and a hash of the whole id.
        digest = hashlib.sha1(job.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        safe = safe.encode()[:80].decode("utf-8", "ignore") + "-" + digest
    return os.path.join(tempfile.gettempdir(), f"ddpscope-{os.getuid()}", safe)


@dataclass(kw_only=True, slots=True)
class Config:
    """Everything the agent (and, read-only, the hang watchdog in ddp/) needs."""

    job: str
    """Job id; all ranks of a job must agree on it."""
    rank: int | None = None
    """Global rank (``RANK``); None in a process that is not a rank (records then carry rank 0)."""
    url: str = DEFAULT_URL
    """Collector base URL."""
    token: str | None = None
    """Bearer token for ingest, if the collector requires one."""
    spool_dir: str = ""
    """Directory for the spool, the crash file and the shipper log; default per job under the temp dir."""
    hang_timeout_s: float = 300.0
    """Seconds without progress before a hang report (read by ddp/)."""
    heartbeat_s: float = 2.0
    """Seconds between heartbeats (read by ddp/)."""
    disabled: bool = False
    """True: a null agent, no threads, files or hooks."""
    max_queue: int = 100_000
    """In-memory queue bound; emit drops and counts beyond it."""
    max_batch: int = 1000
    """Records per export call."""
    flush_interval_s: float = 0.02
    """Worker wake-up period: how long a record may sit in memory (lost on SIGKILL)."""
    spool_max_bytes: int = 256 * 2**20
    """Disk cap of the spool of one agent."""
    http_timeout_s: float = 10.0
    """Timeout of one ingest request."""
    retry_max_backoff_s: float = 5.0
    """Cap of the jittered exponential backoff."""
    shipper_linger_s: float = 600.0
    """Retry window of the shipper after its rank is gone."""
    stats_interval_s: float = 5.0
    """Seconds between ``agent_stats`` records (also sent on every flush when counts changed)."""
    check_gradients: bool = False
    """Check every gradient bucket for NaN and Inf before its all-reduce (read by ddp/)."""
    validate: bool = True
    """Check each record against the wire format in the worker: one bad record would otherwise make
    the collector reject its whole batch."""

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Build from ``environ`` (default ``os.environ``); explicit ``overrides`` win and are checked."""
        env = os.environ if environ is None else environ
        names = {f.name for f in dataclasses.fields(cls)}
        for name in overrides:
            if name not in names:
                raise ValueError(f"{name}: unknown agent setting; expected one of {sorted(names)}")
        values: dict[str, Any] = {
            "url": _env(env, DDPSCOPE_URL, str, DEFAULT_URL, _valid_url, _URL_RULE),
            "token": env.get(DDPSCOPE_TOKEN) or None,
            "hang_timeout_s": hang_timeout_from_env(env),
            "heartbeat_s": heartbeat_from_env(env),
            "disabled": _env(env, DDPSCOPE_DISABLED, _parse_bool, False),
            "check_gradients": _env(env, DDPSCOPE_CHECK_GRADIENTS, _parse_bool, False),
            "max_queue": _env(env, DDPSCOPE_QUEUE_SIZE, int, 100_000, _positive),
            "spool_max_bytes": int(
                _env(
                    env,
                    DDPSCOPE_SPOOL_MAX_MB,
                    float,
                    256.0,
                    lambda v: v * 2**20 >= 4096,
                    "at least 0.004 (4 KiB)",
                )
                * 2**20
            ),
            "flush_interval_s": _env(env, DDPSCOPE_FLUSH_INTERVAL_S, float, 0.02, _positive),
            "http_timeout_s": _env(env, DDPSCOPE_HTTP_TIMEOUT_S, float, 10.0, _positive),
            "retry_max_backoff_s": _env(env, DDPSCOPE_RETRY_MAX_S, float, 5.0, _positive),
            "shipper_linger_s": _env(env, DDPSCOPE_SHIPPER_LINGER_S, float, 600.0, _non_negative),
        }
        rank = _env(env, "RANK", int, None, _non_negative)
        if rank is None:
            rank = group_rank()
        if rank is not None:
            values["rank"] = rank
        # None means "not given" (configure(job=None) is the same as leaving it out).
        values.update({k: v for k, v in overrides.items() if v is not None or k in ("rank", "token")})
        if values.get("job") is None:
            job = env.get(DDPSCOPE_JOB)
            if job and not _valid_job(job):
                # Every rank sees the same variable: deriving the id from it (not from the launch,
                # which can differ per rank) keeps the job one job.
                used = sanitized_job_id(job)
                logger.warning(
                    "ddpscope: %s=%r is not a valid job id (%s); using %r",
                    DDPSCOPE_JOB,
                    job[:80],
                    _JOB_RULE,
                    used,
                )
                job = used
            values["job"] = job or default_job_id(env)
        if values.get("spool_dir") is None:
            values["spool_dir"] = env.get(DDPSCOPE_SPOOL_DIR) or default_spool_dir(str(values["job"]))
        return cls(**values)

    @property
    def ingest_url(self) -> str:
        return self.url.rstrip("/") + "/api/v1/ingest"


def group_rank() -> int | None:
    """The default process group's rank when one exists in this process (torch already imported; the agent
    imports nothing of it): a script launched without ``RANK`` (``torch.multiprocessing.spawn``) that
    configures the agent after ``init_process_group`` gets its rank, not rank 0 on every rank."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # a group being destroyed on another thread
        return None
    return None


def _positive(v: float) -> bool:
    return v > 0


def hang_timeout_from_env(env: Mapping[str, str]) -> float:
    """``DDPSCOPE_HANG_TIMEOUT`` (300 s if unset or bad), raised to ``MIN_HANG_TIMEOUT_S`` with a warning. Also
    what the watchdog falls back to when no agent is configured, so both read the variable one way."""
    timeout = float(_env(env, DDPSCOPE_HANG_TIMEOUT, float, 300.0, _positive, "a number of seconds > 0"))
    if timeout < MIN_HANG_TIMEOUT_S:
        # Raised, not ignored: whoever set 0.1 wants hangs reported fast, not after the 300 s default.
        logger.warning(
            "ddpscope: %s=%s is below the shortest hang timeout; using %s s (shorter, ordinary work "
            "between steps reads as a hang on every step)",
            DDPSCOPE_HANG_TIMEOUT,
            env.get(DDPSCOPE_HANG_TIMEOUT),
            MIN_HANG_TIMEOUT_S,
        )
        return MIN_HANG_TIMEOUT_S
    return timeout


def heartbeat_from_env(env: Mapping[str, str]) -> float:
    """``DDPSCOPE_HEARTBEAT_S`` (2 s if unset or bad)."""
    return float(_env(env, DDPSCOPE_HEARTBEAT_S, float, 2.0, _positive, "a number of seconds > 0"))


def memory_interval_from_env(env: Mapping[str, str]) -> float:
    """``DDPSCOPE_MEMORY_INTERVAL_S`` (30 s if unset or bad)."""
    return float(_env(env, DDPSCOPE_MEMORY_INTERVAL_S, float, 30.0, _positive, "a number of seconds > 0"))


def _non_negative(v: float) -> bool:
    return v >= 0


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(text)


def _env(
    env: Mapping[str, str],
    name: str,
    parse: Callable[[str], Any],
    default: Any,
    ok: Callable[[Any], bool] = lambda _v: True,
    rule: str = "",
) -> Any:
    """``name`` parsed and checked, else ``default`` with a warning (saying what ``rule`` it breaks)."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = parse(raw)
        if ok(value):
            return value
    except ValueError:
        pass  # falls through to the warning: a bad env value must not stop training
    why = f"it must be {rule}" if rule else "invalid"
    logger.warning("ddpscope: ignoring %s=%r (%s); using the default %r", name, raw, why, default)
    return default


_URL_RULE = "an http:// or https:// URL with a host and a valid port, e.g. http://collector:8321"


def url_problem(url: str) -> str | None:
    """What keeps ``url`` from being a collector base URL an HTTP client can open (a scheme, a host, a port
    in range), in words that follow "is", or None. Shared by the agent and the command line: a shipper
    that cannot parse its URL dies at start-up, and its records wait in the spool unsent."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port out of range or not a number)
    except ValueError as e:
        return f"not a valid URL ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not an http(s) URL with a host"
    return None


def _valid_url(value: Any) -> bool:
    return isinstance(value, str) and url_problem(value) is None


_JOB_RULE = f"1-{MAX_JOB_LENGTH} characters, no '/', no control characters, not '.' or '..'"


def _forbidden(c: str) -> bool:
    # Cc: C0/C1 controls and DEL (NUL breaks PostgreSQL, a newline breaks every log line);
    # Cs: a lone surrogate, an undecodable byte in the environment, which no UTF-8 JSON can carry.
    return c == "/" or unicodedata.category(c) in ("Cc", "Cs")


def _valid_job(job: str) -> bool:
    # The collector stores job ids in an indexed VARCHAR(MAX_JOB_LENGTH) column and serves them as
    # one URL path segment.
    return 0 < len(job) <= MAX_JOB_LENGTH and job not in (".", "..") and not any(_forbidden(c) for c in job)


def _int(text: str | None) -> int:
    try:
        return int(text or "")
    except ValueError:
        return 0


# (field, test, what it must be) for the explicit-argument check.
_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    (
        "job",
        lambda v: isinstance(v, str) and _valid_job(v),
        _JOB_RULE,
    ),
    ("rank", lambda v: v is None or (type(v) is int and v >= 0), "None or an int >= 0"),
    ("url", _valid_url, _URL_RULE),
    ("token", lambda v: v is None or isinstance(v, str), "None or a string"),
    ("spool_dir", lambda v: isinstance(v, (str, os.PathLike)) and bool(str(v)), "a directory path"),
    ("disabled", lambda v: isinstance(v, bool), "a bool"),
    ("validate", lambda v: isinstance(v, bool), "a bool"),
    ("check_gradients", lambda v: isinstance(v, bool), "a bool"),
    ("max_queue", lambda v: type(v) is int and v > 0, "an int > 0"),
    ("max_batch", lambda v: type(v) is int and v > 0, "an int > 0"),
    ("spool_max_bytes", lambda v: type(v) is int and v >= 4096, "an int >= 4096"),
)
_POSITIVE_FLOATS = (
    "hang_timeout_s",
    "heartbeat_s",
    "flush_interval_s",
    "http_timeout_s",
    "retry_max_backoff_s",
    "stats_interval_s",
)


def _check(cfg: Config) -> None:
    for name, test, what in _RULES:
        if not test(getattr(cfg, name)):
            raise ValueError(f"{name}: must be {what}, got {getattr(cfg, name)!r}")
    for name in _POSITIVE_FLOATS:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{name}: must be a number > 0, got {v!r}")
    if cfg.hang_timeout_s < MIN_HANG_TIMEOUT_S:
        raise ValueError(
            f"hang_timeout_s: must be at least {MIN_HANG_TIMEOUT_S} s (shorter, ordinary work between steps "
            f"reads as a hang), got {cfg.hang_timeout_s!r}"
        )
    v = cfg.shipper_linger_s
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ValueError(f"shipper_linger_s: must be a number >= 0, got {v!r}")
    cfg.spool_dir = os.fspath(cfg.spool_dir)
