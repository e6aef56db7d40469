"""Footprint of the agent as a DaemonSet runs it: CPU (millicores) and RSS at its default interval, and how long
from the start of the process until it serves (/healthz, /readyz and /metrics answer 200), against
nvitop-exporter at its own default interval, in the same window on the same machine.

    python benchmarks/bench_footprint.py --seconds 60                  # on a GPU machine: the real agent
    python benchmarks/bench_footprint.py --seconds 60 --agent-args "--simulate mixed --gpus 8 --processes 100"

Both servers are scraped every 15 s, as Prometheus would (its default scrape interval), so the figures
include rendering /metrics. CPU is the process's own (user + system, all threads) over the window after a
warm-up; RSS is sampled every second (mean and max). Goals (issue 19): ≤ 50 millicores, ≤ 150 MB RSS,
ready ≤ 2 s after start.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def first_200(port: int, path: str, t0: float, proc: subprocess.Popen, timeout: float = 60.0,
              need: bytes = b"") -> float | None:
    """Seconds from t0 (the spawn) to the first 200 on path whose body holds `need`; None if it never came."""
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            return None
        try:
            code, body = get(port, path, timeout=2.0)
            if code == 200 and need in body:
                return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.01)
    return None


class Server:
    def __init__(self, name: str, argv: list[str], port: int, probes: list[tuple[str, str, bytes]], env: dict) -> None:
        self.name, self.port = name, port
        self.log = tempfile.TemporaryFile()  # not a pipe: a full pipe would stall a chatty server
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        self.ps = psutil.Process(self.proc.pid)
        self.start: dict[str, float | None] = {}
        for label, path, need in probes:  # in order: each is at least as late as the one before
            self.start[label] = first_200(port, path, self.t0, self.proc, need=need)
        self.rss: list[float] = []

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-600:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="measured window (default 60)")
    ap.add_argument("--warmup", type=float, default=10.0, help="left out before the window (default 10)")
    ap.add_argument("--agent-args", default="", help="extra arguments for gpuscope agent (e.g. --simulate ...)")
    ap.add_argument("--peer", choices=("auto", "none"), default="auto",
                    help="nvitop-exporter beside it (auto: where it is installed and the node is real)")
    ap.add_argument("--scrape-every", type=float, default=15.0)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    data = tempfile.mkdtemp(prefix="gpuscope-footprint-")
    gp = free_port()
    agent_argv = [sys.executable, "-m", "gpuscope", "agent", "--port", str(gp), "--data-dir", data,
                  *shlex.split(a.agent_args)]
    servers = [Server("gpuscope agent", agent_argv, gp,
                      [("healthz_s", "/healthz", b""), ("readyz_s", "/readyz", b""),
                       ("metrics_with_gpu_s", "/metrics", b"gpu_memory_used_bytes{")], env)]
    simulated = "--simulate" in a.agent_args
    if a.peer == "auto" and not simulated:
        try:
            import nvitop_exporter  # noqa: F401
        except ImportError:
            print("note: nvitop-exporter is not installed: no peer in this run")
        else:
            np_ = free_port()
            servers.append(Server("nvitop-exporter", [sys.executable, "-m", "nvitop_exporter", "--bind-address",
                                                      "127.0.0.1", "--port", str(np_)], np_,
                                  [("metrics_with_gpu_s", "/metrics", b"gpu_memory_used")], env))
    results = {"date": time.strftime("%Y-%m-%d"), "host": os.uname().nodename, "cpus": os.cpu_count(),
               "agent_args": a.agent_args, "seconds": a.seconds, "warmup": a.warmup, "servers": []}
    try:
        for s in servers:
            if any(v is None for v in s.start.values()):
                print(f"{s.name} did not come up: {s.stop()}")
                return 1
        time.sleep(a.warmup)
        c0 = {s.name: s.cpu() for s in servers}
        w0 = time.perf_counter()
        next_scrape, scrapes = w0, 0
        while time.perf_counter() - w0 < a.seconds:
            now = time.perf_counter()
            if now >= next_scrape:
                for s in servers:
                    get(s.port, "/metrics", timeout=10)
                scrapes += 1
                next_scrape += a.scrape_every
            for s in servers:
                s.rss.append(s.ps.memory_info().rss)
            time.sleep(1.0)
        wall = time.perf_counter() - w0
        for s in servers:
            cpu = s.cpu() - c0[s.name]
            r = {"name": s.name, "millicores": cpu / wall * 1000, "cpu_s": cpu, "wall_s": wall,
                 "rss_mean_mb": sum(s.rss) / len(s.rss) / 1e6, "rss_max_mb": max(s.rss) / 1e6,
                 "threads": s.ps.num_threads(), "scrapes": scrapes, **s.start}
            results["servers"].append(r)
            starts = ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in s.start.items() if v is not None)
            print(f"{s.name:<16} {r['millicores']:6.1f} millicores  RSS mean {r['rss_mean_mb']:6.1f} MB  "
                  f"max {r['rss_max_mb']:6.1f} MB  threads {r['threads']}  first 200 after start: {starts}", flush=True)
        if len(results["servers"]) == 2:
            g, n = results["servers"]
            print(f"ratio gpuscope / nvitop-exporter: CPU {g['millicores'] / n['millicores']:.2f}, "
                  f"RSS {g['rss_mean_mb'] / n['rss_mean_mb']:.2f}, time to metrics "
                  f"{g['metrics_with_gpu_s'] / n['metrics_with_gpu_s']:.2f}")
    finally:
        for s in servers:
            s.stop()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
