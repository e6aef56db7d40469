"""What the live views show, as plain JSON-able dicts: one shape for `gpuscope top`, the web dashboard,
the agent's /ui/api/overview and the Prometheus-backed dashboard.

    overview = {
      "source": "agent" | "local" | "prometheus",
      "simulated": "mixed" | None,        # the scenario when any of this is simulated
      "time_ns": int,
      "gpus": [gpu, ...],                  # ordered by host, then GPU index
      "processes": [process, ...],         # every process on every GPU (the views sort and cut)
      "alerts": {"firing": [...], "pending": [...]},   # as /api/v1/alerts gives them; empty if none
      "host_values": {METRIC: float | None},   # the node's CPU and memory (HOST_METRICS); None in a fleet
      "errors": [str, ...],                # what could not be read, one sentence each
    }
    gpu = {
      "key": "host/0",                    # unique over a fleet: host + '/' + the gpu label
      "host": str, "gpu": "0" | "0/mig3", "uuid": str, "name": str,
      "healthy": bool,                    # False once the GPU is lost
      "simulated": str | None,
      "values": {METRIC: float | None},   # canonical metric names from GPU_METRICS, base units
      "throttle": [str, ...],             # active clock-event reasons that slow the GPU
      "verdict": {"kind", "severity", "confidence", "summary"} | None,   # the primary one
      "side": [{"kind", "severity", "summary"}, ...],                      # side verdicts
      "allocation": {"state": str | None, "pods": [{"namespace", "pod", "container"}, ...]} | None,
                                          # Kubernetes (gpu_allocation_state); None where the agent reads no kubelet
    }
    process = {
      "key": "host/pid/gpu", "host": str, "gpu_key": str, "gpu": str, "pid": int, "user": str,
      "name": str, "command": str,        # command line, secrets already redacted by the sampler
      "gpu_memory_bytes", "sm_ratio", "cpu_cores", "rss_bytes": float | None,
      "container": str, "pod": str, "namespace": str, "started_at": float | None,
      "ppid": int | None,                 # parent pid when known (for the tree view)
      "verdict": {"kind", "severity", "confidence", "summary"} | None,   # its own on a shared GPU (the GPU
                                          # verdict's `processes`); on a GPU it has alone, the GPU's
    }
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from .catalog import ALLOCATION_STATES, series_key

# The numbers a GPU panel shows; every backend fills what it can and leaves the rest None.
GPU_METRICS: tuple[str, ...] = (
    "gpu_sm_active_ratio", "gpu_sm_occupancy_ratio", "gpu_tensor_active_ratio", "gpu_fp32_active_ratio",
    "gpu_fp16_active_ratio", "gpu_fp64_active_ratio", "gpu_dram_active_ratio", "gpu_utilization_ratio",
    "gpu_memory_used_bytes", "gpu_memory_total_bytes", "gpu_power_watts", "gpu_power_limit_watts",
    "gpu_temperature_celsius", "gpu_sm_clock_hertz", "gpu_sm_clock_max_hertz",
    "gpu_pcie_rx_bytes_per_second", "gpu_pcie_tx_bytes_per_second",
    "gpu_nvlink_rx_bytes_per_second", "gpu_nvlink_tx_bytes_per_second",
)

# The host's numbers `gpuscope top` shows beside nvitop's CPU and MEM bars, as the host source names them.
HOST_METRICS: tuple[str, ...] = ("host_cpu_ratio", "host_memory_used_bytes", "host_memory_total_bytes", "host_load1")

# Clock-event reasons that are not a slowdown (the GPU is idle, or an application/user chose it).
_BENIGN_REASONS = frozenset({"gpu_idle", "applications_clocks", "sync_boost", "display_clock"})


def _num(v: Any) -> float | None:
    """A finite number, or None: a NaN or infinity from a source would print as 'nan%' and crash the
    sparkline's rounding, and JSON cannot carry it."""
    return v if v is None or (isinstance(v, int | float) and math.isfinite(v)) else None


def gpu_key(host: str, gpu: str) -> str:
    return f"{host}/{gpu}"


