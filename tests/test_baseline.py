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


def test_jobs_that_all_differ_keep_memory_and_the_file_bounded_and_the_recent_job_keeps_its_baseline(tmp_path):
    """A run id in every command line makes every job a workload of its own: at most max_jobs per GPU are
    remembered (the one seen longest ago goes), so a node that runs thousands of them stays bounded."""
    b = Baselines(min_windows=5, sustain=1, max_jobs=8)
    for _ in range(10):
        b.observe([window(power=690, noise=1, job="python serve.py --model llama")])
    for k in range(500):
        b.observe([window(job=f"python train.py --run-id run-{chr(97 + k % 26)}{chr(97 + k // 26 % 26)}x")])
        if k % 5 == 0:  # the long-lived service keeps being seen
            b.observe([window(power=690, noise=1, job="python serve.py --model llama")])
    jobs = {j for _, _, j in b._hist}
    assert len(jobs) <= 8 and "python serve.py --model llama" in jobs
    assert b.forgotten >= 500 - 8
    path = tmp_path / "baselines.json"
    b.save(path)
    again = Baselines.load(path, min_windows=5, sustain=1, max_jobs=8)
    assert len({s["job"] for s in again.to_dict()["series"]}) <= 8
    found = again.observe([window(power=500, noise=1, job="python serve.py --model llama")])
    assert [f.metric for f in found] == ["gpu_power_watts"]  # its history survived the churn


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


# ---- peers on a mixed node: only a GPU doing worse than its peers on the same job ----------------

def _mixed(gpus):
    from test_diagnose import simulated_window  # the real sampler on the simulated node, fake clock

    return simulated_window("mixed", gpus=gpus)


# healthy, compute_bound and memory_bound: the GPUs doing the most work (mixed deals 8 profiles round-robin)
BEST = {"0", "1", "2", "8", "9", "10"}


@pytest.mark.parametrize("gpus", [8, 16])
def test_the_best_gpus_of_a_mixed_node_are_never_peer_outliers(gpus):
    ws = _mixed(gpus)
    flagged = [(v.gpu, v.summary) for v in diagnose(ws) if v.kind == "peer_outlier"]
    assert [f for f in flagged if f[0] in BEST] == []
    assert [(f.gpu, f.summary) for f in peer_outliers(ws) if f.gpu in BEST] == []
    if gpus == 8:  # one GPU per behaviour: no GPU has two others doing the same work to compare with
        assert flagged == []


def test_a_throttled_gpu_among_compute_bound_peers_of_the_same_job_is_flagged():
    # 16 GPUs: GPUs 1 and 9 compute-bound, 6 and 14 the same work thermally throttled (SM clock 1.11 GHz).
    found = peer_outliers(_mixed(16))
    clock = {f.gpu: f for f in found if f.metric == "gpu_sm_clock_hertz"}
    assert set(clock) == {"6", "14"}
    f = clock["6"]
    assert f.reference == pytest.approx(1.755e9) and f.score < -4
    assert "GPU 6's SM clock (1.11 GHz) is 37 % below the 1.75 GHz of the 3 other GPUs" in f.summary
    assert {g.gpu for g in found} == {"6", "14"}


def test_only_the_worse_direction_is_an_outlier_and_ratios_differ_in_points():
    ws = [window(str(g), job=f"python train.py --local-rank {g}", rng=random.Random(g)) for g in range(4)]
    fast = window("1", clock=2.1e9, power=699, job="python train.py --local-rank 1")  # does more: not a problem
    ws[1] = fast
    ws[3].series["gpu_tensor_active_ratio"] = [0.62] * 30  # does less tensor work than its peers
    found = peer_outliers(ws)
    assert {(f.gpu, f.metric) for f in found} == {("3", "gpu_tensor_active_ratio")}
    assert ("GPU 3's tensor-pipe activity (62.0 %) is 28.0 pp below the 90.0 % of the 3 other GPUs"
            in found[0].summary)
