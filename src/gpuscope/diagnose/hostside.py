"""Is a GPU process busy on the host? Its busiest thread saturated (a Python loop held by the GIL), or its
CPU in all as much as a saturated thread with at least one busy thread (a runtime dispatching from several
threads: JAX/XLA, TensorFlow, multi-stream PyTorch). Either way, a GPU it holds while its SMs idle waits on
its host side, and is never idle.

    >>> from gpuscope.diagnose import ProcessView, Thresholds
    >>> jax = ProcessView(1, cpu_cores=1.9, thread_cpu_max_ratio=0.82, threads_busy=3)
    >>> saturated(jax, Thresholds()), spread_busy(jax, Thresholds()), describe(jax)
    (False, True, '1.9 cores over 3 busy threads, the busiest at 82 % of a core')
"""

from __future__ import annotations

from typing import Any

from .._records import THREAD_BUSY_RATIO
from .thresholds import Thresholds


def saturated(p: Any, th: Thresholds) -> bool:
    """Its busiest thread runs at `thread_saturated` of a core or more."""
    return (p.thread_cpu_max_ratio or 0.0) >= th.thread_saturated


def spread_busy(p: Any, th: Thresholds) -> bool:
    """It uses `process_cpu_busy` cores or more in all, with a busy thread (half a core) among them; where the
    busy threads were not counted (an older recording), the busiest thread's ratio says whether one is."""
    if p.cpu_cores is None or p.cpu_cores < th.process_cpu_busy:
        return False
    busy = getattr(p, "threads_busy", None)
    if busy is not None:
        return busy >= 1
    return p.thread_cpu_max_ratio is None or p.thread_cpu_max_ratio >= THREAD_BUSY_RATIO


def host_busy(p: Any, th: Thresholds) -> bool:
    return saturated(p, th) or spread_busy(p, th)


def busiest(processes: list[Any], th: Thresholds) -> Any:
    """The process most busy on the host among those that are (host_busy), or None."""
    busy = [p for p in processes if host_busy(p, th)]
    return max(busy, key=lambda p: (p.cpu_cores or 0.0, p.thread_cpu_max_ratio or 0.0), default=None)


def describe(p: Any) -> str:
    """'1.9 cores over 3 busy threads, the busiest at 82 % of a core', with what is known."""
    busy = getattr(p, "threads_busy", None)
    many = busy is not None and busy > 1
    cores = "" if p.cpu_cores is None else (f"{p.cpu_cores:.1f} core{'' if f'{p.cpu_cores:.1f}' == '1.0' else 's'}"
                                            + (f" over {busy} busy threads" if many else ""))
    thread = "" if p.thread_cpu_max_ratio is None else (
        f"{'the busiest' if many else 'its busiest thread'} at {p.thread_cpu_max_ratio * 100:.0f} % of a core")
    return ", ".join(x for x in (cores, thread) if x)


def evidence(p: Any) -> dict[str, Any]:
    """What the verdicts' evidence says of a process's host side."""
    ev: dict[str, Any] = {"pid": p.pid}
    if p.cpu_cores is not None:
        ev["process_cpu_cores"] = p.cpu_cores
    if getattr(p, "threads_busy", None) is not None:
        ev["threads_busy"] = p.threads_busy
    threads = getattr(p, "busy_threads", None)
    if threads:
        ev["busy_threads"] = [f"{t.name or '?'} ({t.tid}) {t.cpu_ratio * 100:.0f} %" for t in threads]
    return ev
