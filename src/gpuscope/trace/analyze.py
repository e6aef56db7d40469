"""Analyses over a `Trace`: where the GPU time went and why the GPU waited.

    >>> from gpuscope.trace import load
    >>> from gpuscope.trace.analyze import analyze
    >>> report = analyze(load("tests/fixtures/traces/launch_bound.pt.trace.json.gz"))
    >>> round(report.temporal[0].idle_ratio, 2)  # the GPU idle 89 % of the traced time
    0.89

Definitions follow the tools people already trust, so numbers can be compared: kernel and API
statistics as `nsys stats` (cuda_gpu_kern_sum, cuda_api_sum; share = of kernel time, not wall time),
the temporal breakdown, idle-time breakdown, launch delay and communication overlap as Holistic Trace
Analysis computes them. Everything is numpy over the columns; all times are int ns (floats where a
mean or percentile needs them).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .model import EventKind, Trace

COMM_RE = re.compile(r"^nccl.*|.*ncclKernel.*")
MEMORY_RE = re.compile(r"^Memcpy|^Memset")
SYNC_CALLS = frozenset(("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
                        "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize"))
# HTA's consecutive_kernel_delay: a gap below it between two kernels already queued is launch latency.
CONSECUTIVE_KERNEL_DELAY_NS = 30_000
_GPU_OPS = (EventKind.KERNEL, EventKind.MEMCPY, EventKind.MEMSET)
_LAUNCHERS = (EventKind.RUNTIME, EventKind.DRIVER)
_COPY_OPS = ("HtoD", "DtoH", "DtoD", "HtoH", "PtoP", "HtoA", "AtoH", "AtoA", "AtoD", "DtoA")


@dataclass
class Distribution:
    """Percentiles of a set of durations, ns."""
    count: int
    mean_ns: float
    p50_ns: float
    p90_ns: float
    p99_ns: float
    min_ns: int
    max_ns: int


@dataclass
class NameStat:
    """One name's calls (nsys *_sum semantics); share_ratio = total / total of all names in the table."""
    name: str
    count: int
    total_ns: int
    mean_ns: float
    p50_ns: float
    p99_ns: float
    min_ns: int
    max_ns: int
    share_ratio: float


@dataclass
class KernelStat(NameStat):
    """A kernel name's statistics and its launch delay (runtime call end -> kernel start, HTA's definition)."""
    launch_delay_mean_ns: float | None = None
    launch_delay_p50_ns: float | None = None
    launch_delay_p99_ns: float | None = None


@dataclass
class CopyStat:
    """Memcpy/memset of one kind (the name Kineto gives it, e.g. 'Memcpy HtoD (Pageable -> Device)')."""
    name: str
    op: str                     # HtoD, DtoH, DtoD, PtoP, ... or Memset
    pageable: bool
    count: int
    bytes: int
    total_ns: int
    mean_bytes: float
    bandwidth_bytes_per_s: float | None


@dataclass
class Temporal:
    """HTA's temporal breakdown of one (rank, device): span = last GPU op end - first start."""
    rank: int | None
    device: int
    span_ns: int
    idle_ns: int
    compute_ns: int
    non_compute_ns: int
    idle_ratio: float
    compute_ratio: float
    non_compute_ratio: float


@dataclass
class IdleBreakdown:
    """HTA's idle-time breakdown of one stream: the gaps between consecutive GPU ops, by cause."""
    device: int
    stream: int
    idle_ns: int
    host_wait_ns: int           # the launch came after the GPU had drained: the CPU was late
    kernel_wait_ns: int         # a short gap (< 30 us) between ops already queued: launch latency
    other_ns: int               # longer gaps with the op already queued: waits on events, other streams
    host_wait_ratio: float
    kernel_wait_ratio: float
    other_ratio: float


@dataclass
class Overlap:
    """HTA's communication-computation overlap: share of (merged) NCCL time with a compute kernel running."""
    rank: int | None
    comm_ns: int
    overlap_ns: int
    overlap_ratio: float


@dataclass
class Report:
    source: str
    rank: int | None
    events: int
    kernels: list[KernelStat]
    api: list[NameStat]
    sync: list[NameStat]
    memcpy: list[CopyStat]
    temporal: list[Temporal]
    idle: list[IdleBreakdown]
    launch_overhead: Distribution | None    # durations of the runtime/driver calls that launched GPU ops
    queue_delay: Distribution | None        # launch call end -> GPU op start, over all launched ops
    overlap: Overlap | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Straggler:
    rank: int | None
    source: str
    busy_ns: int
    median_busy_ns: float
    excess_ratio: float         # busy / median - 1


