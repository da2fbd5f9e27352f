"""Cross-rank diagnosis over synthetic snapshots built from wire-shaped records.

Every record goes through ``validate_record`` first, so these scenarios use exactly the fields the
agent sends; ``snapshot_from_records`` turns them into the ``JobSnapshot`` the collector builds.
"""

from __future__ import annotations

from typing import Any

import pytest

from ddpscope.agent.records import validate_record
from ddpscope.server.analysis.incidents import Incident, diagnose
from ddpscope.server.analysis.snapshot import JobSnapshot, snapshot_from_records
from ddpscope.server.analysis.status import job_status

T0 = 1_700_000_000.0
"""Job start, aligned-clock seconds."""


class JobRecords:
    """Builds one job's records the way its ranks would emit them."""

    def __init__(self, world: int = 2, job: str = "job-a") -> None:
        self.world, self.job = world, job
        self.records: list[dict[str, Any]] = []
        self._seq: dict[int, int] = {}
        self._incarnation: dict[int, int] = {}
        """Per rank, how many times it started: a restarted process is a new agent stream."""

    def add(self, kind: str, rank: int, t: float, **fields: Any) -> dict[str, Any]:
        seq = self._seq.get(rank, 0)
        self._seq[rank] = seq + 1
        stream = f"s{rank}.{self._incarnation.get(rank, 1)}"
        rec = {"kind": kind, "job": self.job, "rank": rank, "stream": stream, "seq": seq}
        rec.update(time_ns=int(t * 1e9), **fields)
        validate_record(rec)
        self.records.append(rec)
        return rec

    def start(self, rank: int, t: float = T0, *, find_unused: bool = False) -> None:
        if any(r["kind"] == "rank_start" and r["rank"] == rank for r in self.records):
            self._incarnation[rank] = self._incarnation.get(rank, 1) + 1
        self.add(
            "rank_start", rank, t, world_size=self.world, backend="gloo", device="cpu", host="node-1",
            pid=1000 + rank, engine="ddpscope", torch_version="2.13.0", ddpscope_version="0.1.0",
            python_version="3.11", find_unused_parameters=find_unused, bucket_cap_mb=25.0,
            clock_offset_ns=0, clock_error_ns=1000,
        )  # fmt: skip
        buckets = [
            {
                "index": 0,
                "bytes": 40,
                "dtype": "float32",
                "device": "cpu",
                "parameters": ["head.weight", "head.bias"],
            },
            {"index": 1, "bytes": 4096, "dtype": "float32", "device": "cpu", "parameters": ["enc.weight"]},
        ]
        self.add("layout", rank, t, step=0, reason="initial", buckets=buckets)

    def heartbeat(self, rank: int, t: float, *, step: int = 0, phase: str = "forward", last: int = 0) -> None:
        self.add("heartbeat", rank, t, phase=phase, step=step, last_coll_seq=last, pid=1000 + rank)

    def coll(
        self, rank: int, t: float, seq: int, *, op: str = "all_reduce", reduce_op: str | None = "SUM",
        shapes: list[list[int]] | None = None, dtypes: list[str] | None = None,
        site: str | None = "train.py:10", pg: str = "default", step: int | None = None,
        done: bool = True, source: str = "user", group_ranks: list[int] | None = None,
        signal: str | None = None,
    ) -> None:  # fmt: skip
        shapes = shapes if shapes is not None else [[4]]
        members: dict[str, Any] = {} if group_ranks is None else {"group_ranks": group_ranks}
        if signal is not None:
            members["signal"] = signal
        self.add(
            "collective", rank, t, pg=pg, coll_seq=seq, op=op, reduce_op=reduce_op, shapes=shapes,
            dtypes=dtypes or ["float32"] * len(shapes), call_site=site, start_ns=int(t * 1e9), step=step,
            source=source, **members,
        )  # fmt: skip
        if done:
            self.add(
                "collective_end", rank, t + 0.001, pg=pg, coll_seq=seq, end_ns=int((t + 0.001) * 1e9), ok=True
            )

    def step(
        self, rank: int, t: float, step: int, *, unused: list[str] | None = None, seqs: list[int]
    ) -> None:
        ns = int(t * 1e9)
        self.add(
            "step", rank, t, step=step, synced=True, forward_start_ns=ns, forward_end_ns=ns + 1000,
            backward_start_ns=ns + 2000, backward_end_ns=ns + 9000, bucket_ready_ns=[ns + 3000, ns + 5000],
            allreduce_start_ns=[ns + 3000, ns + 5000], allreduce_end_ns=[ns + 4000, ns + 8000],
            bucket_bytes=[40, 4096], ready_order=[0, 1], unused_parameters=unused or [], collective_seqs=seqs,
        )  # fmt: skip

    def train(
        self,
        steps: int,
        *,
        t: float = T0 + 1,
        dt: float = 0.1,
        ranks: list[int] | None = None,
        first: int = 0,
    ) -> float:
        """Healthy steps ``first``.. on ``ranks`` (two engine all-reduces each, then a heartbeat); returns
        the end time."""
        for s in range(first, first + steps):
            for r in ranks if ranks is not None else range(self.world):
                seqs = [2 * s + 1, 2 * s + 2]
                for i, seq in enumerate(seqs):
                    self.coll(r, t, seq, shapes=[[10]] if i == 0 else [[1024]], site="ddp/reducer.py:88",
                              step=s, source="engine")  # fmt: skip
                self.step(r, t, s, seqs=seqs)
                self.heartbeat(r, t, step=s, phase="backward", last=seqs[-1])
            t += dt
        return t

    def hang(self, rank: int, t: float, *, step: int, inflight: list[dict[str, Any]], stalled_s: float = 5.0,
             pending: list[dict[str, Any]] | None = None, phase: str = "allreduce") -> None:  # fmt: skip
        stacks = [
            {"thread": "ddpscope-watchdog", "stack": "watchdog.py:40 in run"},
            {"thread": "MainThread", "stack": "train.py:57 in main\n  dist.all_reduce(t)"},
        ]
        self.add("hang", rank, t, phase=phase, step=step, stalled_s=stalled_s, pending_buckets=pending or [],
                 inflight=inflight, stacks=stacks, message="no progress")  # fmt: skip

    def error(self, rank: int, t: float, message: str, *, error_type: str = "RuntimeError", fatal: bool = True,
              step: int | None = 3) -> None:  # fmt: skip
        self.add("rank_error", rank, t, step=step, phase="backward", error_type=error_type, message=message,
                 stack=f"Traceback: rank {rank}\n{message}", fatal=fatal)  # fmt: skip

    def exit(self, rank: int, t: float, reason: str = "finished", step: int | None = 9) -> None:
        self.add("rank_exit", rank, t, step=step, reason=reason)

    def snapshot(self) -> JobSnapshot:
        return snapshot_from_records(self.job, self.records)


def inflight(seq: int, t: float, site: str = "train.py:57", pg: str = "default") -> dict[str, Any]:
    return {"pg": pg, "coll_seq": seq, "op": "all_reduce", "shapes": [[4]], "dtypes": ["float32"],
            "call_site": site, "start_ns": int(t * 1e9)}  # fmt: skip


def started(world: int = 2) -> JobRecords:
    job = JobRecords(world)
    for r in range(world):
        job.start(r)
    return job


def kinds(incidents: list[Incident]) -> list[str]:
    return [i.kind for i in incidents]


def only(incidents: list[Incident], kind: str) -> Incident:
    found = [i for i in incidents if i.kind == kind]
    assert len(found) == 1, f"expected one {kind}, got {kinds(incidents)}: {[i.message for i in incidents]}"
    return found[0]


# ------------------------------------------------------------------------------------------ healthy jobs


def test_a_healthy_running_job_gets_no_incident() -> None:
    job = started(4)
    end = job.train(20)
    assert diagnose(job.snapshot(), end + 0.5) == []


def test_a_healthy_finished_job_gets_no_incident_long_after_it_ended() -> None:
    job = started(2)
    end = job.train(5)
    for r in range(2):
        job.exit(r, end)
    assert diagnose(job.snapshot(), end + 3600) == []


def test_collectives_still_in_flight_for_a_moment_are_not_a_missing_collective() -> None:
    job = started(2)
    end = job.train(3)
    # Rank 0 already launched the next step's first all-reduce; rank 1 is a few ms behind.
    job.coll(0, end, 7, shapes=[[10]], site="ddp/reducer.py:88", done=False, source="engine")
    assert diagnose(job.snapshot(), end + 0.2) == []


# ------------------------------------------------------------------------------------ silent or stopped


def test_a_stopped_rank_is_the_culprit_while_the_others_wait_for_it() -> None:
    job = started(3)
    end = job.train(5)
    # Rank 2 is SIGSTOPped: nothing more from it. Ranks 0 and 1 keep heartbeating and report a hang
    # in the next step's all-reduce, which rank 2 did issue before it stopped.
    job.coll(2, end, 11, shapes=[[10]], site="ddp/reducer.py:88", done=False, source="engine")
    now = end + 30
    for r in (0, 1):
        job.coll(r, end, 11, shapes=[[10]], site="ddp/reducer.py:88", done=False, source="engine")
        job.hang(r, now - 2, step=5, inflight=[inflight(11, end, "ddp/reducer.py:88")], stalled_s=28)
        job.heartbeat(r, now - 1, step=5, phase="allreduce", last=11)
    incidents = diagnose(job.snapshot(), now)
    silent = only(incidents, "rank_silent")
    assert silent.rank == 2 and silent.culprit_ranks == [2]
    assert "py-spy" in silent.message and "pid 1002" in silent.message
    hangs = [i for i in incidents if i.kind == "hang"]
    assert sorted(h.rank for h in hangs) == [0, 1]
    assert all(h.culprit_ranks == [2] and h.seq == 11 and h.active for h in hangs)
    assert all(h.stack and h.stack.startswith("Thread MainThread") for h in hangs)
    assert not [i for i in incidents if i.kind == "missing_collective"]


