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
from workload_labels import EXPECTED, FALLBACK

from gpuscope import Sampler, SamplerConfig
from gpuscope.diagnose import SERIES, Profiler, diagnose, windows_from_snapshots

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = Path(os.environ.get("GPUSCOPE_WORKLOADS", ROOT.parent / "shared" / "workloads"))

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
    proc = subprocess.Popen([sys.executable, str(script), "--seconds", "30"], cwd=str(WORKLOADS),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        s.start()  # from the launch on: the start-up (torch import, allocation) is part of what it sees
        # Until 12 s after the GPU's first work (input_starved's set-up once took 12 s before its first kernel,
        # and the rules rightly give no verdict on a few seconds of work), at most 40 s.
        began, deadline = None, time.monotonic() + 40
        while time.monotonic() < deadline and (began is None or time.monotonic() < began + 12):
            time.sleep(0.5)
            last = s.latest()
            if began is None and last is not None and last.gpus and (
                    last.gpus[0].values.get("gpu_sm_active_ratio") or 0) > 0.01:
                began = time.monotonic()
        s.stop()
        snaps = list(s.history)
        window = [sn for sn in snaps if sn.time_ns >= snaps[-1].time_ns - 10 * 10**9]
        windows = windows_from_snapshots(window)
        verdicts = diagnose(windows, profiler=Profiler())  # the workload still runs: its stacks can be read
    finally:
        proc.wait(timeout=60)
    mine = [v for v in verdicts if v.gpu == "0"]
    print(name, [(v.kind, v.summary) for v in mine])
    rec_dir = os.environ.get("GPUSCOPE_RECORD_DIR")
    if rec_dir:
        rows = [{"t": sn.time_ns, **{k: sn.gpus[0].values.get(k) for k in SERIES}} for sn in snaps]
        views = {v.pid: v for w in windows for v in w.processes}
        procs = [{"pid": p.pid, "cpu_cores": p.cpu_cores, "thread_cpu_max_ratio": p.thread_cpu_max_ratio,
                  "gpu_memory_bytes": p.gpu_memory_bytes, "threads_busy": p.threads_busy,
                  "busy_threads": [[t.tid, t.name, t.cpu_ratio] for t in p.busy_threads], "sm_ratio": p.sm_ratio,
                  "utilization_ratio": p.utilization_ratio,
                  "profile": None if views.get(p.pid) is None or views[p.pid].profile is None else {
                      "samples": views[p.pid].profile.samples, "shares": views[p.pid].profile.shares,
                      "top": views[p.pid].profile.top}} for p in snaps[-1].processes]
        rec = {"workload": name, "gpu": snaps[0].gpus[0].identity.name,
               "memory_total_bytes": snaps[0].gpus[0].identity.memory_total_bytes,
               "sm_clock_max_hertz": snaps[0].gpus[0].identity.sm_clock_max_hertz,
               "processes": procs, "series": rows, "verdicts": [v.kind for v in mine]}
        Path(rec_dir).mkdir(parents=True, exist_ok=True)
        (Path(rec_dir) / f"{name}.json.gz").write_bytes(gzip.compress(json.dumps(rec).encode()))
    primary = {v.kind for v in mine if v.primary}
    sampled = not any("stack_sampling" in v.evidence for v in mine)
    expected = EXPECTED[name] if sampled or name not in FALLBACK else {FALLBACK[name]}
    assert primary & expected, (name, [(v.kind, v.summary) for v in mine])
