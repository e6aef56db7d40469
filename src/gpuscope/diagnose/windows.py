"""What the verdict rules read and what they give: per-GPU windows of aligned series (built from the
sampler's snapshots) and the verdicts. A module of its own so that the rules and the baselines can use
them without importing the package that imports them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._records import Event, PodRef, ProcessRecord, Snapshot, ThreadCpu
from .driverapi import over as _driver_calls
from .stacks import HostProfile

#: The series the rules read.
SERIES = ("gpu_utilization_ratio", "gpu_sm_active_ratio", "gpu_sm_occupancy_ratio", "gpu_tensor_active_ratio",
          "gpu_fp32_active_ratio", "gpu_fp16_active_ratio", "gpu_fp64_active_ratio", "gpu_dram_active_ratio",
          "gpu_pcie_rx_bytes_per_second", "gpu_pcie_tx_bytes_per_second", "gpu_power_watts",
          "gpu_memory_used_bytes", "gpu_clock_event_reasons", "gpu_sm_clock_hertz",
          "gpu_ecc_uncorrected_errors_total", "gpu_row_remap_pending", "gpu_row_remap_failure",
          "gpu_temperature_celsius")


@dataclass
class ProcessView:
    """One process of a GPU over the window: its CPU figures are medians over the window's reads of it, its SM
    figures its time share over the window (time_share), its GPU memory the latest."""

    pid: int
    name: str = ""
    cmdline: str = ""
    cpu_cores: float | None = None
    thread_cpu_max_ratio: float | None = None
    gpu_memory_bytes: float | None = None
    profile: HostProfile | None = None  # its busy threads' stacks, when sampled (stacks.py)
    profile_error: str | None = None  # why they could not be sampled
    namespace: str = ""  # its Kubernetes pod, where attribution found one
    pod: str = ""
    frameworks: tuple[str, ...] = ()  # what it runs on (gpuscope._frameworks): the fixes speak its words
    sm_ratio: float | None = None  # its share of the GPU's SM activity (gpuscope.shares)
    utilization_ratio: float | None = None  # NVML's per-process figure: time a kernel of it ran
    threads_busy: int | None = None  # threads at half a core or more (_records.THREAD_BUSY_RATIO)
    busy_threads: list[ThreadCpu] = field(default_factory=list)  # the busiest, latest read
    memory: list[tuple[float, float]] = field(default_factory=list)  # (seconds, GPU bytes) over the window
    driver: Any = None  # its CUDA driver calls over the window (driverapi.DriverCalls), where the eBPF probes ran


@dataclass
class GpuWindow:
    """One GPU over a time window: aligned series, the latest processes, the events in the window."""

    gpu: str
    times: list[float]  # seconds (any origin)
    series: dict[str, list[float | None]]
    memory_total_bytes: float | None = None
    sm_clock_max_hertz: float | None = None
    healthy: bool = True
    processes: list[ProcessView] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    name: str = ""
    pods: list[PodRef] = field(default_factory=list)  # the pods' containers the kubelet says hold it, latest


@dataclass
class Verdict:
    gpu: str
    kind: str
    severity: str  # 'info', 'warning' or 'critical'
    confidence: float  # 0..1
    summary: str
    evidence: dict[str, Any]
    recommendations: list[str]
    start_s: float = 0.0
    end_s: float = 0.0
    primary: bool = True
    pid: int | None = None  # set on a process's own verdict, which lies in its GPU's `processes`
    # On the primary verdict of a GPU that several processes share: each process's verdicts (diagnose.perprocess);
    # empty for a GPU with one process, whose verdict is its own.
    processes: list[Verdict] = field(default_factory=list)


def windows_from_snapshots(snaps: Sequence[Snapshot]) -> list[GpuWindow]:
    """Per GPU, the snapshots' values as aligned series (missing values are None)."""
    if not snaps:
        return []
    out: dict[str, GpuWindow] = {}
    for snap in snaps:
        t = snap.time_ns / 1e9
        for g in snap.gpus:
            label = g.identity.label
            w = out.get(label)
            if w is None:
                w = out[label] = GpuWindow(label, [], {k: [] for k in SERIES},
                                           memory_total_bytes=float(g.identity.memory_total_bytes) or None,
                                           sm_clock_max_hertz=g.identity.sm_clock_max_hertz, name=g.identity.name)
            w.times.append(t)
            for k in SERIES:
                w.series[k].append(g.values.get(k))
            w.healthy = g.healthy
            w.pods = list(g.allocated_to)
        for e in snap.events:
            if e.gpu in out:
                out[e.gpu].events.append(e)
    last = snaps[-1]
    reads: dict[tuple[str, int], list[tuple[float, ProcessRecord]]] = {
        (p.gpu, p.pid): [] for p in last.processes if p.gpu in out}
    for snap in snaps:
        t = snap.time_ns / 1e9
        for p in snap.processes:
            seen = reads.get((p.gpu, p.pid))
            # The sampler reads processes every second or so and repeats the records between: one per read.
            if seen is not None and (not seen or seen[-1][1] is not p):
                seen.append((t, p))
    for p in last.processes:
        w = out.get(p.gpu)
        if w is not None:
            w.processes.append(_view(p, reads[(p.gpu, p.pid)]))
    return list(out.values())


