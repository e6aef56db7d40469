"""One trace of a job across nodes with real PyTorch (`pytest -m gpu`): two agents (simulated nodes, so that
two samplers do not both read the GPU's GPM; one's clock 250 ms ahead through the test-only shift), each with
a real PyTorch rank opted in on demand, traced by `gpuscope trace fleet` at one moment and merged on one
clock. What the tests on the dev machine cannot show: the real profiler's start cost in each window's start,
and real Kineto traces through the pull, the shift and the merge."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_agent import env  # tests/ is on sys.path through its conftest.py
from test_trace_fleet import SHIFT_NS, TOKEN, Agent, _true_start_ns

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = Path(os.environ.get("GPUSCOPE_WORKLOADS", ROOT.parent / "shared" / "workloads"))


def test_two_real_pytorch_ranks_under_two_agents_merge_on_one_clock(tmp_path):
    script = WORKLOADS / "launch_bound.py"
    if not script.exists() or shutil.which("nvidia-smi") is None:
        pytest.skip("needs the reference workloads (GPUSCOPE_WORKLOADS) and an NVIDIA driver")
    agents = [Agent(tmp_path, i, SHIFT_NS if i == 1 else 0) for i in range(2)]
    progs: list[subprocess.Popen] = []
    try:
        for a in agents:
            a.wait_ready()
        for i, a in enumerate(agents):
            e = {**env(), "TORCHELASTIC_RUN_ID": "gpu-fleet", "RANK": str(i), "WORKLOAD_SECONDS": "120"}
            progs.append(subprocess.Popen([sys.executable, "-m", "gpuscope.cli", "trace", "--on-demand", "--agent-dir",
                                           str(a.data), "--", sys.executable, str(script)], env=e, cwd=str(WORKLOADS),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        end = time.monotonic() + 120
        while not all(a.opted_in() for a in agents):
            assert time.monotonic() < end, "the ranks never opted in"
            time.sleep(0.5)
        out = tmp_path / "job.pt.trace.json.gz"
        r = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "fleet", "--job", "torchrun/gpu-fleet",
                            "--agents", *[a.url for a in agents], "--duration", "3s", "--out", str(out), "--json"],
                           env={**env(), "GPUSCOPE_TOKEN": TOKEN}, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr + r.stdout
        s = json.loads(r.stdout)
        print(json.dumps({k: s[k] for k in ("agents", "ranks", "phases_s")}, indent=1))  # the figures, with -s
    finally:
        for p in progs:
            p.terminate()
        for p in progs:
            p.wait(60)
        for a in agents:
            a.stop()
    assert sorted(x["rank"] for x in s["ranks"]) == [0, 1] and s["missing"] == []
    by_url = {a["url"]: a for a in s["agents"]}
    for x in s["ranks"]:
        a = next(g for g in agents if g.url == x["url"])
        true_error_ns = _true_start_ns(a, by_url[a.url]["request_id"], x["pid"]) - s["start_unix_ns"]
        bound_ns = max(1_000_000, by_url[a.url]["offset_error_ns"])
        assert abs(x["start_error_ns"] - true_error_ns) <= bound_ns, (x, true_error_ns, by_url[a.url])
        assert true_error_ns >= -1_000_000
    merged = json.loads(gzip.decompress(out.read_bytes()))
    kernels = {}
    for ev in merged["traceEvents"]:
        if ev.get("cat") == "kernel":
            kernels.setdefault(ev["pid"] // 10**7 - 1, []).append(ev["ts"])
    assert sorted(kernels) == [0, 1] and all(len(v) > 100 for v in kernels.values())
    # both ranks' kernels on one clock: their first kernels within the window's start error of each other,
    # not 250 ms apart
    firsts = [min(v) for v in kernels.values()]
    late_us = max(abs(x["start_error_ns"]) for x in s["ranks"]) / 1000
    assert abs(firsts[0] - firsts[1]) <= late_us + 50_000, (firsts, late_us)
