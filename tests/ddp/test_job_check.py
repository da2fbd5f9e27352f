"""The job id check over a real c10d TCPStore: each "rank" is a thread with its own client connection, as
each process of a job has (``ddp/job_check.py``). The 2-rank jobs at a real collector are in
``tests/server/test_job_ids_differ_jobs.py``."""

from __future__ import annotations

import contextlib
import datetime
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch.distributed as dist

import ddpscope.ddp  # noqa: F401  (wraps init_process_group, as a user's import does)
from ddpscope import agent
from ddpscope.agent.records import JOB_IDS_DIFFER, validate_record
from ddpscope.ddp import job_check, monitor
from ddpscope.ddp.job_check import JobCheck
from ddpscope.ddp.job_ids_text import Claim, id_source, job_ids_message
from tests.ddp.watchdog_support import Records, in_memory_records
from tests.support.procs import free_port, kill_group

TIMEOUT = datetime.timedelta(seconds=10)
DEADLINE_S = 60.0
"""Every thread a test starts is joined within this; none may be left running."""
SETTLE_S = 0.2
"""How long differing ids must stay so in these tests (the product waits ``job_check.SETTLE_S``)."""


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT, wait_for_workers=False)
    yield store


def client(server: dist.TCPStore) -> dist.Store:
    """One rank's own connection, under the prefix torch gives the default group's store."""
    return dist.PrefixStore("default_pg", dist.TCPStore("127.0.0.1", server.port, 1, False, TIMEOUT))


def run_ranks(
    server: dist.TCPStore,
    jobs: Mapping[int, str],
    world_size: int | None = None,
    collectors: Mapping[int, str] | None = None,
    codes: dict[int, str] | None = None,
    **kw: Any,
) -> dict[int, str | None]:
    """Run every rank of ``jobs`` (rank -> job id; ``collectors``: rank -> its DDPSCOPE_URL) at once on
    threads; return each one's message (and fill ``codes`` with each one's warning code)."""
    world = world_size or len(jobs)
    kw.setdefault("settle_s", SETTLE_S)
    url = collectors or {}
    checks = [
        JobCheck(client(server), r, world,
                 claim=lambda r=r: Claim(jobs[r], "DDPSCOPE_JOB", f"node{r}", url.get(r, "http://c:8321")), **kw)
        for r in jobs
    ]  # fmt: skip
    out: dict[int, str | None] = {}
    errors: list[BaseException] = []

    def one(check: JobCheck) -> None:
        try:
            out[check.rank] = check.run()
        except BaseException as e:  # re-raised below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in checks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a check outlived the deadline"
    if errors:
        raise errors[0]
    if codes is not None:
        codes.update((c.rank, c.code) for c in checks)
    return out


def wait_until(done: Callable[[], object]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.02)


def test_ranks_that_share_one_job_id_say_nothing(server: dist.TCPStore) -> None:
    assert run_ranks(server, dict.fromkeys(range(4), "train")) == dict.fromkeys(range(4), None)


def test_every_rank_gets_the_same_words_naming_each_id_its_ranks_and_the_odd_one_out(
    server: dist.TCPStore,
) -> None:
    said = run_ranks(server, {0: "train", 1: "oops", 2: "train", 3: "train"})
    (message,) = set(said.values())  # the same on every rank: one incident per job at the collector
    assert message is not None
    assert (
        "under 2 job ids: 'train' (ranks 0, 2, 3; DDPSCOPE_JOB) and 'oops' (rank 1; DDPSCOPE_JOB)" in message
    )
    assert "Probably misconfigured: rank 1 on node1 (the fewer ranks)" in message
    assert "Give every rank the same DDPSCOPE_JOB, or unset it on every rank" in message


def test_ranks_under_one_id_that_send_to_different_collectors_are_told_which_and_the_odd_one_out(
    server: dist.TCPStore,
) -> None:
    # One node's DDPSCOPE_URL differs: its ranks' records never reach the job's collector, which then calls
    # them "never reported".
    codes: dict[int, str] = {}
    said = run_ranks(
        server, dict.fromkeys(range(3), "train"), collectors={2: "http://typo:8321"}, codes=codes
    )
    (message,) = set(said.values())
    assert message is not None
    assert (
        "the ranks of job 'train' send their records to 2 collector URLs: 'http://c:8321' (ranks 0, 1) and "
        "'http://typo:8321' (rank 2). Probably misconfigured: rank 2 on node2 (the fewer ranks)" in message
    )
    assert "Give every rank the same DDPSCOPE_URL." in message
    assert set(codes.values()) == {"collectors_differ"}


def test_on_a_tie_the_ranks_whose_id_differs_from_rank_0s_are_named(server: dist.TCPStore) -> None:
    said = run_ranks(server, {0: "a", 1: "b"})
    assert said[0] == said[1] and said[0] is not None
    assert "Probably misconfigured: rank 1 on node1 (as many ranks use each id; rank 0's is taken" in said[0]


