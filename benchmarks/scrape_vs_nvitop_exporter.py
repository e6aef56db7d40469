"""Scrape latency of the gpuscope agent's /metrics against nvitop-exporter's, same GPU, same run.

    python benchmarks/scrape_vs_nvitop_exporter.py --scrapes 200     # on a GPU machine, both installed

Starts `gpuscope agent` and `nvitop-exporter` on loopback ports, optionally a workload so both have
a GPU process to report, then times scrapes over one kept-alive connection per server.
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(port: int, path: str, timeout: float = 60.0) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", path)
            r = c.getresponse()
            body = r.read()
            if r.status == 200 and body:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"nothing answered on port {port}")


def time_scrapes(port: int, n: int) -> tuple[list[float], int]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    times, size = [], 0
    for _ in range(n):
        t = time.perf_counter()
        c.request("GET", "/metrics")
        r = c.getresponse()
        body = r.read()
        times.append(time.perf_counter() - t)
        size = len(body)
        time.sleep(0.01)
    return times, size


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--workload", default="", help="a python script to run meanwhile (e.g. a reference workload)")
    a = ap.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    procs = []
    if a.workload:
        procs.append(subprocess.Popen([sys.executable, a.workload, "--seconds", "120"], cwd=os.path.dirname(a.workload),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(5)
    gp, npt = free_port(), free_port()
    data = tempfile.mkdtemp()
    procs.append(subprocess.Popen([sys.executable, "-m", "gpuscope.cli", "agent", "--port", str(gp), "--data-dir", data],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    procs.append(subprocess.Popen([sys.executable, "-m", "nvitop_exporter", "--bind", "127.0.0.1", "--port", str(npt),
                                   "--interval", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        wait_up(gp, "/metrics")
        wait_up(npt, "/metrics")
        time.sleep(3)
        g, gsize = time_scrapes(gp, a.scrapes)
        n, nsize = time_scrapes(npt, a.scrapes)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
    gm, nm = statistics.median(g) * 1e3, statistics.median(n) * 1e3
    gq, nq = sorted(g)[int(len(g) * 0.99) - 1] * 1e3, sorted(n)[int(len(n) * 0.99) - 1] * 1e3
    print(f"gpuscope agent  /metrics: median {gm:7.3f} ms  p99 {gq:7.3f} ms  ({gsize} bytes)")
    print(f"nvitop-exporter /metrics: median {nm:7.3f} ms  p99 {nq:7.3f} ms  ({nsize} bytes)")
    print(f"nvitop-exporter / gpuscope (median): {nm / gm:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
