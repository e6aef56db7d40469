"""A fake NVML at the function level: what the simulated node (`--simulate`, gpuscope.sim) runs on at run
time, and what tests of code built on gpuscope inject (through gpuscope.testing, which re-exports it).

`FakeNVML` has the same function names, arguments and return shapes as `pynvml` for every call
gpuscope makes, and raises the real `pynvml.NVMLError` subclasses. Each `FakeGPU` holds plain
state a test can change between calls (or a `dynamics` callback that changes it with time, which is
what the simulated node does).

    >>> from gpuscope.fakenvml import FakeNVML, FakeGPU
    >>> nvml = FakeNVML([FakeGPU(index=0), FakeGPU(index=1)])
    >>> nvml.nvmlInit(); nvml.nvmlDeviceGetCount()
    2

Scenario fixtures (`healthy_gpus()`, `lost_gpu()`, ...) live in gpuscope.testing.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml as _real

NVMLError = _real.NVMLError

HOPPER = 9
AMPERE = 7


@dataclass
class FakeProcess:
    pid: int
    used_memory_bytes: int | None = 1 << 30
    sm_percent: int = 0
    mem_percent: int = 0
    graphics: bool = False
    gpu_instance_id: int = 0xFFFFFFFF


@dataclass
class FakeMig:
    """A MIG GPU instance on a FakeGPU."""

    gpu_instance_id: int
    memory_total_bytes: int = 20 << 30
    memory_used_bytes: int = 0
    gpm: dict[int, float] = field(default_factory=dict)
    parent: FakeGPU | None = None


@dataclass
class FakeGPU:
    index: int = 0
    name: str = "NVIDIA H200"
    uuid: str = ""
    bus_id: str = ""
    architecture: int = HOPPER
    compute_capability: tuple[int, int] = (9, 0)
    memory_total_bytes: int = 143771 << 20
    memory_used_bytes: int = 512 << 20
    memory_reserved_bytes: int = 600 << 20
    util_gpu: int = 0
    util_mem: int = 0
    enc_util: int = 0
    dec_util: int = 0
    power_w: float = 120.0
    power_limit_w: float = 700.0
    energy_mj: int = 1_000_000
    temperature_c: int = 30
    memory_temperature_c: int = 35
    sm_clock_mhz: int = 345
    mem_clock_mhz: int = 3201
    graphics_clock_mhz: int = 345
    sm_clock_max_mhz: int = 1980
    pstate: int = 0
    clock_event_reasons: int = 0x1
    pcie_gen: int = 5
    pcie_width: int = 16
    pcie_replay: int = 0
    pcie_tx_bytes: int = 0  # cumulative, NVML_FI_DEV_PCIE_COUNT_TX_BYTES
    pcie_rx_bytes: int = 0
    nvlink_tx_kib: int = 0
    nvlink_rx_kib: int = 0
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # corr, unc, pending, failure
    gpm: dict[int, float] = field(default_factory=dict)  # GPM metric id -> value (percent or MiB/s)
    processes: list[FakeProcess] = field(default_factory=list)
    mig: list[FakeMig] = field(default_factory=list)
    numa_cpus: list[int] = field(default_factory=lambda: list(range(8)))
    # Failure injection: NVML function name -> NVML error code raised by that call on this GPU.
    errors: dict[str, int] = field(default_factory=dict)
    # Field ids (nvmlDeviceGetFieldValues) this GPU reports as not supported.
    unsupported_fields: set[int] = field(default_factory=set)
    lost: bool = False
    # Called as dynamics(gpu, seconds_since_start) before each read; the simulated node uses it.
    dynamics: Callable[[FakeGPU, float], None] | None = None
    proc_util_last_ts: int = 0

    def __post_init__(self) -> None:
        if not self.uuid:
            self.uuid = f"GPU-fake0000-0000-0000-0000-{self.index:012d}"
        if not self.bus_id:
            self.bus_id = f"00000000:{0x18 + self.index * 0x10:02X}:00.0"
        for m in self.mig:
            m.parent = self

    @property
    def gpm_supported(self) -> bool:
        return self.architecture >= HOPPER


_DEFAULT = object()


class _FakeGpmSample:
    __slots__ = ("device", "gi", "mono", "values")

    def __init__(self) -> None:
        self.device: Any = None
        self.gi: int | None = None
        self.mono = 0.0
        self.values: dict[int, float] = {}


class _GpmMetric:
    __slots__ = ("metricId", "nvmlReturn", "value", "metricInfo")

    def __init__(self) -> None:
        self.metricId = 0
        self.nvmlReturn = 0
        self.value = 0.0
        self.metricInfo = None


class FakeGpmMetricsGet:
    """Stands in for pynvml.c_nvmlGpmMetricsGet_t."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: Any = None
        self.sample2: Any = None
        self.metrics = [_GpmMetric() for _ in range(_real.NVML_GPM_METRIC_MAX)]


