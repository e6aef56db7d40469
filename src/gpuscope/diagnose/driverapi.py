"""What a process's CUDA driver API calls say over a window, from the eBPF probes' counters on its records
(sources.cudaprobe): how many kernels it launches per second, and what share of its time its threads wait
inside synchronisations. A process that keeps the GPU waiting on its host side either issues work too fast
to fill the GPU (many tiny launches) or takes turns with it (waits for each result before issuing more):
these two figures tell which, without sampling its stacks or tracing it.

    >>> from gpuscope._records import ProcessRecord
    >>> def read(t, launches, sync_s):
    ...     return t, ProcessRecord(1, "0", "GPU-0", "compute", cuda_launches=launches, cuda_sync_seconds=sync_s,
    ...                             cuda_syncs=launches / 10, cuda_graph_launches=0.0)
    >>> calls = over([read(0.0, 1000, 0.0), read(10.0, 201000, 0.5)])
    >>> round(calls.launches_per_s), calls.sync_share, kind(calls, Thresholds())
    (20000, 0.05, 'launch_bound')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .thresholds import Thresholds

#: Verdicts about a process's host side, whose evidence carries its driver calls where the probes ran.
HOST_SIDE = frozenset({"launch_or_sync_bound", "launch_bound", "sync_bound", "input_starved", "host_bound"})

#: A thread waiting in synchronisations this share of the window (summed over the process's threads) while the
#: GPU's SMs are mostly idle: GPU and host take turns. Kept here, beside the launch rate below, until
#: thresholds.py takes them.
SYNC_SHARE = 0.3
#: Kernel launches (graph launches counted as launches) per second from which a process whose GPU waits on it
#: is taken to be launch-bound: ~5,000/s is 200 us per launch, far above a launch's own cost.
LAUNCH_RATE = 5000.0


@dataclass(frozen=True, slots=True)
class DriverCalls:
    """A process's driver API calls over `seconds` of a window, as rates."""

    launches_per_s: float
    graph_launches_per_s: float
    syncs_per_s: float
    sync_share: float  # seconds in synchronisations per second, summed over threads (may pass 1)
    copy_bytes_per_s: float
    seconds: float


def _copy_bytes(r: Any) -> float | None:
    parts = (r.cuda_h2d_bytes, r.cuda_d2h_bytes, r.cuda_d2d_bytes, r.cuda_other_copy_bytes)
    return None if all(v is None for v in parts) else sum(v or 0.0 for v in parts)


def over(reads: list[tuple[float, Any]]) -> DriverCalls | None:
    """The rates between the first and the last of a process's (seconds, record) reads that carry probe counters;
    None where fewer than two do, they span under a second, or a counter went back (the probes restarted)."""
    probed = [(t, r) for t, r in reads if getattr(r, "cuda_launches", None) is not None]
    if len(probed) < 2:
        return None
    (t0, a), (t1, b) = probed[0], probed[-1]
    dt = t1 - t0
    if dt < 1.0:
        return None
    deltas = []
    for get in (lambda r: r.cuda_launches, lambda r: r.cuda_graph_launches, lambda r: r.cuda_syncs,
                lambda r: r.cuda_sync_seconds, _copy_bytes):
        x, y = get(a), get(b)
        d = 0.0 if x is None or y is None else y - x
        if d < 0:
            return None
        deltas.append(d)
    launches, graphs, syncs, sync_s, copied = deltas
    return DriverCalls(launches / dt, graphs / dt, syncs / dt, sync_s / dt, copied / dt, dt)


def kind(calls: DriverCalls, th: Thresholds) -> str | None:
    """'sync_bound' or 'launch_bound' where the calls say so, for a process its GPU waits on; else None."""
    if calls.sync_share >= SYNC_SHARE:
        return "sync_bound"
    if calls.launches_per_s + calls.graph_launches_per_s >= LAUNCH_RATE:
        return "launch_bound"
    return None


def describe(calls: DriverCalls) -> str:
    """'20,000 launches/s, 5 % of its time in synchronisations (120 a second)'."""
    graphs = f" and {calls.graph_launches_per_s:,.0f} graph launches/s" if calls.graph_launches_per_s >= 0.5 else ""
    return (f"{calls.launches_per_s:,.0f} launches/s{graphs}, {calls.sync_share * 100:.0f} % of its time in "
            f"synchronisations ({calls.syncs_per_s:,.0f} a second)")


def evidence(calls: DriverCalls) -> dict[str, Any]:
    return {"cuda_launches_per_s": round(calls.launches_per_s, 1),
            "cuda_graph_launches_per_s": round(calls.graph_launches_per_s, 1),
            "cuda_syncs_per_s": round(calls.syncs_per_s, 1), "cuda_sync_share": round(calls.sync_share, 4),
            "cuda_copy_bytes_per_s": round(calls.copy_bytes_per_s, 1)}


def of_window(processes: list[Any], th: Thresholds) -> tuple[Any, DriverCalls] | None:
    """The process of a GPU whose calls speak for it: the one its verdict says it waits on (the busiest on the
    host, hostside.busiest) where the probes saw it, else the one that launches most; None without probes."""
    from . import hostside

    seen = [p for p in processes if getattr(p, "driver", None) is not None]
    if not seen:
        return None
    host = hostside.busiest(seen, th)
    p = host if host is not None else max(seen, key=lambda q: q.driver.launches_per_s + q.driver.graph_launches_per_s)
    return p, p.driver


def sharpen(v: Any, calls: DriverCalls | None, th: Thresholds, fixes: Any) -> Any:
    """A host-side verdict with the driver calls of the process it is about in its evidence; a
    launch_or_sync_bound one named launch_bound or sync_bound where the calls tell which (`fixes(kind)` gives the
    new kind's fixes). Returns `v`, changed in place."""
    if calls is None or v.kind not in HOST_SIDE:
        return v
    v.evidence.update(evidence(calls))
    k = kind(calls, th) if v.kind == "launch_or_sync_bound" else None
    if k is None:
        return v
    v.kind, v.confidence = k, max(v.confidence, 0.75)
    v.summary = (f"{v.summary} Its CUDA driver calls tell which: {describe(calls)}, so it is "
                 + ("sync-bound: it waits for each result before issuing more work." if k == "sync_bound"
                    else "launch-bound: it issues kernels too small, one by one, to fill the GPU."))
    v.recommendations = fixes(k)
    return v
