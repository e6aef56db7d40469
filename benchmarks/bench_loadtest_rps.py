"""Requests per second from one core: gpuscope loadtest vs Locust (FastHttpUser) vs wrk, same nginx, same run.

    python benchmarks/bench_loadtest_rps.py [--seconds 10] [--connections 64]

Starts nginx (Debian: apt-get install nginx-light wrk) on a free loopback port serving a 6-byte static
file, then runs each generator closed-loop with the same number of connections for the same time, one
process / one thread each, and prints requests/s and the ratios (goals: >= 3x Locust, >= 0.5x wrk).
The machine may be shared: compare the ratios, and run it twice.
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nginx(tmp: Path) -> tuple[subprocess.Popen, str]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        sys.exit("nginx is not installed (Debian: apt-get install nginx-light).")
    port = _free_port()
    tmp.chmod(0o755)   # nginx's worker runs as an unprivileged user and must read the file
    (tmp / "www").mkdir()
    (tmp / "www" / "index.html").write_text("hello\n")
    conf = tmp / "nginx.conf"
    conf.write_text(textwrap.dedent(f"""\
        worker_processes 1; daemon off; pid {tmp}/nginx.pid; error_log {tmp}/error.log;
        events {{ worker_connections 4096; }}
        http {{ access_log off; keepalive_requests 10000000;
                server {{ listen 127.0.0.1:{port}; location / {{ root {tmp}/www; }} }} }}
        """))
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(tmp)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}/index.html"


def ours(url: str, seconds: float, conns: int) -> float:
    from gpuscope.loadtest import schedule as S
    from gpuscope.loadtest.requests import Protocol
    from gpuscope.loadtest.runner import execute, summarize
    from gpuscope.loadtest.worker import WorkerConfig

    cfg = WorkerConfig(url=url, proto=Protocol(), plan=S.plan([S.Stage(seconds, concurrency=conns)]))
    s = summarize(cfg, execute(cfg, 1), url=url, protocol="http", stage_names=["c"])
    assert not s["overall"]["errors"], s["overall"]["errors"]
    return s["overall"]["completed"] / seconds


def ours_open(url: str, seconds: float, rate: float) -> tuple[float, dict]:
    from gpuscope.loadtest import schedule as S
    from gpuscope.loadtest.requests import Protocol
    from gpuscope.loadtest.runner import execute, summarize
    from gpuscope.loadtest.worker import WorkerConfig

    cfg = WorkerConfig(url=url, proto=Protocol(), plan=S.plan([S.Stage(seconds, rate=rate)], seed=1))
    s = summarize(cfg, execute(cfg, 1), url=url, protocol="http", stage_names=["o"])
    return s["overall"]["completed"] / seconds, s["client"]


def locust(url: str, seconds: float, users: int, tmp: Path) -> float:
    f = tmp / "locustfile.py"
    f.write_text(textwrap.dedent(f"""\
        from locust import FastHttpUser, task, constant
        class U(FastHttpUser):
            wait_time = constant(0)
            @task
            def get(self):
                self.client.get("{url.split('/', 3)[3] and '/' + url.split('/', 3)[3]}")
        """))
    host = "/".join(url.split("/")[:3])
    subprocess.run(["locust", "-f", str(f), "--headless", "-u", str(users), "-r", str(users), "-t", f"{int(seconds)}s",
                    "--host", host, "--csv", str(tmp / "loc"), "--only-summary", "--loglevel", "ERROR"],
                   capture_output=True, timeout=seconds + 60)
    with open(tmp / "loc_stats.csv") as fh:
        for row in csv.DictReader(fh):
            if row["Name"] == "Aggregated":
                return float(row["Request Count"]) / seconds
    raise RuntimeError("locust wrote no aggregated stats")


def wrk(url: str, seconds: float, conns: int) -> float:
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{int(seconds)}s", url], capture_output=True, text=True,
                         timeout=seconds + 30).stdout
    m = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    if not m:
        raise RuntimeError(f"wrk printed no rate: {out}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--connections", type=int, default=64)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc, url = start_nginx(tmp)
        try:
            r_ours = ours(url, a.seconds, a.connections)
            r_loc = locust(url, a.seconds, a.connections, tmp)
            r_wrk = wrk(url, a.seconds, a.connections)
            r_open, client = ours_open(url, a.seconds, 0.6 * r_ours)
        finally:
            proc.terminate()
            proc.wait(5)
    print(f"closed loop, {a.connections} connections, {a.seconds:g} s, one core each, nginx static file:")
    print(f"  gpuscope loadtest : {r_ours:10.0f} req/s")
    print(f"  locust FastHttp   : {r_loc:10.0f} req/s   ours/locust = {r_ours / r_loc:5.2f}x (goal >= 3)")
    print(f"  wrk -t1           : {r_wrk:10.0f} req/s   ours/wrk    = {r_ours / r_wrk:5.2f}x (goal >= 0.5)")
    print(f"open loop at 60 % of that ({0.6 * r_ours:.0f} req/s Poisson): {r_open:.0f} req/s done, "
          f"CPU {client['cpu_percent']:.0f} %, send lag p99 {client['send_lag_ms']['p99']:.2f} ms, late {client['late']}")


if __name__ == "__main__":
    main()
