"""The diagnosis on real failures: 2-rank gloo jobs with ddpscope's engine stream to a real collector,
and its incidents endpoint must name the culprit rank, the call site or the parameters. The failures
are run again with torch's own DDP observed by ``instrument()`` (issue 7: the watchdog, the recorder and
the incidents work the same as with the engine), against a second collector started after the first
batch, so the two batches do not load the 2 cores at once.

This file is also the rank script (``python test_incidents_jobs.py SCENARIO STEPS ENGINE``, run once
per rank by the tests below; torch is imported only there). Every job has a deadline and every rank is killed by
pid when its test ends (a SIGSTOPped rank included).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FAULT_STEP = 3
"""Step at which the injected fault happens: after a few healthy steps (layout, collectives, heartbeats)."""


# ------------------------------------------------------------------------------------- the rank script


def rank_main(scenario: str, steps: int, engine: str) -> None:  # pragma: no cover - runs in the ranks
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddpscope.agent import get_agent
    from ddpscope.ddp import DistributedDataParallel, instrument
    from tests.support.job_end import destroy_together
    from tests.support.job_start import start_monitored_rank

    rank = start_monitored_rank()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(16, 32)
            self.head = nn.Linear(32, 4)
            self.aux = nn.Linear(32, 4)
            self.use_aux = True
            # Buffers, which DDP broadcasts from rank 0 at the start of every forward.
            self.norm = nn.BatchNorm1d(32) if scenario == "stuck" else nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.norm(self.body(x)))
            return self.head(h) + self.aux(h) if self.use_aux else self.head(h)

    def reduce_sum(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)  # SITE:sum

    def reduce_max(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # SITE:max

    net = Net()
    unused = scenario == "unused"
    if engine == "torch":
        model: nn.Module = instrument(nn.parallel.DistributedDataParallel(net, find_unused_parameters=unused))
    else:
        model = DistributedDataParallel(net, find_unused_parameters=unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for step in range(steps):
        if step == FAULT_STEP and scenario == "skip_backward" and rank == 1:
            model(x)  # a bad batch skipped after its forward: this rank runs one gradient sync fewer
            continue
        if step == FAULT_STEP:
            a, b = torch.ones(4), torch.ones(4)
            if scenario == "sigstop" and rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            elif scenario == "stuck" and rank == 1:
                time.sleep(300)  # alive, beating, stuck (a deadlocked data loader)  # SITE:stuck
            elif scenario in ("sigkill", "retry") and rank == 1:
                get_agent().force_flush(2.0)
                os.kill(os.getpid(), signal.SIGKILL)
            elif scenario == "one_rank_only" and rank == 0:
                dist.all_reduce(torch.ones(3))  # SITE:one_rank_only
            elif scenario == "order":
                # The same two helper calls, in the opposite order on rank 1: gloo sums silently wrong.
                for reduce in (reduce_sum, reduce_max) if rank == 0 else (reduce_max, reduce_sum):
                    reduce(a if reduce is reduce_sum else b)
            elif scenario == "shapes":
                dist.all_reduce(torch.ones(4 + rank))  # SITE:shapes
            elif scenario in ("unused", "skipped") and rank == 1:
                net.use_aux = False
            elif scenario == "early_exit" and rank == 1:
                sys.exit(0)  # its loop ends early (a shorter data shard, a rank-dependent break)
            elif scenario == "diverged" and rank == 0:
                # A checkpoint loaded on rank 0 only, after wrapping: DDP broadcast the state long ago.
                net.load_state_dict({k: v + 0.01 for k, v in net.state_dict().items()})
        if scenario == "retry" and step >= FAULT_STEP:
            # The survivor catches its peer's loss and retries the step (an elastic-style loop); DDP
            # must fail every retry, as no peer is left to average with, and the loop gives up.
            try:
                optimizer.zero_grad(set_to_none=True)
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                print(f"step {step}: synced with a dead peer", flush=True)
            except RuntimeError:
                print(f"step {step}: failed, retrying", flush=True)
                time.sleep(0.3)
            continue
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if scenario == "skipped_call" and not (rank == 0 and step == FAULT_STEP):
            # The loss averaged for logging, every step on every rank, but rank 0 skips it once: its next
            # bucket all-reduce meets rank 1's call (gloo aborts on the sizes).
            dist.all_reduce(loss.detach())  # SITE:logged_loss
        if scenario == "eval_grad" and rank == 0 and step == 1:
            model(x)  # an evaluation on rank 0 only that forgot no_grad: its step numbers run one ahead
    if scenario == "skip_backward" and rank == 1:
        sys.exit(0)  # its loop is over, one sync before rank 0's
    if scenario == "retry":
        sys.exit(1)  # every retry failed: the loop gives up
    dist.barrier()
    destroy_together()


if __name__ == "__main__":  # pragma: no cover
    rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    sys.exit(0)


# ------------------------------------------------------------------------------------------- the tests

import pytest  # noqa: E402

from tests.support.collector_proc import CollectorProc  # noqa: E402
from tests.support.preloaded import RankPopen  # noqa: E402
from tests.support.procs import free_port, kill_group, rank_env  # noqa: E402
from tests.support.real_job import RealJob, get_json, marked_site  # noqa: E402

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__)
SCENARIOS = (
    "healthy",
    "sigstop",
    "stuck",
    "sigkill",
    "retry",
    "one_rank_only",
    "order",
    "shapes",
    "unused",
    "skipped",
    "early_exit",
    "skip_backward",
    "diverged",
    "eval_grad",
    "skipped_call",
)
WAIT_S = 90.0
"""Deadline for one diagnosis to show up; all the jobs run at once on a 2-core machine."""
EXIT_WAIT_S = 240.0
"""Deadline for a job to end. The first test waits from the moment its batch starts: 24 ranks importing
torch at once on 2 cores took 78-90 s to get the healthy job through 6 steps (measured), where WAIT_S
left no margin."""


def site(name: str) -> str:
    """``file:line`` of the line marked ``# SITE:<name>`` in this file."""
    return marked_site(SCRIPT, name)


