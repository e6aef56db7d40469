"""Verdicts: which bottleneck a GPU has, with the numbers that show it and what to change first.

    from gpuscope import Sampler
    from gpuscope.diagnose import diagnose, windows_from_snapshots
    with Sampler(simulate="launch_bound") as s:
        snaps = [s.sample_once() for _ in range(100)]       # or s.history from a running sampler
    for v in diagnose(windows_from_snapshots(snaps)):
        print(v.gpu, v.kind, v.summary)

Each GPU gets one primary verdict (what limits it) and side verdicts (throttling, memory growth,
hardware errors). Thresholds live in `thresholds.Thresholds`; the rules in `rules.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._records import Event, Snapshot
from .baseline import as_verdicts, peer_outliers
from .rules import classify, node_verdicts
from .stacks import HostProfile, Profiler
from .thresholds import DEFAULT, Thresholds

__all__ = ["GpuWindow", "ProcessView", "Profiler", "Thresholds", "Verdict", "diagnose", "windows_from_snapshots"]

#: The series the rules read.
SERIES = ("gpu_utilization_ratio", "gpu_sm_active_ratio", "gpu_sm_occupancy_ratio", "gpu_tensor_active_ratio",
          "gpu_fp32_active_ratio", "gpu_fp16_active_ratio", "gpu_fp64_active_ratio", "gpu_dram_active_ratio",
          "gpu_pcie_rx_bytes_per_second", "gpu_pcie_tx_bytes_per_second", "gpu_power_watts",
          "gpu_memory_used_bytes", "gpu_clock_event_reasons", "gpu_sm_clock_hertz",
          "gpu_ecc_uncorrected_errors_total", "gpu_row_remap_pending", "gpu_row_remap_failure",
          "gpu_temperature_celsius")


@dataclass
class ProcessView:
    pid: int
    name: str = ""
    cmdline: str = ""
    cpu_cores: float | None = None
    thread_cpu_max_ratio: float | None = None
    gpu_memory_bytes: float | None = None
    profile: HostProfile | None = None  # its busy threads' stacks, when sampled (stacks.py)
    profile_error: str | None = None  # why they could not be sampled


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
        for e in snap.events:
            if e.gpu in out:
                out[e.gpu].events.append(e)
    last = snaps[-1]
    for p in last.processes:
        w = out.get(p.gpu)
        if w is not None:
            w.processes.append(ProcessView(p.pid, p.name, p.cmdline, p.cpu_cores, p.thread_cpu_max_ratio,
                                           p.gpu_memory_bytes))
    return list(out.values())


#: Verdicts where the GPU waits on a host thread whose stacks can say why.
HOST_BOUND = frozenset({"launch_or_sync_bound", "input_starved", "launch_bound", "sync_bound", "host_bound"})


def diagnose(windows: Iterable[GpuWindow], thresholds: Thresholds = DEFAULT,
             profiler: Callable[[int], tuple[HostProfile | None, str | None]] | None = None) -> list[Verdict]:
    """Verdicts for every GPU (primary first), then node-level ones (imbalance across GPUs).

    With a `profiler` (e.g. `Profiler()`), a GPU that waits on a saturated host thread has that
    thread's process sampled for a few seconds, and its stacks tell launch-, sync- and input-bound apart.
    """
    ws = list(windows)
    verdicts: list[Verdict] = []
    for w in ws:
        mine = classify(w, thresholds, Verdict)
        if profiler is not None and w.processes and any(v.primary and v.kind in HOST_BOUND for v in mine):
            busiest = max(w.processes, key=lambda p: p.thread_cpu_max_ratio or 0.0)
            if (busiest.thread_cpu_max_ratio or 0.0) >= thresholds.thread_saturated and busiest.profile is None:
                busiest.profile, busiest.profile_error = profiler(busiest.pid)
                mine = classify(w, thresholds, Verdict)
        verdicts.extend(mine)
    node = node_verdicts(ws, verdicts, thresholds, Verdict)
    verdicts.extend(node)
    straggling = {v.gpu for v in node if v.kind == "imbalance"}  # SM activity already said there
    t0 = min((w.times[0] for w in ws if w.times), default=0.0)
    t1 = max((w.times[-1] for w in ws if w.times), default=0.0)
    verdicts.extend(as_verdicts([f for f in peer_outliers(ws) if not (f.gpu in straggling
                                                                      and f.metric == "gpu_sm_active_ratio")],
                                Verdict, t0, t1))
    return verdicts
