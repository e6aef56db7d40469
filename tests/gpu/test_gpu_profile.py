"""GPU time by stack from a real PyTorch process (`pytest -m gpu`): the agent on the real GPU asks a process
started with `gpuscope trace --on-demand` (a torchrun rank by its environment) for a window, folds the trace it
writes, and `gpuscope profile` writes a pprof whose GPU time is the trace's and whose stacks name the workload's
own line, labelled with the job."""

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
from test_agent import AgentProc, env, http  # tests/ is on sys.path through its conftest.py

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = Path(os.environ.get("GPUSCOPE_WORKLOADS", ROOT.parent / "shared" / "workloads"))


def wait_for(what, timeout: float = 90.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError("timed out")


def test_a_real_pytorch_window_becomes_a_pprof_by_stack_and_job(tmp_path):
    script = WORKLOADS / "launch_bound.py"
    if not script.exists() or shutil.which("nvidia-smi") is None:
        pytest.skip("needs the reference workloads (GPUSCOPE_WORKLOADS) and an NVIDIA driver")
    agent = AgentProc(tmp_path)
    prog = None
    try:
        agent.wait_ready(60)  # its data directory exists from here on: --agent-dir must name one
        e = {**env(), "TORCHELASTIC_RUN_ID": "gpu-profile", "WORKLOAD_SECONDS": "60"}
        prog = subprocess.Popen([sys.executable, "-m", "gpuscope.cli", "trace", "--on-demand", "--agent-dir",
                                 str(agent.data), "--", sys.executable, str(script)], env=e, cwd=str(WORKLOADS),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        token = agent.token()

        def api(path, body=None):
            code, out = http(agent.port, path, token, method="POST" if body else "GET",
                             data=json.dumps(body).encode() if body else None)
            return code, out

        wait_for(lambda: json.loads(api("/api/v1/traces")[1])["opted_in"])
        code, out = api("/api/v1/trace", {"duration": "3s"})
        assert code == 202, out
        traces = agent.data / "traces"
        cache = wait_for(lambda: list(traces.glob("*.pt.trace.json.gz.profile.json")))[0]
        trace_file = traces / cache.name.removesuffix(".profile.json")

        out = tmp_path / "gpu.pb.gz"
        r = subprocess.run([sys.executable, "-m", "gpuscope.cli", "profile", "--agents",
                            f"http://127.0.0.1:{agent.port}", "--data-dir", str(agent.data), "--out", str(out)],
                           env=env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr

        from gpuscope.trace._pprof.profile_pb2 import Profile

        p = Profile.FromString(gzip.decompress(out.read_bytes()))
        s = list(p.string_table)
        assert [(s[t.type], s[t.unit]) for t in p.sample_type] == [("gpu_time", "nanoseconds"), ("launches", "count")]
        doc = json.loads(gzip.decompress(trace_file.read_bytes()))
        gpu = [ev for ev in doc["traceEvents"] if ev.get("ph") == "X" and ev.get("cat") in ("kernel", "gpu_memcpy",
                                                                                          "gpu_memset")]
        assert sum(x.value[1] for x in p.sample) == len(gpu) > 1000
        want_ns = sum(round(ev["dur"] * 1000) for ev in gpu)
        assert abs(sum(x.value[0] for x in p.sample) - want_ns) <= len(gpu)  # µs with 3 decimals in the file
        jobs = {s[lab.str] for x in p.sample for lab in x.label if s[lab.key] == "job"}
        assert jobs == {"torchrun/gpu-profile"}
        functions = {f.id: (s[f.name], os.path.basename(s[f.filename])) for f in p.function}
        # most of the GPU time is charged to the workload's own step() (its file and line), not left unattributed
        step_ids = {loc.id for loc in p.location if functions[loc.line[0].function_id] == ("step", "launch_bound.py")
                    and loc.line[0].line > 0}
        assert step_ids
        in_step = sum(x.value[0] for x in p.sample if step_ids & set(x.location_id))
        assert in_step > 0.9 * want_ns
    finally:
        if prog is not None:
            prog.kill()
            prog.wait()
        agent.stop()
