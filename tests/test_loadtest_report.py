"""The load-test HTML report: real headless Chromium loads it without script errors and every plot has
data; a run without GPU data says why; a million requests stay a small file with the tail kept."""

from __future__ import annotations

import json
import random
import re
import subprocess
from html import unescape
from html.parser import HTMLParser

import pytest

from gpuscope.loadtest.capacity import find_capacity
from gpuscope.loadtest.gpu import join_stages
from gpuscope.loadtest.records import GpuReading, RequestRecord
from gpuscope.loadtest.report import _bucket, _edges, render, write_html


def _pct(ms: float) -> dict:
    return {"mean": ms, "p50": ms, "p90": ms * 1.5, "p95": ms * 1.8, "p99": ms * 3, "p999": ms * 5, "max": ms * 9}


def _stats(rate: float, streaming: bool) -> dict:
    s = {"requests": int(rate * 10), "completed": int(rate * 10) - 2, "errors": {"http_5xx": 1, "timeout": 1},
         "late": 0, "request_throughput": rate * 0.98, "latency_ms": _pct(40), "service_latency_ms": _pct(38),
         "goodput": rate * 0.9, "slo_attainment": 0.92}
    if streaming:
        s.update({"ttft_ms": _pct(20), "ttst_ms": _pct(5), "tpot_ms": _pct(4), "chunk_gap_ms": _pct(4),
                  "e2e_ms": _pct(40), "input_tokens": 1000, "output_tokens": 5000, "output_throughput": 500.0,
                  "total_token_throughput": 600.0})
    return s


