"""Scrape cost: render `/metrics` for 8 GPUs with 64 processes, against prometheus_client exposing
the same series (a custom collector of GaugeMetricFamily / CounterMetricFamily, generate_latest) in
the same run; optionally against a running nvitop-exporter scraped over HTTP.

    python benchmarks/bench_scrape.py                      # anywhere (simulated 8-GPU node)
    python benchmarks/bench_scrape.py --gpus 1 --processes 8 \\
        --nvitop-exporter http://127.0.0.1:5050/metrics --gpuscope-url http://127.0.0.1:PORT/metrics  # GPU machine
    python benchmarks/bench_scrape.py --json               # one JSON object for BENCHMARKS.md

Goal (issue 3): render <= 5 ms. The snapshot comes from the simulated 'mixed' node (8 H200s) with
its processes replicated to `--processes` (distinct pids, names, users), as the sampler would report
them; the render reads only that snapshot, as a scrape does. We time the canonical and the DCGM
mode, and, to compare like for like with an exporter scraped over HTTP, a full scrape of our render
served by the standard library's HTTP server on loopback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from gpuscope import Sampler  # noqa: E402
from gpuscope._records import Snapshot  # noqa: E402
from gpuscope.export.exposition import Exposition  # noqa: E402


def make_snapshot(gpus: int = 8, processes: int = 64) -> tuple[Snapshot, dict[str, float]]:
    """A realistic snapshot: the simulated node after a few ticks, processes spread over the GPUs."""
    s = Sampler(simulate="mixed", gpus=gpus)
    try:
        s.sample_once()
        time.sleep(0.25)  # let GPM produce its first window
        snap = s.sample_once()
        extra = s.self_metrics()
    finally:
        s.stop()
    base = snap.processes
    procs = []
    for i in range(processes):
        p = base[i % len(base)]
        procs.append(dataclasses.replace(
            p, pid=p.pid + 1 + i, name=f"python-worker-{i}", user=f"user{i % 5}",
            gpu_memory_bytes=(p.gpu_memory_bytes or 0) / (1 + i // len(base))))
    snap.processes = procs
    return snap, extra


def time_it(fn, repeat: int) -> list[float]:
    fn()  # warm caches, as every scrape after the first is
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def prometheus_client_peer(snap: Snapshot, extra: dict[str, float], rows_of):
    """A prometheus_client registry exposing exactly the series our canonical render has: one
    GaugeMetricFamily / CounterMetricFamily per family, labels padded with "" where a row lacks
    one (Prometheus treats an empty label as absent, so the series are the same)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class SnapshotCollector:
        def collect(self):
            for fam, rows in rows_of(snap, extra):
                names: dict[str, None] = {}
                for ctx, sl, _ in rows:
                    for k, _ in ctx.labels + sl:
                        names[k] = None
                labels = list(names)
                if fam.kind == "counter":  # prometheus_client appends _total itself
                    mf = CounterMetricFamily(fam.name.removesuffix("_total"), fam.help, labels=labels)
                else:
                    mf = GaugeMetricFamily(fam.name, fam.help, labels=labels)
                for ctx, sl, v in rows:
                    d = dict(ctx.labels + sl)
                    mf.add_metric([d.get(k, "") for k in labels], v)
                yield mf

    reg = CollectorRegistry(auto_describe=False)
    reg.register(SnapshotCollector())
    return lambda: generate_latest(reg)


