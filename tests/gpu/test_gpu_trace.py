"""`gpuscope trace -- python <workload>.py` on a real GPU with real torch writes Kineto traces with
kernels (`pytest -m gpu`); two traced processes with RANK=0/1 merge into one timeline.

The runs go side by side on the one GPU (this checks what is written, not speed: that is
benchmarks/bench_trace_overhead.py), so the whole file takes about a minute.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = Path(os.environ.get("GPUSCOPE_WORKLOADS", ROOT.parent / "shared" / "workloads"))
NAMES = ["launch_bound", "sync_heavy", "h2d_pageable", "healthy_training"]
TRACE = [sys.executable, "-m", "gpuscope.cli", "trace", "--delay", "3", "--duration", "3"]


def _need(name: str) -> Path:
    script = WORKLOADS / f"{name}.py"
    if not script.exists():
        pytest.skip(f"{script} not found (set GPUSCOPE_WORKLOADS)")
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA driver here")
    return script


def _read(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def test_each_workload_traced_unchanged(tmp_path):
    scripts = {n: _need(n) for n in NAMES}
    procs = {n: subprocess.Popen([*TRACE, "--out", str(tmp_path / n), "--samples", "--", sys.executable, str(s),
                                  "--seconds", "12"], cwd=str(WORKLOADS), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for n, s in scripts.items()}
    for name, p in procs.items():
        out, err = p.communicate(timeout=240)
        print(name, err[-3000:])
        assert p.returncode == 0, (name, err[-2000:])
        assert "steps_per_s=" in out, (name, out)  # the program's stdout passes untouched
        [f] = sorted((tmp_path / name).glob("*.pt.trace.json.gz"))
        doc = _read(f)
        kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
        cpu_ops = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
        assert kernels, name
        assert cpu_ops, (name, "no CPU ops: the main thread's ops were not recorded from the helper thread")
        assert doc["gpuscope"]["cpu_ops_all_threads"] is True
        span_s = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / 1e6
        assert 1.0 < span_s < 6.0, (name, span_s)  # the 3 s window, not the whole run
        assert f.name in err and "kernels" in err
        [pf] = sorted((tmp_path / name).glob("*.perfetto.json.gz"))
        assert any(e["ph"] == "C" and e["name"] == "SM active %" for e in _read(pf)["traceEvents"])


def test_two_ranks_traced_and_merged(tmp_path):
    script = _need("healthy_training")
    both = (f"RANK=0 {sys.executable} {script} --seconds 10 & a=$!; RANK=1 {sys.executable} {script} --seconds 10; "
            "b=$?; wait $a; exit $(( $? | b ))")
    p = subprocess.run([*TRACE, "--no-stack", "--out", str(tmp_path), "--", "sh", "-c", both], cwd=str(WORKLOADS),
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    files = sorted(tmp_path.glob("*.pt.trace.json.gz"))
    assert sorted(re.search(r"\.(rank\d)\.", f.name).group(1) for f in files) == ["rank0", "rank1"], files
    out = tmp_path / "merged.json.gz"
    m = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "merge", *map(str, files), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert m.returncode == 0, m.stderr
    doc = _read(out)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert any(n.startswith("rank 0") for n in names) and any(n.startswith("rank 1") for n in names)
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    assert len({e["pid"] for e in kernels}) == 2
    # both ranks traced the same 3 s of one clock: their kernel spans overlap
    spans = {}
    for e in kernels:
        lo, hi = spans.get(e["pid"], (e["ts"], e["ts"]))
        spans[e["pid"]] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
    (a0, a1), (b0, b1) = spans.values()
    assert min(a1, b1) > max(a0, b0), spans
