"""Host-side facts about the processes that use a GPU: CPU (whole process and busiest thread), memory,
threads, user, redacted command line, and container / pod / Slurm job / torchrun run.

A GPU job that starves its GPU is often CPU-bound in one Python thread (data loading, the launch
loop): the process as a whole may use 1.3 cores on a 64-core host, yet one thread sits at 100 %.
`thread_cpu_max_ratio` shows that.

    >>> import os
    >>> reader = HostProcessReader()
    >>> reader.read(os.getpid()).cpu_cores is None  # the first read only sets the baseline
    True
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import psutil

from gpuscope._cgroup import Attribution, read_attribution
from gpuscope._redact import redact_cmdline
from gpuscope._text import valid_text

__all__ = ["HostProcInfo", "HostProcessReader"]

log = logging.getLogger("gpuscope.hostproc")

# Below this wall window, jiffy rounding (10 ms) dominates the ratio: keep the previous one.
_MIN_WINDOW_S = 0.05

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
    started_at: float | None = None  # wall clock, seconds since the epoch
    container: str = ""
    pod_uid: str = ""
    pod: str = ""
    namespace: str = ""
    slurm_job: str = ""
    torchrun_run: str = ""  # TORCHELASTIC_RUN_ID


class _Entry:
    """What is kept between two reads of one process."""

    __slots__ = ("proc", "static", "t", "cpu", "thread_cpu", "cpu_cores", "thread_ratio")

    def __init__(self, proc: psutil.Process, static: HostProcInfo) -> None:
        self.proc = proc
        self.static = static
        self.t: float | None = None
        self.cpu: float | None = None
        self.thread_cpu: dict[int, float] | None = None
        self.cpu_cores: float | None = None
        self.thread_ratio: float | None = None


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
            slurm_job=att.slurm_job, torchrun_run=att.torchrun_run,
        )
        return _Entry(proc, static)

    def _sample(self, entry: _Entry) -> HostProcInfo:
        proc = entry.proc
        with proc.oneshot():
            now = self._clock()
            times: Any = _get(proc.cpu_times, None)
            mem: Any = _get(proc.memory_info, None)
            threads: list[Any] | None = _get(proc.threads, None)
        s = entry.static
        info = HostProcInfo(
            pid=s.pid, name=s.name, user=s.user, cmdline=s.cmdline, started_at=s.started_at,
            container=s.container, pod_uid=s.pod_uid, pod=s.pod, namespace=s.namespace,
            slurm_job=s.slurm_job, torchrun_run=s.torchrun_run,
            rss_bytes=float(mem.rss) if mem is not None else None,
            threads=len(threads) if threads is not None else None,
        )
        cpu = times.user + times.system if times is not None else None
        thread_cpu = {t.id: t.user_time + t.system_time for t in threads} if threads is not None else None

        dt = now - entry.t if entry.t is not None else None
        if dt is not None and dt < _MIN_WINDOW_S:
            info.cpu_cores, info.thread_cpu_max_ratio = entry.cpu_cores, entry.thread_ratio
            return info
        entry.cpu_cores = entry.thread_ratio = None
        if dt is not None and cpu is not None and entry.cpu is not None:
            entry.cpu_cores = max(0.0, cpu - entry.cpu) / dt
        if dt is not None and thread_cpu is not None and entry.thread_cpu is not None:
            prev = entry.thread_cpu
            # A thread new since the last read started after it: its whole time is in the window.
            busiest = max((c - prev.get(tid, 0.0) for tid, c in thread_cpu.items()), default=0.0)
            entry.thread_ratio = min(1.0, max(0.0, busiest / dt))
        entry.t, entry.cpu, entry.thread_cpu = now, cpu, thread_cpu
        info.cpu_cores, info.thread_cpu_max_ratio = entry.cpu_cores, entry.thread_ratio
        return info