def serve(expo: Exposition, snap: Snapshot, extra: dict[str, float]):
    """Our render behind the standard library's HTTP server, for a like-for-like HTTP scrape."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = expo.render(snap, extra=extra)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/metrics"


def scrape(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--processes", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=300, help="timed renders per variant (median reported)")
    ap.add_argument("--nvitop-exporter", metavar="URL", help="also time scrapes of a running nvitop-exporter")
    ap.add_argument("--gpuscope-url", metavar="URL",
                    help="also time scrapes of a running gpuscope agent's /metrics (e.g. on the GPU machine)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()

    snap, extra = make_snapshot(a.gpus, a.processes)
    expo = Exposition()
    text = expo.render(snap, extra=extra)
    series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    res: dict = {"gpus": a.gpus, "processes": a.processes, "series": series, "bytes": len(text)}

    canon = time_it(lambda: expo.render(snap, extra=extra), a.repeat)
    dcgm = time_it(lambda: expo.render(snap, mode="dcgm", extra=extra), a.repeat)
    cold = time_it(lambda: Exposition().render(snap, extra=extra), max(20, a.repeat // 10))
    res["render_canonical_ms"] = statistics.median(canon) * 1e3
    res["render_canonical_p99_ms"] = sorted(canon)[int(len(canon) * 0.99) - 1] * 1e3
    res["render_dcgm_ms"] = statistics.median(dcgm) * 1e3
    res["render_first_scrape_ms"] = statistics.median(cold) * 1e3

    try:
        peer = prometheus_client_peer(snap, extra, lambda s, e: expo.model.rows(s, extra=e))
        peer_text = peer()
        pc = time_it(peer, a.repeat)
        from importlib.metadata import version

        res["prometheus_client_version"] = version("prometheus_client")
        res["prometheus_client_series"] = sum(
            1 for line in peer_text.splitlines() if line and not line.startswith(b"#"))
        res["prometheus_client_ms"] = statistics.median(pc) * 1e3
        res["ratio_prometheus_client_over_gpuscope"] = res["prometheus_client_ms"] / res["render_canonical_ms"]
    except ImportError:
        res["prometheus_client_ms"] = None

    srv, url = serve(expo, snap, extra)
    try:
        res["gpuscope_http_scrape_ms"] = statistics.median(time_it(lambda: scrape(url), min(a.repeat, 100))) * 1e3
    finally:
        srv.shutdown()
        srv.server_close()

    if a.gpuscope_url:
        body = scrape(a.gpuscope_url)
        res["gpuscope_agent_series"] = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        res["gpuscope_agent_scrape_ms"] = statistics.median(time_it(lambda: scrape(a.gpuscope_url),
                                                                    min(a.repeat, 100))) * 1e3

    if a.nvitop_exporter:
        body = scrape(a.nvitop_exporter)
        nv = time_it(lambda: scrape(a.nvitop_exporter), min(a.repeat, 50))
        res["nvitop_exporter_series"] = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        res["nvitop_exporter_scrape_ms"] = statistics.median(nv) * 1e3
        res["ratio_nvitop_exporter_over_gpuscope_http"] = res["nvitop_exporter_scrape_ms"] / res["gpuscope_http_scrape_ms"]
        if a.gpuscope_url:
            res["ratio_nvitop_exporter_over_gpuscope_agent"] = (res["nvitop_exporter_scrape_ms"]
                                                                / res["gpuscope_agent_scrape_ms"])

    if a.json:
        print(json.dumps(res, indent=2, default=str))
        return 0
    print(f"{a.gpus} GPUs, {a.processes} processes: {series} series, {len(text)} bytes")
    print(f"gpuscope render (canonical)   median {res['render_canonical_ms']:.3f} ms  "
          f"p99 {res['render_canonical_p99_ms']:.3f} ms  (goal <= 5 ms)")
    print(f"gpuscope render (dcgm)        median {res['render_dcgm_ms']:.3f} ms")
    print(f"gpuscope first render (cold)  median {res['render_first_scrape_ms']:.3f} ms")
    print(f"gpuscope HTTP scrape (stdlib server, loopback)  median {res['gpuscope_http_scrape_ms']:.3f} ms")
    if res.get("prometheus_client_ms") is not None:
        print(f"prometheus_client {res['prometheus_client_version']} generate_latest  median "
              f"{res['prometheus_client_ms']:.3f} ms  ({res['prometheus_client_series']} series)")
        print(f"ratio prometheus_client / gpuscope: {res['ratio_prometheus_client_over_gpuscope']:.1f}x")
    else:
        print("prometheus_client not installed: no peer timed")
    if a.gpuscope_url:
        print(f"gpuscope agent scrape         median {res['gpuscope_agent_scrape_ms']:.3f} ms  "
              f"({res['gpuscope_agent_series']} series)")
    if a.nvitop_exporter:
        print(f"nvitop-exporter scrape        median {res['nvitop_exporter_scrape_ms']:.3f} ms  "
              f"({res['nvitop_exporter_series']} series)")
        print(f"ratio nvitop-exporter / gpuscope (both scraped over HTTP): "
              f"{res['ratio_nvitop_exporter_over_gpuscope_http']:.1f}x")
        if a.gpuscope_url:
            print(f"ratio nvitop-exporter / gpuscope agent: {res['ratio_nvitop_exporter_over_gpuscope_agent']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
