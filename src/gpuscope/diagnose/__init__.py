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

from collections.abc import Callable, Iterable

from .baseline import as_verdicts, peer_outliers
from .rules import classify, node_verdicts
from .stacks import HostProfile, Profiler
from .thresholds import DEFAULT, Thresholds
from .windows import SERIES, GpuWindow, ProcessView, Verdict, windows_from_snapshots  # noqa: F401 - SERIES re-exported

__all__ = ["GpuWindow", "ProcessView", "Profiler", "Thresholds", "Verdict", "diagnose", "windows_from_snapshots"]

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
    # Peers are GPUs on the same job with the same primary verdict (the same kind of work).
    kinds = {v.gpu: v.kind for v in verdicts if v.primary}
    verdicts.extend(as_verdicts([f for f in peer_outliers(ws, signatures=kinds)
                                 if not (f.gpu in straggling and f.metric == "gpu_sm_active_ratio")],
                                Verdict, t0, t1))
    return verdicts
