"""The README table builder and the shared bench helpers, on fixture result files (no benchmark runs)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from bench import common
from bench.run_all import collect
from bench.table import markdown, rows_for

ENGINE = {"target_ratio": 1.0, "models": {"mlp": {"ratio": 0.97}, "transformer": {"ratio": 1.08}}}
HANG = {"hang_timeout_s": 3.0, "runs": 2, "latency_s": {"median": 3.6, "max": 5.4}}
END_TO_END = {
    "targets": {"engine": 1.0, "instrument": 1.01},
    "cases": [
        {
            "model": "mlp",
            "world_size": 2,
            "ratios": {
                "engine": {"median": 0.99, "p10": 0.9, "p90": 1.1},
                "instrument": {"median": 1.05, "p10": 1.0, "p90": 1.2},
                "engine+agent+collector": {"median": 1.02, "p10": 0.95, "p90": 1.1},
            },
        }
    ],
}


def test_the_table_marks_each_figure_met_or_not_against_its_target() -> None:
    rows = rows_for("engine", ENGINE)
    assert [(r.measured, r.met) for r in rows] == [("0.970", True), ("1.080", False)]
    table = markdown(rows)
    assert table.splitlines()[0] == "| benchmark | figure | measured | target | met? |"
    assert "| 1.080 | ≤ 1.00 | **no** |" in table


def test_a_hang_slower_than_timeout_plus_two_seconds_misses_its_target_on_the_worst_run() -> None:
    (row,) = rows_for("hang_latency", HANG)
    assert row.measured == "3.60 s" and row.target == "≤ 5 s" and row.met is False


def test_a_ratio_without_a_target_is_published_with_no_verdict() -> None:
    rows = {r.figure.split(" /")[0]: r for r in rows_for("end_to_end", END_TO_END)}
    assert rows["engine"].met is True and rows["instrument"].met is False
    assert rows["engine+agent+collector"].met is None
    assert "p10..p90 0.95 .. 1.10" in rows["engine+agent+collector"].figure


def test_a_result_missing_keys_keeps_its_complete_figures_and_says_it_is_incomplete() -> None:
    complete = {
        "steps_per_arm": 3000, "step_overhead_pct": 0.4, "step_overhead_pct_per_rank": [0.3, 0.5],
        "thread_cpu_added_us": 50.0, "thread_cpu_added_pct_of_step": 0.5,
        "process_cpu_added_us": 70.0, "process_cpu_added_pct_of_step": 0.7,
    }  # fmt: skip
    broken = {**complete, "process_cpu_added_pct_of_step": "x"}
    data = {"target_pct": 1.0, "engine_benchmark": complete, "with_user_all_reduce": broken}
    rows = rows_for("watchdog", data)
    assert [r.met for r in rows[:3]] == [True, True, True] and rows[3].met is None
    assert rows[-1].figure == "result incomplete" and rows[-1].met is False


def test_collect_marks_result_files_older_than_the_run_as_stale(tmp_path: Path) -> None:
    (tmp_path / "engine.json").write_text(json.dumps(ENGINE))
    old = tmp_path / "hang_latency.json"
    old.write_text(json.dumps(HANG))
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    runs: dict[str, dict[str, object]] = {}
    results, rows = collect(["engine", "hang_latency", "scale"], runs, time.time() - 60, tmp_path)
    assert set(results) == {"engine", "hang_latency"}
    assert runs["engine"]["result"] == "fresh" and runs["scale"]["result"] == "missing"
    assert str(runs["hang_latency"]["result"]).startswith("stale")
    assert rows[-1].figure.endswith("[stale: not from this run]") and not rows[0].figure.endswith("]")


def test_a_fresh_file_is_not_this_runs_result_when_its_benchmark_failed_here(tmp_path: Path) -> None:
    (tmp_path / "engine.json").write_text(json.dumps(ENGINE))
    runs: dict[str, dict[str, object]] = {"engine": {"status": "failed (exit 2)"}}
    _, rows = collect(["engine"], runs, time.time() - 60, tmp_path)
    assert str(runs["engine"]["result"]).startswith("stale")
    assert all(r.figure.endswith("[stale: not from this run]") for r in rows)


def test_summary_gives_median_quartiles_and_spread() -> None:
    s = common.summary([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median"], s["p25"], s["p75"], s["iqr"], s["min"], s["max"], s["n"]) == (3, 2, 4, 2, 1, 5, 5)
    assert s["p10"] == pytest.approx(1.4) and s["p90"] == pytest.approx(4.6)
    assert common.summary([7.0])["iqr"] == 0
    assert common.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == 9
    with pytest.raises(ValueError):
        common.summary([])


def test_interleaved_blocks_rotate_their_order_and_ratios_are_taken_per_round() -> None:
    calls: list[str] = []

    def block(name: str, t: float) -> list[float]:
        calls.append(name)
        return [t, t, t * 3]

    samples, per_round = common.interleave(
        {"a": lambda: block("a", 1.0), "b": lambda: block("b", 2.0), "c": lambda: block("c", 1.5)}, 3
    )
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert len(samples["a"]) == 9 and per_round[0] == {"a": 1.0, "b": 2.0, "c": 1.5}
    assert common.ratios_to(per_round, "a") == {"b": [2.0] * 3, "c": [1.5] * 3}


def test_write_result_adds_the_machine_with_its_load_average(tmp_path: Path) -> None:
    path = common.write_result("fixture", {"x": 1}, tmp_path)
    data = json.loads(path.read_text())
    assert data["bench"] == "fixture" and data["x"] == 1
    assert data["machine"]["cpu_count"] == os.cpu_count() and len(data["machine"]["load_average"]) == 3
    assert "load average" in common.machine_line(data["machine"])


def test_scale_and_debug_aid_figures_are_published_without_a_verdict() -> None:
    scale = {
        "buckets": [
            {
                "buckets": 10,
                "json_bytes": 1156,
                "gzip_bytes": 356,
                "us_per_record": 700.4,
                "collector_cpu_us_per_record": 60.2,
            }
        ],
        "ranks": [
            {
                "ranks": 1024,
                "steps": 10,
                "records_per_s": 2600.0,
                "collector_cpu_us_per_record": 45.0,
                "queries_ms": {"stragglers": 1200.0, "incidents": 80.0},
            }
        ],
    }
    rows = rows_for("scale", scale)
    assert [r.measured for r in rows] == [
        "1,156 / 356 B; 700 (60) µs",
        "2,600 (45 µs); stragglers 1200 ms, incidents 80 ms",
    ]
    aids = {
        "model": "mlp",
        "world_size": 2,
        "ratios": {"INFO, wall": {"median": 1.02}},
        "detail_all_reduce": {"ratio": 6.5},
    }
    rows = rows_for("debug_aids", aids)
    assert [(r.measured, r.met) for r in rows] == [("1.020", None), ("6.50", None)]
    assert all(r.met is None for r in rows_for("scale", scale))


def test_accounted_costs_are_summed_per_part_and_judged_against_one_percent_of_the_step() -> None:
    from bench.cost_accounting import _shares

    def rank(step_us: float, calls_us: float) -> dict[str, object]:
        return {
            "median_step_us": step_us,
            "us_per_step": {
                "agent thread": 40.0,
                "shipper process": 50.0,
                "agent calls on the training thread": 10.0,
                "recorder calls on the training thread": calls_us,
                "watchdog thread": 10.0,
                "training thread (all of it)": 9000.0,
            },
            "as_timed_us_per_step": {"recorder": calls_us + 20.0, "agent": 12.0},
            "measuring_floor_ns_per_call": {"recorder": 5_000.0, "agent": 2_000.0},
        }

    shares = _shares([rank(10_000.0, 150.0), rank(10_000.0, 250.0)])
    assert (shares["agent_pct"], shares["recorder_watchdog_pct"]) == (1.0, 2.1)
    assert shares["measuring_floor_us_per_call"] == {"recorder": 5.0, "agent": 2.0}
    rows = rows_for("cost_accounting", {"target_pct": 1.0, "models": {"mlp": shares}})
    assert [(r.measured, r.met) for r in rows] == [("1.00 %", True), ("2.10 %", False)]
    assert "net of 5.0 µs/call measuring" in rows[1].figure
    observed = {"target_pct": 1.0, "observed": "torch DDP + instrument()", "models": {"mlp": shares}}
    assert all(
        r.figure.startswith("instrument(), ") for r in rows_for("cost_accounting_instrument", observed)
    )


def test_the_replica_digest_row_gives_its_share_of_a_step_and_of_the_schedule() -> None:
    data = {"every": 64, "models": {"mlp": {"parameters": 6, "digest_ms": 0.2, "step_ms": 6.6,
                                            "digest_pct_of_step": 3.03, "amortized_pct": 0.047}}}  # fmt: skip
    (row,) = rows_for("replicas", data)
    assert row.measured == "3.03 % (0.047 %)" and "every 64 steps" in row.figure and row.met is None


def test_the_median_interval_covers_the_true_median_about_95_times_in_100() -> None:
    import random

    rng = random.Random(7)
    trials = 1000
    covered = sum(
        lo <= 0.0 <= hi
        for lo, hi in (common.median_interval([rng.gauss(0, 1) for _ in range(150)]) for _ in range(trials))
    )
    assert 0.92 <= covered / trials <= 0.98
    assert common.median_interval([3.0]) == (3.0, 3.0)
    with pytest.raises(ValueError, match="no values"):
        common.median_interval([])
