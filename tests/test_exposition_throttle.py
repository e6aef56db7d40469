"""Throttle-time counters never grow faster than wall time, through the exposition of real sampler
snapshots: a '% of time throttled' panel (rate of a violation counter over 1e9 ns/s) can read at most
100 %, however many clock-event reasons hold at once."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuscope import Sampler, SamplerConfig
from gpuscope.export.exposition import render
from gpuscope.sim import PROFILES

TICKS = 25
GAP_S = 0.04


def _counters(text: bytes, mode: str) -> dict[tuple[str, str, str], float]:
    """(series name, gpu, reason) -> value, for the throttle-time counters, in seconds."""
    out: dict[tuple[str, str, str], float] = {}
    # The parser names a counter's family without `_total` (and its samples with it).
    for fam in text_string_to_metric_families(text.decode()):
        if fam.type != "counter":
            continue
        for s in fam.samples:
            if mode == "dcgm" and fam.name.startswith("DCGM_FI_DEV_") and fam.name.endswith("_VIOLATION"):
                out[(fam.name, s.labels["gpu"], "")] = s.value / 1e9
            elif mode == "canonical" and fam.name.endswith("throttle_seconds"):
                out[(fam.name, s.labels["gpu"], s.labels.get("reason", ""))] = s.value
    return out


@pytest.mark.parametrize("mode", ["dcgm", "canonical"])
def test_no_throttle_counter_grows_faster_than_wall_time(mode):
    # The throttled scenario holds sw_thermal and hw_thermal together (both DCGM THERMAL).
    assert PROFILES["throttled"].clock_events & 0x60 == 0x60
    with Sampler(SamplerConfig(interval=0.02, gpm=False, collect_processes=False, collect_host=False,
                               events=False), simulate="throttled", gpus=2) as s:
        runs: list[tuple[float, float, dict[tuple[str, str, str], float]]] = []
        for _ in range(TICKS):
            before = time.monotonic()
            snap = s.sample_once()
            after = time.monotonic()
            runs.append((before, after, _counters(render(snap, mode=mode), mode)))
            time.sleep(GAP_S)
    first, last = runs[0][2], runs[-1][2]
    assert first, "no throttle counter exposed"
    if mode == "dcgm":
        assert ("DCGM_FI_DEV_THERMAL_VIOLATION", "0", "") in first
    grew = 0
    for (b0, _a0, c0), (_b1, a1, c1) in zip(runs, runs[1:], strict=False):
        # Tick k's clock read lies between before_k and after_k: a counter cannot gain more than
        # after_k - before_(k-1) between the two snapshots.
        wall = a1 - b0
        for key, v in c1.items():
            assert v - c0.get(key, 0.0) <= wall + 1e-9, (key, v - c0.get(key, 0.0), wall)
    span = runs[-1][1] - runs[0][0]
    for key, v in last.items():
        assert 0.0 <= v - first.get(key, 0.0) <= span + 1e-9, key
        if v - first.get(key, 0.0) > 0.5 * span:
            grew += 1
    # The thermal reasons held all along: their counters did grow (at about wall time).
    assert grew >= 2
