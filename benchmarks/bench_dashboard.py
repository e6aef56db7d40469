"""Time to the dashboard's first full render over 24 h of 8-GPU history, against plotly.js drawing the same data.

Builds a store with 24 h of synthetic 8-GPU data (bench_store_data's signals, GPU series thinned to
1 Hz, processes at 1 Hz) written through Store.append_batch, starts a real simulated agent on it,
then loads /ui/?start=-24h in the Debian headless Chromium N times and reads
`window.gpuscope.renderedAt` (ms from navigation start to the last chart drawn). The peer, in the
same run and browser: a page that fetches the same /ui/api/range answers and draws the same 9
charts with plotly.js (`pip install plotly` for this benchmark only; it is no dependency).

    python benchmarks/bench_dashboard.py [--runs 10] [--hours 24]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import bench_store_data as data  # noqa: E402

from gpuscope.store import Store  # noqa: E402

# The dashboard's charts (app.js CHARTS), for the peer page (without their dashed reference lines).
CHARTS = [["gpu_sm_active_ratio"], ["gpu_tensor_active_ratio"], ["gpu_dram_active_ratio"], ["gpu_utilization_ratio"],
          ["gpu_sm_clock_hertz"], ["gpu_power_watts"], ["gpu_memory_used_bytes"], ["gpu_temperature_celsius"],
          ["gpu_pcie_rx_bytes_per_second", "gpu_pcie_tx_bytes_per_second"],
          ["gpu_nvlink_rx_bytes_per_second", "gpu_nvlink_tx_bytes_per_second"]]

PEER_PAGE = """<!doctype html><html><head><meta charset="utf-8"><script src="/peer/plotly.min.js"></script></head>
<body style="margin:0"><div id="c"></div><script>
(async function () {
  const charts = %s;
  const answers = await Promise.all(charts.map((ms) => Promise.all(ms.map((m) =>
    fetch("/ui/api/range?start=-24h&end=now&step=auto&metric=" + m).then((r) => r.json())))));
  const box = document.getElementById("c");
  for (let i = 0; i < charts.length; i++) {
    const sum = new Map();
    for (const res of answers[i]) for (const s of res.series) {
      const m = sum.get(s.gpu_key) || new Map(); sum.set(s.gpu_key, m);
      s.timestamps_ns.forEach((t, j) => { if (s.values[j] !== null) m.set(t, (m.get(t) || 0) + s.values[j]); });
    }
    const traces = [...sum.entries()].map(([k, m]) => ({ name: k, type: "scatter", mode: "lines",
      x: [...m.keys()].map((t) => new Date(t / 1e6)), y: [...m.values()] }));
    const d = document.createElement("div"); box.appendChild(d);
    await Plotly.newPlot(d, traces, { width: 680, height: 240, margin: { t: 24, l: 60, r: 10, b: 30 } });
  }
  window.peerRenderedAt = performance.now();
})();
</script></body></html>"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_store(path: Path, hours: float) -> None:
    end_ns = time.time_ns()
    nd = data.NodeData(data.template(8), end_ns - int(hours * 3600e9))
    ngpu_series = {id(series) for series, _ in nd.gpus}
    first = id(nd.gpus[0][0])
    with Store(path, flush_interval=3600.0) as store:
        for series, t, v in nd.blocks(hours * 3600, block_s=600):
            if id(series) == first:  # a new block: persist the last one, as the agent's flushes would
                store.flush()
            if id(series) in ngpu_series:  # GPUs at 1 Hz: what the 1 s rollup would hold anyway
                t, v = t[::10].copy(), v[::10].copy()
            store.append_batch(series, t, v)
        store.flush()
        stats = store.stats()
    print(f"store: {stats['samples'] if 'samples' in stats else '?'} raw samples, oldest "
          f"{(end_ns - (stats['oldest_ns'] or end_ns)) / 3600e9:.1f} h ago")


