"""NVML device fields: utilization (labelled for what it is), memory, power, energy, temperature,
clocks, throttle reasons, PCIe/NVLink byte counters, ECC, remapped rows.

Each field's cadence fits its cost and its meaning (costs measured on an H200, see BENCHMARKS.md):
- 'fast', every tick: memory used/free, clock-event (throttle) reasons, SM clock (~1-8 us each);
- 'medium', every 200 ms: NVML utilization and power, which the driver itself refreshes only every
  1/6-1 s (power is a 1 s average on Ampere and newer), so reading them faster buys nothing;
- 'slow', every second: temperatures, other clocks, P-state, encoder/decoder; memory temperature and the
  ECC counters in one nvmlDeviceGetFieldValues call;
- 'energy', every 10 s: the hardware energy counter (~3 ms of CPU per read), integrated from power
  between reads;
- 'rare', every 30 s: PCIe link and replay counter (~170 us), the power limit, remapped rows; the maximum
  SM clock is static (read once, at discovery).
PCIe/NVLink byte counters come from integrating GPM's rates where the GPU has GPM; NVML's own
counters (~150 us per read) are read every second only on GPUs without it.
"""

from __future__ import annotations

import time
from typing import Any

from .._nvml import ERROR_NO_DATA, ERROR_NOT_FOUND, Nvml, Unavailable
from .._records import Capability, Event
from ..catalog import CLOCK_EVENT_REASONS, decode_clock_event_reasons, series_key
from .device import Device

_THROTTLE_KEYS = {bit: series_key("gpu_throttle_seconds_total", reason=name)
                  for bit, name in CLOCK_EVENT_REASONS.items()}
_IDLE_BIT = 0x1
# Both thermal reasons often hold at once: their union is one counter (DCGM's THERMAL_VIOLATION),
# so that a '% of time throttled' never passes 100 %.
_THERMAL_KEY = "gpu_thermal_throttle_seconds_total"
_THERMAL_BITS = sum(bit for bit, name in CLOCK_EVENT_REASONS.items() if name in ("sw_thermal", "hw_thermal"))


