// The live job page: every 2 s fetch the job's API endpoints and redraw with Plotly.react (no reload).
"use strict";
(() => {
  const job = ddp.cfg.job;
  const WINDOW = 300; // steps shown in the heatmap and the overlap plot
  const rows = new Map(); // "rank:step" -> steps item
  let maxStep = -1;
  let firstLoad = true;
  let world = null;
  let traceRangeEdited = false;
  window.ddpJobUpdates = 0; // count of completed refreshes: tests wait on it

  async function fetchSteps() {
    // After the first load only the tail is re-read; the last step is read again because
    // slower ranks may not have reported it yet.
    const path = firstLoad ? ddp.jobPath(job, "/steps") : ddp.jobPath(job, `/steps?start=${Math.max(0, maxStep - 1)}`);
    const items = await ddp.apiAll(path);
    for (const it of items) {
      rows.set(`${it.rank}:${it.step}`, it);
      if (it.step > maxStep) maxStep = it.step;
    }
    firstLoad = false;
  }

  function windowed() {
    const lo = maxStep - WINDOW + 1;
    const ranks = new Set();
    const steps = new Set();
    const kept = [];
    for (const it of rows.values()) {
      if (it.step < lo) continue;
      kept.push(it);
      ranks.add(it.rank);
      steps.add(it.step);
    }
    if (world) for (let r = 0; r < world.world_size; r++) ranks.add(r);
    return { items: kept, ranks: [...ranks].sort((a, b) => a - b), steps: [...steps].sort((a, b) => a - b) };
  }

  function drawHeatmap(w) {
    const ri = new Map(w.ranks.map((r, i) => [r, i]));
    const si = new Map(w.steps.map((s, i) => [s, i]));
    const z = w.ranks.map(() => w.steps.map(() => null));
    for (const it of w.items) z[ri.get(it.rank)][si.get(it.step)] = it.step_s;
    const height = Math.min(900, Math.max(180, 60 + 16 * w.ranks.length));
    return ddp.plot("heatmap", [{
      type: "heatmap", x: w.steps, y: w.ranks, z, colorscale: "YlOrRd", reversescale: true,
      hoverongaps: false, colorbar: { title: { text: "step s" } },
      hovertemplate: "rank %{y}<br>step %{x}<br>%{z:.4f} s<extra>click: timeline</extra>",
    }], {
      height, xaxis: { title: { text: "step" } },
      yaxis: { title: { text: "rank" }, autorange: "reversed", dtick: w.ranks.length > 32 ? 4 : 1 },
    }).then((div) => {
      if (!div._ddpClick) {
        div._ddpClick = true;
        div.on("plotly_click", (ev) => { location.href = ddp.jobHref(job, "/steps/" + ev.points[0].x); });
      }
    });
  }

  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

  function drawOverlap(w) {
    const byRank = new Map();
    for (const it of w.items) {
      if (!byRank.has(it.rank)) byRank.set(it.rank, []);
      byRank.get(it.rank).push(it);
    }
    const traces = [];
    const many = byRank.size > 12;
    for (const [rank, its] of [...byRank.entries()].sort((a, b) => a[0] - b[0])) {
      its.sort((a, b) => a.step - b.step);
      const x = its.map((i) => i.step);
      // One colour per rank in both panels (Plotly's own cycle would give each trace its own).
      const common = { type: "scatter", mode: "lines", x, legendgroup: "r" + rank,
        line: { width: 1.5, color: PALETTE[rank % PALETTE.length] } };
      traces.push(Object.assign({}, common, {
        name: "rank " + rank, y: its.map((i) => i.overlap_ratio), yaxis: "y",
        hovertemplate: `rank ${rank} · step %{x}<br>overlap %{y:.0%}<extra></extra>`,
      }));
      traces.push(Object.assign({}, common, {
        name: "rank " + rank, y: its.map((i) => i.exposed_comm_s), yaxis: "y2", showlegend: false,
        hovertemplate: `rank ${rank} · step %{x}<br>exposed comm %{y:.4f} s<extra></extra>`,
      }));
    }
    return ddp.plot("overlap", traces, {
      height: 360, showlegend: !many, hovermode: "closest",
      xaxis: { title: { text: "step" }, anchor: "y2" },
      yaxis: { title: { text: "overlap ratio" }, domain: [0.55, 1], range: [0, 1.05], tickformat: ".0%" },
      yaxis2: { title: { text: "exposed comm (s)" }, domain: [0, 0.45], rangemode: "tozero" },
    });
  }

  function drawSummary(w, incidents) {
    const box = document.getElementById("summary");
    const ranksReporting = new Set(w.items.filter((i) => i.step === maxStep).map((i) => i.rank)).size;
    let slowest = null;
    for (const it of w.items) if (!slowest || it.step_s > slowest.step_s) slowest = it;
    const cell = (label, value) => ddp.el("div", {}, label, ddp.el("b", {}, value));
    box.replaceChildren(
      cell("status", world ? world.status : "—"),
      cell("world size", world ? world.world_size : "—"),
      cell("last step", maxStep >= 0 ? maxStep : "—"),
      cell("ranks at last step", maxStep >= 0 ? ranksReporting : "—"),
      cell("last seen", world ? ddp.fmtAgo(world.last_seen) : "—"),
    );
    const links = document.getElementById("step-links");
    links.replaceChildren();
    if (maxStep >= 0) {
      links.append(ddp.el("a", { id: "latest-step-link", href: ddp.jobHref(job, "/steps/" + maxStep) }, `timeline of step ${maxStep}`));
      links.append(" · ");
      links.append(ddp.el("a", { id: "slowest-step-link", href: ddp.jobHref(job, "/steps/" + slowest.step) },
        `slowest step (${slowest.step}, ${ddp.fmtSeconds(slowest.step_s)})`));
    }
    // A job that hung or crashed inside a step has no record of it: link the step its incidents name.
    const stoppedIn = Math.max(-1, ...incidents.filter((i) => i.active !== false && Number.isInteger(i.step)).map((i) => i.step));
    if (stoppedIn > maxStep) {
      if (links.childNodes.length) links.append(" · ");
      links.append(ddp.el("a", { id: "stopped-step-link", href: ddp.jobHref(job, "/steps/" + stoppedIn) },
        `step ${stoppedIn}, where it stopped`));
    }
    if (maxStep >= 0) {
      const start = document.getElementById("trace-start");
      const end = document.getElementById("trace-end");
      // Follow the last ten steps until the user picks a range.
      if (!traceRangeEdited) {
        start.value = Math.max(0, maxStep - 9);
        end.value = Math.max(maxStep, stoppedIn);
      }
      updateTraceLink();
    }
  }

  function updateTraceLink() {
    const start = document.getElementById("trace-start").value;
    const end = document.getElementById("trace-end").value;
    const q = new URLSearchParams();
    if (start !== "") q.set("start", start);
    if (end !== "") q.set("end", end);
    const a = document.getElementById("trace-link");
    a.href = ddp.jobPath(job, "/trace?" + q.toString());
    a.setAttribute("download", `${job}-steps-${start || 0}-${end || "end"}.trace.json`);
  }

  function drawStragglers(items, threshold, stalls) {
    show("stragglers", items.length > 0);
    if (!items.length) {
      ddp.say("stragglers-msg", "No straggler scores yet: they need a few steps from every rank.");
      return;
    }
    // Ranks that hold the others up now and then (the collector's sentences), after the stragglers.
    const now = (stalls || []).map((s) => ` Now and then: ${s.message}.`).join("");
    // Scores by phase: the overall slowdown and, when the API splits it, forward, backward and the time
    // between steps (optimizer, data loading: a rank that starts its forward late).
    items = [...items].sort((a, b) => a.rank - b.rank);
    const x = items.map((i) => i.rank);
    const series = [["overall", "slowdown", "#1f5fbf"], ["forward", "forward_slowdown", "#9cc0ee"], ["backward", "backward_slowdown", "#f0a030"],
      ["between steps", "between_steps_slowdown", "#6aa84f"]]
      .filter(([, key]) => items.some((i) => typeof i[key] === "number"));
    const traces = series.map(([phase, key, color]) => ({
      type: "bar", name: phase, x, y: items.map((i) => i[key] ?? null), marker: { color },
      customdata: items.map((i) => [i.steps_flagged ?? 0, i.steps_considered ?? "?"]),
      hovertemplate: `rank %{x} · ${phase}<br>slowdown %{y:.2f}×<br>flagged in %{customdata[0]} of %{customdata[1]} steps<extra></extra>`,
    }));
    const phases = new Map(series.map((s) => [s[0], s]));
    const drawn = ddp.plot("stragglers", traces, {
      height: 260, barmode: "group", showlegend: phases.size > 1,
      xaxis: { title: { text: "rank" }, tickmode: "linear", dtick: Math.max(1, Math.ceil(items.length / 16)) },
      yaxis: { title: { text: "slowdown vs median of others" }, rangemode: "tozero" },
      // The analysis' own threshold, when the API reports it: bars above the red line count against a rank.
      shapes: [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: 1, y1: 1, line: { dash: "dot", color: "#888" } }]
        .concat(typeof threshold === "number" ? [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: 1 + threshold, y1: 1 + threshold,
          line: { dash: "dash", color: "#c62828", width: 1 } }] : []),
    });
    const flagged = items.filter((i) => (i.flagged ?? (i.steps_flagged ?? 0) > 0));
    // A crowded host's note (more compute threads than cores) is said once, after the ranks it concerns.
    const notes = [...new Set(flagged.map((i) => i.contention).filter(Boolean))];
    ddp.say("stragglers-msg", (flagged.length
      ? "Flagged: " + flagged.map((i) => `rank ${i.rank} (${(i.slowdown ?? 0).toFixed(2)}× slower${i.phase ? " in " + i.phase.replace("_", " ") : ""}${i.sampled ? `, at ${i.sampled.site}${i.sampled.loader ? " waiting for its DataLoader's workers" : ""} in ${i.sampled.samples} of ${i.sampled.of} samples` : ""}, ${i.steps_flagged ?? "?"} steps)`).join(", ")
        + notes.map((n) => `. But ${n}.`).join("")
      : "No rank is flagged as a straggler.") + now);
    // Where a stalling rank's training thread (its main thread unless named) was, as its watchdog sampled it: the stack behind the line named.
    document.getElementById("stall-stacks").replaceChildren(...(stalls || []).filter((s) => s.sampled && s.sampled.stack)
      .map((s) => ddp.el("details", {},
        ddp.el("summary", {}, `rank ${s.rank}'s ${s.sampled.thread ? `training thread '${s.sampled.thread}'` : "main thread"} in its stalls (${s.sampled.site || "outside user code"})`),
        ddp.el("pre", { class: "stack" }, s.sampled.stack))));
    return drawn;
  }

  function drawIncidents(items) {
    const list = document.getElementById("incidents");
    const latest = items.slice(-5).reverse();
    list.replaceChildren(...latest.map((it) => ddp.el("li", {},
      ddp.el("span", { class: "badge bad" }, it.kind || "incident"), " ",
      it.message || "", it.step !== null && it.step !== undefined ? ` (step ${it.step})` : "")));
    ddp.say("incidents-msg", items.length ? `${items.length} in total.` : "No incidents.");
  }

  function drawUnused(items, advice) {
    const table = document.getElementById("unused");
    table.querySelector("tbody").replaceChildren(...items.map((it) => ddp.el("tr", {},
      ddp.el("td", { class: "params" }, it.name),
      ddp.el("td", {}, Array.isArray(it.ranks) ? it.ranks.join(", ") : it.ranks),
      ddp.el("td", { class: "num" }, it.steps))));
    table.hidden = !items.length;
    const none = "Every parameter got a gradient in every recorded step.";
    ddp.say("unused-msg", [items.length ? "" : none, advice || ""].filter(Boolean).join(" "));
  }

  function drawBuckets(items) {
    show("buckets", items.length > 0);
    if (!items.length) {
      ddp.say("buckets-msg", "No bucket layout reported yet.");
      return;
    }
    items = [...items].sort((a, b) => a.index - b.index);
    const x = items.map((b) => b.index);
    const hover = items.map((b) => {
      const names = b.parameters || [];
      const shown = names.slice(0, 6).map(ddp.plotText).join("<br>");
      return `bucket ${b.index} · ${ddp.fmtBytes(b.bytes)} · ${names.length} parameters<br>${shown}${names.length > 6 ? `<br>… ${names.length - 6} more` : ""}`;
    });
    // Three stacked panels sharing the bucket axis: size, how often ready out of order, order penalty.
    const drawn = ddp.plot("buckets", [
      { type: "bar", name: "bytes", x, y: items.map((b) => b.bytes), hovertext: hover, hoverinfo: "text", marker: { color: "#8fb3e8" } },
      { type: "bar", name: "ready out of order", x, y: items.map((b) => b.out_of_order ?? 0), yaxis: "y2",
        hovertemplate: "bucket %{x}: ready out of order %{y} times<extra></extra>", marker: { color: "#c62828" } },
      { type: "bar", name: "order penalty", x, y: items.map((b) => b.order_penalty_s ?? 0), yaxis: "y3",
        hovertemplate: "bucket %{x}: waited %{y:.4f} s for earlier buckets<extra></extra>", marker: { color: "#b26a00" } },
    ], {
      height: 380, showlegend: false,
      xaxis: { title: { text: "bucket index" }, anchor: "y3", tickmode: "linear", dtick: Math.max(1, Math.ceil(items.length / 25)) },
      yaxis: { title: { text: "bytes" }, domain: [0.56, 1] },
      yaxis2: { title: { text: "out of order" }, domain: [0.3, 0.5], rangemode: "tozero" },
      yaxis3: { title: { text: "penalty (s)" }, domain: [0, 0.24], rangemode: "tozero" },
    });
    ddp.say("buckets-msg", "");
    return drawn;
  }

  const GIB = 2 ** 30;

  function drawMemory(items) {
    show("memory", items.length > 0);
    if (!items.length) {
      ddp.say("memory-msg", "No memory records: the ranks' agents send one every 30 s (Linux only).");
      return;
    }
    // Resident memory per rank over time, and what is left where each runs (dotted): a leak climbs
    // towards the kernel's OOM killer, which ends a rank without a word when the dotted line reaches 0.
    const traces = [];
    const many = items.length > 12;
    for (const r of items) {
      const color = PALETTE[r.rank % PALETTE.length];
      const x = r.samples.map((s) => new Date(s[0] * 1000));
      const steps = r.samples.map((s) => s[1]);
      traces.push({ type: "scatter", mode: "lines", name: "rank " + r.rank, legendgroup: "r" + r.rank, x,
        y: r.samples.map((s) => s[2] / GIB), customdata: steps, line: { width: 1.5, color },
        hovertemplate: `rank ${r.rank} · step %{customdata}<br>resident %{y:.2f} GiB<extra></extra>` });
      if (r.samples.some((s) => s[4] > 0)) {
        traces.push({ type: "scatter", mode: "lines", name: `rank ${r.rank} workers`, legendgroup: "r" + r.rank,
          x, y: r.samples.map((s) => s[4] / GIB), customdata: steps, line: { width: 1, dash: "dash", color },
          hovertemplate: `rank ${r.rank} · step %{customdata}<br>DataLoader workers' own %{y:.2f} GiB<extra></extra>` });
      }
      traces.push({ type: "scatter", mode: "lines", name: `rank ${r.rank} available`, legendgroup: "r" + r.rank,
        showlegend: false, x, y: r.samples.map((s) => s[3] / GIB), customdata: steps, line: { width: 1, dash: "dot", color },
        hovertemplate: `rank ${r.rank} · step %{customdata}<br>available %{y:.2f} GiB<extra></extra>` });
    }
    const drawn = ddp.plot("memory", traces, {
      height: 260, showlegend: !many, hovermode: "closest",
      xaxis: { title: { text: "time" } }, yaxis: { title: { text: "GiB (dashed: workers; dotted: available)" }, rangemode: "tozero" },
    });
    const growing = items.filter((r) => r.growing);
    const largest = items.reduce((a, b) => (b.rss_bytes > a.rss_bytes ? b : a));
    ddp.say("memory-msg", (growing.length
      ? "Growing: " + growing.map((r) => `rank ${r.rank}${r.growing_in === "workers" ? "'s DataLoader workers" : ""} (+${ddp.fmtBytes(r.bytes_per_min)}/min)`).join(", ") + "; see the memory_growth incident."
      : "No rank's memory grows steadily.")
      + ` Largest: rank ${largest.rank}, ${ddp.fmtBytes(largest.rss_bytes)}, with ${ddp.fmtBytes(largest.available_bytes)} of ${ddp.fmtBytes(largest.total_bytes)} left where it runs.`);
    return drawn;
  }

  // Plot divs start hidden (an empty frame says nothing) and are shown before drawing, so Plotly
  // measures their real width.
  function show(id, visible) { document.getElementById(id).hidden = !visible; }

  const settled = (p) => p.then((v) => ({ ok: true, v }), (e) => ({ ok: false, e }));

  async function refresh() {
    const [info, steps, strag, incid, unused, buckets, stalls, memory] = await Promise.all([
      settled(ddp.api(ddp.jobPath(job))),
      settled(fetchSteps()),
      settled(ddp.api(ddp.jobPath(job, "/stragglers"))),
      settled(ddp.api(ddp.jobPath(job, "/incidents"))),
      settled(ddp.api(ddp.jobPath(job, "/unused-parameters"))),
      settled(ddp.api(ddp.jobPath(job, "/buckets"))),
      settled(ddp.api(ddp.jobPath(job, "/stalls"))),
      settled(ddp.api(ddp.jobPath(job, "/memory"))),
    ]);
    if (info.ok) world = info.v;
    const badge = document.getElementById("job-status");
    badge.textContent = world ? world.status : "";
    badge.className = "badge " + (world ? world.status : "");
    const errors = [info, steps, strag, incid, unused, buckets, stalls, memory].filter((r) => !r.ok).map((r) => r.e.message);
    const w = windowed();
    show("heatmap", rows.size > 0);
    show("overlap", rows.size > 0);
    // Every figure is awaited before the refresh counts as done (tests and the next poll rely on it).
    const drawing = [];
    if (rows.size) drawing.push(drawHeatmap(w), drawOverlap(w));
    drawSummary(w, incid.ok ? incid.v.items || [] : []);
    if (strag.ok) drawing.push(drawStragglers(strag.v.items || [], strag.v.threshold, stalls.ok ? stalls.v.items : []));
    if (incid.ok) drawIncidents(incid.v.items || []);
    if (unused.ok) drawUnused(unused.v.items || [], unused.v.advice);
    if (buckets.ok) drawing.push(drawBuckets(buckets.v.items || []));
    if (memory.ok) drawing.push(drawMemory(memory.v.items || []));
    await Promise.all(drawing);
    let msg = rows.size ? "" : "This job has not reported any steps yet. The page updates by itself.";
    if (errors.length) msg = (msg ? msg + " " : "") + "Some data could not be loaded: " + errors.join("; ");
    ddp.say("message", msg, errors.length > 0);
    window.ddpJobUpdates += 1;
  }

  for (const id of ["trace-start", "trace-end"]) {
    document.getElementById(id).addEventListener("input", () => { traceRangeEdited = true; updateTraceLink(); });
  }
  document.getElementById("trace-form").addEventListener("submit", (e) => e.preventDefault());
  ddp.poll(refresh, 2000, (e) => ddp.say("message", "Could not refresh: " + e.message, true));
})();
