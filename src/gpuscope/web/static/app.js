// gpuscope dashboard: cards and processes from the live stream, charts and the diagnosis timeline from
// /ui/api/range and /ui/api/timeline. Plain JS, no build step; the only library is uPlot (make web).
"use strict";

(function () {
  const $ = (sel) => document.querySelector(sel);
  const LIVE_TRIM = 4000;  // points per chart kept when live, whatever the range: a tab left open for days stays small
  const CHARTS = [
    { title: "SM active (true utilization)", metrics: ["gpu_sm_active_ratio"], unit: "pct", max: 100 },
    { title: "Tensor pipes active", metrics: ["gpu_tensor_active_ratio"], unit: "pct", max: 100 },
    { title: "DRAM bandwidth active", metrics: ["gpu_dram_active_ratio"], unit: "pct", max: 100 },
    { title: "NVML util (any kernel running)", metrics: ["gpu_utilization_ratio"], unit: "pct", max: 100 },
    { title: "Memory used", metrics: ["gpu_memory_used_bytes"], unit: "bytes" },
    { title: "Power", metrics: ["gpu_power_watts"], unit: "watts" },
    { title: "Temperature", metrics: ["gpu_temperature_celsius"], unit: "celsius" },
    { title: "PCIe rx + tx", metrics: ["gpu_pcie_rx_bytes_per_second", "gpu_pcie_tx_bytes_per_second"], unit: "rate" },
    { title: "NVLink rx + tx", metrics: ["gpu_nvlink_rx_bytes_per_second", "gpu_nvlink_tx_bytes_per_second"], unit: "rate" },
  ];
  const PALETTE = ["#58a6ff", "#3fb950", "#d29922", "#f778ba", "#a371f7", "#39c5cf", "#ff7b72", "#e3b341",
    "#8ddb8c", "#79c0ff", "#ffa657", "#d2a8ff"];
  const EVENT_COLORS = { xid: "#ff4d4f", ecc: "#ff4d4f", gpu_lost: "#ff00ff", clock_events: "#d29922",
    process_start: "#3fb950", process_stop: "#8a97a5", guard: "#a371f7" };
  const VERDICT_COLORS = { healthy: "#2ea043", idle: "#444c56", compute_bound: "#1f6feb", memory_bound: "#8957e5",
    host_bound: "#d29922", input_bound: "#bf8700", launch_bound: "#db6d28", sync_bound: "#e16f24",
    throttled: "#da3633", thermal: "#da3633", power: "#da3633", imbalance: "#a371f7", gpu_lost: "#ff00ff" };

  const state = { start: "-1h", end: "now", gpus: [], sort: { key: "gpu_memory_bytes", asc: false } };
  const api = window.gpuscope = { charts: [], renderedAt: null, timelineAt: null, loads: 0, live: 0, state: state, meta: null,
    overview: null, timeline: null };
  api.feed = (ov) => onOverview(ov);  // what the stream calls; tests feed it days of updates at once
  let meta = null, colorOf = {}, data = [], events = [], loadSeq = 0, stream = null, rangeS = [0, 0], stepS = 1, zooming = false;
  let retryTimer = 0, refusedMessage = null;
  const RETRY_MS = 5000;
  const STREAM_URL = "/ui/api/stream?interval=1s";  // a stream the server refused is opened again this much later

  // -- formatting ------------------------------------------------------------------------------------
  function fmt(v, unit) {
    if (v === null || v === undefined || Number.isNaN(v)) return "—";
    switch (unit) {
      case "pct": return v.toFixed(v >= 10 ? 0 : 1) + " %";
      case "ratio": return (v * 100).toFixed(0) + " %";
      case "bytes": return bytes(v);
      case "rate": return bytes(v) + "/s";
      case "watts": return v.toFixed(0) + " W";
      case "celsius": return v.toFixed(0) + " °C";
      case "cores": return v.toFixed(2);
      default: return String(v);
    }
  }
  function bytes(v) {
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return v.toFixed(v >= 10 || i === 0 ? 0 : 1) + " " + u[i];
  }
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

  // -- the URL holds the range and the GPUs, so a view can be shared ---------------------------------
  function readUrl() {
    const q = new URLSearchParams(location.search);
    state.start = q.get("start") || "-1h";
    state.end = q.get("end") || "now";
    state.gpus = (q.get("gpu") || "").split(",").map((s) => s.trim()).filter(Boolean);
  }
  function writeUrl() {
    const q = new URLSearchParams();
    q.set("start", state.start);
    q.set("end", state.end);
    if (state.gpus.length) q.set("gpu", state.gpus.join(","));
    history.replaceState(null, "", "/ui/?" + q.toString().replace(/%2F/g, "/").replace(/%2C/g, ","));
  }
  const isLive = () => state.end === "now";

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
  function query(extra) {
    const q = new URLSearchParams({ start: state.start, end: state.end, ...extra });
    if (state.gpus.length) q.set("gpu", state.gpus.join(","));
    return q.toString();
  }

  // -- controls --------------------------------------------------------------------------------------
  function setRange(start, end) {
    state.start = start;
    state.end = end;
    writeUrl();
    load();
  }
  function initControls() {
    document.querySelectorAll("#ranges button").forEach((b) => b.addEventListener("click", () => setRange(b.dataset.start, "now")));
    $("#custom").addEventListener("submit", (ev) => {
      ev.preventDefault();
      setRange($("#start").value.trim() || "-1h", $("#end").value.trim() || "now");
    });
    document.querySelectorAll("#procs th").forEach((th) => th.addEventListener("click", () => {
      const k = th.dataset.key;
      state.sort = { key: k, asc: state.sort.key === k ? !state.sort.asc : false };
      if (api.overview) renderProcesses(api.overview);
    }));
  }
  function renderControls() {
    document.querySelectorAll("#ranges button").forEach((b) => b.classList.toggle("active", isLive() && b.dataset.start === state.start));
    $("#start").value = state.start;
    $("#end").value = state.end;
    const box = $("#gpu-filter");
    box.textContent = "";
    box.appendChild(el("span", "muted", "GPUs:"));
    for (const g of meta ? meta.gpus : []) {
      const lab = el("label", "gpu");
      const cb = document.createElement("input");
      cb.type = "checkbox";
      cb.value = g.key;
      cb.checked = !state.gpus.length || state.gpus.includes(g.key);
      cb.addEventListener("change", () => {
        const on = [...box.querySelectorAll("input:checked")].map((i) => i.value);
        state.gpus = on.length === meta.gpus.length ? [] : on;
        writeUrl();
        load();
      });
      const sw = el("span", "swatch");
      sw.style.background = colorOf[g.key];
      // One host: '0'; a fleet: 'node-a/0', or the same index on two hosts reads alike.
      const hosts = new Set(meta.gpus.map((x) => x.host));
      lab.append(cb, sw, document.createTextNode(hosts.size > 1 ? g.key : g.gpu));
      box.appendChild(lab);
    }
  }

  // -- header ----------------------------------------------------------------------------------------
  function renderHeader(sim) {
    if (meta) {
      const where = meta.url || meta.host || "";
      $("#source").textContent = (meta.source === "prometheus" ? "Prometheus " : "agent ") + where + " · gpuscope " + meta.version;
    }
    $("#sim-banner").hidden = !sim;
    $("#sim-scenario").textContent = sim || "";
  }

  // -- cards -----------------------------------------------------------------------------------------
  function gaugeRow(card, label, value, unit, frac) {
    const r = el("div", "row");
    r.append(el("span", "muted", label), el("span", "", fmt(value, unit)));
    card.appendChild(r);
    if (frac !== null && frac !== undefined) {
      const bar = el("div", "bar"), fill = el("div");
      fill.style.width = Math.max(0, Math.min(100, frac * 100)).toFixed(1) + "%";
      bar.appendChild(fill);
      card.appendChild(bar);
    }
  }
  function renderCards(ov) {
    const box = $("#cards");
    box.textContent = "";
    const gpus = ov.gpus.filter((g) => !state.gpus.length || state.gpus.includes(g.key));
    if (!gpus.length) box.appendChild(el("div", "muted", ov.errors && ov.errors.length ? ov.errors.join(" ") : "No GPUs to show yet."));
    for (const g of gpus) {
      const v = g.values, card = el("div", "card" + (g.healthy ? "" : " lost"));
      const h = el("h3"), name = el("span"), sw = el("span", "swatch");
      sw.style.background = colorOf[g.key] || "#888";
      name.append(sw, document.createTextNode(g.key + " · " + g.name));
      h.append(name, el("span", g.healthy ? "muted" : "sev-critical", g.healthy ? (g.uuid || "").slice(0, 12) : "LOST"));
      card.appendChild(h);
      const sm = v.gpu_sm_active_ratio;
      const top = el("div", "row");
      top.append(el("span", "big", sm === null ? "—" : (sm * 100).toFixed(0) + " %"), el("span", "muted", "TRUE utilization (SM active)"));
      card.appendChild(top);
      gaugeRow(card, "Tensor active", pct(v.gpu_tensor_active_ratio), "pct", v.gpu_tensor_active_ratio);
      gaugeRow(card, "DRAM active", pct(v.gpu_dram_active_ratio), "pct", v.gpu_dram_active_ratio);
      gaugeRow(card, "NVML util (any kernel running)", pct(v.gpu_utilization_ratio), "pct", v.gpu_utilization_ratio);
      const mem = el("div", "row");
      mem.append(el("span", "muted", "Memory"), el("span", "", fmt(v.gpu_memory_used_bytes, "bytes") + " / " + fmt(v.gpu_memory_total_bytes, "bytes")));
      card.appendChild(mem);
      const pw = el("div", "row");
      pw.append(el("span", "muted", "Power · temperature"), el("span", "", fmt(v.gpu_power_watts, "watts") + " / " +
        fmt(v.gpu_power_limit_watts, "watts") + " · " + fmt(v.gpu_temperature_celsius, "celsius")));
      card.appendChild(pw);
      if (g.throttle && g.throttle.length) card.appendChild(el("div", "throttle", "Throttled: " + g.throttle.join(", ")));
      const vd = el("div", "verdict");
      if (g.verdict) {
        vd.appendChild(el("b", "sev-" + g.verdict.severity, g.verdict.kind.replace(/_/g, " ") + ": "));
        vd.appendChild(document.createTextNode(g.verdict.summary));
      } else {
        vd.appendChild(el("span", "muted", g.healthy ? "No verdict yet." : "The GPU is lost: NVML cannot reach it."));
      }
      card.appendChild(vd);
      box.appendChild(card);
    }
  }
  const pct = (r) => (r === null || r === undefined ? null : r * 100);

  // -- processes -------------------------------------------------------------------------------------
  function renderProcesses(ov) {
    const { key, asc } = state.sort;
    const procs = ov.processes.filter((p) => !state.gpus.length || state.gpus.includes(p.gpu_key));
    procs.sort((a, b) => {
      const x = a[key], y = b[key];
      const c = (x === null || x === undefined) - (y === null || y === undefined) ||
        (typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y), undefined, { numeric: true }));
      return asc ? c : -c;
    });
    document.querySelectorAll("#procs th").forEach((th) => {
      th.classList.toggle("sorted", th.dataset.key === key);
      th.classList.toggle("asc", th.dataset.key === key && asc);
    });
    const body = $("#procs tbody"), frag = document.createDocumentFragment();
    for (const p of procs) {
      const tr = el("tr");
      const cmd = el("td", "cmd", p.command || p.name);
      cmd.title = p.command || p.name;
      tr.append(el("td", "num", String(p.pid)), el("td", "", p.user || "—"), cmd, el("td", "", p.gpu_key),
        el("td", "num", fmt(p.gpu_memory_bytes, "bytes")), el("td", "num", fmt(pct(p.sm_ratio), "pct")),
        el("td", "num", fmt(p.cpu_cores, "cores")), el("td", "num", fmt(p.rss_bytes, "bytes")),
        el("td", "", [p.container, p.pod && (p.namespace ? p.namespace + "/" : "") + p.pod].filter(Boolean).join(" · ") || "—"));
      frag.appendChild(tr);
    }
    body.replaceChildren(frag);
    $("#proc-count").textContent = "(" + procs.length + ")";
  }

  // -- alerts ----------------------------------------------------------------------------------------
  function renderAlerts(al) {
    const box = $("#alerts");
    const active = [...(al.firing || []), ...(al.pending || [])];
    box.textContent = "";
    if (!active.length) { box.className = "muted"; box.textContent = "No alert is firing or pending."; return; }
    box.className = "";
    const ul = el("ul", "alerts");
    for (const a of active) {
      const li = el("li");
      const sev = (a.labels && a.labels.severity) || a.severity || "warning";
      li.append(el("b", "sev-" + sev, (a.state || "") + " " + (a.name || (a.labels && a.labels.alertname) || "alert") + ": "),
        document.createTextNode((a.annotations && a.annotations.summary) || a.summary || ""));
      ul.appendChild(li);
    }
    box.appendChild(ul);
  }

  // -- charts ----------------------------------------------------------------------------------------
  function gpuKeys() {
    const all = meta ? meta.gpus.map((g) => g.key) : [];
    return state.gpus.length ? all.filter((k) => state.gpus.includes(k)) : all;
  }
  // uPlot wants one x array and one y array per series, aligned: join the GPUs' series on their time stamps,
  // summing the metrics of a chart (rx + tx) where it has several.
  function align(responses, keys) {
    const perKey = new Map(keys.map((k) => [k, new Map()]));
    for (const res of responses) {
      for (const s of res.series) {
        const m = perKey.get(s.gpu_key);
        if (!m) continue;
        for (let i = 0; i < s.timestamps_ns.length; i++) {
          const t = Math.round(s.timestamps_ns[i] / 1e6) / 1e3, v = s.values[i];
          if (v === null) continue;
          m.set(t, (m.get(t) || 0) + v);
        }
      }
    }
    const xs = [...new Set([].concat(...[...perKey.values()].map((m) => [...m.keys()])))].sort((a, b) => a - b);
    return [xs, ...keys.map((k) => { const m = perKey.get(k); return xs.map((t) => (m.has(t) ? m.get(t) : null)); })];
  }
  function scaled(def, v) {
    return v === null || v === undefined ? null : def.unit === "pct" ? v * 100 : v;
  }
  function drawMarkers(u) {
    const { ctx } = u, { top, height } = u.bbox;
    ctx.save();
    ctx.lineWidth = Math.max(1, devicePixelRatio);
    for (const e of events) {
      const x = u.valToPos(e.time_ns / 1e9, "x", true);
      if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
      ctx.strokeStyle = EVENT_COLORS[e.kind] || "#888";
      ctx.globalAlpha = e.kind.startsWith("process_") ? 0.35 : 0.9;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
    }
    ctx.restore();
  }
  // The y range of an all-zero chart: a readable scale (0..1 KiB/s, 0..1 W) rather than ticks that
  // all print as 0.
  function floorOf(def) { return def.unit === "bytes" || def.unit === "rate" ? 1024 : 1; }
  function chartWidth(box) { return Math.max(300, box.clientWidth - 12); }
  function makeChart(def, box, d, keys, seq, done) {
    const opts = {
      title: def.title, width: chartWidth(box), height: 220,
      scales: { x: { time: true }, y: def.max ? { range: [0, def.max] } : { range: (u, lo, hi) => [0, Math.max(hi, floorOf(def)) * 1.1] } },
      series: [{}, ...keys.map((k) => ({ label: k, stroke: colorOf[k], width: 1.25, spanGaps: false,
        value: (u, v) => fmt(v, def.unit) }))],
      axes: [{ stroke: "#8a97a5", grid: { stroke: "#2a3540" }, ticks: { stroke: "#2a3540" } },
        { stroke: "#8a97a5", grid: { stroke: "#2a3540" }, ticks: { stroke: "#2a3540" }, size: 84,
          values: (u, vals) => vals.map((v) => fmt(v, def.unit)) }],
      cursor: { drag: { x: true, y: false, setScale: false }, sync: { key: "gpuscope" } },
      legend: { live: true },
      hooks: {
        draw: [(u) => { drawMarkers(u); if (seq === loadSeq) done(); }],
        setSelect: [(u) => {
          // The cursor sync hands the selection to every chart: act once, for the chart dragged on.
          if (u.select.width < 4 || zooming) return;
          zooming = true;
          setTimeout(() => { zooming = false; }, 0);
          const a = u.posToVal(u.select.left, "x"), b = u.posToVal(u.select.left + u.select.width, "x");
          u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
          setRange(a.toFixed(3), b.toFixed(3));  // zoom = a new, finer query over the selection
        }],
      },
    };
    return new uPlot(opts, d, box);
  }

  async function loadCharts(seq, keys) {
    const box = $("#charts");
    const requests = CHARTS.map((def) => Promise.all(def.metrics.map((m) => getJson("/ui/api/range?" + query({ metric: m, step: "auto" })))));
    const results = await Promise.all(requests);
    if (seq !== loadSeq) return;
    for (const c of api.charts) c.destroy();
    api.charts = [];
    box.textContent = "";
    data = [];
    const first = results[0][0];
    rangeS = [first.start_ns / 1e9, first.end_ns / 1e9];
    stepS = first.step_s;
    $("#range-label").textContent = new Date(rangeS[0] * 1000).toLocaleString() + " – " +
      (isLive() ? "now" : new Date(rangeS[1] * 1000).toLocaleString()) + " · step " + stepS + " s";
    renderHeader(first.simulated || (meta && meta.simulated));
    if (typeof uPlot === "undefined") {
      showMessage("The chart library is missing: run `make web` (npm ci --prefix src/gpuscope/web --omit=dev --no-audit --no-fund).");
      api.renderedAt = performance.now();
      return;
    }
    let pending = CHARTS.length;
    const done = () => { if (--pending === 0) api.renderedAt = performance.now(); };
    CHARTS.forEach((def, i) => {
      const d = align(results[i], keys);
      for (let j = 1; j < d.length; j++) d[j] = d[j].map((v) => scaled(def, v));
      data.push(d);
      const cbox = el("div", "chart");
      box.appendChild(cbox);
      let fired = false;
      api.charts.push(makeChart(def, cbox, d, keys, seq, () => { if (!fired) { fired = true; done(); } }));
      if (!d[0].length) cbox.appendChild(el("div", "empty", "No data in this range yet."));
    });
  }

  // -- diagnosis timeline ----------------------------------------------------------------------------
  async function loadTimeline(seq) {
    const tl = await getJson("/ui/api/timeline?" + query({}));
    if (seq !== loadSeq) return;
    api.timeline = tl;
    events = tl.events;
    for (const c of api.charts) c.redraw(false);
    renderTimeline(tl);
  }
  function renderTimeline(tl) {
    const box = $("#timeline"), [t0, t1] = rangeS, span = Math.max(1e-9, t1 - t0);
    box.textContent = "";
    const kinds = new Set();
    for (const key of gpuKeys()) {
      const lane = el("div", "lane"), track = el("div", "track");
      lane.append(el("span", "name", key), track);
      const place = (node, a, b) => {
        node.style.left = (Math.max(0, (a - t0) / span) * 100).toFixed(3) + "%";
        if (b !== undefined) node.style.width = (Math.max(0.2, (Math.min(b, t1) - Math.max(a, t0)) / span * 100)).toFixed(3) + "%";
      };
      for (const s of tl.spans.filter((s) => s.gpu_key === key)) {
        const d = el("div", "span");
        d.style.background = VERDICT_COLORS[s.kind] || "#6e7681";
        d.title = s.kind + ": " + s.summary;
        place(d, s.start_ns / 1e9, s.end_ns / 1e9);
        track.appendChild(d);
        kinds.add(s.kind);
      }
      for (const e of tl.events.filter((e) => e.gpu_key === key && !e.kind.startsWith("process_"))) {
        const d = el("div", "event");
        d.style.background = EVENT_COLORS[e.kind] || "#888";
        d.title = e.message;
        place(d, e.time_ns / 1e9);
        track.appendChild(d);
      }
      box.appendChild(lane);
    }
    if (!tl.spans.length) box.appendChild(el("div", "muted", "No diagnosis for this range yet (it needs samples)."));
    const legend = $("#legend");
    legend.textContent = "";
    for (const k of kinds) {
      const item = el("span"), sw = el("i");
      sw.style.background = VERDICT_COLORS[k] || "#6e7681";
      item.append(sw, document.createTextNode(k.replace(/_/g, " ")));
      legend.appendChild(item);
    }
    for (const [k, c] of Object.entries(EVENT_COLORS)) {
      const item = el("span", "muted"), sw = el("i");
      sw.style.background = c;
      item.append(sw, document.createTextNode(k.replace(/_/g, " ") + " marker"));
      legend.appendChild(item);
    }
  }

  // -- live updates ----------------------------------------------------------------------------------
  function onOverview(ov) {
    api.overview = ov;
    api.live++;
    renderHeader(ov.simulated);
    renderCards(ov);
    renderProcesses(ov);
    renderAlerts(ov.alerts || {});
    if (!isLive() || !api.charts.length) return;
    const t = ov.time_ns / 1e9, keys = gpuKeys(), byKey = new Map(ov.gpus.map((g) => [g.key, g]));
    CHARTS.forEach((def, i) => {
      const d = data[i];
      if (!d) return;
      const last = d[0].length ? d[0][d[0].length - 1] : -Infinity;
      if (t - last < stepS * 0.999) return;  // keep the query's resolution: at most one point per step
      d[0].push(t);
      keys.forEach((k, j) => {
        const g = byKey.get(k);
        let v = null;
        if (g) for (const m of def.metrics) { const x = g.values[m]; if (x !== null && x !== undefined) v = (v || 0) + x; }
        d[j + 1].push(scaled(def, v));
      });
      const cutoff = t - (rangeS[1] - rangeS[0]);
      let drop = 0;
      while (drop < d[0].length && d[0][drop] < cutoff) drop++;
      drop = Math.max(drop, d[0].length - LIVE_TRIM);
      if (drop > 0) for (const col of d) col.splice(0, drop);
      api.charts[i].setData(d);
    });
  }
  // EventSource hides the answer of a refused stream: ask for it once more to show its sentence.
  function whyRefused() {
    const ctl = new AbortController();
    fetch(STREAM_URL, { credentials: "same-origin", signal: ctl.signal }).then(async (r) => {
      if (r.ok) { ctl.abort(); return; }
      let body = null;
      try { body = await r.json(); } catch (e) { body = null; }
      refusedMessage = (body && body.error) || ("The server refused the live stream (HTTP " + r.status + ").");
      showMessage(refusedMessage);
    }).catch(() => {});
  }
  function connect() {
    if (stream) stream.close();
    stream = new EventSource(STREAM_URL);
    const conn = $("#conn");
    stream.addEventListener("overview", (ev) => {
      if (refusedMessage !== null && $("#message").textContent === refusedMessage) showMessage("");
      refusedMessage = null;
      conn.textContent = "live";
      conn.className = "conn live";
      onOverview(JSON.parse(ev.data));
    });
    stream.addEventListener("error", (ev) => {
      if (ev.data) { showMessage(JSON.parse(ev.data).error); return; }
      conn.textContent = "disconnected, retrying…";
      conn.className = "conn down";
      if (ev.target === stream && stream.readyState === EventSource.CLOSED) {
        // The server answered the stream with an error (401 once the token changed, 503 with too many
        // dashboards open): the browser gives up on it for good. Say why, and try again later.
        whyRefused();
        clearTimeout(retryTimer);
        retryTimer = setTimeout(connect, RETRY_MS);
      }
    });
  }

  // -- loading a view --------------------------------------------------------------------------------
  async function load() {
    const seq = ++loadSeq;
    api.renderedAt = null;
    api.timelineAt = null;
    showMessage("");
    renderControls();
    try {
      const keys = gpuKeys();
      // The charts first: a long range's diagnosis costs the agent more than all the charts together,
      // and asked for at the same time it would keep them waiting (a day: 0.9 s instead of 0.4 s).
      await loadCharts(seq, keys);
      await loadTimeline(seq).catch((e) => { if (seq === loadSeq) showMessage(e.message); });
      if (seq === loadSeq) {
        renderTimeline(api.timeline || { spans: [], events: [] });
        api.timelineAt = performance.now();
        api.loads++;
      }
    } catch (e) {
      if (seq !== loadSeq) return;
      for (const c of api.charts) c.destroy();
      api.charts = [];
      $("#charts").textContent = "";
      showMessage(e.message);
      api.renderedAt = performance.now();
    }
    if (api.overview) { renderCards(api.overview); renderProcesses(api.overview); }
  }

  // -- the kernels of the last trace taken on demand (gpuscope trace --on-demand, POST /api/v1/trace);
  // only the agent has /api/v1/traces: elsewhere, or before any trace, the box stays hidden -----------
  function seconds(v) {
    if (v === null || v === undefined) return "–";
    return v >= 1 ? v.toFixed(2) + " s" : v >= 1e-3 ? (v * 1e3).toFixed(2) + " ms" : (v * 1e6).toFixed(1) + " µs";
  }
  async function loadKernels() {
    const list = await getJson("/api/v1/traces");
    const last = (list.traces || []).find((t) => t.status === "written" && t.kernel_names);
    if (!last) return;
    const one = await getJson("/api/v1/traces/" + encodeURIComponent(last.id) + "/kernels");
    const mine = (one.traces || []).find((t) => t.pid === last.pid);
    if (!mine || !mine.kernels) return;
    const kernels = mine.kernels.slice().sort((a, b) => b.total_s - a.total_s).slice(0, 20);
    const body = $("#kernels tbody");
    body.textContent = "";
    for (const k of kernels) {
      const name = el("td", "", k.short_name);
      name.title = k.name;
      const tr = el("tr");
      tr.append(name, el("td", "", k.gpu), el("td", "num", String(k.count)), el("td", "num", seconds(k.total_s)),
        el("td", "num", seconds(k.p50_s)), el("td", "num", seconds(k.p99_s)), el("td", "num", seconds(k.launch_delay_p50_s)));
      body.appendChild(tr);
    }
    const at = last.start_unix ? new Date(last.start_unix * 1000).toLocaleString() : "";
    $("#kernels-note").textContent = "pid " + last.pid + ", " + last.duration_s + " s from " + at +
      (mine.kernels.length > kernels.length ? ", the 20 longest of " + mine.kernels.length : "");
    $("#kernels-box").hidden = false;
  }

  async function start() {
    readUrl();
    initControls();
    try {
      meta = api.meta = await getJson("/ui/api/meta");
    } catch (e) {
      showMessage(e.message);
      return;
    }
    meta.gpus.forEach((g, i) => { colorOf[g.key] = PALETTE[i % PALETTE.length]; });
    renderHeader(meta.simulated);
    writeUrl();
    connect();
    await load();
    setInterval(() => { if (isLive() && loadSeq) loadTimeline(loadSeq).catch(() => {}); }, 15000);
    if (meta.source === "agent") {  // traces live on an agent; a Prometheus-backed page has none to ask for
      loadKernels().catch(() => {});
      setInterval(() => loadKernels().catch(() => {}), 30000);
    }
    let resizeTimer = 0;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => { for (const c of api.charts) c.setSize({ width: chartWidth(c.root.parentNode), height: 220 }); }, 150);
    });
  }

  start();
})();
