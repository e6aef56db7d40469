"""Soak: one real agent on a simulated 8-GPU node whose 100 processes churn, used for a long time the way a
node is used, while its RSS, open files, threads and store are sampled: is it flat, and where does it grow?

The 1-hour soak (the reliability issue's run; about 61 minutes of wall time with start and stop):

    .venv/bin/python benchmarks/soak.py --duration 1h --out soak-1h

Quicker checks of the script, a control without churn (the series then stop growing once every GPU's
are there), and where the Python heap grew (the agent under tracemalloc: slower, for finding a leak):

    .venv/bin/python benchmarks/soak.py --duration 5m
    .venv/bin/python benchmarks/soak.py --duration 1h --churn 0 --out soak-1h-control
    .venv/bin/python benchmarks/soak.py --duration 1h --tracemalloc --out soak-1h-tracemalloc
    .venv/bin/python benchmarks/soak.py --duration 1h --heap --out soak-1h-heap   # which allocator grows (cheap)

What runs, all on 127.0.0.1 (nothing is sent anywhere else; the agent binds to loopback):
  - `python -m gpuscope agent --simulate mixed --gpus 8 --processes 100 --churn 60` with a config file whose
    retention is soak-sized (raw 10 min, 1 s rollups 30 min, max_size 256 MiB: see RETENTION), in a fresh
    data directory;
  - a Prometheus-style scraper: GET /metrics and /metrics?naming=dcgm every second (keep-alive);
  - two dashboards: each GET /ui/api/overview every second, a live SSE stream (/ui/api/stream) read as it
    comes, the timeline every 15 s, the charts' /ui/api/range every minute, the kernels every 30 s;
  - events: POST /api/v1/events (kind guard, with the agent's token) every 3 s;
  - API: /api/v1/query_range and /api/v1/diagnose (in-memory window) every 30 s, a stored-range diagnose
    every 5 min;
  - traces on demand: this script opts in as a traced process (trace/ondemand.py's file protocol), asks the
    agent for a trace every minute (POST /api/v1/trace) and answers it with one of the checked-in fixture
    traces (tests/fixtures/traces), which the agent ingests into its kernel series.
Every --sample (10 s) it records the agent's RSS, open fds, threads and CPU (psutil), the store directory's
bytes on disk, /api/v1/status's store figures, and the store's series by kind read from its SQLite file
(read-only): gpu_* (device), gpu_process_* and process_* (one set per pid: churn adds them), gpu_kernel_*
(traces), host_*, gpuscope_* (self), and the events by kind.

At the end (or on Ctrl-C) it stops the agent (SIGTERM, then SIGKILL after 30 s), writes to --out
samples.csv, samples.json, soak.svg (RSS, store, series, fds/threads over time) and summary.json, prints a
report and, last, one JSON line (the summary, for BENCHMARKS.md). The RSS slope is a least-squares fit after a
warm-up (a third of the run, at least 25 min: the sampler's 5 min of in-memory history and the store's hot
window of 10-20 min fill first; at most 60 % of a short run), in MB/h (MB = 10^6 bytes); the goal is <= 5 MB/h.
A run shorter than ~40 min therefore measures the filling, not the leak; use it to check the script.
Exit status: 0 when the run completed (whatever it found), 1 when the agent died or never started, 2 for
a bad flag, 130 when interrupted (the outputs are written for the part that ran). If this script is killed
outright, the agent gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and its data directory stays in /tmp.
"""

from __future__ import annotations

import argparse
import csv
import http.client
import json
import math
import os
import random
import secrets
import shutil
import signal
import socket
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from html import escape
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

from gpuscope.agent.config import parse_size  # noqa: E402
from gpuscope.report.svg import Axis, Band, Line, panel  # noqa: E402
from gpuscope.timeparse import parse_duration  # noqa: E402
from gpuscope.trace import ondemand as od  # noqa: E402

HOST = "127.0.0.1"  # the only address this script ever talks to
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "traces")
MB = 1e6
GOAL_RSS_MB_PER_H = 5.0

# Soak-sized retention: short enough that raw retention acts within the hour (a raw block is 10 min; it is
# dropped once it is older than `raw` and rolled into 1 s), realistic in shape. The 1 s tier is kept until
# its 1 min rollup (6 h blocks) exists, so within an hour its age limit cannot act: it grows all run.
RETENTION = {"raw": "10m", "rollup_1s": "30m", "rollup_1m": "6h", "rollup_1h": "7d", "max_size": "256MiB"}
RAW_BLOCK_S = 600.0
# What fills on purpose before the agent can be flat: the sampler's in-memory history (3000 snapshots at
# 100 ms: 5 min) and the store's hot window (raw samples stay in memory until their 10 min block is sealed
# and they are 10 min old: 10 to 20 min). The fits start after both.
WARMUP_S = 25 * 60.0

KINDS = ("gpu", "process", "kernel", "host", "self", "other")


def kind_of(metric: str) -> str:
    """The series' family: per-process series (GPU side gpu_process_*, host side process_*: one set per pid),
    per-kernel (traces), per-GPU, host, the agent's own."""
    if metric.startswith(("gpu_process_", "process_")):
        return "process"
    if metric.startswith("gpu_kernel_"):
        return "kernel"
    if metric.startswith("gpu_"):
        return "gpu"
    if metric.startswith("host_"):
        return "host"
    if metric.startswith("gpuscope_"):
        return "self"
    return "other"


