// The overlap timeline of one step: one row per rank, a compute lane (forward, backward, bucket-ready
// ticks) above a communication lane (each bucket's all-reduce from launch to end, the exposed tail in
// red). Each kind is ONE scatter trace of None-separated segments, so 64 ranks x 100 buckets stays a
// handful of SVG paths instead of thousands of traces.
"use strict";
(() => {
  const job = ddp.cfg.job;
  const step = Number(ddp.cfg.step);
  const COLORS = { forward: "#9cc0ee", backward: "#1f5fbf", ready: "#111111", allreduce: "#f0a030", exposed: "rgba(211, 47, 47, 0.55)" };

  function paramsText(names) {
    if (!names || !names.length) return "parameters: unknown";
    const shown = names.slice(0, 8).map(ddp.plotText).join("<br>  ");
    return `parameters (${names.length}):<br>  ${shown}${names.length > 8 ? `<br>  … ${names.length - 8} more` : ""}`;
  }

  // Push a horizontal segment [x0, x1] at height y, with one hover text for both ends.
  function seg(t, x0, x1, y, text) {
    t.x.push(x0, x1, null);
    t.y.push(y, y, null);
    t.text.push(text, text, null);
  }
  function trace(name, color, width) {
    return { type: "scatter", mode: "lines", name, x: [], y: [], text: [], hoverinfo: "text",
      line: { color, width }, connectgaps: false };
  }

  function draw(timeline, buckets, stepRows, worldSize) {
    const byIndex = new Map((buckets || []).map((b) => [b.index, b]));
    const exposedByRank = new Map((stepRows || []).map((r) => [r.rank, r.exposed_comm_s]));
    const ranks = [...timeline.ranks].sort((a, b) => a.rank - b.rank);
    const present = new Set(ranks.map((r) => r.rank));
    const allRanks = new Set(present);
    for (let r = 0; r < (worldSize || 0); r++) allRanks.add(r);
    const rankList = [...allRanks].sort((a, b) => a - b);
    const row = new Map(rankList.map((r, i) => [r, i]));
    const n = rankList.length;
    const rowPx = n <= 4 ? 70 : n <= 16 ? 40 : n <= 40 ? 28 : 22;
    const fwd = trace("forward", COLORS.forward, rowPx * 0.32);
    const bwd = trace("backward", COLORS.backward, rowPx * 0.32);
    const ready = trace("bucket ready", COLORS.ready, 1.5);
    const ar = trace("all-reduce", COLORS.allreduce, rowPx * 0.14);
    const tail = trace("exposed tail", COLORS.exposed, rowPx * 0.4);
    let lastT = 0;
    for (const r of ranks) {
      const y = row.get(r.rank);
      const yc = y - 0.18; // compute lane
      const ym = y + 0.22; // communication lane
      if (r.forward) seg(fwd, r.forward[0], r.forward[1], yc, `rank ${r.rank} · forward<br>${ddp.fmtSeconds(r.forward[1] - r.forward[0])}`);
      if (r.backward) seg(bwd, r.backward[0], r.backward[1], yc, `rank ${r.rank} · backward<br>${ddp.fmtSeconds(r.backward[1] - r.backward[0])}`);
      let lastEnd = null;
      for (const b of r.buckets || []) {
        const meta = byIndex.get(b.index) || {};
        const head = `rank ${r.rank} · bucket ${b.index} · ${ddp.fmtBytes(b.bytes ?? meta.bytes)}`;
        if (b.ready !== null && b.ready !== undefined) {
          const text = `${head}<br>ready at ${ddp.fmtSeconds(b.ready)}<br>${paramsText(meta.parameters)}`;
          ready.x.push(b.ready, b.ready, null);
          ready.y.push(yc - 0.17, yc + 0.17, null);
          ready.text.push(text, text, null);
        }
        if (b.allreduce && b.allreduce[0] !== null && b.allreduce[1] !== null) {
          const [s, e] = b.allreduce;
          // Alternate buckets by a hair so back-to-back all-reduces read as separate spans.
          seg(ar, s, e, ym + (b.index % 2 ? 0.07 : -0.07),
            `${head}<br>all-reduce ${ddp.fmtSeconds(s)} → ${ddp.fmtSeconds(e)} (${ddp.fmtSeconds(e - s)})` +
            (b.order_penalty_s > 0 ? `<br>waited ${ddp.fmtSeconds(b.order_penalty_s)} for earlier buckets` : "") +
            `<br>${paramsText(meta.parameters)}`);
          lastEnd = lastEnd === null ? e : Math.max(lastEnd, e);
        }
      }
      // The exposed tail ends at the last all-reduce end; its length is the analysis' exposed_comm_s
      // (from the timeline itself, else from the steps endpoint), never recomputed here.
      const exposedS = r.exposed_comm_s ?? exposedByRank.get(r.rank);
      const exposed = lastEnd !== null && exposedS > 0 ? [lastEnd - exposedS, lastEnd] : null;
      if (exposed) seg(tail, exposed[0], exposed[1], ym, `rank ${r.rank} · exposed communication<br>${ddp.fmtSeconds(exposed[1] - exposed[0])} after the last gradient`);
      lastT = Math.max(lastT, lastEnd || 0, r.backward ? r.backward[1] : 0);
    }
    const silent = rankList.filter((r) => !present.has(r));
    const annotations = silent.map((r) => ({
      x: 0, y: row.get(r), xref: "x", yref: "y", xanchor: "left", showarrow: false,
      text: `rank ${r}: no record for this step (silent or not there yet)`, font: { color: "#c62828" },
    }));
    const div = document.getElementById("timeline");
    return Plotly.react(div, [fwd, bwd, tail, ar, ready], {
      height: 90 + n * rowPx, margin: { l: 70, r: 20, t: 30, b: 50 }, hovermode: "closest",
      legend: { orientation: "h", x: 0, y: 1.0, yanchor: "bottom" }, annotations,
      xaxis: { title: { text: "seconds since the step began" }, range: [0, lastT * 1.02 || 1], zeroline: false },
      yaxis: { tickvals: rankList.map((r) => row.get(r)), ticktext: rankList.map((r) => "rank " + r),
        range: [n - 0.5, -0.5], zeroline: false, showgrid: false },
      shapes: rankList.slice(1).map((_, i) => ({ type: "line", xref: "paper", x0: 0, x1: 1, y0: i + 0.5, y1: i + 0.5,
        line: { color: "#eef0f3", width: 1 }, layer: "below" })),
    }, { displaylogo: false, responsive: true });
  }

  function drawTable(stepRows, worldSize) {
    const table = document.getElementById("ranks");
    const byRank = new Map(stepRows.map((r) => [r.rank, r]));
    const ranks = new Set(byRank.keys());
    for (let r = 0; r < (worldSize || 0); r++) ranks.add(r);
    table.querySelector("tbody").replaceChildren(...[...ranks].sort((a, b) => a - b).map((rank) => {
      const r = byRank.get(rank);
      if (!r) return ddp.el("tr", { class: "silent" }, ddp.el("td", {}, rank), ddp.el("td", { colspan: 6 }, "no record for this step"));
      return ddp.el("tr", {}, ddp.el("td", {}, rank),
        ...[r.step_s, r.forward_s, r.backward_s, r.comm_s, r.exposed_comm_s].map((v) => ddp.el("td", { class: "num" }, ddp.fmtSeconds(v))),
        ddp.el("td", { class: "num" }, ddp.fmtRatio(r.overlap_ratio)));
    }));
    table.hidden = ranks.size === 0;
  }

  function setNav(id, target) {
    const a = document.getElementById(id);
    if (target === null || target === undefined) { a.classList.add("disabled"); a.removeAttribute("href"); return; }
    a.classList.remove("disabled");
    a.href = ddp.jobHref(job, "/steps/" + target);
  }

  async function navigation() {
    // Step numbers and times of the lowest rank that reported this step decide prev / next / slowest.
    const first = await ddp.api(ddp.jobPath(job, "/steps?limit=1"));
    const rank = first.items && first.items.length ? first.items[0].rank : 0;
    const items = await ddp.apiAll(ddp.jobPath(job, `/steps?rank=${rank}`));
    let prev = null, next = null, slowest = null;
    for (const it of items) {
      if (it.step < step && (prev === null || it.step > prev)) prev = it.step;
      if (it.step > step && (next === null || it.step < next)) next = it.step;
      if (!slowest || it.step_s > slowest.step_s) slowest = it;
    }
    setNav("prev-step", prev);
    setNav("next-step", next);
    setNav("slowest-step", slowest ? slowest.step : null);
    if (slowest) document.getElementById("slowest-step").textContent = `slowest step (${slowest.step}, ${ddp.fmtSeconds(slowest.step_s)})`;
  }

  async function main() {
    document.getElementById("trace-link").href = ddp.jobPath(job, `/trace?start=${step}&end=${step}`);
    const navDone = navigation().catch((e) => console.warn("navigation:", e.message));
    const [tl, buckets, stepRows, jobs] = await Promise.all([
      ddp.api(ddp.jobPath(job, `/timeline?step=${step}`)).catch((e) => { if (e.status === 404) return { ranks: [] }; throw e; }),
      ddp.api(ddp.jobPath(job, "/buckets")).then((b) => b.items || []).catch(() => []),
      ddp.apiAll(ddp.jobPath(job, `/steps?start=${step}&end=${step + 1}`)).catch(() => []),
      ddp.api("/api/v1/jobs").then((j) => (j.items || []).find((x) => x.job === job)).catch(() => null),
    ]);
    const worldSize = jobs ? jobs.world_size : 0;
    const rowsHere = stepRows.filter((r) => r.step === step);
    if (!tl.ranks || !tl.ranks.length) {
      ddp.say("message", `Step ${step} has no records. It may not have run yet, or the job never reached it.`);
      window.ddpTimelineRendered = performance.now();
      await navDone;
      return;
    }
    await draw(tl, buckets, rowsHere, worldSize);
    window.ddpTimelineRendered = performance.now();
    const missing = [];
    for (let r = 0; r < worldSize; r++) if (!tl.ranks.some((x) => x.rank === r)) missing.push(r);
    ddp.say("message", missing.length ? `No record of this step from rank ${missing.join(", ")} (silent, or not reported yet).` : "");
    drawTable(rowsHere, worldSize);
    await navDone;
  }

  main().catch((e) => ddp.say("message", "Could not load the timeline: " + e.message, true));
})();
