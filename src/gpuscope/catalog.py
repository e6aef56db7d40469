"""The metric catalog: the single source of truth for every series gpuscope produces.

Each entry names the series (Prometheus conventions: base units, ``_total`` for counters, ratios in
0..1), its unit, kind, the source that produces it, the NVML call(s) behind it, its cost class
(which decides the cadence), what it needs (Hopper+, root, no MIG), the DCGM field that means the
same thing, and the OpenTelemetry name.

    >>> from gpuscope.catalog import CATALOG
    >>> CATALOG["gpu_sm_active_ratio"].dcgm
    'DCGM_FI_PROF_SM_ACTIVE'
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    GAUGE = "gauge"
    COUNTER = "counter"


class Cost(str, Enum):
    """How often a field is read. The sampler maps each class to a period (see SamplerConfig)."""

    FAST = "fast"  # ~1-8 us per call and changes quickly (memory, throttle reasons, SM clock): every tick
    MEDIUM = "medium"  # the driver refreshes it every 1/6-1 s (utilization, 1 s-averaged power): every 200 ms
    GPM = "gpm"  # GPM window, >= 100 ms between its two samples
    SLOW = "slow"  # temperatures, other clocks, ECC, encoder, per-process data: every second
    ENERGY = "energy"  # the total-energy read costs ~3 ms of CPU on an H200: every 10 s, power integrated between
    RARE = "rare"  # link state, remapped rows, limits: every 30 s
    EVENT = "event"  # pushed by NVML event sets, never polled
    DERIVED = "derived"  # computed by the sampler from other reads


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    kind: Kind
    source: str
    cost: Cost
    help: str
    nvml: str = ""
    dcgm: str = ""
    dcgm_scale: float = 1.0  # multiply our value by this to get DCGM's unit
    otel: str = ""
    labels: tuple[str, ...] = ()  # labels beyond the device ones (gpu, uuid, model, hostname)
    needs: str = ""  # 'hopper', 'root', 'no-mig', 'nvlink', 'ecc' ...


G, C = Kind.GAUGE, Kind.COUNTER
_MIB = 1.0 / (1024 * 1024)

_METRICS = [
    # ---- NVML device source: the numbers nvidia-smi shows, each labelled for what it is ----
    Metric("gpu_utilization_ratio", "ratio", G, "nvml", Cost.MEDIUM,
           "NVML utilization.gpu: share of time any kernel or copy ran. NOT how busy the SMs were; "
           "see gpu_sm_active_ratio.", "nvmlDeviceGetUtilizationRates", "DCGM_FI_DEV_GPU_UTIL", 100.0,
           "hw.gpu.utilization", needs="no-mig"),
    Metric("gpu_memory_utilization_ratio", "ratio", G, "nvml", Cost.MEDIUM,
           "NVML utilization.memory: share of time device memory was read or written.",
           "nvmlDeviceGetUtilizationRates", "DCGM_FI_DEV_MEM_COPY_UTIL", 100.0, needs="no-mig"),
    Metric("gpu_encoder_utilization_ratio", "ratio", G, "nvml", Cost.SLOW, "Video encoder utilization.",
           "nvmlDeviceGetEncoderUtilization", "DCGM_FI_DEV_ENC_UTIL", 100.0),
    Metric("gpu_decoder_utilization_ratio", "ratio", G, "nvml", Cost.SLOW, "Video decoder utilization.",
           "nvmlDeviceGetDecoderUtilization", "DCGM_FI_DEV_DEC_UTIL", 100.0),
    Metric("gpu_memory_used_bytes", "bytes", G, "nvml", Cost.FAST, "Device memory in use.",
           "nvmlDeviceGetMemoryInfo", "DCGM_FI_DEV_FB_USED", _MIB, "hw.gpu.memory.usage"),
    Metric("gpu_memory_free_bytes", "bytes", G, "nvml", Cost.FAST, "Device memory free.",
           "nvmlDeviceGetMemoryInfo", "DCGM_FI_DEV_FB_FREE", _MIB),
    Metric("gpu_memory_reserved_bytes", "bytes", G, "nvml", Cost.FAST,
           "Device memory reserved by the driver and firmware.", "nvmlDeviceGetMemoryInfo_v2",
           "DCGM_FI_DEV_FB_RESERVED", _MIB),
    Metric("gpu_memory_total_bytes", "bytes", G, "nvml", Cost.RARE, "Device memory installed.",
           "nvmlDeviceGetMemoryInfo", "DCGM_FI_DEV_FB_TOTAL", _MIB, "hw.gpu.memory.limit"),
    Metric("gpu_power_watts", "watts", G, "nvml", Cost.MEDIUM,
           "Board power draw (averaged over 1 s by the driver on Ampere and newer).",
           "nvmlDeviceGetPowerUsage", "DCGM_FI_DEV_POWER_USAGE", 1.0, "hw.gpu.power"),
    Metric("gpu_power_limit_watts", "watts", G, "nvml", Cost.RARE, "Enforced power limit.",
           "nvmlDeviceGetEnforcedPowerLimit", "DCGM_FI_DEV_ENFORCED_POWER_LIMIT"),
    Metric("gpu_energy_joules_total", "joules", C, "nvml", Cost.ENERGY,
           "Energy used since the driver loaded: the hardware counter, advanced between its (costly) "
           "reads by integrating power.", "nvmlDeviceGetTotalEnergyConsumption",
           "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 1000.0, "hw.gpu.energy"),
    Metric("gpu_temperature_celsius", "celsius", G, "nvml", Cost.SLOW, "GPU die temperature.",
           "nvmlDeviceGetTemperature", "DCGM_FI_DEV_GPU_TEMP", 1.0, "hw.gpu.temperature"),
    Metric("gpu_memory_temperature_celsius", "celsius", G, "nvml", Cost.SLOW, "HBM temperature.",
           "nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)", "DCGM_FI_DEV_MEMORY_TEMP"),
    Metric("gpu_sm_clock_hertz", "hertz", G, "nvml", Cost.FAST, "SM clock.",
           "nvmlDeviceGetClockInfo(SM)", "DCGM_FI_DEV_SM_CLOCK", 1e-6),
    Metric("gpu_memory_clock_hertz", "hertz", G, "nvml", Cost.SLOW, "Memory clock.",
           "nvmlDeviceGetClockInfo(MEM)", "DCGM_FI_DEV_MEM_CLOCK", 1e-6),
    Metric("gpu_graphics_clock_hertz", "hertz", G, "nvml", Cost.SLOW, "Graphics clock.",
           "nvmlDeviceGetClockInfo(GRAPHICS)"),
    Metric("gpu_sm_clock_max_hertz", "hertz", G, "nvml", Cost.RARE, "Highest SM clock the GPU supports.",
           "nvmlDeviceGetMaxClockInfo(SM)", "DCGM_FI_DEV_MAX_SM_CLOCK", 1e-6),
    Metric("gpu_performance_state", "", G, "nvml", Cost.SLOW, "Performance state: 0 (P0, fastest) to 15.",
           "nvmlDeviceGetPerformanceState", "DCGM_FI_DEV_PSTATE"),
    Metric("gpu_clock_event_reasons", "", G, "nvml", Cost.FAST,
           "Raw clock-event (throttle) reason bitmask.", "nvmlDeviceGetCurrentClocksEventReasons",
           "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"),
    Metric("gpu_throttle_seconds_total", "seconds", C, "nvml", Cost.DERIVED,
           "Time spent with each clock-event reason active, accumulated at the sampling rate.",
           "nvmlDeviceGetCurrentClocksEventReasons", labels=("reason",)),
    Metric("gpu_thermal_throttle_seconds_total", "seconds", C, "nvml", Cost.DERIVED,
           "Time with either thermal reason (sw_thermal, hw_thermal) active, counted once (NVML's thermal "
           "violation policy): never faster than wall time, unlike the sum of the two reasons.",
           "nvmlDeviceGetCurrentClocksEventReasons", "DCGM_FI_DEV_THERMAL_VIOLATION", 1e9),
    Metric("gpu_pcie_link_generation", "", G, "nvml", Cost.RARE, "Current PCIe link generation.",
           "nvmlDeviceGetCurrPcieLinkGeneration", "DCGM_FI_DEV_PCIE_LINK_GEN"),
    Metric("gpu_pcie_link_width", "", G, "nvml", Cost.RARE, "Current PCIe link width (lanes).",
           "nvmlDeviceGetCurrPcieLinkWidth", "DCGM_FI_DEV_PCIE_LINK_WIDTH"),
    Metric("gpu_pcie_replay_errors_total", "", C, "nvml", Cost.RARE, "PCIe replay counter.",
           "nvmlDeviceGetPcieReplayCounter", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"),
    Metric("gpu_pcie_tx_bytes_total", "bytes", C, "nvml", Cost.DERIVED,
           "Bytes sent over PCIe by the GPU (NVML field counter, else the GPM rate integrated).",
           "NVML_FI_DEV_PCIE_COUNT_TX_BYTES"),
    Metric("gpu_pcie_rx_bytes_total", "bytes", C, "nvml", Cost.DERIVED,
           "Bytes received over PCIe by the GPU (NVML field counter, else the GPM rate integrated).",
           "NVML_FI_DEV_PCIE_COUNT_RX_BYTES"),
    Metric("gpu_nvlink_tx_bytes_total", "bytes", C, "nvml", Cost.DERIVED,
           "NVLink data bytes sent, all links (GPM rate integrated, else NVML throughput field).",
           "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", needs="nvlink"),
    Metric("gpu_nvlink_rx_bytes_total", "bytes", C, "nvml", Cost.DERIVED,
           "NVLink data bytes received, all links.", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
           needs="nvlink"),
    Metric("gpu_ecc_corrected_errors_total", "", C, "nvml", Cost.SLOW,
           "Corrected (single-bit) ECC errors since the driver loaded.", "nvmlDeviceGetTotalEccErrors",
           "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", needs="ecc"),
    Metric("gpu_ecc_uncorrected_errors_total", "", C, "nvml", Cost.SLOW,
           "Uncorrected (double-bit) ECC errors since the driver loaded.", "nvmlDeviceGetTotalEccErrors",
           "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", needs="ecc"),
    Metric("gpu_remapped_rows_correctable_total", "", C, "nvml", Cost.RARE,
           "Memory rows remapped after correctable errors.", "nvmlDeviceGetRemappedRows",
           "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"),
    Metric("gpu_remapped_rows_uncorrectable_total", "", C, "nvml", Cost.RARE,
           "Memory rows remapped after uncorrectable errors.", "nvmlDeviceGetRemappedRows",
           "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"),
    Metric("gpu_row_remap_pending", "", G, "nvml", Cost.RARE,
           "1 when a row remap waits for a GPU reset.", "nvmlDeviceGetRemappedRows",
           "DCGM_FI_DEV_ROW_REMAP_PENDING"),
    Metric("gpu_row_remap_failure", "", G, "nvml", Cost.RARE, "1 when a row remap failed.",
           "nvmlDeviceGetRemappedRows", "DCGM_FI_DEV_ROW_REMAP_FAILURE"),
    Metric("gpu_retired_pages", "", G, "nvml", Cost.RARE,
           "Pages retired (pre-Ampere GPUs), by cause.", "nvmlDeviceGetRetiredPages",
           labels=("cause",)),
    Metric("gpu_healthy", "", G, "nvml", Cost.DERIVED,
           "1 while NVML answers for the GPU, 0 after it fell off the bus (GPU is lost).", ""),
    # ---- Kubernetes: the kubelet's PodResources API joined with the processes' cgroups ----
    Metric("gpu_allocation_state", "", G, "kubelet", Cost.DERIVED,
           "1 for the GPU's state, 0 for the other three: unallocated (no pod holds it), allocated_idle (a pod "
           "holds it, nothing runs), in_use_by_pod, in_use_outside_kubernetes (a process in no pod's cgroup). "
           "Only where the agent reads the kubelet's PodResources API.", "", labels=("state",)),
    # ---- GPM (Hopper and newer): what the SMs, pipes and memory really did ----
    Metric("gpu_graphics_active_ratio", "ratio", G, "gpm", Cost.GPM,
           "Share of time the graphics/compute engine was active (GPM; like NVML utilization). Off by default: "
           "this one GPM metric costs ~1.4 ms of CPU per read on an H200, the others ~1 us.",
           "NVML_GPM_METRIC_GRAPHICS_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", needs="hopper"),
    Metric("gpu_sm_active_ratio", "ratio", G, "gpm", Cost.GPM,
           "Share of SMs busy, averaged over time: the truthful 'utilization'.",
           "NVML_GPM_METRIC_SM_UTIL", "DCGM_FI_PROF_SM_ACTIVE", 1.0, "hw.gpu.sm.active", needs="hopper"),
    Metric("gpu_sm_occupancy_ratio", "ratio", G, "gpm", Cost.GPM,
           "Resident warps relative to the SMs' maximum.", "NVML_GPM_METRIC_SM_OCCUPANCY",
           "DCGM_FI_PROF_SM_OCCUPANCY", needs="hopper"),
    Metric("gpu_tensor_active_ratio", "ratio", G, "gpm", Cost.GPM,
           "Share of time any tensor-core pipe was busy.", "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
           "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", needs="hopper"),
    Metric("gpu_tensor_hmma_active_ratio", "ratio", G, "gpm", Cost.GPM,
           "Tensor pipe busy with half-precision (FP16/BF16/TF32) MMA.", "NVML_GPM_METRIC_HMMA_TENSOR_UTIL",
           "DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE", needs="hopper"),
    Metric("gpu_tensor_imma_active_ratio", "ratio", G, "gpm", Cost.GPM,
           "Tensor pipe busy with integer MMA.", "NVML_GPM_METRIC_IMMA_TENSOR_UTIL",
           "DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE", needs="hopper"),
    Metric("gpu_tensor_dfma_active_ratio", "ratio", G, "gpm", Cost.GPM,
           "Tensor pipe busy with FP64 MMA.", "NVML_GPM_METRIC_DFMA_TENSOR_UTIL",
           "DCGM_FI_PROF_PIPE_TENSOR_DFMA_ACTIVE", needs="hopper"),
    Metric("gpu_fp64_active_ratio", "ratio", G, "gpm", Cost.GPM, "Non-tensor FP64 pipe activity.",
           "NVML_GPM_METRIC_FP64_UTIL", "DCGM_FI_PROF_PIPE_FP64_ACTIVE", needs="hopper"),
    Metric("gpu_fp32_active_ratio", "ratio", G, "gpm", Cost.GPM, "Non-tensor FP32 pipe activity.",
           "NVML_GPM_METRIC_FP32_UTIL", "DCGM_FI_PROF_PIPE_FP32_ACTIVE", needs="hopper"),
    Metric("gpu_fp16_active_ratio", "ratio", G, "gpm", Cost.GPM, "Non-tensor FP16 pipe activity.",
           "NVML_GPM_METRIC_FP16_UTIL", "DCGM_FI_PROF_PIPE_FP16_ACTIVE", needs="hopper"),
    Metric("gpu_integer_active_ratio", "ratio", G, "gpm", Cost.GPM, "Integer pipe activity.",
           "NVML_GPM_METRIC_INTEGER_UTIL", "DCGM_FI_PROF_PIPE_INT_ACTIVE", needs="hopper"),
    Metric("gpu_dram_active_ratio", "ratio", G, "gpm", Cost.GPM,
           "DRAM bandwidth used relative to the theoretical maximum.", "NVML_GPM_METRIC_DRAM_BW_UTIL",
           "DCGM_FI_PROF_DRAM_ACTIVE", needs="hopper"),
    Metric("gpu_pcie_tx_bytes_per_second", "bytes/s", G, "gpm", Cost.GPM, "PCIe send rate.",
           "NVML_GPM_METRIC_PCIE_TX_PER_SEC", "DCGM_FI_PROF_PCIE_TX_BYTES", needs="hopper"),
    Metric("gpu_pcie_rx_bytes_per_second", "bytes/s", G, "gpm", Cost.GPM, "PCIe receive rate.",
           "NVML_GPM_METRIC_PCIE_RX_PER_SEC", "DCGM_FI_PROF_PCIE_RX_BYTES", needs="hopper"),
    Metric("gpu_nvlink_tx_bytes_per_second", "bytes/s", G, "gpm", Cost.GPM, "NVLink send rate, all links.",
           "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", "DCGM_FI_PROF_NVLINK_TX_BYTES", needs="hopper"),
    Metric("gpu_nvlink_rx_bytes_per_second", "bytes/s", G, "gpm", Cost.GPM,
           "NVLink receive rate, all links.", "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC",
           "DCGM_FI_PROF_NVLINK_RX_BYTES", needs="hopper"),
    # ---- events (pushed by NVML event sets) ----
    Metric("gpu_xid_events_total", "", C, "events", Cost.EVENT, "XID errors reported by the driver, by code.",
           "nvmlEventSetWait(XidCriticalError)", labels=("xid",)),
    Metric("gpu_ecc_events_total", "", C, "events", Cost.EVENT, "ECC error events, by type.",
           "nvmlEventSetWait(Single/DoubleBitEccError)", labels=("type",)),
    # ---- per process on a GPU ----
    Metric("gpu_process_memory_used_bytes", "bytes", G, "processes", Cost.SLOW,
           "GPU memory held by the process.", "nvmlDeviceGetComputeRunningProcesses",
           labels=("pid", "process", "user")),
    Metric("gpu_process_sm_active_ratio", "ratio", G, "processes", Cost.SLOW,
           "The process's share of the GPU's SM activity: NVML per-process utilization scaled so that the "
           "processes of a GPU sum to gpu_sm_active_ratio (an estimate; NVML's own figure, unscaled, where "
           "the GPU has no GPM).", "nvmlDeviceGetProcessUtilization", labels=("pid", "process", "user"),
           needs="no-mig"),
    Metric("gpu_process_memory_utilization_ratio", "ratio", G, "processes", Cost.SLOW,
           "NVML per-process memory-controller utilization.", "nvmlDeviceGetProcessUtilization",
           labels=("pid", "process", "user"), needs="no-mig"),
    Metric("gpu_process_utilization_ratio", "ratio", G, "processes", Cost.SLOW,
           "NVML per-process utilization (smUtil): share of time a kernel of the process ran, the "
           "per-process gpu_utilization_ratio. NOT how busy the SMs were; see gpu_process_sm_active_ratio.",
           "nvmlDeviceGetProcessUtilization", labels=("pid", "process", "user"), needs="no-mig"),
    Metric("gpu_process_energy_joules_total", "joules", C, "processes", Cost.SLOW,
           "GPU energy shared out to the process by its share of the GPU's busy time, since the agent first "
           "saw it on this GPU (an estimate).", "nvmlDeviceGetProcessUtilization",
           labels=("pid", "process", "user"), needs="no-mig"),
    # ---- per pod on a GPU: its processes summed (gpuscope.shares.roll_up) ----
    Metric("gpu_pod_memory_used_bytes", "bytes", G, "processes", Cost.SLOW,
           "GPU memory held by the pod's processes.", "nvmlDeviceGetComputeRunningProcesses",
           labels=("namespace", "pod", "container")),
    Metric("gpu_pod_sm_active_ratio", "ratio", G, "processes", Cost.SLOW,
           "The pod's share of the GPU's SM activity (its processes' gpu_process_sm_active_ratio summed).",
           "nvmlDeviceGetProcessUtilization", labels=("namespace", "pod", "container"), needs="no-mig"),
    Metric("gpu_pod_energy_joules_total", "joules", C, "processes", Cost.SLOW,
           "GPU energy shared out to the pod's processes by SM share, while the pod has a process on the GPU "
           "(an estimate).", "nvmlDeviceGetProcessUtilization", labels=("namespace", "pod", "container"),
           needs="no-mig"),
    Metric("process_cpu_cores", "cores", G, "processes", Cost.SLOW,
           "CPU used by the process, in cores (1.0 = one core saturated).", "",
           labels=("pid", "process", "user")),
    Metric("process_thread_cpu_max_ratio", "ratio", G, "processes", Cost.SLOW,
           "CPU of the process's busiest thread, in cores: 1.0 means one Python thread is the bottleneck.",
           "", labels=("pid", "process", "user")),
    Metric("process_resident_memory_bytes", "bytes", G, "processes", Cost.SLOW, "Resident host memory.",
           "", labels=("pid", "process", "user")),
    Metric("process_threads", "", G, "processes", Cost.SLOW, "Threads in the process.", "",
           labels=("pid", "process", "user")),
    Metric("process_threads_busy", "", G, "processes", Cost.SLOW,
           "Threads of the process using half a core or more: a runtime that dispatches from several threads "
           "(JAX/XLA, TensorFlow) is busy with none of them saturated.", "", labels=("pid", "process", "user")),
    # ---- per process, CUDA driver API calls counted by eBPF uprobes on libcuda (sources.cudaprobe) ----
    Metric("process_cuda_launches_total", "", C, "cudaprobe", Cost.SLOW,
           "Kernel launches through the CUDA driver API (cuLaunchKernel, cuLaunchKernelEx, cooperative), "
           "counted by eBPF probes on libcuda since they first saw the process.", "",
           labels=("pid", "process", "user"), needs="bpf"),
    Metric("process_cuda_graph_launches_total", "", C, "cudaprobe", Cost.SLOW,
           "CUDA graph launches (cuGraphLaunch); each runs many kernels the launch count does not see.", "",
           labels=("pid", "process", "user"), needs="bpf"),
    Metric("process_cuda_copies_total", "", C, "cudaprobe", Cost.SLOW,
           "Copies through the driver API (cuMemcpy*, synchronous and async, 1D and 2D), all directions.", "",
           labels=("pid", "process", "user"), needs="bpf"),
    Metric("process_cuda_h2d_bytes_total", "bytes", C, "cudaprobe", Cost.SLOW,
           "Bytes the process asked to copy host to device (cuMemcpyHtoD*, 2D copies from host memory).", "",
           labels=("pid", "process", "user"), needs="bpf"),
    Metric("process_cuda_d2h_bytes_total", "bytes", C, "cudaprobe", Cost.SLOW,
           "Bytes the process asked to copy device to host.", "", labels=("pid", "process", "user"), needs="bpf"),
    Metric("process_cuda_d2d_bytes_total", "bytes", C, "cudaprobe", Cost.SLOW,
           "Bytes copied device to device and peer to peer.", "", labels=("pid", "process", "user"), needs="bpf"),
    Metric("process_cuda_other_copy_bytes_total", "bytes", C, "cudaprobe", Cost.SLOW,
           "Bytes of cuMemcpy / cuMemcpyAsync, whose direction the driver infers from unified addresses.", "",
           labels=("pid", "process", "user"), needs="bpf"),
    Metric("process_cuda_syncs_total", "", C, "cudaprobe", Cost.SLOW,
           "Synchronisations (cuStreamSynchronize, cuCtxSynchronize, cuEventSynchronize) that returned.", "",
           labels=("pid", "process", "user"), needs="bpf"),
    Metric("process_cuda_sync_seconds_total", "seconds", C, "cudaprobe", Cost.SLOW,
           "Time the process's threads spent inside those synchronisations, summed over threads: its rate is "
           "the share of a thread waiting on the GPU.", "", labels=("pid", "process", "user"), needs="bpf"),
    # ---- host ----
    Metric("host_cpu_ratio", "ratio", G, "host", Cost.SLOW, "Host CPU busy, all cores (0..1).", "",
           otel="system.cpu.utilization"),
    Metric("host_cpu_core_ratio", "ratio", G, "host", Cost.SLOW, "Host CPU busy per core (0..1).", "",
           labels=("cpu",)),
    Metric("host_load1", "", G, "host", Cost.SLOW, "1-minute load average.", ""),
    Metric("host_load5", "", G, "host", Cost.SLOW, "5-minute load average.", ""),
    Metric("host_load15", "", G, "host", Cost.SLOW, "15-minute load average.", ""),
    Metric("host_memory_total_bytes", "bytes", G, "host", Cost.SLOW, "Host memory installed.", ""),
    Metric("host_memory_available_bytes", "bytes", G, "host", Cost.SLOW, "Host memory available.", ""),
    Metric("host_memory_used_bytes", "bytes", G, "host", Cost.SLOW, "Host memory used.", "",
           otel="system.memory.usage"),
    Metric("host_swap_used_bytes", "bytes", G, "host", Cost.SLOW, "Swap in use.", ""),
    Metric("host_disk_read_bytes_total", "bytes", C, "host", Cost.SLOW, "Bytes read from disks.", ""),
    Metric("host_disk_write_bytes_total", "bytes", C, "host", Cost.SLOW, "Bytes written to disks.", ""),
    Metric("host_network_receive_bytes_total", "bytes", C, "host", Cost.SLOW,
           "Bytes received, all interfaces but loopback.", ""),
    Metric("host_network_transmit_bytes_total", "bytes", C, "host", Cost.SLOW,
           "Bytes sent, all interfaces but loopback.", ""),
    # ---- the sampler's own cost ----
    Metric("gpuscope_sampler_cpu_seconds_total", "seconds", C, "sampler", Cost.DERIVED,
           "CPU time used by the sampler thread itself.", ""),
    Metric("gpuscope_sampler_ticks_total", "", C, "sampler", Cost.DERIVED, "Sampling ticks run.", ""),
    Metric("gpuscope_sampler_missed_ticks_total", "", C, "sampler", Cost.DERIVED,
           "Ticks skipped because the sampler ran late (the schedule never drifts; it skips).", ""),
]

CATALOG: dict[str, Metric] = {m.name: m for m in _METRICS}

#: ProcessRecord attribute -> the series it is stored and exported as (labels gpu, pid, process, user).
PROCESS_SERIES: tuple[tuple[str, str], ...] = (
    ("gpu_memory_bytes", "gpu_process_memory_used_bytes"),
    ("sm_ratio", "gpu_process_sm_active_ratio"),
    ("memory_ratio", "gpu_process_memory_utilization_ratio"),
    ("utilization_ratio", "gpu_process_utilization_ratio"),
    ("energy_joules", "gpu_process_energy_joules_total"),
    ("cpu_cores", "process_cpu_cores"),
    ("thread_cpu_max_ratio", "process_thread_cpu_max_ratio"),
    ("rss_bytes", "process_resident_memory_bytes"),
    ("threads", "process_threads"),
    ("threads_busy", "process_threads_busy"),
    ("cuda_launches", "process_cuda_launches_total"),
    ("cuda_graph_launches", "process_cuda_graph_launches_total"),
    ("cuda_copies", "process_cuda_copies_total"),
    ("cuda_h2d_bytes", "process_cuda_h2d_bytes_total"),
    ("cuda_d2h_bytes", "process_cuda_d2h_bytes_total"),
    ("cuda_d2d_bytes", "process_cuda_d2d_bytes_total"),
    ("cuda_other_copy_bytes", "process_cuda_other_copy_bytes_total"),
    ("cuda_syncs", "process_cuda_syncs_total"),
    ("cuda_sync_seconds", "process_cuda_sync_seconds_total"),
)

#: PodRecord attribute -> the series it is exported as (labels gpu, namespace, pod, container).
POD_SERIES: tuple[tuple[str, str], ...] = (
    ("gpu_memory_bytes", "gpu_pod_memory_used_bytes"),
    ("sm_ratio", "gpu_pod_sm_active_ratio"),
    ("energy_joules", "gpu_pod_energy_joules_total"),
)

#: Clock-event (throttle) reason bits, as NVML defines them, and our names for them.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clock",
    0x200: "board_limit",
    0x400: "reliability",
}


def decode_clock_event_reasons(mask: int) -> list[str]:
    """Names of the reasons set in an NVML clock-event bitmask, lowest bit first."""
    return list(_decode_reasons(mask))


@functools.lru_cache(maxsize=256)  # a handful of masks recur in every sample of a diagnosis
def _decode_reasons(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit)


#: gpu_allocation_state's states (its `state` label), as its help names them.
ALLOCATION_STATES: tuple[str, ...] = ("unallocated", "allocated_idle", "in_use_by_pod", "in_use_outside_kubernetes")


def series_key(name: str, **labels: object) -> str:
    """The key of one series inside a record: the metric name, plus its own labels if it has any.

    >>> series_key("gpu_throttle_seconds_total", reason="sw_power_cap")
    'gpu_throttle_seconds_total{reason="sw_power_cap"}'
    """
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}}"


def _escape(v: object) -> str:
    """Label values escaped as in Prometheus's text format."""
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def split_series_key(key: str) -> tuple[str, dict[str, str]]:
    """Inverse of series_key."""
    brace = key.find("{")
    if brace < 0:
        return key, {}
    labels: dict[str, str] = {}
    body, i = key[brace + 1 : -1], 0
    while i < len(body):
        eq = body.index("=", i)
        j, out = eq + 2, []
        while body[j] != '"':
            if body[j] == "\\":
                j += 1
                out.append("\n" if body[j] == "n" else body[j])
            else:
                out.append(body[j])
            j += 1
        labels[body[i:eq]] = "".join(out)
        i = j + 2
    return key[:brace], labels
