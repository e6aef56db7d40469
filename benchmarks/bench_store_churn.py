"""The store under process churn, alone (no agent): seal time and memory against the number of dead series.

A node with --gpus GPUs (--gpu-series series each) and --procs processes, each replaced every --churn seconds
by a new pid (7 series per process: gpu_process_* and process_*), sampled every --step seconds and flushed
after every snapshot, as the agent does. The clock is fake: the store's monotonic clock follows the stamps,
so an hour of data (six 10-minute raw blocks sealed) takes well under a minute of real time.

    .venv/bin/python benchmarks/bench_store_churn.py                   # 1 h, 100 processes, churn 60 s
    .venv/bin/python benchmarks/bench_store_churn.py --hours 2 --tracemalloc
    .venv/bin/python benchmarks/bench_store_churn.py --churn 0         # the control: no churn

Every sealed block prints one row: the series ever created, those still live, the series the writer
still knows, the slowest flush of the block (the seal) and the median one, the process's RSS and, with
--tracemalloc, the Python heap. The last line is the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from gpuscope import GpuIdentity, GpuRecord, HostRecord, ProcessRecord, Snapshot  # noqa: E402
from gpuscope.catalog import CATALOG  # noqa: E402
from gpuscope.store import Retention, Store  # noqa: E402

T0 = 1_800_489_600 * 10**9  # on a week boundary
SEC = 10**9
BLOCK = 600 * SEC
RETENTION = Retention(raw_s=600, rollup_1s_s=1800, max_bytes=256 << 20)  # the soak's (benchmarks/soak.py)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class FakeClock:
    def __init__(self) -> None:
        self.s = 0.0

    def __call__(self) -> float:
        return self.s


def identity(i: int) -> GpuIdentity:
    return GpuIdentity(index=i, uuid=f"GPU-churn-{i}", name="Test H200", memory_total_bytes=150 << 30)


def run(hours: float, gpus: int, gpu_series: int, procs: int, churn_s: float, step_s: float,
        trace: bool, path: Path) -> dict[str, object]:
    clock = FakeClock()
    ids = [identity(i) for i in range(gpus)]
    names = [m for m in sorted(CATALOG) if m.startswith("gpu_") and not m.startswith("gpu_process_")][:gpu_series]
    if trace:
        tracemalloc.start()
    rows: list[dict[str, object]] = []
    born = 0
    with Store(path, flush_interval=3600, retention=RETENTION, clock=clock, wall_clock_ns=lambda: T0) as store:
        w = store._writer
        assert w is not None
        ticks = int(hours * 3600 / step_s)
        pids = list(range(procs))
        started = [0.0] * procs
        next_pid = procs
        born = procs
        flushes: list[float] = []
        cpus: list[float] = []
        block = 0
        wall0 = time.perf_counter()
        for k in range(ticks):
            s = k * step_s
            t = T0 + int(s * SEC)
            clock.s = s
            if churn_s > 0:
                for i in range(procs):
                    # staggered: process i is replaced at i * churn/procs, then every churn seconds
                    if s - started[i] >= churn_s and (s - i * churn_s / procs) % churn_s < step_s:
                        pids[i], started[i] = next_pid, s
                        next_pid += 1
                        born += 1
            recs = [GpuRecord(ids[g], t, {n: (k + g + j) % 100 / 100 for j, n in enumerate(names)})
                    for g in range(gpus)]
            pr = [ProcessRecord(pid=100_000 + p, gpu=str(i % gpus), gpu_uuid=ids[i % gpus].uuid, type="compute",
                                name="job", user="bob", gpu_memory_bytes=float(1 << 30), sm_ratio=(k % 10) / 10,
                                memory_ratio=0.25, cpu_cores=1.0, thread_cpu_max_ratio=0.5,
                                rss_bytes=float(2 << 30), threads=8) for i, p in enumerate(pids)]
            store.append(Snapshot(t, recs, pr, HostRecord(t, {"host_cpu_ratio": 0.5}), [], None, "churnhost"))
            f0, c0 = time.perf_counter(), time.thread_time()
            store.flush()
            flushes.append(time.perf_counter() - f0)
            cpus.append(time.thread_time() - c0)
            if w.w[0] // BLOCK > block:  # this flush sealed a block
                block = w.w[0] // BLOCK
                row = {
                    "minute": round(s / 60, 1),
                    "series_created": w.reg._next_sid - 1,
                    "series_live": gpus * gpu_series + 1 + procs * 7,
                    "series_known": len(w.reg.metric),
                    "layouts_known": len(w.reg.layouts),
                    "hot_bufs": len(w.hot.bufs),
                    "seal_s": round(flushes[-1], 3),
                    "seal_cpu_s": round(cpus[-1], 3),
                    "median_flush_ms": round(statistics.median(flushes[:-1] or [0]) * 1e3, 2),
                    "rss_mb": round(rss_bytes() / 1e6, 1),
                }
                if trace:
                    row["heap_mb"] = round(tracemalloc.get_traced_memory()[0] / 1e6, 1)
                rows.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                flushes, cpus = [], []
        wall = time.perf_counter() - wall0
    return {"hours": hours, "gpus": gpus, "procs": procs, "churn_s": churn_s, "step_s": step_s,
            "pids_born": born, "wall_s": round(wall, 1), "blocks": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=1.0, help="simulated hours (default 1)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu-series", type=int, default=40, help="series per GPU (default 40)")
    ap.add_argument("--procs", type=int, default=100, help="processes running at any time (default 100)")
    ap.add_argument("--churn", type=float, default=60.0, help="seconds each process lives; 0: no churn (default 60)")
    ap.add_argument("--step", type=float, default=1.0, help="seconds between snapshots (default 1)")
    ap.add_argument("--tracemalloc", action="store_true", help="also report the Python heap (slower)")
    a = ap.parse_args()
    if a.hours <= 0 or a.step <= 0 or a.procs < 0 or a.gpus < 1 or a.churn < 0:
        ap.error("--hours and --step must be positive, --gpus at least 1, --procs and --churn not negative")
    with tempfile.TemporaryDirectory(prefix="gpuscope-churn-") as tmp:
        out = run(a.hours, a.gpus, a.gpu_series, a.procs, a.churn, a.step, a.tracemalloc, Path(tmp))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
