// The overlap timeline of one step: one row per rank, a compute lane (forward, backward, bucket-ready
// ticks) above a communication lane (each bucket's all-reduce from launch to end, the exposed tail in
// red). A rank that hung or failed inside the step (no step record: drawn from its report) has its
// unfinished spans end at a red mark where the report was written, all-reduces still in flight then in
// red; a rank that stopped elsewhere (another step, or out of the job) says where instead of drawing.
//
// Speed at 64 ranks x 100 buckets: Plotly draws every gap-separated piece of a scatter line as its own
// SVG <path> (13 000 elements, seconds to draw). So each kind of bar is ONE layout shape whose SVG path
// holds all its segments (one element per kind), and hover comes from one invisible scatter line per
// kind through the points worth hovering (a single <path> each): a few dozen elements in all.
"use strict";
(() => {
  const job = ddp.cfg.job;
  const step = Number(ddp.cfg.step);
  const COLORS = { forward: "#9cc0ee", backward: "#1f5fbf", ready: "#111111", allreduce: "#f0a030",
    allreduce2: "#c77d12", exposed: "rgba(211, 47, 47, 0.55)", open: "#c62828", stop: "#c62828" };

  // "hung in backward", "failed in allreduce", "exited": a rank's stop in a few words.
  function stopWords(s) {
    const phase = s.phase ? ` in ${s.phase.replace("_", " ")}` : "";
    return `${s.state}${phase}`;
  }

  function paramsText(names) {
    if (!names || !names.length) return "parameters: unknown";
    const shown = names.slice(0, 8).map(ddp.plotText).join("<br>  ");
    return `parameters (${names.length}):<br>  ${shown}${names.length > 8 ? `<br>  … ${names.length - 8} more` : ""}`;
  }

  // One kind of mark: an SVG path (drawn as a shape) plus the hover points along it.
  function kind(name, color, width) {
    return { name, color, width, path: [], hx: [], hy: [], ht: [], segments: 0 };
  }
  function bar(k, x0, x1, y, text, hoverPoints) {
    k.path.push(`M${x0},${y}H${x1}`);
    k.segments += 1;
    for (const x of hoverPoints || [x0, x1]) { k.hx.push(x); k.hy.push(y); k.ht.push(text); }
  }
  function tick(k, x, y0, y1, text) {
    k.path.push(`M${x},${y0}V${y1}`);
    k.segments += 1;
    k.hx.push(x); k.hy.push((y0 + y1) / 2); k.ht.push(text);
  }
  function shapeOf(k) {
    return { type: "path", path: k.path.join("") || "M0,0", xref: "x", yref: "y", layer: "above",
      line: { color: k.color, width: k.path.length ? k.width : 0 }, name: k.name };
  }
  function hoverTraceOf(k) {
    // Invisible (zero-width line) but hoverable at its points; "kind" lets tests count segments.
    return { type: "scatter", mode: "lines", name: k.name, x: k.hx, y: k.hy, text: k.ht, hoverinfo: "text",
      line: { width: 0, color: k.color }, showlegend: false, meta: { kind: k.name, segments: k.segments },
      hoverlabel: { bgcolor: "#fff", bordercolor: k.color === COLORS.ready ? "#111" : k.color } };
  }
  function legendTraceOf(k) {
    return { type: "scatter", mode: "lines", name: k.name, x: [null], y: [null], hoverinfo: "skip",
      line: { color: k.color, width: Math.min(10, Math.max(2, k.width)) } };
  }

  function draw(timeline, buckets, worldSize) {
    const byIndex = new Map((buckets || []).map((b) => [b.index, Object.assign({}, b)]));
    const ranks = [...timeline.ranks].sort((a, b) => a.rank - b.rank);
    const present = new Set(ranks.map((r) => r.rank));
    const allRanks = new Set(present);
    for (let r = 0; r < (worldSize || 0); r++) allRanks.add(r);
    const elsewhere = new Map((timeline.elsewhere || []).map((e) => [e.rank, e]));
    for (const r of elsewhere.keys()) allRanks.add(r);
    const rankList = [...allRanks].sort((a, b) => a - b);
    const row = new Map(rankList.map((r, i) => [r, i]));
    const n = rankList.length;
    const rowPx = n <= 4 ? 70 : n <= 16 ? 40 : n <= 40 ? 28 : 22;
    const fwd = kind("forward", COLORS.forward, rowPx * 0.32);
    const bwd = kind("backward", COLORS.backward, rowPx * 0.32);
    // Many buckets put their ready ticks a pixel apart: thinner and translucent, they stay a texture
    // over the backward bar instead of hiding it (zoom in to tell them apart).
    const manyBuckets = ranks.some((r) => (r.buckets || []).length > 30);
    const ready = kind("bucket ready", manyBuckets ? "rgba(17, 17, 17, 0.45)" : COLORS.ready, manyBuckets ? 1 : 1.5);
    const ar = kind("all-reduce", COLORS.allreduce, rowPx * 0.14);
    const ar2 = kind("all-reduce (odd buckets)", COLORS.allreduce2, rowPx * 0.14);
    const tail = kind("exposed tail", COLORS.exposed, rowPx * 0.4);
    const open = kind("all-reduce still in flight", COLORS.open, rowPx * 0.14);
    const stop = kind("report of the stop", COLORS.stop, 2.5);
    const stopNotes = [];
    let lastT = 0;
    for (const r of ranks) {
      const y = row.get(r.rank);
      const yc = y - 0.18; // compute lane
      const ym = y + 0.22; // communication lane
      for (const [k, span, label] of [[fwd, r.forward, "forward"], [bwd, r.backward, "backward"]]) {
        if (!span) continue;
        bar(k, span[0], span[1], yc, `rank ${r.rank} · ${label}<br>${ddp.fmtSeconds(span[1] - span[0])}`,
          [span[0], (span[0] + span[1]) / 2, span[1]]);
      }
      let lastEnd = null;
      for (const b of r.buckets || []) {
        const meta = byIndex.get(b.index) || {};
        // Parameter lists are the same on every rank: format each bucket's once, not once per rank.
        const names = meta.namesText || (meta.namesText = paramsText(meta.parameters));
        const head = `rank ${r.rank} · bucket ${b.index} · ${ddp.fmtBytes(b.bytes ?? meta.bytes)}`;
        if (b.ready !== null && b.ready !== undefined) {
          tick(ready, b.ready, yc - 0.17, yc + 0.17, `${head}<br>ready at ${ddp.fmtSeconds(b.ready)}<br>${names}`);
        }
        if (b.open && b.allreduce) {
          const [s, e] = b.allreduce;
          bar(open, s, e, ym, `${head}<br>all-reduce launched at ${ddp.fmtSeconds(s)}, still in flight ` +
            `${ddp.fmtSeconds(e - s)} later, when rank ${r.rank} reported<br>${names}`);
        } else if (b.allreduce && b.allreduce[0] !== null && b.allreduce[1] !== null) {
          const [s, e] = b.allreduce;
          // Alternate buckets by a hair (and a shade) so back-to-back all-reduces read as separate spans.
          const odd = b.index % 2 === 1;
          bar(odd ? ar2 : ar, s, e, ym + (odd ? 0.07 : -0.07),
            `${head}<br>all-reduce ${ddp.fmtSeconds(s)} → ${ddp.fmtSeconds(e)} (${ddp.fmtSeconds(e - s)})` +
            (b.order_penalty_s > 0 ? `<br>waited ${ddp.fmtSeconds(b.order_penalty_s)} for earlier buckets` : "") +
            `<br>${names}`);
          lastEnd = lastEnd === null ? e : Math.max(lastEnd, e);
        }
      }
      // The exposed tail ends at the last all-reduce end; its length is the analysis' exposed_comm_s,
      // never recomputed here.
      const exposedS = r.exposed_comm_s;
      if (lastEnd !== null && exposedS > 0) {
        bar(tail, lastEnd - exposedS, lastEnd, ym,
          `rank ${r.rank} · exposed communication<br>${ddp.fmtSeconds(exposedS)} after the last gradient`);
      }
      if (r.state && r.state !== "completed" && r.until !== null && r.until !== undefined) {
        tick(stop, r.until, yc - 0.3, ym + 0.2, `rank ${r.rank} · ${stopWords(r)} (no step record: from its report)` +
          `<br>${ddp.plotText(r.message || "")}`);
        // Left of the mark, over the compute lane: the mark is the figure's right edge.
        stopNotes.push({ x: r.until, y: yc - 0.3, xref: "x", yref: "y", xanchor: "right", yanchor: "middle",
          showarrow: false, text: ddp.plotText(stopWords(r)) + " ", font: { color: COLORS.stop },
          bgcolor: "rgba(255, 255, 255, 0.85)" });
      }
      lastT = Math.max(lastT, lastEnd || 0, r.backward ? r.backward[1] : 0, r.forward ? r.forward[1] : 0, r.until || 0);
    }
    const kinds = [tail, ar, ar2, open, fwd, bwd, ready, stop];
    const silent = rankList.filter((r) => !present.has(r));
    const annotations = stopNotes.concat(silent.map((r) => {
      const e = elsewhere.get(r);
      const text = e
        ? `rank ${r}: ${stopWords(e)}${e.step !== null && e.step !== undefined ? ` at step ${e.step}` : ""}, not in this step`
        : `rank ${r}: no record for this step (silent or not there yet)`;
      return { x: 0, y: row.get(r), xref: "x", yref: "y", xanchor: "left", showarrow: false, font: { color: "#c62828" },
        text: ddp.plotText(text), hovertext: e ? ddp.plotText(e.message) : undefined };
    }));
    const separators = rankList.slice(1).map((_, i) => `M0,${i + 0.5}H${lastT * 1.02 || 1}`).join("");
    const shapes = [{ type: "path", path: separators || "M0,0", xref: "x", yref: "y", layer: "below", line: { color: "#eef0f3", width: 1 } }]
      .concat(kinds.map(shapeOf));
    const legend = [fwd, bwd, ready, ar, tail].concat(open.segments ? [open] : [], stop.segments ? [stop] : []).map(legendTraceOf);
    const div = document.getElementById("timeline");
    const height = 90 + n * rowPx;
    ddp.fixHeight(div, height);
    return Plotly.react(div, legend.concat(kinds.map(hoverTraceOf)), {
      height, margin: { l: 70, r: 20, t: 30, b: 50 }, hovermode: "closest",
      legend: { orientation: "h", x: 0, y: 1.0, yanchor: "bottom", itemclick: false, itemdoubleclick: false },
      annotations, shapes,
      xaxis: { title: { text: "time since the step began" }, range: [0, lastT * 1.02 || 1], zeroline: false,
        exponentformat: "SI", ticksuffix: "s" },
      // "allow": the rank labels always fit the left margin. Plotly's default ("hide past div") checks
      // every label's box again after placing each one: n^2 text measurements, the largest single
      // cost of drawing 64 ranks (about 50 ms of 150 once compiled, more on a first draw).
      yaxis: { tickvals: rankList.map((r) => row.get(r)), ticktext: rankList.map((r) => "rank " + r),
        range: [n - 0.5, -0.5], zeroline: false, showgrid: false, ticklabeloverflow: "allow" },
    }, { displaylogo: false, responsive: true });
  }

  function drawTable(stepRows, worldSize, tl) {
    const table = document.getElementById("ranks");
    const byRank = new Map(stepRows.map((r) => [r.rank, r]));
    const stops = new Map((tl.elsewhere || []).concat(tl.ranks.filter((x) => x.state && x.state !== "completed")).map((x) => [x.rank, x]));
    const ranks = new Set([...byRank.keys(), ...stops.keys()]);
    for (let r = 0; r < (worldSize || 0); r++) ranks.add(r);
    table.querySelector("tbody").replaceChildren(...[...ranks].sort((a, b) => a - b).map((rank) => {
      const r = byRank.get(rank);
      const s = stops.get(rank);
      if (!r) {
        const text = s ? `${stopWords(s)}${s.step !== undefined && s.step !== null ? ` at step ${s.step}` : ""}: ${s.message || ""}`
          : "no record for this step";
        return ddp.el("tr", { class: "silent" }, ddp.el("td", {}, rank), ddp.el("td", { colspan: 6 }, text));
      }
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
    // Only what the figure needs is on the critical path; the per-rank table and the navigation
    // (which read the steps endpoint) are fetched once the figure is drawn.
    const [tl, buckets, info] = await Promise.all([
      ddp.api(ddp.jobPath(job, `/timeline?step=${step}`)).catch((e) => { if (e.status === 404) return { ranks: [] }; throw e; }),
      ddp.api(ddp.jobPath(job, "/buckets")).then((b) => b.items || []).catch(() => []),
      ddp.api(ddp.jobPath(job)).catch(() => null),
    ]);
    performance.mark("ddp-data"); // the API answered: the rest is drawing (bench/dashboard.py reads both marks)
    const worldSize = info ? info.world_size : 0;
    if (!tl.ranks || !tl.ranks.length) {
      ddp.say("message", `Step ${step} has no records. It may not have run yet, or the job never reached it.`);
      window.ddpTimelineRendered = performance.now();
      await navigation().catch((e) => console.warn("navigation:", e.message));
      return;
    }
    await ddp.plotlyReady;
    await draw(tl, buckets, worldSize);
    performance.mark("ddp-drawn");
    window.ddpTimelineRendered = performance.now();
    const said = [];
    const stopped = tl.ranks.filter((x) => x.state && x.state !== "completed");
    if (stopped.length) {
      said.push(`This step never finished on rank ${stopped.map((x) => `${x.rank} (${stopWords(x)})`).join(", ")}: ` +
        "drawn from each such rank's own report, up to the red mark.");
    }
    const elsewhere = tl.elsewhere || [];
    if (elsewhere.length) {
      said.push(elsewhere.map((e) => `Rank ${e.rank} ${stopWords(e)}` +
        (e.step !== null && e.step !== undefined ? ` at step ${e.step}` : "") + ".").join(" "));
    }
    const missing = [];
    for (let r = 0; r < worldSize; r++) {
      if (!tl.ranks.some((x) => x.rank === r) && !elsewhere.some((e) => e.rank === r)) missing.push(r);
    }
    if (missing.length) said.push(`No record of this step from rank ${missing.join(", ")} (silent, or not reported yet).`);
    ddp.say("message", said.join(" "));
    const [stepRows] = await Promise.all([
      ddp.apiAll(ddp.jobPath(job, `/steps?start=${step}&end=${step}`)).catch(() => []),
      navigation().catch((e) => console.warn("navigation:", e.message)),
    ]);
    drawTable(stepRows.filter((r) => r.step === step), worldSize, tl);
    window.ddpTimelineComplete = true;
  }

  main().catch((e) => ddp.say("message", "Could not load the timeline: " + e.message, true));
})();
