"""Windows for the verdict rules built the way the sampler builds them: Snapshots of real GpuRecords and
ProcessRecords (the processes reread once a second, their records repeated between reads, as the sampler
does), turned into windows by diagnose.windows_from_snapshots. Shared by test_process_verdicts.py and
test_host_bound.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuscope._records import THREAD_BUSY_RATIO, GpuIdentity, GpuRecord, ProcessRecord, Snapshot, ThreadCpu
from gpuscope.diagnose import GpuWindow, windows_from_snapshots

H200 = GpuIdentity(0, "GPU-test-0", "NVIDIA H200", memory_total_bytes=143771 * 2**20, sm_clock_max_hertz=1.98e9)
GIB = float(2**30)

#: GPU states as the rules read them (0..1 ratios, bytes, bytes per second).
COMPUTE = {"gpu_utilization_ratio": 1.0, "gpu_sm_active_ratio": 0.96, "gpu_tensor_active_ratio": 0.9,
           "gpu_dram_active_ratio": 0.17, "gpu_fp32_active_ratio": 0.0, "gpu_fp16_active_ratio": 0.0,
           "gpu_pcie_rx_bytes_per_second": 15e6, "gpu_pcie_tx_bytes_per_second": 10e6}
HEALTHY = {**COMPUTE, "gpu_sm_active_ratio": 0.895, "gpu_tensor_active_ratio": 0.32, "gpu_dram_active_ratio": 0.377}
EAGER = {"gpu_utilization_ratio": 0.03, "gpu_sm_active_ratio": 0.001, "gpu_tensor_active_ratio": 0.0,
         "gpu_dram_active_ratio": 0.001, "gpu_fp32_active_ratio": 0.001, "gpu_fp16_active_ratio": 0.0,
         "gpu_pcie_rx_bytes_per_second": 40e6, "gpu_pcie_tx_bytes_per_second": 10e6}


def proc(pid: int, name: str = "python", *, sm: float | None, cpu: float | None, threads: tuple[float, ...] = (),
         util: float | None = None, memory: float = 2 * GIB, **kw: Any) -> ProcessRecord:
    """A GPU process record: its SM share, CPU in cores and its threads' CPU (busiest first; the busy ones,
    at THREAD_BUSY_RATIO or more, are counted and named as the host reader counts and names them)."""
    busy = [ThreadCpu(pid + i, name if i == 0 else f"worker-{i}", r) for i, r in enumerate(threads)
            if r >= THREAD_BUSY_RATIO]
    return ProcessRecord(pid=pid, gpu="0", gpu_uuid=H200.uuid, type="compute", name=name, cmdline=f"{name} job.py",
                         gpu_memory_bytes=memory, sm_ratio=sm, utilization_ratio=sm if util is None else util,
                         cpu_cores=cpu, thread_cpu_max_ratio=threads[0] if threads else None,
                         threads_busy=len(busy) if threads else None, busy_threads=busy, threads=24, **kw)


def snapshots(gpu: dict[str, float] | Callable[[float], dict[str, float]],
              procs: Callable[[float], list[ProcessRecord]], seconds: float = 12.0, step: float = 0.1,
              memory_used: Callable[[float], float] | None = None, t0: float = 1000.0) -> list[Snapshot]:
    """`seconds` of one GPU at `step` from `t0` (unix seconds): its values (`gpu`, or a function of the time
    since t0), and its processes, reread from `procs(t)` every second."""
    snaps = []
    records: list[ProcessRecord] = []
    for k in range(int(round(seconds / step))):
        t = k * step
        if k % int(round(1.0 / step)) == 0:
            records = procs(t)
        values = dict(gpu(t) if callable(gpu) else gpu)
        values["gpu_memory_used_bytes"] = (memory_used(t) if memory_used is not None
                                           else sum(p.gpu_memory_bytes or 0.0 for p in records) + 0.5 * GIB)
        t_ns = int((t0 + t) * 1e9)
        snaps.append(Snapshot(t_ns, [GpuRecord(H200, t_ns, values)], list(records), None, [], hostname="node-a"))
    return snaps


def window(gpu: dict[str, float] | Callable[[float], dict[str, float]],
           procs: Callable[[float], list[ProcessRecord]], seconds: float = 12.0, step: float = 0.1,
           memory_used: Callable[[float], float] | None = None) -> GpuWindow:
    """The window diagnose reads of `snapshots(...)`."""
    (w,) = windows_from_snapshots(snapshots(gpu, procs, seconds, step, memory_used))
    return w
