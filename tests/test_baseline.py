"""Baselines (a GPU against its own history) and peers (against the GPUs on the same job)."""

from __future__ import annotations

import json
import random
import time

import pytest

from gpuscope import Sampler, SamplerConfig
from gpuscope.diagnose import GpuWindow, ProcessView, diagnose
from gpuscope.diagnose.baseline import Baselines, Tracker, peer_outliers, workload_key


def window(gpu="0", power=690.0, clock=1.98e9, sm=0.95, job="python train.py --local-rank 0", n=30, noise=5.0,
           rng=None):
    rng = rng or random.Random(0)
    w = GpuWindow(gpu, [i * 1.0 for i in range(n)], {
        "gpu_power_watts": [power + rng.uniform(-noise, noise) for _ in range(n)],
        "gpu_sm_clock_hertz": [clock] * n,
        "gpu_sm_active_ratio": [sm] * n,
        "gpu_tensor_active_ratio": [0.9] * n,
        "gpu_utilization_ratio": [1.0] * n,
    })
    if job:
        w.processes = [ProcessView(1000 + int(gpu), "python", job, gpu_memory_bytes=20e9)]
    return w


def test_a_sustained_drop_against_its_own_history_is_named_in_words():
    b, rng = Baselines(min_windows=20, sustain=3), random.Random(1)
    for _ in range(40):
        assert b.observe([window(rng=rng)]) == []
    assert b.observe([window(power=450, rng=rng)]) == []  # one odd window is not a change yet
    assert b.observe([window(power=452, rng=rng)]) == []
    found = b.observe([window(power=448, rng=rng)])
    assert [(f.gpu, f.kind, f.metric) for f in found] == [("0", "anomaly", "gpu_power_watts")]
    f = found[0]
    assert f.score < -4 and f.sustained == 3
    assert "power (448 W) is 35 % below its usual 690 W for this job (median of 40 windows" in f.summary
    # another job on the same GPU has a baseline of its own: nothing to compare with yet
    assert b.observe([window(power=300, job="python serve.py", rng=rng)]) == []


def test_noise_and_tiny_changes_are_not_anomalies():
    b = Baselines(min_windows=20, sustain=1)
    for _ in range(30):
        b.observe([window(clock=1.98e9)])  # constant: MAD 0
    assert b.observe([window(clock=1.98e9 - 15e6)]) == []  # 15 MHz: below what matters (50 MHz)
    assert [f.metric for f in b.observe([window(clock=1.41e9)])] == ["gpu_sm_clock_hertz"]


def test_a_lasting_change_becomes_the_new_normal():
    b = Baselines(keep=100, min_windows=20, sustain=2)
    for _ in range(30):
        b.observe([window(power=690)])
    flagged = [bool(b.observe([window(power=400)])) for _ in range(60)]
    assert flagged[1] and flagged[5]  # flagged while it is new
    assert not flagged[-1]  # learnt after a while: 400 W is this job's normal now


def test_baselines_survive_a_restart_and_a_damaged_file_says_so(tmp_path):
    b = Baselines(min_windows=5, sustain=1)
    for _ in range(10):
        b.observe([window(power=690, noise=1)])
    path = tmp_path / "baselines.json"
    b.save(path)
    again = Baselines.load(path, min_windows=5, sustain=1)
    assert [f.metric for f in again.observe([window(power=500, noise=1)])] == ["gpu_power_watts"]
    path.write_text('{"version": 1, "series": [{"gpu": "0"')
    with pytest.raises(ValueError, match="damaged") as e:
        Baselines.load(path)
    assert "\n" not in str(e.value)
    assert Baselines.load(tmp_path / "absent.json").to_dict()["series"] == []


def test_a_gpu_unlike_its_peers_on_the_same_job():
    ws = [window(str(g), job=f"python train.py --local-rank {g}", rng=random.Random(g)) for g in range(4)]
    ws[2] = window("2", clock=1.41e9, power=520, job="python train.py --local-rank 2")
    found = {(f.gpu, f.metric) for f in peer_outliers(ws)}
    assert found == {("2", "gpu_sm_clock_hertz"), ("2", "gpu_power_watts")}
    text = next(f.summary for f in peer_outliers(ws) if f.metric == "gpu_sm_clock_hertz")
    assert "GPU 2's SM clock (1.41 GHz) is 29 % below the 1.98 GHz of the 3 other GPUs running the same job" in text
    # different jobs are not peers; two GPUs are too few to say which one is odd
    ws[2].processes = [ProcessView(9, "python", "python other.py", gpu_memory_bytes=1e9)]
    assert peer_outliers(ws) == []
    assert peer_outliers(ws[:2]) == []


def test_diagnose_reports_peer_outliers_as_side_verdicts():
    ws = [window(str(g), job=f"torchrun train.py --rank {g}", rng=random.Random(g)) for g in range(4)]
    ws[3] = window("3", clock=1.2e9, job="torchrun train.py --rank 3")
    out = [v for v in diagnose(ws) if v.kind == "peer_outlier"]
    assert [(v.gpu, v.primary, v.evidence["metric"]) for v in out] == [("3", False, "gpu_sm_clock_hertz")]


def test_workload_key_ignores_rank_numbers():
    a = [ProcessView(1, "python", "python train.py --local-rank 0 --port 29500", gpu_memory_bytes=1e9)]
    b = [ProcessView(2, "python", "python train.py --local-rank 7 --port 29501", gpu_memory_bytes=1e9)]
    assert workload_key(a) == workload_key(b) != "" and workload_key([]) == ""


def test_tracker_learns_from_a_running_sampler_and_saves(tmp_path):
    path = tmp_path / "b.json"
    with Sampler(SamplerConfig(interval=0.1), simulate="healthy", gpus=2) as s:
        s.start()
        time.sleep(1.5)
        t = Tracker(s, path, every_s=1.0)
        t.step()
        t.stop()
    assert t.windows == 1
    data = json.loads(path.read_text())
    assert {(x["gpu"], x["metric"]) for x in data["series"]} >= {("0", "gpu_power_watts"), ("1", "gpu_power_watts")}
