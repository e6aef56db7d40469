"""On a real NVIDIA GPU (`pytest -m gpu`): every supported metric reads a plausible value, and the
reference workloads show their measured signatures under the sampler.

The workloads live in ../shared/workloads; set GPUSCOPE_WORKLOADS to another copy if needed.
Each run's per-metric medians are written to $GPUSCOPE_RECORD_DIR (if set) for golden fixtures.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuscope import Sampler

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = Path(os.environ.get("GPUSCOPE_WORKLOADS", ROOT.parent / "shared" / "workloads"))
RECORD_DIR = os.environ.get("GPUSCOPE_RECORD_DIR")

PLAUSIBLE = {
    "gpu_utilization_ratio": (0, 1), "gpu_memory_utilization_ratio": (0, 1),
    "gpu_memory_used_bytes": (0, 1 << 41), "gpu_memory_total_bytes": (1 << 30, 1 << 41),
    "gpu_power_watts": (10, 1500), "gpu_power_limit_watts": (50, 1500),
    "gpu_temperature_celsius": (5, 110), "gpu_memory_temperature_celsius": (5, 120),
    "gpu_sm_clock_hertz": (100e6, 3.5e9), "gpu_memory_clock_hertz": (100e6, 20e9),
    "gpu_energy_joules_total": (1, 1e15), "gpu_performance_state": (0, 15),
    "gpu_sm_active_ratio": (0, 1), "gpu_sm_occupancy_ratio": (0, 1), "gpu_tensor_active_ratio": (0, 1),
    "gpu_dram_active_ratio": (0, 1), "gpu_pcie_rx_bytes_per_second": (0, 200e9),
    "gpu_pcie_link_generation": (1, 6), "gpu_pcie_link_width": (1, 32),
}


def test_every_supported_metric_is_plausible(sampler):
    time.sleep(1.5)
    sampler._next_due.clear()  # force every cadence group once
    snap = sampler.sample_once()
    caps = sampler.capabilities()
    g = snap.gpus[0]
    assert g.healthy and g.identity.uuid.startswith("GPU-")
    checked = 0
    for name, (lo, hi) in PLAUSIBLE.items():
        cap = caps[g.identity.label].get(name)
        if cap is None or not cap.supported:
            continue
        v = g.get(name)
        assert v is not None, f"{name} is marked supported but has no value"
        assert lo <= v <= hi, f"{name}={v} outside [{lo}, {hi}]"
        checked += 1
    assert checked >= 12
    if g.identity.architecture in ("Hopper", "Blackwell"):
        assert caps[g.identity.label]["gpu_sm_active_ratio"].supported
    # Every unsupported metric says why.
    for name, cap in caps[g.identity.label].items():
        if not cap.supported:
            assert cap.reason, name


def _workload(name: str, seconds: float, sampler: Sampler) -> tuple[dict[str, float], list, int]:
    script = WORKLOADS / f"{name}.py"
    if not script.exists():
        pytest.skip(f"{script} not found (set GPUSCOPE_WORKLOADS)")
    proc = subprocess.Popen([sys.executable, str(script), "--seconds", str(seconds)], cwd=str(WORKLOADS),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    snaps = []
    start = time.monotonic()
    steady_after = 4.0  # CUDA context, allocation and warm-up
    while proc.poll() is None:
        time.sleep(0.1)
        s = sampler.latest()
        if s is not None and time.monotonic() - start > steady_after:
            snaps.append(s)
    out = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode == 0, out
    snaps = snaps[:-3]  # the tail may include teardown
    assert len(snaps) > 20, f"only {len(snaps)} steady snapshots"
    keys = ["gpu_utilization_ratio", "gpu_sm_active_ratio", "gpu_sm_occupancy_ratio", "gpu_tensor_active_ratio",
            "gpu_fp32_active_ratio", "gpu_dram_active_ratio", "gpu_pcie_rx_bytes_per_second", "gpu_power_watts",
            "gpu_memory_used_bytes", "gpu_clock_event_reasons", "gpu_sm_clock_hertz"]
    med = {}
    for k in keys:
        vals = [s.gpus[0].get(k) for s in snaps if s.gpus[0].get(k) is not None]
        if vals:
            med[k] = statistics.median(vals)
    procs = [p for s in snaps for p in s.processes if p.pid == proc.pid]
    if RECORD_DIR:
        rec = {"workload": name, "medians": med, "gpu": snaps[0].gpus[0].identity.name,
               "process_cpu_cores": statistics.median([p.cpu_cores for p in procs if p.cpu_cores is not None] or [0]),
               "series": [{"t": s.time_ns, **{k: s.gpus[0].get(k) for k in keys}} for s in snaps]}
        Path(RECORD_DIR).mkdir(parents=True, exist_ok=True)
        (Path(RECORD_DIR) / f"{name}.json").write_text(json.dumps(rec))
    print(name, json.dumps({k: round(v, 4) for k, v in med.items()}), out.strip())
    return med, procs, proc.pid


def test_compute_bound_signature(sampler):
    med, procs, pid = _workload("compute_bound", 12, sampler)
    assert med["gpu_tensor_active_ratio"] > 0.5
    assert med["gpu_sm_active_ratio"] > 0.8
    assert med["gpu_utilization_ratio"] > 0.9
    # Attributed to the workload's process, with its CPU use joined from the host.
    assert procs, "the workload's process was not attributed"
    assert any(p.cpu_cores is not None and p.cpu_cores > 0.3 for p in procs)
    assert all(p.gpu_memory_bytes and p.gpu_memory_bytes > 100 << 20 for p in procs)
    assert "python" in procs[-1].cmdline and "compute_bound" in procs[-1].cmdline


def test_memory_bound_signature(sampler):
    med, procs, _ = _workload("memory_bound", 12, sampler)
    assert med["gpu_dram_active_ratio"] > 0.6
    assert med["gpu_tensor_active_ratio"] < 0.05
    assert procs


def test_h2d_pageable_signature(sampler):
    med, procs, _ = _workload("h2d_pageable", 12, sampler)
    # NVML 'utilization' counts the copies as busy; the SMs are not.
    assert med["gpu_sm_active_ratio"] < 0.05
    assert med["gpu_utilization_ratio"] >= 0.05
    assert med["gpu_utilization_ratio"] > 3 * med["gpu_sm_active_ratio"]
    assert med["gpu_pcie_rx_bytes_per_second"] > 1e9
    assert any(p.cpu_cores is not None and p.cpu_cores > 0.5 for p in procs)


def test_energy_counter_tracks_power(sampler):
    snap0 = sampler.latest()
    time.sleep(6.0)  # spans at least one hardware energy read
    snap1 = sampler.latest()
    g0, g1 = snap0.gpus[0], snap1.gpus[0]
    de = g1["gpu_energy_joules_total"] - g0["gpu_energy_joules_total"]
    dt = (g1.identity and (snap1.time_ns - snap0.time_ns) / 1e9)
    avg_p = (g0["gpu_power_watts"] + g1["gpu_power_watts"]) / 2
    assert de > 0
    assert 0.5 * avg_p * dt < de < 1.6 * avg_p * dt, (de, avg_p, dt)


def test_sampler_self_accounting(sampler):
    ov = sampler.overhead()
    assert ov["ticks"] > 50
    calls = {c["call"]: c for c in ov["nvml_calls"]}
    assert calls["nvmlDeviceGetUtilizationRates"]["median_us"] < 1000
    print(json.dumps(ov["nvml_calls"], indent=0))
