// Shared helpers for the dashboard pages. Data from the API is only ever put into the page with
// textContent or as Plotly data, never parsed as markup, so hostile job ids or stacks stay text.
"use strict";
const ddp = (() => {
  const app = document.getElementById("app");
  const cfg = app ? app.dataset : {};

  // Fetch one API path; throw an Error carrying the status and the API's own message on failure.
  async function api(path) {
    const resp = await fetch(path, { headers: { accept: "application/json" }, cache: "no-store" });
    let body = null;
    try { body = await resp.json(); } catch (_) { body = null; }
    if (!resp.ok) {
      const detail = body && (body.detail || body.message);
      const err = new Error(`${path}: ${resp.status}${detail ? " " + (typeof detail === "string" ? detail : JSON.stringify(detail)) : ""}`);
      err.status = resp.status;
      throw err;
    }
    return body;
  }

  // Follow a list endpoint's `next` cursor until done or `maxPages` pages were read.
  async function apiAll(path, maxPages = 20) {
    const items = [];
    let url = path;
    for (let i = 0; i < maxPages && url; i++) {
      const page = await api(url);
      items.push(...(page.items || []));
      url = page.next ? withParam(path, "cursor", page.next) : null;
      if (page.next && typeof page.next === "string" && page.next.startsWith("/")) url = page.next;
    }
    return items;
  }

  function withParam(path, key, value) {
    const u = new URL(path, location.origin);
    u.searchParams.set(key, value);
    return u.pathname + u.search;
  }

  function jobPath(job, suffix = "") { return "/api/v1/jobs/" + encodeURIComponent(job) + suffix; }
  function jobHref(job, suffix = "") { return "/jobs/" + encodeURIComponent(job) + suffix; }

  // el("td", {class: "num"}, "text", childNode): text children become text nodes.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") node.className = v;
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) {
      if (c === undefined || c === null) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function say(id, text, isError = false) {
    const node = document.getElementById(id);
    if (!node) return;
    node.textContent = text || "";
    node.classList.toggle("error", Boolean(isError));
  }

  function fmtSeconds(s) {
    if (s === null || s === undefined || Number.isNaN(s)) return "—";
    if (Math.abs(s) >= 1) return s.toFixed(2) + " s";
    if (Math.abs(s) >= 1e-3) return (s * 1e3).toFixed(1) + " ms";
    return (s * 1e6).toFixed(0) + " µs";
  }
  function fmtBytes(b) {
    if (b === null || b === undefined) return "—";
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
    return (i ? b.toFixed(1) : String(b)) + " " + units[i];
  }
  function fmtRatio(r) { return r === null || r === undefined ? "—" : (r * 100).toFixed(0) + " %"; }
  // last_seen is seconds since the epoch (aligned clock); show it relative to the browser's clock.
  function fmtAgo(t) {
    if (!t) return "never";
    const d = Date.now() / 1000 - t;
    if (d < 2) return "just now";
    if (d < 120) return d.toFixed(0) + " s ago";
    if (d < 7200) return (d / 60).toFixed(0) + " min ago";
    if (d < 172800) return (d / 3600).toFixed(1) + " h ago";
    return new Date(t * 1000).toISOString().replace("T", " ").slice(0, 16) + " UTC";
  }

  // Call fn now and then every `ms`, never overlapping runs; errors are shown, not thrown.
  function poll(fn, ms, onError) {
    let stopped = false;
    async function tick() {
      if (stopped) return;
      try { await fn(); } catch (e) { (onError || console.warn)(e); }
      if (!stopped) setTimeout(tick, ms);
    }
    tick();
    return () => { stopped = true; };
  }

  // Plotly renders a small HTML subset in hover text; escape data so "<script>" shows as text.
  function plotText(s) {
    return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }

  // Plotly.react keeps zoom when uirevision is stable; also makes re-draws cheap.
  const plotConfig = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
  // plotly.js is the last deferred script: it has run once the document is fully parsed.
  // The mark lets bench/dashboard.py tell waiting for plotly.js from drawing with it.
  const plotlyReady = new Promise((resolve) => {
    if (window.Plotly) resolve();
    else document.addEventListener("DOMContentLoaded", resolve, { once: true });
  }).then(() => { if (!performance.getEntriesByName("ddp-plotly-ready").length) performance.mark("ddp-plotly-ready"); });

  // With responsive: true Plotly sizes the figure to its div on every window resize; a div whose
  // height comes only from its content then collapses (to min-height) and clips the figure.
  function fixHeight(node, height) {
    if (height) node.style.height = height + "px";
  }

  async function plot(id, traces, layout) {
    await plotlyReady;
    const node = document.getElementById(id);
    const full = Object.assign({ margin: { l: 60, r: 20, t: 10, b: 40 }, uirevision: "keep", font: { size: 12 } }, layout || {});
    fixHeight(node, full.height);
    return Plotly.react(node, traces, full, plotConfig);
  }

  return { cfg, api, apiAll, jobPath, jobHref, el, say, fmtSeconds, fmtBytes, fmtRatio, fmtAgo, poll, plot, fixHeight, plotlyReady, plotText, withParam };
})();
