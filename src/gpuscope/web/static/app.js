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
    // A reference line (dashed): the clock the SMs could run at, the power the GPU may draw.
    { title: "SM clock", metrics: ["gpu_sm_clock_hertz"], unit: "hertz", ref: { metric: "gpu_sm_clock_max_hertz", label: "max SM clock" } },
    { title: "Power", metrics: ["gpu_power_watts"], unit: "watts", ref: { metric: "gpu_power_limit_watts", label: "power limit" } },
    { title: "Memory used", metrics: ["gpu_memory_used_bytes"], unit: "bytes" },
    { title: "Temperature", metrics: ["gpu_temperature_celsius"], unit: "celsius" },
    { title: "PCIe rx + tx", metrics: ["gpu_pcie_rx_bytes_per_second", "gpu_pcie_tx_bytes_per_second"], unit: "rate" },
    { title: "NVLink rx + tx", metrics: ["gpu_nvlink_rx_bytes_per_second", "gpu_nvlink_tx_bytes_per_second"], unit: "rate" },
  ];
  const CHART_HEIGHT = 200;
  const AXIS_FONT = "11px system-ui, sans-serif";
  const PALETTE = ["#58a6ff", "#3fb950", "#d29922", "#f778ba", "#a371f7", "#39c5cf", "#ff7b72", "#e3b341",
    "#8ddb8c", "#79c0ff", "#ffa657", "#d2a8ff"];
  // Markers: each kind its own colour (an XID and an ECC error are different faults), bright and outlined
  // so that they show on any band; the legend draws them as lines, the bands as squares.
  const EVENT_COLORS = { xid: "#ff2a2a", ecc: "#ffe14d", gpu_lost: "#ff80ff", clock_events: "#fff7b0",
    process_start: "#7dffa0", process_stop: "#8a97a5", guard: "#b3f0ff" };
  // Every verdict its own colour, by family: green = well used; blue/violet = a GPU-side limit; warm =
  // the GPU waits on something (it costs money); pink = memory held idle; red/magenta = faults. No colour
  // is the track's "no data" one; tests/test_web_chromium.py holds them apart (CIE76 distance >= 20).
  const VERDICT_COLORS = {
    healthy: "#2ea043", compute_bound: "#1f6feb", memory_bound: "#8957e5", memory_access_bound: "#d2a8ff",
    tensor_cores_unused: "#39c5cf", underutilized: "#9e6a03", input_starved: "#e3b341", transfer_bound: "#f0883e",
    launch_or_sync_bound: "#ff7b72", launch_bound: "#ffc99e", sync_bound: "#b04a00", host_bound: "#8b949e",
    idle_allocated: "#f778ba", idle: "#3d444d", gpu_lost: "#ff00ff",
    // side verdicts (not drawn as bands today, coloured all the same so that a new view can)
    throttled: "#da3633", power_capped: "#7ee787", memory_growth: "#d9f06a", hardware: "#ffffff",
    anomaly: "#79c0ff", peer_outlier: "#0d7d86", imbalance: "#4d2d8f",
  };
  const UNKNOWN_VERDICT_COLOR = "#c297b8";  // a kind this page does not know yet: still not "no data"

  const state = { start: "-1h", end: "now", gpus: [], sort: { key: "gpu_memory_bytes", asc: false } };
  const api = window.gpuscope = { charts: [], renderedAt: null, timelineAt: null, loads: 0, live: 0, state: state, meta: null,
    overview: null, timeline: null, axis: [0, 0], axisFont: AXIS_FONT };
  api.feed = (ov) => onOverview(ov);  // what the stream calls; tests feed it days of updates at once
  api.drawTimeline = (tl) => renderTimeline(tl);  // tests draw every verdict kind at once
  // The one time axis [start, end] in seconds that the charts and the diagnosis bands share: the range
  // asked for (not the span of the data), moving with the live updates when the range ends at "now".
  let axis = api.axis;
  let meta = null, colorOf = {}, data = [], events = [], loadSeq = 0, stream = null, stepS = 1, zooming = false;
  let retryTimer = 0, refusedMessage = null, placed = [];
  const RETRY_MS = 5000;
  const STREAM_URL = "/ui/api/stream?interval=1s";  // a stream the server refused is opened again this much later

  // -- formatting: a number and its unit never part (no-break space); flows in decimal units (GB/s, as
  // PCIe and NVLink are specified and as the verdicts say them), sizes in binary ones (GiB, as nvidia-smi) --
  const NB = "\u00a0";
  const BIN = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"], DEC = ["B/s", "kB/s", "MB/s", "GB/s", "TB/s", "PB/s"];
  function fmt(v, unit) {
    if (v === null || v === undefined || Number.isNaN(v)) return "—";
    switch (unit) {
      case "pct": return v.toFixed(v >= 10 ? 0 : 1) + NB + "%";
      case "ratio": return (v * 100).toFixed(0) + NB + "%";
      case "bytes": case "rate": {
        const s = scaleOf(unit, Math.abs(v)), x = v / s.div;
        return x.toFixed(Math.abs(x) >= 10 || s.div === 1 ? 0 : 1) + NB + s.suffix;
      }
      case "watts": return v.toFixed(0) + NB + "W";
      case "celsius": return v.toFixed(0) + NB + "°C";
      case "hertz": return (v / 1e6).toFixed(0) + NB + "MHz";
      default: return String(v);
    }
  }
  // The unit an axis (or a value) is shown in: by its largest magnitude.
  function scaleOf(unit, mag) {
    if (unit === "bytes" || unit === "rate") {
      const base = unit === "bytes" ? 1024 : 1000, names = unit === "bytes" ? BIN : DEC;
      let i = 0;
      while (mag >= base ** (i + 1) && i < names.length - 1) i++;
      return { div: base ** i, suffix: names[i] };
    }
    return { pct: { div: 1, suffix: "%" }, watts: { div: 1, suffix: "W" }, celsius: { div: 1, suffix: "°C" },
      hertz: { div: 1e6, suffix: "MHz" } }[unit] || { div: 1, suffix: "" };
  }
  // The fewest decimals that show a step exactly (2.5 -> 1, 0.25 -> 2).
  function decimalsOf(step) {
    for (let d = 0; d < 6; d++) if (Math.abs(step * 10 ** d - Math.round(step * 10 ** d)) < 1e-6) return d;
    return 6;
  }
  // Ticks: uPlot steps by 1, 2, 2.5, 5 x 10^k; bytes by powers of two (0, 8, 16, 24 GiB; 0, 0.5, 1 GiB),
  // so that in the unit shown every tick is a round number.
  const BINARY_INCRS = [];
  for (let k = 0; k < 6; k++) for (let j = 0; j < 10; j++) BINARY_INCRS.push(2 ** j * 1024 ** k);
  function tickLabels(unit, splits, incr) {
    const s = scaleOf(unit, Math.max(0, ...splits.map(Math.abs)));
    const d = decimalsOf(incr / s.div);
    return splits.map((v) => (v === 0 ? "0" : (v / s.div).toFixed(d)) + NB + s.suffix);
  }
  const pad = (n, w) => String(n).padStart(w || 2, "0");
  const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
  // Time ticks on one line, local time: 14:05 (14:05:30 below a minute; 14:05:30.5 below a second); a
  // day's first tick and steps of days say the date. The full date is in the range label above.
  function timeLabels(splits, incr) {
    return splits.map((t) => {
      const d = new Date(t * 1000);
      const day = MONTHS[d.getMonth()] + " " + d.getDate();
      if (incr >= 86400 - 1e-6) return day;
      if (d.getHours() === 0 && d.getMinutes() === 0 && d.getSeconds() === 0 && d.getMilliseconds() === 0) return day;
      let s = pad(d.getHours()) + ":" + pad(d.getMinutes());
      if (incr < 60 - 1e-6) {
        const dec = incr < 1 ? decimalsOf(incr) : 0, sec = ((t % 60) + 60) % 60;
        s += ":" + sec.toFixed(dec).padStart(dec ? 3 + dec : 2, "0");
      }
      return s;
    });
  }
  // An absolute time as the range boxes show it: RFC 3339 in local time with its offset, which the
  // server reads back (2026-11-29 14:05:30+01:00; milliseconds where the range is short).
  function stamp(t, ms) {
    const d = new Date(Math.round(t * 1000)), off = -d.getTimezoneOffset();
    const tz = off === 0 ? "Z" : (off > 0 ? "+" : "-") + pad(Math.floor(Math.abs(off) / 60)) + ":" + pad(Math.abs(off) % 60);
    return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " + pad(d.getHours()) + ":" +
      pad(d.getMinutes()) + ":" + pad(d.getSeconds()) + (ms ? "." + pad(d.getMilliseconds(), 3) : "") + tz;
  }
  // What a range box shows: -1h and now as written, unix seconds (old links) as a date and time.
  function shownTime(text) {
    return /^\s*\d+(\.\d+)?\s*$/.test(text) && Number(text) > 1e8 ? stamp(Number(text), !Number.isInteger(Number(text))) : text;
  }
  function duration(s) {
    s = Math.max(0, Math.round(s));
    if (s < 60) return s + NB + "s";
    if (s < 3600) return Math.floor(s / 60) + NB + "min";
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
    return h + NB + "h" + (m ? " " + m + NB + "min" : "");
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
    history.replaceState(null, "", "/ui/?" + q.toString().replace(/%2F/g, "/").replace(/%2C/g, ",").replace(/%3A/g, ":"));
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
    $("#start").value = shownTime(state.start);
    $("#end").value = shownTime(state.end);
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
      const badge = allocationBadge(g.allocation);
      if (badge) card.appendChild(badge);
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
  // Kubernetes (gpu_allocation_state): what holds the GPU and whether it works; nothing outside Kubernetes.
  const ALLOCATION = { unallocated: "Unallocated", allocated_idle: "Allocated, idle", in_use_by_pod: "In use by a pod",
    in_use_outside_kubernetes: "In use outside Kubernetes" };
  function allocationBadge(a) {
    if (!a || !a.state) return null;
    const pods = [...new Set((a.pods || []).map((p) => p.namespace + "/" + p.pod))];
    const named = pods.length && (a.state === "allocated_idle" || a.state === "in_use_by_pod");
    const b = el("div", "k8s k8s-" + a.state, (ALLOCATION[a.state] || a.state) + (named ? ": " + pods.join(", ") : ""));
    b.title = "gpu_allocation_state: " + a.state;
    return b;
  }

  // -- processes -------------------------------------------------------------------------------------
  function renderProcesses(ov) {
    const { key, asc } = state.sort;
    const procs = ov.processes.filter((p) => !state.gpus.length || state.gpus.includes(p.gpu_key));
    for (const p of procs) p.verdict_kind = p.verdict ? p.verdict.kind : null;  // sortable like the other columns
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
        el("td", "num", fmt(pct(p.cpu_cores), "pct")), el("td", "num", fmt(p.rss_bytes, "bytes")),
        el("td", "", [p.container, p.pod && (p.namespace ? p.namespace + "/" : "") + p.pod].filter(Boolean).join(" · ") || "—"),
        verdictCell(p.verdict));
      frag.appendChild(tr);
    }
    body.replaceChildren(frag);
    $("#proc-count").textContent = "(" + procs.length + ")";
  }

  // A process's verdict: its kind, coloured by severity; the summary (what limits it and why) on hover.
  function verdictCell(v) {
    const td = el("td", "verdict-cell");
    if (!v) { td.textContent = "—"; return td; }
    td.appendChild(el("span", "sev-" + v.severity, v.kind.replace(/_/g, " ")));
    td.title = v.summary || "";
    return td;
  }

  // -- alerts ----------------------------------------------------------------------------------------
  // A pending alert is a condition that holds but has not held for the rule's `for` yet: it is told as
  // how long it has held against that `for`, with what holds now (the verdict), never with the summary
  // written for when it fires ("... for 30 min"), which goes to the tooltip.
  function alertLine(a, nowS) {
    const ann = a.annotations || {}, labels = a.labels || {};
    const name = a.rule || a.name || labels.alertname || "alert";
    const summary = ann.summary || a.summary || "";
    const since = typeof a.active_at === "number" ? nowS - a.active_at : null;
    if (a.state === "pending") {
      const held = since === null ? "" : " for " + duration(since);
      const of = typeof a.for_s === "number" && a.for_s > 0 ? " of the " + duration(a.for_s) + " it must hold to fire"
        : " (it fires once it has held for the rule's `for`)";
      const now = ann.verdict || (ann.condition ? "holds: " + ann.condition : "its condition holds");
      return { head: "pending " + name + held + of + ": ", text: now, title: summary && "When it fires: " + summary };
    }
    const at = typeof a.fired_at === "number" ? a.fired_at : a.active_at;
    const when = typeof at === "number" ? " since " + stamp(at).slice(11, 19) : "";
    return { head: (a.state || "") + " " + name + when + ": ", text: summary || ann.verdict || "", title: ann.description || "" };
  }
  function renderAlerts(al, nowS) {
    const box = $("#alerts");
    const active = [...(al.firing || []), ...(al.pending || [])];
    box.textContent = "";
    if (!active.length) { box.className = "muted"; box.textContent = "No alert is firing or pending."; return; }
    box.className = "";
    const ul = el("ul", "alerts");
    for (const a of active) {
      const li = el("li"), line = alertLine(a, nowS);
      const sev = (a.labels && a.labels.severity) || a.severity || "warning";
      li.append(el("b", "sev-" + sev, line.head), document.createTextNode(line.text));
      if (line.title) li.title = line.title;
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
  function perKey(responses, keys) {
    const out = new Map(keys.map((k) => [k, new Map()]));
    for (const res of responses) {
      for (const s of res.series) {
        const m = out.get(s.gpu_key);
        if (!m) continue;
        for (let i = 0; i < s.timestamps_ns.length; i++) {
          const t = Math.round(s.timestamps_ns[i] / 1e6) / 1e3, v = s.values[i];
          if (v === null) continue;
          m.set(t, (m.get(t) || 0) + v);
        }
      }
    }
    return out;
  }
  function align(responses, keys) {
    const m = perKey(responses, keys);
    const xs = [...new Set([].concat(...[...m.values()].map((x) => [...x.keys()])))].sort((a, b) => a - b);
    return [xs, ...keys.map((k) => { const g = m.get(k); return xs.map((t) => (g.has(t) ? g.get(t) : null)); })];
  }
  // A reference line (the power limit, the max SM clock) on the chart's time stamps. These are read
  // rarely and change rarely: each point takes the last value stored at or before it. One line when every
  // GPU has the same value, else one per GPU in its colour.
  function refColumns(def, responses, keys, xs) {
    if (!def.ref || !responses) return [];
    const m = perKey(responses, keys), have = [];
    for (const k of keys) {
      const pts = [...m.get(k).entries()].sort((p, q) => p[0] - q[0]);
      if (!pts.length) continue;
      let j = 0;
      have.push([k, xs.map((t) => { while (j + 1 < pts.length && pts[j + 1][0] <= t) j++; return pts[j][1]; })]);
    }
    if (!have.length) return [];
    const values = new Set();
    for (const [, col] of have) for (const v of col) values.add(v);
    if (values.size <= 1 || have.length === 1) return [{ label: def.ref.label, key: null, values: have[0][1] }];
    return have.map(([k, col]) => ({ label: k + " " + def.ref.label, key: k, values: col }));
  }
  function scaled(def, v) {
    return v === null || v === undefined ? null : def.unit === "pct" ? v * 100 : v;
  }
  function drawMarkers(u) {
    const { ctx } = u, { top, height } = u.bbox;
    ctx.save();
    ctx.setLineDash([]);  // a dashed reference line leaves its dash behind
    ctx.lineWidth = Math.max(1, devicePixelRatio);
    for (const e of events) {
      const x = u.valToPos(e.time_ns / 1e9, "x", true);
      if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
      ctx.strokeStyle = EVENT_COLORS[e.kind] || "#888";
      // clock-event changes come often at a power cap: seen, but not louder than an XID
      ctx.globalAlpha = e.kind.startsWith("process_") ? 0.35 : e.kind === "clock_events" ? 0.6 : 0.9;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
    }
    ctx.restore();
  }
  // The y range of an all-zero chart: a readable scale (0..750 B/s, 0..1 W) rather than ticks that all
  // print as 0; kept below 1 k of the unit, so that it reads in the unit itself.
  function floorOf(def) { return { bytes: 900, rate: 900, hertz: 0.9e6 }[def.unit] || 1; }
  function chartWidth(box) { return Math.max(300, box.clientWidth - 12); }
  function makeChart(def, box, d, keys, refs, seq, done) {
    const info = { def: def, keys: keys, refs: refs.map((r) => r.label), refKeys: refs.map((r) => r.key), ticks: { x: null, y: null } };
    const grid = { stroke: "#2a3540" }, ticks = { stroke: "#2a3540" };
    const yAxis = { stroke: "#8a97a5", grid: grid, ticks: ticks, size: 84, font: AXIS_FONT,
      values: (u, splits, i, space, incr) => (info.ticks.y = { splits: splits.slice(), incr: incr, labels: tickLabels(def.unit, splits, incr) }).labels };
    if (def.unit === "bytes") yAxis.incrs = BINARY_INCRS;
    const opts = {
      title: def.title, width: chartWidth(box), height: CHART_HEIGHT,
      scales: {
        x: { time: true, range: () => [axis[0], axis[1]] },  // the range asked for, not the data's span
        y: def.max ? { range: [0, def.max] } : { range: (u, lo, hi) => [0, Math.max(hi, floorOf(def)) * 1.1] },
      },
      series: [{}, ...keys.map((k) => ({ label: k, stroke: colorOf[k], width: 1.25, spanGaps: false,
        value: (u, v) => fmt(v, def.unit) })),
      ...refs.map((r) => ({ label: r.label, stroke: r.key ? colorOf[r.key] : "#c9d1d9", width: 1.25, dash: [6, 4],
        spanGaps: true, value: (u, v) => fmt(v, def.unit) }))],
      axes: [{ stroke: "#8a97a5", grid: grid, ticks: ticks, font: AXIS_FONT, space: 80,
        values: (u, splits, i, space, incr) => (info.ticks.x = { splits: splits.slice(), incr: incr, labels: timeLabels(splits, incr) }).labels },
      yAxis],
      cursor: { drag: { x: true, y: false, setScale: false }, sync: { key: "gpuscope" } },
      legend: { live: true },
      hooks: {
        draw: [(u) => { drawMarkers(u); if (seq === loadSeq) done(); }],
        setSize: [() => alignTimeline()],
        setSelect: [(u) => {
          // The cursor sync hands the selection to every chart: act once, for the chart dragged on.
          if (u.select.width < 4 || zooming) return;
          zooming = true;
          setTimeout(() => { zooming = false; }, 0);
          let a = u.posToVal(u.select.left, "x"), b = u.posToVal(u.select.left + u.select.width, "x");
          const ms = b - a < 120;  // a short selection keeps its milliseconds
          if (!ms) { a = Math.floor(a); b = Math.ceil(b); }
          u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
          setRange(stamp(a, ms), stamp(b, ms));  // zoom = a new, finer query over the selection
        }],
      },
    };
    const u = new uPlot(opts, d, box);
    u.gpuscope = info;  // what tests read: the series layout and the tick labels drawn
    return u;
  }

  async function loadCharts(seq, keys) {
    const box = $("#charts"), known = new Set(meta ? meta.metrics : []);
    const ask = (m) => getJson("/ui/api/range?" + query({ metric: m, step: "auto" }));
    const requests = CHARTS.map((def) => Promise.all([Promise.all(def.metrics.map(ask)),
      def.ref && known.has(def.ref.metric) ? ask(def.ref.metric).then((r) => [r]) : null]));
    const results = await Promise.all(requests);
    if (seq !== loadSeq) return;
    for (const c of api.charts) c.destroy();
    api.charts = [];
    box.textContent = "";
    data = [];
    const first = results[0][0][0];
    const rangeS = [first.start_ns / 1e9, first.end_ns / 1e9];
    axis[0] = rangeS[0];
    axis[1] = rangeS[1];
    stepS = first.step_s;
    $("#range-label").textContent = stamp(rangeS[0]) + " – " + (isLive() ? "now" : stamp(rangeS[1])) + " · step " + stepS + " s";
    renderHeader(first.simulated || (meta && meta.simulated));
    if (typeof uPlot === "undefined") {
      showMessage("The chart library is missing: run `make web` (npm ci --prefix src/gpuscope/web --omit=dev --no-audit --no-fund).");
      api.renderedAt = performance.now();
      return;
    }
    let pending = CHARTS.length;
    const done = () => { if (--pending === 0) api.renderedAt = performance.now(); };
    CHARTS.forEach((def, i) => {
      const d = align(results[i][0], keys);
      for (let j = 1; j < d.length; j++) d[j] = d[j].map((v) => scaled(def, v));
      const refs = refColumns(def, results[i][1], keys, d[0]);
      for (const r of refs) d.push(r.values);
      data.push(d);
      const cbox = el("div", "chart");
      box.appendChild(cbox);
      let fired = false;
      api.charts.push(makeChart(def, cbox, d, keys, refs, seq, () => { if (!fired) { fired = true; done(); } }));
      if (!d[0].length) cbox.appendChild(el("div", "empty", "No data in this range yet."));
    });
    alignTimeline();
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
  // The lanes' tracks lie exactly under the charts' plot areas: a time is at the same x in both.
  function alignTimeline() {
    const c = api.charts[0], box = $("#timeline");
    if (!c || !c.over.isConnected) return;
    const over = c.over.getBoundingClientRect(), at = box.getBoundingClientRect();
    box.style.setProperty("--track-left", (over.left - at.left).toFixed(2) + "px");
    box.style.setProperty("--track-width", over.width.toFixed(2) + "px");
  }
  // Bands and markers sit on the shared axis; placeAll() moves them when the axis moves (live).
  function place(node, a, b) {
    const [t0, t1] = axis, span = Math.max(1e-9, t1 - t0);
    if (b === undefined) {
      node.hidden = a < t0 || a > t1;
      node.style.left = ((a - t0) / span * 100).toFixed(3) + "%";
      return;
    }
    const lo = Math.max(a, t0), hi = Math.min(b, t1);
    node.hidden = hi <= lo && !(a === b && a >= t0 && a <= t1);
    const left = (lo - t0) / span * 100;
    node.style.left = left.toFixed(3) + "%";
    node.style.width = Math.min(100 - left, Math.max(0.2, (hi - lo) / span * 100)).toFixed(3) + "%";
  }
  function placeAll() { for (const [node, a, b] of placed) place(node, a, b); }
  function legendItem(legend, color, text, cls) {
    const item = el("span", cls), sw = el("i");
    sw.style.background = color;
    item.append(sw, document.createTextNode(text));
    legend.appendChild(item);
  }
  function renderTimeline(tl) {
    const box = $("#timeline");
    box.textContent = "";
    placed = [];
    const kinds = new Set();
    for (const key of gpuKeys()) {
      const lane = el("div", "lane"), track = el("div", "track"), name = el("span", "name", key);
      name.title = key;
      lane.append(name, track);
      for (const s of tl.spans.filter((s) => s.gpu_key === key)) {
        const d = el("div", "span");
        d.style.background = VERDICT_COLORS[s.kind] || UNKNOWN_VERDICT_COLOR;
        d.dataset.kind = s.kind;
        d.dataset.start = s.start_ns / 1e9;  // seconds, for a reader of the page (tests)
        d.dataset.end = s.end_ns / 1e9;
        d.title = s.kind.replace(/_/g, " ") + ": " + s.summary;
        placed.push([d, s.start_ns / 1e9, s.end_ns / 1e9]);
        track.appendChild(d);
        kinds.add(s.kind);
      }
      for (const e of tl.events.filter((e) => e.gpu_key === key && !e.kind.startsWith("process_"))) {
        const d = el("div", "event");
        d.style.background = EVENT_COLORS[e.kind] || "#888";
        d.dataset.kind = e.kind;
        d.title = e.message;
        placed.push([d, e.time_ns / 1e9]);
        track.appendChild(d);
      }
      box.appendChild(lane);
    }
    placeAll();
    alignTimeline();
    if (!tl.spans.length) box.appendChild(el("div", "muted", "No diagnosis for this range yet (it needs samples)."));
    const legend = $("#legend");
    legend.textContent = "";
    for (const k of kinds) legendItem(legend, VERDICT_COLORS[k] || UNKNOWN_VERDICT_COLOR, k.replace(/_/g, " "));
    legendItem(legend, "", "no data", "muted nodata");
    for (const [k, c] of Object.entries(EVENT_COLORS)) legendItem(legend, c, k.replace(/_/g, " ") + " marker", "muted marker");
  }

  // -- live updates ----------------------------------------------------------------------------------
  function onOverview(ov) {
    api.overview = ov;
    api.live++;
    renderHeader(ov.simulated);
    renderCards(ov);
    renderProcesses(ov);
    renderAlerts(ov.alerts || {}, ov.time_ns / 1e9);
    if (!isLive() || !api.charts.length) return;
    const t = ov.time_ns / 1e9, keys = gpuKeys(), byKey = new Map(ov.gpus.map((g) => [g.key, g]));
    if (t <= axis[1]) return;
    const span = axis[1] - axis[0];
    axis[0] = t - span;  // the one axis moves: charts and bands together
    axis[1] = t;
    CHARTS.forEach((def, i) => {
      const d = data[i], u = api.charts[i];
      if (!d || !u) return;
      const last = d[0].length ? d[0][d[0].length - 1] : -Infinity;
      if (t - last >= stepS * 0.999) {  // keep the query's resolution: at most one point per step
        d[0].push(t);
        keys.forEach((k, j) => {
          const g = byKey.get(k);
          let v = null;
          if (g) for (const m of def.metrics) { const x = g.values[m]; if (x !== null && x !== undefined) v = (v || 0) + x; }
          d[j + 1].push(scaled(def, v));
        });
        u.gpuscope.refKeys.forEach((k, j) => {
          const g = k === null ? keys.map((x) => byKey.get(x)).find((x) => x && x.values[def.ref.metric] != null) : byKey.get(k);
          const v = g ? g.values[def.ref.metric] : null;
          d[keys.length + 1 + j].push(v === undefined ? null : v);
        });
        let drop = 0;
        while (drop < d[0].length && d[0][drop] < axis[0]) drop++;
        drop = Math.max(drop, d[0].length - LIVE_TRIM);
        if (drop > 0) for (const col of d) col.splice(0, drop);
      }
      u.setData(d);
    });
    placeAll();
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
    // the window's own verdicts and findings, and why it was taken when the agent started it (/api/v1/autotrace)
    const auto = await getJson("/api/v1/autotrace").catch(() => null);
    const w = auto && (auto.windows || []).find((x) => x.id === last.id && x.pid === last.pid);
    const line = $("#kernels-verdict");
    line.hidden = !w;
    if (w) {
      const verdicts = (w.verdicts || []).map((v) => "GPU " + v.gpu + " " + v.kind).join(", ");
      const rules = [...new Set((w.findings || []).map((f) => f.rule))].join(", ");
      line.textContent = "Verdict of this window: " + (verdicts || "none") + (rules ? "; findings: " + rules : "") +
        (w.trigger ? "; started by the agent: " + w.trigger : "");
    }
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
    // A narrower window, or a scroll bar that appears: the charts follow their column, the lanes follow the charts.
    let resizeTimer = 0, width = $("#charts").clientWidth;
    new ResizeObserver(() => {
      const w = $("#charts").clientWidth;
      if (w === width) return;
      width = w;
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => {
        for (const c of api.charts) c.setSize({ width: chartWidth(c.root.parentNode), height: CHART_HEIGHT });
        alignTimeline();
      }, 100);
    }).observe($("#charts"));
  }

  start();
})();