def analyze(trace: Trace) -> Report:
    """All the single-rank analyses of one trace."""
    ev = trace.events
    kind = ev["kind"]
    gpu = np.flatnonzero(np.isin(kind, _GPU_OPS))
    launcher = launcher_rows(trace, gpu)
    has = launcher >= 0
    launch_end = ev["ts_ns"][launcher[has]] + ev["dur_ns"][launcher[has]]
    delay = np.maximum(0, ev["ts_ns"][gpu[has]] - launch_end)
    return Report(
        source=trace.source, rank=trace.rank, events=len(trace),
        kernels=kernel_stats(trace, gpu, launcher),
        api=name_stats(trace, np.flatnonzero(np.isin(kind, _LAUNCHERS))),
        sync=sync_stats(trace),
        memcpy=copy_stats(trace),
        temporal=temporal_breakdown(trace),
        idle=idle_breakdown(trace),
        launch_overhead=distribution(ev["dur_ns"][np.unique(launcher[has])]),
        queue_delay=distribution(delay),
        overlap=comm_overlap(trace),
    )


def distribution(values: np.ndarray) -> Distribution | None:
    if len(values) == 0:
        return None
    p50, p90, p99 = np.percentile(values, (50, 90, 99))
    return Distribution(count=len(values), mean_ns=float(values.mean()), p50_ns=float(p50), p90_ns=float(p90),
                        p99_ns=float(p99), min_ns=int(values.min()), max_ns=int(values.max()))


def name_stats(trace: Trace, rows: np.ndarray) -> list[NameStat]:
    """nsys-style statistics per name over `rows`, largest total first."""
    return [NameStat(**_without_id(s)) for s in _grouped(trace, trace.events["name"][rows], trace.events["dur_ns"][rows])]


def kernel_stats(trace: Trace, gpu: np.ndarray | None = None, launcher: np.ndarray | None = None) -> list[KernelStat]:
    """cuda_gpu_kern_sum per kernel name, with HTA's launch delay per name."""
    ev = trace.events
    if gpu is None or launcher is None:
        gpu = np.flatnonzero(np.isin(ev["kind"], _GPU_OPS))
        launcher = launcher_rows(trace, gpu)
    is_kernel = ev["kind"][gpu] == EventKind.KERNEL
    rows, launched_by = gpu[is_kernel], launcher[is_kernel]
    stats = _grouped(trace, ev["name"][rows], ev["dur_ns"][rows])
    has = launched_by >= 0
    end = ev["ts_ns"][launched_by[has]] + ev["dur_ns"][launched_by[has]]
    delays = {s["name_id"]: s for s in _grouped(trace, ev["name"][rows[has]],
                                                np.maximum(0, ev["ts_ns"][rows[has]] - end))}
    out = []
    for s in stats:
        d = delays.get(s["name_id"])
        out.append(KernelStat(**_without_id(s), launch_delay_mean_ns=d and d["mean_ns"], launch_delay_p50_ns=d and d["p50_ns"],
                              launch_delay_p99_ns=d and d["p99_ns"]))
    return out


def sync_stats(trace: Trace) -> list[NameStat]:
    """The host calls that wait for the GPU (cuda*Synchronize) and Kineto's cuda_sync events."""
    ev = trace.events
    sync_ids = [i for i, n in enumerate(trace.names) if n in SYNC_CALLS]
    rows = np.flatnonzero((np.isin(ev["kind"], _LAUNCHERS) & np.isin(ev["name"], sync_ids))
                          | (ev["kind"] == EventKind.SYNC))
    return name_stats(trace, rows)


def copy_stats(trace: Trace) -> list[CopyStat]:
    """cuda_gpu_mem_time_sum / mem_size_sum: memcpy and memset per kind, with bytes and bandwidth."""
    ev = trace.events
    rows = np.flatnonzero(np.isin(ev["kind"], (EventKind.MEMCPY, EventKind.MEMSET)))
    if len(rows) == 0:
        return []
    ids, inverse, counts = np.unique(ev["name"][rows], return_inverse=True, return_counts=True)
    total_ns = np.bincount(inverse, weights=ev["dur_ns"][rows]).astype(np.int64)
    nbytes = np.bincount(inverse, weights=np.maximum(ev["bytes"][rows], 0)).astype(np.int64)
    out = []
    for i, name_id in enumerate(ids):
        name = trace.names[name_id]
        op = next((o for o in _COPY_OPS if f" {o}" in name), "Memset" if name.startswith("Memset") else "other")
        out.append(CopyStat(name=name, op=op, pageable="Pageable" in name, count=int(counts[i]),
                            bytes=int(nbytes[i]), total_ns=int(total_ns[i]), mean_bytes=nbytes[i] / counts[i],
                            bandwidth_bytes_per_s=nbytes[i] / total_ns[i] * 1e9 if total_ns[i] > 0 else None))
    out.sort(key=lambda c: -c.total_ns)
    return out


