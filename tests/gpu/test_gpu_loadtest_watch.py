"""On a real NVIDIA GPU (`pytest -m gpu`): the load tester's GpuWatch reads this host's GPU at 10 Hz or
more, sees SM activity while a matmul loop runs, and join_stages turns the readings into energy."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gpuscope.loadtest.gpu import GpuWatch, join_stages

pytestmark = pytest.mark.gpu

_MATMULS = """
import time, torch
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
print("ready", flush=True)
end = time.monotonic() + float(__import__("sys").argv[1])
while time.monotonic() < end:
    for _ in range(20):
        y = x @ x
    torch.cuda.synchronize()
"""


def test_watch_reads_sm_activity_at_10_hz_and_energy_under_load():
    pytest.importorskip("torch")
    clock = (time.time(), time.perf_counter())
    w = GpuWatch(hz=10.0, clock=clock)
    w.start()
    assert w.source.startswith("nvml"), w.source
    proc = subprocess.Popen([sys.executable, "-c", _MATMULS, "4"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        t_load = time.perf_counter() - clock[1]
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    t_end = time.perf_counter() - clock[1]
    readings = w.stop()
    gpus = {r.gpu for r in readings}
    for g in gpus:
        mine = [r for r in readings if r.gpu == g and t_load <= r.t <= t_end]
        rate = (len(mine) - 1) / (mine[-1].t - mine[0].t)
        assert rate >= 10.0, (g, rate)
    busy = [r.sm_active for r in readings if t_load + 0.5 <= r.t <= t_end - 0.5 and r.sm_active is not None]
    assert busy and max(busy) > 0.5, busy[:20]  # one of the GPUs ran the matmuls
    summary = {"stages": [{"index": 0, "name": "load", "start_s": t_load, "end_s": t_end,
                           "stats": {"completed": 100, "output_tokens": 1000}}],
               "overall": {"completed": 100, "output_tokens": 1000}}
    join_stages(summary, readings, source=w.source)
    g = summary["stages"][0]["gpu"]
    assert g["energy_j"] > 0 and g["j_per_request"] > 0 and g["j_per_output_token"] > 0
    assert g["sm_active_p95"] > 0.5 and g["power_w_mean"] > 50
