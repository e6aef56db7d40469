"""The guard proxy's data path: `gpuscope guard proxy` vs nginx `limit_req` vs direct, same upstream, same run.

    python benchmarks/bench_guard_proxy.py [--seconds 10] [--connections 64] [--upstream aiohttp|nginx]

Starts one upstream on a free loopback port (an aiohttp app answering a 27-byte JSON, or nginx `return
200`), nginx (Debian: apt-get install nginx-light wrk) in front of it with `limit_req` and an upstream
keep-alive pool, and `gpuscope guard proxy` in front of it with two priority classes, class rate buckets
and a fixed concurrency limit of 256 (`--controller gradient` for the adaptive one, which in front of an
upstream this fast settles at a few requests in flight and queues the rest); then, with wrk (one thread), for each of direct, nginx and the guard:
- 64 connections closed loop: requests/s, and the CPU the proxy process spent per request (utime +
  stime from /proc/PID/stat over the run, divided by the requests wrk completed);
- one connection: p50 latency, and what the proxy adds to direct's p50.
Prints one table and the ratios the goals are stated in (issue 18: >= 0.5x nginx's requests/s, <= 50 us
of CPU per request, <= 0.2 ms added at p50 on one connection). The machine may be shared: run it twice.
Every load goes to 127.0.0.1 only and each wrk run is bounded by --seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")

UPSTREAM = r'''
import sys
from aiohttp import web

BODY = b'{"ok": true, "answer": 42}\n'

async def answer(request):
    if request.can_read_body:
        await request.read()
    return web.Response(body=BODY, content_type="application/json")

app = web.Application()
app.router.add_route("*", "/{tail:.*}", answer)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
'''

GUARD_CFG = """\
classes:
  - {name: interactive, share: 0.8, rate: 1000000, burst: 1000000}
  - {name: batch, share: 0.2, rate: 1000000, burst: 1000000}
classify: {header: x-priority, default: interactive}
controller: {mode: CONTROLLER, max_limit: 256}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited at start (status {proc.returncode}).")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{what} did not listen on port {port} within 30 s.")


def _nginx() -> str:
    exe = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(exe).exists():
        sys.exit("nginx is not installed (Debian: apt-get install nginx-light).")
    return exe


def start_nginx(tmp: Path, name: str, body: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    d = tmp / name
    d.mkdir()
    conf = d / "nginx.conf"
    conf.write_text(textwrap.dedent(f"""\
        worker_processes 1; daemon off; master_process off; pid {d}/nginx.pid; error_log {d}/error.log;
        {"user root root;" if os.geteuid() == 0 else ""}
        events {{ worker_connections 4096; }}
        http {{ access_log off; keepalive_requests 10000000; client_body_temp_path {d}; proxy_temp_path {d};
               fastcgi_temp_path {d};
               {body.replace("PORT", str(port))} }}
        """))
    proc = subprocess.Popen([_nginx(), "-c", str(conf), "-p", str(d)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc, f"nginx ({name})")
    except SystemExit:
        log = d / "error.log"
        sys.exit(f"nginx ({name}) did not start: {log.read_text().strip().splitlines()[-1] if log.exists() else '?'}")
    return proc, port


def start_upstream(kind: str, tmp: Path) -> tuple[subprocess.Popen, int]:
    if kind == "nginx":
        return start_nginx(tmp, "upstream", """server { listen 127.0.0.1:PORT;
            location / { default_type application/json; return 200 '{"ok": true, "answer": 42}\\n'; } }""")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(port)])
    _wait_port(port, proc, "the aiohttp upstream")
    return proc, port


def start_limit_req(tmp: Path, upstream_port: int) -> tuple[subprocess.Popen, int]:
    # limit_req at a rate no run reaches (nodelay): the module's bookkeeping on every request, no refusals
    return start_nginx(tmp, "front", f"""
        limit_req_zone $binary_remote_addr zone=one:1m rate=1000000r/s;
        upstream up {{ server 127.0.0.1:{upstream_port}; keepalive 64; }}
        server {{ listen 127.0.0.1:PORT;
            location / {{ limit_req zone=one burst=1000000 nodelay; proxy_pass http://up;
                          proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; }} }}""")


def start_guard(tmp: Path, upstream_port: int, controller: str) -> tuple[subprocess.Popen, int]:
    cfg = tmp / "guard.yaml"
    cfg.write_text(GUARD_CFG.replace("CONTROLLER", controller))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())",
                             "guard", "proxy", "--config", str(cfg), "--upstream", f"http://127.0.0.1:{upstream_port}",
                             "--listen", f"127.0.0.1:{port}"], env=env, stdout=subprocess.DEVNULL)
    _wait_port(port, proc, "gpuscope guard proxy")
    return proc, port


def cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def wrk(port: int, seconds: float, conns: int) -> dict:
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{max(1, int(seconds))}s", "--latency",
                          f"http://127.0.0.1:{port}/v1/completions"],
                         capture_output=True, text=True, timeout=seconds + 60).stdout
    rate = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    p50 = re.search(r"50%\s+([0-9.]+)(us|ms|s)\b", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errs = re.search(r"Socket errors: (.*)", out)
    if not (rate and total and p50):
        raise RuntimeError(f"wrk printed no figures: {out}")
    return {"rps": float(rate.group(1)), "requests": int(total.group(1)),
            "p50_s": float(p50.group(1)) * _UNITS[p50.group(2)], "non2xx": int(bad.group(1)) if bad else 0,
            "socket_errors": errs.group(1) if errs else ""}


def measure(port: int, pid: int | None, seconds: float, conns: int) -> dict:
    wrk(port, 1, conns)  # warm: the pools fill, the classifier's cache has the path
    before = cpu_s(pid) if pid else 0.0
    many = wrk(port, seconds, conns)
    spent = (cpu_s(pid) - before) if pid else 0.0
    one = wrk(port, max(2.0, seconds / 2), 1)
    return {"rps": many["rps"], "cpu_per_request_s": spent / many["requests"] if pid else None,
            "p50_one_s": one["p50_s"], "p50_many_s": many["p50_s"],
            "errors": many["non2xx"] + one["non2xx"], "socket_errors": many["socket_errors"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--upstream", choices=("aiohttp", "nginx"), default="aiohttp")
    ap.add_argument("--controller", choices=("fixed", "gradient", "aimd"), default="fixed",
                    help="the guard's concurrency controller (default fixed at 256: the data path alone; the "
                         "adaptive limit's own behaviour under load is another benchmark's)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    a = ap.parse_args()
    if not shutil.which("wrk"):
        sys.exit("wrk is not installed (Debian: apt-get install wrk).")
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tmp.chmod(0o755)
        try:
            up, up_port = start_upstream(a.upstream, tmp)
            procs.append(up)
            ngx, ngx_port = start_limit_req(tmp, up_port)
            procs.append(ngx)
            guard, guard_port = start_guard(tmp, up_port, a.controller)
            procs.append(guard)
            res = {"direct": measure(up_port, None, a.seconds, a.connections),
                   "nginx": measure(ngx_port, ngx.pid, a.seconds, a.connections),
                   "guard": measure(guard_port, guard.pid, a.seconds, a.connections)}
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    direct, nginx, guard_r = res["direct"], res["nginx"], res["guard"]
    print(f"{a.connections} connections and 1 connection, {a.seconds:g} s each, wrk -t1, upstream: {a.upstream}, "
          f"guard controller: {a.controller}")
    print(f"{'':8} {'req/s':>9} {'CPU/req':>9} {'p50 (1 conn)':>13} {'added p50':>10} {'p50 (many)':>11} errors")
    for name, r in res.items():
        cpu = f"{r['cpu_per_request_s'] * 1e6:7.1f}us" if r["cpu_per_request_s"] is not None else f"{'-':>9}"
        added = f"{(r['p50_one_s'] - direct['p50_one_s']) * 1e3:8.3f}ms" if name != "direct" else f"{'-':>10}"
        print(f"{name:8} {r['rps']:9.0f} {cpu} {r['p50_one_s'] * 1e3:11.3f}ms {added} {r['p50_many_s'] * 1e3:9.2f}ms "
              f"{r['errors']} {r['socket_errors']}")
    print(f"guard / nginx limit_req throughput = {guard_r['rps'] / nginx['rps']:.2f}x (goal >= 0.5); "
          f"guard / direct = {guard_r['rps'] / direct['rps']:.2f}x")
    print(f"guard CPU per request = {guard_r['cpu_per_request_s'] * 1e6:.1f} us (goal <= 50); "
          f"nginx {nginx['cpu_per_request_s'] * 1e6:.1f} us")
    print(f"added at p50 on one connection: guard {(guard_r['p50_one_s'] - direct['p50_one_s']) * 1e3:.3f} ms "
          f"(goal <= 0.2), nginx {(nginx['p50_one_s'] - direct['p50_one_s']) * 1e3:.3f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps({"upstream": a.upstream, "connections": a.connections,
                                            "seconds": a.seconds, **res}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