def temporal_breakdown(trace: Trace) -> list[Temporal]:
    """HTA's get_temporal_breakdown per device: merged GPU op intervals over all streams; compute = merged
    kernels that are neither communication nor memory; non-compute = the rest of the busy time."""
    ev = trace.events
    out = []
    compute = _compute_names(trace)
    for device, rows in _per_device(trace):
        starts, ends = _merge(ev["ts_ns"][rows], ev["dur_ns"][rows])
        span = int(ends[-1] - starts[0])
        busy = int((ends - starts).sum())
        comp = rows[compute[ev["name"][rows]]]
        cs, ce = _merge(ev["ts_ns"][comp], ev["dur_ns"][comp])
        compute_ns = int((ce - cs).sum())
        idle_ns = span - busy
        out.append(Temporal(rank=trace.rank, device=device, span_ns=span, idle_ns=idle_ns, compute_ns=compute_ns,
                            non_compute_ns=span - compute_ns - idle_ns, idle_ratio=_ratio(idle_ns, span),
                            compute_ratio=_ratio(compute_ns, span),
                            non_compute_ratio=_ratio(span - compute_ns - idle_ns, span)))
    return out


def idle_breakdown(trace: Trace, consecutive_kernel_delay_ns: int = CONSECUTIVE_KERNEL_DELAY_NS) -> list[IdleBreakdown]:
    """HTA's get_idle_time_breakdown per stream. For each GPU op after the first: gap = its start - the
    previous op's end; host wait if its launch call started after that end, else kernel wait if the gap is
    under `consecutive_kernel_delay_ns`, else other."""
    ev = trace.events
    gpu = np.flatnonzero(np.isin(ev["kind"], _GPU_OPS))
    launcher = launcher_rows(trace, gpu)
    launch_ts = np.where(launcher >= 0, ev["ts_ns"][launcher], np.iinfo(np.int64).min)
    dev, stream = ev["device"][gpu], ev["stream"][gpu]
    order = np.lexsort((ev["ts_ns"][gpu], stream, dev))   # rows already sort by ts; keep that within a stream
    gpu, launch_ts, dev, stream = gpu[order], launch_ts[order], dev[order], stream[order]
    ts = ev["ts_ns"][gpu]
    end = ts + ev["dur_ns"][gpu]
    same = np.zeros(len(gpu), dtype=bool)
    same[1:] = (dev[1:] == dev[:-1]) & (stream[1:] == stream[:-1])
    prev_end = np.empty_like(end)
    prev_end[1:] = end[:-1]
    gap = np.where(same, ts - np.where(same, prev_end, ts), 0)
    host = same & (launch_ts > prev_end)
    kern = same & ~host & (gap < consecutive_kernel_delay_ns)
    other = same & ~host & ~kern
    out = []
    bounds = np.append(np.flatnonzero(~same), len(gpu))
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        g = gap[lo:hi]
        h, k, o = int(g[host[lo:hi]].sum()), int(g[kern[lo:hi]].sum()), int(g[other[lo:hi]].sum())
        idle = h + k + o
        out.append(IdleBreakdown(device=int(dev[lo]), stream=int(stream[lo]), idle_ns=idle, host_wait_ns=h,
                                 kernel_wait_ns=k, other_ns=o, host_wait_ratio=_ratio(h, idle),
                                 kernel_wait_ratio=_ratio(k, idle), other_ratio=_ratio(o, idle)))
    return out


def comm_overlap(trace: Trace) -> Overlap | None:
    """HTA's get_comm_comp_overlap: the time merged NCCL kernels run alongside merged compute kernels,
    over the merged NCCL time; None when the trace has no communication kernels."""
    ev = trace.events
    kernels = np.flatnonzero(ev["kind"] == EventKind.KERNEL)
    names = ev["name"][kernels]
    comm_ids = np.array([bool(COMM_RE.match(n)) for n in trace.names], dtype=bool)
    comm = kernels[comm_ids[names]]
    if len(comm) == 0:
        return None
    comp = kernels[_compute_names(trace)[names]]
    ms, me = _merge(ev["ts_ns"][comm], ev["dur_ns"][comm])
    cs, ce = _merge(ev["ts_ns"][comp], ev["dur_ns"][comp])
    comm_ns = int((me - ms).sum())
    overlap = _intersection_ns(ms, me, cs, ce)
    return Overlap(rank=trace.rank, comm_ns=comm_ns, overlap_ns=overlap, overlap_ratio=_ratio(overlap, comm_ns))


