"""Store benchmarks, each against plain SQLite rows (series_id, t, value) measured in the same run:

  (a) ingest: samples/s through Store.append(snapshot) (8 simulated GPUs x 59 series, processes and
      host, as the sampler makes them) and through the bulk Store.append_batch, on one core (the
      process is pinned to CPU 0), flushing, sealing and rolling up included;
  (b) size on disk for --hours of realistic series at 10 Hz (bench_store_data: METRICS.md
      signatures plus noise at the sampler's cadence) against the same data as SQLite rows;
  (c) range query: 1 h of 8 GPUs x 20 series at 1 s steps (mean), from a reader in read-only mode.

    python benchmarks/bench_store.py                 # ~1 minute: 3 h of data
    python benchmarks/bench_store.py --hours 24      # the full day (~5 minutes on 2 cores)

Goals (issue 3): ingest >= 1,000,000 samples/s; <= 2 bytes per sample on disk; query <= 100 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sqlite3
import statistics
import sys
import tempfile
import time
from itertools import repeat
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

import bench_store_data as data  # noqa: E402

from gpuscope.store import Store  # noqa: E402

T0 = 1_800_489_600 * 10**9  # on a week boundary, like a store that has run for a while
HOUR = 3600 * 10**9


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def plain_db(path: Path) -> sqlite3.Connection:
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("PRAGMA synchronous = NORMAL")
    con.execute("CREATE TABLE samples (series_id INTEGER, t INTEGER, value REAL, PRIMARY KEY (series_id, t)) "
                "WITHOUT ROWID")
    return con


def db_bytes(path: Path) -> int:
    return sum(os.path.getsize(str(path) + x) for x in ("", "-wal") if os.path.exists(str(path) + x))


# -- (a) ingest ----------------------------------------------------------------------------------------
def ingest_snapshots(tmp: Path, count: int) -> dict[str, float]:
    snaps = data.snapshots(count, T0)
    with Store(tmp / "snap") as store:
        c0, w0 = cpu(), time.perf_counter()
        append = store.append
        for s in snaps:
            append(s)
        store.flush()
        wall, used = time.perf_counter() - w0, cpu() - c0
        n = store.stats()["samples"]
    peer_n = min(count, 3000)
    ids: dict[tuple[str, str], int] = {}
    con = plain_db(tmp / "peer_snap.db")
    w0 = time.perf_counter()
    rows = 0
    for i, s in enumerate(snaps[:peer_n]):
        batch = []
        for g in s.gpus:
            label = g.identity.label
            for k, v in g.values.items():
                sid = ids.setdefault((label, k), len(ids))
                batch.append((sid, g.time_ns, v))
        if i % 10 == 0:
            for p in s.processes:
                for attr in ("gpu_memory_bytes", "sm_ratio", "memory_ratio", "cpu_cores", "thread_cpu_max_ratio",
                             "rss_bytes", "threads"):
                    batch.append((ids.setdefault((str(p.pid), attr), len(ids)), s.time_ns, getattr(p, attr)))
            if s.host:
                batch.extend((ids.setdefault(("host", k), len(ids)), s.host.time_ns, v) for k, v in s.host.values.items())
        if i % 10 == 0:
            con.execute("BEGIN")
        con.executemany("INSERT OR REPLACE INTO samples VALUES (?, ?, ?)", batch)
        if i % 10 == 9:
            con.execute("COMMIT")
        rows += len(batch)
    if con.in_transaction:
        con.execute("COMMIT")
    peer = rows / (time.perf_counter() - w0)
    con.close()
    return {"samples": n, "seconds": wall, "samples_per_s": n / wall, "samples_per_cpu_s": n / used,
            "peer_samples_per_s": peer, "append_us": wall / count * 1e6}


def ingest_bulk(tmp: Path, hours: float) -> tuple[dict[str, float], data.NodeData]:
    nd = data.NodeData(data.template(), T0)
    path = tmp / "bulk"
    store = Store(path, flush_interval=3600)
    c0, w0 = cpu(), time.perf_counter()
    gen = 0.0
    blocks = nd.blocks(hours * 3600, block_s=60)
    i = 0
    while True:
        g0 = time.perf_counter()
        item = next(blocks, None)
        gen += time.perf_counter() - g0
        if item is None:
            break
        store.append_batch(*item)
        i += 1
        if i % 17 == 0:  # a minute of the node: 8 GPUs, host and 8 processes
            store.flush()
    store.close()
    wall = time.perf_counter() - w0 - gen
    used = cpu() - c0 - gen
    st = Store(path, readonly=True)
    stats = st.stats()
    st.close()
    return {"samples": nd.samples, "seconds": wall, "samples_per_s": nd.samples / wall,
            "samples_per_cpu_s": nd.samples / used, "generate_s": gen, "stats": stats}, nd


# -- (b) size -------------------------------------------------------------------------------------------
def peer_rows(tmp: Path, name: str, minutes: float, keep: object = None, start_ns: int = T0) -> tuple[int, int, float, Path]:
    """The same generated data as plain rows; `keep(metric, labels)` selects series."""
    nd = data.NodeData(data.template(), T0)
    path = tmp / name
    con = plain_db(path)
    ids: dict[int, list[int]] = {}
    rows = 0
    w0 = time.perf_counter()
    for series, t, v in nd.blocks((start_ns - T0) / 1e9 + minutes * 60, block_s=60):
        if int(t[-1]) < start_ns:
            continue
        sids = ids.setdefault(id(series), [len(ids) * 1000 + j for j in range(len(series))])
        con.execute("BEGIN")
        tl = t.tolist()
        for j, (m, lab) in enumerate(series):
            if keep is None or keep(m, lab):  # type: ignore[operator]
                con.executemany("INSERT INTO samples VALUES (?, ?, ?)", zip(repeat(sids[j]), tl, v[:, j].tolist()))
                rows += len(tl)
        con.execute("COMMIT")
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    return rows, db_bytes(path), time.perf_counter() - w0, path


# -- (c) query -----------------------------------------------------------------------------------------
QUERY_METRICS = [
    "gpu_utilization_ratio", "gpu_memory_utilization_ratio", "gpu_sm_active_ratio", "gpu_sm_occupancy_ratio",
    "gpu_tensor_active_ratio", "gpu_dram_active_ratio", "gpu_fp32_active_ratio", "gpu_fp16_active_ratio",
    "gpu_power_watts", "gpu_energy_joules_total", "gpu_temperature_celsius", "gpu_memory_temperature_celsius",
    "gpu_memory_used_bytes", "gpu_memory_free_bytes", "gpu_sm_clock_hertz", "gpu_clock_event_reasons",
    "gpu_pcie_rx_bytes_per_second", "gpu_pcie_tx_bytes_per_second", "gpu_pcie_rx_bytes_total",
    "gpu_pcie_tx_bytes_total",
]


def query_store(path: Path, start: int, end: int, repeats: int = 5) -> tuple[float, int]:
    store = Store(path, readonly=True)
    try:
        times, points = [], 0
        for _ in range(repeats + 1):  # the first run fills the reader's caches
            w0 = time.perf_counter()
            points = 0
            for m in QUERY_METRICS:
                points += sum(len(r) for r in store.query(m, start, end, 1.0, agg="mean"))
            times.append(time.perf_counter() - w0)
        return statistics.median(times[1:]), points
    finally:
        store.close()


def query_peer(path: Path, start: int, end: int) -> tuple[float, int]:
    con = sqlite3.connect(path)
    sids = [r[0] for r in con.execute("SELECT DISTINCT series_id FROM samples")]
    times, points = [], 0
    for _ in range(3):
        w0 = time.perf_counter()
        rows = con.execute(f"SELECT series_id, (t - ?) / 1000000000 AS b, AVG(value) FROM samples WHERE series_id IN "
                           f"({','.join('?' * len(sids))}) AND t >= ? AND t < ? GROUP BY series_id, b",
                           (start, *sids, start, end)).fetchall()
        times.append(time.perf_counter() - w0)
        points = len(rows)
    con.close()
    return statistics.median(times), points


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=3.0, help="hours of 10 Hz node data for (b) and (c) (>= 2)")
    ap.add_argument("--snapshots", type=int, default=20_000, help="snapshots appended for (a)")
    ap.add_argument("--peer-minutes", type=float, default=10.0, help="minutes of the same data as plain rows for (b)")
    ap.add_argument("--all-cores", action="store_true", help="do not pin the process to one CPU")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args()
    if a.hours < 2:
        ap.error("--hours must be at least 2 (the query reads the second hour)")
    if not a.all_cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="gpuscope-bench-store-") as d:
        tmp = Path(d)
        snap = ingest_snapshots(tmp, a.snapshots)
        bulk, nd = ingest_bulk(tmp, a.hours)
        st = bulk.pop("stats")
        store_bytes = st["file_bytes"]
        tiers = {k: v["bytes"] for k, v in st["tiers"].items()}
        rows, peer_bytes, peer_s, _ = peer_rows(tmp, "peer_size.db", a.peer_minutes)
        past = (T0 + HOUR, T0 + 2 * HOUR)
        end = T0 + int(a.hours * HOUR)
        q_past, pts = query_store(tmp / "bulk", *past)
        q_last, _ = query_store(tmp / "bulk", end - HOUR, end)
        wanted = set(QUERY_METRICS)
        _, _, _, qpath = peer_rows(tmp, "peer_query.db", 60, lambda m, lab: m in wanted and "gpu" in lab, T0 + HOUR)
        q_peer, peer_pts = query_peer(qpath, *past)
    bps, peer_bps = store_bytes / bulk["samples"], peer_bytes / rows
    out = {"ingest_snapshots": snap, "ingest_bulk": bulk,
           "size": {"hours": a.hours, "samples": bulk["samples"], "file_bytes": store_bytes,
                    "bytes_per_sample": bps, "encoded_bytes_per_tier": tiers,
                    "encoded_bytes_per_sample": sum(tiers.values()) / bulk["samples"],
                    "peer_rows": rows, "peer_bytes": peer_bytes, "peer_bytes_per_sample": peer_bps},
           "query": {"series": 160, "points": pts, "past_hour_ms": q_past * 1e3, "last_hour_ms": q_last * 1e3,
                     "peer_ms": q_peer * 1e3, "peer_points": peer_pts}}
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"(a) ingest, append(snapshot): {snap['samples_per_s'] / 1e6:.2f} M samples/s "
          f"({snap['append_us']:.1f} us per snapshot of ~{snap['samples'] / a.snapshots:.0f} samples, flushes included) "
          f"vs plain SQLite rows {snap['peer_samples_per_s'] / 1e6:.2f} M/s -> {snap['samples_per_s'] / snap['peer_samples_per_s']:.1f}x"
          "   [goal >= 1.0 M/s]")
    print(f"    ingest, append_batch:     {bulk['samples_per_s'] / 1e6:.2f} M samples/s "
          f"({bulk['samples'] / 1e6:.0f} M samples, seal + rollups + retention included)")
    print(f"(b) size, {a.hours:g} h at 10 Hz: {bps:.3f} bytes/sample on disk ({store_bytes / 1e6:.1f} MB for "
          f"{bulk['samples'] / 1e6:.0f} M samples; encoded raw {tiers['raw'] / 1e6:.1f} MB, 1 s {tiers['1s'] / 1e6:.1f} MB, "
          f"1 min {tiers['1m'] / 1e6:.2f} MB, 1 h {tiers['1h'] / 1e6:.2f} MB) vs plain SQLite rows "
          f"{peer_bps:.1f} bytes/sample ({a.peer_minutes:g} min, {rows / 1e6:.1f} M rows) -> {peer_bps / bps:.0f}x smaller"
          "   [goal <= 2]")
    print(f"(c) query, 1 h x 8 GPUs x 20 series at 1 s (mean, read-only reader): past hour {q_past * 1e3:.0f} ms, "
          f"last hour (with the unsealed tail) {q_last * 1e3:.0f} ms, {pts:,} points vs plain SQLite GROUP BY "
          f"{q_peer * 1e3:.0f} ms -> {q_peer / q_past:.0f}x   [goal <= 100 ms]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
