"""GPM (GPU Performance Monitoring, Hopper and newer): what the SMs, pipes and memory really did.

NVML computes GPM metrics between two samples that must be more than 100 ms apart ("due to the
internal sample refresh rate"). We keep two samples per device and ping-pong them: each read takes a
new sample and computes the metrics over [previous, new] only when the two are at least
`min_window` apart; otherwise the new sample is dropped and the previous one kept, so the next read
spans a longer window. One metrics structure per device is allocated once and reused.

MIG GPU instances are sampled with nvmlGpmMigSampleGet on the parent GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .._nvml import Nvml, Unavailable
from .device import Device

log = logging.getLogger("gpuscope.gpm")

PCT = 0.01
MIB = 1024.0 * 1024.0

#: (series, GPM metric id, scale to base units)
GPM_METRICS: list[tuple[str, int, float]] = [
    ("gpu_sm_active_ratio", 2, PCT),
    ("gpu_sm_occupancy_ratio", 3, PCT),
    ("gpu_integer_active_ratio", 4, PCT),
    ("gpu_tensor_active_ratio", 5, PCT),
    ("gpu_tensor_dfma_active_ratio", 6, PCT),
    ("gpu_tensor_hmma_active_ratio", 7, PCT),
    ("gpu_tensor_imma_active_ratio", 9, PCT),
    ("gpu_dram_active_ratio", 10, PCT),
    ("gpu_fp64_active_ratio", 11, PCT),
    ("gpu_fp32_active_ratio", 12, PCT),
    ("gpu_fp16_active_ratio", 13, PCT),
    ("gpu_pcie_tx_bytes_per_second", 20, MIB),
    ("gpu_pcie_rx_bytes_per_second", 21, MIB),
    ("gpu_nvlink_rx_bytes_per_second", 60, MIB),
    ("gpu_nvlink_tx_bytes_per_second", 61, MIB),
]
#: Measured on an H200 (driver 580): GRAPHICS_UTIL alone makes one nvmlGpmMetricsGet cost ~1.4 ms of
#: CPU instead of ~1.5 us for all the others together, and NVML utilization says nearly the same.
EXPENSIVE_METRICS: list[tuple[str, int, float]] = [("gpu_graphics_active_ratio", 1, PCT)]
GPM_SERIES = [m[0] for m in GPM_METRICS]
_EXPENSIVE_REASON = ("off by default: this GPM metric costs ~1.4 ms of CPU per read (the others ~1 us); "
                     "enable with [sampler] gpm_graphics = true in the agent's config file (gpuscope agent --config)")

# Rates that also feed byte counters when NVML's own field counters are unavailable.
_COUNTERS = {
    "gpu_pcie_tx_bytes_per_second": "gpu_pcie_tx_bytes_total",
    "gpu_pcie_rx_bytes_per_second": "gpu_pcie_rx_bytes_total",
    "gpu_nvlink_tx_bytes_per_second": "gpu_nvlink_tx_bytes_total",
    "gpu_nvlink_rx_bytes_per_second": "gpu_nvlink_rx_bytes_total",
}

MIN_WINDOW_S = 0.1


class _GpmState:
    __slots__ = ("prev", "cur", "prev_t", "query", "active")

    def __init__(self, nvml: Nvml, metrics: list[tuple[str, int, float]]) -> None:
        lib = nvml.lib
        self.prev: Any = None
        self.cur: Any = lib.nvmlGpmSampleAlloc()
        self.prev_t = 0.0
        q = lib.c_nvmlGpmMetricsGet_t()
        q.version = lib.NVML_GPM_METRICS_GET_VERSION
        self.query = q
        self.active = list(metrics)
        self._load(q)

    def _load(self, q: Any) -> None:
        q.numMetrics = len(self.active)
        for i, (_, mid, _) in enumerate(self.active):
            q.metrics[i].metricId = mid


class GpmSource:
    name = "gpm"
    groups = ("gpm",)

    def __init__(self, nvml: Nvml, min_window: float = MIN_WINDOW_S, graphics: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if min_window < MIN_WINDOW_S:
            raise ValueError(f"the GPM window must be at least {MIN_WINDOW_S * 1000:.0f} ms, got {min_window * 1000:g} ms")
        self.nvml = nvml
        self.min_window = min_window
        self.clock = clock  # the source times its own samples: the tick's start is not when they are taken
        self.metrics = GPM_METRICS + (EXPENSIVE_METRICS if graphics else [])
        self.series = [m[0] for m in self.metrics]

    def _state(self, dev: Device) -> _GpmState | None:
        st = dev.state.get("gpm")
        if st is not None:
            return st if st is not False else None
        handle = dev.parent_handle if dev.is_mig else dev.handle
        sup = self.nvml.call("nvmlGpmQueryDeviceSupport", handle)
        reason = ""
        if isinstance(sup, Unavailable):
            reason = f"GPM unavailable: {sup.reason}"
        elif not sup.isSupportedDevice:
            arch = dev.identity.architecture or "this"
            reason = f"GPM needs a Hopper or newer data-center GPU ({arch} GPU); DCGM's profiling module is the only path here"
        if reason:
            for series in self.series + [e[0] for e in EXPENSIVE_METRICS]:
                dev.unsupported(series, reason)
            dev.state["gpm"] = False
            return None
        try:
            st = _GpmState(self.nvml, self.metrics)
        except Exception as e:  # noqa: BLE001 - allocation failure: report, never raise into the sampler
            for series in self.series:
                dev.unsupported(series, f"GPM sample allocation failed: {e}")
            dev.state["gpm"] = False
            return None
        dev.state["gpm"] = st
        if len(self.metrics) == len(GPM_METRICS):
            for series, _, _ in EXPENSIVE_METRICS:
                dev.unsupported(series, _EXPENSIVE_REASON)
        return st

    def close(self, devices: list[Device]) -> None:
        """Free every device's GPM samples (before nvmlShutdown)."""
        for dev in devices:
            st = dev.state.pop("gpm", None)
            if st:
                for sample in {id(x): x for x in (st.prev, st.cur) if x is not None}.values():
                    self.nvml.call("nvmlGpmSampleFree", sample)

    def collect(self, group: str, dev: Device, now: float) -> None:
        st = self._state(dev)
        if st is None:
            return
        if st.prev is not None and self.clock() - st.prev_t < self.min_window:
            return
        before = self.clock()
        if dev.is_mig:
            r = self.nvml.call("nvmlGpmMigSampleGet", dev.parent_handle, dev.identity.gpu_instance_id, st.cur)
        else:
            r = self.nvml.call("nvmlGpmSampleGet", dev.handle, st.cur)
        if isinstance(r, Unavailable):
            for series in self.series:
                dev.unsupported(series, f"GPM sampling failed: {r.reason}")
            return
        after = self.clock()
        if st.prev is None:
            cur = self.nvml.call("nvmlGpmSampleAlloc")
            if isinstance(cur, Unavailable):
                return  # keep sampling into the one sample; try to allocate the second next time
            st.prev, st.prev_t, st.cur = st.cur, after, cur
            return
        window = before - st.prev_t  # a lower bound of the gap NVML sees between the two samples
        q = st.query
        q.sample1, q.sample2 = st.prev, st.cur
        res = self.nvml.call("nvmlGpmMetricsGet", q)
        st.prev, st.cur, st.prev_t = st.cur, st.prev, after
        if isinstance(res, Unavailable):
            for series in self.series:
                dev.unsupported(series, f"GPM metrics read failed: {res.reason}")
            return
        values, dropped = dev.values, False
        keep = []
        sm = None
        for i, (series, mid, scale) in enumerate(st.active):
            m = q.metrics[i]
            if m.nvmlReturn != 0:
                dev.unsupported(series, "this GPM metric is not supported on this GPU")
                dropped = True
                continue
            keep.append((series, mid, scale))
            v = m.value * scale
            values[series] = v
            dev.supported(series)
            if mid == 2:  # SM_UTIL: gpu_sm_active_ratio
                sm = v
            counter = _COUNTERS.get(series)
            if counter is not None and not dev.state.get("counters_from_nvml"):
                # GPM's rate is an average over the window, so rate x window is exact.
                values[counter] = values.get(counter, 0.0) + v * window
                dev.supported(counter)
        if dropped:
            st.active = keep
            st._load(q)
        dev.state["gpm_window_s"] = window
        if sm is not None:
            # SM activity integrated over time, so that a reader with a longer window (the per-process
            # shares, gpuscope.shares) gets its exact mean: (change of sm_active_s) / (change of gpm_s).
            dev.state["sm_active_s"] = dev.state.get("sm_active_s", 0.0) + sm * window
            dev.state["gpm_s"] = dev.state.get("gpm_s", 0.0) + window