def stragglers(traces: list[Trace], threshold_ratio: float = 0.10) -> list[Straggler]:
    """Ranks whose GPU busy time (merged GPU ops) is an outlier above the others': more than
    `threshold_ratio` above the median and, with 3 ranks or more, more than 3 robust deviations (MAD)."""
    if len(traces) < 2:
        return []
    busy = []
    for t in traces:
        ev = t.events
        rows = np.flatnonzero(np.isin(ev["kind"], _GPU_OPS))
        s, e = _merge(ev["ts_ns"][rows], ev["dur_ns"][rows])
        busy.append(int((e - s).sum()))
    values = np.array(busy, dtype=np.float64)
    median = float(np.median(values))
    mad = float(np.median(np.abs(values - median))) * 1.4826
    out = []
    for t, b in zip(traces, busy, strict=True):
        excess = b / median - 1 if median > 0 else 0.0
        robust = len(traces) < 3 or mad == 0 or (b - median) / mad > 3
        if excess > threshold_ratio and robust:
            out.append(Straggler(rank=t.rank, source=t.source, busy_ns=b, median_busy_ns=median, excess_ratio=excess))
    return out


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def launcher_rows(trace: Trace, gpu: np.ndarray) -> np.ndarray:
    """For each GPU op row, the row of the runtime/driver call that launched it (same correlation), else -1."""
    ev = trace.events
    host = np.flatnonzero(np.isin(ev["kind"], _LAUNCHERS) & (ev["correlation"] >= 0))
    out = np.full(len(gpu), -1, dtype=np.int64)
    if len(host) == 0 or len(gpu) == 0:
        return out
    corr = ev["correlation"][host]
    by = np.argsort(corr, kind="stable")
    sorted_corr = corr[by]
    want = ev["correlation"][gpu]
    pos = np.searchsorted(sorted_corr, want)
    pos[pos == len(sorted_corr)] = 0
    found = (want >= 0) & (sorted_corr[pos] == want)
    out[found] = host[by[pos[found]]]
    return out


def _compute_names(trace: Trace) -> np.ndarray:
    """Per name id: True for a compute kernel (neither communication nor memory, HTA's classes)."""
    return np.array([not (COMM_RE.match(n) or MEMORY_RE.match(n)) for n in trace.names], dtype=bool)


def _per_device(trace: Trace) -> list[tuple[int, np.ndarray]]:
    ev = trace.events
    gpu = np.flatnonzero(np.isin(ev["kind"], _GPU_OPS))
    dev = ev["device"][gpu]
    return [(int(d), gpu[dev == d]) for d in np.unique(dev)]


def _merge(ts: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals [ts, ts + dur) as sorted disjoint (starts, ends)."""
    if len(ts) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.argsort(ts, kind="stable")
    ts = ts[order]
    reach = np.maximum.accumulate(ts + dur[order])
    new = np.ones(len(ts), dtype=bool)
    new[1:] = ts[1:] > reach[:-1]
    first = np.flatnonzero(new)
    return ts[first], reach[np.append(first[1:] - 1, len(ts) - 1)]


def _intersection_ns(a_start: np.ndarray, a_end: np.ndarray, b_start: np.ndarray, b_end: np.ndarray) -> int:
    """Total length of the intersection of two sets of disjoint intervals."""
    t = np.concatenate((a_start, a_end, b_start, b_end))
    step = np.concatenate((np.ones(len(a_start)), -np.ones(len(a_end)), np.full(len(b_start), 2.0),
                           np.full(len(b_end), -2.0)))
    order = np.argsort(t, kind="stable")
    t, level = t[order], np.cumsum(step[order])
    return int((np.diff(t)[level[:-1] == 3]).sum())


def _grouped(trace: Trace, keys: np.ndarray, values: np.ndarray) -> list[dict[str, Any]]:
    """count, total, mean, p50, p99, min, max and share per key, largest total first (name_id kept for joins)."""
    if len(keys) == 0:
        return []
    order = np.lexsort((values, keys))
    k, v = keys[order], values[order]
    ids, starts, counts = np.unique(k, return_index=True, return_counts=True)
    totals = np.add.reduceat(v, starts)
    last = starts + counts - 1
    p50, p99 = (_sorted_quantile(v, starts, last, q) for q in (0.5, 0.99))
    grand = float(totals.sum())
    out = [dict(name_id=int(ids[i]), name=trace.names[ids[i]], count=int(counts[i]), total_ns=int(totals[i]),
                mean_ns=totals[i] / counts[i], p50_ns=float(p50[i]), p99_ns=float(p99[i]), min_ns=int(v[starts[i]]),
                max_ns=int(v[last[i]]), share_ratio=_ratio(float(totals[i]), grand))
           for i in np.argsort(-totals, kind="stable")]
    return out


def _without_id(stat: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stat.items() if k != "name_id"}


def _sorted_quantile(v: np.ndarray, first: np.ndarray, last: np.ndarray, q: float) -> np.ndarray:
    """Linear-interpolated quantile of each group of the sorted array v (numpy's default method)."""
    pos = first + q * (last - first)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, last)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)