def test_a_peer_that_never_says_its_id_is_waited_for_until_the_deadline_only(server: dist.TCPStore) -> None:
    # Rank 2 never publishes (ddpscope disabled there, or it died): the others decide on what they have.
    assert run_ranks(server, {0: "train", 1: "train"}, world_size=3, wait_s=0.5) == {0: None, 1: None}


def test_ids_that_differ_are_told_without_the_rank_that_never_said_its_own(server: dist.TCPStore) -> None:
    said = run_ranks(server, {0: "train", 1: "oops"}, world_size=3, wait_s=0.5)
    assert said[0] is not None and "Rank 2 had said nothing after" in said[0]


def test_ids_that_agree_again_within_the_settle_time_are_not_told(server: dist.TCPStore) -> None:
    # Rank 1 is loaded: the check finds its id from the environment, and the script's agent.configure(job=...)
    # comes a second later. Said at once, both jobs would get a false job_ids_differ incident.
    ids = {0: "train", 1: "from-env"}
    threading.Timer(1.0, ids.__setitem__, args=(1, "train")).start()
    assert run_ranks(server, ids, settle_s=5.0) == {0: None, 1: None}


def test_a_job_id_the_script_sets_after_the_check_began_is_the_one_compared(server: dist.TCPStore) -> None:
    # Rank 1 first publishes the id it had from the environment, then the script configures the agent.
    ids = {1: "from-env"}
    checks_started = threading.Event()

    def rank1_claim() -> Claim:
        checks_started.set()
        return Claim(ids[1])

    late = JobCheck(client(server), 1, 2, claim=rank1_claim)
    result: list[str | None] = []
    t = threading.Thread(target=lambda: result.append(late.run()), daemon=True)
    t.start()
    assert checks_started.wait(DEADLINE_S)
    ids[1] = "train"  # agent.configure(job="train") on rank 1
    store = client(server)
    wait_until(
        lambda: (
            store.check(["ddpscope/job_check/0/rank/1"])
            and b'"train"' in store.get("ddpscope/job_check/0/rank/1")
        )
    )
    assert JobCheck(store, 0, 2, claim=lambda: Claim("train")).run() is None
    t.join(DEADLINE_S)
    assert result == [None]


def test_claims_an_earlier_torchrun_attempt_left_in_the_store_are_not_read(server: dist.TCPStore) -> None:
    # torchrun keeps one store across restarts: attempt 0's keys are still there in attempt 1.
    said = run_ranks(server, {0: "a", 1: "b"}, restart="0")
    assert said[0] is not None
    assert run_ranks(server, {0: "a", 1: "a"}, restart="1") == {0: None, 1: None}


def test_a_store_that_is_gone_ends_the_check_in_a_debug_line_and_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    code = (
        "import datetime, sys, time, torch.distributed as d\n"
        f"s = d.TCPStore('127.0.0.1', {port}, 2, True, datetime.timedelta(seconds=30), wait_for_workers=False)\n"
        "print('up', flush=True)\n"
        "time.sleep(120)\n"
    )
    host = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "up"
        store = dist.TCPStore("127.0.0.1", port, 2, False, TIMEOUT)
        check = JobCheck(store, 0, 2, claim=lambda: Claim("train"), wait_s=DEADLINE_S)
        with caplog.at_level(logging.DEBUG, logger="ddpscope.ddp.job_check"):
            check.start()
            kill_group(host)  # rank 0's process, which hosted the store, died
            host.wait(DEADLINE_S)
            assert check.wait(DEADLINE_S)
    finally:
        kill_group(host)
        host.wait(DEADLINE_S)
    assert check.message is None
    (line,) = [r for r in caplog.records if "job id check of rank 0 stopped" in r.getMessage()]
    assert line.levelno == logging.DEBUG and line.exc_info is not None


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=0)


def test_a_difference_is_logged_and_sent_as_a_warning_record_from_the_checks_thread(
    server: dist.TCPStore, records: Records, caplog: pytest.LogCaptureFixture
) -> None:
    checks = [
        JobCheck(
            client(server), r, 2, claim=lambda r=r: Claim(("a", "b")[r], "DDPSCOPE_JOB"), settle_s=SETTLE_S
        )
        for r in (0, 1)
    ]
    with caplog.at_level(logging.WARNING, logger="ddpscope.ddp.job_check"):
        for c in checks:
            c.start()
        assert all(c.wait(DEADLINE_S) for c in checks)
    sent = records("warning")  # checked against the wire format
    assert len(sent) == 2 and {w["code"] for w in sent} == {JOB_IDS_DIFFER} and sent[0]["step"] is None
    assert sent[0]["message"] == sent[1]["message"] == checks[0].message
    assert "ddpscope: rank 1: the ranks of this torch job report to ddpscope under 2 job ids" in caplog.text


