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
from workload_labels import EXPECTED, FALLBACK, WITHIN_S, steady_start

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = Path(os.environ.get("GPUSCOPE_WORKLOADS", ROOT.parent / "shared" / "workloads"))
SECONDS = float(os.environ.get("GPUSCOPE_RUN_SECONDS", "30"))


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
