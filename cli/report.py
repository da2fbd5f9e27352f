"""`ddpscope report JOB`: the diagnosis in the terminal, from the collector's API (no second analysis).

Strings that come from training processes (job ids, parameter names, stacks, messages) are printed
through ``safe()``: a hostile name must not be able to move the cursor or rewrite the terminal.
"""

from __future__ import annotations

import datetime
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddpscope.agent.config import sanitized_job_id
from ddpscope.agent.records import MAX_JOB_LENGTH
from ddpscope.cli.client import Client, CollectorError

# C0/C1 control characters and DEL, except newline and tab which stacks legitimately contain, and the
# Unicode direction overrides/isolates, which can make a printed name read as something else.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def safe(value: Any, *, multiline: bool = False) -> str:
    text = _CONTROL.sub("?", str(value))
    return text if multiline else text.replace("\n", " ").replace("\t", " ")


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def when(epoch_s: Any, now_s: float | None = None) -> str:
    """``2026-11-22 10:59:17 UTC (3 min ago)`` for an aligned-clock time in seconds."""
    if not isinstance(epoch_s, (int, float)) or epoch_s <= 0:
        return "-"
    stamp = datetime.datetime.fromtimestamp(epoch_s, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    age = (time.time() if now_s is None else now_s) - epoch_s
    if age < 0:
        return stamp
    ago = f"{age:.0f} s" if age < 120 else f"{age / 60:.0f} min" if age < 7200 else f"{age / 3600:.0f} h"
    return f"{stamp} ({ago} ago)"


def _rank_process(rank: int, processes: dict[int, dict[str, Any]]) -> str:
    """``1 (pid 4242 on node-3)``: the process to look at; the bare rank when it never announced itself."""
    proc = processes.get(int(rank))
    if not proc or proc.get("pid") is None:
        return str(rank)
    return f"{rank} (pid {proc['pid']} on {safe(proc.get('host'))})"


def _fmt_bytes(n: Any) -> str:
    """Bucket sizes and memory: B and whole KiB, tenths of MiB and GiB; '?' for a value that is no number."""
    if not isinstance(n, (int, float)):
        return "?"
    if n < 1 << 20:
        return f"{n:.0f} B" if n < 1024 else f"{n / 1024:.0f} KiB"
    return f"{n / (1 << 20):.1f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.1f} GiB"


FEW_BUCKETS = 2
"""At most this many buckets: the all-reduce waits for (nearly) the whole backward whatever their size."""
SMALL_BUCKET_BYTES = 1 << 20
MANY_BUCKETS = 8
"""This many buckets of a quarter of SMALL_BUCKET_BYTES or less: a bucket cap set too small."""
"""Below this median bucket size, splitting buckets further adds per-call cost rather than overlap."""


def _median_of(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the rows that have it, None when none has."""
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def _overlap_section(
    steps: list[dict[str, Any]], stragglers: Sequence[int] = (), bucket_bytes: Sequence[int] = ()
) -> list[str]:
    """The overlap table and a verdict; ``stragglers``: the flagged ranks, whose peers' exposed
    communication is mostly time spent waiting for them, not a bucket layout to tune; ``bucket_bytes``:
    the layout's bucket sizes, already too small to split further when their median is small."""
    synced = [s for s in steps if s.get("comm_s")]
    if not steps:
        return ["No step records yet."]
    lines = []
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for s in steps:
        by_rank.setdefault(int(s["rank"]), []).append(s)
    lines.append(
        f"{'rank':>4}  {'steps':>5}  {'step (median)':>13}  {'comm':>9}  {'exposed':>9}  {'overlap':>7}"
    )
    for rank, rows in sorted(by_rank.items()):
        # Synchronised steps only: a no_sync() step has no all-reduce, and its short step time next to
        # the synced steps' comm would read as more communication exposed than the step lasts.
        step_values = [r["step_s"] for r in rows if r.get("step_s") is not None and r.get("synced", True)]
        comm_rows = [r for r in rows if r.get("comm_s")]
        overlap = statistics.median(r["overlap_ratio"] for r in comm_rows) if comm_rows else None
        lines.append(
            f"{rank:>4}  {len(step_values):>5}  {_fmt_s(statistics.median(step_values) if step_values else None):>13}  "
            f"{_fmt_s(statistics.median(r['comm_s'] for r in comm_rows) if comm_rows else None):>9}  "
            f"{_fmt_s(statistics.median(r['exposed_comm_s'] for r in comm_rows) if comm_rows else None):>9}  "
            f"{'-' if overlap is None else f'{overlap:.0%}':>7}"
        )
    unsynced = sum(1 for s in steps if s.get("synced") is False)
    if unsynced:
        lines.append(f"{unsynced} no_sync() step(s) (no all-reduce) are left out of the medians.")
    if synced:
        overlap_all = statistics.median(s["overlap_ratio"] for s in synced)
        exposed = statistics.median(s["exposed_comm_s"] for s in synced)
        step = statistics.median(s["step_s"] for s in synced)
        if overlap_all >= 0.5:
            verdict = "communication is mostly hidden behind backward"
        elif stragglers:
            slow = ", ".join(str(r) for r in stragglers)
            verdict = (
                f"most all-reduce time is exposed after backward, and the other ranks spend it waiting for "
                f"straggler rank{'s' if len(stragglers) > 1 else ''} {slow} (see Stragglers): make "
                f"{'them' if len(stragglers) > 1 else 'it'} as fast as the others first; smaller buckets "
                "would not shorten that wait"
            )
        elif (
            len(bucket_bytes) >= MANY_BUCKETS
            and (median_bytes := statistics.median(bucket_bytes)) < SMALL_BUCKET_BYTES / 4
        ):
            verdict = (
                f"most all-reduce time is exposed after backward, spread over {len(bucket_bytes)} small buckets "
                f"(median {_fmt_bytes(median_bytes)}): each all-reduce pays a fixed cost whatever its size, so "
                "fewer, larger buckets (a larger bucket_cap_mb; torch's default is 25) cut the communication "
                "time, and more work per rank and step hides the rest"
            )
        elif (
            bucket_bytes
            and len(bucket_bytes) <= FEW_BUCKETS
            and (backward := _median_of(synced, "backward_s"))
            and backward >= 2 * (comm := statistics.median(s["comm_s"] for s in synced))
        ):
            # All of the gradients in one or two buckets: the all-reduce can only start near the end of
            # the backward, however long the backward is. Splitting them lets it start earlier.
            whole = sum(bucket_bytes)
            verdict = (
                f"most all-reduce time is exposed after backward: the gradients ({_fmt_bytes(whole)}) fit in "
                f"{len(bucket_bytes)} bucket{'s' if len(bucket_bytes) > 1 else ''}, whose all-reduce starts only "
                f"once the backward has produced all of {'their' if len(bucket_bytes) > 1 else 'its'} "
                f"gradients; the backward ({_fmt_s(backward)}) is long enough to hide the communication "
                f"({_fmt_s(comm)}): a smaller bucket_cap_mb (about {whole / 4 / (1 << 20):.2g}, four buckets) "
                "starts the all-reduces while the backward still runs"
            )
        elif bucket_bytes and (median_bytes := statistics.median(bucket_bytes)) < SMALL_BUCKET_BYTES:
            verdict = (
                f"most all-reduce time is exposed after backward, although the {len(bucket_bytes)} "
                f"bucket{'s are' if len(bucket_bytes) > 1 else ' is'} already small (median "
                f"{_fmt_bytes(median_bytes)}): smaller ones would only add per-call cost; the backward "
                "is too short to hide the communication (more work per rank and step hides more)"
            )
        else:
            verdict = (
                "most all-reduce time is exposed after backward: consider smaller buckets "
                "(bucket_cap_mb) or a model whose backward is long enough to hide it"
            )
        lines.append(
            f"Overall: median overlap {overlap_all:.0%}, exposed comm {_fmt_s(exposed)} "
            # step_s runs from forward start to backward end: the optimizer step and data loading between
            # steps are not in it, so the share is named for what it is a share of.
            f"({exposed / step:.0%} of forward + backward): {verdict}."
            if step
            else f"Overall: median overlap {overlap_all:.0%}."
        )
    return lines


def known_jobs(items: list[dict[str, Any]], shown: int = 10) -> str:
    """The most recently seen jobs first (the one a user mistyped is likely among them), and how
    many more there are, so a long list is never silently cut."""

    def last_seen(j: dict[str, Any]) -> float:
        v = j.get("last_seen")
        return float(v) if isinstance(v, (int, float)) else float("-inf")

    recent = sorted(items, key=last_seen, reverse=True)
    names = ", ".join(safe(j.get("job")) for j in recent[:shown]) or "none"
    rest = len(recent) - shown
    return names + (f", ... and {rest} more: ddpscope jobs" if rest > 0 else "")


@dataclass
class Stopped:
    """The step a job hung or crashed in, which no rank finished (the timeline draws it from the ranks'
    reports): per rank a line saying where it stopped, and the buckets whose all-reduce was in flight."""

    step: int
    ranks: list[tuple[str, list[int]]]


def stopped_step(client: Client, job: str) -> Stopped | None:
    """``Stopped`` from the collector's timeline of the job's latest step; None when every rank finished it."""
    try:
        tl = client.get(client.job_path(job, "timeline"))
    except CollectorError:
        return None
    unfinished = [r for r in tl.get("ranks", []) if r.get("state", "completed") != "completed"]
    if not unfinished:
        return None

    def where(x: dict[str, Any]) -> str:
        if x.get("phase") == "idle":
            return f"{safe(x['state'])} between steps"
        return f"{safe(x['state'])} in {safe(x['phase'])}" if x.get("phase") else safe(x["state"])

    ranks = []
    for r in unfinished:
        in_flight = [int(b["index"]) for b in r.get("buckets", []) if b.get("open")]
        names = f"bucket{'s' if len(in_flight) > 1 else ''} {', '.join(map(str, in_flight))}"
        ranks.append(
            (
                f"rank {r['rank']} {where(r)}" + (f", all-reduce of {names} in flight" if in_flight else ""),
                in_flight,
            )
        )
    for e in tl.get("elsewhere", []):
        at = (
            ""
            if e.get("step") is None
            else f" {'after' if e.get('phase') == 'idle' else 'at'} step {e['step']}"
        )
        ranks.append((f"rank {e['rank']} {where(e)}{at}", []))
    return Stopped(int(tl["step"]), ranks)


def _stopped_section(stopped: Stopped, buckets: list[dict[str, Any]]) -> list[str]:
    out = ["", f"== Where it stopped: step {stopped.step}, which no rank finished"]
    layout = {b["index"]: b for b in buckets}
    for line, in_flight in stopped.ranks:
        out.append(f"- {line}")
        for k in in_flight:
            names = [safe(p) for p in layout.get(k, {}).get("parameters", [])]
            if names:
                more = f" and {len(names) - 6} more" if len(names) > 6 else ""
                out.append(f"  bucket {k}: {', '.join(names[:6])}{more}")
    return out


def sampled_words(sampled: dict[str, Any]) -> str:
    """ ", at train.py:16, waiting for its DataLoader's workers (15 of 15 samples taken there)": where a
    straggler's slow phase was sampled most (its ``/stragglers`` item's ``sampled``)."""
    loader = ", waiting for its DataLoader's workers" if sampled.get("loader") else ""
    return (
        f", at {safe(sampled['site'])}{loader} ({sampled['samples']} of {sampled['of']} samples taken there)"
    )


def unknown_job(client: Client, job: str) -> LookupError:
    """The error for a job the collector does not know, listing the jobs it does; when the name is not a
    valid job id, the id the agent reported that DDPSCOPE_JOB under instead (it warned so at start)."""
    items = client.items("/api/v1/jobs")
    stored = sanitized_job_id(job)
    if stored != job and any(j.get("job") == stored for j in items):
        return LookupError(
            f"no job {safe(job)!r} at the collector: that is not a valid job id (no '/', no control "
            f"characters, at most {MAX_JOB_LENGTH} characters), and ddpscope reported it as {safe(stored)!r}; "
            f"ask for that one (ddpscope report {safe(stored)!r})"
        )
    return LookupError(f"no job {safe(job)!r} at the collector (known jobs: {known_jobs(items)})")


def render_report(client: Client, job: str) -> tuple[str, int]:
    """Return the report text and how many problems it found (active incidents + stragglers)."""
    try:
        info = client.get(client.job_path(job))
    except CollectorError as e:
        if e.status != 404:
            raise
        raise unknown_job(client, job) from None
    processes = {int(r["rank"]): r for r in info.get("ranks", [])}
    out = [
        f"ddpscope report for job {safe(job)}",
        f"status: {safe(info.get('status'))}   world size: {info.get('world_size')}   "
        f"last seen: {when(info.get('last_seen'))}",
        "",
    ]
    incidents = client.items(client.job_path(job, "incidents"))
    stragglers = client.items(client.job_path(job, "stragglers"))
    stalls = client.items(client.job_path(job, "stalls"))
    unused_page = client.page(client.job_path(job, "unused-parameters"))
    unused = list(unused_page.get("items") or [])
    buckets = client.items(client.job_path(job, "buckets"))
    steps = client.items(client.job_path(job, "steps"), limit=2000)

    active = [i for i in incidents if i.get("active", True)]
    history = len(incidents) - len(active)
    out.append(
        f"== Incidents ({len(active)}{f', and {history} resolved or before a restart' if history else ''})"
    )
    for inc in incidents:
        current = inc.get("active", True)
        where = [f"rank {inc['rank']}" if inc.get("rank") is not None else None]
        where += [f"step {inc['step']}" if inc.get("step") is not None else None]
        where += [f"collective #{inc['seq']}" if inc.get("seq") is not None else None]
        where += [f"bucket {inc['bucket']}" if inc.get("bucket") is not None else None]
        state = "" if current else " (history)"
        out.append(f"- [{safe(inc.get('kind'))}]{state} {', '.join(w for w in where if w)}".rstrip())
        out.append(f"  {safe(inc.get('message'))}")
        if inc.get("culprit_ranks"):
            # The pid and host are the rank's current process: not the one a history incident is about.
            culprits = ", ".join(_rank_process(r, processes if current else {}) for r in inc["culprit_ranks"])
            out.append(f"  culprit ranks: {culprits}")
        if inc.get("parameters"):
            out.append(f"  parameters: {', '.join(safe(p) for p in inc['parameters'])}")
        if inc.get("call_site"):
            out.append(f"  call site: {safe(inc['call_site'])}")
        if inc.get("stack"):
            stack = _stack_tail(safe(inc["stack"], multiline=True), call_site=inc.get("call_site"))
            out.extend("  | " + line for line in stack)
    if not incidents:
        out.append("none")
    if info.get("status") in ("hung", "failed") and (stopped := stopped_step(client, job)):
        out += _stopped_section(stopped, buckets)

    out += ["", f"== Stragglers ({sum(1 for s in stragglers if s.get('flagged', True))})"]
    flagged = [s for s in stragglers if s.get("flagged", True)]
    for s in flagged:
        phase = f", mostly in {safe(s['phase']).replace('_', ' ')}" if s.get("phase") else ""
        if sampled := s.get("sampled"):
            phase += sampled_words(sampled)
        out.append(
            f"- rank {s['rank']}: {s['slowdown']:.2f}x slower than the median of the others "
            f"in {s.get('steps_flagged')} recent steps{phase}"
        )
        if s.get("contention"):
            out.append(f"  but {safe(s['contention'])}")
    if not flagged:
        out.append("none: no rank is consistently slower than the others")
    for st in stalls:
        out.append(f"- now and then: {safe(st['message'])}")
        sampled = st.get("sampled") or {}
        if sampled.get("stack"):
            stack = _stack_tail(safe(sampled["stack"], multiline=True), call_site=sampled.get("site"))
            out.extend("  | " + line for line in stack)

    out += ["", "== Overlap of communication with backward"]
    sizes = [int(b["bytes"]) for b in buckets if isinstance(b.get("bytes"), int)]
    out += _overlap_section(steps, [int(s["rank"]) for s in flagged], sizes)

    out += ["", f"== Unused parameters ({len(unused)})"]
    for u in unused:
        msg = u.get("message") or ""
        out.append(
            f"- {safe(u['name'])}: ranks {', '.join(str(r) for r in u.get('ranks', []))}, "
            f"{u.get('steps')} steps {safe(msg)}".rstrip()
        )
    if not unused:
        out.append("none")
    if unused_page.get("advice"):  # find_unused_parameters set to no purpose, or needed and unset
        out.append(safe(unused_page["advice"]))

    disordered = [b for b in buckets if b.get("out_of_order")]
    out += ["", f"== Buckets ({len(buckets)})"]
    if disordered:
        worst = max(disordered, key=lambda b: b.get("order_penalty_s") or 0.0)
        out.append(
            f"{len(disordered)} bucket(s) became ready out of index order; the worst, bucket {worst['index']}, "
            f"waited {_fmt_s(worst.get('order_penalty_s'))} a step on average for earlier buckets."
        )
        if worst.get("advice"):  # the collector's: it knows whether the buckets were rebuilt
            out.append(safe(worst["advice"]))
    elif buckets:
        out.append("all buckets became ready in index order: no order penalty")
    out += _memory_section(_memory(client, job))
    problems = len(active) + len(flagged) + len(stalls)
    return "\n".join(out) + "\n", problems


MEMORY_ROWS = 16
"""Ranks listed in the memory section at most: the growing ones first, then the largest."""


def _memory(client: Client, job: str) -> list[dict[str, Any]]:
    """The job's ``/memory`` items; none from a collector older than that endpoint."""
    try:
        return client.items(client.job_path(job, "memory"))
    except CollectorError as e:
        if e.status == 404:
            return []
        raise


def _memory_section(ranks: list[dict[str, Any]]) -> list[str]:
    out = ["", f"== Memory ({len(ranks)} ranks)"]
    if not ranks:
        return [*out, "no memory records (each rank sends one every 30 s, on Linux)"]
    shown = sorted(ranks, key=lambda r: (not r.get("growing"), -int(r.get("rss_bytes") or 0)))[:MEMORY_ROWS]
    out.append(f"{'rank':>4}  {'resident':>10}  {'workers':>10}  {'left where it runs':>22}  growing")
    for r in sorted(shown, key=lambda r: int(r["rank"])):
        left = f"{_fmt_bytes(r.get('available_bytes'))} of {_fmt_bytes(r.get('total_bytes'))}"
        grows = (
            f"+{_fmt_bytes(r['bytes_per_min'])}/min" if r.get("growing") and r.get("bytes_per_min") else "no"
        )
        if r.get("growing") and r.get("growing_in") == "workers":
            grows += " (its DataLoader workers)"
        workers = "-" if r.get("workers_bytes") is None else _fmt_bytes(r.get("workers_bytes"))
        out.append(
            f"{r['rank']:>4}  {_fmt_bytes(r.get('rss_bytes')):>10}  {workers:>10}  {left:>22}  {grows}"
        )
    hidden = [r for r in ranks if r not in shown]
    if hidden:
        growing = sum(1 for r in hidden if r.get("growing"))
        out.append(
            f"... {len(hidden)} more ranks, {growing or 'none'} of them growing (GET /memory has them all)"
        )
    return out


def _stack_tail(stack: str, lines: int = 8, call_site: str | None = None) -> list[str]:
    """The innermost frames of one thread, and how many other threads the API and the dashboard show in
    full. The thread is the one running the incident's ``call_site`` (the innermost line of user code),
    else faulthandler's current thread, else the first (the main thread, in a hang report's dump of every
    thread). A crash dump from faulthandler lists the innermost frame first and, when a thread that is not
    Python's aborted (gloo's), its newest thread first: usually a ddpscope thread, not the main one.
    When the frames shown are all inside libraries (a DataLoader waiting on its worker queue is eight
    frames of multiprocessing), the frame of ``call_site`` comes first."""
    blocks = [b for b in stack.strip().split("\n\n") if b.strip()]
    threads = [b for b in blocks if b.startswith(("Thread ", "Current thread "))]
    if len(threads) < 2:
        return _with_call_site(_innermost_last(stack.rstrip().splitlines()), lines, call_site)
    chosen = next((t for t in threads if _site_index(t.splitlines(), call_site) is not None), None)
    chosen = chosen or next((t for t in threads if t.startswith("Current thread ")), threads[0])
    head, *frames = _innermost_last(chosen.splitlines())
    more = len(threads) - 1
    return [
        f"{head.rstrip(':')} (innermost frames)",
        *_with_call_site(frames, lines, call_site),
        f"... {more} other thread{'s' if more > 1 else ''}: see the incidents API or the dashboard",
    ]


def _innermost_last(stack_lines: list[str]) -> list[str]:
    """Frames in traceback order (innermost last). faulthandler writes "(most recent call first)" and one
    line a frame: those lines are reversed, their header saying so."""
    if not stack_lines or "(most recent call first)" not in stack_lines[0]:
        return stack_lines
    head = stack_lines[0].replace("(most recent call first)", "(most recent call last)")
    return [head, *reversed(stack_lines[1:])]


_FRAME_AT = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+)')


def _site_index(frames: list[str], call_site: str | None) -> int | None:
    """Where the frame of ``call_site`` ("path:line", the path maybe relative to the job's working
    directory) is among ``frames`` (traceback or faulthandler lines), or None."""
    path, _, line = (call_site or "").rpartition(":")
    if not path:
        return None
    for i, f in enumerate(frames):
        m = _FRAME_AT.search(f)
        if m and m["line"] == line and (m["path"] == path or m["path"].endswith("/" + path.lstrip("./"))):
            return i
    return None


def _with_call_site(frames: list[str], lines: int, call_site: str | None) -> list[str]:
    """The last ``lines`` of ``frames``, led by the frame of ``call_site`` ("path:line") and a count of
    the frames left out when that frame is not among them."""
    tail = frames[-lines:]
    at = _site_index(frames, call_site)
    if at is None or at >= len(frames) - lines:
        return tail
    site = (
        frames[at : at + 2] if at + 1 < len(frames) and "File " not in frames[at + 1] else frames[at : at + 1]
    )
    start = len(frames) - max(2, lines - len(site) - 1)
    while start > at + len(site) and "File " not in frames[start]:
        start -= 1  # begin at a frame's first line, not with the source line of a frame left out
    skipped = sum("File " in f for f in frames[at + len(site) : start])
    return [
        *site,
        f"  ... {skipped} frame{'s' if skipped != 1 else ''} inside libraries ...",
        *frames[start:],
    ]
