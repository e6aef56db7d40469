"""Issue 21 on a real GPU (`pytest -m gpu`): `gpuscope run --json F -- python3 WORKLOAD` over each of its
workloads (tests/gpu/workloads) gives the verdict the workload's docstring names, within 15 s of its steady
state, and keeps it (tests/issue21_labels.py holds the checks, which the recordings' replay makes too):

- shared_two, shared_four: each process of the shared GPU its own verdict (the bf16 matmuls compute_bound on
  their share, the .item() loop sync_bound, the tiny launches launch_bound, the 4 GiB holder idle_allocated),
  and the GPU's verdict says it is shared, by which processes;
- jax_eager: never idle, launch_bound, its fixes in JAX's words (jax.jit), none of PyTorch's;
- cupy_loop, numba_kernel: the GPU waits on the host, with CuPy's and Numba's fixes;
- fp32_gemm: tensor_cores_unused, PyTorch's fix;
- a healthy process (the matmul loop beside the others) gets nothing but healthy verdicts.

Set GPUSCOPE_RECORD_DIR to keep each run's JSON report (run_<workload>.json.gz, the golden recordings of
tests/fixtures/recordings/runs) and HTML report. GPUSCOPE_ISSUE21_SECONDS: each workload's seconds (20).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from issue21_labels import FRAMEWORK, NAMES, ROLES, check, check_report, live, roles

pytestmark = pytest.mark.gpu

WORKLOADS = Path(__file__).parent / "workloads"
SECONDS = float(os.environ.get("GPUSCOPE_ISSUE21_SECONDS", "20"))
MODULE = {"torch": "torch", "jax": "jax", "cupy": "cupy", "numba": "numba"}


_RUNS: dict[str, tuple[subprocess.CompletedProcess[str], dict]] = {}  # one run per workload serves its tests


def _run(name: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    if name not in _RUNS:
        _RUNS[name] = _run_once(name, tmp_path)
        _show(name, _RUNS[name][1])
    return _RUNS[name]


def _run_once(name: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA driver here")
    if importlib.util.find_spec(MODULE[FRAMEWORK[name]]) is None:
        pytest.skip(f"{MODULE[FRAMEWORK[name]]} is not installed here")
    report = tmp_path / "run.json"
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "run", "--json", str(report), "--html",
                        str(tmp_path / "run.html"), "--", sys.executable, f"{name}.py", "--seconds", str(SECONDS)],
                       cwd=str(WORKLOADS), capture_output=True, text=True, timeout=SECONDS + 120)
    print(p.stdout[-1500:])
    print(p.stderr[-3000:])
    assert p.returncode == 0, p.stderr[-2000:]
    rec = os.environ.get("GPUSCOPE_RECORD_DIR")
    if rec:
        Path(rec).mkdir(parents=True, exist_ok=True)
        (Path(rec) / f"run_{name}.json.gz").write_bytes(gzip.compress(report.read_bytes(), mtime=0))
        shutil.copy(tmp_path / "run.html", Path(rec) / f"run_{name}.html")
    return p, json.loads(report.read_text())


def _show(name: str, data: dict) -> None:
    """The verdicts seen, for the log: each window's GPU verdict and its processes' own."""
    who = {pid: role for role, pid in roles(data).items()} if name in ROLES else {}
    print(name, "on the GPU at", data["gpu_start_s"], "duration", round(data["duration_s"], 1))
    for m in live(data):
        own = {who.get(pid, pid): v.kind for pid, v in m.processes.items()}
        print(f"  {m.t:5.1f} s  {m.kind:22s} {own or ''}  {m.summary[:160]}")
    for r in data["processes"]:
        print("  row", r["pid"], r["gpu"], r["name"], r["frameworks"], r.get("verdict"), r.get("verdict_share"),
              "cpu", r["cpu_cores_mean"], "thread", r["thread_cpu_max_ratio"], "busy", r["threads_busy_max"],
              "sm", r["sm_ratio_mean"])
    for s in data["timeline"]:
        ev = s["evidence"]
        if "stack_shares" in ev:
            print("  stacks (GPU)", s["end_s"], ev["stack_shares"], ev["stack_top_lines"])
        for p in s.get("processes") or []:
            if "stack_shares" in p["evidence"]:
                print("  stacks", who.get(p["pid"], p["pid"]), s["end_s"], p["evidence"]["stack_shares"],
                      p["evidence"]["stack_top_lines"])
    print("  change first:", data["change_first"])


@pytest.mark.parametrize("name", NAMES)
def test_run_gives_each_workload_its_verdict(name, tmp_path):
    p, data = _run(name, tmp_path)
    assert data["gpu_start_s"] is not None, "the workload's processes were never seen on a GPU"
    check(name, data, live(data), data["duration_s"] - 1.0)
    check_report(name, data)
    if name in ROLES:  # the end-of-run text lists what limited each process of the shared GPU
        for role, pid in roles(data).items():
            row = next(r for r in data["processes"] if r["pid"] == pid and r["gpu"] == "0")
            assert f"process {pid} ({row['name']}): {row['verdict']} " in p.stderr, (role, p.stderr[-2000:])