class FakeNVML:
    """A module-like fake of pynvml. Constants and classes not defined here come from pynvml."""

    c_nvmlGpmMetricsGet_t = FakeGpmMetricsGet
    NVMLError = _real.NVMLError

    def __init__(
        self,
        gpus: list[FakeGPU] | None = None,
        driver_version: str = "580.159.03",
        cuda_driver_version: int = 13000,
        available: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gpus = gpus if gpus is not None else [FakeGPU(index=0)]
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.available = available
        self.clock = clock
        self.t0 = clock()
        self.initialized = False
        self.calls: dict[str, int] = {}
        self.gpm_short_intervals = 0  # GPM metric reads over samples < 100 ms apart
        self._events: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        # Constants (NVML_*), structures (c_nvml*) and anything else not faked come from pynvml;
        # functions we do not fake must not silently reach the real library.
        if name.startswith("nvml") and callable(getattr(_real, name, None)):
            raise AttributeError(name)
        return getattr(_real, name)

    # -- helpers -------------------------------------------------------------------------------
    def _enter(self, name: str, handle: Any = None) -> Any:
        self.calls[name] = self.calls.get(name, 0) + 1
        if not self.initialized:
            raise NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        gpu = handle.parent if isinstance(handle, FakeMig) else handle
        if isinstance(gpu, FakeGPU):
            if gpu.lost:
                raise NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
            code = gpu.errors.get(name)
            if code is not None:
                raise NVMLError(code)
            if gpu.dynamics is not None:
                with self._lock:
                    gpu.dynamics(gpu, self.clock() - self.t0)
        return gpu

    def inject_event(self, gpu: FakeGPU, event_type: int, data: int = 0) -> None:
        """Queue an NVML event (e.g. nvmlEventTypeXidCriticalError with data=79)."""
        self._events.put(SimpleNamespace(device=gpu, eventType=event_type, eventData=data,
                                         gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF))

    # -- system --------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] = self.calls.get("nvmlInit", 0) + 1
        if not self.available:
            raise NVMLError(_real.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGPU:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if gpu.lost:
            raise NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
        return gpu

    # -- identity ------------------------------------------------------------------------------
    def nvmlDeviceGetUUID(self, h: Any) -> str:
        g = self._enter("nvmlDeviceGetUUID", h)
        if isinstance(h, FakeMig):
            return f"MIG-{g.uuid[4:]}-{h.gpu_instance_id}"
        return g.uuid

    def nvmlDeviceGetName(self, h: Any) -> str:
        g = self._enter("nvmlDeviceGetName", h)
        return g.name if not isinstance(h, FakeMig) else f"{g.name} MIG"

    def nvmlDeviceGetPciInfo_v3(self, h: Any) -> Any:
        g = self._enter("nvmlDeviceGetPciInfo_v3", h)
        return SimpleNamespace(busId=g.bus_id)

    def nvmlDeviceGetArchitecture(self, h: Any) -> int:
        return self._enter("nvmlDeviceGetArchitecture", h).architecture

    def nvmlDeviceGetCudaComputeCapability(self, h: Any) -> tuple[int, int]:
        return self._enter("nvmlDeviceGetCudaComputeCapability", h).compute_capability

    def nvmlDeviceGetCpuAffinity(self, h: Any, size: int) -> list[int]:
        g = self._enter("nvmlDeviceGetCpuAffinity", h)
        words = [0] * size
        for cpu in g.numa_cpus:
            if cpu // 64 < size:
                words[cpu // 64] |= 1 << (cpu % 64)
        return words

    def nvmlDeviceGetMigMode(self, h: Any) -> list[int]:
        g = self._enter("nvmlDeviceGetMigMode", h)
        on = 1 if g.mig else 0
        return [on, on]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> int:
        return 7 if self._enter("nvmlDeviceGetMaxMigDeviceCount", h).mig else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, i: int) -> FakeMig:
        g = self._enter("nvmlDeviceGetMigDeviceHandleByIndex", h)
        if i >= len(g.mig):
            raise NVMLError(_real.NVML_ERROR_NOT_FOUND)
        return g.mig[i]

    def nvmlDeviceGetGPUInstanceId(self, h: Any) -> int:
        self._enter("nvmlDeviceGetGPUInstanceId", h)
        if not isinstance(h, FakeMig):
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return h.gpu_instance_id

    # -- fast fields ---------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        g = self._enter("nvmlDeviceGetUtilizationRates", h)
        if isinstance(h, FakeMig) or g.mig:
            raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=g.util_gpu, memory=g.util_mem)

    def nvmlDeviceGetEncoderUtilization(self, h: Any) -> list[int]:
        return [self._enter("nvmlDeviceGetEncoderUtilization", h).enc_util, 167000]

    def nvmlDeviceGetDecoderUtilization(self, h: Any) -> list[int]:
        return [self._enter("nvmlDeviceGetDecoderUtilization", h).dec_util, 167000]

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: Any = None) -> Any:
        g = self._enter("nvmlDeviceGetMemoryInfo", h)
        if isinstance(h, FakeMig):
            total, used, reserved = h.memory_total_bytes, h.memory_used_bytes, 0
        else:
            total, used, reserved = g.memory_total_bytes, g.memory_used_bytes, g.memory_reserved_bytes
        free = total - used - reserved
        if version is None:  # v1, like the driver: 'used' includes what the driver reserves
            return SimpleNamespace(total=total, used=total - free, free=free)
        return SimpleNamespace(total=total, used=used, free=free, reserved=reserved)

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        return int(self._enter("nvmlDeviceGetPowerUsage", h).power_w * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(self, h: Any) -> int:
        return int(self._enter("nvmlDeviceGetEnforcedPowerLimit", h).power_limit_w * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, h: Any) -> int:
        return int(self._enter("nvmlDeviceGetTotalEnergyConsumption", h).energy_mj)

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        return self._enter("nvmlDeviceGetTemperature", h).temperature_c

    def nvmlDeviceGetClockInfo(self, h: Any, kind: int) -> int:
        g = self._enter("nvmlDeviceGetClockInfo", h)
        return {_real.NVML_CLOCK_SM: g.sm_clock_mhz, _real.NVML_CLOCK_MEM: g.mem_clock_mhz,
                _real.NVML_CLOCK_GRAPHICS: g.graphics_clock_mhz}.get(kind, 0)

    def nvmlDeviceGetMaxClockInfo(self, h: Any, kind: int) -> int:
        return self._enter("nvmlDeviceGetMaxClockInfo", h).sm_clock_max_mhz

    def nvmlDeviceGetPerformanceState(self, h: Any) -> int:
        return self._enter("nvmlDeviceGetPerformanceState", h).pstate

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        return self._enter("nvmlDeviceGetCurrentClocksEventReasons", h).clock_event_reasons

    def nvmlDeviceGetFieldValues(self, h: Any, field_ids: list[Any]) -> list[Any]:
        g = self._enter("nvmlDeviceGetFieldValues", h)
        table: dict[int, tuple[int, float]] = {
            _real.NVML_FI_DEV_MEMORY_TEMP: (_real.NVML_VALUE_TYPE_UNSIGNED_INT, g.memory_temperature_c),
            _real.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: (_real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, g.ecc_corrected),
            _real.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: (_real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, g.ecc_uncorrected),
            _real.NVML_FI_DEV_POWER_INSTANT: (_real.NVML_VALUE_TYPE_UNSIGNED_INT, int(g.power_w * 1000)),
            _real.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: (_real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, g.energy_mj),
            _real.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: (_real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, g.pcie_tx_bytes),
            _real.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: (_real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, g.pcie_rx_bytes),
            _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: (_real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, g.nvlink_tx_kib),
            _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: (_real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, g.nvlink_rx_kib),
        }
        out = []
        for fid in field_ids:
            fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
            vtype, v = table.get(fid, (0, 0))
            ret = _real.NVML_SUCCESS
            if fid not in table or fid in g.unsupported_fields:
                ret = _real.NVML_ERROR_NOT_SUPPORTED
            value = SimpleNamespace(dVal=float(v), uiVal=int(v), ulVal=int(v), ullVal=int(v),
                                    sllVal=int(v), siVal=int(v), usVal=int(v))
            out.append(SimpleNamespace(fieldId=fid, scopeId=scope, timestamp=int(time.time() * 1e6),
                                       latencyUsec=0, valueType=vtype, nvmlReturn=ret, value=value))
        return out

    # -- slow and rare fields ------------------------------------------------------------------
    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: Any) -> int:
        return self._enter("nvmlDeviceGetCurrPcieLinkGeneration", h).pcie_gen

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: Any) -> int:
        return self._enter("nvmlDeviceGetCurrPcieLinkWidth", h).pcie_width

    def nvmlDeviceGetPcieReplayCounter(self, h: Any) -> int:
        return self._enter("nvmlDeviceGetPcieReplayCounter", h).pcie_replay

    def nvmlDeviceGetTotalEccErrors(self, h: Any, error_type: int, counter_type: int) -> int:
        g = self._enter("nvmlDeviceGetTotalEccErrors", h)
        return g.ecc_corrected if error_type == _real.NVML_MEMORY_ERROR_TYPE_CORRECTED else g.ecc_uncorrected

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, int, int, int]:
        return self._enter("nvmlDeviceGetRemappedRows", h).remapped_rows

    def nvmlDeviceGetRetiredPages(self, h: Any, cause: int) -> list[int]:
        g = self._enter("nvmlDeviceGetRetiredPages", h)
        if g.architecture >= AMPERE:
            raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return []

    # -- processes -----------------------------------------------------------------------------
    def _procs(self, h: Any, graphics: bool) -> list[Any]:
        g = h.parent if isinstance(h, FakeMig) else h
        out = []
        for p in g.processes:
            if p.graphics != graphics:
                continue
            if isinstance(h, FakeMig) and p.gpu_instance_id != h.gpu_instance_id:
                continue
            out.append(SimpleNamespace(pid=p.pid, usedGpuMemory=p.used_memory_bytes,
                                       gpuInstanceId=p.gpu_instance_id, computeInstanceId=0xFFFFFFFF))
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        self._enter("nvmlDeviceGetComputeRunningProcesses", h)
        return self._procs(h, graphics=False)

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: Any) -> list[Any]:
        self._enter("nvmlDeviceGetGraphicsRunningProcesses", h)
        return self._procs(h, graphics=True)

    def nvmlDeviceGetProcessUtilization(self, h: Any, last_seen_us: int) -> list[Any]:
        g = self._enter("nvmlDeviceGetProcessUtilization", h)
        if isinstance(h, FakeMig) or g.mig:
            raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        now_us = int(time.time() * 1e6)
        busy = [p for p in g.processes if p.sm_percent or p.mem_percent]
        # Like the driver: one sample per process with non-zero use in the last period, newer than
        # the caller's last-seen stamp; nothing new is NVML_ERROR_NOT_FOUND.
        if not busy or last_seen_us >= now_us:
            raise NVMLError(_real.NVML_ERROR_NOT_FOUND)
        return [SimpleNamespace(pid=p.pid, timeStamp=now_us, smUtil=p.sm_percent, memUtil=p.mem_percent,
                                encUtil=0, decUtil=0) for p in busy]

    # -- GPM -----------------------------------------------------------------------------------
    def nvmlGpmQueryDeviceSupport(self, h: Any) -> Any:
        g = self._enter("nvmlGpmQueryDeviceSupport", h)
        return SimpleNamespace(isSupportedDevice=1 if g.gpm_supported else 0)

    def nvmlGpmSampleAlloc(self) -> _FakeGpmSample:
        self.calls["nvmlGpmSampleAlloc"] = self.calls.get("nvmlGpmSampleAlloc", 0) + 1
        return _FakeGpmSample()

    def nvmlGpmSampleFree(self, s: _FakeGpmSample) -> None:
        self.calls["nvmlGpmSampleFree"] = self.calls.get("nvmlGpmSampleFree", 0) + 1

    def _gpm_sample(self, name: str, h: Any, gi: int | None, s: _FakeGpmSample) -> None:
        g = self._enter(name, h)
        if not g.gpm_supported:
            raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        src = g.gpm
        if gi is not None:
            mig = next((m for m in g.mig if m.gpu_instance_id == gi), None)
            if mig is None:
                raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
            src = mig.gpm
        s.device, s.gi, s.mono, s.values = g, gi, self.clock(), dict(src)

    def nvmlGpmSampleGet(self, h: Any, s: _FakeGpmSample) -> None:
        self._gpm_sample("nvmlGpmSampleGet", h, None, s)

    def nvmlGpmMigSampleGet(self, h: Any, gi: int, s: _FakeGpmSample) -> None:
        self._gpm_sample("nvmlGpmMigSampleGet", h, gi, s)

    def nvmlGpmMetricsGet(self, q: FakeGpmMetricsGet) -> FakeGpmMetricsGet:
        self._enter("nvmlGpmMetricsGet")
        s1, s2 = q.sample1, q.sample2
        if s2.mono - s1.mono < 0.1:
            self.gpm_short_intervals += 1
        for i in range(q.numMetrics):
            m = q.metrics[i]
            if m.metricId in s2.values:
                a, b = s1.values.get(m.metricId, 0.0), s2.values[m.metricId]
                m.value, m.nvmlReturn = (a + b) / 2, _real.NVML_SUCCESS
            else:
                m.value, m.nvmlReturn = 0.0, _real.NVML_ERROR_NOT_SUPPORTED
        return q

    # -- events --------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> object:
        self._enter("nvmlEventSetCreate")
        return object()

    def nvmlDeviceGetSupportedEventTypes(self, h: Any) -> int:
        self._enter("nvmlDeviceGetSupportedEventTypes", h)
        return (_real.nvmlEventTypeXidCriticalError | _real.nvmlEventTypeSingleBitEccError
                | _real.nvmlEventTypeDoubleBitEccError | _real.nvmlEventTypeClock)

    def nvmlDeviceRegisterEvents(self, h: Any, mask: int, event_set: object) -> None:
        self._enter("nvmlDeviceRegisterEvents", h)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> Any:
        self.calls["nvmlEventSetWait_v2"] = self.calls.get("nvmlEventSetWait_v2", 0) + 1
        try:
            return self._events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(_real.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, event_set: object) -> None:
        return None
