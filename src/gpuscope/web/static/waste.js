// gpuscope dashboard, the waste view (/ui/waste): the fleet report (gpuscope fleet report) over the dashboard's
// Prometheus, from /ui/api/waste, ranked by money wasted and refreshed every minute; each row opens the GPU
// pages (/ui/?gpu=host/0) of the GPUs in its group. Plain JS, no build step; text goes in as textContent only.
"use strict";

(function () {
  const $ = (sel) => document.querySelector(sel);
  const REFRESH_MS = 60000;
  const BY = ["namespace", "pod", "job", "user", "node", "model"];
  const HEAD = { namespace: "Namespace", pod: "Pod", job: "Job", user: "User", node: "Node", model: "Model" };
  const NB = "\u00a0";
  const state = { since: "24h", by: "namespace" };
  const api = window.gpuscope = { waste: null, meta: null, renderedAt: null, loads: 0, state: state };
  let seq = 0, shownFor = null;
  const viewKey = () => state.since + "|" + state.by;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function showMessage(text) {
    const m = $("#message");
    m.textContent = text || "";
    m.hidden = !text;
  }
  async function getJson(path) {
    const r = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" } });
    let body = null;
    try { body = await r.json(); } catch (e) { body = null; }
    if (!r.ok) {
      const err = new Error((body && body.error) || ("The server answered " + r.status + " for " + path + "."));
      err.status = r.status;
      throw err;
    }
    return body;
  }

  // -- numbers: GPU-hours to three figures, money in the report's currency -----------------------------
  function hours(v) {
    if (v === null || v === undefined) return "—";
    if (v === 0) return "0";
    return v >= 100 ? Math.round(v).toLocaleString() : v.toPrecision(3);
  }
  function kwh(v) {
    if (v === null || v === undefined) return "—";
    return (v >= 100 ? Math.round(v).toLocaleString() : v.toPrecision(3)) + NB + "kWh";
  }
  function money(v, currency) {
    if (v === null || v === undefined) return "—";
    try {
      return new Intl.NumberFormat(undefined, { style: "currency", currency: currency }).format(v);
    } catch (e) {  // a currency of the prices file that is no ISO 4217 code: the number and its name
      return v.toFixed(2) + NB + currency;
    }
  }
  function clock(t) {
    const d = new Date(t * 1000), p = (n) => String(n).padStart(2, "0");
    return p(d.getHours()) + ":" + p(d.getMinutes()) + ":" + p(d.getSeconds());
  }

  // -- the URL holds the range and the grouping, so a view can be shared -------------------------------
  function readUrl() {
    const q = new URLSearchParams(location.search);
    state.since = q.get("since") || "24h";
    state.by = BY.includes(q.get("by")) ? q.get("by") : "namespace";
  }
  function writeUrl() {
    const q = new URLSearchParams({ since: state.since, by: state.by });
    history.replaceState(null, "", "/ui/waste?" + q.toString());
  }
  function renderControls() {
    document.querySelectorAll("#ranges button").forEach((b) => b.classList.toggle("active", b.dataset.since === state.since));
    $("#since").value = state.since;
    $("#by").value = state.by;
  }
  function set(since, by) {
    state.since = since;
    state.by = by;
    writeUrl();
    load();
  }
  function initControls() {
    document.querySelectorAll("#ranges button").forEach((b) => b.addEventListener("click", () => set(b.dataset.since, state.by)));
    $("#custom").addEventListener("submit", (ev) => {
      ev.preventDefault();
      set($("#since").value.trim() || "24h", state.by);
    });
    $("#by").addEventListener("change", () => set(state.since, $("#by").value));
  }

  // -- the view --------------------------------------------------------------------------------------
  // A GPU's page: the dashboard filtered to it, over the same range (the answer's `since`, in the
  // dashboard's grammar: 90m, 24h, 7d).
  function gpuHref(keys, since) {
    const q = new URLSearchParams({ start: "-" + since, end: "now", gpu: keys.join(",") });
    return "/ui/?" + q.toString().replace(/%2F/g, "/").replace(/%2C/g, ",");
  }
  function gpuLinks(keys, since) {
    const td = el("td", "gpus");
    if (!keys.length) { td.appendChild(el("span", "muted", "—")); return td; }
    if (keys.length > 1) {
      const all = el("a", "all", "all " + keys.length);
      all.href = gpuHref(keys, since);
      all.title = keys.join(", ");
      td.appendChild(all);
    }
    for (const k of keys) {
      const a = el("a", "gpu", k);
      a.href = gpuHref([k], since);
      td.appendChild(a);
    }
    return td;
  }
  function render(doc) {
    const r = doc.report, f = r.fleet, cur = r.currency || "USD";
    api.waste = doc;
    $("#fleet-line").textContent = f.line;
    const notes = [
      f.gpus + " GPU" + (f.gpus === 1 ? "" : "s"),
      hours(f.observed_gpu_hours) + " GPU-h observed" + (f.unobserved_gpu_hours > 0 ? " (" + hours(f.unobserved_gpu_hours) + " not scraped)" : ""),
      hours(f.allocated_gpu_hours) + " allocated, " + hours(f.used_gpu_hours) + " used, " + hours(f.idle_gpu_hours) + " idle",
      money(f.wasted_money, cur) + " wasted while allocated, " + money(f.unallocated_money, cur) + " unallocated",
      kwh(f.energy_kwh) + ", " + f.co2e_kg.toPrecision(3) + NB + "kg CO2e",
      "as of " + clock(doc.computed_at_s) + " (" + r.source + " series, " + r.queries + " queries in " + r.query_seconds.toFixed(1) + NB + "s)",
    ];
    $("#fleet-note").textContent = notes.join(" · ");
    $("#range-label").textContent = r.range.start + " – " + r.range.end;
    $("#group-head").textContent = HEAD[doc.by] || doc.by;
    const body = $("#waste tbody"), frag = document.createDocumentFragment();
    r.groups.forEach((g, i) => {
      const tr = el("tr");
      tr.dataset.group = g.group;
      const name = el("td", g.group === "(none)" ? "name muted" : "name", g.group);
      name.title = g.group;
      const why = el("td", "why");
      why.append(el("div", "", g.why), el("div", "muted", g.fix));
      tr.append(el("td", "num", String(i + 1)), name, gpuLinks((doc.gpus || {})[g.group] || [], doc.since),
        el("td", "num", hours(g.allocated_gpu_hours)), el("td", "num", hours(g.used_gpu_hours)),
        el("td", "num", hours(g.idle_gpu_hours)), el("td", "num", kwh(g.energy_kwh)), el("td", "num", money(g.cost, cur)),
        el("td", "num wasted", money(g.wasted_money, cur)), why);
      frag.appendChild(tr);
    });
    body.replaceChildren(frag);
    $("#group-count").textContent = "(" + r.groups.length + " " + (r.groups.length === 1 ? "group" : "groups") + ", by " + doc.by + ")";
  }

  async function load() {
    const mine = ++seq, conn = $("#conn");
    renderControls();
    conn.textContent = "refreshing…";
    conn.className = "conn";
    try {
      const doc = await getJson("/ui/api/waste?" + new URLSearchParams({ since: state.since, by: state.by }).toString());
      if (mine !== seq) return;
      showMessage("");
      render(doc);
      shownFor = viewKey();
      conn.textContent = "live · every " + REFRESH_MS / 1000 + NB + "s";
      conn.className = "conn live";
    } catch (e) {
      if (mine !== seq) return;
      // The last answer stays on the page (a report still being computed, a server down for a moment),
      // unless it was for another range or grouping.
      if (shownFor !== viewKey()) {
        $("#waste tbody").textContent = "";
        $("#fleet-line").textContent = "—";
        $("#fleet-note").textContent = "";
        $("#group-count").textContent = "";
        api.waste = null;
        shownFor = null;
      }
      showMessage(e.message);
      conn.textContent = "not updated";
      conn.className = "conn down";
    }
    api.loads++;
    api.renderedAt = performance.now();
  }

  // The agent's own dashboard has no fleet to report on: the page says so (what /ui/api/waste answers there).
  const onAgent = () => Boolean(api.meta && api.meta.source === "agent");

  async function start() {
    readUrl();
    initControls();
    writeUrl();
    try {
      const meta = api.meta = await getJson("/ui/api/meta");
      $("#source").textContent = (meta.source === "prometheus" ? "Prometheus " + (meta.prometheus || "") : "agent " + (meta.host || "")) + " · gpuscope " + meta.version;
      $("#sim-banner").hidden = !meta.simulated;
    } catch (e) {
      $("#source").textContent = "";
    }
    if (onAgent()) {  // nothing to ask: the agent's answer is this sentence
      $("#needs-prometheus").hidden = false;
      $("#controls").style.display = "none";  // its CSS display outranks the hidden attribute
      $("main").style.display = "none";
      $("#conn").textContent = "";
      api.loads++;
      api.renderedAt = performance.now();
      return;
    }
    await load();
    setInterval(load, REFRESH_MS);
  }

  start();
})();