def run_data(n_stages: int = 3, per_stage: int = 400, streaming: bool = True, gpu: bool = True,
             valid: bool = True, seed: int = 1) -> tuple[dict, list[RequestRecord], list[GpuReading]]:
    """A synthetic 3-stage step ladder: summary, records (a 1 s stall in stage 2), GPU readings at 10 Hz."""
    rng = random.Random(seed)
    stages, recs = [], []
    for k in range(n_stages):
        t0, t1, rate = k * 10.0, (k + 1) * 10.0, 10.0 * (k + 1)
        stages.append({"index": k, "name": f"step {rate:g}/s", "start_s": t0, "end_s": t1, "target_rate": rate,
                       "concurrency": None, "stats": _stats(rate, streaming)})
        for j in range(per_stage):
            ti = t0 + (t1 - t0) * j / per_stage
            sent = ti + rng.uniform(0, 0.001)
            lat = rng.gauss(0.05, 0.005) + (1.0 if k == 1 and j == per_stage // 2 else 0.0)
            err = "http_5xx" if j % 97 == 5 else ("timeout" if j % 131 == 7 else None)
            r = RequestRecord(i=len(recs), stage=k, worker=0, t_intended=ti, t_sent=sent,
                              t_end=None if err == "timeout" else sent + lat, status=500 if err == "http_5xx" else 200,
                              error=err)
            if streaming and err is None:
                n = 20
                r.chunk_times = [sent + 0.02 + (lat - 0.02) * i / (n - 1) for i in range(n)]
                r.output_tokens = n
            recs.append(r)
    summary = {"tool": "gpuscope loadtest", "version": 1, "url": "http://127.0.0.1:8000/v1/chat/completions",
               "protocol": "openai-chat" if streaming else "http", "metrics_as": "aiperf",
               "clock": {"wall_s": 1.7e9, "mono_s": 100.0}, "duration_s": n_stages * 10.0,
               "valid": valid, "invalid_reasons": [] if valid else ["the client used 98 % of its CPU <script>"],
               "client": {"workers": 2, "cpu_percent": 30.0, "loop_lag_ms": {"p50": 0.1, "p99": 0.5, "max": 2},
                          "send_lag_ms": {"p50": 0.1, "p99": 0.6, "max": 3}, "late": 0, "late_threshold_ms": 10},
               "slo": {"e2e": 0.1}, "names": {"chunk_gap_ms": "ICL", "tpot_ms": "ITL"},
               "stages": stages, "overall": _stats(20.0, streaming)}
    readings = []
    if gpu:
        for i in range(n_stages * 100):
            for g in ("0", "1"):
                t = i * 0.1
                readings.append(GpuReading(t=t, gpu=g, sm_active=0.2 + 0.2 * (t // 10), nvml_util=1.0,
                                           mem_used_frac=0.5, power_w=200 + 100 * (t // 10), energy_j=1000 + 300 * t,
                                           throttle="sw_power_cap" if t > 25 else None, source="simulated (healthy)"))
    join_stages(summary, readings, source="simulated (healthy) (2 GPUs, every 95 ms)" if gpu else
                "no GPU data: this host's GPUs could not be read (No NVIDIA driver was found)")
    return summary, recs, readings


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.plots: dict[str, dict[str, str]] = {}
        self.canvases: dict[str, int] = {}
        self.body: dict[str, str] = {}
        self._in: str | None = None
        self._depth = 0

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        if tag == "div" and a.get("class") == "plot":
            self._in, self._depth = a["id"], 0
            self.plots[a["id"]] = a
        if self._in and tag == "div":
            self._depth += 1
        if self._in and tag == "canvas":
            self.canvases[self._in] = self.canvases.get(self._in, 0) + 1

    def handle_endtag(self, tag):
        if self._in and tag == "div":
            self._depth -= 1
            if self._depth == 0:
                self._in = None


def _chromium_dom(chromium: str, path, tmp_path) -> tuple[_Page, str]:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--enable-logging=stderr",
           "--v=0", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,3000", "--dump-dom", path.as_uri()]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    page = _Page()
    page.feed(run.stdout)
    return page, run.stderr


def _console_errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]


def test_chromium_renders_every_plot_with_data_and_no_errors(tmp_path, chromium):
    summary, recs, readings = run_data()
    summary["capacity"] = find_capacity(
        lambda r: {"requests": 100, "errors": {}, "request_throughput": min(r, 70.0), "slo_attainment": 0.99,
                   "latency_ms": {"p99": 30.0}}, {"e2e": 0.1}, start_rate=10, max_rate=1000)
    path = tmp_path / "report.html"
    write_html(str(path), summary, recs, readings)
    page, stderr = _chromium_dom(chromium, path, tmp_path)
    assert "data-errors" not in page.body, page.body.get("data-errors")
    assert not _console_errors(stderr), _console_errors(stderr)
    want = {"plot-capacity", "plot-latency", "plot-percentiles", "plot-throughput", "plot-errors", "plot-ttft", "plot-tpot",
            "plot-gpu_sm", "plot-gpu_util", "plot-gpu_mem", "plot-gpu_power", "plot-gpu_throttle"}
    assert set(page.plots) == want
    assert int(page.body["data-rendered"]) == len(want)
    for pid, attrs in page.plots.items():
        assert int(attrs["data-points"]) > 0, pid
        assert page.canvases.get(pid, 0) >= 1, pid  # uPlot drew it


def test_report_content_tables_names_verdict_and_escaping(tmp_path):
    summary, recs, readings = run_data(valid=False)
    html = render(summary, recs, readings)
    assert "INVALID run" in html and "98 % of its CPU &lt;script&gt;" in html and "<script>\n" not in html[:2000]
    # metric names as --metrics-as aiperf calls them
    assert "<th>ITL p50</th>" in html and "<th>ICL p99</th>" in html and "<th>TPOT" not in html
    assert "<th>J/request</th>" in html and "sw_power_cap" in html
    data = json.loads(re.search(r"id='loadtest-data'>(.*?)</script>", html, re.S).group(1).replace("<\\/", "</"))
    lat = next(p for p in data["plots"] if p["id"] == "latency")
    i_max = lat["series"].index("max from intended") + 1
    assert max(v for v in lat["data"][i_max] if v is not None) > 1000  # the 1 s stall survives bucketing
    thr = next(p for p in data["plots"] if p["id"] == "throughput")
    assert thr["data"][0] == [10.0, 20.0, 30.0]
    assert [s["name"] for s in data["stages"]] == ["0 step 10/s", "1 step 20/s", "2 step 30/s"]
    assert "uPlot" in html  # the chart library is inlined, nothing fetched
    assert not re.search(r"<(script|link)[^>]+(src|href)=", html)


def test_no_gpu_data_says_why(tmp_path, chromium):
    summary, recs, readings = run_data(gpu=False, streaming=False)
    path = tmp_path / "r.html"
    write_html(str(path), summary, recs, readings)
    html = unescape(path.read_text())
    assert "No GPU data: this host's GPUs could not be read (No NVIDIA driver was found)" in html
    assert "plot-gpu" not in html and "<th>J/request</th>" not in html
    page, stderr = _chromium_dom(chromium, path, tmp_path)
    assert "data-errors" not in page.body and not _console_errors(stderr)
    assert set(page.plots) == {"plot-latency", "plot-percentiles", "plot-throughput", "plot-errors"}
    assert all(int(a["data-points"]) > 0 for a in page.plots.values())


def test_no_completed_requests_still_renders():
    summary, recs, readings = run_data(gpu=False, streaming=False)
    for r in recs:
        r.t_end, r.error = None, "connect"
    html = render(summary, recs, [])
    assert "No request completed: there is no latency to plot." in html
    html = render({"stages": [], "overall": {}}, [], [])
    assert "No GPU data: no GPU readings were taken during this run." in html


def test_a_million_requests_stay_small_and_keep_the_tail(tmp_path):
    rng = random.Random(5)
    n = 1_000_000
    recs = [RequestRecord(i=i, stage=0, worker=0, t_intended=i * 1e-4, t_sent=i * 1e-4,
                          t_end=i * 1e-4 + (2.5 if i == 777_777 else 0.01 + rng.random() * 0.01), status=200)
            for i in range(n)]
    summary = {"url": "http://x", "duration_s": 100.0, "valid": True, "stages": [
        {"index": 0, "name": "constant", "start_s": 0.0, "end_s": 100.0, "target_rate": 10_000.0,
         "stats": {"requests": n, "request_throughput": 1e4}}], "overall": {"requests": n}}
    path = tmp_path / "big.html"
    write_html(str(path), summary, recs, [])
    size = path.stat().st_size
    assert size < 2_000_000, size
    html = path.read_text()
    data = json.loads(re.search(r"id='loadtest-data'>(.*?)</script>", html, re.S).group(1).replace("<\\/", "</"))
    lat = next(p for p in data["plots"] if p["id"] == "latency")
    assert len(lat["data"][0]) <= 600
    assert max(v for v in lat["data"][3] if v is not None) == pytest.approx(2500.0, abs=1)
    curve = next(p for p in data["plots"] if p["id"] == "percentiles")
    assert curve["data"][1][-1] == pytest.approx(2500.0, abs=1)  # the 1-in-a-million request ends the curve


def test_bucket_quantiles_and_empty_buckets():
    import numpy as np

    t = np.array([0.1, 0.2, 0.3, 0.4, 2.5])
    v = np.array([4.0, 1.0, 3.0, 2.0, 9.0])
    b = _bucket(t, v, _edges(0.0, 3.0, 3))
    assert b["p50"] == [2.0, None, 9.0] and b["max"] == [4.0, None, 9.0] and b["p99"] == [4.0, None, 9.0]
    assert b["mean"] == [2.5, None, 9.0] and b["count"] == [4.0, 0.0, 1.0]


def test_closed_loop_stages_plot_throughput_against_concurrency():
    summary, recs, readings = run_data(gpu=False, streaming=False)
    for k, st in enumerate(summary["stages"]):
        st["target_rate"], st["concurrency"] = None, 4 * (k + 1)
    html = render(summary, recs, [])
    data = json.loads(re.search(r"id='loadtest-data'>(.*?)</script>", html, re.S).group(1).replace("<\\/", "</"))
    thr = next(p for p in data["plots"] if p["id"] == "throughput")
    assert thr["xlabel"] == "concurrency" and thr["data"][0] == [4.0, 8.0, 12.0]
    assert "offered (ideal)" not in thr["series"]  # no offered rate to compare with in a closed loop
    assert "<td class=num>4 conc.</td>" in html
