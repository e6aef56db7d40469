"""The obvious peer of `gpuscope fleet report` (benchmarks/bench_fleet_scale.py): pull the raw series with
query_range at the scrape step, one metric and node at a time (in chunks under Prometheus's 11,000 points
per series), and sum them client-side into the same per-group figures.

    python benchmarks/fleet_scale_peer.py URL START_S END_S STEP_S OUT.json

A point at start + (j+1) x step is the sample scraped in the j-th step of the window (the server runs with
a lookback of one step, as staleness markers would make it: see bench_fleet_scale.LOOKBACK); the point at
start, the step before the window, is fetched too, as the counters' baseline. Counters are the GPU's,
whichever pod's labels they carried: their increase from one scraped step to the next goes to the group of
the later one, and a drop is a restart from 0.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fleet_scale_data as data  # noqa: E402

MAX_POINTS = 11_000  # Prometheus refuses a query_range of more points per series
FAMILIES = ("gpu_sm_active_ratio", "gpu_memory_used_bytes", "gpu_memory_total_bytes", "gpu_energy_joules_total",
            "gpu_throttle_seconds_total", "gpu_allocation_state", "gpu_process_memory_used_bytes")
HELD = {"allocated_idle", "in_use_by_pod", "in_use_outside_kubernetes"}


def _get(url: str, path: str, params: dict[str, Any]) -> Any:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(params)}", timeout=600) as r:
        doc = orjson.loads(r.read())
    if doc.get("status") != "success":
        raise SystemExit(f"peer query failed: {doc}")
    return doc["data"]


def _increase(c: np.ndarray) -> np.ndarray:
    """Per step, what a counter (NaN where not scraped) grew by since its previous scraped step."""
    out = np.zeros(len(c))
    at = np.flatnonzero(~np.isnan(c))
    if len(at) > 1:
        v = c[at]
        d = np.diff(v)
        out[at[1:]] = np.where(d >= 0, d, v[1:])
    return out


def _new_gpu(k: int) -> dict[str, Any]:
    return {"sm": np.full(k, np.nan, np.float32), "series": np.full(k, -1, np.int32), "mem": np.full(k, np.nan),
            "total": np.full(k, np.nan), "energy": np.full(k, np.nan), "throttle": {}, "k8s": False,
            "alloc": np.zeros(k, bool), "outside": np.zeros(k, bool), "proc": np.zeros(k, bool),
            "user": np.full(k, -1, np.int32)}


def fetch(url: str, start_s: int, end_s: int, step_s: int) -> tuple[dict[tuple[str, str], dict[str, Any]],
                                                                     dict[tuple[str, ...], int], dict[str, int], int]:
    """Per GPU (hostname, gpu), its arrays over the window's steps; the GPU label sets and users seen."""
    k = (end_s - start_s) // step_s + 1  # index 0: the step before the window
    hosts = sorted(_get(url, "/api/v1/label/hostname/values", {"start": start_s, "end": end_s}))
    series: dict[tuple[str, ...], int] = {}  # (namespace, pod, workload, hostname, model) -> id
    users: dict[str, int] = {}
    gpus: dict[tuple[str, str], dict[str, Any]] = {}
    queries = 0
    for host in hosts:
        for fam in FAMILIES:
            for c0 in range(0, k, MAX_POINTS - 1):
                c1 = min(k, c0 + MAX_POINTS - 1)
                res = _get(url, "/api/v1/query_range", {
                    "query": f'{fam}{{hostname="{host}"}}', "start": start_s + c0 * step_s,
                    "end": start_s + (c1 - 1) * step_s, "step": step_s})["result"]
                queries += 1
                for s in res:
                    _add(gpus, series, users, fam, s, start_s, step_s, k)
        for key, a in gpus.items():
            if key[0] == host:  # this node is whole: its counters become increases, the baseline step goes
                a["energy"] = _increase(a["energy"])
                a["throttle"] = sum((_increase(c) for c in a["throttle"].values()), np.zeros(k))
                for name in ("sm", "series", "mem", "total", "alloc", "outside", "proc", "user", "energy",
                             "throttle"):
                    a[name] = a[name][1:]
    return gpus, series, users, queries


