"""Verdicts: which bottleneck a GPU has, with the numbers that show it and what to change first.

    from gpuscope import Sampler
    from gpuscope.diagnose import diagnose, windows_from_snapshots
    with Sampler(simulate="launch_bound") as s:
        snaps = [s.sample_once() for _ in range(100)]       # or s.history from a running sampler
    for v in diagnose(windows_from_snapshots(snaps)):
        print(v.gpu, v.kind, v.summary)

Each GPU gets one primary verdict (what limits it) and side verdicts (throttling, memory growth,
hardware errors). Thresholds live in `thresholds.Thresholds`; the rules in `rules.py`. A GPU that several
processes share has each process's verdicts in its primary verdict's `processes` (perprocess.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from . import hostside, perprocess
from .baseline import as_verdicts, peer_outliers
from .rules import classify, node_verdicts
from .stacks import HostProfile, Profiler
from .thresholds import DEFAULT, Thresholds
from .windows import SERIES, GpuWindow, ProcessView, Verdict, windows_from_snapshots  # noqa: F401 - SERIES re-exported

__all__ = ["GpuWindow", "ProcessView", "Profiler", "Thresholds", "Verdict", "diagnose", "windows_from_snapshots"]

#: Verdicts where the GPU waits on a host thread whose stacks can say why.
HOST_BOUND = frozenset({"launch_or_sync_bound", "input_starved", "launch_bound", "sync_bound", "host_bound"})
#: Processes of one GPU whose stacks are sampled at most, at once (a few seconds each).
MAX_SAMPLED = 4


def diagnose(windows: Iterable[GpuWindow], thresholds: Thresholds = DEFAULT,
             profiler: Callable[[int], tuple[HostProfile | None, str | None]] | None = None) -> list[Verdict]:
    """Verdicts for every GPU (primary first), then node-level ones (imbalance across GPUs).

    With a `profiler` (e.g. `Profiler()`), a GPU that waits on its process's busy host side (a saturated
    thread, or cores spread over busy threads) has that process sampled for a few seconds, and its stacks
    tell launch-, sync- and input-bound apart; on a shared GPU, so has every process that waits on its own
    host side (at most MAX_SAMPLED, at once).
    """
    ws = list(windows)
    verdicts: list[Verdict] = []
    for w in ws:
        mine = classify(w, thresholds, Verdict)
        if profiler is not None and w.processes:
            todo = _to_sample(w, mine, thresholds)
            if todo:
                with ThreadPoolExecutor(len(todo)) as pool:
                    for p, got in zip(todo, pool.map(profiler, [p.pid for p in todo]), strict=True):
                        p.profile, p.profile_error = got
                mine = classify(w, thresholds, Verdict)
        perprocess.attach(w, mine, thresholds, Verdict)
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


def _to_sample(w: GpuWindow, mine: list[Verdict], th: Thresholds) -> list[ProcessView]:
    """The processes of a window whose stacks would settle a verdict: the GPU's busiest on the host where the GPU
    waits on its host, and on a shared GPU each process whose own verdict is host-bound; the busiest first."""
    want: dict[int, ProcessView] = {}
    primary = next((v for v in mine if v.primary), None)
    if primary is not None and primary.kind in HOST_BOUND:
        p = hostside.busiest(w.processes, th)
        if p is not None:
            want[p.pid] = p
    if primary is not None and len(w.processes) > 1:
        by_pid = {p.pid: p for p in w.processes}
        for v in perprocess.process_verdicts(w, primary, th, Verdict):
            if v.primary and v.kind in HOST_BOUND and v.pid in by_pid:
                want[v.pid] = by_pid[v.pid]
    todo = sorted((p for p in want.values() if p.profile is None), key=lambda p: -(p.cpu_cores or 0.0))
    return todo[:MAX_SAMPLED]
