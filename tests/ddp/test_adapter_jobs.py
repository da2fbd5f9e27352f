"""``instrument(torch DDP)`` in real 2-rank gloo jobs (tests/ddp/adapter_jobs/adapter_job.py).

Each scenario runs once per module; the tests read what every rank wrote: its records (validated
against the wire format) and the facts the job measured itself (parameters bit-for-bit against an
uninstrumented twin, torch's own ``_get_ddp_logging_data()`` of every step).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpscope.agent.records import validate_record
from tests.ddp.failure_jobs.runner import JobRun
from tests.support.eval_mode import FORGETS_AT
from tests.support.procs import exited_cleanly, run_ranks

pytestmark = pytest.mark.slow

JOB = Path(__file__).parent / "adapter_jobs" / "adapter_job.py"
HANG_ENV = {"DDPSCOPE_HANG_TIMEOUT": "1.0", "DDPSCOPE_HEARTBEAT_S": "0.2", "JOB_STALL_S": "3.0"}


class AdapterRun(JobRun):
    results_json: dict[int, dict[str, Any]]


def run(scenario: str, out: Path, env: dict[str, str] | None = None, world_size: int = 2) -> AdapterRun:
    ranks = range(world_size)
    # Under the job's 60 s process-group timeout, as ddpscope advises (else each rank warns about it).
    env = {"DDPSCOPE_HANG_TIMEOUT": "30", **(env or {})}
    results = run_ranks(JOB, world_size, args=[scenario, str(out)], env=env, timeout_s=120)
    records = {}
    for rank in ranks:
        path = out / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        records[rank] = [json.loads(line) for line in lines]
        for record in records[rank]:
            validate_record(record)
    job = AdapterRun(results, records)
    assert all(exited_cleanly(r) for r in results), job.output()
    job.results_json = {r: json.loads((out / f"rank{r}.json").read_text()) for r in ranks}
    return job


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> AdapterRun:
    return run("parity", tmp_path_factory.mktemp("parity"))


@pytest.fixture(scope="module")
def unused(tmp_path_factory: pytest.TempPathFactory) -> AdapterRun:
    return run("unused", tmp_path_factory.mktemp("unused"))


@pytest.fixture(scope="module")
def userhook(tmp_path_factory: pytest.TempPathFactory) -> AdapterRun:
    return run("userhook", tmp_path_factory.mktemp("userhook"))


@pytest.fixture(scope="module")
def hang(tmp_path_factory: pytest.TempPathFactory) -> AdapterRun:
    return run("hang", tmp_path_factory.mktemp("hang"), HANG_ENV)


def steps(job: JobRun, rank: int) -> list[dict[str, Any]]:
    return job.of(rank, "step")


# -- gradients -------------------------------------------------------------------------------------


def test_parameters_are_bit_identical_to_uninstrumented_torch_ddp_after_several_steps(
    parity: AdapterRun,
) -> None:
    for rank in (0, 1):
        assert parity.results_json[rank]["identical"], parity.results_json[rank]["max_diff"]


def test_a_gradient_penalty_s_input_gradient_is_not_taken_for_the_step_s_backward(tmp_path: Path) -> None:
    job = run("penalty", tmp_path)
    for rank in (0, 1):
        assert job.results_json[rank]["identical"], job.results_json[rank]["max_diff"]
        assert job.of(rank, "warning") == []  # it once said the gradients were never all-reduced
        synced = [r for r in steps(job, rank) if r["synced"]]
        assert len(synced) == 6 and all(r["collective_seqs"] for r in synced)  # adapter_job.STEPS


def test_gradients_kept_in_their_buckets_are_scaled_as_torch_does_on_three_ranks(tmp_path: Path) -> None:
    # gradient_as_bucket_view + zero_grad(set_to_none=False): torch divides by 3 in the bucket, which
    # differs in the last bit from multiplying by 1/3 (what it does to a gradient it copies in).
    job = run("asview", tmp_path, world_size=3)
    for rank in range(3):
        assert job.results_json[rank]["identical"], job.results_json[rank]["max_diff"]


def test_find_unused_parameters_still_trains_identically(unused: AdapterRun) -> None:
    for rank in (0, 1):
        assert unused.results_json[rank]["identical"], unused.results_json[rank]["max_diff"]


@pytest.mark.parametrize("scenario", ["static", "sparse", "join"])
def test_static_graphs_sparse_gradients_and_uneven_inputs_train_identically_and_are_recorded(
    scenario: str, tmp_path: Path
) -> None:
    # Each reaches torch's process group another way (delayed launches, a sparse all-reduce, the
    # Join hook's shadow all-reduces): all of them through ddpscope's observed group.
    job = run(scenario, tmp_path)
    for rank in (0, 1):
        assert job.results_json[rank]["identical"], job.results_json[rank]["max_diff"]
        (start,) = job.of(rank, "rank_start")
        assert start["static_graph"] is (scenario == "static")
        reductions = [r for r in job.of(rank, "collective") if r["op"] == "all_reduce"]
        seqs = {r["coll_seq"] for r in reductions}
        ended = {r["coll_seq"] for r in job.of(rank, "collective_end") if r["ok"]}
        assert seqs and seqs <= ended  # every recorded all-reduce ended, none failed
        # Named alike on every rank (a ReduceOp object's str holds its address), so ranks match.
        assert all(r["reduce_op"].isalpha() and r["reduce_op"].isupper() for r in reductions)
        for record in steps(job, rank):
            if record["synced"]:
                assert record["collective_seqs"] and set(record["collective_seqs"]) <= seqs
                assert all(end > 0 for end in record["allreduce_end_ns"])
    ops = [
        {
            (r["pg"], r["coll_seq"]): r["reduce_op"]
            for r in job.of(rank, "collective")
            if r["op"] == "all_reduce"
        }
        for rank in (0, 1)
    ]
    common = ops[0].keys() & ops[1].keys()
    assert common and all(ops[0][key] == ops[1][key] for key in common)


def test_a_users_comm_hook_passed_through_instrument_gives_the_same_parameters(userhook: AdapterRun) -> None:
    for rank in (0, 1):
        assert userhook.results_json[rank]["identical"], userhook.results_json[rank]["max_diff"]


def test_a_comm_hook_registered_after_instrument_is_timed_as_if_passed_through_it(tmp_path: Path) -> None:
    # Registered behind ddpscope's back, torch called the hook instead of the observed group: same
    # gradients, but no bucket all-reduce measured (every step's communication read as zero).
    job = run("hookafter", tmp_path)
    for rank in (0, 1):
        result = job.results_json[rank]
        assert result["identical"], result["max_diff"]
        assert "only be called once" in result["second"]  # torch's own refusal of a second hook
        synced = [r for r in steps(job, rank) if r["synced"]]
        assert synced and all(r["collective_seqs"] for r in synced)
        for record in synced:
            assert all(
                0 < s < e
                for s, e in zip(record["allreduce_start_ns"], record["allreduce_end_ns"], strict=True)
            )


def test_a_model_with_its_own_comm_hook_is_refused_with_the_way_to_pass_it_through(
    userhook: AdapterRun,
) -> None:
    message = userhook.results_json[0]["refusal"]
    assert "fp16_compress_hook" in message
    assert "instrument(model, comm_hook=" in message


# -- records ---------------------------------------------------------------------------------------


def test_rank_start_says_torch_engine_and_the_layout_is_learned_then_rebuilt(parity: AdapterRun) -> None:
    for rank in (0, 1):
        (start,) = parity.of(rank, "rank_start")
        assert start["engine"] == "torch" and start["world_size"] == 2 and start["bucket_cap_mb"] == 25.0
        layouts = parity.of(rank, "layout")
        assert [(lay["reason"], lay["step"]) for lay in layouts] == [("initial", 0), ("rebuilt", 1)]
        initial, rebuilt = layouts
        assert len(initial["buckets"]) == 1  # torch's iteration 0: one bucket with every parameter
        # torch's "Parameter indices which did not receive grad" index this list.
        assert (
            initial["parameter_order"]
            == rebuilt["parameter_order"]
            == parity.results_json[rank]["reducer_parameters"]
        )
        # Rebuilt in gradient-ready order: the last layer first, a ~1 MiB first bucket.
        assert rebuilt["buckets"][0]["parameters"][:2] == ["5.bias", "5.weight"]
        assert [b["bytes"] for b in rebuilt["buckets"]] == [4 * 263168, 2 * 263168]


def test_bucket_count_and_sizes_match_torchs_own_logging_data(parity: AdapterRun) -> None:
    for rank in (0, 1):
        logged = parity.results_json[rank]["logged"][-1]
        initial, rebuilt = parity.of(rank, "layout")
        assert [b["bytes"] for b in initial["buckets"]] == [int(s) for s in logged["bucket_sizes"].split(",")]
        assert [b["bytes"] for b in rebuilt["buckets"]] == [
            int(s) for s in logged["rebuilt_bucket_sizes"].split(",")
        ]
        names = parity.results_json[rank]["reducer_parameters"]
        torch_buckets = [
            [names[int(i)] for i in group.split()]
            for group in logged["rebuilt_per_bucket_param_indices"].split(",")
        ]
        assert [b["parameters"] for b in rebuilt["buckets"]] == torch_buckets
        for record in steps(parity, rank):
            if record["synced"] and record["step"] >= 1:
                assert record["bucket_bytes"] == [b["bytes"] for b in rebuilt["buckets"]]
                assert logged["num_buckets_reduced"] == len(record["bucket_bytes"])


def test_a_rebuild_with_a_bucket_of_sparse_gradients_is_read_from_torchs_logging_data(tmp_path: Path) -> None:
    # torch's Reducer cannot show a sparse bucket (_get_zeros_like_grad_buckets raises on it).
    job = run("sparse", tmp_path)
    for rank in (0, 1):
        logged = job.results_json[rank]["logged"][-1]
        names = job.results_json[rank]["reducer_parameters"]
        torch_buckets = [
            [names[int(i)] for i in group.split()]
            for group in logged["rebuilt_per_bucket_param_indices"].split(",")
        ]
        layouts = job.of(rank, "layout")
        assert [lay["reason"] for lay in layouts] == ["initial", "rebuilt"]
        assert [b["parameters"] for b in layouts[-1]["buckets"]] == torch_buckets
        assert layouts[-1]["buckets"] != layouts[0]["buckets"]  # torch did reorder them


def test_allreduce_span_and_overlap_agree_with_torchs_sampled_timings(parity: AdapterRun) -> None:
    for rank in (0, 1):
        synced = [s for s in steps(parity, rank) if s["synced"]]
        # Records are on the job's aligned clock; torch stamps this host's time_ns().
        (start,) = parity.of(rank, "rank_start")
        offset = start["clock_offset_ns"]
        start_diff, ready_diff, overlap_diff, end_lag = [], [], [], []
        # DDP writes a step's timings at the start of the next synced forward (TORCH-FACTS).
        for logged in parity.results_json[rank]["logged"][1:]:
            mine = [s for s in synced if s["step"] < logged["read_at_step"]][-1]
            first_launch = min(mine["allreduce_start_ns"]) - offset
            last_ready = max(mine["bucket_ready_ns"]) - offset
            last_end = max(mine["allreduce_end_ns"]) - offset
            start_diff.append(abs(first_launch - logged["backward_comm_time_start"]))
            ready_diff.append(abs(last_ready - logged["backward_compute_time_end"]))
            overlap = last_ready - first_launch
            overlap_diff.append(abs(overlap - logged["backward_compute_comm_overlap_time"]))
            # torch stamps comm end after its finalizer woke up from the wait: never before ours.
            end_lag.append(logged["backward_comm_time_end"] - last_end)
        assert len(start_diff) >= 4
        ms = 1_000_000
        assert statistics.median(start_diff) < 1 * ms, start_diff
        assert statistics.median(ready_diff) < 3 * ms, ready_diff
        assert statistics.median(overlap_diff) < 3 * ms, overlap_diff
        # ddpscope stamps an end in Python, torch in C++: when another thread holds the GIL (the
        # agent's worker), the stamp waits for it, at most one switch interval.
        switch = int(sys.getswitchinterval() * 1e9)
        assert min(end_lag) > -switch - ms // 2 and statistics.median(end_lag) < 15 * ms, end_lag


def test_step_records_are_ordered_in_time_with_one_collective_per_bucket(parity: AdapterRun) -> None:
    for rank in (0, 1):
        records = steps(parity, rank)
        assert [r["step"] for r in records] == list(range(6))
        seqs = [r["coll_seq"] for r in parity.of(rank, "collective") if r["pg"] == "default"]
        for r in records:
            assert (
                r["forward_start_ns"] <= r["forward_end_ns"] <= r["backward_start_ns"] <= r["backward_end_ns"]
            )
            if not r["synced"]:
                continue
            assert all(seq in seqs for seq in r["collective_seqs"])
            for ready, start, end in zip(
                r["bucket_ready_ns"], r["allreduce_start_ns"], r["allreduce_end_ns"], strict=True
            ):
                assert r["backward_start_ns"] <= ready <= start < end <= r["backward_end_ns"]
        assert records[0]["collective_seqs"] == [seqs[0]]
        # The two ranks number their bucket all-reduces identically.
    assert [r["collective_seqs"] for r in steps(parity, 0)] == [
        r["collective_seqs"] for r in steps(parity, 1)
    ]


def test_each_bucket_all_reduce_record_carries_its_bucket_shape_step_and_end(parity: AdapterRun) -> None:
    # The hook's records come from per-bucket plans (made once per bucket size): they must still say
    # what each step's all-reduce was, across torch's bucket rebuild after the first iteration.
    for rank in (0, 1):
        begins = {r["coll_seq"]: r for r in parity.of(rank, "collective") if r["pg"] == "default"}
        ends = {r["coll_seq"]: r for r in parity.of(rank, "collective_end") if r["pg"] == "default"}
        for step in steps(parity, rank):
            if not step["synced"]:
                continue
            for seq, size in zip(step["collective_seqs"], step["bucket_bytes"], strict=True):
                record = begins[seq]
                assert (record["op"], record["reduce_op"], record["source"]) == (
                    "all_reduce",
                    "SUM",
                    "engine",
                )
                assert record["step"] == step["step"] and record["dtypes"] == ["float32"]
                assert record["shapes"] == [[size // 4]]
                assert ends[seq]["ok"] is True and ends[seq]["end_ns"] >= record["start_ns"]


def test_no_sync_steps_are_recorded_unsynchronised_without_buckets(parity: AdapterRun) -> None:
    record = steps(parity, 0)[3]
    assert record["synced"] is False
    assert record["bucket_bytes"] == [] and record["collective_seqs"] == []


def test_unused_parameters_are_those_without_a_gradient_in_a_synced_step(unused: AdapterRun) -> None:
    for rank in (0, 1):
        by_step = {r["step"]: r for r in steps(unused, rank)}
        for step in (0, 2, 4):
            assert sorted(by_step[step]["unused_parameters"]) == sorted(
                ["odd.weight", "odd.bias", "never.weight", "never.bias"]
            )
        for step in (1, 5):
            assert sorted(by_step[step]["unused_parameters"]) == ["never.bias", "never.weight"]
        # find_unused_parameters=True: torch never rebuilds, the initial layout stays.
        assert [lay["reason"] for lay in unused.of(rank, "layout")] == ["initial"]


# -- hangs -----------------------------------------------------------------------------------------


def stalled(job: JobRun, rank: int) -> dict[str, Any]:
    """The hang report of the planned stall (a loaded machine may add a spurious one elsewhere)."""
    reports = [r for r in job.of(rank, "hang") if r["step"] == 2]
    assert reports, job.of(rank, "hang")
    return reports[0]


def test_a_rank_stalled_in_backward_names_the_parameters_whose_gradients_never_arrived(
    hang: AdapterRun,
) -> None:
    report = stalled(hang, 1)
    assert report["phase"] == "backward"
    # The bucket torch launched before the stall completed meanwhile: the rank is not waiting in it.
    assert report["inflight"] == []
    waiting = [b for b in report["pending_buckets"] if not b["launched"]]
    missing = {name for b in waiting for name in b["missing"]}
    # The sleep sits between layers 1 and 2: the first two layers' gradients never arrived.
    assert {"0.weight", "0.bias", "1.weight", "1.bias"} <= missing
    assert "5.weight" not in missing
    assert "0.weight" in report["message"]


def test_its_peer_reports_the_launched_bucket_and_the_inflight_all_reduce(hang: AdapterRun) -> None:
    report = stalled(hang, 0)
    assert report["pending_buckets"] and all(b["launched"] for b in report["pending_buckets"])
    assert any(c["op"] == "all_reduce" and c["pg"] == "default" for c in report["inflight"])
    for rank in (0, 1):
        assert max(r["hang_s"] for r in hang.of(rank, "hang_resolved")) >= 1.0
        assert [r["step"] for r in steps(hang, rank)] == [0, 1, 2, 3, 4, 5]


def test_a_comm_hook_that_issued_no_collective_leaves_none_recorded_and_its_hang_names_the_hook(
    tmp_path: Path,
) -> None:
    job = run("hooklate", tmp_path, HANG_ENV)
    report = stalled(job, 1)
    assert report["inflight"] == [], report["inflight"]  # not a bucket all-reduce it never issued
    line = job.results_json[1]["hook_line"]
    hooked = [b for b in report["pending_buckets"] if b.get("hook")]
    assert hooked and hooked[0]["launched"], report["pending_buckets"]
    assert hooked[0]["hook"].startswith("hooklate.<locals>.late_hook() at ")
    assert hooked[0]["hook"].endswith(f"adapter_job.py:{line}")
    # Its peer waits in the bucket's all-reduce, which rank 1 issued only when the timer fired, after its report.
    waited = {c["coll_seq"] for c in stalled(job, 0)["inflight"] if c["pg"] == "default"}
    issued = [c for c in job.of(1, "collective") if c["pg"] == "default" and c["coll_seq"] in waited]
    assert waited and issued and all(c["start_ns"] > report["time_ns"] for c in issued), issued


def test_a_rank_stalled_between_forward_and_backward_awaits_no_gradient_yet(hang: AdapterRun) -> None:
    (report,) = [r for r in hang.of(1, "hang") if r["step"] == 4]
    # Not "gradients never arrived" (which reads as unused parameters): backward has not begun.
    assert (report["phase"], report["pending_buckets"], report["inflight"]) == ("after_forward", [], [])
    assert "between forward and backward" in report["message"]


# -- disabled --------------------------------------------------------------------------------------


def test_disabled_attaches_nothing_but_still_registers_the_users_hook(tmp_path: Path) -> None:
    job = run("disabled", tmp_path, {"DDPSCOPE_DISABLED": "1"}, world_size=1)
    assert job.results_json[0] == {
        "same_object": True,
        "instrumentation": False,
        "forward_hooks": 0,
        "comm_hooks": ["fp16_compress_hook"],
        "param_hooks": 0,
    }
    assert job.records[0] == []


def test_a_training_step_through_model_module_is_called_out_once_and_is_no_step(tmp_path: Path) -> None:
    job = run("bypass", tmp_path)
    (warning,) = job.results_json[0]["warnings"]
    assert warning.startswith("ddpscope: rank 0: the backward() at ") and "adapter_job.py:" in warning
    assert "gave 4 parameter(s)" in warning and "not all-reduced" in warning
    assert job.results_json[1]["warnings"] == []
    (record,) = [r for r in job.records[0] if r["kind"] == "warning"]
    assert (record["code"], record["step"], len(record["parameters"])) == ("unsynced_gradients", 0, 4)
    assert not [r for r in job.records[1] if r["kind"] == "warning"]
    steps = {r: [s["step"] for s in job.records[r] if s["kind"] == "step"] for r in (0, 1)}
    assert steps == {0: [0, 1], 1: [0, 1, 2, 3]}  # the bypassing backwards recorded no step


def test_a_layer_unfrozen_after_wrapping_is_called_out_once_on_every_rank_as_torch_lets_it_drift(
    tmp_path: Path,
) -> None:
    job = run("thawed", tmp_path)
    for rank in (0, 1):
        assert not job.results_json[rank]["first_equal"]
        (warning,) = job.results_json[rank]["warnings"]
        assert (
            "2 parameter(s) that were frozen (requires_grad=False)" in warning
            and "'0.weight', '0.bias'" in warning
        )
        (record,) = [r for r in job.records[rank] if r["kind"] == "warning"]
        assert (record["code"], record["step"], record["parameters"]) == (
            "unsynced_gradients", 2, ["0.weight", "0.bias"],
        )  # fmt: skip


def test_torchs_error_for_a_layer_frozen_after_wrapping_carries_a_note_naming_the_cause(
    tmp_path: Path,
) -> None:
    job = run("frozen_late", tmp_path)
    for rank in (0, 1):
        (note,) = job.results_json[rank]["notes"]
        assert note.startswith(
            "ddpscope: parameters ['0.weight', '0.bias'] were frozen (requires_grad=False)"
        )
        (error,) = [r for r in job.records[rank] if r["kind"] == "rank_error"]
        assert note in error["stack"]  # shipped: the collector's advice reads it


def test_torchs_error_after_a_backward_cut_short_by_a_caught_exception_says_the_parameters_were_not_unused(
    tmp_path: Path,
) -> None:
    job = run("cut_short", tmp_path)
    for rank in (0, 1):
        assert job.results_json[rank]["caught"] == [1]
        (note,) = job.results_json[rank]["notes"]
        assert note.startswith("ddpscope: the backward of step 1 began on this rank and never finished"), note
        assert "the parameters torch lists were not unused" in note
        (error,) = [r for r in job.records[rank] if r["kind"] == "rank_error"]
        assert "Parameter indices which did not receive grad" in error["message"]
        assert note in error["stack"]  # shipped: the collector reads it instead of torch's advice


def test_a_rank_dependent_update_under_torchs_engine_shows_in_the_replica_digests(tmp_path: Path) -> None:
    job = run("replicas", tmp_path)
    digests = [{r["step"]: r for r in job.records[rank] if r["kind"] == "replica_digest"} for rank in (0, 1)]
    assert sorted(digests[0]) == sorted(digests[1]) == [0, 1, 2, 4, 8]
    layout = next(r for r in job.records[0] if r["kind"] == "layout")
    assert digests[0][0]["parameters"] == len(layout["parameter_order"]) == 4
    for step in (0, 1, 2):
        assert digests[0][step]["norms"] == digests[1][step]["norms"]
    for step in (4, 8):
        assert all(a != b for a, b in zip(digests[0][step]["norms"], digests[1][step]["norms"], strict=True))
    for rank in (0, 1):
        (warning,) = [r for r in job.records[rank] if r["kind"] == "warning"]
        assert warning["parameters"] == ["extra.weight", "extra.bias"] and warning["step"] == 8


def test_training_steps_after_a_model_eval_on_one_rank_are_called_out_under_instrument(
    tmp_path: Path,
) -> None:
    job = run("eval_mode", tmp_path)
    for rank in (0, 1):
        records = [
            r for r in job.records[rank] if r["kind"] == "warning" and r["code"] == "trains_in_eval_mode"
        ]
        if rank == 1:
            assert records == [] and job.results_json[1]["warnings"] == []
            continue
        (record,) = records  # not the validation at step 1, which went back to train mode
        # Step numbers count forwards with gradients on: the validation at VALIDATES_AT was one.
        assert record["step"] == FORGETS_AT + 1, record
        assert (
            "model.eval()" in record["message"] and "call model.train() before training" in record["message"]
        )
        (warning,) = job.results_json[0]["warnings"]
        assert "eval mode" in warning
