"""The README table: one row per published figure, built from the benchmarks' result files.

Each benchmark writes its own JSON shape; ``ROWS`` maps a benchmark name to a function that pulls
its figures out as ``Row``s (figure, measured, target, met). A missing key skips that figure rather
than failing the table: a benchmark that crashed half-way still gets its other rows published.
``met`` is None where there is no target (a comparison, or a figure published so users can plan).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class Row:
    bench: str
    figure: str
    measured: str
    target: str
    met: bool | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(x: float) -> str:
    return f"{x * 100:+.1f} %"


def _ratio_row(bench: str, figure: str, ratio: float, limit: float | None) -> Row:
    target = f"≤ {limit:.2f}" if limit is not None else "—"
    met = None if limit is None else ratio <= limit
    return Row(bench, figure, f"{ratio:.3f}", target, met)


def _engine(d: Mapping[str, Any]) -> Iterator[Row]:
    limit = float(d.get("target_ratio", 1.0))
    for name, m in d["models"].items():
        yield _ratio_row("engine", f"ddpscope engine / torch DDP step, {name}, 2 ranks", m["ratio"], limit)
        if "cpu_ratio" in m:
            figure = f"ddpscope engine / torch DDP, training-thread CPU per step, {name}, 2 ranks"
            yield _ratio_row("engine", figure, m["cpu_ratio"], None)


def _adapter(d: Mapping[str, Any]) -> Iterator[Row]:
    limit = float(d.get("target_overhead", 0.01))
    for m in d["results"]:
        over = m["overhead"]["instrumented"]
        lo, hi = m["overhead_p10_p90"]["instrumented"]
        interval = m.get("overhead_ci95", {}).get("instrumented")
        said = f"; the median's 95 % interval {_pct(interval[0])} .. {_pct(interval[1])}" if interval else ""
        yield Row(
            "adapter",
            f"instrument() step overhead, {m['model']}, 2 ranks (p10..p90 {_pct(lo)} .. {_pct(hi)}{said})",
            _pct(over),
            f"≤ {limit * 100:.0f} %",
            over <= limit,
        )
        # What torch charges for the mechanisms issue 7 prescribes, before ddpscope records anything.
        thread = m.get("thread_cpu_overhead", {})
        floors = (
            ("param_hooks", "a no-op post-accumulate-grad hook per parameter"),
            ("observed_group", "the Reducer all-reducing through ObservedGroup"),
        )
        for variant, what in floors:
            if variant in thread:
                figure = f"floor: {what}, training-thread CPU / plain torch DDP, {m['model']}, 2 ranks"
                yield Row("adapter", figure, _pct(thread[variant]), "—", None)


def _watchdog(d: Mapping[str, Any]) -> Iterator[Row]:
    limit = float(d.get("target_pct", 1.0))
    for key, where, judged in (
        ("engine_benchmark", "engine benchmark's MLP", True),  # where the target is set
        ("with_user_all_reduce", "same MLP + a user all_reduce a step", False),
    ):
        a = d.get(key)
        if not a:
            continue
        per_rank = ", ".join(f"{x:+.1f}" for x in a["step_overhead_pct_per_rank"])
        for figure, value in (
            (f"wall step time ({a['steps_per_arm']:,} steps per arm interleaved; ranks {per_rank} %)",
             a["step_overhead_pct"]),
            (f"training-thread CPU added ({a['thread_cpu_added_us']:.0f} µs), share of the step",
             a["thread_cpu_added_pct_of_step"]),
            (f"process CPU added, all threads ({a['process_cpu_added_us']:.0f} µs), share of the step",
             a["process_cpu_added_pct_of_step"]),
        ):  # fmt: skip
            target, met = (f"≤ {limit:.0f} %", value <= limit) if judged else ("—", None)
            yield Row("watchdog", f"recorder + watchdog, {where}: {figure}", f"{value:+.2f} %", target, met)
    if "small_all_reduce_us_on" in d:
        label = "1-element all_reduce on 2 ranks in a tight loop, per call: recorder on vs off"
        measured = f"{d['small_all_reduce_us_on']:.0f} vs {d['small_all_reduce_us_off']:.0f} µs"
        yield Row("watchdog", label, measured, "—", None)


def _agent(d: Mapping[str, Any]) -> Iterator[Row]:
    emit = d["latency"]["emit"]
    yield Row("agent", "emit() p50", f"{emit['p50_ns'] / 1e3:.2f} µs", "≤ 1 µs", emit["p50_ns"] <= 1000)
    yield Row("agent", "emit() p99", f"{emit['p99_ns'] / 1e3:.2f} µs", "≤ 10 µs", emit["p99_ns"] <= 10_000)
    yield Row("agent", "emit() max", f"{emit['max_ns'] / 1e6:.1f} ms", "—", None)
    ship = d["shipping"]["spool_and_shipper"]["records_per_s"]
    yield Row("agent", "step records shipped/s (spool + shipper)", f"{ship:,.0f}", "—", None)
    # A stress figure, not the target (that one is on the engine benchmark: bench.cost_accounting).
    over = d["training_step"]["overhead"]
    yield Row(
        "agent",
        "agent overhead, synthetic 7 ms step with a 50-bucket step + 8 collective records",
        _pct(over),
        "—",
        None,
    )


def _cost_accounting(d: Mapping[str, Any]) -> Iterator[Row]:
    limit = float(d.get("target_pct", 1.0))
    for name, m in d["models"].items():
        us = m["us_per_step"]
        step_ms = m["median_step_us"] / 1e3
        agent_parts = (
            f"thread {us['agent thread']:.0f} + shipper {us['shipper process']:.0f} + calls "
            f"{us['agent calls on the training thread']:.0f} µs"
        )
        recorder_parts = f"calls {us['recorder calls on the training thread']:.0f} + watchdog {us['watchdog thread']:.0f} µs"
        floor = m.get("measuring_floor_us_per_call")
        if floor:  # calls are net of the measuring wrapper's own cost (bench.cost_accounting)
            recorder_parts += f"; calls net of {floor['recorder']:.1f} µs/call measuring"
        observed = "instrument(), " if str(d.get("observed", "")).startswith("torch") else ""
        for label, key, parts in (
            ("agent", "agent_pct", agent_parts),
            ("recorder + watchdog", "recorder_watchdog_pct", recorder_parts),
        ):
            yield Row(
                "cost_accounting",
                f"{observed}{label}, CPU accounted per {step_ms:.1f} ms step, {name}, 2 ranks ({parts})",
                f"{m[key]:.2f} %",
                f"≤ {limit:.0f} %",
                m[key] <= limit,
            )


def _collector(d: Mapping[str, Any]) -> Iterator[Row]:
    targets = d.get("targets", {})
    rate_t, ratio_t = targets.get("records_per_s", 20_000), targets.get("ratio_to_raw", 0.8)
    for db in ("sqlite", "postgresql"):
        if db in d["ingest"]:
            r = d["ingest"][db]
            yield Row(
                "collector",
                f"ingest, {db} (step records/s; x raw executemany)",
                f"{r['records_per_s']:,.0f} ({r['ratio_to_raw']:.2f} x)",
                f"≥ {rate_t:,} ({ratio_t} x)",
                r["records_per_s"] >= rate_t and r["ratio_to_raw"] >= ratio_t,
            )
    q = d["queries"]
    limit = targets.get("query_p95_ms", 50)
    for name in ("timeline", "steps", "stragglers"):
        if name in q:
            p95 = q[name]["p95_ms"]
            yield Row(
                "collector",
                f"query p95, {name} ({q['step_records']:,} step records)",
                f"{p95:.1f} ms",
                f"≤ {limit} ms",
                p95 <= limit,
            )


def _dashboard(d: Mapping[str, Any]) -> Iterator[Row]:
    limit = d.get("target_s", 1.0)
    for phase in ("warm", "cold"):
        s = d[phase]["first_render_s"]
        yield Row(
            "dashboard",
            f"timeline first render, {d.get('ranks')} ranks x {d.get('buckets')} buckets, {phase}",
            f"{s:.2f} s",
            f"≤ {limit} s",
            s <= limit,
        )


def _end_to_end(d: Mapping[str, Any]) -> Iterator[Row]:
    for c in d["cases"]:
        for variant, r in c["ratios"].items():
            limit = d.get("targets", {}).get(variant)
            fig = f"{variant} / torch DDP step, {c['model']}, {c['world_size']} ranks"
            row = _ratio_row("end_to_end", fig, r["median"], limit)
            row.figure += f" (p10..p90 {r['p10']:.2f} .. {r['p90']:.2f})"
            yield row


def _debug_aids(d: Mapping[str, Any]) -> Iterator[Row]:
    for name, r in d["ratios"].items():
        yield Row(
            "debug_aids",
            f"{name} / plain torch DDP step, {d['model']}, {d['world_size']} ranks",
            f"{r['median']:.3f}",
            "—",
            None,
        )
    if "detail_all_reduce" in d:
        r = d["detail_all_reduce"]
        yield Row("debug_aids", "DETAIL / plain, small raw all_reduce", f"{r['ratio']:.2f}", "—", None)


def _hang_latency(d: Mapping[str, Any]) -> Iterator[Row]:
    limit = d["hang_timeout_s"] + 2.0
    s = d["latency_s"]["median"]
    yield Row(
        "hang_latency",
        f"hang start to incident at the collector (timeout {d['hang_timeout_s']} s, {d['runs']} runs, max "
        f"{d['latency_s']['max']:.2f} s)",
        f"{s:.2f} s",
        f"≤ {limit:.0f} s",
        d["latency_s"]["max"] <= limit,
    )


def _scale(d: Mapping[str, Any]) -> Iterator[Row]:
    for r in d.get("buckets", []):
        yield Row(
            "scale",
            f"step record, {r['buckets']} buckets: JSON / gzip size; ingest µs/record wall (collector CPU)",
            f"{r['json_bytes']:,} / {r['gzip_bytes']:,} B; {r['us_per_record']:.0f} "
            f"({r['collector_cpu_us_per_record']:.0f}) µs",
            "—",
            None,
        )
    for r in d.get("ranks", []):
        q = r.get("queries_ms", {})
        qs = ", ".join(f"{k} {v:.0f} ms" for k, v in q.items())
        yield Row(
            "scale",
            f"{r['ranks']} ranks x {r['steps']} steps: ingest records/s (collector CPU/record); queries",
            f"{r['records_per_s']:,.0f} ({r['collector_cpu_us_per_record']:.0f} µs); {qs}",
            "—",
            None,
        )


def _replicas(d: Mapping[str, Any]) -> Iterator[Row]:
    for name, m in d.get("models", {}).items():
        yield Row(
            "replicas",
            f"replica digest / training step, {name} ({m['parameters']} parameters, {m['digest_ms']:.2f} ms "
            f"vs {m['step_ms']:.1f} ms), spread over one digest every {d['every']} steps",
            f"{m['digest_pct_of_step']:.2f} % ({m['amortized_pct']:.3f} %)",
            "—",
            None,
        )


ROWS: dict[str, Callable[[Mapping[str, Any]], Iterator[Row]]] = {
    "engine": _engine,
    "end_to_end": _end_to_end,
    "adapter": _adapter,
    "debug_aids": _debug_aids,
    "watchdog": _watchdog,
    "agent": _agent,
    "cost_accounting": _cost_accounting,
    "cost_accounting_instrument": _cost_accounting,
    "hang_latency": _hang_latency,
    "collector": _collector,
    "scale": _scale,
    "dashboard": _dashboard,
    "replicas": _replicas,
}


def rows_for(name: str, data: Mapping[str, Any]) -> list[Row]:
    """Every figure of one benchmark's result; figures whose keys are missing are skipped (logged)."""
    builder = ROWS.get(name)
    if builder is None:
        return []
    out: list[Row] = []
    try:
        for row in builder(data):
            out.append(row)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        logger.warning("%s: result incomplete (%r); %d figure(s) kept", name, exc, len(out))
        out.append(Row(name, "result incomplete", repr(exc), "—", False))
    return out


def _met(m: bool | None) -> str:
    return "—" if m is None else ("yes" if m else "**no**")


def markdown(rows: list[Row]) -> str:
    """The README table: benchmark | figure | measured | target | met?"""
    lines = ["| benchmark | figure | measured | target | met? |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [r.bench, r.figure, r.measured, r.target, _met(r.met)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)
