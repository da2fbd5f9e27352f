// The job list: polls /api/v1/jobs and rebuilds the table.
"use strict";
(() => {
  const table = document.getElementById("jobs");
  const tbody = table.querySelector("tbody");

  // The job list carries status but not straggler or incident counts: read them per job, for the
  // most recently seen jobs only, so a collector with hundreds of finished jobs is not asked 2 x N times.
  const FLAG_JOBS = 30;
  async function jobFlags(job) {
    const [strag, incid] = await Promise.all([
      ddp.api(ddp.jobPath(job.job, "/stragglers")).catch(() => null),
      ddp.api(ddp.jobPath(job.job, "/incidents")).catch(() => null),
    ]);
    return {
      stragglers: strag ? (strag.items || []).filter((s) => s.flagged ?? (s.steps_flagged ?? 0) > 0).map((s) => s.rank) : null,
      incidents: incid ? (incid.items || []).filter((i) => i.active !== false).length : null,
    };
  }

  function flags(job, f) {
    const out = ddp.el("td", { class: "flags" });
    if (job.status === "hung") out.append(ddp.el("span", { class: "badge bad" }, "hung"));
    if (f && f.stragglers && f.stragglers.length) {
      out.append(ddp.el("span", { class: "badge warn" }, `straggler: rank ${f.stragglers.join(", ")}`));
    }
    if (f && f.incidents) {
      out.append(ddp.el("a", { class: "badge bad", href: ddp.jobHref(job.job, "/incidents") },
        `${f.incidents} incident${f.incidents === 1 ? "" : "s"}`));
    }
    if (!out.childNodes.length) out.append("—");
    return out;
  }

  function row(job, f) {
    const rate = job.step_rate;
    return ddp.el("tr", { "data-job": job.job },
      ddp.el("td", {}, ddp.el("a", { class: "job-id", href: ddp.jobHref(job.job) }, job.job)),
      ddp.el("td", {}, ddp.el("span", { class: "badge " + (job.status || "") }, job.status || "unknown")),
      ddp.el("td", { class: "num" }, job.world_size ?? "—"),
      ddp.el("td", {}, ddp.fmtAgo(job.last_seen)),
      ddp.el("td", { class: "num" }, job.steps ?? "—"),
      ddp.el("td", { class: "num" }, rate === null || rate === undefined ? "—" : rate.toFixed(2) + " /s"),
      flags(job, f));
  }

  async function refresh() {
    const data = await ddp.api("/api/v1/jobs");
    const jobs = data.items || [];
    const flagList = await Promise.all(jobs.map((j, i) => (i < FLAG_JOBS ? jobFlags(j) : null)));
    tbody.replaceChildren(...jobs.map((j, i) => row(j, flagList[i])));
    table.hidden = jobs.length === 0;
    ddp.say("message", jobs.length ? "" : "No jobs yet. Point a training job at this collector (DDPSCOPE_URL) or run `ddpscope demo`.");
  }

  window.ddpJobListUpdates = 0;
  const counted = async () => { await refresh(); window.ddpJobListUpdates += 1; };
  ddp.poll(counted, 5000, (e) => ddp.say("message", "Could not load jobs: " + e.message, true));
})();
