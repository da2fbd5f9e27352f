"""Memory that grows every step, and the OOM killer behind a rank that vanished: from ``memory`` records.

Each rank's watchdog sends its resident memory and its host's (``agent/memory.py``) every 30 s. Two
questions are answered from them:

- **Is a rank leaking?** ``memory_incidents``: a rank whose resident memory grew steadily over its recent
  samples (the snapshot's last hour): by at least ``MIN_GROWTH_BYTES`` and ``MIN_GROWTH_FRACTION`` of where
  it began; in three of the four quarters of that time, the last among them (one pause, an evaluation or a
  checkpoint, is allowed); the second half still growing at ``MIN_LATE_SHARE`` of the second quarter's pace.
  Warm-up (allocator pools, a DataLoader's prefetch, optimizer state made at the first step) grows fast and
  then flattens, which the last test tells from a leak, whose pace holds. The incident says the rate per
  minute and per step (over the second half) and, from the host's available memory and the growth of its
  ranks, when the host runs out: then the kernel's OOM killer ends a rank with SIGKILL, and nothing of it
  says why.
- **Did the OOM killer end a rank?** ``note_memory``: a rank that stopped reporting with no error and no exit
  (``rank_crashed``, ``rank_silent``, ``job_silent``) gets what its last sample says: the host or its cgroup
  all but full, or full by then at the pace it grew (the OOM killer, most likely), or plenty left (not
  memory: look elsewhere).

Pure functions of a ``JobSnapshot``; a rank sends nothing on other platforms than Linux, and older
agents send nothing: then nothing is said.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ddpscope.server.analysis.incident_model import Incident, Record, capitalized, ranks_phrase
from ddpscope.server.analysis.snapshot import JobSnapshot, latest_attempt

MIN_SAMPLES = 8
"""Samples a rank needs before its growth is judged (4 minutes at the agent's 30 s)."""
MIN_SPAN_STEPS, MIN_SPAN_S = 10, 60.0
"""Steps, or else seconds, those samples must span. A rank also sends a sample whenever the memory in use
where it runs rises (another process's too), so on a busy host eight samples can come within a job's first
seconds, whose warm-up (the model, the optimizer's state, gloo's buffers) is no leak."""
MIN_GROWTH_BYTES = 64 * 2**20
MIN_GROWTH_FRACTION = 0.05
MIN_LATE_SHARE = 0.4
"""The pace of the window's second half, as a share of its second quarter's, below which growth is flattening."""
NEARLY_FULL = 0.05
"""Available memory, as a share of the host's (or the cgroup's usage left to its limit), that counts as full."""
DEATH_SLACK_S = 5.0
"""How long after a rank was last heard of its memory, at its latest pace, may fill for the OOM killer to be
named (its silence is noticed up to a heartbeat late)."""
WORKERS = "workers_bytes"
"""A ``memory`` record's field of its rank's DataLoader workers' own memory (``agent/memory.py``)."""
ANON = "anon_bytes"
"""A ``memory`` record's field of the rank's anonymous memory: its resident size less file-backed pages."""
OOM_NAMED = "OOM killer: "
"""In a vanished rank's note (``death_note``) and so its incident, once it is put down to the OOM killer."""

RECENT_SAMPLES = 4
"""The samples a rank's latest pace is measured over, for a death: a blow-up to the OOM killer can take
seconds (a batch of the wrong size, a tensor kept per step of a fast loop), too few samples for a leak's test."""


@dataclass(frozen=True, slots=True)
class Growth:
    """A rank's steady growth over its window of samples, its pace measured over the window's second half
    (the first may hold the end of a warm-up: a rank's first sample is taken before its model is built)."""

    rank: int
    first: Record
    last: Record
    bytes_per_s: float
    per_step: float | None
    """Bytes per training step, when the steps moved over that half."""
    of: str = "rss_bytes"
    """What grew: the rank's own resident memory (``rss_bytes``) or anonymous memory (``ANON``), or its
    DataLoader workers' (``WORKERS``)."""

    @property
    def in_workers(self) -> bool:
        return self.of == WORKERS


def by_rank(samples: Iterable[Record]) -> dict[int, list[Record]]:
    """The samples of each rank, oldest first."""
    out: dict[int, list[Record]] = {}
    for m in sorted(samples, key=lambda m: m["time_ns"]):
        out.setdefault(int(m["rank"]), []).append(m)
    return out


def growth(samples: Sequence[Record], of: str = "rss_bytes", until_ns: int | None = None) -> Growth | None:
    """The steady growth of ``of`` (the rank's resident memory, ``ANON``: its anonymous memory, or ``WORKERS``: its
    DataLoader workers' own memory, 0 in a sample without workers) over ``samples`` (one rank, oldest first), or None (too few samples,
    too short a span, too little growth, a quarter that did not grow, or growth that is flattening). Samples taken after the rank's
    steps stopped (its script's end: a final flush, waiting for its peers; a hang) are left out but the first:
    they say nothing of growth per step, and a leak that ran to the end of a job stays named. So are the samples
    after ``until_ns`` (the rank's exit: its teardown frees what it kept)."""
    if until_ns is not None:
        samples = [m for m in samples if m["time_ns"] <= until_ns]
    samples = _while_training(_workers_lifetime(samples) if of == WORKERS else samples)
    if len(samples) < MIN_SAMPLES:
        return None

    def size(m: Record) -> int:
        return int(m.get(of) or 0)

    first, last = samples[0], samples[-1]
    steps = int(last.get("step") or 0) - int(first.get("step") or 0)
    if steps < MIN_SPAN_STEPS and (last["time_ns"] - first["time_ns"]) / 1e9 < MIN_SPAN_S:
        return None  # too short to tell a leak from the warm-up
    grown = size(last) - size(first)
    if grown < max(MIN_GROWTH_BYTES, MIN_GROWTH_FRACTION * size(first)):
        return None
    n = len(samples)
    quarters = [samples[(i * (n - 1)) // 4] for i in range(5)]
    grew = [size(b) > size(a) for a, b in zip(quarters, quarters[1:], strict=False)]
    if sum(grew) < 3 or not grew[-1]:  # one pause allowed (an evaluation, a checkpoint), but not the last
        return None
    # The second quarter's pace against the second half's: a warm-up slows from one to the other, a leak does
    # not. Not the first quarter's: it holds the warm-up's own jump (a DataLoader worker's start, optimizer
    # state), which beside a leak's steady pace made a leak read as flattening.
    start, middle = quarters[1], quarters[2]
    early, late = size(middle) - size(start), size(last) - size(middle)
    # The pace per step when the steps moved in both: a leak of so much a step keeps its pace per step however
    # the steps' speed changes (a busier host, a slower phase); else per second.
    x_of = (
        (lambda m: float(m.get("step", 0)))
        if _moved(start, middle, "step") and _moved(middle, last, "step")
        else (lambda m: m["time_ns"] / 1e9)
    )
    early_x, late_x = x_of(middle) - x_of(start), x_of(last) - x_of(middle)
    if early_x <= 0 or late_x <= 0 or late / late_x < MIN_LATE_SHARE * early / early_x:
        return None
    recent = samples[n // 2 :]
    per_step = _slope(recent, lambda m: float(m.get("step", 0)), size)
    per_s = _slope(recent, lambda m: m["time_ns"] / 1e9, size) or 0.0
    return Growth(int(first["rank"]), first, last, per_s, per_step, of)


def _workers_lifetime(samples: Sequence[Record]) -> Sequence[Record]:
    """The samples of the rank's latest DataLoader workers while they lived: workers end with their epoch
    (unless ``persistent_workers``) or the rank's loop, and what they held goes with them."""
    end = len(samples)
    while end and not samples[end - 1].get("workers"):
        end -= 1
    start = end
    while start and samples[start - 1].get("workers"):
        start -= 1
    return samples[start:end]


def _moved(a: Record, b: Record, key: str) -> bool:
    return isinstance(a.get(key), int) and isinstance(b.get(key), int) and b[key] > a[key]


def _while_training(samples: Sequence[Record]) -> Sequence[Record]:
    """``samples`` up to the first one of the rank's last step (the later ones were taken at that step too)."""
    end = len(samples)
    while end > 1 and samples[end - 2].get("step") == samples[-1].get("step"):
        end -= 1
    return samples[:end]


def _slope(
    samples: Sequence[Record], x_of: Callable[[Record], float], y_of: Callable[[Record], int]
) -> float | None:
    """Least-squares bytes (``y_of``) per unit of ``x_of`` (seconds, steps); None when x never moved."""
    xs = [x_of(m) for m in samples]
    ys = [float(y_of(m)) for m in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else None


def headroom(sample: Record) -> tuple[int, int, str]:
    """(bytes left, bytes in all, what runs out) where the sample was taken: the cgroup's limit when it has
    one below the host's memory, else the host's available memory."""
    limit, used = sample.get("limit_bytes"), sample.get("cgroup_bytes")
    host_left = int(sample["available_bytes"])
    if isinstance(limit, int) and isinstance(used, int):
        left = limit - used
        if left < host_left:
            return max(0, left), limit, "the memory cgroup's limit"
    return host_left, int(sample["total_bytes"]), "the host's memory"


def _hosts(snapshot: JobSnapshot) -> dict[int, str]:
    return {r: str(s.get("host", "?")) for r, s in snapshot.ranks.items()}


KEPT_CAUSES = (
    "Memory that grows every step is something kept every step: a loss or an output stored with its "
    "autograd graph (losses.append(loss) instead of loss.item()), a list or dict that grows each step "
    "(metrics, a cache keyed by batch), tensors kept for logging. tracemalloc snapshots (or memray) two "
    "steps apart on one rank name the line."
)
WORKER_CAUSES = (
    "Each DataLoader worker is a process with its own copy of the Dataset, so what __getitem__ keeps (a cache, "
    "a list it appends to, decoded samples) grows in every worker; and Python objects the workers only read "
    "(a list of dicts or strings of file names, labels) are copied into each worker page by page as their "
    "reference counts change (copy-on-read), which grows with every sample read until each worker holds the "
    "whole dataset. Keep such data in numpy arrays or tensors (one object, no per-item reference counts), cap "
    "or drop the cache, or use fewer workers; the OOM killer picks the process that holds the most, often a "
    "worker ('DataLoader worker (pid N) is killed by signal: Killed')."
)


def rank_growth(samples: Sequence[Record], exited_ns: int | None = None) -> Growth | None:
    """The faster of the rank's own steady growth and its DataLoader workers' (``WORKERS``), before it
    exited: a rank whose own memory creeps up must not hide the workers' leak that will get one of them
    killed. The rank's own is its anonymous memory (``ANON``) when its samples carry it: its resident size
    also holds the code of the libraries it maps, which a busy host pages out and the rank pages in again."""
    own = ANON if samples and all(ANON in m for m in samples) else "rss_bytes"
    found = [
        g for g in (growth(samples, own, exited_ns), growth(samples, WORKERS, exited_ns)) if g is not None
    ]
    return max(found, key=lambda g: g.bytes_per_s, default=None)


def exit_times(rank_exits: Iterable[Record]) -> dict[int, int]:
    """Each rank's first ``rank_exit`` time (ns): what it sends after says nothing of its training."""
    out: dict[int, int] = {}
    for e in rank_exits:
        out[e["rank"]] = min(out.get(e["rank"], e["time_ns"]), e["time_ns"])
    return out


def memory_incidents(snapshot: JobSnapshot, live_ranks: Iterable[int]) -> list[Incident]:
    """One ``memory_growth`` incident for the ranks whose memory, or whose DataLoader workers' memory,
    grows steadily (see the module doc); inactive once none of them is live any more."""
    samples, exited = by_rank(snapshot.memory), exit_times(snapshot.rank_exits)
    grown = {r: g for r, s in samples.items() if (g := rank_growth(s, exited.get(r))) is not None}
    if not grown:
        return []
    hosts = _hosts(snapshot)
    fastest = max(grown.values(), key=lambda g: g.bytes_per_s)
    r, first, last = fastest.rank, fastest.first, fastest.last
    span_s = (last["time_ns"] - first["time_ns"]) / 1e9
    per_step = fastest.per_step
    step_text = f", {_size(per_step)} a step" if per_step is not None and per_step > 0 else ""
    others = sorted(set(grown) - {r})
    alike = f"; {ranks_phrase(others)} grew too" if others else ""
    whose = (
        f"Rank {r}'s DataLoader workers' own memory (not shared with the rank; {last.get('workers')} of them)"
        if fastest.in_workers
        else f"Rank {r}'s memory (its heap and tensors: not the libraries and files it maps)"
        if fastest.of == ANON
        else f"Rank {r}'s memory"
    )
    msg = (
        f"{whose} grew steadily from {_size(first.get(fastest.of) or 0)} to {_size(last[fastest.of])} in "
        f"{_duration(span_s)} (+{_size(fastest.bytes_per_s * 60)}/min{step_text}), at a pace that is not "
        f"flattening as a warm-up would{alike}. "
    )
    host = hosts.get(r)
    on_host = [g for q, g in grown.items() if hosts.get(q) == host] if host is not None else [fastest]
    left, total, what = headroom(last)
    pace = sum(g.bytes_per_s for g in on_host)
    if pace > 0:
        who = f"its {len(on_host)} growing ranks fill" if len(on_host) > 1 else "it fills"
        msg += (
            f"{capitalized(what)} on {host or 'its host'} had {_size(left)} of {_size(total)} left, which {who}"
            f" in ~{_duration(left / pace)} at this pace; then the kernel's OOM killer ends a rank with "
            "SIGKILL, and nothing in its log says why. "
        )
    msg += WORKER_CAUSES if fastest.in_workers else KEPT_CAUSES
    live = set(live_ranks)
    return [
        Incident(
            kind="memory_growth",
            message=msg,
            rank=r,  # no step: a leak is no place where the job stopped (the job page links such a step)
            culprit_ranks=sorted(grown),
            time_s=first["time_ns"] / 1e9,
            active=any(q in live for q in grown),
        )
    ]


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One rank's memory for the ``/memory`` endpoint: its latest sample, its growth, its samples."""

    rank: int
    host: str | None
    rss_bytes: int
    available_bytes: int
    """What is left where it runs: the host's MemAvailable, or its cgroup's limit less its usage if less."""
    total_bytes: int
    """The host's memory, or its cgroup's limit when that is lower."""
    workers_bytes: int | None
    """Its DataLoader workers' own memory (``WORKERS``) in its latest sample; None when it has none."""
    growing: bool
    """Its memory, or its workers', grows steadily (the ``memory_growth`` incident's test)."""
    growing_in: str | None
    """``"rank"`` or ``"workers"`` (its DataLoader workers) when ``growing``."""
    bytes_per_min: float | None
    """Its growth when ``growing``."""
    samples: list[tuple[float, int, int, int, int]]
    """(aligned-clock seconds, step, rss bytes, available bytes, workers' bytes or 0), oldest first, over the
    snapshot's window."""


def memory_report(
    samples: Iterable[Record], rank_starts: Sequence[Record], rank_exits: Iterable[Record] = ()
) -> list[RankMemory]:
    """Each rank's ``RankMemory``, by rank, from ``memory`` records and the job's ``rank_start`` and
    ``rank_exit`` records. All of a rank's samples are charted (a restart shows as its drop), but its growth
    is judged over its latest attempt's alone, before its exit, as the ``memory_growth`` incident judges it:
    the climb of an attempt that ended is not the current process's."""
    host = {s["rank"]: s.get("host") for s in sorted(rank_starts, key=lambda s: s["time_ns"])}
    samples = list(samples)
    current = by_rank(latest_attempt(samples, rank_starts))
    exited = exit_times(latest_attempt(list(rank_exits), rank_starts))
    out = []
    for rank, mine in sorted(by_rank(samples).items()):
        last = mine[-1]
        left, total, _ = headroom(last)
        g = rank_growth(current.get(rank, []), exited.get(rank))
        out.append(
            RankMemory(
                rank=rank,
                host=host.get(rank),
                rss_bytes=int(last["rss_bytes"]),
                available_bytes=left,
                total_bytes=total,
                workers_bytes=int(last[WORKERS]) if isinstance(last.get(WORKERS), int) else None,
                growing=g is not None,
                growing_in=None if g is None else "workers" if g.in_workers else "rank",
                bytes_per_min=g.bytes_per_s * 60 if g is not None else None,
                samples=[
                    (
                        m["time_ns"] / 1e9,
                        int(m.get("step", 0)),
                        int(m["rss_bytes"]),
                        headroom(m)[0],
                        int(m.get(WORKERS) or 0),
                    )
                    for m in mine
                ],
            )
        )
    return out


def death_note(snapshot: JobSnapshot, rank: int, gone_s: float | None) -> str:
    """What a vanished rank's last ``memory`` sample says of the OOM killer ('' without one): named when
    the host (or cgroup) was all but full, or would have been by ``gone_s`` (when the rank was last heard
    of) plus ``DEATH_SLACK_S`` at the pace its ranks grew; ruled out when far from full."""
    found = _last_state(snapshot, rank, gone_s, "it went silent")
    if found is None:
        return ""
    state, left, total, pace, gap_s = found
    heading = "Memory cgroup out of memory" if "cgroup" in state else "Out of memory"
    pid = snapshot.ranks.get(rank, {}).get("pid")  # unknown for a restart's earlier processes
    line = f"'{heading}: Killed process {pid}'" if pid else f"'{heading}: Killed process' and the rank's pid"
    kernel_log = f"The kernel's log on its host (dmesg, journalctl -k) says {line}."
    if left <= NEARLY_FULL * total:
        return f" Its memory points at the kernel's {OOM_NAMED}{state}. {kernel_log}"
    if pace > 0 and left / pace <= gap_s + DEATH_SLACK_S:
        return (
            f" Its memory points at the kernel's {OOM_NAMED}{state}, and the memory of the ranks on its host grew "
            f"{_pace(pace)}, enough to fill it by then. {kernel_log}"
        )
    if left >= 0.25 * total:
        return f" Not for lack of memory, as far as its last sample shows: {state}."
    return ""


def allocation_note(snapshot: JobSnapshot, rank: int, error_s: float | None, message: str) -> str:
    """The memory behind a rank's failed allocation ('' without a sample): where it and its host stood and,
    when torch says how much it asked for, whether that could ever have fit."""
    found = _last_state(snapshot, rank, error_s, "the error")
    if found is None:
        return ""
    state, left, total, pace, _ = found
    grew = f"; the memory of the ranks on its host grew {_pace(pace)}" if pace > 0 else ""
    note = f" When last sampled, {state}{grew}."
    asked = _ASKED.search(message)
    if asked is not None:
        n = int(asked.group(1))
        if n > total:
            note += (
                f" The allocation alone asked for {_size(n)}, more than the {_size(total)} there are: a size "
                "computed wrong (a dimension multiplied in, a whole dataset in one batch), not memory used up."
            )
        elif n < left:
            note += (
                f" The allocation ({_size(n)}) would have fitted in what was left then: the memory filled since, "
                "or a limit of the process's own (ulimit -v) refused it."
            )
    return note


_ASKED = re.compile(r"tried to allocate (\d+) bytes")


def _last_state(
    snapshot: JobSnapshot, rank: int, event_s: float | None, event: str
) -> tuple[str, int, int, float, float] | None:
    """(what the rank's last sample says, bytes left, bytes in all, its host's growth in bytes/s, seconds from
    that sample to ``event_s``), or None without a sample."""
    samples = by_rank(snapshot.memory)
    mine = samples.get(rank)
    if not mine:
        return None
    last = mine[-1]
    left, total, what = headroom(last)
    at_s = last["time_ns"] / 1e9
    gap_s = max(0.0, (event_s or at_s) - at_s)
    state = (
        f"rank {rank} held {_holding(last)} and {what} had {_size(left)} of {_size(total)} left "
        f"({gap_s:.0f} s before {event})"
    )
    hosts = _hosts(snapshot)
    host = hosts.get(rank)
    pace = sum(_recent_pace(s) for q, s in samples.items() if hosts.get(q) == host)
    return state, left, total, pace, gap_s


def _recent_pace(samples: Sequence[Record]) -> float:
    """Bytes per second the resident memory grew over the last ``RECENT_SAMPLES`` samples (0 if it shrank)."""
    recent = samples[-RECENT_SAMPLES:]
    if len(recent) < 2:
        return 0.0
    return max(0.0, _slope(recent, lambda m: m["time_ns"] / 1e9, held) or 0.0)


def held(sample: Record) -> int:
    """What a rank holds of its host's memory: its resident memory and its DataLoader workers' own."""
    return int(sample["rss_bytes"]) + int(sample.get(WORKERS) or 0)


def _holding(sample: Record) -> str:
    """The resident size of a sample, with its workers' own memory when it has workers."""
    workers = int(sample.get("workers") or 0)
    if not workers:
        return _size(sample["rss_bytes"])
    return (
        f"{_size(sample['rss_bytes'])} (and its {workers} DataLoader worker{'s' if workers > 1 else ''} "
        f"{_size(sample.get(WORKERS) or 0)} of their own)"
    )


MEMORY_ERRORS = (
    "can't allocate memory",
    "Cannot allocate memory",
    "MemoryError",
    "std::bad_alloc",
    "is killed by signal: Killed",
)
"""A rank's own error that says host memory ran out (torch's CPU allocator, ENOMEM, Python, C++) or that the
OOM killer took one of its DataLoader workers."""


def note_memory(
    incidents: Sequence[Incident], snapshot: JobSnapshot, last_alive_s: Mapping[int, float]
) -> None:
    """Append what the ranks' memory says to the incidents it explains: ``death_note`` to a vanished rank's
    (``rank_crashed``, ``rank_silent``; ``job_silent``'s rank that fell quiet first, else the first rank whose
    memory points at the OOM killer), ``allocation_note`` to a rank's error of a failed allocation or a
    worker the OOM killer took."""
    for inc in incidents:
        if inc.kind in ("rank_crashed", "rank_silent", "job_silent") and inc.rank is not None:
            inc.message += death_note(snapshot, inc.rank, last_alive_s.get(inc.rank))
        elif inc.kind == "job_silent":
            for r in sorted(last_alive_s):
                note = death_note(snapshot, r, last_alive_s[r])
                if OOM_NAMED in note:
                    inc.message += f" Rank {r}:{note.replace(' Its memory', ' its memory', 1)}"
                    break
        elif (
            inc.kind == "rank_error" and inc.rank is not None and any(e in inc.message for e in MEMORY_ERRORS)
        ):
            inc.message += allocation_note(snapshot, inc.rank, inc.time_s, inc.message)


def note_oom_loop(incidents: Sequence[Incident], earlier: Sequence[Sequence[Incident]]) -> None:
    """Append to the current attempt's OOM kills how many earlier attempts (``earlier``: each attempt's
    history incidents) the OOM killer ended too: each restart starts the same climb, and the restart budget
    goes on it."""
    attempts = sum(1 for a in earlier if any(i.kind == "rank_crashed" and OOM_NAMED in i.message for i in a))
    if not attempts:
        return
    for inc in incidents:
        if (
            inc.active
            and inc.kind in ("rank_crashed", "rank_silent", "job_silent")
            and OOM_NAMED in inc.message
        ):
            inc.message += (
                f" The OOM killer ended {attempts} earlier attempt{'s' if attempts > 1 else ''} of this job too: "
                "a restart climbs to the same end. Make each rank need less memory (a smaller batch, fewer "
                "DataLoader workers, the leak above fixed) or give it more before restarting it again."
            )


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _pace(bytes_per_s: float) -> str:
    """+1.2 GiB/min, or per second when that fast (a blow-up)."""
    if bytes_per_s * 60 >= 2**30 * 10:
        return f"+{_size(bytes_per_s)}/s"
    return f"+{_size(bytes_per_s * 60)}/min"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