def _add(gpus: dict[tuple[str, str], dict[str, Any]], series: dict[tuple[str, ...], int], users: dict[str, int],
         fam: str, s: dict[str, Any], start_s: int, step_s: int, k: int) -> None:
    m = s["metric"]
    pts = s["values"]
    j = np.rint((np.array([p[0] for p in pts], dtype=np.float64) - start_s) / step_s).astype(np.int64)
    v = np.array([p[1] for p in pts], dtype=np.float64)
    a = gpus.get((m["hostname"], m["gpu"]))
    if a is None:
        a = gpus[(m["hostname"], m["gpu"])] = _new_gpu(k)
    if fam == "gpu_sm_active_ratio":
        pod = f"{m['namespace']}/{m['pod']}" if m.get("pod") else ""
        a["sm"][j] = v
        a["series"][j] = series.setdefault((m.get("namespace", ""), pod, m.get("workload", ""), m["hostname"],
                                            m["model"]), len(series))
    elif fam == "gpu_memory_used_bytes":
        a["mem"][j] = v
    elif fam == "gpu_memory_total_bytes":
        a["total"][j] = v
    elif fam == "gpu_energy_joules_total":
        a["energy"][j] = v
    elif fam == "gpu_throttle_seconds_total":
        a["throttle"].setdefault(m["reason"], np.full(k, np.nan))[j] = v
    elif fam == "gpu_allocation_state":
        a["k8s"] = True
        if m["state"] in HELD:
            a["alloc"][j] |= v == 1
        if m["state"] == "in_use_outside_kubernetes":
            a["outside"][j] |= v == 1
    elif fam == "gpu_process_memory_used_bytes":
        a["user"][j] = users.setdefault(m.get("user", ""), len(users))
        a["proc"][j] = True


def groups(gpus: dict[tuple[str, str], dict[str, Any]], series: dict[tuple[str, ...], int], users: dict[str, int],
           step_s: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per --by dimension, per group: the figures bench_fleet_scale compares."""
    inv = {v: key for key, v in series.items()}
    uname = {v: key for key, v in users.items()}
    h = step_s / 3600
    out: dict[str, dict[str, dict[str, float]]] = {}
    for dim in data.DIMS:
        table: dict[str, dict[str, float]] = {}
        for a in gpus.values():
            obs = a["series"] >= 0
            alloc = (a["alloc"] if a["k8s"] else a["proc"]) & obs
            sm = np.nan_to_num(a["sm"]).astype(np.float64)
            ratio = np.nan_to_num(a["mem"] / a["total"])
            if dim == "user":
                gid = a["user"]
                name = {i: (uname[i] or data.NONE) for i in np.unique(gid[gid >= 0])}
                name[-1] = data.NONE  # scraped, no process
            else:
                idx = {"namespace": 0, "pod": 1, "job": 2, "node": 3, "model": 4}[dim]
                gid = a["series"]
                name = {i: (inv[i][idx] or data.NONE) for i in np.unique(gid[gid >= 0])}
            for i, group in name.items():
                sel = (gid == i) & obs
                if not sel.any():
                    continue
                g = table.setdefault(group, dict.fromkeys((*data.FIGURES, "memory_used_ratio_max"), 0.0))
                g["observed_gpu_hours"] += sel.sum() * h
                g["allocated_gpu_hours"] += (alloc & sel).sum() * h
                g["outside_kubernetes_gpu_hours"] += (a["outside"] & sel).sum() * h
                g["used_gpu_hours"] += float(sm[sel].sum()) * h
                g["idle_gpu_hours"] += (alloc & sel & (sm < data.SM_IDLE)).sum() * h
                g["energy_kwh"] += float(a["energy"][sel].sum()) / 3.6e6
                g["throttled_hours"] += float(a["throttle"][sel].sum()) / 3600
                g["memory_used_ratio_max"] = max(g["memory_used_ratio_max"], float(ratio[sel].max()))
        out[dim] = table
    return out


def main(argv: list[str]) -> int:
    url, start_s, end_s, step_s, out = argv
    t0 = time.perf_counter()
    gpus, series, users, queries = fetch(url, int(start_s), int(end_s), int(step_s))
    fetched = time.perf_counter() - t0
    res = {"groups": groups(gpus, series, users, int(step_s)), "queries": queries, "fetch_s": fetched,
           "gpus": len(gpus), "gpu_label_sets": len(series), "wall_s": time.perf_counter() - t0}
    Path(out).write_text(json.dumps(res, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
