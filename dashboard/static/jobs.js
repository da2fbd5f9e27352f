// The job list: polls /api/v1/jobs and rebuilds the table.
"use strict";
(() => {
  const table = document.getElementById("jobs");
  const tbody = table.querySelector("tbody");

  function flags(job) {
    const f = job.flags || {};
    const out = ddp.el("td", { class: "flags" });
    const hung = f.hung ?? job.status === "hung";
    if (hung) out.append(ddp.el("span", { class: "badge bad" }, "hung"));
    const stragglers = f.stragglers;
    const nStragglers = Array.isArray(stragglers) ? stragglers.length : Number(stragglers || 0);
    if (nStragglers) {
      const label = Array.isArray(stragglers) ? `straggler: rank ${stragglers.join(", ")}` : `${nStragglers} straggler(s)`;
      out.append(ddp.el("span", { class: "badge warn" }, label));
    }
    const incidents = Number(f.incidents ?? job.incidents ?? 0);
    if (incidents) {
      out.append(ddp.el("a", { class: "badge bad", href: ddp.jobHref(job.job, "/incidents") },
        `${incidents} incident${incidents === 1 ? "" : "s"}`));
    }
    if (!out.childNodes.length) out.append("—");
    return out;
  }

  function row(job) {
    const rate = job.step_rate;
    return ddp.el("tr", { "data-job": job.job },
      ddp.el("td", {}, ddp.el("a", { class: "job-id", href: ddp.jobHref(job.job) }, job.job)),
      ddp.el("td", {}, ddp.el("span", { class: "badge " + (job.status || "") }, job.status || "unknown")),
      ddp.el("td", { class: "num" }, job.world_size ?? "—"),
      ddp.el("td", {}, ddp.fmtAgo(job.last_seen)),
      ddp.el("td", { class: "num" }, job.steps ?? "—"),
      ddp.el("td", { class: "num" }, rate === null || rate === undefined ? "—" : rate.toFixed(2) + " /s"),
      flags(job));
  }

  async function refresh() {
    const data = await ddp.api("/api/v1/jobs");
    const jobs = data.items || [];
    tbody.replaceChildren(...jobs.map(row));
    table.hidden = jobs.length === 0;
    ddp.say("message", jobs.length ? "" : "No jobs yet. Point a training job at this collector (DDPSCOPE_URL) or run `ddpscope demo`.");
  }

  ddp.poll(refresh, 5000, (e) => ddp.say("message", "Could not load jobs: " + e.message, true));
})();