def test_a_rank_that_exited_cleanly_is_not_silent() -> None:
    job = started(2)
    end = job.train(5)
    job.exit(1, end)
    job.heartbeat(0, end + 60, step=5, phase="optimizer")
    assert [i for i in diagnose(job.snapshot(), end + 61) if i.kind == "rank_silent"] == []


def test_a_job_where_every_rank_went_quiet_blames_nobody() -> None:
    job = started(2)
    end = job.train(5)
    incidents = diagnose(job.snapshot(), end + 600)
    assert kinds(incidents) == ["job_silent"]
    assert incidents[0].culprit_ranks == []


def test_silent_after_s_sets_how_long_a_rank_may_stay_quiet() -> None:
    job = started(2)
    end = job.train(5)
    job.heartbeat(0, end + 8, step=5)
    snap = job.snapshot()
    assert diagnose(snap, end + 9, silent_after_s=20) == []
    assert only(diagnose(snap, end + 9, silent_after_s=5), "rank_silent").rank == 1


# ------------------------------------------------------------------------------------- crashed ranks


def test_a_killed_rank_is_the_culprit_and_the_survivors_connection_errors_are_attached() -> None:
    job = started(3)
    end = job.train(5)
    # Rank 1 is SIGKILLed at `end`; ranks 0 and 2 get "Connection reset by peer" tens of ms later.
    job.error(0, end + 0.03, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    job.error(2, end + 0.06, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    incidents = diagnose(job.snapshot(), end + 0.5)
    crash = only(incidents, "rank_crashed")
    assert crash.rank == 1 and crash.culprit_ranks == [1]
    assert sorted(r["rank"] for r in crash.related) == [0, 2]
    assert all(0 not in i.culprit_ranks and 2 not in i.culprit_ranks for i in incidents)
    assert "SIGKILL" in crash.message


def test_a_survivor_that_caught_the_lost_connection_and_then_gave_up_is_a_victim_not_an_origin() -> None:
    job = started(2)
    end = job.train(5)
    # Rank 1 is SIGKILLed; rank 0's loop catches each failed backward and retries: the next forward is
    # refused by torch (unfinished reduction), the retry fails again, and the loop gives up.
    lost = "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer"
    job.error(0, end + 0.03, lost, fatal=False, step=5)
    job.error(0, end + 0.4, "Expected to have finished reduction in the prior iteration", fatal=False, step=6)
    job.error(0, end + 0.8, "sys.exit(1): exit status 1", error_type="SystemExit", step=6)
    incidents = diagnose(job.snapshot(), end + 1.5)
    crash = only(incidents, "rank_crashed")
    assert crash.culprit_ranks == [1]
    assert [r["error_type"] for r in crash.related] == ["RuntimeError", "RuntimeError", "SystemExit"]
    assert kinds(incidents) == ["rank_crashed"], incidents
    assert job_status(job.snapshot(), end + 1.5) == "failed"


def test_an_error_a_rank_raised_before_it_lost_a_peer_is_still_its_own() -> None:
    job = started(2)
    end = job.train(3)
    job.error(1, end, "CUDA out of memory. Tried to allocate 2.00 GiB", error_type="OutOfMemoryError",
              fatal=False)  # fmt: skip
    job.error(1, end + 0.5, "Connection closed by peer [127.0.0.1]:4312", step=4)
    job.error(0, end + 0.48, "boom: a bug on rank 0", error_type="ValueError", step=4)
    incidents = diagnose(job.snapshot(), end + 1)
    origins = {i.rank for i in incidents if i.kind == "rank_error" and "origin" in i.message}
    assert origins == {0, 1}, incidents


def test_a_rank_killed_a_few_fast_steps_in_is_placed_by_its_durable_collectives() -> None:
    # Its step records and later heartbeats were still in the process when it was SIGKILLed (they leave
    # in rounds); its collective records were written before each call and reached the collector.
    job = started(2)
    end = job.train(1)
    for s in range(1, 6):
        job.coll(
            1, end + s * 0.05, 2 * s + 1, shapes=[[10]], site="ddp/reducer.py:88", step=s, source="engine"
        )
    job.train(5, t=end, dt=0.05, ranks=[0], first=1)
    job.error(0, end + 0.4, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=6)
    crash = only(diagnose(job.snapshot(), end + 1), "rank_crashed")
    assert crash.rank == 1 and crash.step == 5
    assert "last collective #11 all_reduce in step 5" in crash.message, crash.message


def test_a_rank_error_is_the_origin_and_its_peers_errors_are_related_not_blamed() -> None:
    job = started(2)
    end = job.train(3)
    job.error(1, end, "CUDA out of memory. Tried to allocate 2.00 GiB", error_type="OutOfMemoryError")
    job.error(0, end + 0.02, "Connection closed by peer [127.0.0.1]:4312")
    incidents = diagnose(job.snapshot(), end + 1)
    err = only(incidents, "rank_error")
    assert err.rank == 1 and err.culprit_ranks == [1]
    assert [r["rank"] for r in err.related] == [0]
    assert "OutOfMemoryError" in err.message and err.stack and "rank 1" in err.stack
    assert "rank_crashed" not in kinds(incidents)


@pytest.mark.parametrize(
    ("error_type", "message"),
    [
        ("ValueError", "SIGMA must be positive, got -0.5"),
        ("RuntimeError", "DataLoader worker (pid 4242) is killed by signal: Killed."),
        ("RuntimeError", "aborting: the batch has no labels"),
    ],
)
def test_an_exception_whose_message_names_a_signal_or_an_abort_is_an_error_not_a_crash(
    error_type: str, message: str
) -> None:
    job = started(2)
    end = job.train(3)
    job.error(1, end, message, error_type=error_type)
    job.error(0, end + 0.02, "Connection closed by peer [127.0.0.1]:4312")
    incidents = diagnose(job.snapshot(), end + 1)
    assert only(incidents, "rank_error").culprit_ranks == [1]
    assert "rank_crashed" not in kinds(incidents)


def test_after_a_restart_the_old_crash_is_history_and_the_new_processes_are_healthy() -> None:
    job = started(2)
    end = job.train(5)
    job.error(1, end, "CUDA out of memory", step=5)
    job.error(0, end + 0.03, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    for r in range(2):  # torchrun --max-restarts: new processes, same job id, collectives from #1 again
        job.start(r, end + 10)
    end2 = job.train(5, t=end + 11)
    incidents = diagnose(job.snapshot(), end2 + 0.5)
    assert [(i.kind, i.active) for i in incidents] == [("rank_error", False)], incidents
    before = incidents[0]
    assert before.rank == 1 and before.culprit_ranks == [1] and before.step == 5
    assert [r["rank"] for r in before.related] == [0]
    assert before.message.startswith("Before the ranks restarted (10 s before it)")
    assert "CUDA out of memory" in before.message
    assert job_status(job.snapshot(), end2 + 0.5) == "running"


def test_a_rank_killed_silently_before_a_restart_is_named_in_the_history() -> None:
    job = started(2)
    end = job.train(5)
    # Rank 1 is SIGKILLed: it says nothing; rank 0 loses its connection.
    job.error(0, end + 0.03, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    for r in range(2):
        job.start(r, end + 10)
    end2 = job.train(5, t=end + 11)
    incidents = diagnose(job.snapshot(), end2 + 0.5)
    assert [(i.kind, i.active, i.culprit_ranks) for i in incidents] == [("rank_crashed", False, [1])], (
        incidents
    )
    assert job_status(job.snapshot(), end2 + 0.5) == "running"


def test_what_the_processes_before_a_restart_left_in_flight_is_not_held_against_the_new_ones() -> None:
    job = started(2)
    end = job.train(5)  # collectives #1-#10 on each rank
    # The old processes disagreed at #11 and hung there until the scheduler killed them.
    job.coll(0, end, 11, shapes=[[3]], site="train.py:40", done=False)
    job.coll(1, end, 11, shapes=[[5]], site="train.py:40", done=False)
    job.hang(0, end + 5, step=5, inflight=[inflight(11, end, site="train.py:40")], stalled_s=5)
    for r in range(2):  # resubmitted with the fix: #11 is now the engine's all-reduce everywhere
        job.start(r, end + 60)
    end2 = job.train(6, t=end + 61)
    incidents = diagnose(job.snapshot(), end2 + 0.5)
    assert incidents and all(not i.active for i in incidents), incidents
    assert "mismatch" in {i.kind for i in incidents}
    assert job_status(job.snapshot(), end2 + 0.5) == "running"


def test_an_error_between_steps_is_placed_after_the_step_that_finished() -> None:
    job = started(2)
    end = job.train(5)
    job.add("rank_error", 1, end, step=4, phase="idle", error_type="StopIteration", message="loader ran dry",
            stack="Traceback: rank 1\nStopIteration", fatal=True)  # fmt: skip
    [err] = [i for i in diagnose(job.snapshot(), end + 0.5) if i.kind == "rank_error"]
    assert err.message.startswith("Rank 1 died after step 4 (between steps: optimizer, data loading"), (
        err.message
    )


def test_a_fatal_signal_reported_by_the_rank_is_a_crash() -> None:
    job = started(2)
    end = job.train(3)
    job.error(
        1, end, "gloo::EnforceNotMet: Received data size doesn't match expected size", error_type="SIGABRT"
    )
    job.error(0, end + 0.02, "Connection reset by peer")
    crash = only(diagnose(job.snapshot(), end + 1), "rank_crashed")
    assert crash.rank == 1 and crash.culprit_ranks == [1] and [r["rank"] for r in crash.related] == [0]


def test_victim_errors_with_no_origin_in_sight_blame_nobody_and_say_so() -> None:
    job = started(2)
    end = job.train(3)
    job.error(0, end + 0.01, "Connection reset by peer")
    job.error(1, end + 0.02, "Connection reset by peer")
    err = only(diagnose(job.snapshot(), end + 1), "rank_error")
    assert err.culprit_ranks == [] and "no rank reported a cause" in err.message
    assert [r["rank"] for r in err.related] == [1]


def test_a_caught_error_is_reported_without_failing_anything_else() -> None:
    job = started(2)
    end = job.train(3)
    job.error(0, end, "ValueError: bad batch", error_type="ValueError", fatal=False)
    err = only(diagnose(job.snapshot(), end + 0.5), "rank_error")
    assert "kept running" in err.message and err.culprit_ranks == [0]


def test_the_same_warning_from_several_ranks_is_one_incident_naming_them_and_failing_nothing() -> None:
    job = started(3)
    end = job.train(4)
    thawed_text = "2 parameter(s) that were frozen when the model was wrapped now require a gradient."
    for rank, step in ((2, 3), (0, 2)):
        job.add("warning", rank, end + rank / 10, step=step, code="unsynced_gradients", message=thawed_text,
                parameters=["enc.weight", "enc.bias"])  # fmt: skip
    job.add("warning", 1, end, step=3, code="unsynced_gradients", message="the backward() at train.py:9 ...",
            parameters=["head.bias"], call_site="train.py:9")  # fmt: skip
    found = sorted((i for i in diagnose(job.snapshot(), end + 1) if i.kind == "unsynced_gradients"), key=str)
    thawed, bypass = sorted(found, key=lambda i: i.rank or 0)
    assert thawed.message == f"Ranks 0, 2 (step 2): {thawed_text}"
    assert (thawed.culprit_ranks, thawed.step, thawed.parameters) == ([0, 2], 2, ["enc.weight", "enc.bias"])
    assert bypass.message.startswith("Rank 1 (step 3): the backward() at train.py:9")
    assert (bypass.culprit_ranks, bypass.call_site) == ([1], "train.py:9")
    assert job_status(job.snapshot(), end + 1) == "running"


EVAL_MODE_TEXT = (
    "the model was in eval mode (model.eval()) in the forward and backward of training steps: ..."
)


def test_a_rank_training_in_eval_mode_beside_peers_in_train_mode_is_named_with_the_peers_that_were_not() -> (
    None
):
    job = started(3)
    end = job.train(4)
    job.add("warning", 0, end, step=3, code="trains_in_eval_mode", message=EVAL_MODE_TEXT)
    (found,) = [i for i in diagnose(job.snapshot(), end + 1) if i.kind == "trains_in_eval_mode"]
    assert found.culprit_ranks == [0] and found.step == 3
    assert found.message.startswith("Rank 0 (step 3): the model was in eval mode (model.eval())")
    assert found.message.endswith("(Ranks 1, 2 trained in train mode: the ranks ran different forwards.)")
    for rank in (1, 2):  # every rank: said as it is, maybe on purpose (BatchNorm frozen for a fine-tune)
        job.add("warning", rank, end, step=3, code="trains_in_eval_mode", message=EVAL_MODE_TEXT)
    (found,) = [i for i in diagnose(job.snapshot(), end + 1) if i.kind == "trains_in_eval_mode"]
    assert found.culprit_ranks == [0, 1, 2] and "trained in train mode" not in found.message


# -------------------------------------------------------------------------------- missing collectives


def test_ranks_waiting_in_a_collective_one_rank_never_issued_name_that_rank_and_both_call_sites() -> None:
    job = started(3)
    end = job.train(5)  # seqs 1..10 on every rank
    job.coll(2, end, 11, site="train.py:50", step=5)  # rank 2's last collective, then it stops issuing
    for r in (0, 1):
        job.coll(r, end, 11, site="train.py:50", step=5)
        job.coll(r, end + 0.1, 12, site="train.py:57", step=5, done=False)
        job.hang(r, end + 5, step=5, inflight=[inflight(12, end + 0.1)])
    for r in range(3):
        job.heartbeat(
            r, end + 5.5, step=5, last=12 if r < 2 else 11, phase="forward" if r == 2 else "allreduce"
        )
    incidents = diagnose(job.snapshot(), end + 6)
    missing = only(incidents, "missing_collective")
    assert missing.culprit_ranks == [2] and missing.seq == 12 and missing.pg == "default"
    assert missing.call_site == "train.py:57, train.py:50"
    assert "rank 2: last collective #11" in missing.message and "alive" in missing.message
    assert all(h.culprit_ranks == [2] for h in incidents if h.kind == "hang")
    assert "rank_silent" not in kinds(incidents)


def test_a_rank_with_no_record_in_the_awaited_subgroup_is_said_to_have_nothing_recorded_there() -> None:
    job = started(2)
    end = job.train(2)  # both ranks busy in the default group only
    job.coll(0, end, 1, site="eval.py:12", pg="pg:1", done=False, group_ranks=[0, 1])
    job.hang(0, end + 4, step=2, inflight=[inflight(1, end, "eval.py:12", pg="pg:1")])
    job.heartbeat(0, end + 4.5, step=2, phase="allreduce", last=4)
    job.heartbeat(1, end + 4.5, step=2, phase="forward", last=4)
    missing = only(diagnose(job.snapshot(), end + 5), "missing_collective")
    assert missing.culprit_ranks == [1] and missing.pg == "pg:1"
    assert "rank 1: no collective recorded in group pg:1" in missing.message


def test_a_missing_rank_that_went_silent_is_not_said_to_have_skipped_the_call() -> None:
    job = started(2)
    end = job.train(2)
    job.coll(0, end, 5, site="eval.py:12", done=False)
    now = end + 30  # rank 1 sent nothing since: stopped, frozen
    job.hang(0, now - 2, step=2, inflight=[inflight(5, end, "eval.py:12")], stalled_s=28)
    job.heartbeat(0, now - 1, step=2, phase="allreduce", last=5)
    incidents = diagnose(job.snapshot(), now, silent_after_s=20)
    assert only(incidents, "rank_silent").rank == 1
    missing = only(incidents, "missing_collective")
    assert missing.culprit_ranks == [1] and "skip this call (a rank-dependent" not in missing.message
    assert "Rank 1 did not skip this call: it went silent or died before reaching it" in missing.message


def test_a_collective_stuck_longer_than_silent_after_s_counts_as_waiting_without_a_hang_report() -> None:
    job = started(2)
    end = job.train(2)
    job.coll(0, end, 5, site="eval.py:12", done=False)
    job.heartbeat(0, end + 15, step=2, phase="allreduce", last=5)
    job.heartbeat(1, end + 15, step=2, phase="forward", last=4)
    missing = only(diagnose(job.snapshot(), end + 16), "missing_collective")
    assert missing.culprit_ranks == [1] and missing.seq == 5 and missing.call_site.startswith("eval.py:12")


def test_a_rank_that_exited_without_the_collective_is_named_as_having_exited() -> None:
    job = started(2)
    end = job.train(2)
    job.exit(1, end, step=2)
    job.coll(0, end, 5, site="eval.py:12", done=False)
    job.hang(0, end + 4, step=2, inflight=[inflight(5, end, "eval.py:12")])
    job.heartbeat(0, end + 4.5, step=2, phase="allreduce", last=5)
    missing = only(diagnose(job.snapshot(), end + 5), "missing_collective")
    assert missing.culprit_ranks == [1] and "exited (finished) at step 2" in missing.message


# ----------------------------------------------------------------------------------------- mismatches


def test_different_ops_at_the_same_sequence_number_blame_the_minority_and_name_both_calls() -> None:
    job = started(3)
    end = job.train(5)
    job.coll(0, end, 11, site="train.py:60", op="broadcast", reduce_op=None, shapes=[[4, 4]])
    job.coll(1, end, 11, site="train.py:57", shapes=[[4]])
    job.coll(2, end, 11, site="train.py:60", op="broadcast", reduce_op=None, shapes=[[4, 4]])
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert m.culprit_ranks == [1] and m.seq == 11 and m.call_site == "train.py:57"
    assert m.message.startswith(
        "rank 1 issued all_reduce(SUM) [4] float32 at train.py:57 where ranks 0, 2 issued broadcast "
        "[4,4] float32 at train.py:60 at collective #11 of group default"
    )


def test_on_a_tie_the_rank_a_step_ahead_ran_a_forward_its_peers_did_not_and_is_the_culprit() -> None:
    # Rank 1 evaluated through the DDP model with gradients on at step 5: that forward's buffer broadcast
    # paired with rank 0's at step 5; at #12 rank 1 broadcasts for step 6 while rank 0 all-reduces step 5's bucket.
    job = started(2)
    end = job.train(5)
    for rank in (0, 1):
        job.coll(
            rank, end, 11, op="broadcast", reduce_op=None, shapes=[[16]], site=None, step=5, source="engine"
        )
    job.coll(0, end + 0.01, 12, shapes=[[10]], site="ddp/reducer.py:88", step=5, source="engine", done=False)
    job.coll(1, end + 0.01, 12, op="broadcast", reduce_op=None, shapes=[[16]], site=None, step=6, source="engine",
             done=False)  # fmt: skip
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert m.culprit_ranks == [1] and m.seq == 12, m.message
    assert "rank 1 was ahead (at step 6 against 5)" in m.message
    assert "ran a forward through the DDP model that rank 0 did not" in m.message


def test_same_shape_reductions_with_swapped_reduce_ops_are_flagged() -> None:
    job = started(2)
    end = job.train(5)
    # rank 0: all_reduce(a, SUM) then all_reduce(b, MAX); rank 1 does MAX first. gloo says nothing.
    job.coll(0, end, 11, reduce_op="SUM", site="train.py:40")
    job.coll(0, end, 12, reduce_op="MAX", site="train.py:41")
    job.coll(1, end, 11, reduce_op="MAX", site="train.py:41")
    job.coll(1, end, 12, reduce_op="SUM", site="train.py:40")
    end2 = job.train(1, t=end + 0.1)
    incidents = diagnose(job.snapshot(), end2)
    m = only(incidents, "mismatch")
    assert m.culprit_ranks == [1] and m.seq == 11 and m.call_site == "train.py:41"
    assert "reduce ops differ" in m.message and "opposite order" in m.message
    assert "rank 0's call is taken as the reference" in m.message


def test_identical_collectives_from_two_lines_issued_in_a_different_order_are_flagged() -> None:
    job = started(2)
    end = job.train(2)
    job.coll(0, end, 5, site="train.py:40")
    job.coll(0, end, 6, site="train.py:41")
    job.coll(1, end, 5, site="train.py:41")
    job.coll(1, end, 6, site="train.py:40")
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert m.seq == 5 and m.culprit_ranks == [1] and "different order" in m.message


def test_rank_dependent_call_sites_with_the_same_collective_are_not_a_mismatch() -> None:
    job = started(2)
    end = job.train(2)
    # if rank == 0: dist.broadcast(t, 0) / else: dist.broadcast(t, 0): two lines, one per rank, always.
    for i in range(3):
        job.coll(0, end + i, 5 + i, op="broadcast", reduce_op=None, site="train.py:30")
        job.coll(1, end + i, 5 + i, op="broadcast", reduce_op=None, site="train.py:32")
    assert diagnose(job.snapshot(), end + 3) == []


def test_an_extra_collective_on_one_rank_blames_that_rank_and_its_call_site() -> None:
    job = started(2)
    end = job.train(4)  # seqs 1..8: engine all-reduces at ddp/reducer.py:88
    # Rank 0 issues a user all_reduce the other rank never makes; rank 1 goes on with the engine's.
    job.coll(0, end, 9, site="train.py:77", shapes=[[3]])
    job.coll(0, end + 0.01, 10, shapes=[[10]], site="ddp/reducer.py:88", source="engine", step=4)
    job.coll(1, end, 9, shapes=[[10]], site="ddp/reducer.py:88", source="engine", step=4)
    m = only(diagnose(job.snapshot(), end + 0.5), "mismatch")
    assert m.culprit_ranks == [0] and m.call_site == "train.py:77" and m.seq == 9
    assert "extra collective" in m.message and "never make" in m.message


def test_mismatched_shapes_say_gloo_aborts_and_count_the_later_disagreements() -> None:
    job = started(2)
    end = job.train(2)
    job.coll(0, end, 5, shapes=[[4]], site="train.py:20")
    job.coll(1, end, 5, shapes=[[5]], site="train.py:20")
    job.coll(0, end, 6, shapes=[[4]], op="all_gather", site="train.py:21")
    job.coll(1, end, 6, shapes=[[6]], op="all_gather", site="train.py:21")
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert (
        m.seq == 5
        and "shapes differ: gloo aborts" in m.message
        and "1 later collective of this group disagrees" in m.message
    )


def test_the_same_mismatched_calls_run_again_each_step_are_counted_as_repeats_not_as_a_consequence() -> None:
    # A metric all-reduced with MAX on rank 1 and SUM on rank 0 after every step: gloo pairs them each time.
    job = started(2)
    end = job.train(2)
    for i in range(3):
        for rank, op in ((0, "SUM"), (1, "MAX")):
            job.coll(rank, end + i, 5 + 2 * i, shapes=[[1]], reduce_op=op, site="train.py:8")
            job.coll(rank, end + i + 0.5, 6 + 2 * i, shapes=[[3]], reduce_op="SUM", site="train.py:9")
    job.coll(0, end + 4, 11, shapes=[[4]], site="train.py:20")  # and one other call disagrees
    job.coll(1, end + 4, 11, shapes=[[5]], site="train.py:20")
    m = only(diagnose(job.snapshot(), end + 5), "mismatch")
    assert m.seq == 5 and "The reduce ops differ" in m.message
    assert (
        "(the same calls disagree twice more later, and 1 other collective of this group disagrees too, as a "
        "consequence)" in m.message
    ), m.message


def test_one_line_gathering_a_size_of_its_own_on_each_rank_is_blamed_on_the_line_with_the_fix() -> None:
    # Variable-length predictions gathered for evaluation: every rank calls the same line, in step.
    job = started(2)
    end = job.train(2)
    job.coll(0, end, 5, op="all_gather", reduce_op=None, shapes=[[10]], site="eval.py:14")
    job.coll(1, end, 5, op="all_gather", reduce_op=None, shapes=[[11]], site="eval.py:14")
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert m.call_site == "eval.py:14" and m.culprit_ranks == [1]
    assert m.message.startswith(
        "Every rank issued all_gather at eval.py:14 as collective #5 of group default (rank 0: all_gather [10] "
        "float32; rank 1: all_gather [11] float32)"
    )
    assert "gloo aborts" in m.message and "the line is at fault on every rank" in m.message
    assert "pad every rank's tensor to the largest" in m.message and "taken as the reference" not in m.message


def test_one_line_with_one_rank_s_odd_dtype_names_that_rank_and_says_to_cast() -> None:
    job = started(3)
    end = job.train(2)
    for r in range(3):
        job.coll(r, end, 5, dtypes=["float16" if r == 2 else "float32"], site="train.py:33")
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert m.culprit_ranks == [2] and m.call_site == "train.py:33"
    assert "Rank 2 had the odd dtypes" in m.message and "cast to one dtype" in m.message


def test_different_shapes_from_different_lines_are_not_taken_for_one_line_s_sizes() -> None:
    job = started(2)
    end = job.train(2)
    job.coll(0, end, 5, shapes=[[4]], site="train.py:20")
    job.coll(1, end, 5, shapes=[[5]], site="train.py:29")
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert "Every rank issued" not in m.message and "shapes differ: gloo aborts" in m.message


def test_engine_buckets_of_a_size_only_one_rank_ever_issued_are_said_to_be_different_buckets() -> None:
    job = started(2)
    end = job.train(2)
    for r, size in ((0, 10), (1, 12)):
        job.coll(r, end, 5, shapes=[[size]], site="ddp/reducer.py:88", step=2, source="engine", done=False)
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert "so the ranks built different buckets" in m.message and "another order" not in m.message


def test_engine_buckets_every_rank_issued_before_met_out_of_turn_are_a_skipped_backward_not_other_buckets() -> (
    None
):
    # A GAN's two DDP models: rank 1 skipped one backward, so its next bucket all-reduce meets rank 0's
    # all-reduce of the other bucket. Both sizes are routine on both ranks.
    job = started(2)
    end = job.train(3)
    job.coll(0, end, 7, shapes=[[10]], site="ddp/reducer.py:88", step=3, source="engine", done=False)
    job.coll(1, end, 7, shapes=[[1024]], site="ddp/reducer.py:88", step=3, source="engine", done=False)
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert "every rank has issued both before" in m.message and "skipped or added a backward" in m.message
    assert "built different buckets" not in m.message


def test_a_metric_loop_that_ran_once_more_on_one_rank_is_told_by_how_often_each_rank_made_the_call() -> None:
    # Evaluation over shards of their own: rank 1 has 4 batches, rank 0 has 3 and goes back to training.
    job = started(2)
    end = job.train(2)
    for r, calls in ((0, 3), (1, 4)):
        for k in range(calls):
            job.coll(r, end + k * 0.01, 5 + k, shapes=[[1]], site="eval.py:15")
    job.coll(0, end + 0.05, 8, shapes=[[10]], site="ddp/reducer.py:88", step=2, source="engine", done=False)
    m = only(diagnose(job.snapshot(), end + 0.5), "mismatch")
    assert m.seq == 8 and m.culprit_ranks == [1] and m.call_site == "eval.py:15"
    assert "Rank 1 made its call at eval.py:15 4 times in a row up to here, rank 0 3 times" in m.message
    assert "the same number of batches" in m.message and "left its training loop" not in m.message


def test_a_loop_cut_short_on_one_rank_of_three_is_told_by_the_count_of_the_others() -> None:
    job = started(3)
    end = job.train(2)
    for r, calls in ((0, 4), (1, 4), (2, 3)):
        for k in range(calls):
            job.coll(r, end + k * 0.01, 5 + k, shapes=[[1]], site="eval.py:15")
    job.coll(2, end + 0.05, 8, shapes=[[10]], site="ddp/reducer.py:88", step=2, source="engine", done=False)
    m = only(diagnose(job.snapshot(), end + 0.5), "mismatch")
    assert m.culprit_ranks == [2]
    assert "Rank 0 made its call at eval.py:15 4 times in a row up to here, rank 2 3 times" in m.message


def test_a_user_call_one_rank_made_inside_its_step_is_not_taken_for_leaving_the_training_loop() -> None:
    # Rank 1 all-reduced a statistic in a backward hook of step 2 (its record carries the step); rank 0 went
    # on to step 2's bucket all-reduce. Between steps, the same records would read as a loop left early.
    job = started(2)
    end = job.train(2)
    job.coll(1, end, 5, shapes=[[1]], site="model.py:40", step=2, done=False)
    job.coll(0, end, 5, shapes=[[10]], site="ddp/reducer.py:88", step=2, source="engine", done=False)
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert m.culprit_ranks == [1] and m.call_site == "model.py:40"
    assert (
        "Rank 1 made that call inside its step 2" in m.message
        and "went on to DDP's gradient all-reduce" in m.message
    )
    assert "stopped training" not in m.message and "left their training loop" not in m.message


def test_an_all_to_all_with_split_sizes_of_its_own_on_each_rank_is_no_mismatch_but_other_widths_are() -> None:
    # A mixture of experts sends each expert as many tokens as were routed to it: the first dimension of
    # all_to_all_single's input, and of all_to_all's tensors, differs per rank by design.
    job = started(2)
    end = job.train(2)
    job.coll(0, end, 5, op="all_to_all_single", reduce_op=None, shapes=[[2, 8]], site="moe.py:30")
    job.coll(1, end, 5, op="all_to_all_single", reduce_op=None, shapes=[[4, 8]], site="moe.py:30")
    job.coll(0, end, 6, op="all_to_all", reduce_op=None, shapes=[[1, 8], [3, 8]], site="moe.py:31")
    job.coll(1, end, 6, op="all_to_all", reduce_op=None, shapes=[[2, 8], [0, 8]], site="moe.py:31")
    assert [i for i in diagnose(job.snapshot(), end + 0.1) if i.kind == "mismatch"] == []
    job.coll(0, end, 7, op="all_to_all_single", reduce_op=None, shapes=[[2, 8]], site="moe.py:30")
    job.coll(1, end, 7, op="all_to_all_single", reduce_op=None, shapes=[[2, 16]], site="moe.py:30")
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert m.seq == 7 and "shapes differ" in m.message


def test_torch_s_static_graph_assertion_is_explained_instead_of_left_as_a_bug_to_report() -> None:
    # torch 2.13, DDP(static_graph=True) whose first backward runs under no_sync(): every rank raises it.
    job = started(2)
    text = (
        'expect_autograd_hooks_ INTERNAL ASSERT FAILED at "/pytorch/torch/csrc/distributed/c10d/reducer.cpp":1732, '
        "please report a bug to PyTorch."
    )
    for r in range(2):
        job.error(r, T0 + 1 + r / 100, text, step=0)
    err = only(diagnose(job.snapshot(), T0 + 2), "rank_error")
    assert "with static_graph=True when its first backward runs under no_sync()" in err.message
    assert "run the first iteration synced" in err.message and err.culprit_ranks == [0, 1]


def _model_differs(rank: int, mine: int, peer: int, theirs: int) -> str:
    return (
        f"DDP expects same model across all ranks, but Rank {rank} has {mine} params, while rank {peer} has "
        f"inconsistent {theirs} params."
    )


def test_torch_s_model_check_raised_on_every_rank_is_one_incident_naming_the_rank_whose_count_is_odd() -> (
    None
):
    # Each rank compares itself with one peer: ranks 0 and 2 name rank 1, rank 1 names rank 0. Each used to
    # be its own incident, each rank "the origin".
    job = started(3)
    t = T0 + 1
    job.error(0, t, _model_differs(0, 6, 1, 5), step=None)
    job.error(1, t, _model_differs(1, 5, 0, 6), step=None)
    job.error(2, t, _model_differs(2, 6, 1, 5), step=None)
    err = only(diagnose(job.snapshot(), t + 1), "rank_error")
    assert err.rank == 1 and err.culprit_ranks == [1], err.message
    assert "ranks 0, 2 reported the same error" in err.message


def test_torch_s_model_check_on_two_ranks_names_both_as_it_cannot_tell_the_odd_one() -> None:
    job = started(2)
    t = T0 + 1
    job.error(0, t, _model_differs(0, 6, 1, 5), step=None)
    job.error(1, t, _model_differs(1, 5, 0, 6), step=None)
    err = only(diagnose(job.snapshot(), t + 1), "rank_error")
    assert err.culprit_ranks == [0, 1] and "no majority to tell the odd one" in err.message
    assert "This rank is the origin" not in err.message


def test_a_mismatch_in_a_subgroup_names_that_group() -> None:
    job = started(4)
    end = job.train(1)
    for r in (2, 3):
        job.coll(r, end, 1, pg="pg1", dtypes=["float32" if r == 2 else "float16"], site="moe.py:9")
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert m.pg == "pg1" and "dtypes" in m.message and "of group pg1" in m.message


# --------------------------------------------------------------------------------------------- hangs


def test_a_hang_in_backward_names_the_parameters_whose_gradients_are_not_computed_yet() -> None:
    job = started(2)
    end = job.train(3)
    pending = [{"index": 0, "missing": ["head.weight", "head.bias"], "launched": False}]
    job.hang(1, end + 5, step=3, inflight=[], pending=pending, phase="backward")
    job.hang(0, end + 5, step=3, inflight=[], pending=[{"index": 1, "missing": [], "launched": True}])
    for r in range(2):
        job.heartbeat(r, end + 5, step=3, phase="backward", last=6)
    h1 = next(i for i in diagnose(job.snapshot(), end + 6) if i.kind == "hang" and i.rank == 1)
    assert h1.parameters == ["head.weight", "head.bias"] and h1.bucket == 0 and h1.culprit_ranks == [1]
    # Unused parameters end a backward without them; one that does not end is still computing them.
    assert "find_unused_parameters" not in h1.message
    assert "not computed yet" in h1.message and "stuck inside the backward pass" in h1.message


def test_a_resolved_hang_stays_as_history_but_is_not_active() -> None:
    job = started(2)
    end = job.train(3)
    job.hang(0, end + 3, step=3, inflight=[inflight(7, end)], stalled_s=3)
    job.add("hang_resolved", 0, end + 4, step=3, hang_s=4.0)
    end2 = job.train(2, t=end + 4)
    hang = only(diagnose(job.snapshot(), end2), "hang")
    assert not hang.active and hang.message.startswith("(resolved)")


# ----------------------------------------------------------------------------------- unused parameters


def test_parameters_unused_on_one_rank_only_are_named_with_the_rank_and_the_bucket() -> None:
    job = started(2)
    t = T0 + 1
    for s in range(4):
        job.step(0, t + s, s, seqs=[2 * s + 1, 2 * s + 2])
        job.step(
            1, t + s, s, seqs=[2 * s + 1, 2 * s + 2], unused=["head.weight", "head.bias"] if s >= 2 else []
        )
        for r in range(2):
            job.heartbeat(r, t + s, step=s)
    u = only(diagnose(job.snapshot(), t + 4), "unused_parameters")
    assert u.culprit_ranks == [1] and u.bucket == 0 and sorted(u.parameters) == ["head.bias", "head.weight"]
    assert "without find_unused_parameters=True" in u.message


def test_parameters_unused_on_every_rank_are_not_an_incident() -> None:
    job = started(2)
    for s in range(3):
        for r in range(2):
            job.step(r, T0 + s, s, seqs=[1], unused=["enc.weight"])
            job.heartbeat(r, T0 + s, step=s)
    assert diagnose(job.snapshot(), T0 + 3) == []


def test_the_engines_did_not_receive_grad_error_becomes_an_unused_parameters_incident() -> None:
    job = started(2)
    end = job.train(3)
    job.error(1, end, "Expected to have finished reduction in the prior iteration. Parameters which did "
              "not receive grad for rank 1: head.weight, head.bias", step=3)  # fmt: skip
    job.error(0, end + 0.05, "Connection closed by peer")
    incidents = diagnose(job.snapshot(), end + 1)
    u = only(incidents, "unused_parameters")
    assert u.rank == 1 and u.parameters == ["head.weight", "head.bias"] and u.bucket == 0
    err = only(incidents, "rank_error")
    assert err.culprit_ranks == [1] and [r["rank"] for r in err.related] == [0]


def test_an_incident_serialises_with_the_fields_of_the_incidents_endpoint() -> None:
    job = started(2)
    end = job.train(2)
    job.error(0, end, "boom")
    d = only(diagnose(job.snapshot(), end + 1), "rank_error").as_dict()
    for name in ("kind", "rank", "step", "seq", "bucket", "parameters", "culprit_ranks", "call_site", "message",
                 "stack", "time_s", "related"):  # fmt: skip
        assert name in d


def test_a_send_paired_with_a_recv_is_not_a_mismatch_but_two_sends_are() -> None:
    job = started(2)
    end = job.train(1)
    for i, (op0, op1) in enumerate([("send", "recv"), ("irecv", "isend")]):
        job.coll(0, end, i + 1, op=op0, reduce_op=None, pg="default/p2p/0-1", site=f"sync.py:{10 + i}")
        job.coll(1, end, i + 1, op=op1, reduce_op=None, pg="default/p2p/0-1", site=f"sync.py:{20 + i}")
    assert diagnose(job.snapshot(), end + 0.1) == []
    job.coll(0, end, 3, op="send", reduce_op=None, pg="default/p2p/0-1", site="sync.py:30")
    job.coll(1, end, 3, op="send", reduce_op=None, pg="default/p2p/0-1", site="sync.py:31")
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert m.seq == 3 and m.culprit_ranks == [0, 1] and "same direction" in m.message
    assert m.message.startswith("Ranks 0, 1 both send to each other as transfer #3")
    assert "sync.py:30" in m.message and "sync.py:31" in m.message and "batch_isend_irecv" in m.message


@pytest.mark.parametrize(
    ("sent", "received", "says"),
    [
        (([4], "float32"), ([5], "float32"), "only the 16 bytes sent into the 20-byte"),
        (([5], "float32"), ([4], "float32"), "gloo aborts on the size mismatch"),
        (([4], "float32"), ([2], "float64"), "reads the sent float32 bytes as float64: wrong values"),
    ],
    ids=["recv_larger_is_silent", "recv_smaller_aborts", "same_bytes_other_dtype"],
)
def test_a_send_and_recv_of_different_sizes_say_what_gloo_does_with_the_bytes(
    sent: tuple[list[int], str], received: tuple[list[int], str], says: str
) -> None:
    # Measured on gloo: a recv larger than the send completes with only the sent bytes written.
    job = started(2)
    end = job.train(1)
    for r, op, (shape, dtype) in ((0, "send", sent), (1, "recv", received)):
        job.coll(r, end, 1, op=op, reduce_op=None, pg="default:p2p:0-1", site=f"pipe.py:{40 + r}",
                 shapes=[shape], dtypes=[dtype])  # fmt: skip
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert says in m.message, m.message
    assert ("gloo aborts" in m.message) == (says == "gloo aborts on the size mismatch"), m.message


@pytest.mark.parametrize("skipper", [0, 1])
def test_a_rank_that_skipped_a_call_every_rank_makes_each_step_is_the_culprit_whatever_its_number(
    skipper: int,
) -> None:
    # ZeroRedundancyOptimizer broadcasts each shard in every optimizer step; one rank skipped its step. The
    # broadcasts, outside forward and backward, carry no step: they belong to the step before them.
    job = started(2)
    t = T0 + 1
    for r in (0, 1):
        seq = 0
        for s in range(5):
            for shape in ([10], [1024]):
                seq += 1
                job.coll(r, t + s, seq, shapes=[shape], site=None, step=s, source="engine")
            job.step(r, t + s, s, seqs=[seq - 1, seq])
            if s == 4:
                break  # step 4's all-reduces done; then the broadcast of step 4, or not
            seq += 1
            job.coll(r, t + s, seq, op="broadcast", reduce_op=None, shapes=[[64, 64]], site="opt.py:21")
        seq += 1
        if r == skipper:  # on to step 5's backward
            job.coll(r, t + 5, seq, shapes=[[10]], site=None, step=5, source="engine", done=False)
        else:
            job.coll(r, t + 4, seq, op="broadcast", reduce_op=None, shapes=[[64, 64]], site="opt.py:21",
                     done=False)  # fmt: skip
    m = only(diagnose(job.snapshot(), t + 6), "mismatch")
    assert m.culprit_ranks == [skipper] and m.call_site == "opt.py:21", m.message
    assert f"rank {skipper} skipped it in step 4 and went on to step 5's backward" in m.message, m.message
    assert "taken as the reference" not in m.message and "left its training loop" not in m.message
    assert m.message.count("opt.py:21") == 2, m.message  # rank 1's call, and the routine one: once each


def test_a_rank_that_skipped_a_call_made_inside_every_step_is_the_culprit_and_went_on_in_that_same_step() -> (
    None
):
    # The loss all-reduced between forward and backward, every step (its records carry their own step);
    # rank 0 skipped it in step 3 and went on to step 3's bucket all-reduce.
    job = started(2)
    t = T0 + 1
    for r in (0, 1):
        seq = 0
        for s in range(4):
            if not (r == 0 and s == 3):
                seq += 1
                job.coll(r, t + s, seq, shapes=[[1]], site="train.py:30", step=s, done=s < 3)
            if s == 3 and r == 1:
                break
            for shape in ([10], [1024]):
                seq += 1
                job.coll(r, t + s, seq, shapes=[shape], site=None, step=s, source="engine", done=s < 3)
                if s == 3:
                    break
            if s < 3:
                job.step(r, t + s, s, seqs=[seq - 1, seq])
    m = only(diagnose(job.snapshot(), t + 5), "mismatch")
    assert m.culprit_ranks == [0] and m.call_site == "train.py:30", m.message
    assert "rank 0 skipped it in step 3 and went on to step 3's backward" in m.message, m.message


def test_two_peers_receiving_at_the_same_line_are_a_mismatch_though_their_records_are_identical() -> None:
    # `dist.recv(buf, src=1 - rank)` on both ranks of a pipeline: each waits for the other to send.
    job = started(2)
    end = job.train(1)
    for r in (0, 1):
        job.coll(r, end, 1, op="recv", reduce_op=None, pg="default:p2p:0-1", site="pipe.py:40", done=False)
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert m.seq == 1 and "same direction" in m.message and m.call_site == "pipe.py:40"
    assert m.culprit_ranks == [0, 1] and "each waits for the other forever" in m.message


def test_a_user_collective_paired_with_the_engines_all_reduce_is_flagged_even_with_the_same_shape() -> None:
    job = started(2)
    end = job.train(3)  # engine all-reduces [10] and [1024] at ddp/reducer.py:88, seqs 1..6
    job.coll(0, end, 7, shapes=[[10]], site="train.py:33", source="user")
    job.coll(1, end, 7, shapes=[[10]], site=None, source="engine", step=3)
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert m.culprit_ranks == [0] and m.call_site == "train.py:33" and "some ranks only" in m.message


def test_a_rank_that_called_barrier_after_its_last_step_is_said_to_have_left_its_loop_or_skipped_a_branch() -> (
    None
):
    job = started(2)
    end = job.train(8)  # engine all-reduces #1-#16, steps 0-7 on both ranks
    # Rank 1 has no batch 8: it leaves its loop and calls dist.barrier() at the end of its script,
    # while rank 0 is in step 8's first bucket all-reduce. Both wait there.
    job.coll(0, end, 17, shapes=[[10]], site="ddp/reducer.py:88", source="engine", step=8, done=False)
    job.coll(1, end, 17, op="barrier", reduce_op=None, shapes=[], site="train.py:120", done=False)
    job.hang(0, end + 5, step=8, inflight=[inflight(17, end, site="ddp/reducer.py:88")])
    incidents = diagnose(job.snapshot(), end + 5.1)
    hang = only(incidents, "hang")
    assert "culprit: rank 1 (stopped training early or issued a collective its peers skip)" in hang.message
    m = only(incidents, "mismatch")
    assert m.message.startswith("Rank 1 stopped training after step 7 and called a collective")
    assert "rank 0 was in step 8's bucket all-reduce" in m.message
    # A barrier inside the loop that only rank 1 reaches leaves the same records: both causes are named.
    assert "left its training loop early (fewer batches" in m.message
    assert "inside the loop, a collective its peers skip" in m.message
    assert "rank 1 issued barrier at train.py:120 where rank 0 issued all_reduce(SUM)" in m.message
    assert "torch.distributed.algorithms.Join" in m.message and "same synced steps" in m.message
    assert m.culprit_ranks == [1] and m.seq == 17 and m.call_site == "train.py:120"


def test_a_collective_from_a_signal_handler_is_blamed_on_the_handler_even_on_a_majority_of_ranks() -> None:
    # SIGTERM reached ranks 0 and 1 of a node between steps 7 and 8; their handler checkpoints behind a
    # barrier while rank 2, on another node, is in step 8's bucket all-reduce.
    job = started(3)
    end = job.train(8)
    for r in (0, 1):
        job.coll(
            r,
            end,
            17,
            op="barrier",
            reduce_op=None,
            shapes=[],
            site="train.py:12",
            done=False,
            signal="SIGTERM",
        )
    job.coll(2, end, 17, shapes=[[10]], site="ddp/reducer.py:88", source="engine", step=8, done=False)
    job.hang(2, end + 5, step=8, inflight=[inflight(17, end, site="ddp/reducer.py:88")])
    incidents = diagnose(job.snapshot(), end + 5.1)
    m = only(incidents, "mismatch")
    assert m.culprit_ranks == [0, 1] and m.call_site == "train.py:12", m.message
    assert m.message.startswith(
        "Ranks 0, 1 issued barrier at train.py:12 from their SIGTERM handler, where rank 2 issued all_reduce(SUM)"
    ), m.message
    assert "(ranks 0, 1: between two steps)" in m.message and "all-reduce the flag (MAX)" in m.message
    assert (
        "rank 1 (called barrier from its SIGTERM handler at #17 of group default)"
        in only(incidents, "hang").message
    )


def test_a_user_collective_inside_a_step_on_one_rank_is_not_said_to_leave_the_loop() -> None:
    job = started(2)
    end = job.train(3)
    job.coll(0, end, 7, shapes=[[10]], site="ddp/reducer.py:88", source="engine", step=3)
    job.coll(1, end, 7, shapes=[[10]], site="train.py:33", source="user")
    job.step(1, end, 3, seqs=[8, 9])  # rank 1 went on with step 3: it did not leave its loop
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert "left its training loop" not in m.message and "some ranks only" in m.message


def test_a_mismatch_takes_its_step_from_the_peers_record_when_the_user_call_has_none() -> None:
    job = started(2)
    end = job.train(3)
    job.coll(0, end, 7, shapes=[[10]], site="ddp/reducer.py:88", source="engine", step=3)
    job.coll(1, end, 7, op="barrier", reduce_op=None, shapes=[], site="train.py:120")
    assert only(diagnose(job.snapshot(), end + 0.1), "mismatch").step == 3


def test_failed_waiting_for_a_peer_is_a_sentence_starting_with_a_capital() -> None:
    job = started(2)
    end = job.train(5)
    # Both ranks fail waiting for a peer, and no rank says why: the message opens with the ranks.
    job.error(0, end + 1, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    job.error(1, end + 1, "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", step=5)
    incidents = diagnose(job.snapshot(), end + 2)
    failed = [i for i in incidents if "failed waiting for a peer" in i.message]
    assert failed and failed[0].message.startswith("Ranks 0, 1 failed waiting for a peer")


FAULTHANDLER_DUMP = """Fatal Python error: Aborted

Thread 0x00007fc020c3d6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/work/main/ddp/watchdog.py", line 211 in _run

Thread 0x00007fc040c87b80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/work/main/ddp/_patch.py", line 164 in wrapper
  File "/home/me/proj/train.py", line 82 in step
  File "/home/me/proj/train.py", line 93 in <module>
"""


# A layer in float64 on one rank under torch's DDP: its constructor broadcasts the state through
# torch/distributed/utils.py (no distributed_c10d frame) and gloo aborts on the size.
CONSTRUCTOR_DUMP = FAULTHANDLER_DUMP.replace(
    '"/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce',
    '"/venv/lib/python3.11/site-packages/torch/distributed/utils.py", line 321 in _sync_module_states\n'
    '  File "/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line 898 in __init__',
)


@pytest.mark.parametrize("dump", [FAULTHANDLER_DUMP, CONSTRUCTOR_DUMP], ids=["collective", "ddp_constructor"])
def test_a_crash_inside_torch_distributed_names_the_users_line_it_died_in(dump: str) -> None:
    job = started(2)
    end = job.train(2)
    job.add("rank_error", 0, end, step=None, phase="unknown", error_type="SIGABRT",
            message="Fatal Python error: Aborted", stack=dump, fatal=True)  # fmt: skip
    job.error(1, end + 0.02, "Connection reset by peer")
    crash = only(diagnose(job.snapshot(), end + 1), "rank_crashed")
    assert crash.rank == 0 and crash.call_site == "/home/me/proj/train.py:82"
    assert "died inside a torch.distributed call at /home/me/proj/train.py:82" in crash.message, crash.message


def test_a_native_crash_outside_any_collective_says_where_the_rank_last_got_to() -> None:
    # faulthandler's report knows no step; the rank's own records do.
    job = started(2)
    end = job.train(3)
    job.add("rank_error", 1, end, step=None, phase="unknown", error_type="SIGSEGV",
            message="Fatal Python error: Segmentation fault", stack='File "train.py", line 36 in <module>',
            fatal=True)  # fmt: skip
    job.error(0, end + 0.02, "Connection closed by peer")
    crash = only(diagnose(job.snapshot(), end + 1), "rank_crashed")
    assert crash.rank == 1 and crash.step == 2
    assert crash.message.startswith("Rank 1 died (last completed step 2; pid 1001"), crash.message


def test_a_rank_aborted_by_gloo_on_a_size_mismatch_points_at_the_rank_that_issued_the_wrong_size() -> None:
    # Rank 1 issued the wrong size; gloo killed rank 0, the one that received it.
    job = started(2)
    end = job.train(2)
    for r in (0, 1):
        job.coll(r, end, 5, shapes=[[4]] if r == 0 else [[5]], site="train.py:82", done=False)
    job.add("rank_error", 0, end + 0.01, step=None, phase="unknown", error_type="SIGABRT",
            message="Fatal Python error: Aborted", stack=FAULTHANDLER_DUMP, fatal=True)  # fmt: skip
    job.error(1, end + 0.03, "Connection reset by peer")
    incidents = diagnose(job.snapshot(), end + 1)
    crash = only(incidents, "rank_crashed")
    assert crash.rank == 0 and crash.culprit_ranks == only(incidents, "mismatch").culprit_ranks
    assert "aborted on the size mismatch at collective #5 of group default" in crash.message
    assert "origin" not in crash.message


def test_the_engines_misaligned_collectives_error_is_blamed_on_the_mismatchs_culprit() -> None:
    # Rank 1 all-reduced a metric where rank 0 all-reduced its last bucket (the same size): rank 0's
    # engine found its status slots holding the metric's values and raised.
    job = started(2)
    end = job.train(2)
    job.coll(0, end, 5, shapes=[[170]], site="ddp/reducer.py:88", step=2, source="engine")
    job.coll(1, end, 5, shapes=[[170]], site="train.py:83")
    job.error(0, end + 0.01, "DistributedDataParallel (rank 0, step 2): the gradient all-reduce of bucket 0 ...",
              error_type="MisalignedCollectivesError", step=2)  # fmt: skip
    incidents = diagnose(job.snapshot(), end + 1)
    mismatch = only(incidents, "mismatch")
    error = only(incidents, "rank_error")
    assert mismatch.culprit_ranks == [1] and error.culprit_ranks == [1], incidents
    assert "see the mismatch incident at collective #5 of group default" in error.message
    assert "origin" not in error.message


def test_an_exception_names_the_innermost_line_of_user_code() -> None:
    job = started(2)
    end = job.train(2)
    stack = (
        'Traceback (most recent call last):\n  File "/home/me/proj/train.py", line 40, in <module>\n'
        '  File "/home/me/proj/model.py", line 12, in forward\n'
        '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", line 125, in forward\n'
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    )
    job.add("rank_error", 1, end, step=2, phase="forward", error_type="RuntimeError",
            message="mat1 and mat2 shapes cannot be multiplied", stack=stack, fatal=True)  # fmt: skip
    assert only(diagnose(job.snapshot(), end + 1), "rank_error").call_site == "/home/me/proj/model.py:12"


def test_a_hang_ended_by_the_ranks_death_stays_part_of_the_diagnosis_and_is_not_called_resolved() -> None:
    job = started(2)
    end = job.train(3)
    job.hang(0, end + 3, step=3, inflight=[inflight(7, end)], stalled_s=3)
    job.error(0, end + 4, "Connection closed by peer")
    job.error(1, end + 3.9, "Timed out", step=3)
    hang = only(diagnose(job.snapshot(), end + 5), "hang")
    assert hang.active and hang.message.startswith("(ended when the rank died)")
    # Measured from the stall's start to the death, not the report's threshold.
    assert "made no progress for 4 s" in hang.message


def engine_unused_error(rank: int) -> str:
    mine = " On this rank the missing parameters are ['aux.weight', 'aux.bias']." if rank == 1 else ""
    return (
        f"DistributedDataParallel (rank {rank}, step 6): parameters ['aux.weight', 'aux.bias'] in bucket(s) [0] "
        f"received no gradient on rank(s) [1] during this backward, and find_unused_parameters=False.{mine} "
        "Every rank still joined the gradient all-reduces."
    )


def test_the_same_engine_error_on_every_rank_is_one_incident_blamed_on_the_rank_it_names() -> None:
    job = started(2)
    end = job.train(6)
    job.error(0, end, engine_unused_error(0), error_type="UnreducedGradientsError", step=6)
    job.error(1, end + 0.001, engine_unused_error(1), error_type="UnreducedGradientsError", step=6)
    incidents = diagnose(job.snapshot(), end + 1)
    err = only(incidents, "rank_error")
    assert err.rank == 1 and err.culprit_ranks == [1] and [r["rank"] for r in err.related] == [0]
    assert "rank 0 reported the same error" in err.message and err.bucket == 0
    unused = only(incidents, "unused_parameters")
    assert (
        unused.culprit_ranks == [1] and unused.parameters == ["aux.weight", "aux.bias"] and unused.bucket == 0
    )


def test_an_error_between_steps_before_a_restart_is_placed_after_its_step_not_in_set_up() -> None:
    job = started(2)
    end = job.train(5)
    job.add("rank_error", 1, end, step=4, phase="idle", error_type="RuntimeError", message="boom at step 5",
            stack="Traceback ...", fatal=True)  # fmt: skip
    for r in range(2):
        job.start(r, end + 10)
    end2 = job.train(5, t=end + 11)
    before = only(diagnose(job.snapshot(), end2 + 0.5), "rank_error")
    assert "Rank 1 died after step 4 (between steps" in before.message
    assert "before its first step" not in before.message


def _accumulate(job: JobRecords, every: dict[int, int], syncs: int, t: float = T0 + 1) -> float:
    """Each rank syncs gradients after ``every[rank]`` steps (no_sync for the others), ``syncs`` times:
    one engine all-reduce per sync, numbered in order on every rank."""
    for k in range(syncs):
        for r, n in every.items():
            step = (k + 1) * n - 1
            job.coll(r, t, k + 1, shapes=[[1024]], site="ddp/reducer.py:88", step=step, source="engine")
            job.step(r, t, step, seqs=[k + 1])
        t += 0.1
    return t


def test_ranks_that_accumulate_a_different_number_of_steps_per_sync_are_flagged_though_every_op_pairs() -> (
    None
):
    job = started(2)
    end = _accumulate(job, {0: 2, 1: 3}, syncs=6)
    incidents = diagnose(job.snapshot(), end + 0.1)
    m = only(incidents, "mismatch")
    assert m.message.startswith("The ranks synchronize gradients after different numbers of steps")
    assert "rank 0 of its step 3, rank 1 of its step 5" in m.message
    assert "rank 0 syncs every 2 steps; rank 1 syncs every 3 steps" in m.message
    assert "silently wrong" in m.message and "no_sync()" in m.message
    assert m.seq == 2 and m.culprit_ranks == [1]


def test_a_constant_step_offset_between_ranks_is_not_a_sync_mismatch() -> None:
    # Rank 1 counted one extra forward before training (an evaluation pass with grad on): its steps are
    # one ahead, but both sync every 2 steps.
    job = started(2)
    t = T0 + 1
    for k in range(6):
        for r in (0, 1):
            step = 2 * k + 1 + r
            job.coll(r, t, k + 1, shapes=[[1024]], site="ddp/reducer.py:88", step=step, source="engine")
            job.step(r, t, step, seqs=[k + 1])
        t += 0.1
    assert kinds(diagnose(job.snapshot(), t + 0.1)) == []


def test_an_extra_forward_on_one_rank_mid_training_is_not_a_sync_mismatch() -> None:
    # Rank 0 ran one forward with autograd on and no backward after its third sync: the offset between
    # the ranks' steps moves once, but both still sync every 2 steps.
    job = started(2)
    t = T0 + 1
    for k in range(8):
        for r in (0, 1):
            step = 2 * k + 1 + (1 if r == 0 and k >= 3 else 0)
            job.coll(r, t, k + 1, shapes=[[1024]], site="ddp/reducer.py:88", step=step, source="engine")
            job.step(r, t, step, seqs=[k + 1])
        t += 0.1
    assert kinds(diagnose(job.snapshot(), t + 0.1)) == []


def test_calls_that_no_longer_pair_are_one_mismatch_named_by_the_wrapping_not_a_sync_schedule_mismatch() -> (
    None
):
    # torch DDP with find_unused_parameters on rank 0 only: rank 0's unused-parameter all-reduce of step 0
    # meets rank 1's bucket-rebuild broadcast of step 1 at #2. The steps those records carry say nothing
    # about accumulation: the calls themselves differ.
    job = JobRecords(2)
    job.start(0, find_unused=True)
    job.start(1, find_unused=False)
    t = T0 + 1
    for r in (0, 1):
        job.coll(r, t, 1, shapes=[[1024]], site=None, step=0, source="engine")
    job.coll(0, t + 0.1, 2, shapes=[[6]], dtypes=["int32"], site=None, step=0, source="engine", done=False)
    job.coll(1, t + 0.1, 2, op="broadcast", reduce_op=None, shapes=[[7]], dtypes=["int32"], site=None, step=1,
             source="engine", done=False)  # fmt: skip
    mismatches = [i for i in diagnose(job.snapshot(), t + 0.3) if i.kind == "mismatch"]
    assert [m.seq for m in mismatches] == [2]
    assert "different numbers of steps" not in mismatches[0].message
    assert (
        "wrapped the model with different arguments (find_unused_parameters is True on rank 0, False on "
        "rank 1)" in mismatches[0].message
    )


def test_healthy_training_has_no_sync_mismatch() -> None:
    job = started(4)
    end = _accumulate(job, {0: 4, 1: 4, 2: 4, 3: 4}, syncs=5)
    assert kinds(diagnose(job.snapshot(), end + 0.1)) == []


def test_a_mismatch_on_a_group_two_threads_use_at_once_blames_the_race_on_the_ranks_that_said_so() -> None:
    # A logging thread's all_reduce against the engine's broadcast: which rank "differs" is chance.
    job = started(2)
    end = job.train(2)
    race = "Collectives on the default process group are issued from two threads at once."
    for r in (0, 1):
        job.add("warning", r, end, step=2, code="collectives_from_threads", pg="default", message=race)
    job.coll(0, end + 0.1, 5, shapes=[[10]], site="log.py:11")
    job.coll(1, end + 0.1, 5, op="broadcast", reduce_op=None, shapes=[[6]], site=None, source="engine")
    job.coll(0, end + 0.2, 1, pg="pg:1", shapes=[[4]], site="eval.py:3", group_ranks=[0, 1])
    job.coll(1, end + 0.2, 1, pg="pg:1", shapes=[[5]], site="eval.py:3", group_ranks=[0, 1])
    incidents = diagnose(job.snapshot(), end + 1)
    by_pg = {i.pg: i for i in incidents if i.kind == "mismatch"}
    assert by_pg["default"].culprit_ranks == [0, 1]
    raced = by_pg["default"].message
    assert raced.startswith(
        "Two threads' collectives met at collective #5 of group default: rank 0 issued all_reduce(SUM) [10] "
        "float32 at log.py:11; rank 1 issued broadcast"
    )
    assert "The cause is a race, not one rank's code: ranks 0, 1 issue collectives on this group" in raced
    # Neither rank left its loop or skipped a call: the one-rank-is-odd readings would mislead.
    assert "training loop" not in raced and "Join" not in raced and "skipped" not in raced
    assert "race" not in by_pg["pg:1"].message  # the threads' warning names the default group only
    assert only(incidents, "collectives_from_threads").culprit_ranks == [0, 1]


def test_torch_s_static_graph_changed_error_names_the_promise_broken_and_both_ways_out() -> None:
    # torch 2.13: DDP(static_graph=True) where rank 1 takes another branch at step 3.
    job = started(2)
    job.error(
        1,
        T0 + 1,
        "Your training graph has changed in this iteration, e.g., one parameter is unused in first iteration, "
        "but then got used in the second iteration. this is not compatible with static_graph set to True.",
        step=3,
    )
    err = only(diagnose(job.snapshot(), T0 + 2), "rank_error")
    assert err.culprit_ranks == [1]
    assert (
        "With static_graph=True, torch's DDP is promised that every iteration uses the same parameters"
        in (err.message)
    )
    assert "pass find_unused_parameters=True" in err.message


def test_torch_s_marked_ready_twice_error_names_reentrant_checkpointing_and_its_way_out() -> None:
    # torch 2.13: torch.utils.checkpoint(use_reentrant=True) inside DDP(find_unused_parameters=True).
    job = started(2)
    for r in (0, 1):
        job.error(
            r,
            T0 + 1 + r * 0.001,
            "Expected to mark a variable ready only once. This error is caused by one of the following reasons: "
            "1) Use of a module parameter outside the `forward` function. ...\nParameter at index 1 with name "
            "a.bias has been marked as ready twice.",
            step=0,
        )
    err = only(diagnose(job.snapshot(), T0 + 2), "rank_error")
    assert "reentrant activation checkpointing" in err.message and "pass use_reentrant=False" in err.message


@pytest.mark.parametrize(
    ("message", "said"),
    [
        (
            'Error(s) in loading state_dict for Sequential:\n\tMissing key(s) in state_dict: "0.weight", "0.bias". '
            '\n\tUnexpected key(s) in state_dict: "module.0.weight", "module.0.bias". ',
            "save model.module.state_dict() instead",
        ),
        (
            "Error(s) in loading state_dict for DistributedDataParallel:\n\tMissing key(s) in state_dict: "
            '"module.0.weight". \n\tUnexpected key(s) in state_dict: "0.weight". ',
            "load it into model.module instead",
        ),
        (
            "element 0 of tensors does not require grad and does not have a grad_fn",
            "torch.set_grad_enabled(False) still in force",
        ),
        (
            "The server socket has failed to listen on any local network address. port: 29533, useIpv6: false, "
            "code: -98, name: EADDRINUSE, message: address already in use",
            "another job on the same node with the same port (torchrun's default is 29500)",
        ),
        (
            "[enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/device.cc:84] ifa != "
            "nullptr. Unable to find address for: eth9",
            "GLOO_SOCKET_IFNAME names (the message says which), and this host has none of that name",
        ),
        (
            "DataLoader worker (pid 29820) is killed by signal: Killed. ",
            "DataLoader worker of this rank got SIGKILL, almost always from the kernel's OOM killer",
        ),
    ],
)
def test_torch_errors_a_user_meets_under_ddp_name_their_usual_cause(message: str, said: str) -> None:
    job = started(2)
    for r in (0, 1):
        job.error(r, T0 + 1 + r * 0.001, message, step=None)
    err = only(diagnose(job.snapshot(), T0 + 2), "rank_error")
    assert said in err.message


def test_a_job_whose_heard_ranks_all_exited_names_the_ranks_never_heard_of_not_a_silence_of_0_s() -> None:
    # Launched with a WORLD_SIZE one too large: ranks 0 and 1 ran (then were stopped), rank 2 never existed.
    job = JobRecords(3)
    for r in (0, 1):
        job.start(r)
    for r in (0, 1):
        job.exit(r, T0 + 20, reason="sigterm", step=0)
    silent = only(diagnose(job.snapshot(), T0 + 20.5), "job_silent")
    assert silent.message.startswith(
        "Every rank heard of has exited, and rank 2 of the job's 3 never reported"
    )
    assert "WORLD_SIZE larger than the ranks started" in silent.message


def test_a_rank_never_heard_of_that_the_job_id_check_says_sends_elsewhere_is_said_to_send_elsewhere() -> None:
    # Rank 1's DDPSCOPE_URL named another collector: rank 0's check said so; rank 1 never reached this one.
    job = JobRecords(2)
    job.start(0)
    elsewhere = (
        "the ranks of job 'job-a' send their records to 2 collector URLs: 'http://c:8321' (rank 0) and "
        "'http://typo:8321' (rank 1). Probably misconfigured: rank 1 on node1 (as many ranks use each; rank 0's "
        "is taken as the job's). Unless these name one collector, each sees only its ranks of the job."
    )
    job.add("warning", 0, T0 + 5, step=None, code="collectors_differ", message=elsewhere)
    job.exit(0, T0 + 20, step=5)
    found = diagnose(job.snapshot(), T0 + 20.5)
    assert only(found, "collectors_differ").culprit_ranks == [1]
    silent = only(found, "job_silent")
    assert silent.message.startswith(
        "Every rank heard of has exited, and rank 1 of the job's 2 sent its records elsewhere, under another job "
        "id or to another collector (see the job_ids_differ or collectors_differ incident)"
    ), silent.message


def test_a_distributed_checkpoint_failure_raised_on_every_rank_is_blamed_on_the_ranks_it_names() -> None:
    # torch 2.13: dcp.save where rank 1's checkpoint path cannot be made; every rank raises the same
    # exception, carrying rank 1's traceback.
    job = started(2)
    end = job.train(3)
    inner = (
        'Traceback (most recent call last):\n  File "/venv/torch/distributed/checkpoint/utils.py", line 212\n'
        '  File "/usr/lib/python3.11/pathlib.py", line 1116, in mkdir\n    os.mkdir(self, mode)\n'
        "FileNotFoundError: [Errno 2] No such file or directory: '/mnt/ckpt'\n"
    )
    for r in (0, 1):
        job.add("rank_error", r, end + 1 + r * 0.01, step=3, phase="idle", error_type="CheckpointException",
                message="CheckpointException ranks:dict_keys([1])\nTraceback: (RANK 1)\n" + inner,
                stack=f'  File "/proj/train.py", line 12, in <module>\n{inner}CheckpointException: '
                "CheckpointException ranks:dict_keys([1])\n", fatal=True)  # fmt: skip
    err = only(diagnose(job.snapshot(), end + 2), "rank_error")
    assert err.culprit_ranks == [1], err.message
    assert "rank 0 reported the same error" in err.message
    assert "the cause is on those ranks, usually a path missing or not writable on their hosts" in err.message
    assert err.message.endswith("Rank 1's own failure: FileNotFoundError: [Errno 2] No such file or directory: "
                                "'/mnt/ckpt'."), err.message  # fmt: skip
    assert "Every rank listed raised it itself" not in err.message


def test_urls_that_differ_but_reach_this_same_collector_are_no_incident() -> None:
    # Rank 1's node names the collector by address, rank 0's by host name: both reach this one.
    job = started(2)
    aliases = (
        "the ranks of job 'job-a' send their records to 2 collector URLs: 'http://collector:8321' (rank 0) and "
        "'http://10.0.0.5:8321' (rank 1). Probably misconfigured: rank 1 on node1 (as many ranks use each "
        "collector; rank 0's is taken as the job's)."
    )
    for r in (0, 1):
        job.add("warning", r, T0 + 5, step=None, code="collectors_differ", message=aliases)
    end = job.train(3, t=T0 + 6)
    assert "collectors_differ" not in kinds(diagnose(job.snapshot(), end))
