"""The load generator's closed-loop throughput from two source trees, alternated against one nginx, same run.

    python benchmarks/bench_loadtest_rps_ab.py --before-src DIR [--rounds 8] [--seconds 5]

Uses bench_loadtest_rps.py's nginx and its closed-loop run (64 connections, one worker), each round in a
fresh process with PYTHONPATH set to the tree (`git archive REV src | tar -x -C DIR` gives one), the order
swapped every round; then wrk -t1 once. Prints requests/s and the worker's CPU time per request for each
tree (median, and the paired difference per round), which a shared machine disturbs less than requests/s.
Then the client's own path per request in process, no network (a canned nginx answer through
Client.send and _Conn.data_received into the stage statistics; CPU time, the least of 30 x 50,000 in each
of 6 processes per tree), which isolates what a change to the client costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_loadtest_rps as rps  # noqa: E402

ONE = r'''
import json, sys
from gpuscope.loadtest import schedule as S
from gpuscope.loadtest.requests import Protocol
from gpuscope.loadtest.runner import execute
from gpuscope.loadtest.worker import WorkerConfig
url, seconds = sys.argv[1], float(sys.argv[2])
cfg = WorkerConfig(url=url, proto=Protocol(), keep_records=False, plan=S.plan([S.Stage(seconds, concurrency=64)]))
res = execute(cfg, 1)
n = sum(a.completed for a in res.accs)
assert not any(a.errors for a in res.accs)
print(json.dumps([n / seconds, res.cpu_percent[0] / 100 * seconds / n * 1e6]))
'''


PATH = r'''
import time
from gpuscope.loadtest import client as C
from gpuscope.loadtest.records import RequestRecord
from gpuscope.loadtest.stats import Acc
class T:
    def write(self, d): pass
    def is_closing(self): return False
    def close(self): pass
cl = C.Client("http://127.0.0.1:1/", t0=time.perf_counter(), timeout_s=1e9)
cl._timer_at = -1.0   # no timer: nothing here times out
conn = C._Conn(cl); conn.transport = T(); cl._all.add(conn); cl._idle.append(conn)
payload = C.encode_request(cl.target, "GET", "/index.html", {}, b"")
answer = (b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Wed, 02 Dec 2026 02:00:00 GMT\r\nContent-Type: text/html"
          b"\r\nContent-Length: 6\r\nLast-Modified: Wed, 02 Dec 2026 01:00:00 GMT\r\nConnection: keep-alive\r\n"
          b"ETag: \"x\"\r\nAccept-Ranges: bytes\r\n\r\nhello\n")
acc = Acc()
def done(r): acc.add(r, metrics_as="vllm", late_s=0.005, slo={})
best = 1e9
for _ in range(30):
    t = time.process_time()
    for i in range(50000):
        cl.send(RequestRecord(i=i, stage=0, worker=0, t_intended=0.0, t_sent=0.0), payload, done)
        conn.data_received(answer)
    best = min(best, (time.process_time() - t) / 50000 * 1e6)
print(best)
'''


def client_path_us(src: str) -> float:
    out = subprocess.run([sys.executable, "-c", PATH], capture_output=True, text=True, cwd="/",
                         env={**os.environ, "PYTHONPATH": src}, timeout=600)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return float(out.stdout.strip().splitlines()[-1])


def one(url: str, src: str, seconds: float) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", ONE, url, str(seconds)], capture_output=True, text=True, cwd="/",
                         env={**os.environ, "PYTHONPATH": src}, timeout=seconds + 120)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    rate, cpu_us = json.loads(out.stdout.strip().splitlines()[-1])
    return rate, cpu_us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before-src", required=True, help="the src/ directory of the other tree")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    a = ap.parse_args()
    trees = {"before": a.before_src, "this tree": str(Path(__file__).resolve().parent.parent / "src")}
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in trees}
    with tempfile.TemporaryDirectory() as d:
        proc, url = rps.start_nginx(Path(d))
        try:
            for k in range(a.rounds):
                for name in (list(trees) if k % 2 == 0 else list(trees)[::-1]):
                    got[name].append(one(url, trees[name], a.seconds))
            w = rps.wrk(url, 10, 64)
        finally:
            proc.terminate()
            proc.wait(5)
    print(f"closed loop, 64 connections, one worker, nginx static file, {a.rounds} rounds of {a.seconds:g} s:")
    for name, rows in got.items():
        print(f"  {name:10} req/s median {statistics.median(r[0] for r in rows):8.0f}  CPU/request median "
              f"{statistics.median(r[1] for r in rows):6.2f} us  (per round: {[round(r[1], 1) for r in rows]})")
    diff = [b[1] - a_[1] for a_, b in zip(got["before"], got["this tree"], strict=True)]
    print(f"  paired CPU/request difference (this tree - before): median {statistics.median(diff):+.2f} us")
    print(f"  wrk -t1: {w:.0f} req/s")
    path: dict[str, list[float]] = {k: [] for k in trees}
    for _ in range(6):
        for name, src in trees.items():
            path[name].append(client_path_us(src))
    print("the client's path per request, in process (least CPU time of each of 6 processes):")
    for name, vals in path.items():
        print(f"  {name:10} min {min(vals):.2f} us  median {statistics.median(vals):.2f} us  {[round(v, 2) for v in vals]}")


if __name__ == "__main__":
    main()
