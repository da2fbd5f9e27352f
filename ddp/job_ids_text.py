"""The words of the job id check (``job_check.py``): each rank's claim, where its id came from, and the
warning when the ranks' claims differ, the same on every rank for the same claims."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from ddpscope.agent.config import default_job_id, sanitized_job_id
from ddpscope.agent.rank_spans import ranks_text

MAX_IDS_NAMED = 8
"""Job ids a message lists (a launch where every rank derived its own id could have thousands)."""
SOURCES = {
    "DDPSCOPE_JOB": "DDPSCOPE_JOB",
    "TORCHELASTIC_RUN_ID": "TORCHELASTIC_RUN_ID",
    "SLURM": "SLURM_JOB_ID",
    "launcher": "derived from MASTER_ADDR/MASTER_PORT and the launcher's pid",
    "code": "set in the script (configure(job=...))",
    "unknown": "set in the script, or generated at random",
}
"""Where a claimed id came from (``id_source``), as the message says it."""


@dataclass(frozen=True, slots=True)
class Claim:
    """The job id one rank reports under, where it came from (a ``SOURCES`` key) and the rank's host."""

    job: str
    source: str = "unknown"
    host: str = ""
    collector: str = ""
    """The collector the rank sends its records to (its ``DDPSCOPE_URL``): a rank sending elsewhere is as
    lost to its job's collector as one reporting under another id."""

    def encode(self) -> bytes:
        return json.dumps(
            {"job": self.job, "source": self.source, "host": self.host, "collector": self.collector}
        ).encode()

    @staticmethod
    def decode(raw: bytes) -> Claim:
        value = json.loads(raw)
        return Claim(
            str(value["job"]),
            str(value.get("source", "unknown")),
            str(value.get("host", "")),
            str(value.get("collector", "")),
        )

    @property
    def destination(self) -> str:
        """Where the rank's records end up: its job at its collector (what the ranks must share)."""
        return f"{self.job}\n{self.collector}"


def id_source(job: str, environ: Mapping[str, str]) -> str:
    """Which setting gave this process ``job`` (a ``SOURCES`` key), read as ``agent/config.py`` reads them."""
    explicit = environ.get("DDPSCOPE_JOB")
    if explicit:
        return "DDPSCOPE_JOB" if job in (explicit, sanitized_job_id(explicit)) else "code"
    derived = default_job_id(environ)
    if job != derived:
        # Random when nothing in the environment names the launch: then two calls disagree.
        return "code" if derived == default_job_id(environ) else "unknown"
    if environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return "TORCHELASTIC_RUN_ID"
    return "SLURM" if derived.startswith("slurm-") else "launcher"


def job_ids_message(claims: Mapping[int, Claim], world_size: int, waited_s: float) -> str | None:
    """The warning (written without the rank: the collector adds who said it) when ``claims`` name more
    than one job id; None when they agree. The same claims give the same words on every rank, so the
    collector folds the ranks of one job that said it into one incident."""
    by_job: dict[str, list[int]] = {}
    for rank, claim in sorted(claims.items()):
        by_job.setdefault(claim.job, []).append(rank)
    if len(by_job) < 2:
        return None
    order, misconfigured = _majority(by_job, claims, "id")
    ids = []
    for job in order[:MAX_IDS_NAMED]:
        sources = sorted({SOURCES.get(claims[r].source, "?") for r in by_job[job]})
        ids.append(f"{job!r} ({ranks_text(by_job[job])}; {' or '.join(sources)})")
    if len(order) > MAX_IDS_NAMED:
        ids.append(f"{len(order) - MAX_IDS_NAMED} more")
    text = (
        f"the ranks of this torch job report to ddpscope under {len(order)} job ids: "
        f"{', '.join(ids[:-1])} and {ids[-1]}. {misconfigured} "
    )
    missing = sorted(set(range(world_size)) - set(claims))
    if missing:
        text += f"{capital(ranks_text(missing))} had said nothing after {waited_s:.0f} s. "
    text += (
        "Each id is a job of its own at the collector, whose diagnosis calls the other ids' ranks silent or "
        "never seen. Give every rank the same DDPSCOPE_JOB, or unset it on every rank and let torchrun's "
        "TORCHELASTIC_RUN_ID name the job."
    )
    if any(c.source == "launcher" for c in claims.values()):
        text += (
            " Ranks on several hosts, or each under its own launcher, derive different ids: set DDPSCOPE_JOB."
        )
    return text


def capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def collectors_message(claims: Mapping[int, Claim]) -> str | None:
    """The warning when ``claims`` share one job id but send to more than one collector; None otherwise
    (differing ids are ``job_ids_message``'s). Same claims, same words on every rank."""
    by_url: dict[str, list[int]] = {}
    for rank, claim in sorted(claims.items()):
        by_url.setdefault(claim.collector, []).append(rank)
    if len(by_url) < 2 or len({c.job for c in claims.values()}) > 1:
        return None
    order, misconfigured = _majority(by_url, claims, "collector")
    urls = [f"{url!r} ({ranks_text(by_url[url])})" for url in order[:MAX_IDS_NAMED]]
    if len(order) > MAX_IDS_NAMED:
        urls.append(f"{len(order) - MAX_IDS_NAMED} more")
    job = next(iter(claims.values())).job
    return (
        f"the ranks of job {job!r} send their records to {len(order)} collector URLs: {', '.join(urls[:-1])} "
        f"and {urls[-1]}. {misconfigured} Unless these name one collector, each sees only its ranks of the job "
        "and its diagnosis calls the others silent or never seen (a collector that hears from every rank says "
        "nothing). Give every rank the same DDPSCOPE_URL."
    )


def _majority(
    groups: Mapping[str, list[int]], claims: Mapping[int, Claim], what: str
) -> tuple[list[str], str]:
    """The values of ``groups`` (value -> ranks), most ranks first (on a tie the lowest rank's, rank 0's when
    it said, is the job's), and "Probably misconfigured: ranks ... on hosts (why)." for the others."""
    order = sorted(groups, key=lambda value: (-len(groups[value]), groups[value][0]))
    odd = sorted(r for value in order[1:] for r in groups[value])
    tie = len(groups[order[0]]) == len(groups[order[1]])
    hosts = sorted({claims[r].host for r in odd if claims[r].host})
    on = f" on {', '.join(hosts)}" if 0 < len(hosts) <= 3 else ""
    first = groups[order[0]][0]
    why = f"as many ranks use each {what}; rank {first}'s is taken as the job's" if tie else "the fewer ranks"
    return order, f"Probably misconfigured: {ranks_text(odd)}{on} ({why})."