def _mid(xs: list[float | None]) -> float | None:
    vals = sorted(v for v in xs if v is not None)
    if not vals:
        return None
    n = len(vals)
    return vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2


def time_share(reads: Sequence[float | None]) -> float | None:
    """A per-process SM figure (NVML's per-process utilization, the SM share scaled from it) over a window, from
    the values its records held in turn, oldest first.

    NVML's per-process figure is read every few seconds (SamplerConfig.process_utilization) and describes the
    time since the read before it; the records between two reads repeat it. So each new value stands for the
    time since the previous one, and the window's first value, read before the window began, for none of it
    (unless it is the only one). A median over the records would give a start-up read, shown for five
    seconds though it covered the first second of a process, the weight of a steady one.

    >>> time_share([0.0, 0.0, 0.0, 0.0, 0.0, 0.68]), time_share([0.3] * 3 + [0.5] * 5 + [0.2] * 5 + [0.8])
    (0.68, 0.5)
    """
    vals = [v for v in reads if v is not None]
    if not vals:
        return None
    changes = [i for i in range(1, len(vals)) if vals[i] != vals[i - 1]]
    if not changes:
        return vals[0]
    # the value read at changes[k] covers the records since the read before it (the window's start for the first)
    spans = [b - a for a, b in zip([0, *changes], changes, strict=False)]
    return sum(vals[i] * n for i, n in zip(changes, spans, strict=True)) / sum(spans)


def _view(p: ProcessRecord, reads: list[tuple[float, ProcessRecord]]) -> ProcessView:
    """The process `p` (its latest record) with the medians of its reads over the window."""
    recs = [r for _, r in reads] or [p]
    busy = _mid([float(r.threads_busy) if r.threads_busy is not None else None for r in recs])
    return ProcessView(
        p.pid, p.name, p.cmdline, _mid([r.cpu_cores for r in recs]), _mid([r.thread_cpu_max_ratio for r in recs]),
        p.gpu_memory_bytes, namespace=p.namespace, pod=p.pod, frameworks=tuple(getattr(p, "frameworks", ())),
        sm_ratio=time_share([r.sm_ratio for r in recs]), utilization_ratio=time_share([r.utilization_ratio for r in recs]),
        threads_busy=None if busy is None else int(busy + 0.5),
        busy_threads=next((list(r.busy_threads) for r in reversed(recs) if r.busy_threads), []),
        memory=[(t, r.gpu_memory_bytes) for t, r in reads if r.gpu_memory_bytes is not None],
        driver=_driver_calls(reads))