def launch(url: str, scenario: str, job_id: str, spool_dir: Path, engine: str = "ddpscope") -> RealJob:
    """Start the 2 ranks of ``scenario`` streaming to ``url`` as job ``job_id``, training with
    ``engine`` ("ddpscope", or "torch": torch's DDP observed by ``instrument()``)."""
    env = {
        "DDPSCOPE_URL": url,
        "DDPSCOPE_JOB": job_id,
        # Short only where a hang is the point: elsewhere a busy machine must not look hung.
        "DDPSCOPE_HANG_TIMEOUT": "2" if scenario in ("sigstop", "stuck") else "60",
        "DDPSCOPE_HEARTBEAT_S": "0.5",
        "DDPSCOPE_SPOOL_DIR": str(spool_dir),
    }
    port = free_port()
    procs = [
        RankPopen(
            [sys.executable, str(SCRIPT), scenario, "6", engine],
            env=rank_env(rank, 2, port, env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    return RealJob(url, job_id, procs, wait_s=WAIT_S, exit_wait_s=EXIT_WAIT_S, engine=engine)


@pytest.fixture(scope="module", params=["ddpscope", "torch"])
def jobs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, RealJob]]:
    """Every scenario's job under ddpscope's engine, then (pytest groups the tests by this module-scoped
    parameter, so one batch ends before the next starts) under torch's DDP with ``instrument()``; each
    batch started at once against one real collector (the waits overlap). Tests may add jobs (key
    ``name``) with ``launch``: they are killed here too."""
    engine = request.param
    tmp = tmp_path_factory.mktemp(f"{engine}-jobs")
    started: dict[str, RealJob] = {}
    with CollectorProc(f"sqlite:///{tmp / 'ddpscope.db'}", log_path=tmp / "collector.log") as collector:
        url = collector.start()
        try:
            for scenario in SCENARIOS:
                job_id = f"{engine}-{scenario}-{uuid.uuid4().hex[:6]}"
                started[scenario] = launch(url, scenario, job_id, tmp / "spool" / scenario, engine)
            yield started
        finally:
            for j in started.values():
                for p in j.procs:
                    kill_group(p)  # SIGKILL also ends the SIGSTOPped rank
                for p in j.procs:
                    with contextlib.suppress(Exception):
                        p.communicate(timeout=10)


def kind(incidents: list[dict[str, Any]], k: str) -> list[dict[str, Any]]:
    return [i for i in incidents if i["kind"] == k]


def test_a_healthy_real_job_gets_no_incident_and_finishes(jobs: dict[str, RealJob]) -> None:
    j = jobs["healthy"]
    assert j.exited_cleanly(), j.logs()
    j.wait_for("finished", lambda _: j.status() == "finished")
    assert j.incidents() == []


def test_an_extra_forward_on_one_rank_shifts_its_step_numbers_but_raises_nothing(
    jobs: dict[str, RealJob],
) -> None:
    j = jobs["eval_grad"]
    assert j.exited_cleanly(), j.logs()
    j.wait_for("finished", lambda _: j.status() == "finished")
    assert j.incidents() == []  # the replica digests are compared at equal sync counts, not step numbers


def test_a_sigstopped_rank_is_named_as_the_silent_culprit_of_the_hang(jobs: dict[str, RealJob]) -> None:
    j = jobs["sigstop"]
    silent = j.wait_for("rank 1 silent", lambda inc: kind(inc, "rank_silent"))
    hangs = j.wait_for("rank 0 hang", lambda inc: [h for h in kind(inc, "hang") if h["rank"] == 0])
    assert [s["culprit_ranks"] for s in silent] == [[1]]
    assert 1 in hangs[0]["culprit_ranks"] and hangs[0]["stack"]
    assert j.status() == "hung"


def test_a_rank_stuck_before_forward_is_the_culprit_of_its_peers_wait_in_the_buffer_broadcast(
    jobs: dict[str, RealJob],
) -> None:
    # Under instrument() that broadcast runs in torch's C++: recorded all the same, or no rank would be
    # seen waiting in a collective, and two ranks each stalled "in their own code" are no hang.
    j = jobs["stuck"]
    # At the fault step: with 24 ranks starting at once on 2 cores, an earlier step can outlast this job's
    # 2 s hang timeout too (a real, resolved hang, not the one under test).
    (wait,) = j.wait_for(
        "rank 0's wait",
        lambda inc: [
            h for h in kind(inc, "hang") if h["rank"] == 0 and h["culprit_ranks"] and h["step"] == FAULT_STEP
        ],
    )
    assert wait["culprit_ranks"] == [1], wait
    assert "in broadcast" in wait["message"] and "phase forward" in wait["message"], wait
    (missing,) = j.wait_for("the broadcast rank 1 never issued", lambda inc: kind(inc, "missing_collective"))
    assert missing["culprit_ranks"] == [1] and missing["seq"] == wait["seq"], missing
    # The active one: under load an earlier step of rank 1 can outlast the timeout too, and resolve.
    (own,) = j.wait_for(
        "rank 1's own report", lambda inc: [h for h in kind(inc, "hang") if h["rank"] == 1 and h["active"]]
    )
    assert own["culprit_ranks"] == [1] and site("stuck") in own["message"], own
    assert j.status() == "hung"
    # The step it hung in: rank 0 waits in its forward (the broadcast), rank 1 never began it.
    tl = get_json(f"{j.url}/api/v1/jobs/{j.job}/timeline")
    assert tl["step"] == FAULT_STEP, tl
    assert [(r["rank"], r["state"], r["phase"]) for r in tl["ranks"]] == [(0, "hung", "forward")], tl
    assert [(e["rank"], e["state"], e["phase"]) for e in tl["elsewhere"]] == [(1, "hung", "idle")], tl


def test_a_sigkilled_rank_is_the_culprit_and_the_survivors_errors_are_attached(
    jobs: dict[str, RealJob],
) -> None:
    j = jobs["sigkill"]
    j.wait_exit()
    # The survivor's "Connection closed by peer" arrives with or after the crash evidence: wait for both.
    crash = j.wait_for("rank 1 crashed", lambda inc: [c for c in kind(inc, "rank_crashed") if c["related"]])
    incidents = j.incidents()
    assert crash[0]["rank"] == 1 and crash[0]["culprit_ranks"] == [1], incidents
    assert [r["rank"] for r in crash[0]["related"]] == [0]
    assert all(0 not in i["culprit_ranks"] for i in incidents), incidents
    assert j.status() == "failed"
    # The step it died in has no step record: its timeline is the survivor's report of that step so far,
    # with the all-reduce that the peer's death broke still open.
    tl = get_json(f"{j.url}/api/v1/jobs/{j.job}/timeline")
    assert tl["step"] == FAULT_STEP, tl
    (survivor,) = tl["ranks"]
    assert (survivor["rank"], survivor["state"], survivor["phase"]) == (0, "failed", "allreduce"), survivor
    assert any(b["open"] for b in survivor["buckets"]), survivor
    # gloo words a SIGKILLed peer either way, depending on whether its socket saw the FIN or an RST.
    assert any(lost in survivor["message"] for lost in ("Connection closed", "Connection reset")), survivor


def test_a_survivor_that_retries_after_its_peer_was_killed_fails_every_retry_and_blames_the_killed_rank(
    jobs: dict[str, RealJob],
) -> None:
    j = jobs["retry"]
    j.wait_exit()
    out = j.procs[0].communicate(timeout=10)[0]
    # Every step after the peer died failed on the survivor: none synced with nobody (ddpscope's engine
    # once marked a failed all-reduce done when it polled it, and trained on alone).
    assert "synced with a dead peer" not in out, out
    assert out.count("failed, retrying") == 3, out
    crash = j.wait_for("rank 1 crashed", lambda inc: [c for c in kind(inc, "rank_crashed") if c["related"]])
    incidents = j.incidents()
    assert crash[0]["culprit_ranks"] == [1], incidents
    # The lost connections the loop caught, and its giving up (sys.exit(1)), are the crash's victims.
    related = crash[0]["related"]
    assert {r["rank"] for r in related} == {0}, related
    assert any(r["error_type"] == "SystemExit" for r in related), related
    assert all(0 not in i["culprit_ranks"] for i in incidents), incidents
    assert j.status() == "failed"


def test_a_user_all_reduce_issued_on_one_rank_only_names_that_rank_and_its_line(
    jobs: dict[str, RealJob],
) -> None:
    # gloo aborts one of the ranks on the size mismatch: rank 0's record of its call must still arrive.
    m = jobs["one_rank_only"].wait_for("the extra all_reduce", lambda inc: kind(inc, "mismatch"))
    assert m[0]["culprit_ranks"] == [0], m
    assert (m[0]["call_site"] or "").endswith(site("one_rank_only")), m


def test_a_rank_that_skipped_a_call_every_rank_makes_each_step_is_the_culprit_not_the_ranks_that_made_it(
    jobs: dict[str, RealJob],
) -> None:
    # The mirror of one_rank_only: by sequence alone rank 1 issued one collective more. Every rank made the
    # call in each earlier step, so the rank that went on to its next backward without it is at fault.
    m = jobs["skipped_call"].wait_for("the skipped loss all_reduce", lambda inc: kind(inc, "mismatch"))
    assert m[0]["culprit_ranks"] == [0], m
    assert site("logged_loss") in m[0]["message"], m


def test_same_shape_collectives_in_a_different_order_are_flagged(jobs: dict[str, RealJob]) -> None:
    j = jobs["order"]
    m = j.wait_for("the swapped reductions", lambda inc: kind(inc, "mismatch"))
    assert m[0]["culprit_ranks"] == [1] and m[0]["call_site"].endswith(site("max")), m
    assert "opposite order" in m[0]["message"]
    # gloo does not notice: both ranks finish, with silently wrong sums.
    assert j.exited_cleanly(), j.logs()


def test_mismatched_shapes_are_flagged_although_gloo_aborts_the_process(jobs: dict[str, RealJob]) -> None:
    m = jobs["shapes"].wait_for("the shape mismatch", lambda inc: kind(inc, "mismatch"))
    assert (
        m[0]["call_site"].endswith(site("shapes")) and "[4]" in m[0]["message"] and "[5]" in m[0]["message"]
    )
    assert m[0]["culprit_ranks"] == [1]


def test_parameters_unused_on_one_rank_are_named_with_that_rank(jobs: dict[str, RealJob]) -> None:
    u = jobs["unused"].wait_for("aux unused on rank 1", lambda inc: kind(inc, "unused_parameters"))
    assert u[0]["culprit_ranks"] == [1]
    assert sorted(u[0]["parameters"]) == ["aux.bias", "aux.weight"]
    assert u[0]["bucket"] is not None


def test_parameters_one_rank_skipped_without_find_unused_parameters_are_named_with_that_rank(
    jobs: dict[str, RealJob],
) -> None:
    # The engine raises at the end of that backward on every rank; torch on the skipping rank only, in its
    # next forward, naming parameter indices: the diagnosis is the same.
    j = jobs["skipped"]
    u = j.wait_for("aux skipped on rank 1", lambda inc: kind(inc, "unused_parameters"))
    assert u[0]["culprit_ranks"] == [1], u
    assert sorted(u[0]["parameters"]) == ["aux.bias", "aux.weight"], u
    j.wait_exit()
    j.wait_for("failed", lambda _: j.status() == "failed")


def test_a_rank_that_exits_cleanly_while_its_peer_trains_on_is_the_culprit(jobs: dict[str, RealJob]) -> None:
    j = jobs["early_exit"]
    j.wait_exit()
    early = j.wait_for("rank 1 exited early", lambda inc: kind(inc, "rank_exited_early"))
    assert [(e["rank"], e["culprit_ranks"], e["step"]) for e in early] == [(1, [1], FAULT_STEP - 1)]
    assert "rank 0" in early[0]["message"]
    # The survivor's lost connection arrives with or after the exit: then it is blamed on rank 1 too.
    j.wait_for("rank 0's lost connection", lambda inc: [i for i in kind(inc, "rank_error") if i["rank"] == 0])
    incidents = j.incidents()
    assert all(i["culprit_ranks"] == [1] for i in incidents), incidents
    assert j.status() == "failed"


def test_a_rank_that_skipped_a_backward_ran_out_of_batches_one_sync_early_and_is_the_culprit(
    jobs: dict[str, RealJob],
) -> None:
    j = jobs["skip_backward"]
    j.wait_exit()
    (early,) = j.wait_for("rank 1 exited early", lambda inc: kind(inc, "rank_exited_early"))
    assert early["culprit_ranks"] == [1], early
    assert "It ran 1 more forward pass without a backward than rank 0" in early["message"], early
    j.wait_for("rank 0's lost connection", lambda inc: [i for i in kind(inc, "rank_error") if i["rank"] == 0])
    assert all(i["culprit_ranks"] == [1] for i in j.incidents()), j.incidents()
    assert j.status() == "failed"


def test_a_checkpoint_loaded_on_one_rank_after_wrapping_is_caught_as_diverged_replicas(
    jobs: dict[str, RealJob],
) -> None:
    j = jobs["diverged"]
    assert j.exited_cleanly(), j.logs()  # nothing fails: the ranks just train different models
    (d,) = j.wait_for("diverged replicas", lambda inc: kind(inc, "replicas_diverged"))
    assert d["step"] == FAULT_STEP + 1 and f"they were identical at step {FAULT_STEP - 1}" in d["message"]
    assert sorted(d["parameters"]) == sorted(
        ["body.weight", "body.bias", "head.weight", "head.bias", "aux.weight", "aux.bias"]
    )
    assert j.status() == "finished"


def test_a_crashed_job_restarted_under_the_same_id_is_healthy_and_keeps_the_crash_as_history(
    jobs: dict[str, RealJob], tmp_path: Path
) -> None:
    crashed = jobs["sigkill"]
    crashed.wait_exit()
    crashed.wait_for("rank 1 crashed", lambda inc: kind(inc, "rank_crashed"))
    # torchrun --max-restarts: new processes of every rank, same job id.
    jobs["sigkill-restarted"] = again = launch(
        crashed.url, "healthy", crashed.job, tmp_path / "spool", crashed.engine
    )
    assert again.exited_cleanly(), again.logs()
    again.wait_for("finished", lambda _: again.status() == "finished")
    incidents = again.incidents()
    assert all(i["active"] is False for i in incidents), incidents
    history = [(i["kind"], i["culprit_ranks"]) for i in incidents]
    assert ("rank_crashed", [1]) in history, incidents
