"""Agent benchmark: emit() latency with the sender busy, records/s shipped, training-step overhead.

    .venv/bin/python -m bench.agent [--quick]

Everything is measured side by side in one run on this machine (printed first): the emit latency
next to a bare ``deque.append`` of the same tuple, throughput through the default pipeline (spool +
shipper process) and the direct HTTP exporter to a local HTTP sink in another process, and the step
time of a small CPU training loop with and without the agent's per-step records, interleaved.
Results go to ``bench/results/agent.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import task_cpu_ns
from ddpscope import agent
from ddpscope.agent.clock import now_ns
from ddpscope.agent.transport import HttpExporter

SINK = r"""
import gzip, json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
count = 0
lock = threading.Lock()  # several shippers post at once: count += n must not lose updates
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, body):
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        global count
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        n = len(json.loads(body)["records"])
        with lock:
            count += n
        self._send(b"{}")
    def do_GET(self):
        self._send(str(count).encode())
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""

BUCKETS = 50


def step_record(step: int) -> dict[str, Any]:
    t = now_ns()
    ints = [t + i for i in range(BUCKETS)]
    return {
        "kind": "step", "step": step, "synced": True, "forward_start_ns": t, "forward_end_ns": t,
        "backward_start_ns": t, "backward_end_ns": t, "bucket_ready_ns": ints, "allreduce_start_ns": ints,
        "allreduce_end_ns": ints, "bucket_bytes": [1 << 20] * BUCKETS, "ready_order": list(range(BUCKETS)),
        "unused_parameters": [], "collective_seqs": list(range(BUCKETS)),
    }  # fmt: skip


def collective_record(seq: int) -> dict[str, Any]:
    return {
        "kind": "collective", "pg": "default", "coll_seq": seq, "op": "all_reduce", "reduce_op": "SUM",
        "shapes": [[1024]], "dtypes": ["float32"], "call_site": "train.py:42", "start_ns": now_ns(),
        "step": seq, "source": "engine",
    }  # fmt: skip


def machine() -> dict[str, Any]:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],  # a shared machine: read the figures against this
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor()
    return info


def percentiles(samples: list[int]) -> dict[str, float]:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"p50_ns": pick(0.5), "p99_ns": pick(0.99), "p999_ns": pick(0.999), "max_ns": s[-1], "n": len(s)}


def sink_count(url: str) -> int:
    with urllib.request.urlopen(url) as r:
        return int(r.read())


