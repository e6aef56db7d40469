"""The one shape every live view reads."""

import time
from dataclasses import asdict

from gpuscope import Sampler, SamplerConfig
from gpuscope.diagnose import diagnose, windows_from_snapshots
from gpuscope.viewmodel import GPU_METRICS, from_snapshot, merge


def _snaps(scenario: str, gpus: int, processes: int | None = None, seconds: float = 1.5):
    with Sampler(SamplerConfig(interval=0.05), simulate=scenario, gpus=gpus, processes=processes) as s:
        s.start()
        time.sleep(seconds)
        return list(s.history)


def test_overview_from_a_snapshot_and_its_verdicts():
    snaps = _snaps("mixed", 4, processes=10)
    verdicts = diagnose(windows_from_snapshots(snaps))  # side verdicts only this early (peer outliers)
    verdicts.append({"gpu": "1", "kind": "memory_bound", "severity": "warning", "confidence": 0.8,
                     "summary": "DRAM-bound.", "primary": True})
    ov = from_snapshot(snaps[-1], verdicts, source="local")
    assert ov["simulated"] == "mixed" and ov["source"] == "local"
    assert [g["gpu"] for g in ov["gpus"]] == ["0", "1", "2", "3"]
    assert len({g["key"] for g in ov["gpus"]}) == 4
    g0 = ov["gpus"][0]
    assert set(g0["values"]) == set(GPU_METRICS)
    assert g0["values"]["gpu_memory_total_bytes"] > 0 and 0 <= g0["values"]["gpu_sm_active_ratio"] <= 1
    assert "gpu_idle" not in g0["throttle"]
    assert all(g["verdict"] is None or g["verdict"]["kind"] for g in ov["gpus"])
    assert ov["gpus"][1]["verdict"] == {"kind": "memory_bound", "severity": "warning", "confidence": 0.8,
                                        "summary": "DRAM-bound."}
    assert all(s["kind"] == "peer_outlier" for g in ov["gpus"] for s in g["side"])
    assert len(ov["processes"]) == 10
    assert {p["gpu_key"] for p in ov["processes"]} <= {g["key"] for g in ov["gpus"]}
    assert all(p["ppid"] is None for p in ov["processes"])  # simulated pids have no parents


def test_the_json_form_gives_the_same_overview():
    snap = _snaps("compute_bound", 2, seconds=0.5)[-1]
    a = from_snapshot(snap, source="agent")
    b = from_snapshot(asdict(snap) | {"hostname": snap.hostname}, source="agent")
    assert a == b


def test_merge_orders_a_fleet_by_host_then_index():
    snap = _snaps("healthy", 2, seconds=0.5)[-1]
    a = from_snapshot(snap, host="b-node")
    b = from_snapshot(snap, host="a-node")
    m = merge([a, b], "prometheus")
    assert [g["key"] for g in m["gpus"]] == ["a-node/0", "a-node/1", "b-node/0", "b-node/1"]
    assert m["simulated"] == "healthy"


def test_nan_and_infinity_become_none():
    nan, inf = float("nan"), float("inf")
    snap = {"hostname": "h", "time_ns": 1, "simulated": None,
            "gpus": [{"identity": {"index": 0, "name": "G"}, "healthy": True, "throttle_reasons": [],
                      "values": {"gpu_sm_active_ratio": nan, "gpu_power_watts": inf, "gpu_temperature_celsius": 40}}],
            "processes": [{"pid": 1, "gpu": 0, "sm_ratio": nan, "gpu_memory_bytes": -inf, "rss_bytes": 5}]}
    ov = from_snapshot(snap, with_ppid=False)
    v = ov["gpus"][0]["values"]
    assert v["gpu_sm_active_ratio"] is None and v["gpu_power_watts"] is None and v["gpu_temperature_celsius"] == 40
    p = ov["processes"][0]
    assert p["sm_ratio"] is None and p["gpu_memory_bytes"] is None and p["rss_bytes"] == 5
