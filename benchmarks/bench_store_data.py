"""Realistic synthetic node data for the store benchmarks: 8 simulated H200s at 10 Hz running the
'mixed' scenario's workloads, with the medians of ../shared/workloads/METRICS.md (via gpuscope.sim's
PROFILES) plus the noise the simulated node uses, refreshed at the sampler's real cadence (fast
fields every tick, utilization/power/GPM every 200 ms, temperatures and clocks every second,
counters integrated), processes and host every second. Time stamps are synthesized (with 0.2 ms
of scheduling jitter) so a day is generated in seconds.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterator

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from gpuscope import HostRecord, ProcessRecord, Sampler, Snapshot  # noqa: E402
from gpuscope._records import GpuRecord  # noqa: E402
from gpuscope.catalog import split_series_key  # noqa: E402
from gpuscope.sim import _MIXED, PROFILES, Profile  # noqa: E402

MIB = float(1 << 20)
TICK_NS = 100_000_000  # 10 Hz
Series = list[tuple[str, dict[str, str]]]


def template(gpus: int = 8) -> Snapshot:
    """A real snapshot of the simulated 'mixed' node: the exact series keys the sampler produces."""
    with Sampler(simulate="mixed", gpus=gpus) as s:
        s.sample_once()
        time.sleep(0.25)
        return s.sample_once()


def _pct(rng: np.random.Generator, v: float, n: int, rel: float = 0.03) -> np.ndarray:
    x = v * (1 + rel * rng.standard_normal(n)) + 0.05 * np.abs(rng.standard_normal(n)) * (v > 0)
    return np.clip(x, 0.0, 100.0)


def _held(x: np.ndarray, every: int, n: int) -> np.ndarray:
    return np.repeat(x, every)[:n]


class GpuSignal:
    """One GPU's series over consecutive blocks, continuing its counters across blocks."""

    def __init__(self, index: int, keys: list[str], seed: int) -> None:
        self.prof: Profile = PROFILES[_MIXED[index % len(_MIXED)]]
        self.name = _MIXED[index % len(_MIXED)]
        self.keys = keys
        self.rng = np.random.default_rng(seed)
        self.counters: dict[str, float] = {}

    def block(self, t_s: np.ndarray) -> np.ndarray:
        n, p, r = len(t_s), self.prof, self.rng
        med, slow = -(-n // 2), -(-n // 10)
        busy = ((t_s % 2.5) < 0.2) if self.name == "input_starved" else np.ones(n, bool)

        def gpm(v: float, busy_v: float | None = None) -> np.ndarray:
            x = _held(_pct(r, v, med), 2, n)
            if busy_v is not None and self.name == "input_starved":
                x = np.where(busy, _held(_pct(r, busy_v, med), 2, n), x)
            return x / 100.0

        power = _held(np.round(np.maximum(60.0, p.power * (1 + 0.02 * r.standard_normal(med))), 3), 2, n)
        rx = _held(np.maximum(0, p.pcie_rx * (1 + 0.03 * r.standard_normal(med))) * MIB, 2, n)
        tx = _held(np.maximum(0, p.pcie_tx * (1 + 0.05 * r.standard_normal(med))) * MIB, 2, n)
        temp = _held(np.round(p.temp + 0.5 * r.standard_normal(slow)), 10, n)
        tensor = gpm(p.tensor, 30)
        used = (p.mem_mib + 520) * MIB
        cols: dict[str, np.ndarray | float] = {
            "gpu_utilization_ratio": _held(np.round(_pct(r, p.nvml_util, med, 0.02)), 2, n) / 100,
            "gpu_memory_utilization_ratio": _held(np.round(_pct(r, p.dram * 0.9, med)), 2, n) / 100,
            "gpu_sm_active_ratio": gpm(p.sm, 80), "gpu_sm_occupancy_ratio": gpm(p.occ, 40),
            "gpu_tensor_active_ratio": tensor, "gpu_tensor_hmma_active_ratio": tensor,
            "gpu_dram_active_ratio": gpm(p.dram, 35), "gpu_fp32_active_ratio": gpm(p.fp32),
            "gpu_fp16_active_ratio": gpm(p.fp16), "gpu_integer_active_ratio": gpm(p.fp32 * 0.3),
            "gpu_power_watts": power, "gpu_temperature_celsius": temp, "gpu_memory_temperature_celsius": temp + 4,
            "gpu_pcie_rx_bytes_per_second": rx, "gpu_pcie_tx_bytes_per_second": tx,
            "gpu_memory_used_bytes": used, "gpu_memory_free_bytes": 150754820096.0 - used - 629145600.0,
            "gpu_sm_clock_hertz": p.sm_clock * 1e6, "gpu_graphics_clock_hertz": p.sm_clock * 1e6,
            "gpu_clock_event_reasons": float(p.clock_events),
        }
        dt = 0.1
        for name, rate in (("gpu_energy_joules_total", power), ("gpu_pcie_rx_bytes_total", rx),
                           ("gpu_pcie_tx_bytes_total", tx)):
            c = self.counters.get(name, 0.0) + np.cumsum(rate * dt)
            self.counters[name] = float(c[-1])
            cols[name] = c
        out = np.empty((n, len(self.keys)))
        for j, key in enumerate(self.keys):
            metric, labels = split_series_key(key)
            if metric == "gpu_throttle_seconds_total":
                bit = {"sw_power_cap": 0x4, "sw_thermal": 0x20, "hw_thermal": 0x40, "gpu_idle": 0x1}.get(labels["reason"], 0)
                on = bool(p.clock_events & bit) or (bit == 0x1 and p.nvml_util == 0)
                base = self.counters.get(key, 0.0)
                out[:, j] = base + (np.arange(1, n + 1) * dt if on else 0.0)
                self.counters[key] = float(out[-1, j])
            else:
                out[:, j] = cols.get(key, self.counters.setdefault(key, _constant(metric)))
        return out


def _constant(metric: str) -> float:
    return {"gpu_memory_total_bytes": 150754820096.0, "gpu_memory_reserved_bytes": 629145600.0,
            "gpu_power_limit_watts": 700.0, "gpu_memory_clock_hertz": 3.201e9, "gpu_sm_clock_max_hertz": 1.98e9,
            "gpu_pcie_link_generation": 5.0, "gpu_pcie_link_width": 16.0, "gpu_healthy": 1.0}.get(metric, 0.0)


class NodeData:
    """Blocks of (series, times, values) for every layout of the node, in time order."""

    def __init__(self, tmpl: Snapshot, t0_ns: int, seed: int = 1) -> None:
        self.t0 = t0_ns
        self.gpus = []
        for i, g in enumerate(tmpl.gpus):
            keys = list(g.values)
            series = []
            for k in keys:
                m, lab = split_series_key(k)
                series.append((m, {**lab, "gpu": g.identity.label, "uuid": g.identity.uuid}))
            self.gpus.append((series, GpuSignal(i, keys, seed * 100 + i)))
        self.host_keys = list(tmpl.host.values) if tmpl.host else []
        self.host_series: Series = [split_series_key(k) for k in self.host_keys]
        self.host_base = np.array([tmpl.host.values[k] for k in self.host_keys]) if tmpl.host else np.empty(0)
        self.procs = [(p, [(m, {"gpu": p.gpu, "pid": str(p.pid), "process": p.name, "user": p.user})
                           for m in _PROC_METRICS]) for p in tmpl.processes]
        self.rng = np.random.default_rng(seed)
        self.samples = 0

    def blocks(self, seconds: float, block_s: float = 60.0) -> Iterator[tuple[Series, np.ndarray, np.ndarray]]:
        ticks, per = int(seconds * 10), int(block_s * 10)
        for start in range(0, ticks, per):
            k = np.arange(start, min(ticks, start + per))
            t = self.t0 + k * TICK_NS + np.clip(self.rng.normal(0, 200_000, len(k)), -900_000, 900_000).astype(np.int64)
            t_s = k * 0.1
            for series, sig in self.gpus:
                v = sig.block(t_s)
                self.samples += v.size
                yield series, t, v
            sec = k % 10 == 0
            ts = t[sec] - 30_000  # the host and process sources run just before the snapshot is stamped
            if self.host_keys and sec.any():
                m = int(sec.sum())
                noise = np.round(self.rng.normal(0, 0.01, (m, len(self.host_keys))) * (self.host_base > 0) *
                                 (self.host_base < 2), 3)
                hv = np.maximum(0, self.host_base + noise)
                self.samples += hv.size
                yield self.host_series, ts, hv
            for p, series in self.procs:
                if not sec.any():
                    continue
                m = int(sec.sum())
                cpu = np.maximum(0, (p.cpu_cores or 0) * (1 + 0.02 * self.rng.standard_normal(m)))
                pv = np.column_stack([np.full(m, p.gpu_memory_bytes or 0), np.full(m, p.sm_ratio or 0),
                                      np.full(m, p.memory_ratio or 0), cpu, np.minimum(1, cpu),
                                      np.full(m, p.rss_bytes or 0), np.full(m, p.threads or 0)])
                self.samples += pv.size
                yield series, ts, pv


_PROC_METRICS = ["gpu_process_memory_used_bytes", "gpu_process_sm_active_ratio", "gpu_process_memory_utilization_ratio",
                 "process_cpu_cores", "process_thread_cpu_max_ratio", "process_resident_memory_bytes", "process_threads"]


def snapshots(count: int, t0_ns: int, gpus: int = 8, variety: int = 40) -> list[Snapshot]:
    """`count` snapshots at 10 Hz cycling through `variety` real sampler snapshots of the mixed node;
    the host and process records change once a second, as the sampler's do."""
    with Sampler(simulate="mixed", gpus=gpus) as s:
        s.sample_once()
        time.sleep(0.3)  # past the first GPM window: every series is present from the first template
        tmpls = []
        for _ in range(variety):
            tmpls.append(s.sample_once())
            time.sleep(0.01)
    out: list[Snapshot] = []
    host: HostRecord | None = None
    procs: list[ProcessRecord] = []
    for i in range(count):
        tm = tmpls[i % variety]
        t = t0_ns + i * TICK_NS
        if i % 10 == 0:
            host = HostRecord(t, dict(tm.host.values)) if tm.host else None
            procs = [dataclasses.replace(p) for p in tm.processes]
        gs = [GpuRecord(g.identity, t, g.values, g.healthy, g.throttle_reasons) for g in tm.gpus]
        out.append(Snapshot(t, gs, procs, host, [], tm.simulated, tm.hostname))
    return out