def emit_latency(n: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    """emit() timed one call at a time while the worker serializes and spools the previous bursts."""
    pc = time.perf_counter_ns
    samples = []
    baseline = []
    q: collections.deque[Any] = collections.deque()
    burst = 2000
    for start in range(0, n, burst):
        for rec in records[start : start + burst]:
            t0 = pc()
            agent.emit(rec)
            samples.append(pc() - t0)
        for rec in records[start : start + burst]:
            t0 = pc()
            q.append((now_ns(), rec))
            baseline.append(pc() - t0)
        q.clear()
        time.sleep(0.002)  # the sender catches up on the burst while the next one is emitted
    timer = []
    for _ in range(10000):
        t0 = pc()
        timer.append(pc() - t0)
    return {
        "emit": percentiles(samples),
        "deque_append_baseline": percentiles(baseline),
        "timer_overhead_ns": statistics.median(timer),
    }


def durable_cost(n: int) -> dict[str, Any]:
    """emit() + make_durable() of one collective record (the recorder's path before each user collective:
    queue, stamp, encode and append to the spool in the caller) next to emit() of the same record,
    interleaved call by call."""
    agent.get_agent().flush_local(30.0)  # start with the previous phase's backlog written
    pc = time.perf_counter_ns
    durable, plain = [], []
    written = 0
    for i in range(n):
        record = collective_record(i)
        t0 = pc()
        agent.emit(record)
        written += agent.make_durable()
        durable.append(pc() - t0)
        record = collective_record(i)
        t0 = pc()
        agent.emit(record)
        plain.append(pc() - t0)
        if i % 64 == 0:
            time.sleep(0.0005)  # let the worker take its rounds, as between real collectives
    # The recorder's path since the write-ahead ring: emit_durable (stamp + copy into the mapped
    # ring), interleaved with emit() alone the same way.
    from ddpscope.agent._core import emit_durable

    agent.get_agent().flush_local(30.0)
    ring, plain2 = [], []
    for i in range(n):
        record = collective_record(i)
        t0 = pc()
        emit_durable(record)
        ring.append(pc() - t0)
        record = collective_record(i)
        t0 = pc()
        agent.emit(record)
        plain2.append(pc() - t0)
        if i % 64 == 0:
            time.sleep(0.0005)
    return {
        "emit_then_make_durable": percentiles(durable),
        "emit": percentiles(plain),
        "written": written / n,
        "emit_durable": percentiles(ring),
        "emit_interleaved_with_emit_durable": percentiles(plain2),
    }


def cpu_seconds_of(pid: int) -> float:
    """User + system CPU seconds of another process (the shipper), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def shipping(n: int, exporter: Any, sink: str, spool_dir: str) -> dict[str, float]:
    """Wall-clock records/s to the sink and CPU microseconds per record in this process (worker:
    stamp, check, encode, write or POST) and in the shipper. CPU per record does not depend on how
    busy the machine is; records/s does."""
    a = agent.configure(
        job=f"bench-{time.time_ns()}", rank=0, url=sink, spool_dir=spool_dir, exporter=exporter
    )
    records = [step_record(i) for i in range(n)]
    before = sink_count(sink)
    t0, c0 = time.perf_counter(), time.process_time()
    sent = 0
    while sent < n:
        if len(a._queue) < 20_000:  # stay under the queue bound: measure shipping, not dropping
            for rec in records[sent : sent + 500]:
                agent.emit(rec)
            sent = min(n, sent + 500)
        else:
            time.sleep(0.001)
    assert a.force_flush(300.0), "flush timed out"
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    got = sink_count(sink) - before
    assert got >= n, (got, n)
    shipper_pid = getattr(a.exporter, "shipper_pid", None)
    shipper_cpu = cpu_seconds_of(shipper_pid) if shipper_pid else 0.0
    agent.shutdown(5.0)
    return {
        "records_per_s": n / elapsed,
        "in_process_cpu_us_per_record": cpu / n * 1e6,
        "shipper_cpu_us_per_record": shipper_cpu / n * 1e6,
    }


def switches(proc_dir: str) -> int:
    """Voluntary context switches (wake-ups after a sleep) of a process or thread, from /proc."""
    try:
        with open(f"{proc_dir}/status") as f:
            return int(next(line for line in f if line.startswith("voluntary_ctxt")).split()[1])
    except (OSError, StopIteration, ValueError):
        return 0


def switches_of(pid: int | None) -> int:
    return switches(f"/proc/{pid}") if pid else 0


def thread_cpu_ns(tid: int | None) -> int:
    """CPU time of one thread of this process, in ns (0 if it is gone)."""
    return (task_cpu_ns("self", tid) if tid is not None else None) or 0


def idle_worker_cpu_share(seconds: float) -> float:
    """Fraction of one core the agent's thread uses with nothing to send (wake-ups only: about one a second since it sleeps while idle)."""
    a = agent.get_agent()
    thread = a._worker._thread
    if thread is None:
        return 0.0
    time.sleep(0.1)
    c0 = thread_cpu_ns(thread.native_id)
    time.sleep(seconds)
    return (thread_cpu_ns(thread.native_id) - c0) / 1e9 / seconds


def training_overhead(steps: int) -> dict[str, Any]:
    from ddpscope.agent._core import emit_durable

    """A 1 M-parameter MLP step on the CPU, with and without 1 step + 8 collective records per step."""
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 512)
    emit_ns = 0

    def step(i: int, instrumented: bool) -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if instrumented:
            nonlocal emit_ns
            collectives = [collective_record(i * 8 + k) for k in range(8)]
            e0 = time.perf_counter_ns()
            # As in a job: the recorder makes each collective record durable, the step record is
            # emitted plainly.
            for record in collectives:
                emit_durable(record)
            agent.emit(step_record(i))
            emit_ns += time.perf_counter_ns() - e0
        return time.perf_counter() - t0

    for i in range(20):
        step(i, False)
    # Blocks of 10 steps, alternating; the agent's worker finishes a block's records during the
    # next block, so the block is the unit. CPU time covers every thread of this process (the worker
    # included) and is less disturbed than wall time by other processes on a shared machine.
    worker = agent.get_agent()._worker._thread
    worker_cpu0 = thread_cpu_ns(worker.native_id) if worker is not None else 0
    shipper_pid = getattr(agent.get_agent().exporter, "shipper_pid", None)
    shipper_cpu0 = cpu_seconds_of(shipper_pid) if shipper_pid else 0.0
    wakes0 = (switches(f"/proc/self/task/{worker.native_id}") if worker else 0, switches_of(shipper_pid))
    t_start = time.monotonic()
    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for block in range(steps // 10):
        on = block % 2 == 1
        c0 = time.process_time()
        wall[on].append(statistics.mean(step(block * 10 + i, on) for i in range(10)))
        cpu[on].append((time.process_time() - c0) / 10)
    worker_cpu_s = (thread_cpu_ns(worker.native_id) - worker_cpu0) / 1e9 if worker is not None else 0.0
    elapsed = time.monotonic() - t_start
    shipper_cpu_s = cpu_seconds_of(shipper_pid) - shipper_cpu0 if shipper_pid else 0.0
    wakes = (
        (switches(f"/proc/self/task/{worker.native_id}") if worker else 0) - wakes0[0],
        switches_of(shipper_pid) - wakes0[1],
    )
    w_on, w_off = statistics.median(wall[True]), statistics.median(wall[False])
    on_steps = 10 * len(wall[True])
    # The agent's own cost, measured on its own thread (ns-resolution scheduler accounting) plus
    # the emit() calls on the training thread: independent of other processes' load.
    agent_s_per_step = (worker_cpu_s + emit_ns / 1e9) / on_steps
    c_on, c_off = statistics.median(cpu[True]), statistics.median(cpu[False])
    return {
        "step_s_without": w_off,
        "step_s_with": w_on,
        "overhead": w_on / w_off - 1.0,
        "cpu_s_per_step_without": c_off,
        "cpu_s_per_step_with": c_on,
        "cpu_overhead": c_on / c_off - 1.0,
        "records_per_step": 9,
        "agent_cpu_s_per_step": agent_s_per_step,
        "agent_cpu_share_of_step": agent_s_per_step / w_off,
        # The shipper is another process (niced); its CPU over the whole run, per instrumented
        # step (its clock ticks are 10 ms: a coarse figure).
        "shipper_cpu_s_per_step": shipper_cpu_s / on_steps,
        "worker_wakeups_per_s": wakes[0] / elapsed,
        "shipper_wakeups_per_s": wakes[1] / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs, under a minute")
    args = parser.parse_args()
    n_emit, n_ship, steps = (30_000, 5_000, 100) if args.quick else (300_000, 100_000, 1000)
    info = machine()
    print(f"machine: {info}")
    sink_proc = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    results: dict[str, Any] = {"machine": info, "quick": args.quick}
    try:
        assert sink_proc.stdout is not None
        sink = f"http://127.0.0.1:{sink_proc.stdout.readline().strip()}"
        with tempfile.TemporaryDirectory() as spool_dir:
            agent.configure(job="bench-latency", rank=0, url=sink, spool_dir=spool_dir)
            records = [step_record(i) for i in range(n_emit)]
            results["latency"] = emit_latency(n_emit, records)
            del records
            results["durable_collective"] = durable_cost(n_ship)
            agent.shutdown(10.0)
            results["shipping"] = {
                "spool_and_shipper": shipping(n_ship, None, sink, spool_dir),
                "direct_http": shipping(n_ship, HttpExporter(sink + "/api/v1/ingest"), sink, spool_dir),
                "record": f"step record with {BUCKETS} buckets",
            }
            agent.configure(job="bench-train", rank=0, url=sink, spool_dir=spool_dir)
            results["idle_worker_core_share"] = idle_worker_cpu_share(2.0)
            results["training_step"] = training_overhead(steps)
            agent.shutdown(10.0)
    finally:
        sink_proc.kill()
        sink_proc.wait()
    lat = results["latency"]
    print(
        "emit() with the sender busy: p50 {p50_ns} ns, p99 {p99_ns} ns, p99.9 {p999_ns} ns, max {max_ns} ns".format(
            **lat["emit"]
        )
    )
    print(
        "  bare deque.append baseline: p50 {p50_ns} ns, p99 {p99_ns} ns".format(
            **lat["deque_append_baseline"]
        )
    )
    print(f"  timer overhead (included above): {lat['timer_overhead_ns']:.0f} ns")
    dur = results["durable_collective"]
    print(
        "emit() + make_durable() of a collective record (in the spool on return): p50 {p50_ns} ns, "
        "p99 {p99_ns} ns, max {max_ns} ns".format(**dur["emit_then_make_durable"])
        + " (emit() of the same record, interleaved: p50 {p50_ns} ns)".format(**dur["emit"])
    )
    print(
        "emit_durable() of a collective record (in the write-ahead ring on return): p50 {p50_ns} ns, "
        "p99 {p99_ns} ns, max {max_ns} ns".format(**dur["emit_durable"])
        + " (emit(), interleaved: p50 {p50_ns} ns)".format(**dur["emit_interleaved_with_emit_durable"])
    )
    for name in ("spool_and_shipper", "direct_http"):
        sh = results["shipping"][name]
        print(
            f"shipped ({name}): {sh['records_per_s']:.0f} rec/s; CPU per record "
            f"{sh['in_process_cpu_us_per_record']:.1f} us in the training process, "
            f"{sh['shipper_cpu_us_per_record']:.1f} us in the shipper"
        )
    tr = results["training_step"]
    print(
        f"training step: {tr['step_s_without'] * 1e3:.2f} ms without, {tr['step_s_with'] * 1e3:.2f} ms with "
        f"the agent ({tr['overhead'] * 100:+.2f} %); process CPU {tr['cpu_overhead'] * 100:+.2f} %"
    )
    print(
        f"  agent's own CPU per step ({tr['records_per_step']} records): {tr['agent_cpu_s_per_step'] * 1e6:.0f} us"
        f" = {tr['agent_cpu_share_of_step'] * 100:.2f} % of a step"
    )
    print(
        f"  shipper CPU per step: {tr['shipper_cpu_s_per_step'] * 1e6:.0f} us; wake-ups per second: "
        f"agent thread {tr['worker_wakeups_per_s']:.1f}, shipper {tr['shipper_wakeups_per_s']:.1f}"
    )
    print(f"  idle agent thread: {results['idle_worker_core_share'] * 100:.2f} % of a core (wake-ups only)")
    out = Path(__file__).with_name("results") / "agent.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
