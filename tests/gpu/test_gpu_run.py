"""`gpuscope run -- python <workload>.py` names each reference workload's bottleneck on a real GPU,
within 15 s of the workload reaching the GPU, and keeps naming it (`pytest -m gpu`).

Set GPUSCOPE_RECORD_DIR to keep each run's JSON report (series, spans, processes) and HTML report.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = Path(os.environ.get("GPUSCOPE_WORKLOADS", ROOT.parent / "shared" / "workloads"))
SECONDS = float(os.environ.get("GPUSCOPE_RUN_SECONDS", "30"))
WITHIN_S = 15.0

#: The labelled verdict (../shared/workloads/README.md); host-bound ones are told apart by the
#: process's stacks, and without permission to sample them the honest 'launch_or_sync_bound'.
EXPECTED = {
    "compute_bound": {"compute_bound"},
    "memory_bound": {"memory_bound"},
    "h2d_pageable": {"transfer_bound"},
    "launch_bound": {"launch_bound"},
    "input_starved": {"input_starved"},
    "sync_heavy": {"sync_bound"},
    "idle_allocated": {"idle_allocated"},
    "healthy_training": {"healthy", "compute_bound"},
}
FALLBACK = {"launch_bound": "launch_or_sync_bound", "sync_heavy": "launch_or_sync_bound",
            "input_starved": "launch_or_sync_bound"}


def steady_start(data: dict) -> float:
    """When the workload reached its steady state: its process on the GPU and, for a workload that
    computes, its loop started (the GPU busy in three samples in a row after set-up); a workload that
    never computes (idle_allocated) is steady once it is on the GPU."""
    start = data["gpu_start_s"]
    s = data["series"]["0"]
    util = s["gpu_utilization_ratio"]["mean"]
    busy = [t for i, t in enumerate(s["t"]) if t >= start and all(
        (util[j] or 0) >= 0.01 for j in range(i, min(i + 3, len(util))))]
    return busy[0] if busy else start


@pytest.mark.parametrize("name", list(EXPECTED))
def test_run_names_the_workloads_bottleneck(name, tmp_path):
    script = WORKLOADS / f"{name}.py"
    if not script.exists():
        pytest.skip(f"{script} not found (set GPUSCOPE_WORKLOADS)")
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA driver here")
    report = tmp_path / "run.json"
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "run", "--json", str(report), "--html",
                        str(tmp_path / "run.html"), "--", sys.executable, str(script), "--seconds", str(SECONDS)],
                       cwd=str(WORKLOADS), capture_output=True, text=True, timeout=SECONDS + 90)
    print(p.stderr[-3000:])
    assert p.returncode == 0, p.stderr[-2000:]
    data = json.loads(report.read_text())
    rec = os.environ.get("GPUSCOPE_RECORD_DIR")
    if rec:
        Path(rec).mkdir(parents=True, exist_ok=True)
        (Path(rec) / f"run_{name}.json.gz").write_bytes(gzip.compress(report.read_bytes()))
        shutil.copy(tmp_path / "run.html", Path(rec) / f"run_{name}.html")
    assert data["gpu_start_s"] is not None, "the workload's process was never seen on a GPU"
    start = steady_start(data)
    # each timeline segment is one verdict, made at its end_s (spans merge equal neighbours)
    spans = [s for s in data["timeline"] if s["primary"] and s["gpu"] == "0"]
    print(name, "on the GPU at", start, [(round(s["start_s"], 1), round(s["end_s"], 1), s["kind"]) for s in spans])
    stacks_ok = not any("stack_sampling" in (seg.get("evidence") or {}) for seg in data["timeline"])
    expected = set(EXPECTED[name]) if stacks_ok or name not in FALLBACK else {FALLBACK[name]}
    # 1. the labelled verdict, made within 15 s of the workload reaching the GPU
    first = next((s for s in spans if s["kind"] in expected), None)
    assert first is not None, (name, spans)
    made_at = first["end_s"]  # a verdict is made at the end of its window
    assert made_at - start <= WITHIN_S, (name, made_at, start, spans)
    # 2. no other bottleneck named while it runs (the last verdict, made as the program exits and
    #    frees its memory, aside)
    steady = [s for s in spans if made_at < s["end_s"] < data["duration_s"] - 1.0]
    wrong = [s for s in steady if s["kind"] not in expected]
    assert not wrong, (name, wrong)
    if name == "healthy_training":
        assert all(s["severity"] == "info" for s in spans)
