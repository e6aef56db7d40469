"""Shared GPU on a real H200 (`pytest -m gpu`): four processes with different loads time-slice GPU 0; their SM
shares (NVML per-process utilization scaled to GPM SM activity) sum to the GPU's SM activity within ±5 % and
rank in the order of their loads.

Each worker runs bursts of four bf16 8192³ matrix products, then sleeps 0, 20, 80 or 300 ms: the first keeps
the GPU busy, the others time-slice with it for less and less of the time. (Bursts of 24, 12, 6 and 2
products with one 60 ms sleep overlapped so much under time-slicing that the first two shares came within
5 % of each other: 0.212 and 0.202.) The figures go to $GPUSCOPE_BENCH_OUT/shares.json where that is set
(BENCHMARKS.md, "Shared GPUs (issue 19)").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gpuscope import Sampler, SamplerConfig

pytestmark = pytest.mark.gpu

SLEEPS = (0.0, 0.02, 0.08, 0.3)  # seconds between bursts: the loads, heaviest first
WORKER = r"""
import sys, time, torch
pause = float(sys.argv[1])
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
print("ready", flush=True)
t_end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < t_end:
    for _ in range(4):
        c = a @ b
    torch.cuda.synchronize()
    if pause:
        time.sleep(pause)
"""


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def test_four_processes_share_gpu0_in_proportion(tmp_path):
    pytest.importorskip("torch")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    s = Sampler(SamplerConfig(interval=0.1, process_utilization=1.0, collect_host=False))
    try:
        s.open()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no usable NVIDIA GPU: {e}")
    dev0 = next(d for d in s.devices if d.identity.index == 0 and not d.is_mig)
    if dev0.identity.mig_mode or not dev0.identity.gpm_supported:
        s.stop()
        pytest.skip("needs GPU 0 without MIG and with GPM (Hopper or newer)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(dev0.identity.index)}
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(p), "60"], env=env, stdout=subprocess.PIPE,
                                text=True) for p in SLEEPS]
    try:
        for w in workers:
            assert w.stdout is not None and w.stdout.readline().strip() == "ready"
        pids = [w.pid for w in workers]
        s.start()
        # Settle: two per-process windows with all four running, then measure twelve more.
        time.sleep(2.5)
        snaps = []
        t_end = time.monotonic() + 12.0
        while time.monotonic() < t_end:
            time.sleep(0.1)
            snap = s.latest()
            if snap is not None:
                snaps.append(snap)
        s.stop()
    finally:
        for w in workers:
            w.kill()
            w.wait()
        s.stop()
    gpu = [sn.gpu(dev0.label).sm_active_ratio for sn in snaps]
    gpu = [g for g in gpu if g is not None]
    per: dict[int, list[float]] = {p: [] for p in pids}
    raw: dict[int, list[float]] = {p: [] for p in pids}
    energy: dict[int, float] = {}
    totals = []
    for sn in snaps:
        procs = [p for p in sn.processes if p.gpu == dev0.label]
        if not all(any(p.pid == pid and p.sm_ratio is not None for p in procs) for pid in pids):
            continue
        totals.append(sum(p.sm_ratio or 0.0 for p in procs))
        for p in procs:
            if p.pid in per:
                per[p.pid].append(p.sm_ratio)
                raw[p.pid].append(p.utilization_ratio)
                energy[p.pid] = p.energy_joules or 0.0
    assert len(totals) > 50, f"only {len(totals)} snapshots had a share for all four workers"
    cap = s.capabilities()[dev0.label]["gpu_process_sm_active_ratio"]
    shares = [_mean(per[p]) for p in pids]
    result = {
        "sleeps_s": list(SLEEPS), "gpu_sm_active_mean": _mean(gpu), "shares_sum_mean": _mean(totals),
        "shares": shares, "nvml_utilization": [_mean(raw[p]) for p in pids],
        "energy_joules": [energy.get(p) for p in pids], "snapshots": len(totals), "capability": cap.reason,
        "power_watts_mean": _mean([sn.gpu(dev0.label).power_watts or 0.0 for sn in snaps]),
    }
    print("shares on GPU 0:", json.dumps(result))
    out = os.environ.get("GPUSCOPE_BENCH_OUT")
    if out:
        with open(os.path.join(out, "shares.json"), "w") as f:
            json.dump(result, f, indent=1)
    assert cap.supported and cap.reason == "", cap
    assert result["shares_sum_mean"] == pytest.approx(result["gpu_sm_active_mean"], rel=0.05)
    assert shares == sorted(shares, reverse=True), shares  # more work, larger share
    assert all(e > 0 for e in result["energy_joules"])
