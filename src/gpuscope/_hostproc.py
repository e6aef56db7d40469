"""Host-side facts about the processes that use a GPU: CPU (whole process and busiest thread), memory,
threads, user, redacted command line, and container / pod / Slurm job / torchrun run.

A GPU job that starves its GPU is often CPU-bound in one Python thread (data loading, the launch
loop): the process as a whole may use 1.3 cores on a 64-core host, yet one thread sits at 100 %.
`thread_cpu_max_ratio` shows that. A runtime that dispatches from several threads (JAX/XLA, TensorFlow,
multi-stream PyTorch) keeps 1.9 cores busy with no thread at 100 %: `threads_busy` and `busy_threads`
show that. Threads are read from /proc/PID/task/*/stat, at most MAX_THREADS_PER_READ a read: a process
of thousands has them read in turns, each ratio over the time since that thread was last read.

    >>> import os
    >>> reader = HostProcessReader()
    >>> reader.read(os.getpid()).cpu_cores is None  # the first read only sets the baseline
    True
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import psutil

from gpuscope._cgroup import Attribution, read_attribution
from gpuscope._frameworks import read as read_frameworks
from gpuscope._records import THREAD_BUSY_RATIO, ThreadCpu
from gpuscope._redact import redact_cmdline
from gpuscope._text import valid_text

__all__ = ["HostProcInfo", "HostProcessReader"]

log = logging.getLogger("gpuscope.hostproc")

# Below this wall window, jiffy rounding (10 ms) dominates the ratio: keep the previous one.
_MIN_WINDOW_S = 0.05
#: Threads whose stat one read opens: more are read in turns (bounded cost for a process of thousands).
MAX_THREADS_PER_READ = 256
#: Busy threads named in a record, the busiest first.
MAX_BUSY_THREADS = 8
_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)

T = TypeVar("T")


@dataclass(slots=True)
class HostProcInfo:
    """One process as seen from the host. None / "" where the value could not be read."""

    pid: int
    name: str = ""
    user: str = ""
    cmdline: str = ""  # redacted, shell-quoted
    cpu_cores: float | None = None  # cores: 1.0 = one core saturated; None on the first read
    thread_cpu_max_ratio: float | None = None  # busiest thread, 0..1 of one core
    rss_bytes: float | None = None
    threads: int | None = None
    threads_busy: int | None = None  # threads at THREAD_BUSY_RATIO of a core or more; None on the first read
    busy_threads: list[ThreadCpu] | None = None  # the busiest of them (MAX_BUSY_THREADS), busiest first
    started_at: float | None = None  # wall clock, seconds since the epoch
    container: str = ""
    pod_uid: str = ""
    pod: str = ""
    namespace: str = ""
    slurm_job: str = ""
    torchrun_run: str = ""  # TORCHELASTIC_RUN_ID
    # The GPU frameworks it loaded (gpuscope._frameworks), read from its maps once, when it is first read: a GPU
    # process has loaded its framework by the time it holds a CUDA context. () where they cannot be read.
    frameworks: tuple[str, ...] = ()


class _Entry:
    """What is kept between two reads of one process."""

    __slots__ = ("proc", "static", "t", "cpu", "threads", "cpu_cores", "thread_ratio", "busy")

    def __init__(self, proc: psutil.Process, static: HostProcInfo) -> None:
        self.proc = proc
        self.static = static
        self.t: float | None = None
        self.cpu: float | None = None
        self.threads = ThreadTable()
        self.cpu_cores: float | None = None
        self.thread_ratio: float | None = None
        self.busy: tuple[int, list[ThreadCpu]] | None = None


def _list_tasks(task_dir: str) -> list[int]:
    """The thread ids in /proc/PID/task, in order. Raises OSError (gone, or denied)."""
    return sorted(int(n) for n in os.listdir(task_dir) if n.isdigit())


def _thread_stat(path: str) -> tuple[str, float] | None:
    """(name, CPU seconds) from one /proc/PID/task/TID/stat; None when the thread is gone or unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read(1024)
        head, _, tail = data.rpartition(b")")
        fields = tail.split()  # state, ppid, ... utime (11), stime (12), in clock ticks
        return head[head.index(b"(") + 1:].decode("utf-8", "replace"), (int(fields[11]) + int(fields[12])) * _TICK_S
    except (OSError, ValueError, IndexError):
        return None