# -- traffic -------------------------------------------------------------------------------------------
class Stats:
    """Per request name: count, failures (non-2xx or an exception), the last failure, and the latencies of
    the current sample window (cleared each sample)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self.last_error: dict[str, str] = {}
        self.window: dict[str, list[float]] = {}
        self.all: dict[str, list[float]] = {}

    def record(self, name: str, seconds: float, ok: bool, error: str = "") -> None:
        with self.lock:
            self.n[name] = self.n.get(name, 0) + 1
            self.window.setdefault(name, []).append(seconds)
            lat = self.all.setdefault(name, [])
            if len(lat) < 200_000:
                lat.append(seconds)
            if not ok:
                self.failed[name] = self.failed.get(name, 0) + 1
                self.last_error[name] = error[:300]

    def take_window(self) -> dict[str, list[float]]:
        with self.lock:
            w, self.window = self.window, {}
        return w


class Client:
    """One keep-alive HTTP connection to the agent, reopened after any failure."""

    def __init__(self, port: int, stats: Stats, timeout: float = 30.0) -> None:
        self.port, self.stats, self.timeout = port, stats, timeout
        self.conn: http.client.HTTPConnection | None = None

    def request(self, name: str, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        t0 = time.monotonic()
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection(HOST, self.port, timeout=self.timeout)
            self.conn.request(method, path, body=body, headers=headers or {})
            resp = self.conn.getresponse()
            data = resp.read()
            ok = 200 <= resp.status < 300
            self.stats.record(name, time.monotonic() - t0, ok, f"{resp.status} {data[:200]!r}" if not ok else "")
            return resp.status, data
        except (OSError, http.client.HTTPException) as e:
            self.stats.record(name, time.monotonic() - t0, False, f"{type(e).__name__}: {e}")
            self.close()
            return 0, b""

    def get(self, name: str, path: str) -> tuple[int, bytes]:
        return self.request(name, "GET", path, headers={"Accept": "application/json"})

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class Periodic(threading.Thread):
    """Runs tasks (period_s, fn) on their own grid until `stop`; a late task skips the slots it missed."""

    def __init__(self, name: str, stop: threading.Event, tasks: list[tuple[float, Callable[[], object]]],
                 first_delay: float = 0.0) -> None:
        super().__init__(name=name, daemon=True)
        self.stop, self.tasks, self.first_delay = stop, tasks, first_delay
        self.crashed: str | None = None

    def run(self) -> None:
        start = time.monotonic() + self.first_delay
        due = [start] * len(self.tasks)
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                for i, (period, fn) in enumerate(self.tasks):
                    if now >= due[i]:
                        fn()
                        due[i] += period * max(1, math.floor((time.monotonic() - due[i]) / period) + 1)
                self.stop.wait(max(0.0, min(due) - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - reported in the summary; the soak goes on without it
            self.crashed = f"{type(e).__name__}: {e}"


class SseReader(threading.Thread):
    """A dashboard's live stream: reads /ui/api/stream as it comes, reconnects after a drop."""

    def __init__(self, name: str, port: int, stop: threading.Event, stats: Stats) -> None:
        super().__init__(name=name, daemon=True)
        self.port, self.stop, self.stats = port, stop, stats
        self.events = 0
        self.bytes = 0
        self.reconnects = 0
        self.conn: http.client.HTTPConnection | None = None

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                self.conn = http.client.HTTPConnection(HOST, self.port, timeout=20)
                self.conn.request("GET", "/ui/api/stream?interval=1s", headers={"Accept": "text/event-stream"})
                resp = self.conn.getresponse()
                if resp.status != 200:
                    self.stats.record("sse_connect", time.monotonic() - t0, False, f"{resp.status}")
                    resp.read()
                else:
                    self.stats.record("sse_connect", time.monotonic() - t0, True)
                    while not self.stop.is_set():
                        line = resp.readline()
                        if not line:
                            break
                        self.bytes += len(line)
                        if line.startswith(b"event:"):
                            self.events += 1
            except (OSError, http.client.HTTPException, ValueError, AttributeError) as e:
                if not self.stop.is_set():
                    self.stats.record("sse_connect", time.monotonic() - t0, False, f"{type(e).__name__}: {e}")
            finally:
                if self.conn is not None:
                    self.conn.close()
            if not self.stop.is_set():
                self.reconnects += 1
                self.stop.wait(2.0)

    def close(self) -> None:
        conn = self.conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


CHART_METRICS = ("gpu_sm_active_ratio", "gpu_tensor_active_ratio", "gpu_dram_active_ratio", "gpu_utilization_ratio",
                 "gpu_memory_used_bytes", "gpu_power_watts", "gpu_temperature_celsius",
                 "gpu_pcie_rx_bytes_per_second", "gpu_pcie_tx_bytes_per_second")


def dashboard_tasks(c: Client) -> list[tuple[float, Callable[[], object]]]:
    def charts() -> None:
        for m in CHART_METRICS:
            c.get("ui_range", f"/ui/api/range?metric={m}&step=auto")

    return [(1.0, lambda: c.get("ui_overview", "/ui/api/overview")),
            (15.0, lambda: c.get("ui_timeline", "/ui/api/timeline")),
            (30.0, lambda: c.get("traces_list", "/api/v1/traces")),
            (60.0, charts)]


def scrape_tasks(c: Client) -> list[tuple[float, Callable[[], object]]]:
    return [(1.0, lambda: c.request("metrics", "GET", "/metrics", headers={"Accept": "text/plain;version=0.0.4"})),
            (1.0, lambda: c.request("metrics_dcgm", "GET", "/metrics?naming=dcgm",
                                    headers={"Accept": "text/plain;version=0.0.4"}))]


def event_tasks(c: Client, token: str) -> list[tuple[float, Callable[[], object]]]:
    rng = random.Random(3)
    seq = [0]

    def post() -> None:
        seq[0] += 1
        typ = rng.choice(["breaker_open", "breaker_closed", "shedding_started", "shedding_stopped"])
        ev = {"kind": "guard", "type": typ, "severity": "warning" if "open" in typ or "started" in typ else "info",
              "message": f"soak event {seq[0]}: {typ}", "source": "guard@soak",
              "labels": {"route": rng.choice(["/v1/chat", "/v1/embed"]), "seq": str(seq[0] % 100)}}
        c.request("events_post", "POST", "/api/v1/events", body=json.dumps(ev).encode(),
                  headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})

    return [(3.0, post)]


def api_tasks(c: Client) -> list[tuple[float, Callable[[], object]]]:
    return [(30.0, lambda: c.get("query_range", "/api/v1/query_range?metric=gpu_sm_active_ratio&start=-10m&step=5s")),
            (30.0, lambda: c.get("query_range_proc",
                                 "/api/v1/query_range?metric=gpu_process_sm_active_ratio&start=-5m&step=30s&gpu=3")),
            (30.0, lambda: c.get("diagnose", "/api/v1/diagnose?window=30s")),
            (300.0, lambda: c.get("diagnose_range", "/api/v1/diagnose?start=-10m&end=now"))]