def verdict_dict(v: Any) -> dict[str, Any]:
    get = v.get if isinstance(v, dict) else (lambda k, d=None: getattr(v, k, d))
    return {"kind": get("kind"), "severity": get("severity", "info"),
            "confidence": get("confidence", 0.0), "summary": get("summary", "")}


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def from_snapshot(snapshot: Any, verdicts: Iterable[Any] = (), *, source: str = "agent",
                  alerts: dict[str, Any] | None = None, host: str | None = None,
                  with_ppid: bool = True) -> dict[str, Any]:
    """The overview of one node from a sampler Snapshot (or its asdict() form, as /api/v1/latest gives
    it) and the verdicts that hold now (diagnose.Verdict or dicts)."""
    snap = snapshot if isinstance(snapshot, dict) else _asdict(snapshot)
    host = host or snap.get("hostname") or os.uname().nodename
    primary: dict[str, dict[str, Any]] = {}
    side: dict[str, list[dict[str, Any]]] = {}
    own: dict[tuple[str, int], dict[str, Any]] = {}  # (gpu, pid) -> its own verdict on a shared GPU
    for v in verdicts:
        d = v if isinstance(v, dict) else _asdict(v)
        gpu = str(d.get("gpu"))
        if d.get("primary", True):
            if gpu not in primary:
                for pv in d.get("processes") or []:
                    if pv.get("primary", True) and isinstance(pv.get("pid"), int):
                        own.setdefault((gpu, pv["pid"]), verdict_dict(pv))
            primary.setdefault(gpu, verdict_dict(d))
        else:
            side.setdefault(gpu, []).append({"kind": d.get("kind"), "severity": d.get("severity", "info"),
                                             "summary": d.get("summary", "")})
    gpus = []
    for g in snap.get("gpus", []):
        ident = g["identity"]
        label = _label(ident)
        values = g.get("values", {})
        vals: dict[str, float | None] = {m: _num(values.get(m)) for m in GPU_METRICS}
        if vals["gpu_memory_total_bytes"] is None and ident.get("memory_total_bytes"):
            vals["gpu_memory_total_bytes"] = float(ident["memory_total_bytes"])
        if vals["gpu_power_limit_watts"] is None and ident.get("power_limit_watts"):
            vals["gpu_power_limit_watts"] = float(ident["power_limit_watts"])
        if vals["gpu_sm_clock_max_hertz"] is None and ident.get("sm_clock_max_hertz"):
            vals["gpu_sm_clock_max_hertz"] = float(ident["sm_clock_max_hertz"])
        gpus.append({
            "key": gpu_key(host, label), "host": host, "gpu": label, "uuid": ident.get("uuid", ""),
            "name": ident.get("name", ""), "healthy": bool(g.get("healthy", True)),
            "simulated": snap.get("simulated"), "values": vals,
            "throttle": [r for r in g.get("throttle_reasons", []) if r not in _BENIGN_REASONS],
            "verdict": primary.get(label), "side": side.get(label, []),
            "allocation": _allocation(values, g.get("allocated_to") or []),
        })
    procs = []
    alone: dict[str, bool] = {}  # GPUs with one process: its verdict is the GPU's
    for p in snap.get("processes", []):
        label = str(p.get("gpu"))
        alone[label] = label not in alone
    for p in snap.get("processes", []):
        label = str(p.get("gpu"))
        pid = int(p["pid"])
        procs.append({
            "key": f"{host}/{pid}/{label}", "host": host, "gpu_key": gpu_key(host, label), "gpu": label,
            "pid": pid, "user": p.get("user", ""), "name": p.get("name", ""), "command": p.get("cmdline", ""),
            "gpu_memory_bytes": _num(p.get("gpu_memory_bytes")), "sm_ratio": _num(p.get("sm_ratio")),
            "cpu_cores": _num(p.get("cpu_cores")), "rss_bytes": _num(p.get("rss_bytes")),
            "container": p.get("container", ""), "pod": p.get("pod", ""), "namespace": p.get("namespace", ""),
            "started_at": p.get("started_at"),
            "ppid": _ppid(pid) if with_ppid and p.get("host_visible", True) and not snap.get("simulated") else None,
            "verdict": own.get((label, pid)) or (primary.get(label) if alone[label] else None),
        })
    host_values = (snap.get("host") or {}).get("values") or {}
    return {"source": source, "simulated": snap.get("simulated"), "time_ns": int(snap.get("time_ns") or time.time_ns()),
            "gpus": gpus, "processes": procs, "host_values": {m: _num(host_values.get(m)) for m in HOST_METRICS},
            "alerts": {"firing": list((alerts or {}).get("firing", [])), "pending": list((alerts or {}).get("pending", []))},
            "errors": []}


_STATE_KEYS = {s: series_key("gpu_allocation_state", state=s) for s in ALLOCATION_STATES}


def _allocation(values: dict[str, Any], held: list[Any]) -> dict[str, Any] | None:
    state = next((s for s, k in _STATE_KEYS.items() if values.get(k) == 1.0), None)
    pods = [h if isinstance(h, dict) else {"namespace": h.namespace, "pod": h.pod, "container": h.container}
            for h in held]
    if state is None and not pods:
        return None
    return {"state": state, "pods": [{k: str(p.get(k, "")) for k in ("namespace", "pod", "container")} for p in pods]}


def merge(overviews: Sequence[dict[str, Any]], source: str) -> dict[str, Any]:
    """One overview of several nodes (a fleet)."""
    out: dict[str, Any] = {"source": source, "simulated": None, "time_ns": 0, "gpus": [], "processes": [],
                           "alerts": {"firing": [], "pending": []}, "errors": []}
    for o in overviews:
        out["simulated"] = out["simulated"] or o.get("simulated")
        out["time_ns"] = max(out["time_ns"], int(o.get("time_ns") or 0))
        out["gpus"].extend(o.get("gpus", []))
        out["processes"].extend(o.get("processes", []))
        for k in ("firing", "pending"):
            out["alerts"][k].extend(o.get("alerts", {}).get(k, []))
        out["errors"].extend(o.get("errors", []))
    one = overviews[0].get("host_values") if len(overviews) == 1 else None
    out["host_values"] = dict(one) if one else {m: None for m in HOST_METRICS}
    out["gpus"].sort(key=lambda g: (g["host"], _gpu_order(g["gpu"])))
    return out


def _gpu_order(label: str) -> tuple[int, str]:
    head = label.split("/", 1)[0]
    return (int(head), label) if head.isdigit() else (1 << 30, label)


def _label(ident: dict[str, Any]) -> str:
    if ident.get("parent_index") is None:
        return str(ident.get("index"))
    return f"{ident['parent_index']}/mig{ident.get('gpu_instance_id')}"


def _asdict(o: Any) -> dict[str, Any]:
    from dataclasses import asdict, is_dataclass

    if is_dataclass(o):
        d = asdict(o)
        if hasattr(o, "hostname"):
            d.setdefault("hostname", o.hostname)
        return d
    return dict(o)
