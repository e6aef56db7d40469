"""A server that closes each connection after one answer without saying `Connection: close` (HTTP/1.1
allows it): gpuscope loadtest vs hey, same server, same run.

    python benchmarks/bench_loadtest_http11.py [--seconds 20] [--rate 200] [--latency-ms 50] [--method POST]
        [--before-src DIR]    # also run the load generator from another source tree (e.g. the code before)

Starts a scripted asyncio server on a free loopback port (its own process): each request waits a delay drawn
from a seeded uniform distribution (--latency-ms ± 50 %), gets `200 OK` with a Content-Length and no
Connection header, and the server closes the connection at once. The delays it applied are the true
latencies (written at its exit). Then, for --seconds each:
- gpuscope loadtest, one worker, open loop at --rate req/s (Poisson): disconnect %, retried %, p50/p90 from
  the intended send; the same from --before-src when given;
- hey (Debian: apt-get install hey), --rate split over 20 workers (`-c 20 -q rate/20`): error %, p50/p90.
Prints one table: each tool's figures beside the server's own p50/p90. Loopback only, bounded by --seconds.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SERVER = r'''
import asyncio, json, random, signal, sys
port_file, delays_file, latency_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
rng = random.Random(1)
delays = []

async def handle(reader, writer):
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        n = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                n = int(line.split(b":")[1])
        if n:
            await reader.readexactly(n)
        d = rng.uniform(0.5 * latency_s, 1.5 * latency_s)
        await asyncio.sleep(d)
        delays.append(d)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok")
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    writer.close()   # after each answer, without having said Connection: close

async def main():
    srv = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    with open(port_file, "w") as f:
        f.write(str(srv.sockets[0].getsockname()[1]))
    await stop.wait()
    with open(delays_file, "w") as f:
        json.dump(delays, f)

asyncio.run(main())
'''

OURS = r'''
import json, sys
from gpuscope.loadtest import schedule as S
from gpuscope.loadtest.requests import Protocol
from gpuscope.loadtest.runner import execute, summarize
from gpuscope.loadtest.worker import WorkerConfig
url, seconds, rate, method = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
proto = Protocol(method=method, body='{"n": {seq}}' if method == "POST" else "")
cfg = WorkerConfig(url=url, proto=proto, timeout_s=10.0, plan=S.plan([S.Stage(seconds, rate=rate)], seed=1))
s = summarize(cfg, execute(cfg, 1), url=url, protocol="http", stage_names=["o"])
print(json.dumps({"overall": s["overall"], "client": s["client"], "valid": s["valid"],
                  "reasons": s["invalid_reasons"], "src": __import__("gpuscope").__file__}))
'''


def start_server(tmp: Path, latency_s: float) -> tuple[subprocess.Popen, str, Path]:
    port_file, delays = tmp / "port", tmp / "delays.json"
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port_file), str(delays), str(latency_s)])
    for _ in range(200):
        if port_file.exists() and port_file.read_text():
            break
        time.sleep(0.05)
    port = int(port_file.read_text())
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    return proc, f"http://127.0.0.1:{port}/", delays


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(q * len(xs) + 0.5) - 1))]


def ours(url: str, seconds: float, rate: float, src: str | None, method: str) -> dict:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", OURS, url, str(seconds), str(rate), method], capture_output=True, text=True,
                         timeout=seconds + 120, env=env, cwd="/")
    if out.returncode != 0:
        raise RuntimeError(f"gpuscope loadtest failed: {out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    o = r["overall"]
    n = o["requests"] or 1
    return {"tool": f"gpuscope loadtest ({'--before-src' if src else 'this tree'})", "requests": o["requests"],
            "disconnect_pct": 100 * o["errors"].get("disconnect", 0) / n,
            "other_errors": {k: v for k, v in o["errors"].items() if k != "disconnect"},
            "retried_pct": 100 * o.get("retried", 0) / n,
            "p50_ms": (o["latency_ms"] or {}).get("p50"), "p90_ms": (o["latency_ms"] or {}).get("p90"),
            "valid": r["valid"], "reasons": r["reasons"], "cpu_percent": r["client"]["cpu_percent"], "src": r["src"]}


def hey(url: str, seconds: float, rate: float, method: str) -> dict:
    exe = shutil.which("hey")
    if exe is None:
        sys.exit("hey is not installed (Debian: apt-get install hey).")
    workers = 20
    body = ["-m", "POST", "-d", '{"n": 1}', "-T", "application/json"] if method == "POST" else []
    out = subprocess.run([exe, "-z", f"{int(seconds)}s", "-c", str(workers), "-q", f"{rate / workers:g}", "-t", "10",
                          *body, url], capture_output=True, text=True, timeout=seconds + 60).stdout
    ok = sum(int(n) for n in re.findall(r"\[\d{3}\]\s+(\d+) responses", out))
    errs = sum(int(n) for n in re.findall(r"^\s+\[(\d+)\]\s", out.split("Error distribution:")[-1], re.M)) \
        if "Error distribution:" in out else 0
    pct = {int(p): float(s) * 1000 for p, s in re.findall(r"(\d+)% in ([0-9.]+) secs", out)}
    n = ok + errs or 1
    return {"tool": "hey (-c 20)", "requests": ok + errs, "disconnect_pct": 100 * errs / n, "other_errors": {},
            "retried_pct": None, "p50_ms": pct.get(50), "p90_ms": pct.get(90), "valid": None, "cpu_percent": None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--method", default="GET", choices=("GET", "POST"))
    ap.add_argument("--before-src", help="a source tree (its src/ directory) to run the load generator from too")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        proc, url, delays_file = start_server(Path(d), a.latency_ms / 1000)
        try:
            if a.before_src:
                rows.append(ours(url, a.seconds, a.rate, a.before_src, a.method))
            rows.append(ours(url, a.seconds, a.rate, None, a.method))
            rows.append(hey(url, a.seconds, a.rate, a.method))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
        delays = [x * 1000 for x in json.loads(delays_file.read_text())]
    true50, true90 = quantile(delays, 0.5), quantile(delays, 0.9)
    print(f"server closing after each answer, no Connection header; {a.method} at {a.rate:g} req/s for {a.seconds:g} s each; "
          f"server delays {a.latency_ms * 0.5:g}-{a.latency_ms * 1.5:g} ms")
    print(f"  the server's own delays (all runs): p50 {true50:.1f} ms, p90 {true90:.1f} ms, {len(delays)} answers")
    print(f"  {'tool':34} {'requests':>8} {'disconnect %':>12} {'retried %':>9} {'p50 ms':>7} {'p90 ms':>7}  valid")
    for r in rows:
        def f(v: float | None, fmt: str = "{:.1f}") -> str:
            return "–" if v is None else fmt.format(v)
        print(f"  {r['tool']:34} {r['requests']:8d} {f(r['disconnect_pct'], '{:.2f}'):>12} "
              f"{f(r['retried_pct'], '{:.2f}'):>9} {f(r['p50_ms']):>7} {f(r['p90_ms']):>7}  "
              f"{'–' if r['valid'] is None else r['valid']}"
              + (f"  other errors {r['other_errors']}" if r["other_errors"] else "")
              + (f"  ({'; '.join(r['reasons'])})" if r.get("reasons") else ""))
    print(json.dumps({"true_p50_ms": true50, "true_p90_ms": true90, "rows": rows}))


if __name__ == "__main__":
    main()