class ThreadTable:
    """The threads of one process between reads: each one's CPU seconds and when they were read, and its last
    ratio. `read` lists /proc/PID/task (one call), opens the stat of at most `limit` threads, in turns when
    there are more, and returns (how many threads there are, {tid: ratio of one core}) for the threads that have
    a ratio: over the time since that thread was last read, or, for a thread that appeared since the previous
    listing, over the time since that listing (it started inside it). `name` holds each thread's name."""

    __slots__ = ("seen", "ratio", "name", "listed", "listed_at", "turn")

    def __init__(self) -> None:
        self.seen: dict[int, tuple[float, float]] = {}  # tid -> (CPU seconds, read at)
        self.ratio: dict[int, float] = {}
        self.name: dict[int, str] = {}
        self.listed: set[int] | None = None
        self.listed_at: float | None = None
        self.turn = 0

    def read(self, task_dir: str, now: float, limit: int = MAX_THREADS_PER_READ) -> tuple[int, dict[int, float]] | None:
        try:
            tids = _list_tasks(task_dir)
        except OSError:
            return None
        if len(tids) > limit:
            start = self.turn % len(tids)
            chosen = (tids[start:] + tids[:start])[:limit]
            self.turn = start + limit
        else:
            chosen = tids
        for tid in chosen:
            got = _thread_stat(f"{task_dir}/{tid}/stat")
            if got is None:
                continue
            name, cpu = got
            self.name[tid] = name
            prev = self.seen.get(tid)
            if prev is not None:
                if now - prev[1] >= _MIN_WINDOW_S:
                    self.ratio[tid] = min(1.0, max(0.0, (cpu - prev[0]) / (now - prev[1])))
                    self.seen[tid] = (cpu, now)
            else:
                if self.listed is not None and self.listed_at is not None and tid not in self.listed \
                        and now - self.listed_at >= _MIN_WINDOW_S:
                    self.ratio[tid] = min(1.0, max(0.0, cpu / (now - self.listed_at)))
                self.seen[tid] = (cpu, now)
        alive = set(tids)
        for table in (self.seen, self.ratio, self.name):
            for tid in [t for t in table if t not in alive]:
                del table[tid]
        self.listed, self.listed_at = alive, now
        return len(tids), self.ratio


def _get(fn: Callable[[], T], default: T) -> T:
    """fn(), or `default` when that one field is denied. A vanished process still raises."""
    try:
        return fn()
    except psutil.ZombieProcess:
        return default
    except psutil.NoSuchProcess:
        raise
    except Exception:
        return default


