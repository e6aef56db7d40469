"""gpuscope's trace loader + analyses against Holistic Trace Analysis on a >= 1 M-event Kineto trace.

    python benchmarks/bench_trace_analyze.py [--events 1000000] [--hta-python /path/to/python]

The trace is the launch_bound golden trace (20 k complete events, 3 steps of a launch-bound loop on the
H200) tiled end to end: each copy shifted past the previous one, its correlation, External, Python and
flow ids offset so that every launch still meets its own kernel. Each side runs in its own process (time
from start to result, peak RSS from getrusage), ours first. HTA needs `pip install HolisticTraceAnalysis`
(it pulls pandas, plotly, jupyterlab: kept out of our dependencies); --hta-python points at an
interpreter that has it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "traces" / "launch_bound.pt.trace.json.gz"

OURS = """
import resource, sys, time
t0 = time.perf_counter()
from gpuscope.trace.kineto import load
from gpuscope.trace.analyze import analyze
report = analyze(load(sys.argv[1]))
wall = time.perf_counter() - t0
print(wall, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, report.temporal[0].idle_ratio,
      sum(k.count for k in report.kernels))
"""

HTA = """
import logging, resource, sys, time, warnings
warnings.simplefilter("ignore")
logging.disable(logging.CRITICAL)
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[2])
temporal = a.get_temporal_breakdown(visualize=False)
a.get_idle_time_breakdown(visualize=False)
kernels = a.get_gpu_kernel_breakdown(visualize=False)
a.get_cuda_kernel_launch_stats(visualize=False)
wall = time.perf_counter() - t0
print(wall, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, temporal["idle_time_pctg"][0] / 100,
      len(kernels[1]))
"""


def tiled(copies: int) -> dict:
    doc = json.loads(gzip.decompress(FIXTURE.read_bytes()))
    events = doc["traceEvents"]
    timed = [e for e in events if e.get("ph") == "X"]
    span_us = max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed) + 1000.0

    def biggest(get):
        return max((v for v in map(get, events) if isinstance(v, int)), default=0) + 1

    corr_step = biggest(lambda e: (e.get("args") or {}).get("correlation"))
    ext_step = biggest(lambda e: (e.get("args") or {}).get("External id"))
    py_step = biggest(lambda e: (e.get("args") or {}).get("Python id"))
    flow_step = biggest(lambda e: e.get("id"))
    out = [e for e in events if e.get("ph") == "M"]
    body = [e for e in events if e.get("ph") != "M"]
    for c in range(copies):
        for e in body:
            e = dict(e)
            if "ts" in e:
                e["ts"] = e["ts"] + c * span_us
            if isinstance(e.get("id"), int):
                e["id"] += c * flow_step
            if e.get("args"):
                a = e["args"] = dict(e["args"])
                for key, step in (("correlation", corr_step), ("External id", ext_step), ("Python id", py_step),
                                  ("Python parent id", py_step)):
                    if isinstance(a.get(key), int):
                        a[key] += c * step
            out.append(e)
    doc["traceEvents"] = out
    doc["distributedInfo"] = {"backend": "nccl", "rank": 0, "world_size": 1}  # HTA reads the rank from here
    return doc


def measure(python: str, script: str, *argv: str) -> tuple[float, int, float, int]:
    done = subprocess.run([python, "-c", script, *argv], check=True, capture_output=True, text=True)
    wall, rss, idle, kernels = done.stdout.split()[-4:]
    return float(wall), int(rss), float(idle), int(kernels)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=1_000_000, help="at least this many complete events")
    p.add_argument("--hta-python", default=sys.executable, help="a Python interpreter with HTA installed")
    args = p.parse_args()
    per_copy = sum(1 for e in json.loads(gzip.decompress(FIXTURE.read_bytes()))["traceEvents"] if e.get("ph") == "X")
    copies = math.ceil(args.events / per_copy)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.pt.trace.json")
        doc = tiled(copies)
        with open(path, "w") as f:
            json.dump(doc, f)
        n_all, n_x = len(doc["traceEvents"]), sum(1 for e in doc["traceEvents"] if e.get("ph") == "X")
        del doc
        print(f"trace: {copies} copies of launch_bound, {n_x:,} complete events ({n_all:,} in all), "
              f"{os.path.getsize(path) / 1e6:.0f} MB of JSON")
        ours = measure(sys.executable, OURS, path, tmp)
        print(f"gpuscope: {ours[0]:6.2f} s, peak RSS {ours[1] / 2**20:7.0f} MiB  (idle {ours[2]:.1%}, {ours[3]:,} kernels)")
        try:
            hta = measure(args.hta_python, HTA, path, tmp)
        except subprocess.CalledProcessError as e:
            print(f"HTA did not run with {args.hta_python}: {e.stderr.strip().splitlines()[-1]}")
            return 1
        print(f"HTA:      {hta[0]:6.2f} s, peak RSS {hta[1] / 2**20:7.0f} MiB  (idle {hta[2]:.1%}: HTA rounds events "
              "inward to whole us)")
        print(f"gpuscope / HTA: time {ours[0] / hta[0]:.3f}, memory {ours[1] / hta[1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
