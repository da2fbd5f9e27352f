// The cross-rank diagnosis: one card per incident, culprit ranks highlighted, stacks as plain text.
"use strict";
(() => {
  const job = ddp.cfg.job;
  let lastPayload = null;
  window.ddpIncidentUpdates = 0;

  function rankChip(rank, culprits) {
    const culprit = culprits.has(rank);
    return ddp.el("span", { class: "rank" + (culprit ? " culprit" : ""), "data-rank": rank, title: culprit ? "culprit" : null }, rank);
  }

  // `stack` may be one formatted string or a list of {thread, stack} (every thread of a hang report).
  function stacks(it) {
    const out = [];
    const add = (label, text) => {
      if (!text) return;
      out.push(ddp.el("details", { open: out.length === 0 ? true : null },
        ddp.el("summary", {}, label), ddp.el("pre", { class: "stack" }, text)));
    };
    const value = it.stack ?? it.stacks;
    if (typeof value === "string") add("stack" + (it.rank !== null && it.rank !== undefined ? ` of rank ${it.rank}` : ""), value);
    else if (Array.isArray(value)) {
      for (const s of value) {
        if (typeof s === "string") add("stack", s);
        else if (s && typeof s === "object") add(`${s.rank !== undefined ? `rank ${s.rank} · ` : ""}thread ${s.thread ?? "?"}`, s.stack);
      }
    } else if (value && typeof value === "object") {
      for (const [k, v] of Object.entries(value)) add(k, typeof v === "string" ? v : JSON.stringify(v, null, 2));
    }
    return out;
  }

  function card(it, i) {
    const culprits = new Set(it.culprit_ranks || []);
    const dl = ddp.el("dl");
    const field = (label, value) => {
      if (value === null || value === undefined || value === "" || (Array.isArray(value) && !value.length)) return;
      dl.append(ddp.el("dt", {}, label), ddp.el("dd", {}, value));
    };
    field("rank", it.rank);
    // The step's timeline: for a hang or a crash, where each rank was in the step it never finished.
    field("step", it.step === null || it.step === undefined ? null
      : ddp.el("a", { class: "step-link", href: ddp.jobHref(job, "/steps/" + it.step) }, String(it.step)));
    field("collective seq", it.seq);
    field("bucket", it.bucket);
    field("process group", it.pg && it.group_ranks && it.group_ranks.length ? `${it.pg} (ranks ${it.group_ranks.join(", ")})` : it.pg);
    field("call site", it.call_site ? ddp.el("code", {}, it.call_site) : null);
    if (it.active === false) field("state", "resolved (history, not a current problem)");
    if (it.parameters && it.parameters.length) {
      field("parameters", ddp.el("span", { class: "params" }, it.parameters.join(", ")));
    }
    if (culprits.size) {
      field("culprit ranks", ddp.el("span", { class: "rank-grid" }, ...[...culprits].sort((a, b) => a - b).map((r) => rankChip(r, culprits))));
    }
    for (const rel of it.related || []) {
      field(`rank ${rel.rank ?? "?"}`, `${rel.error_type ? rel.error_type + ": " : ""}${rel.message ?? ""}`);
    }
    return ddp.el("article", { class: "incident" + (it.active === false ? " resolved" : ""), id: "incident-" + i, "data-kind": it.kind },
      ddp.el("h3", {}, ddp.el("span", { class: "badge bad" }, it.kind || "incident"), " ", it.message || ""),
      dl, ...stacks(it));
  }

  async function refresh() {
    const [data, info] = await Promise.all([
      ddp.api(ddp.jobPath(job, "/incidents")),
      ddp.api(ddp.jobPath(job)).catch(() => null),
    ]);
    const items = data.items || [];
    const world = info;
    const payload = JSON.stringify([items, world ? world.world_size : null]);
    window.ddpIncidentUpdates += 1;
    if (payload === lastPayload) return; // keep scroll and open <details> when nothing changed
    lastPayload = payload;
    const culprits = new Set(items.flatMap((it) => it.culprit_ranks || []));
    const grid = document.getElementById("rank-grid");
    const ws = world ? world.world_size : 0;
    const ranks = new Set(culprits);
    for (let r = 0; r < ws; r++) ranks.add(r);
    grid.replaceChildren(...[...ranks].sort((a, b) => a - b).map((r) => rankChip(r, culprits)));
    document.getElementById("rank-grid-section").hidden = ranks.size === 0;
    document.getElementById("incident-list").replaceChildren(...items.map(card));
    ddp.say("message", items.length
      ? `${items.length} incident${items.length === 1 ? "" : "s"}${culprits.size ? `; culprit ranks: ${[...culprits].sort((a, b) => a - b).join(", ")}` : ""}.`
      : "No incidents: no hang, collective mismatch, rank error or silent rank has been diagnosed for this job.");
  }

  ddp.poll(refresh, 5000, (e) => ddp.say("message", "Could not load incidents: " + e.message, true));
})();
