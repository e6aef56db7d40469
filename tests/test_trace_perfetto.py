"""perfetto.with_counters on the golden Kineto traces with synthetic sampler snapshots. The perfetto
wheel's trace processor downloads its binary on first use (REFERENCE 2c), so the output is checked
against the Chrome trace event format here instead."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from gpuscope._records import GpuIdentity, GpuRecord, Snapshot
from gpuscope.trace.perfetto import COUNTER_PID_BASE, METRICS, with_counters

FIXTURES = Path(__file__).parent / "fixtures" / "traces"


def check_chrome_trace(doc: dict) -> None:
    """Every event has ph and pid (Kineto names one pid "Spans"), timed ones a numeric ts; X has dur >= 0; C args are numbers;
    metadata names a process or thread; flows have ids."""
    assert isinstance(doc["traceEvents"], list)
    for e in doc["traceEvents"]:
        assert isinstance(e.get("ph"), str) and isinstance(e.get("pid"), int | str), e
        if e["ph"] != "M":
            assert isinstance(e.get("ts"), int | float) and math.isfinite(e["ts"]), e
        if e["ph"] == "X":
            assert isinstance(e.get("dur"), int | float) and e["dur"] >= 0, e
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, int | float) and math.isfinite(v) for v in e["args"].values()), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_labels", "process_sort_index",
                                 "thread_sort_index"), e
            assert isinstance(e.get("args"), dict), e
        if e["ph"] in ("s", "t", "f"):
            assert "id" in e, e


def snapshots(start_ns: int, seconds: float, gpus: int = 2) -> list[Snapshot]:
    out = []
    for k in range(int(seconds * 10)):
        t = start_ns + k * 100_000_000
        recs = [GpuRecord(GpuIdentity(index=i, uuid=f"GPU-{i}", name="H200"), t,
                          {"gpu_sm_active_ratio": 0.5, "gpu_utilization_ratio": 1.0, "gpu_power_watts": 300.0 + k,
                           "gpu_memory_used_bytes": 2**30 * 10.0, "gpu_pcie_tx_bytes_per_second": 2e9,
                           "gpu_tensor_active_ratio": float("nan")})
                for i in range(gpus)]
        out.append(Snapshot(time_ns=t, gpus=recs, processes=[], host=None, events=[]))
    return out


@pytest.mark.parametrize("name", ["h2d_pageable", "compute_bound", "launch_bound"])
def test_golden_trace_with_counters_is_a_valid_timeline_on_the_epoch_clock(name, tmp_path):
    src = FIXTURES / f"{name}.pt.trace.json.gz"
    original = json.loads(gzip.decompress(src.read_bytes()))
    base_us = original["baseTimeNanoseconds"] / 1000
    xs = [e for e in original["traceEvents"] if e["ph"] == "X"]
    first_ns = int((base_us + min(e["ts"] for e in xs)) * 1000)
    out = tmp_path / f"{name}.perfetto.json.gz"
    # samples from 10 s before the trace to 10 s after: only those within 2 s of it are kept
    n = with_counters(src, snapshots(first_ns - 10_000_000_000, 22.0), out)
    doc = json.loads(gzip.decompress(out.read_bytes()))
    check_chrome_trace(doc)
    assert doc["baseTimeNanoseconds"] == 0
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert n == len(counters) > 0
    assert {e["name"] for e in counters} == {"SM active %", "NVML utilization %", "Power W", "Memory used GiB",
                                             "PCIe TX MB/s"}  # NaN tensor and unread series left out
    assert {e["pid"] for e in counters} == {COUNTER_PID_BASE, COUNTER_PID_BASE + 1}
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names[COUNTER_PID_BASE + 1] == "GPU 1 metrics (gpuscope)"
    assert next(e for e in counters if e["name"] == "Memory used GiB")["args"]["value"] == pytest.approx(10.0)
    # the kernel events moved to epoch µs, same count and order as before
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    before = [e for e in original["traceEvents"] if e.get("cat") == "kernel"]
    assert len(kernels) == len(before)
    assert kernels[0]["ts"] == pytest.approx(before[0]["ts"] + base_us, abs=0.5)
    lo = min(e["ts"] for e in doc["traceEvents"] if e["ph"] == "X")
    hi = max(e["ts"] + e["dur"] for e in doc["traceEvents"] if e["ph"] == "X")
    assert all(lo - 2.1e6 <= e["ts"] <= hi + 2.1e6 for e in counters)


def test_plain_json_out_and_points_input(tmp_path):
    src = FIXTURES / "memory_bound.pt.trace.json.gz"
    out = tmp_path / "m.json"
    n = with_counters(src, [(1, "0", {"SM active %": 1.0})], out)  # far outside the trace: left out
    doc = json.loads(out.read_text())
    check_chrome_trace(doc)
    assert n == 0 and not any(e["ph"] == "C" for e in doc["traceEvents"])
    assert len(METRICS) == 8
