"""Verdicts for every reference workload on a real GPU (`pytest -m gpu`), and recordings of them.

Set GPUSCOPE_RECORD_DIR to keep each run's series (with the workload process's CPU and busiest thread)
as golden fixtures for the diagnosis tests.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuscope import Sampler, SamplerConfig
from gpuscope.diagnose import SERIES, diagnose, windows_from_snapshots

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = Path(os.environ.get("GPUSCOPE_WORKLOADS", ROOT.parent / "shared" / "workloads"))

EXPECTED = {
    "compute_bound": {"compute_bound"},
    "memory_bound": {"memory_bound"},
    "h2d_pageable": {"transfer_bound"},
    "launch_bound": {"launch_or_sync_bound"},
    "input_starved": {"input_starved"},
    "sync_heavy": {"launch_or_sync_bound"},
    "idle_allocated": {"idle_allocated"},
    "healthy_training": {"healthy", "compute_bound"},
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_workload_verdict(name):
    script = WORKLOADS / f"{name}.py"
    if not script.exists():
        pytest.skip(f"{script} not found (set GPUSCOPE_WORKLOADS)")
    s = Sampler(SamplerConfig(interval=0.1))
    try:
        s.open()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no usable NVIDIA GPU: {e}")
    proc = subprocess.Popen([sys.executable, str(script), "--seconds", "17"], cwd=str(WORKLOADS),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(4.0)  # import torch, allocate, warm up
        s.start()
        time.sleep(11.0)
        s.stop()
    finally:
        proc.wait(timeout=60)
    snaps = list(s.history)
    verdicts = diagnose(windows_from_snapshots(snaps))
    mine = [v for v in verdicts if v.gpu == "0"]
    print(name, [(v.kind, v.summary) for v in mine])
    rec_dir = os.environ.get("GPUSCOPE_RECORD_DIR")
    if rec_dir:
        rows = [{"t": sn.time_ns, **{k: sn.gpus[0].values.get(k) for k in SERIES}} for sn in snaps]
        procs = [{"pid": p.pid, "cpu_cores": p.cpu_cores, "thread_cpu_max_ratio": p.thread_cpu_max_ratio,
                  "gpu_memory_bytes": p.gpu_memory_bytes} for p in snaps[-1].processes]
        rec = {"workload": name, "gpu": snaps[0].gpus[0].identity.name,
               "memory_total_bytes": snaps[0].gpus[0].identity.memory_total_bytes,
               "sm_clock_max_hertz": snaps[0].gpus[0].identity.sm_clock_max_hertz,
               "processes": procs, "series": rows, "verdicts": [v.kind for v in mine]}
        Path(rec_dir).mkdir(parents=True, exist_ok=True)
        (Path(rec_dir) / f"{name}.json.gz").write_bytes(gzip.compress(json.dumps(rec).encode()))
    primary = {v.kind for v in mine if v.primary}
    assert primary & EXPECTED[name], (name, [(v.kind, v.summary) for v in mine])