class HostProcessReader:
    """Reads `HostProcInfo` for GPU processes every tick, cheaply.

    Keeps one psutil.Process per pid (checked against pid reuse), reads the static facts (name,
    user, command line, start time, attribution) once, and turns CPU time counters into ratios over
    the time between two `read` calls. Call `forget` with the live pids now and then.
    """

    def __init__(self, proc_root: str = "/proc", clock: Callable[[], float] = time.monotonic) -> None:
        self._proc_root = proc_root  # for cgroup/environ; psutil reads its own procfs path
        self._clock = clock
        self._entries: dict[int, _Entry] = {}

    def read(self, pid: int) -> HostProcInfo | None:
        """Facts about `pid`, or None if it does not exist or is not visible here (another pid
        namespace). Never raises."""
        try:
            entry = self._entries.get(pid)
            if entry is not None and not entry.proc.is_running():  # gone, or pid reused
                entry = None
                del self._entries[pid]
            if entry is None:
                entry = self._new_entry(pid)
                self._entries[pid] = entry
            return self._sample(entry)
        except psutil.NoSuchProcess:
            self._entries.pop(pid, None)
            return None
        except Exception as e:  # monitoring must not break on one odd process
            log.debug("reading process %s failed: %r", pid, e)
            self._entries.pop(pid, None)
            return None

    def forget(self, alive: set[int]) -> None:
        """Drop what is kept for pids not in `alive`."""
        for pid in [p for p in self._entries if p not in alive]:
            del self._entries[pid]

    def _new_entry(self, pid: int) -> _Entry:
        proc = psutil.Process(pid)
        with proc.oneshot():
            name = _get(proc.name, "")
            user = _get(proc.username, "")
            cmdline: list[str] = _get(proc.cmdline, [])
            started_at = _get(proc.create_time, None)
        att: Attribution = read_attribution(pid, self._proc_root)
        # psutil decodes names and arguments with surrogate escapes: made valid text here, once, for every
        # consumer (any local user can start a process named b"\xff").
        static = HostProcInfo(
            pid=pid, name=valid_text(name), user=valid_text(user),
            cmdline=redact_cmdline([valid_text(a) for a in cmdline]), started_at=started_at,
            container=att.container, pod_uid=att.pod_uid, pod=att.pod, namespace=att.namespace,
            slurm_job=att.slurm_job, torchrun_run=att.torchrun_run, frameworks=read_frameworks(pid, self._proc_root),
        )
        return _Entry(proc, static)

    def _sample(self, entry: _Entry) -> HostProcInfo:
        proc = entry.proc
        with proc.oneshot():
            now = self._clock()
            times: Any = _get(proc.cpu_times, None)
            mem: Any = _get(proc.memory_info, None)
        s = entry.static
        info = HostProcInfo(
            pid=s.pid, name=s.name, user=s.user, cmdline=s.cmdline, started_at=s.started_at,
            container=s.container, pod_uid=s.pod_uid, pod=s.pod, namespace=s.namespace,
            slurm_job=s.slurm_job, torchrun_run=s.torchrun_run, frameworks=s.frameworks,
            rss_bytes=float(mem.rss) if mem is not None else None,
        )
        cpu = times.user + times.system if times is not None else None

        dt = now - entry.t if entry.t is not None else None
        if dt is not None and dt < _MIN_WINDOW_S:
            info.threads = len(entry.threads.listed) if entry.threads.listed is not None else None
            self._fill(info, entry)
            return info
        threads = entry.threads.read(f"{self._proc_root}/{s.pid}/task", now)
        info.threads = threads[0] if threads is not None else None
        entry.cpu_cores = entry.thread_ratio = entry.busy = None
        if dt is not None and cpu is not None and entry.cpu is not None:
            entry.cpu_cores = max(0.0, cpu - entry.cpu) / dt
        if dt is not None and threads is not None and threads[1]:
            ratios = threads[1]
            entry.thread_ratio = max(ratios.values())
            busy = sorted((tid for tid, r in ratios.items() if r >= THREAD_BUSY_RATIO), key=lambda t: (-ratios[t], t))
            names = entry.threads.name
            entry.busy = (len(busy), [ThreadCpu(tid, valid_text(names.get(tid, "")), round(ratios[tid], 4))
                                      for tid in busy[:MAX_BUSY_THREADS]])
        entry.t, entry.cpu = now, cpu
        self._fill(info, entry)
        return info

    @staticmethod
    def _fill(info: HostProcInfo, entry: _Entry) -> None:
        info.cpu_cores, info.thread_cpu_max_ratio = entry.cpu_cores, entry.thread_ratio
        if entry.busy is not None:
            info.threads_busy, info.busy_threads = entry.busy[0], list(entry.busy[1])