def test_nothing_is_checked_in_a_world_of_one_or_before_a_default_group_exists(records: Records) -> None:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    assert job_check.start() is None  # no group yet
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert job_check.start() is None and job_check.current() is None
        assert not [t for t in threading.enumerate() if t.name == "ddpscope-job-check"]
        store = dist.distributed_c10d._get_default_store()
        assert not store.check(["ddpscope/job_check/0/n"])
    finally:
        monitor.disable()
        dist.destroy_process_group()
    assert records("warning") == []


def test_only_torchs_own_stores_are_used_from_a_second_thread(server: dist.TCPStore) -> None:
    class PythonStore(dist.Store):  # a user's store: no promise about threads
        pass

    assert job_check._thread_safe(client(server))
    assert job_check._thread_safe(dist.HashStore())
    assert not job_check._thread_safe(PythonStore())
    assert not job_check._thread_safe(dist.PrefixStore("default_pg", PythonStore()))


@contextlib.contextmanager
def fake_world_of_two() -> Iterator[dist.Store]:
    """This process as rank 0 of 2 (torch's fake backend, no peer process) over a real HashStore, the
    group made through ddpscope's wrapper of ``init_process_group``; yields the default group's store."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        yield dist.distributed_c10d._get_default_store()
    finally:
        monitor.disable()
        dist.destroy_process_group()


def test_the_group_made_through_the_wrapper_starts_one_check_whose_warning_goes_through_the_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(job_check, "SETTLE_S", SETTLE_S)
    exporter = agent.InMemoryExporter()
    agent.configure(exporter=exporter, job="train", rank=0, heartbeat_s=0.2)
    try:
        with fake_world_of_two() as store:
            check = job_check.current()
            assert check is not None and job_check.start() is check  # once per default group
            # Rank 1, played here over the same store, was started with another DDPSCOPE_JOB.
            peer = JobCheck(store, 1, 2, claim=lambda: Claim("oops", "DDPSCOPE_JOB"), settle_s=SETTLE_S)
            said = peer.run()
            assert check.wait(DEADLINE_S) and check.message == said and said is not None
            assert "'train' (rank 0; " in said and "'oops' (rank 1; DDPSCOPE_JOB)" in said
        agent.get_agent().force_flush(5.0)
    finally:
        agent.shutdown()
    (sent,) = [r for r in exporter.records if r["kind"] == "warning"]
    validate_record(sent)
    assert sent["code"] == JOB_IDS_DIFFER and sent["message"] == said and sent["rank"] == 0


def test_disabled_ddpscope_publishes_nothing_and_starts_no_thread() -> None:
    agent.configure(disabled=True)
    try:
        with fake_world_of_two() as store:
            assert job_check.current() is None and job_check.start() is None
            monitor.enable()
            assert job_check.current() is None
            assert not [t for t in threading.enumerate() if t.name == "ddpscope-job-check"]
            assert not store.check(["ddpscope/job_check/0/n"])
    finally:
        agent.shutdown()


@pytest.mark.parametrize(
    ("environ", "job", "source"),
    [
        ({"DDPSCOPE_JOB": "exp1", "TORCHELASTIC_RUN_ID": "r"}, "exp1", "DDPSCOPE_JOB"),
        ({"DDPSCOPE_JOB": "a/b"}, "a_b", "DDPSCOPE_JOB"),  # made valid the same way by the agent
        ({"DDPSCOPE_JOB": "exp1"}, "other", "code"),  # configure(job="other") in the script
        ({"TORCHELASTIC_RUN_ID": "run-7"}, "run-7", "TORCHELASTIC_RUN_ID"),
        (
            {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"},
            "slurm-12.0",
            "SLURM",
        ),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "29500", "WORLD_SIZE": "2"}, None, "launcher"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "29500"}, "mine", "code"),
        ({}, "job-0123456789ab", "unknown"),  # nothing to agree on: random, or set in the script
    ],
)
def test_the_setting_an_id_came_from_is_named(environ: dict[str, str], job: str | None, source: str) -> None:
    from ddpscope.agent.config import default_job_id

    assert id_source(job or default_job_id(environ), environ) == source


def test_a_launch_where_every_rank_derived_its_own_id_is_told_in_bounded_words() -> None:
    claims = {r: Claim(f"job-{r:012x}", "launcher", f"node{r}") for r in range(1000)}
    message = job_ids_message(claims, 1000, 1.0)
    assert message is not None and "under 1000 job ids" in message and "and 992 more." in message
    assert "derive different ids: set DDPSCOPE_JOB" in message and len(message) < 2000


def test_claims_that_agree_make_no_message() -> None:
    def same(r: int) -> Claim:
        return Claim("train", "TORCHELASTIC_RUN_ID" if r else "DDPSCOPE_JOB")

    assert job_ids_message({r: same(r) for r in range(3)}, 3, 1.0) is None
