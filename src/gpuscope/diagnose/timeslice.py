"""A GPU that processes share in turns (time-slicing): judged by its main user over that user's own turns.

Without MPS, the kernels of different processes do not run at once: the GPU gives each process with work
queued a time slice in turn. NVML's utilization then reads (nearly) 100 %, since some process's kernel runs
all the time, while the SM activity (GPM) averages full turns of a large matmul with turns of tiny kernels
that fill a few SMs: 63 % busy need not be a GPU waiting on its host. Each process's part of the time is
NVML's per-process figure (`utilization_ratio`: the time a kernel of it ran), and those parts sum to about
the whole.

The main user is the process that holds the GPU `timeslice_main_share` of the time or more, while another
takes turns too. Its figures over its turns are the GPU's over its share of the time, at most 1: all of a
pipe's activity is put down to it, right for a pipe its neighbours do not use (tiny elementwise kernels use
no tensor core); and its share counts whole turns, longer than its kernels ran at full rate, so the busy
rules judge the turns as `timeslice_turn_scale` of that share. When the turns are busy (SMs at `sm_busy`
or more so judged), the GPU is limited as the main user's turns are: compute_bound, memory_bound, ... by
the rules of a GPU of one process; a full launch queue in the main user's stacks (its thread blocked
issuing work) is then the GPU being the limit, not its host.

    >>> from gpuscope.diagnose import GpuWindow, ProcessView, Thresholds
    >>> w = GpuWindow("0", [], {}, processes=[ProcessView(1, utilization_ratio=0.72),
    ...                                       ProcessView(2, utilization_ratio=0.2), ProcessView(3)])
    >>> main_user(w, 1.0, Thresholds()).pid, len(turn_takers(w, Thresholds())), over_turns(0.56, 0.72)
    (1, 2, 0.7778)
"""

from __future__ import annotations

from typing import Any

from .thresholds import Thresholds


def turn_takers(w: Any, th: Thresholds) -> list[Any]:
    """The processes of the window whose kernels ran `timeslice_min_share` of the time or more."""
    return [p for p in w.processes if (p.utilization_ratio or 0.0) >= th.timeslice_min_share]


def main_user(w: Any, util: float | None, th: Thresholds) -> Any:
    """The process that holds a time-sliced GPU most of the time, or None: the GPU's time full (NVML utilization
    `util` at `timeslice_util`), at least two processes taking turns, one of them `timeslice_main_share` of the
    time or more."""
    if util is None or util < th.timeslice_util:
        return None
    takers = turn_takers(w, th)
    if len(takers) < 2:
        return None
    top = max(takers, key=lambda p: (p.utilization_ratio, -p.pid))
    return top if top.utilization_ratio >= th.timeslice_main_share else None


def over_turns(x: float | None, share: float) -> float | None:
    """A GPU-wide ratio (SMs, a pipe, DRAM) over the main user's turns: x / share, at most 1."""
    return None if x is None or share <= 0 else round(min(1.0, x / share), 4)


def full_queue(p: Any, th: Thresholds) -> str:
    """Where the main user's thread waits to issue work ('' if its stacks were not sampled or say otherwise):
    on a GPU it holds most of the time, a launch blocks because the queue is full."""
    prof = getattr(p, "profile", None)
    if prof is None or prof.samples < th.stack_min_samples or prof.shares.get("launch", 0.0) < th.stack_launch:
        return ""
    return prof.where("launch")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f} %"


def turns_words(kind: str, ev: dict[str, Any]) -> str:
    """What limits the main user's turns, from a time-sliced GPU verdict's evidence (its main_* figures)."""
    return {
        "compute_bound": f"compute-bound on the tensor cores ({_pct(ev.get('main_tensor_active'))}), SMs "
                         f"{_pct(ev.get('main_sm_active'))} busy",
        "memory_bound": f"memory-bandwidth-bound (DRAM {_pct(ev.get('main_dram_active'))} of its peak)",
        "tensor_cores_unused": f"its math on the FP32/FP16 pipes ({_pct(ev.get('main_fp_active'))}) while the tensor "
                               "cores idle",
        "memory_access_bound": "its kernels stall on memory access (SMs busy, math pipes and DRAM both low)",
        "healthy": f"well used (SMs {_pct(ev.get('main_sm_active'))}, tensor {_pct(ev.get('main_tensor_active'))}, "
                   f"DRAM {_pct(ev.get('main_dram_active'))})",
    }.get(kind, kind)


def unread(w: Any, util: float | None, th: Thresholds) -> bool:
    """Whether a shared GPU's full time is, in good part, no process's on record: NVML's per-process figures,
    read every few seconds (a new process's first read covers its first second), leave `timeslice_unaccounted`
    of it or more unaccounted for, so who holds the GPU is not known yet. False where no process's figure is
    known at all (MIG, or no per-process utilization)."""
    if util is None or util < th.timeslice_util or len(w.processes) < 2:
        return False
    known = [p.utilization_ratio for p in w.processes if p.utilization_ratio is not None]
    return bool(known) and util - sum(known) >= th.timeslice_unaccounted
