"""Builders shared by the store tests: snapshots with controlled stamps and values, and the child
processes of the multi-process tests. Also the codec's own tests."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from gpuscope import Event, GpuIdentity, GpuRecord, HostRecord, ProcessRecord, Snapshot
from gpuscope.catalog import series_key
from gpuscope.store._codec import (
    CorruptChunk,
    decode_chunk,
    decode_staging,
    encode_chunk,
    encode_staging,
    scale_for,
)

T0 = 1_800_489_600 * 10**9  # 2027-01-21, on an epoch week boundary (so on every tier's block edge)
SEC = 10**9
SRC = str(Path(__file__).resolve().parents[1] / "src")
THROTTLE = series_key("gpu_throttle_seconds_total", reason="sw_power_cap")


def identity(i: int) -> GpuIdentity:
    return GpuIdentity(index=i, uuid=f"GPU-test-{i}", name="Test H200", memory_total_bytes=150 << 30)


def gpu_values(i: int, k: int) -> dict[str, float]:
    """Values of GPU i at tick k: exact at the store's precision (ratio 1e-4, watts 1e-3, bytes 1)."""
    return {
        "gpu_power_watts": round(300.0 + 10 * i + (k * 7919 % 1000) / 1000 * 50, 3),
        "gpu_sm_active_ratio": round((k * 31 + i) % 100 / 100, 4),
        "gpu_memory_used_bytes": float((1 << 30) * (i + 1) + k * 4096),
        THROTTLE: round(k * 0.1, 6),
    }


def snapshot(k: int, *, t0: int = T0, step_ns: int = 100_000_000, gpus: int = 2, events: list[Event] | None = None,
             procs: bool = True, host: bool = True) -> Snapshot:
    t = t0 + k * step_ns
    recs = [GpuRecord(identity(i), t, gpu_values(i, k)) for i in range(gpus)]
    processes = [ProcessRecord(pid=1000 + i, gpu=str(i), gpu_uuid=f"GPU-test-{i}", type="compute", name="python",
                               user="alice", gpu_memory_bytes=float(1 << 30), sm_ratio=0.5, cpu_cores=1.0 + k % 3,
                               threads=12) for i in range(gpus)] if procs else []
    h = HostRecord(t, {"host_cpu_ratio": round(k % 10 / 10, 4), series_key("host_cpu_core_ratio", cpu=0): 0.25}) \
        if host else None
    return Snapshot(t, recs, processes, h, events or [], None, "testhost")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def python() -> str:
    return sys.executable


# -- the codec ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 5000])
def test_chunk_round_trip(n: int) -> None:
    rng = np.random.default_rng(n)
    t = (T0 + np.arange(n) * 100_000_000 + rng.integers(-50_000, 50_000, n)).astype(np.int64)
    ratio = rng.random(n)
    lossless = rng.standard_normal(n) * 1e300
    if n > 2:
        lossless[1], lossless[2] = np.nan, -np.inf
    counts = rng.integers(0, 2**40, n)
    out = decode_chunk(encode_chunk([t, ratio, lossless, counts], 1e4))
    assert np.array_equal(out[0], t)
    assert np.allclose(out[1], ratio, atol=0.5e-4, rtol=0)
    assert np.array_equal(out[2], lossless, equal_nan=True)
    assert np.array_equal(out[3], counts)


def test_quantised_values_survive_exactly_and_extremes_fall_back_to_lossless() -> None:
    v = np.array([0.1234, 0.9999, 0.0, 1.0])
    assert np.array_equal(decode_chunk(encode_chunk([v], 1e4))[0], v)
    huge = np.array([1e300, 1.0])  # beyond 2**53 quanta: stored lossless, not wrapped
    assert np.array_equal(decode_chunk(encode_chunk([huge], 1.0))[0], huge)
    extremes = np.array([-2**63, 2**63 - 1, 0, -1], dtype=np.int64)
    assert np.array_equal(decode_chunk(encode_chunk([extremes]))[0], extremes)


def test_precision_per_unit() -> None:
    assert scale_for("gpu_sm_active_ratio") == 1e4
    assert scale_for("gpu_power_watts") == 1e3
    assert scale_for("gpu_energy_joules_total") == 1e3
    assert scale_for("gpu_memory_used_bytes") == 1.0
    assert scale_for("gpu_temperature_celsius") == 100.0
    assert scale_for("gpu_throttle_seconds_total") == 1e6
    assert scale_for("gpu_xid_events_total") == 1.0
    assert scale_for("host_load1") == 1e4
    assert scale_for("not_a_catalogued_metric") is None


def test_corruption_is_detected() -> None:
    blob = bytearray(encode_chunk([np.arange(100, dtype=np.int64)]))
    blob[-3] ^= 0xFF
    with pytest.raises(CorruptChunk):
        decode_chunk(bytes(blob))
    with pytest.raises(CorruptChunk):
        decode_chunk(b"nonsense")
    with pytest.raises(CorruptChunk):
        decode_staging(encode_staging(np.arange(3, dtype=np.int64), np.ones((3, 2)))[:-4])


def test_a_skipped_column_is_not_decoded() -> None:
    cols = decode_chunk(encode_chunk([np.arange(5, dtype=np.int64), np.ones(5)], 1.0), [False, True])
    assert cols[0] is None and cols[1] is not None and math.isclose(float(cols[1].sum()), 5.0)