class TraceFeeder:
    """A process that opted in to traces on demand (this script, by the file protocol the bootstrap uses):
    every minute it asks the agent for a 2 s trace of itself and answers with a fixture trace, as a traced
    program would after its window; the agent ingests it into gpu_kernel_* series."""

    def __init__(self, c: Client, data_dir: str, token: str) -> None:
        self.c, self.token = c, token
        self.req_dir = os.path.join(data_dir, "trace-requests")
        self.trace_dir = os.path.join(data_dir, "traces")
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.fixtures = sorted(os.path.join(FIXTURES, n) for n in os.listdir(FIXTURES) if n.endswith(".pt.trace.json.gz"))
        self.fed = 0
        self.registered = False
        self.since = time.time()

    def tasks(self) -> list[tuple[float, Callable[[], object]]]:
        return [(60.0, self.ask), (1.0, self.answer)]

    def ask(self) -> None:
        if not self.registered and os.path.isdir(self.req_dir):
            od.register(self.req_dir, {"host": self.host, "pid": self.pid, "rank": None, "since_unix": self.since,
                                       "trace_dir": self.trace_dir, "max_duty": 0.05, "next_allowed_unix": None})
            self.registered = True
        if self.registered:
            self.c.request("trace_post", "POST", "/api/v1/trace", body=json.dumps({"duration": "2s",
                                                                                    "pids": [self.pid]}).encode(),
                           headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"})

    def answer(self) -> None:
        if not self.registered:
            return
        for req in od.pending_for(self.req_dir, self.pid, self.host, self.since):
            stop_ns = time.time_ns()
            start_ns = stop_ns - int(req["duration_s"] * 1e9)
            name = f"{self.host}.{self.pid}.{req['id']}.pt.trace.json.gz"
            src = self.fixtures[self.fed % len(self.fixtures)]
            tmp = os.path.join(self.trace_dir, f".tmp-soak-{secrets.token_hex(4)}")
            shutil.copyfile(src, tmp)
            os.replace(tmp, os.path.join(self.trace_dir, name))
            od.mark_done(self.req_dir, req["id"], self.host, self.pid, status="written", reason="",
                         duration_s=req["duration_s"], rank=None, cost_s=0.01, file=name,
                         profiler_start_unix_ns=start_ns, profiler_stop_unix_ns=stop_ns,
                         cpu_ops_all_threads=False, with_stack=False, cuda_visible_devices=None)
            self.fed += 1

    def close(self) -> None:
        if self.registered:
            od.unregister(self.req_dir, self.host, self.pid)


# -- measurement ---------------------------------------------------------------------------------------
def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def store_census(db: str) -> dict[str, Any]:
    """Series by kind and by metric, distinct pids, events by kind, series deleted by retention: from the
    store's SQLite file, read-only (WAL: never blocks the agent's writer)."""
    if not os.path.exists(db):
        return {}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        by_metric = dict(conn.execute("SELECT metric, COUNT(*) FROM series GROUP BY metric").fetchall())
        pids = conn.execute("SELECT COUNT(DISTINCT json_extract(labels, '$.pid')) FROM series").fetchone()[0]
        events = dict(conn.execute("SELECT kind, COUNT(*) FROM events GROUP BY kind").fetchall())
        meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('series.deleted', 'series.next')").fetchall())
    finally:
        conn.close()
    kinds = dict.fromkeys(KINDS, 0)
    for m, n in by_metric.items():
        kinds[kind_of(m)] += n
    return {"kinds": kinds, "metrics": by_metric, "pids": int(pids or 0), "events": events,
            "series_deleted": int(meta.get("series.deleted", 0)), "series_next": int(meta.get("series.next", 0))}


class Probe:
    """Every `every` seconds: the agent process (psutil), its store, its status, the traffic's latencies."""

    def __init__(self, proc: Any, port: int, data_dir: str, stats: Stats, t0: float,
                 heap_path: str | None = None) -> None:
        import psutil

        self.heap_path = heap_path
        self.ps = psutil.Process(proc.pid)
        self.client = Client(port, Stats(), timeout=60)
        self.data_dir, self.stats, self.t0 = data_dir, stats, t0
        self.store_dir = os.path.join(data_dir, "store")
        self.db = os.path.join(self.store_dir, "gpuscope.db")
        self.rows: list[dict[str, Any]] = []
        self.census: list[dict[str, Any]] = []
        self._cpu0: tuple[float, float] | None = None

    def sample(self) -> dict[str, Any]:
        now = time.monotonic()
        with self.ps.oneshot():
            mem = self.ps.memory_info()
            cpu = self.ps.cpu_times()
            fds, threads = self.ps.num_fds(), self.ps.num_threads()
        cpu_s = cpu.user + cpu.system
        cpu_ratio = None
        if self._cpu0 is not None and now > self._cpu0[0]:
            cpu_ratio = (cpu_s - self._cpu0[1]) / (now - self._cpu0[0])
        self._cpu0 = (now, cpu_s)
        status: dict[str, Any] = {}
        code, body = self.client.get("status", "/api/v1/status")
        if code == 200:
            status = json.loads(body)
        store = status.get("store", {})
        tiers = store.get("tiers", {})
        census = store_census(self.db)
        self.census.append(census)
        window = self.stats.take_window()
        scrape = window.get("metrics", [])
        raw = tiers.get("raw", {})
        newest, oldest = store.get("newest_ns"), store.get("oldest_ns")
        row = {
            "t_s": round(now - self.t0, 1), "unix": round(time.time(), 1),
            "rss_bytes": mem.rss, "vms_bytes": mem.vms, "fds": fds, "threads": threads,
            "cpu_ratio": None if cpu_ratio is None else round(cpu_ratio, 4),
            "store_dir_bytes": dir_bytes(self.store_dir), "data_dir_bytes": dir_bytes(self.data_dir),
            "store_file_bytes": store.get("file_bytes"), "store_series": store.get("series"),
            "store_events": store.get("events"), "store_healthy": status.get("healthy"),
            "staging_bytes": store.get("staging", {}).get("bytes"),
            **{f"tier_{name}_bytes": tiers.get(name, {}).get("bytes") for name in ("raw", "1s", "1m", "1h")},
            "raw_oldest_age_s": (None if newest is None or raw.get("oldest_ns") is None
                                 else round((newest - raw["oldest_ns"]) / 1e9, 1)),
            "store_span_s": None if newest is None or oldest is None else round((newest - oldest) / 1e9, 1),
            **{f"series_{k}": census.get("kinds", {}).get(k) for k in KINDS},
            "series_pids": census.get("pids"), "series_deleted": census.get("series_deleted"),
            "scrape_p50_ms": round(statistics.median(scrape) * 1e3, 2) if scrape else None,
            "scrape_max_ms": round(max(scrape) * 1e3, 2) if scrape else None,
            "writer_pending": store.get("writer", {}).get("pending"),
            "last_flush_age_s": store.get("health", {}).get("last_flush_age_seconds"),
            "sampler_missed_ticks": status.get("sampler", {}).get("missed_ticks"),
            **smaps_rollup(self.ps.pid),
        }
        if self.heap_path:
            row.update(heap_last(self.heap_path))
        self.rows.append(row)
        return row


# -- analysis and outputs ------------------------------------------------------------------------------
def slope_per_h(rows: list[dict[str, Any]], key: str) -> float | None:
    """Least-squares slope of `key` against time, per hour."""
    pts = [(r["t_s"] / 3600.0, float(r[key])) for r in rows if r.get(key) is not None]
    if len(pts) < 3:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return None if sxx == 0 else sum((x - mx) * (y - my) for x, y in pts) / sxx


def analyse(rows: list[dict[str, Any]], census: list[dict[str, Any]], args: argparse.Namespace,
            stats: Stats, extra: dict[str, Any]) -> dict[str, Any]:
    if not rows:
        return {"benchmark": "soak", "error": "no samples were taken", **extra}
    t_end = rows[-1]["t_s"]
    warm_s = min(args.warmup_s, t_end * 0.9)
    warm = [r for r in rows if r["t_s"] >= warm_s]
    first_warm = census[rows.index(warm[0])] if warm else {}

    def fig(key: str, scale: float = 1.0, nd: int = 1) -> dict[str, Any]:
        vals = [r[key] for r in rows if r.get(key) is not None]
        s = slope_per_h(warm, key)
        return {"start": round(vals[0] / scale, nd) if vals else None,
                "warm": round(warm[0][key] / scale, nd) if warm and warm[0].get(key) is not None else None,
                "end": round(vals[-1] / scale, nd) if vals else None,
                "max": round(max(vals) / scale, nd) if vals else None,
                "slope_per_h": None if s is None else round(s / scale, 2)}

    rss = fig("rss_bytes", MB)
    series_start = census[0].get("kinds", {}) if census else {}
    series_warm = first_warm.get("kinds", {})
    series_end = census[-1].get("kinds", {}) if census else {}
    per_kind = {}
    for k in KINDS:
        s = slope_per_h(warm, f"series_{k}")
        per_kind[k] = {"start": series_start.get(k), "warm": series_warm.get(k), "end": series_end.get(k),
                       "per_h": None if s is None else round(s)}
    total_series_slope = slope_per_h(warm, "store_series")
    pids_slope = slope_per_h(warm, "series_pids")
    proc_metrics = sorted(m for m in census[-1].get("metrics", {}) if kind_of(m) == "process") if census else []
    end_pids = census[-1].get("pids", 0) if census else 0
    series_per_pid = (census[-1].get("kinds", {}).get("process", 0) / end_pids) if end_pids else None
    rss_slope = rss["slope_per_h"]
    bytes_per_series = (rss_slope * MB / total_series_slope
                        if rss_slope is not None and total_series_slope and total_series_slope > 0 else None)

    max_size = parse_size(RETENTION["max_size"], "max_size")
    # A raw block [B, B + 10 min) goes once it is older than `raw` (after B + 10 min + raw): the raw tier
    # spans between `raw` and `raw` + one block, plus a minute for the seal and retention pass.
    raw_bound_s = parse_duration(RETENTION["raw"]) + RAW_BLOCK_S + 60.0
    raw_age = [r["raw_oldest_age_s"] for r in rows if r.get("raw_oldest_age_s") is not None]
    raw_acted = any(r.get("raw_oldest_age_s") is not None for r in rows) and t_end > raw_bound_s
    store_end = rows[-1].get("store_dir_bytes") or 0
    tiers_end = {t: rows[-1].get(f"tier_{t}_bytes") for t in ("raw", "1s", "1m", "1h")}
    requests = {}
    with stats.lock:
        for name in sorted(stats.n):
            lat = sorted(stats.all.get(name, []))
            requests[name] = {"n": stats.n[name], "failed": stats.failed.get(name, 0),
                              "p50_ms": round(lat[len(lat) // 2] * 1e3, 2) if lat else None,
                              "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 2) if lat else None,
                              "last_error": stats.last_error.get(name)}
    scrape_p50 = [r["scrape_p50_ms"] for r in warm if r.get("scrape_p50_ms") is not None]
    findings = []
    if rss_slope is not None:
        findings.append(f"RSS {'flat' if rss_slope <= GOAL_RSS_MB_PER_H else 'grows'}: {rss_slope:+.1f} MB/h after "
                        f"warm-up (goal <= {GOAL_RSS_MB_PER_H:g} MB/h)")
    if warm_s < WARMUP_S:
        findings.append(f"the fits start at {warm_s:.0f} s, before the {WARMUP_S / 60:.0f} min the agent needs to fill "
                        "its in-memory history and the store's hot window: the slopes measure that filling")
    if bytes_per_series is not None:
        findings.append(f"RSS slope / series slope = {bytes_per_series:,.0f} bytes per stored series added "
                        f"({total_series_slope:+,.0f} series/h, {pids_slope or 0:+,.0f} pids/h); an upper bound on "
                        "the cost of a series (whatever else grew is in it too; compare a --churn 0 run)")
    for name, r in requests.items():
        if r["failed"]:
            findings.append(f"{name}: {r['failed']} of {r['n']} requests failed (last: {r['last_error']})")
    unhealthy = [r["t_s"] for r in rows if r.get("store_healthy") is False]
    if unhealthy:
        worst = max(rows, key=lambda r: r.get("last_flush_age_s") or 0)
        findings.append(f"the store reported unhealthy in {len(unhealthy)} of {len(rows)} samples (first at "
                        f"{unhealthy[0]:.0f} s); the longest wait for a flush seen was {worst.get('last_flush_age_s')} s "
                        f"at {worst['t_s']:.0f} s, {worst.get('writer_pending')} snapshots pending")
    fd_slope, thr_slope = slope_per_h(warm, "fds"), slope_per_h(warm, "threads")
    if fd_slope is not None and fd_slope > 10:
        findings.append(f"open fds grow {fd_slope:+.0f}/h after warm-up")
    if thr_slope is not None and thr_slope > 2:
        findings.append(f"threads grow {thr_slope:+.1f}/h after warm-up")
    if store_end > max_size:
        findings.append(f"the store directory ({store_end / MB:.1f} MB) is above max_size "
                        f"({RETENTION['max_size']})")
    return {
        "benchmark": "soak", "duration_s": round(t_end, 1), "warmup_s": round(warm_s, 1), "samples": len(rows),
        "gpus": args.gpus, "processes": args.processes, "churn_s": args.churn or None, "retention": RETENTION,
        "rss_mb": rss, "rss_slope_mb_per_h": rss_slope, "goal_rss_slope_mb_per_h": GOAL_RSS_MB_PER_H,
        "rss_flat": rss_slope is not None and rss_slope <= GOAL_RSS_MB_PER_H,
        "rss_bytes_per_added_series": None if bytes_per_series is None else round(bytes_per_series),
        "fds": fig("fds", 1, 0), "threads": fig("threads", 1, 0),
        "cpu_ratio_median": round(statistics.median([r["cpu_ratio"] for r in warm if r.get("cpu_ratio") is not None]
                                                    or [0.0]), 3),
        "store": {"dir_mb": fig("store_dir_bytes", MB), "tiers_end_bytes": tiers_end,
                  "max_size_bytes": max_size, "within_max_size": store_end <= max_size,
                  "raw_oldest_age_s_end": raw_age[-1] if raw_age else None,
                  "raw_oldest_age_s_max": max(raw_age) if raw_age else None,
                  "raw_bound_s": raw_bound_s, "raw_retention_could_act": raw_acted,
                  "raw_within_bound": (max(raw_age) <= raw_bound_s) if raw_age else None},
        "series": {"per_kind": per_kind, "total_per_h": None if total_series_slope is None else round(total_series_slope),
                   "pids_start": census[0].get("pids") if census else None, "pids_end": end_pids,
                   "pids_per_h": None if pids_slope is None else round(pids_slope),
                   "series_per_pid": None if series_per_pid is None else round(series_per_pid, 2),
                   "process_metrics": proc_metrics,
                   "deleted_by_retention": census[-1].get("series_deleted") if census else None},
        "events_end": census[-1].get("events") if census else {},
        "scrape_p50_ms": {"warm": scrape_p50[0] if scrape_p50 else None, "end": scrape_p50[-1] if scrape_p50 else None,
                          "slope_per_h": slope_per_h(warm, "scrape_p50_ms")},
        "memory": {k: fig(k, MB) for k in (*HEAP_KEYS, "smaps_anonymous_bytes", "smaps_rss_bytes")
                   if any(r.get(k) is not None for r in rows) and k != "py_blocks"}
                  | ({"py_blocks": fig("py_blocks", 1, 0)} if any(r.get("py_blocks") is not None for r in rows) else {}),
        "requests": requests, "findings": findings, **extra,
    }


def write_svg(path: str, rows: list[dict[str, Any]], warm_s: float) -> None:
    """Four stacked panels drawn with gpuscope.report.svg (no plotting library needed); the warm-up shaded."""
    t = [r["t_s"] for r in rows]
    t0, t1 = (t[0], t[-1]) if t else (0.0, 1.0)

    def col(key: str, scale: float = 1.0) -> list[float | None]:
        return [None if r.get(key) is None else r[key] / scale for r in rows]

    rss = [v for v in col("rss_bytes", MB) if v is not None]
    rss_lo = math.floor(min(rss) / 10) * 10 if rss else 0.0
    colors = {"process": "#d62728", "gpu": "#1f77b4", "host": "#2ca02c", "kernel": "#9467bd", "self": "#8c564b"}
    panels = [
        ("Agent RSS (MB)", [Line("RSS", "#1f77b4", t, col("rss_bytes", MB))], Axis("MB", lo=rss_lo)),
        ("Store on disk (MB)", [Line("store directory", "#ff7f0e", t, col("store_dir_bytes", MB)),
                                Line("raw tier", "#2ca02c", t, col("tier_raw_bytes", MB), dashed=True),
                                Line("1 s tier", "#9467bd", t, col("tier_1s_bytes", MB), dashed=True)], Axis("MB")),
        ("Stored series by kind", [Line(k, c, t, col(f"series_{k}")) for k, c in colors.items()], Axis("series")),
        ("Open fds and threads", [Line("fds", "#17becf", t, col("fds")), Line("threads", "#7f7f7f", t, col("threads"))],
         Axis("count")),
    ]
    warm = [Band(t0, warm_s, "#999", f"warm-up, left out of the fits (0-{warm_s:.0f} s)")]
    head, gap, w, h = 22, 6, 960, 170
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {len(panels) * (head + h + gap)}" '
           'font-family="sans-serif" font-size="12">', '<rect width="100%" height="100%" fill="#fff"/>']
    for i, (title, lines, axis) in enumerate(panels):
        y = i * (head + h + gap)
        out.append(f'<text x="8" y="{y + 15}" font-weight="bold">{escape(title)}</text>')
        x = 260
        for ln in lines:
            out.append(f'<text x="{x}" y="{y + 15}" fill="{ln.color}">{"- - " if ln.dashed else "— "}'
                       f'{escape(ln.label)}</text>')
            x += 30 + 8 * len(ln.label)
        out.append(f'<text x="{w - 8}" y="{y + 15}" fill="#777" text-anchor="end">grey: warm-up</text>')
        svg = panel(lines, t0, t1, axis, bands=warm, title=title)
        out.append(svg.replace("<svg ", f'<svg x="0" y="{y + head}" width="{w}" height="{h}" ', 1))
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def report(summary: dict[str, Any]) -> str:
    if "error" in summary:
        return f"soak: {summary['error']}"
    s, st, se = summary, summary["store"], summary["series"]
    lines = [f"soak: {s['duration_s'] / 60:.1f} min, {s['samples']} samples, {s['gpus']} GPUs x {s['processes']} "
             f"processes, churn {s['churn_s'] or 'off'} s; warm-up {s['warmup_s']:.0f} s",
             f"  RSS        {s['rss_mb']['start']} -> {s['rss_mb']['warm']} (warm) -> {s['rss_mb']['end']} MB; "
             f"slope after warm-up {s['rss_slope_mb_per_h']} MB/h (goal <= {GOAL_RSS_MB_PER_H:g}): "
             f"{'FLAT' if s['rss_flat'] else 'GROWS'}",
             f"  fds        {s['fds']['start']} -> {s['fds']['end']} ({s['fds']['slope_per_h']}/h); threads "
             f"{s['threads']['start']} -> {s['threads']['end']} ({s['threads']['slope_per_h']}/h); agent CPU "
             f"{s['cpu_ratio_median'] * 100:.0f} % of a core",
             f"  store      {st['dir_mb']['start']} -> {st['dir_mb']['end']} MB on disk ({st['dir_mb']['slope_per_h']} MB/h);"
             f" max_size {st['max_size_bytes'] / MB:.0f} MB; tiers at end "
             + ", ".join(f"{k} {(v or 0) / MB:.1f} MB" for k, v in st["tiers_end_bytes"].items()),
             f"             raw tier spans {st['raw_oldest_age_s_end']} s (bound {st['raw_bound_s']:.0f} s"
             f"{'' if st['raw_retention_could_act'] else ', not reached in this run'})",
             f"  series     {se['total_per_h']}/h in all; pids {se['pids_start']} -> {se['pids_end']} "
             f"({se['pids_per_h']}/h, {se['series_per_pid']} series each); deleted by retention "
             f"{se['deleted_by_retention']}"]
    for k, v in se["per_kind"].items():
        if v["end"]:
            lines.append(f"    {k:<8} {v['start']} -> {v['warm']} (warm) -> {v['end']}  ({v['per_h']}/h)")
    lines.append("  requests   " + "; ".join(f"{n} {r['n']} (failed {r['failed']}, p50 {r['p50_ms']} ms, p99 "
                                            f"{r['p99_ms']} ms)" for n, r in s["requests"].items()))
    lines.append(f"  SSE events read {s.get('sse_events')}, traces fed {s.get('traces_fed')}, ingested "
                 f"{s.get('traces_ingested')}; events in store {s.get('events_end')}")
    tm = s.get("tracemalloc")
    if tm and "top" in tm:
        lines.append(f"  Python heap grew {tm['python_heap_growth_bytes'] / MB:+.1f} MB after the warm-up; most:")
        lines += [f"    {r['grew_bytes'] / MB:+8.2f} MB {r['blocks']:+8d} blocks  {r['where']}" for r in tm["top"][:10]]
    for k, v in s.get("memory", {}).items():
        unit = "" if k == "py_blocks" else " MB"
        lines.append(f"  {k:<24} {v['start']} -> {v['warm']} (warm) -> {v['end']}{unit} ({v['slope_per_h']}{unit}/h)")
    ht = s.get("heap_types", {})
    if ht.get("growth"):
        lines.append("  object types grown after the warm-up: " + ", ".join(
            f"{g['type']} {g['delta']:+,}" for g in ht["growth"][:10]))
    lines += [f"  * {f}" for f in s["findings"]]
    return "\n".join(lines)


# -- the agent -----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def write_config(path: str, port: int, data_dir: str) -> None:
    store = "\n".join(f'{k} = "{v}"' for k, v in RETENTION.items())
    with open(path, "w") as f:
        f.write(f'[agent]\nbind = "{HOST}"\nport = {port}\ndata_dir = "{data_dir}"\nlog_format = "json"\n'
                f'[sampler]\ninterval = "100ms"\n[store]\nflush_interval = "1s"\n{store}\n'
                f'[remote_write]\nurl = ""\n[alerts]\nenabled = true\n')


def _die_with_parent() -> None:
    """In the agent's child before exec: SIGTERM when this script dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_agent(args: argparse.Namespace, work: str, log: Any) -> tuple[Any, int]:
    import subprocess

    data_dir = os.path.join(work, "data")
    for attempt in range(3):
        port = free_port()
        cfg = os.path.join(work, "agent.toml")
        write_config(cfg, port, data_dir)
        agent = ["agent", "--config", cfg, "--simulate", "mixed", "--gpus", str(args.gpus),
                 "--processes", str(args.processes)]
        if args.churn:
            agent += ["--churn", str(args.churn)]
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if args.heap:
            env["GPUSCOPE_SOAK_HEAP"] = os.path.join(work, "heap.jsonl")
            cmd = [sys.executable, "-c", HEAP_WRAPPER, *agent]
        elif args.tracemalloc:
            env["GPUSCOPE_SOAK_TRACEMALLOC"] = os.path.join(work, "tracemalloc")
            os.makedirs(env["GPUSCOPE_SOAK_TRACEMALLOC"], exist_ok=True)
            env["GPUSCOPE_SOAK_TRACEMALLOC_FRAMES"] = str(TRACEMALLOC_FRAMES)
            cmd = [sys.executable, "-c", TRACEMALLOC_WRAPPER, *agent]
        else:
            cmd = [sys.executable, "-m", "gpuscope", *agent]
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                c = http.client.HTTPConnection(HOST, port, timeout=2)
                c.request("GET", "/readyz")
                if c.getresponse().status == 200:
                    return proc, port
            except OSError:
                pass
            time.sleep(0.25)
        stop_agent(proc)
        if attempt == 2 or proc.returncode not in (0, 1):
            break
    raise RuntimeError(f"the agent did not start (exit {proc.returncode}); see {log.name}")


# The agent under tracemalloc: SIGUSR1 writes a snapshot (N.tm) into $GPUSCOPE_SOAK_TRACEMALLOC. Tracing starts at
# the first one (the end of the warm-up), not at start: the agent runs at full speed until then (tracing from the
# start slowed its flushes so much that the store fell minutes behind), and the last snapshot holds exactly the
# blocks allocated after the warm-up and still alive, which is the growth.
TRACEMALLOC_FRAMES = 4
TRACEMALLOC_WRAPPER = """
import os, signal, sys, tracemalloc
def dump(signum, frame):
    out = os.environ["GPUSCOPE_SOAK_TRACEMALLOC"]
    n = sum(1 for x in os.listdir(out) if x.endswith(".tm"))
    if not tracemalloc.is_tracing():
        tracemalloc.start(int(os.environ.get("GPUSCOPE_SOAK_TRACEMALLOC_FRAMES", "4")))
    tracemalloc.take_snapshot().dump(os.path.join(out, ".tmp"))
    os.replace(os.path.join(out, ".tmp"), os.path.join(out, f"{n}.tm"))
signal.signal(signal.SIGUSR1, dump)
from gpuscope.cli import main
sys.exit(main(sys.argv[1:]))
"""


# The agent with a heap probe (--heap): a daemon thread in the agent's process writes, every 10 s, one JSON line of
# where its memory is: glibc's mallinfo2 (bytes in use, free inside the heap, mmapped), pymalloc's allocated blocks,
# SQLite's own heap (sqlite3_memory_used), and every 5 min the 25 most numerous object types (gc.get_objects: ~1 s
# with the GIL held, so rarely). Cheap, unlike tracemalloc: it says which allocator grows, not who allocated.
HEAP_WRAPPER = """
import ctypes, gc, json, os, sys, threading, time
from collections import Counter
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MI
try:
    sq = ctypes.CDLL("libsqlite3.so.0")
    sq.sqlite3_memory_used.restype = ctypes.c_int64
    sq.sqlite3_memory_highwater.restype = ctypes.c_int64
except OSError:
    sq = None
def probe():
    out, n = os.environ["GPUSCOPE_SOAK_HEAP"], 0
    while True:
        m = libc.mallinfo2()
        row = {"unix": round(time.time(), 1), "malloc_arena": m.arena, "malloc_in_use": m.uordblks,
               "malloc_free": m.fordblks, "malloc_mmap": m.hblkhd, "malloc_keepcost": m.keepcost,
               "py_blocks": sys.getallocatedblocks(),
               "sqlite_used": sq.sqlite3_memory_used() if sq else None,
               "sqlite_highwater": sq.sqlite3_memory_highwater(1) if sq else None,
               "threads": threading.active_count()}
        if n % 30 == 0:
            row["types"] = Counter(type(o).__name__ for o in gc.get_objects()).most_common(25)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\\n")
        n += 1
        time.sleep(10)
threading.Thread(target=probe, name="soak-heap-probe", daemon=True).start()
from gpuscope.cli import main
sys.exit(main(sys.argv[1:]))
"""

HEAP_KEYS = ("malloc_arena", "malloc_in_use", "malloc_free", "malloc_mmap", "py_blocks", "sqlite_used")


def heap_last(path: str) -> dict[str, Any]:
    """The heap probe's newest line (without its type census), {} before the first."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
            lines = f.read().splitlines()
        row = json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}
    return {k: row.get(k) for k in HEAP_KEYS}


def heap_types(path: str) -> list[dict[str, Any]]:
    """Every type census the probe wrote: [{unix, types: [[name, count], ...]}]."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if "types" in row:
                    out.append({"unix": row["unix"], "types": row["types"]})
    except (OSError, ValueError):
        pass
    return out


def t_warm_unix(probe: Any, args: argparse.Namespace) -> float | None:
    rows = [r for r in getattr(probe, "rows", []) if r["t_s"] >= min(args.warmup_s, (probe.rows[-1]["t_s"] * 0.9))]
    return rows[0]["unix"] if rows else None


def type_growth(census: list[dict[str, Any]], warm_unix: float | None, top: int = 15) -> dict[str, Any]:
    """Object counts by type: the first census after the warm-up against the last; the largest growths."""
    after = [c for c in census if warm_unix is None or c["unix"] >= warm_unix]
    if len(after) < 2:
        return {"error": "fewer than two type censuses after the warm-up"}
    a, b = dict(map(tuple, after[0]["types"])), dict(map(tuple, after[-1]["types"]))
    grown = sorted(((b.get(k, 0) - a.get(k, 0), k) for k in set(a) | set(b)), reverse=True)[:top]
    return {"from_unix": after[0]["unix"], "to_unix": after[-1]["unix"],
            "growth": [{"type": k, "from": a.get(k), "to": b.get(k), "delta": d} for d, k in grown]}


def smaps_rollup(pid: int) -> dict[str, int]:
    """Anonymous and file-backed resident bytes (/proc/PID/smaps_rollup)."""
    got = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                k, _, rest = line.partition(":")
                if k in ("Anonymous", "Rss", "Private_Dirty", "Shared_Clean", "Private_Clean"):
                    got[f"smaps_{k.lower()}_bytes"] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return got


def tracemalloc_snapshot(proc: Any, work: str, timeout_s: float = 120.0) -> str | None:
    """Ask the agent (started with --tracemalloc) for a snapshot; its path once written."""
    out = os.path.join(work, "tracemalloc")
    n = sum(1 for x in os.listdir(out) if x.endswith(".tm"))
    proc.send_signal(signal.SIGUSR1)
    path = os.path.join(out, f"{n}.tm")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(path):
            return path
        time.sleep(0.5)
    return None


def tracemalloc_growth(first: str, last: str, top: int = 15) -> dict[str, Any]:
    """Where the Python heap grew between two snapshots (by the innermost gpuscope frame's line)."""
    import tracemalloc

    a, b = tracemalloc.Snapshot.load(first), tracemalloc.Snapshot.load(last)
    total = sum(st.size for st in b.statistics("filename")) - sum(st.size for st in a.statistics("filename"))
    rows = []
    for st in b.compare_to(a, "traceback")[:top]:
        frames = [f for f in st.traceback if "gpuscope" in f.filename] or list(st.traceback)
        rows.append({"where": " <- ".join(f"{os.path.relpath(f.filename, ROOT) if f.filename.startswith(ROOT) else f.filename}"
                                         f":{f.lineno}" for f in frames[:3]),
                     "grew_bytes": st.size_diff, "blocks": st.count_diff})
    return {"python_heap_growth_bytes": total, "top": rows}


def stop_agent(proc: Any, grace_s: float = 30.0) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: it would not stop
            proc.kill()
            proc.wait(10)
    return proc.returncode


# -- main ----------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one sentence, exit 2
        print(f"soak: {message.rstrip('.')}.", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", default="1h", help="how long to drive the agent (default 1h; e.g. 5m, 15m)")
    p.add_argument("--sample", default="10s", help="sampling period of the measurements (default 10s)")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--processes", type=int, default=100)
    p.add_argument("--churn", type=float, default=60.0,
                   help="seconds each simulated process lives (default 60; 0 = no churn, the control run)")
    p.add_argument("--warmup", default="auto",
                   help="time left out of the fits (default: a third of the run, at least 25 min, at most 60 %% of it)")
    p.add_argument("--out", help="directory for samples, plot and summary (default: a new one under /tmp)")
    p.add_argument("--keep-data", action="store_true", help="keep the agent's data directory (its store) afterwards")
    p.add_argument("--json", action="store_true", help="print only the JSON summary")
    p.add_argument("--heap", action="store_true",
                   help="run the agent with a cheap heap probe (glibc mallinfo2, pymalloc blocks, SQLite's heap, a "
                        "type census every 5 min) and report which of them grew after the warm-up")
    p.add_argument("--tracemalloc", action="store_true",
                   help="run the agent under tracemalloc and report where its Python heap grew between the end "
                        "of the warm-up and the end (tracing starts then and slows the agent from then on; for finding a leak, not for the figures)")
    args = p.parse_args(argv)
    try:
        args.duration_s = parse_duration(args.duration, "--duration")
        args.sample_s = parse_duration(args.sample, "--sample")
    except ValueError as e:
        p.error(str(e))
    if not 30 <= args.duration_s <= 24 * 3600:
        p.error("--duration must be between 30s and 24h")
    if not 1 <= args.sample_s <= args.duration_s / 3:
        p.error("--sample must be at least 1s and at most a third of --duration")
    if not (args.churn == 0 or 1 <= args.churn <= 86400):
        p.error("--churn must be 0 (off) or between 1 and 86400 seconds")
    if args.warmup == "auto":
        args.warmup_s = min(max(args.duration_s / 3, WARMUP_S), 0.6 * args.duration_s)
    else:
        try:
            args.warmup_s = parse_duration(args.warmup, "--warmup", allow_zero=True)
        except ValueError as e:
            p.error(str(e))
        if args.warmup_s > 0.9 * args.duration_s:
            p.error("--warmup must leave at least a tenth of --duration to fit")
    return args


class _Stop(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import psutil  # noqa: F401
    except ImportError:
        print("soak: psutil is needed (pip install psutil).", file=sys.stderr)
        return 2
    out = args.out or tempfile.mkdtemp(prefix="gpuscope-soak-")
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpuscope-soak-agent-")

    def on_signal(signum: int, _frame: Any) -> None:
        raise _Stop(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    stop = threading.Event()
    stats = Stats()
    threads: list[threading.Thread] = []
    sse: list[SseReader] = []
    clients: list[Client] = []
    proc = None
    feeder = None
    sampler = None
    interrupted = ""
    agent_rc = None
    tm_paths: list[str | None] = []
    t0 = time.monotonic()
    log = open(os.path.join(out, "agent.log"), "w")  # noqa: SIM115 - closed in finally
    try:
        try:
            proc, port = start_agent(args, work, log)
        except RuntimeError as e:
            print(f"soak: {e}.", file=sys.stderr)
            return 1
        data_dir = os.path.join(work, "data")
        with open(os.path.join(data_dir, "token")) as f:
            token = f.read().strip()

        def client() -> Client:
            c = Client(port, stats)
            clients.append(c)
            return c

        feeder = TraceFeeder(client(), data_dir, token)
        threads += [Periodic("scraper", stop, scrape_tasks(client())),
                    Periodic("dashboard-1", stop, dashboard_tasks(client())),
                    Periodic("dashboard-2", stop, dashboard_tasks(client()), first_delay=0.5),
                    Periodic("events", stop, event_tasks(client(), token), first_delay=1.0),
                    Periodic("api", stop, api_tasks(client()), first_delay=5.0),
                    Periodic("traces", stop, feeder.tasks(), first_delay=10.0)]
        sse = [SseReader(f"sse-{i}", port, stop, stats) for i in (1, 2)]
        t0 = time.monotonic()
        sampler = Probe(proc, port, data_dir, stats, t0, os.path.join(work, "heap.jsonl") if args.heap else None)
        for th in (*threads, *sse):
            th.start()
        deadline = t0 + args.duration_s
        next_sample = t0
        warm_at = t0 + args.warmup_s if args.tracemalloc else None
        while True:
            now = time.monotonic()
            if warm_at is not None and now >= warm_at:
                warm_at = None
                tm_paths.append(tracemalloc_snapshot(proc, work))
            if now >= next_sample:
                if proc.poll() is not None:
                    interrupted = f"the agent exited with status {proc.returncode} during the run"
                    break
                row = sampler.sample()
                if not args.json:
                    print(f"  {row['t_s']:7.0f} s  RSS {row['rss_bytes'] / MB:7.1f} MB  fds {row['fds']:4d}  "
                          f"threads {row['threads']:3d}  store {row['store_dir_bytes'] / MB:7.1f} MB  series "
                          f"{row['store_series']}  pids {row['series_pids']}", file=sys.stderr, flush=True)
                next_sample += args.sample_s
            if now >= deadline:
                break
            time.sleep(max(0.0, min(next_sample, deadline, warm_at or deadline) - time.monotonic()))
        if args.tracemalloc and proc.poll() is None and tm_paths:
            tm_paths.append(tracemalloc_snapshot(proc, work))
    except (KeyboardInterrupt, _Stop) as e:
        interrupted = f"interrupted ({type(e).__name__} {e})".strip()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave the agent running
        stop.set()
        for r in sse:
            r.close()
        for th in (*threads, *sse):
            th.join(timeout=35)
        for c in clients:
            c.close()
        if feeder is not None:
            feeder.close()
        if proc is not None:
            agent_rc = stop_agent(proc)
        log.close()
    rows = sampler.rows if sampler is not None else []
    census = sampler.census if sampler is not None else []
    ingested = 0
    if proc is not None:
        traces_dir = os.path.join(work, "data", "traces")
        ingested = sum(1 for n in os.listdir(traces_dir) if n.endswith(".kernels.json")) if os.path.isdir(traces_dir) else 0
    extra = {"sse_events": sum(r.events for r in sse), "sse_reconnects": sum(r.reconnects for r in sse),
             "traces_fed": feeder.fed if feeder else 0, "traces_ingested": ingested,
             "agent_exit_status": agent_rc, "interrupted": interrupted or None,
             "worker_crashes": {th.name: th.crashed for th in threads if isinstance(th, Periodic) and th.crashed},
             "out": out}
    if len(tm_paths) == 2 and all(tm_paths):
        extra["tracemalloc"] = tracemalloc_growth(tm_paths[0] or "", tm_paths[1] or "")
    if args.heap:
        extra["heap_types"] = type_growth(heap_types(os.path.join(work, "heap.jsonl")), t_warm_unix(sampler, args))
    elif args.tracemalloc:
        extra["tracemalloc"] = {"error": "no pair of snapshots (the run ended before the warm-up did?)"}
    summary = analyse(rows, census, args, stats, extra)
    if rows:
        with open(os.path.join(out, "samples.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        with open(os.path.join(out, "samples.json"), "w") as f:
            json.dump({"samples": rows, "census": census}, f)
        write_svg(os.path.join(out, "soak.svg"), rows, summary.get("warmup_s", 0.0))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if args.keep_data:
        summary["data_dir"] = os.path.join(work, "data")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if not args.json:
        print(report(summary))
        print(f"  outputs in {out}: samples.csv, samples.json, soak.svg, summary.json, agent.log")
    print(json.dumps(summary, separators=(",", ":")))
    if interrupted.startswith("interrupted"):
        return 130
    return 1 if "error" in summary or interrupted.startswith("the agent exited") else 0


if __name__ == "__main__":
    sys.exit(main())