def wait_ready(port: int, proc: subprocess.Popen) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            raise SystemExit(f"the agent exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/status", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the agent did not come up")


def measure(page, url: str, mark: str) -> float:
    page.goto(url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        v = page.evaluate(f"window.{mark}")
        if v:
            return float(v)
        time.sleep(0.02)
    raise SystemExit(f"{url} did not finish rendering within 60 s")


def measure_ui(page, url: str) -> tuple[float, float]:
    """(charts drawn, diagnosis timeline drawn too), ms from navigation start."""
    charts = measure(page, url, "gpuscope.renderedAt")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        v = page.evaluate("window.gpuscope.timelineAt")
        if v:
            return charts, float(v)
        time.sleep(0.02)
    raise SystemExit(f"{url}: the diagnosis timeline did not come within 60 s")


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q, method="inverted_cdf"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--keep", metavar="DIR", help="build the store in DIR once and reuse it in later runs")
    args = ap.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("chromium is not installed (Debian: apt-get install chromium).")
    from playwright.sync_api import sync_playwright

    try:
        import plotly
        plotly_js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    except ImportError:
        plotly_js = None
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpuscope-bench-dash-"))
    if args.keep and (tmp / "store").exists():
        print(f"store: reusing {tmp / 'store'} (its newest data is as old as the store)")
    else:
        t0 = time.monotonic()
        build_store(tmp / "store", args.hours)
        print(f"store: {args.hours:g} h of 8 GPUs + processes built in {time.monotonic() - t0:.0f} s")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    agent = subprocess.Popen([sys.executable, "-m", "gpuscope.cli", "agent", "--simulate", "mixed", "--gpus", "8",
                              "--processes", "100", "--port", str(port), "--data-dir", str(tmp)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, agent)
        base = f"http://127.0.0.1:{port}"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            both = [measure_ui(page, base + "/ui/?start=-24h") for _ in range(args.runs + 1)]
            cold, both = both[0], both[1:]  # the first load after the agent started: nothing cached yet
            ui = [c for c, _ in both]
            full = [t for _, t in both]
            points = page.evaluate("window.gpuscope.charts.map(c => c.data[0].length)")
            series = page.evaluate("window.gpuscope.charts.map(c => c.data.length - 1)")
            print(f"gpuscope (uPlot): {args.runs} loads of /ui/?start=-24h, {len(points)} charts x {series[0]} GPUs x "
                  f"~{max(points)} points: charts drawn p50 {pct(ui, 50):.0f} ms, p95 {pct(ui, 95):.0f} ms (goal p95 <= 1000 ms)")
            print(f"  with the day's diagnosis timeline drawn too: p50 {pct(full, 50):.0f} ms, p95 {pct(full, 95):.0f} ms")
            print(f"  the first load (the agent's timeline cache empty): charts {cold[0]:.0f} ms, "
                  f"with the timeline {cold[1]:.0f} ms")
            if plotly_js is None or not plotly_js.is_file():
                print("peer skipped: pip install plotly (benchmark only) to compare with plotly.js")
            else:
                page.route(base + "/peer/plotly.min.js", lambda r: r.fulfill(path=str(plotly_js),
                                                                             content_type="application/javascript"))
                page.route(base + "/peer/", lambda r: r.fulfill(body=PEER_PAGE % json.dumps(CHARTS),
                                                                content_type="text/html"))
                peer = [measure(page, base + "/peer/", "peerRenderedAt") for _ in range(args.runs + 1)][1:]
                print(f"peer (plotly.js {plotly.__version__}'s bundle, same data, same browser): "
                      f"p50 {pct(peer, 50):.0f} ms, p95 {pct(peer, 95):.0f} ms")
                print(f"ratio gpuscope / peer: p50 {pct(ui, 50) / pct(peer, 50):.2f}, p95 {pct(ui, 95) / pct(peer, 95):.2f}")
            browser.close()
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
