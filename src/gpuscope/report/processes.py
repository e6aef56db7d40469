"""Which processes a run consists of, which of them used which GPU, and how hard.

`RunProcesses` follows the child and all its descendants (psutil, every few seconds, plus an ancestry
check the moment an unknown pid shows up on a GPU) and every GPU process the sampler reports, ours or
another user's. It records when the run's processes first appeared on a GPU (`gpu_start_s`), which is
where a workload's steady state can begin.

On the simulated node the simulated GPU processes stand for the command's GPU work (the real command
runs on the CPU only), so they count as the run's; the report says the node is simulated.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from .._hostproc import HostProcessReader


@dataclass
class _Stats:
    """Running mean and max of a value read now and then."""

    total: float = 0.0
    n: int = 0
    hi: float | None = None

    def add(self, v: float | None) -> None:
        if v is None:
            return
        self.total += v
        self.n += 1
        self.hi = v if self.hi is None else max(self.hi, v)

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None


@dataclass
class _Proc:
    pid: int
    ours: bool
    name: str = ""
    user: str = ""
    cmdline: str = ""  # already redacted
    first_s: float | None = None
    last_s: float | None = None
    cpu: _Stats = field(default_factory=_Stats)
    thread: _Stats = field(default_factory=_Stats)
    busy: _Stats = field(default_factory=_Stats)  # threads at half a core or more
    busy_threads: list[Any] = field(default_factory=list)  # the latest non-empty list (ThreadCpu)
    rss_max_bytes: float | None = None
    from_tree: bool = False  # CPU figures come from our own tree reads, not the sampler's
    frameworks: tuple[str, ...] = ()  # from its GPU process records (read once it held a CUDA context)

    def seen(self, t: float) -> None:
        self.first_s = t if self.first_s is None else min(self.first_s, t)
        self.last_s = t if self.last_s is None else max(self.last_s, t)


#: What a process's series on a GPU keeps per read: the figures the diagnosis reads (gpuscope.diagnose.windows).
SERIES_FIELDS = ("sm_ratio", "utilization_ratio", "cpu_cores", "thread_cpu_max_ratio", "threads_busy",
                 "gpu_memory_bytes")
#: Reads kept per process and GPU; beyond, every other one goes (the series keeps its span, at half the rate).
MAX_SERIES_POINTS = 4096


@dataclass
class _GpuUse:
    first_s: float
    last_s: float
    memory_max_bytes: float | None = None
    sm: _Stats = field(default_factory=_Stats)
    # one row per read of the process: (seconds since the run began, *SERIES_FIELDS), for replaying its verdicts
    series: list[tuple[float | None, ...]] = field(default_factory=list)

    def add(self, t: float, rec: Any) -> None:
        self.series.append((t, *(getattr(rec, f, None) for f in SERIES_FIELDS)))
        if len(self.series) > MAX_SERIES_POINTS:
            self.series = self.series[::2]

    def columns(self) -> dict[str, list[Any]]:
        cols = list(zip(*self.series, strict=True)) if self.series else [()] * (len(SERIES_FIELDS) + 1)
        return {"t": list(cols[0]), **{f: list(c) for f, c in zip(SERIES_FIELDS, cols[1:], strict=True)}}


class RunProcesses:
    """The run's processes (root pid and descendants) and every GPU process seen meanwhile.

    `poll_tree(t)` from the main loop every few seconds; `observe(snapshot, t)` from the sampler
    thread on every tick. Times are seconds since the run began. Thread-safe."""

    def __init__(self, root_pid: int, *, simulated: bool = False, reader: Any = None,
                 children: Callable[[int], list[int]] | None = None,
                 ancestors: Callable[[int], list[int]] | None = None) -> None:
        self.root_pid = root_pid
        self.simulated = simulated
        self._reader = reader or HostProcessReader()
        self._children = children or _children
        self._ancestors = ancestors or _ancestors
        self._lock = threading.Lock()
        self._procs: dict[int, _Proc] = {}
        self._ours: dict[int, bool] = {root_pid: True}
        self._gpu: dict[tuple[int, str], _GpuUse] = {}
        self.gpu_start_s: float | None = None
        self.gpu_start_by_gpu: dict[str, float] = {}
        self._handles: dict[int, psutil.Process] = {}  # the tree's live processes, to signal them later
        self._last_records: list[Any] = []

    # -- the process tree (main thread) ---------------------------------------------------------
    def poll_tree(self, t: float) -> None:
        """Read the root and its live descendants: who they are, their CPU and busiest thread."""
        pids = [self.root_pid] + self._children(self.root_pid)
        for pid in pids:
            if pid not in self._handles:
                try:
                    self._handles[pid] = psutil.Process(pid)
                except psutil.Error:
                    pass
        # Keep a handle that left the tree only while it runs (re-parented): the dict stays as small
        # as the live tree, however many short-lived processes the command starts.
        current = set(pids)
        for pid in [pid for pid in self._handles if pid not in current]:
            if not _running(self._handles[pid]):
                del self._handles[pid]
        infos = [(pid, self._reader.read(pid)) for pid in pids]
        with self._lock:
            for pid, info in infos:
                if info is None:
                    continue
                self._ours[pid] = True
                p = self._procs.get(pid)
                if p is None:
                    p = self._procs[pid] = _Proc(pid, True)
                p.ours, p.from_tree = True, True
                p.name, p.user, p.cmdline = info.name or p.name, info.user or p.user, info.cmdline or p.cmdline
                p.seen(t)
                p.cpu.add(info.cpu_cores)
                p.thread.add(info.thread_cpu_max_ratio)
                p.busy.add(info.threads_busy)
                p.busy_threads = list(info.busy_threads or []) or p.busy_threads
                if info.rss_bytes is not None:
                    p.rss_max_bytes = max(p.rss_max_bytes or 0.0, info.rss_bytes)
        self._reader.forget({pid for pid, info in infos if info is not None})

    def live_descendants(self) -> list[psutil.Process]:
        """The root's descendants seen so far that still run (pid reuse excluded), including any
        that were re-parented after their parent died."""
        seen = dict(self._handles)
        for pid in self._children(self.root_pid):
            if pid not in seen:
                try:
                    seen[pid] = psutil.Process(pid)
                except psutil.Error:
                    pass
        return [p for pid, p in seen.items() if pid != self.root_pid and _running(p)]

    # -- GPU processes (sampler thread) ---------------------------------------------------------
    def observe(self, snap: Any, t: float) -> None:
        # The sampler rereads processes every second; the ticks between repeat the same records.
        recs = snap.processes
        if len(recs) == len(self._last_records) and all(a is b for a, b in zip(recs, self._last_records, strict=True)):
            return
        self._last_records = list(recs)
        for rec in recs:
            ours = self.simulated or self.ours(rec.pid, visible=bool(rec.host_visible))
            with self._lock:
                p = self._procs.get(rec.pid)
                if p is None:
                    p = self._procs[rec.pid] = _Proc(rec.pid, ours)
                p.ours = p.ours or ours
                p.name, p.user, p.cmdline = p.name or rec.name, p.user or rec.user, p.cmdline or rec.cmdline
                p.frameworks = p.frameworks or tuple(getattr(rec, "frameworks", ()))
                p.seen(t)
                if not p.from_tree:
                    p.cpu.add(rec.cpu_cores)
                    p.thread.add(rec.thread_cpu_max_ratio)
                    p.busy.add(rec.threads_busy)
                    p.busy_threads = list(rec.busy_threads) or p.busy_threads
                    if rec.rss_bytes is not None:
                        p.rss_max_bytes = max(p.rss_max_bytes or 0.0, rec.rss_bytes)
                u = self._gpu.get((rec.pid, rec.gpu))
                if u is None:
                    u = self._gpu[(rec.pid, rec.gpu)] = _GpuUse(t, t)
                u.last_s = t
                if rec.gpu_memory_bytes is not None:
                    u.memory_max_bytes = max(u.memory_max_bytes or 0.0, rec.gpu_memory_bytes)
                u.sm.add(rec.sm_ratio)
                u.add(t, rec)
                if ours:
                    if self.gpu_start_s is None:
                        self.gpu_start_s = t
                    self.gpu_start_by_gpu.setdefault(rec.gpu, t)

    def ours(self, pid: int, visible: bool = True) -> bool:
        """Whether `pid` is the run's command or one of its descendants (never another user's).
        `visible=False`: a GPU process outside our pid namespace, whose ancestry cannot be read here."""
        with self._lock:
            known = self._ours.get(pid)
        if known is None:
            known = visible and self.root_pid in self._ancestors(pid)
            with self._lock:
                self._ours[pid] = known
        return known

    # -- the table ------------------------------------------------------------------------------
    def table(self) -> list[dict[str, Any]]:
        """One row per process and GPU it used (a run process that used none gets one row with
        gpu None): the run's first, then other users', each by pid. A GPU row has the process's reads on
        that GPU as `series` (t and SERIES_FIELDS, bounded), so its verdicts can be replayed."""
        rows = []
        with self._lock:
            uses: dict[int, list[tuple[str, _GpuUse]]] = {}
            for (pid, gpu), u in self._gpu.items():
                uses.setdefault(pid, []).append((gpu, u))
            for pid, p in self._procs.items():
                base = {"pid": pid, "ours": p.ours, "name": p.name, "user": p.user, "cmdline": p.cmdline,
                        "first_seen_s": p.first_s, "last_seen_s": p.last_s, "cpu_cores_mean": p.cpu.mean,
                        "cpu_cores_max": p.cpu.hi, "thread_cpu_max_ratio": p.thread.hi,
                        "threads_busy_mean": p.busy.mean, "threads_busy_max": p.busy.hi,
                        "busy_threads": [{"tid": b.tid, "name": b.name, "cpu_ratio": b.cpu_ratio} for b in p.busy_threads],
                        "rss_max_bytes": p.rss_max_bytes, "frameworks": list(p.frameworks)}
                per_gpu = sorted(uses.get(pid, []), key=lambda gu: gu[0])
                if not per_gpu:
                    rows.append({**base, "gpu": None, "gpu_first_seen_s": None, "gpu_memory_max_bytes": None,
                                 "sm_ratio_mean": None, "series": None})
                for gpu, u in per_gpu:
                    rows.append({**base, "gpu": gpu, "gpu_first_seen_s": u.first_s,
                                 "gpu_memory_max_bytes": u.memory_max_bytes, "sm_ratio_mean": u.sm.mean,
                                 "series": u.columns()})
        rows.sort(key=lambda r: (not r["ours"], r["pid"], r["gpu"] or ""))
        return rows


def _running(p: psutil.Process) -> bool:
    """Alive and not a zombie (pid reuse excluded)."""
    try:
        return bool(p.is_running()) and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except (psutil.Error, OSError):
        return []


def _ancestors(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).parents()]
    except (psutil.Error, OSError):
        return []