class NvmlSource:
    name = "nvml"
    groups = ("fast", "medium", "slow", "energy", "rare")

    def __init__(self, nvml: Nvml, events: list[Event]) -> None:
        self.nvml = nvml
        self.lib = nvml.lib
        self.events = events
        lib = self.lib
        # One nvmlDeviceGetFieldValues call for what has a field id: one driver round trip instead of one per
        # call (the ECC counters were two nvmlDeviceGetTotalEccErrors calls; benchmarks/probe_nvml_costs.py).
        self._slow_fields = [
            ("gpu_memory_temperature_celsius", lib.NVML_FI_DEV_MEMORY_TEMP, 1.0),
            ("gpu_ecc_corrected_errors_total", lib.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, 1.0),
            ("gpu_ecc_uncorrected_errors_total", lib.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, 1.0),
        ]
        # Only where GPM is missing (with GPM, its rates are integrated instead: far cheaper).
        self._counter_fields = [
            ("gpu_pcie_tx_bytes_total", lib.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 1.0),
            ("gpu_pcie_rx_bytes_total", lib.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 1.0),
            ("gpu_nvlink_tx_bytes_total", lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 1024.0),
            ("gpu_nvlink_rx_bytes_total", lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 1024.0),
        ]
        self._mem_v2 = getattr(lib, "nvmlMemory_v2", None)
        self._clock_sm = lib.NVML_CLOCK_SM
        self._clock_mem = lib.NVML_CLOCK_MEM
        self._clock_gfx = lib.NVML_CLOCK_GRAPHICS
        self._temp_gpu = lib.NVML_TEMPERATURE_GPU

    def collect(self, group: str, dev: Device, now: float) -> None:
        if dev.is_mig:
            if group == "fast":
                self._memory(dev)
            return
        if group == "fast":
            self._fast(dev, now)
        elif group == "medium":
            self._medium(dev, now)
        elif group == "slow":
            dev.state["memory_at"] = now
            self._slow(dev)
        elif group == "energy":
            self._energy(dev)
        elif group == "rare":
            self._rare(dev)

    # -- helpers -------------------------------------------------------------------------------
    def _put(self, dev: Device, metric: str, v: Any, scale: float = 1.0) -> bool:
        if isinstance(v, Unavailable):
            if v.code not in (ERROR_NOT_FOUND, ERROR_NO_DATA):  # 'no data yet' is not 'unsupported'
                dev.unsupported(metric, v.reason)
            return False
        dev.values[metric] = float(v) * scale
        dev.supported(metric)
        return True

    def _fields(self, dev: Device, key: str, fields: list[tuple[str, int, float]]) -> None:
        """One nvmlDeviceGetFieldValues call for several fields; a field found unsupported is dropped
        from this device's batch so it costs nothing afterwards."""
        active = dev.state.get(key)
        if active is None:
            active = dev.state[key] = list(fields)
        if not active:
            return
        res = self.nvml.call("nvmlDeviceGetFieldValues", dev.handle, [f[1] for f in active])
        if isinstance(res, Unavailable):
            for metric, _, _ in active:
                dev.unsupported(metric, res.reason)
            dev.state[key] = []
            return
        keep = []
        for (metric, fid, scale), fv in zip(active, res, strict=False):
            if fv.nvmlReturn != 0:
                dev.unsupported(metric, "not supported by this GPU or driver")
                continue
            keep.append((metric, fid, scale))
            dev.values[metric] = _field_value(fv) * scale
            dev.supported(metric)
        if len(keep) != len(active):
            dev.state[key] = keep

    # -- groups --------------------------------------------------------------------------------
    def _memory(self, dev: Device, with_reserved: bool = False) -> None:
        """Used/free every tick through the v1 call (cheaper when cold); the v2 call, which also gives
        the memory the driver reserves, with the slow group. `used` always follows v2's meaning
        (without the reserved part, as DCGM's FB_USED): v1's used includes it, so it is subtracted."""
        call = self.nvml.call
        mem = call("nvmlDeviceGetMemoryInfo", dev.handle, self._mem_v2) if with_reserved and self._mem_v2 else None
        if mem is None or isinstance(mem, Unavailable):
            mem = call("nvmlDeviceGetMemoryInfo", dev.handle)
            if isinstance(mem, Unavailable):
                for m in ("gpu_memory_used_bytes", "gpu_memory_free_bytes", "gpu_memory_total_bytes"):
                    dev.unsupported(m, mem.reason)
                return
            res = getattr(mem, "reserved", None)
            reserved = float(res) if res is not None else dev.state.get("memory_reserved", 0.0)
            used = float(mem.total) - float(mem.free) - reserved
        else:
            reserved = float(mem.reserved)
            dev.state["memory_reserved"] = reserved
            used = float(mem.used)
            dev.values["gpu_memory_reserved_bytes"] = reserved
            dev.supported("gpu_memory_reserved_bytes")
        v = dev.values
        v["gpu_memory_used_bytes"] = max(0.0, used)
        v["gpu_memory_free_bytes"] = float(mem.free)
        v["gpu_memory_total_bytes"] = float(mem.total)
        for m in ("gpu_memory_used_bytes", "gpu_memory_free_bytes", "gpu_memory_total_bytes"):
            dev.supported(m)

    def _fast(self, dev: Device, now: float) -> None:
        call, h = self.nvml.call, dev.handle
        if dev.state.get("memory_at") != now:  # the slow group read it this tick already
            self._memory(dev)
        reasons = call("nvmlDeviceGetCurrentClocksEventReasons", h)
        if isinstance(reasons, Unavailable):
            dev.unsupported("gpu_clock_event_reasons", reasons.reason)
            dev.unsupported("gpu_throttle_seconds_total", reasons.reason)
            dev.unsupported(_THERMAL_KEY, reasons.reason)
        else:
            self._throttle(dev, int(reasons), now)
        self._put(dev, "gpu_sm_clock_hertz", call("nvmlDeviceGetClockInfo", h, self._clock_sm), 1e6)

    def _medium(self, dev: Device, now: float) -> None:
        call, h, put = self.nvml.call, dev.handle, self._put
        util = call("nvmlDeviceGetUtilizationRates", h)
        if isinstance(util, Unavailable):
            dev.unsupported("gpu_utilization_ratio", util.reason)
            dev.unsupported("gpu_memory_utilization_ratio", util.reason)
        else:
            dev.values["gpu_utilization_ratio"] = util.gpu / 100.0
            dev.values["gpu_memory_utilization_ratio"] = util.memory / 100.0
            dev.supported("gpu_utilization_ratio")
            dev.supported("gpu_memory_utilization_ratio")
        power = call("nvmlDeviceGetPowerUsage", h)
        if put(dev, "gpu_power_watts", power, 1e-3):
            self._integrate_power(dev, power / 1000.0, now)

    def _integrate_power(self, dev: Device, watts: float, now: float) -> None:
        """Advance the energy counter between hardware reads by integrating power (trapezoid)."""
        st = dev.state
        last = st.get("power_last")
        if last is not None:
            t0, w0 = last
            st["energy_integral_j"] = st.get("energy_integral_j", 0.0) + (w0 + watts) / 2 * (now - t0)
        st["power_last"] = (now, watts)
        total = st.get("energy_anchor_j", 0.0) + st.get("energy_integral_j", 0.0)
        prev = dev.values.get("gpu_energy_joules_total", 0.0)
        dev.values["gpu_energy_joules_total"] = total if total > prev else prev
        if "gpu_energy_joules_total" not in dev.caps:
            dev.supported("gpu_energy_joules_total")

    def _energy(self, dev: Device) -> None:
        mj = self.nvml.call("nvmlDeviceGetTotalEnergyConsumption", dev.handle)
        if isinstance(mj, Unavailable):
            # Keep the integrated counter (joules since the sampler started) and say where it comes from.
            dev.caps["gpu_energy_joules_total"] = Capability(
                True, f"integrated from power; the hardware counter is unavailable ({mj.reason})")
            return
        st = dev.state
        st["energy_anchor_j"] = mj / 1000.0
        st["energy_integral_j"] = 0.0
        prev = dev.values.get("gpu_energy_joules_total", 0.0)
        hw = mj / 1000.0
        dev.values["gpu_energy_joules_total"] = hw if hw > prev else prev
        dev.supported("gpu_energy_joules_total")

    def _throttle(self, dev: Device, mask: int, now: float) -> None:
        v, st = dev.values, dev.state
        v["gpu_clock_event_reasons"] = float(mask)
        dev.supported("gpu_clock_event_reasons")
        last = st.get("reasons_last")
        if last is None:
            for key in (*_THROTTLE_KEYS.values(), _THERMAL_KEY):
                v.setdefault(key, 0.0)
            dev.supported("gpu_throttle_seconds_total")
            dev.supported(_THERMAL_KEY)
        else:
            t0, m0 = last
            dt = now - t0
            if m0:
                for bit, key in _THROTTLE_KEYS.items():
                    if m0 & bit:
                        v[key] += dt
                if m0 & _THERMAL_BITS:
                    v[_THERMAL_KEY] += dt
            if (m0 & ~_IDLE_BIT) != (mask & ~_IDLE_BIT):
                names = [n for n in decode_clock_event_reasons(mask) if n != "gpu_idle"]
                before = [n for n in decode_clock_event_reasons(m0) if n != "gpu_idle"]
                msg = (f"GPU {dev.label} clocks now limited by {', '.join(names)}" if names
                       else f"GPU {dev.label} clocks no longer limited (was {', '.join(before)})")
                self.events.append(Event(time.time_ns(), "clock_events", dev.label, msg,
                                         {"reasons": names, "previous": before, "mask": mask}))
        st["reasons_last"] = (now, mask)

    def _slow(self, dev: Device) -> None:
        call, h, put = self.nvml.call, dev.handle, self._put
        self._memory(dev, with_reserved=True)
        put(dev, "gpu_temperature_celsius", call("nvmlDeviceGetTemperature", h, self._temp_gpu))
        put(dev, "gpu_memory_clock_hertz", call("nvmlDeviceGetClockInfo", h, self._clock_mem), 1e6)
        put(dev, "gpu_graphics_clock_hertz", call("nvmlDeviceGetClockInfo", h, self._clock_gfx), 1e6)
        put(dev, "gpu_performance_state", call("nvmlDeviceGetPerformanceState", h))
        enc = call("nvmlDeviceGetEncoderUtilization", h)
        put(dev, "gpu_encoder_utilization_ratio", enc if isinstance(enc, Unavailable) else enc[0], 0.01)
        dec = call("nvmlDeviceGetDecoderUtilization", h)
        put(dev, "gpu_decoder_utilization_ratio", dec if isinstance(dec, Unavailable) else dec[0], 0.01)
        self._fields(dev, "slow_fields", self._slow_fields)
        if not dev.identity.gpm_supported:
            dev.state["counters_from_nvml"] = True
            self._fields(dev, "counter_fields", self._counter_fields)

    def _rare(self, dev: Device) -> None:
        call, h, put = self.nvml.call, dev.handle, self._put
        put(dev, "gpu_pcie_link_generation", call("nvmlDeviceGetCurrPcieLinkGeneration", h))
        put(dev, "gpu_pcie_link_width", call("nvmlDeviceGetCurrPcieLinkWidth", h))
        put(dev, "gpu_pcie_replay_errors_total", call("nvmlDeviceGetPcieReplayCounter", h))
        put(dev, "gpu_power_limit_watts", call("nvmlDeviceGetEnforcedPowerLimit", h), 1e-3)
        smax = dev.identity.sm_clock_max_hertz  # static: read once, at discovery
        if smax is not None:
            dev.values["gpu_sm_clock_max_hertz"] = smax
            dev.supported("gpu_sm_clock_max_hertz")
        else:
            put(dev, "gpu_sm_clock_max_hertz", call("nvmlDeviceGetMaxClockInfo", h, self._clock_sm), 1e6)
        rows = call("nvmlDeviceGetRemappedRows", h)
        if isinstance(rows, Unavailable):
            for m in ("gpu_remapped_rows_correctable_total", "gpu_remapped_rows_uncorrectable_total",
                      "gpu_row_remap_pending", "gpu_row_remap_failure"):
                dev.unsupported(m, rows.reason)
        else:
            for m, x in zip(("gpu_remapped_rows_correctable_total", "gpu_remapped_rows_uncorrectable_total",
                             "gpu_row_remap_pending", "gpu_row_remap_failure"), rows, strict=False):
                dev.values[m] = float(x)
                dev.supported(m)
        lib = self.lib
        for cause, label in ((lib.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, "sbe"),
                             (lib.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR, "dbe")):
            pages = call("nvmlDeviceGetRetiredPages", h, cause)
            if isinstance(pages, Unavailable):
                dev.unsupported("gpu_retired_pages", pages.reason + " (Ampere and newer remap rows instead)")
                break
            dev.values[series_key("gpu_retired_pages", cause=label)] = float(len(pages))
            dev.supported("gpu_retired_pages")


def _field_value(fv: Any) -> float:
    t, v = fv.valueType, fv.value
    if t == 0:
        return float(v.dVal)
    if t == 1:
        return float(v.uiVal)
    if t == 2:
        return float(v.ulVal)
    if t == 3:
        return float(v.ullVal)
    if t == 4:
        return float(v.sllVal)
    if t == 5:
        return float(v.siVal)
    return float(v.usVal)
