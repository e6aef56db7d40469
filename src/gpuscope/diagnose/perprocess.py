"""Verdicts per process where several processes share a GPU: what limits each one, from its share of the
GPU's SM work (gpuscope.shares), its threads' CPU (hostside), its stacks where they were sampled, and its
GPU memory over the window. The GPU's own verdict says that it is shared and by whom.

- The main user of a GPU that its processes take turns on, its time full (timeslice.py), is limited as the
  GPU is over its own turns; its thread blocked issuing work waits on the GPU's full queue, not its host.
- A main user of a GPU whose SMs are busy (its part of the SM work at least `process_share_major` of a
  fair share) is limited by the GPU: the GPU's verdict (compute_bound, memory_bound, ...) is its own.
  The pipe and DRAM figures are the GPU's, with its neighbours' kernels in them, so below
  `process_share_dominant` of the work it says so and is less sure.
- A process doing `process_share_dominant` of the work of an idle-ish GPU owns its pattern too
  (input_starved bursts, transfers).
- Any other process busy on the host (a saturated thread, or its cores spread over busy threads) waits
  on its host side: launch- or sync-bound (its stacks tell which: sync_bound, launch_bound,
  input_starved, host_bound), or host_bound where it runs no GPU work at all.
- One that runs nothing is idle, or idle_allocated where it holds memory; one with light work and a
  quiet host is healthy, and gets nothing beyond that.
- A process whose GPU memory grows steadily gets memory_growth of its own (a side verdict).

A GPU with one process gets none of these: its verdict is its process's.
"""

from __future__ import annotations

import statistics
from typing import Any

from . import advice, hostside, timeslice
from .rules import _host_verdict, _linear, _pct, _vals
from .thresholds import Thresholds

#: GPU verdicts of busy SMs: a main user of the GPU is limited as the GPU is.
BUSY = frozenset({"compute_bound", "memory_bound", "tensor_cores_unused", "memory_access_bound", "healthy"})
#: GPU verdicts that describe a pattern of the GPU's work, which its dominant user owns.
PATTERN = frozenset({"input_starved", "transfer_bound"})
#: Processes named in the GPU's summary; the evidence lists them all.
NAMED = 4


def attach(w: Any, verdicts: list[Any], th: Thresholds, verdict: Any) -> None:
    """On a window of two or more processes, put each process's verdicts under the GPU's primary verdict
    (`processes`) and say in the GPU's verdict that it is shared, by whom, and with what share each."""
    primary = next((v for v in verdicts if v.primary), None)
    if len(w.processes) < 2 or primary is None or primary.kind == "gpu_lost":
        return
    primary.processes = process_verdicts(w, primary, th, verdict)
    own = {v.pid: v.kind for v in primary.processes if v.primary}
    shares = work_shares(w)
    rows = sorted(w.processes, key=lambda p: (-(p.sm_ratio or 0.0), p.pid))
    primary.evidence["shared_by"] = [
        {"pid": p.pid, "name": p.name, "sm_share": _r(p.sm_ratio), "share_of_gpu_work": _r(shares.get(p.pid)),
         "kind": own.get(p.pid)} for p in rows]
    named = ", ".join(f"{p.pid} {p.name or '?'} (SM {_pct(p.sm_ratio)}, {own.get(p.pid, '?')})" for p in rows[:NAMED])
    more = f" and {len(rows) - NAMED} more" if len(rows) > NAMED else ""
    primary.summary = f"{primary.summary} Shared by {len(rows)} processes: {named}{more}."


def work_shares(w: Any) -> dict[int, float]:
    """Each process's part of the GPU's SM work (0..1, summing to 1), from its SM share; {} where no process's
    share is known (MIG, no per-process utilization)."""
    known = {p.pid: p.sm_ratio for p in w.processes if p.sm_ratio is not None}
    if not known:
        return {}
    total = sum(v for v in known.values() if v > 0)
    return {pid: (v / total if total > 0 and v > 0 else 0.0) for pid, v in known.items()}


def process_verdicts(w: Any, gpu: Any, th: Thresholds, verdict: Any) -> list[Any]:
    """The verdicts of each process of the window (`gpu` is the GPU's primary verdict): one primary each, and
    memory_growth beside it where its memory grows."""
    shares = work_shares(w)
    sm_all = _vals(w, "gpu_sm_active_ratio")
    gpu_sm = statistics.median(sm_all) if sm_all else None
    out: list[Any] = []
    for p in w.processes:
        out.extend(_one(w, p, gpu, gpu_sm, shares, th, verdict))
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _one(w: Any, p: Any, gpu: Any, gpu_sm: float | None, shares: dict[int, float], th: Thresholds,
         verdict: Any) -> list[Any]:
    t0, t1 = gpu.start_s, gpu.end_s
    fixes_for = advice.frameworks_of([p])

    def make(kind: str, severity: str, confidence: float, summary: str, evidence: dict[str, Any],
             primary: bool = True) -> Any:
        return verdict(w.gpu, kind, severity, round(confidence, 2), summary,
                       {k: (round(v, 4) if isinstance(v, float) else v) for k, v in evidence.items()},
                       advice.fixes(kind, fixes_for), t0, t1, primary, pid=p.pid)

    n = len(w.processes)
    frac = shares.get(p.pid)
    who = f"Process {p.pid} ({p.name or '?'})"
    ev: dict[str, Any] = {**hostside.evidence(p), "name": p.name, "sm_share": p.sm_ratio, "share_of_gpu_work": frac,
                          "nvml_process_utilization": p.utilization_ratio, "busiest_cpu_thread": p.thread_cpu_max_ratio,
                          "gpu_memory_bytes": p.gpu_memory_bytes, "gpu_verdict": gpu.kind, "gpu_sm_active": gpu_sm}
    ev = {k: v for k, v in ev.items() if v is not None}
    if p.profile_error:
        ev["stack_sampling"] = p.profile_error
    major = frac is None or frac >= th.process_share_major / n
    dominant = frac is not None and frac >= th.process_share_dominant
    others = sorted((q for q in w.processes if q.pid != p.pid), key=lambda q: -(q.sm_ratio or 0.0))
    main_pid = gpu.evidence.get("main_pid") if gpu.kind in BUSY else None  # a time-sliced GPU's main user
    main = next((q for q in others if q.pid == main_pid), None)
    busy_with = (f"; GPU {w.gpu} is {_pct(gpu_sm)} busy with the work of {others[0].pid} ({others[0].name or '?'}, SM "
                 f"{_pct(others[0].sm_ratio)})" if gpu_sm is not None and gpu_sm >= th.sm_busy and others
                 and (others[0].sm_ratio or 0.0) > (p.sm_ratio or 0.0)
                 else f"; GPU {w.gpu} is time-sliced, {main.pid} ({main.name or '?'}) holding it "
                 f"{(main.utilization_ratio or 0.0) * 100:.0f} % of the time" if main is not None else "")
    part = f"{frac * 100:.0f} % of GPU {w.gpu}'s SM work" if frac is not None else "an unknown part of its SM work"
    out: list[Any] = []
    if main_pid is not None and p.pid == main_pid:
        out.append(_main_user(w, p, gpu, ev, who, part, th, make))
    elif gpu_sm is not None and gpu_sm >= th.sm_busy and gpu.kind in BUSY and major:
        mixed = "" if dominant else " (the GPU's pipe and DRAM figures hold its neighbours' kernels too)"
        out.append(make(gpu.kind, gpu.severity, gpu.confidence * (1.0 if dominant else 0.75),
                        f"{who} does {part} (SM share {_pct(p.sm_ratio)}): {_busy_words(gpu)}{mixed}.", ev))
    elif dominant and gpu.kind in PATTERN:
        out.append(make(gpu.kind, gpu.severity, gpu.confidence * 0.9,
                        f"{who} does {part}, so the GPU's pattern is its own: {gpu.summary}", ev))
    elif hostside.host_busy(p, th):
        from . import driverapi  # its driver calls, where the eBPF probes ran, tell launch- from sync-bound

        out.append(driverapi.sharpen(_host_side(w, p, ev, who, busy_with, th, make), getattr(p, "driver", None), th,
                                     lambda k: advice.fixes(k, fixes_for)))
    elif (p.utilization_ratio or 0.0) < 0.02 and (p.sm_ratio or 0.0) < 0.01:
        held = p.gpu_memory_bytes or 0.0
        held_s = _held_for(p.memory, held, t1)
        if held >= th.held_bytes and held_s >= th.min_window_s:
            out.append(make("idle_allocated", "warning", 0.8,
                            f"{who} holds {held / 2**30:.1f} GiB of GPU {w.gpu} and runs nothing on it.",
                            {**ev, "held_for_s": held_s}))
        else:
            out.append(make("idle", "info", 0.7, f"{who} runs nothing on GPU {w.gpu}.", ev))
    else:
        out.append(make("healthy", "info", 0.6,
                        f"{who}: light GPU work (SM share {_pct(p.sm_ratio)}) and nothing waits on its host side"
                        f"{busy_with}.", ev))
    out.extend(_growth(w, p, th, make))
    return out


def _main_user(w: Any, p: Any, gpu: Any, ev: dict[str, Any], who: str, part: str, th: Thresholds, make: Any) -> Any:
    """The main user of a GPU shared in turns (timeslice.py): limited as the GPU is over its own turns; a thread
    that waits to issue work waits on the full queue of a GPU it holds most of the time, not on its host."""
    e = gpu.evidence
    queue = timeslice.full_queue(p, th)
    ev = {**ev, "time_share": p.utilization_ratio, **{k: e[k] for k in ("main_sm_active", "main_tensor_active",
                                                                          "main_dram_active") if k in e}}
    if queue:
        ev = {**ev, **p.profile.as_evidence()}
    return make(gpu.kind, gpu.severity, gpu.confidence,
                f"{who} holds GPU {w.gpu} {(p.utilization_ratio or 0.0) * 100:.0f} % of the time ({part}), "
                f"time-sliced with {_others(e.get('time_sliced_by', 2) - 1)}; over its turns it is "
                f"{timeslice.turns_words(gpu.kind, e)}"
                + (f". Its thread waits to issue more work (at {queue}): the launch queue is full, so the GPU is "
                   "its limit, not its host." if queue else "."), ev)


def _others(n: int) -> str:
    return "another process" if n == 1 else f"{n} other processes"


def _busy_words(gpu: Any) -> str:
    e = gpu.evidence
    return {
        "compute_bound": f"compute-bound on the tensor cores (GPU tensor pipes {_pct(e.get('tensor_active'))})",
        "memory_bound": f"memory-bandwidth-bound (GPU DRAM {_pct(e.get('dram_active'))} of its peak)",
        "tensor_cores_unused": "its math runs on the FP32/FP16 pipes while the tensor cores idle",
        "memory_access_bound": "its kernels stall on memory access (pipes and DRAM both low)",
        "healthy": "it uses the GPU well",
    }.get(gpu.kind, gpu.kind)


def _host_side(w: Any, p: Any, ev: dict[str, Any], who: str, busy_with: str, th: Thresholds, make: Any) -> Any:
    """A process that does little on the GPU while it is busy on the host: its stacks say why, where sampled."""
    sm, util = p.sm_ratio or 0.0, p.utilization_ratio
    head = f"{who} on GPU {w.gpu} is held up by its host side (SM share {_pct(p.sm_ratio)}, {hostside.describe(p)})"
    prof = p.profile
    if prof is not None and prof.samples >= th.stack_min_samples:
        v = _host_verdict(w, prof, ev, sm, util, p.thread_cpu_max_ratio or 0.0, th, make, head=head)
        if busy_with:
            v.summary = v.summary.rstrip(".") + busy_with + "."
        return v
    if (util or 0.0) > 0.0 or sm > 0.0:
        return make("launch_or_sync_bound", "warning", 0.6,
                    f"{head}: it launches small work or waits on synchronisations"
                    + (f" ({ev['stack_sampling']})" if "stack_sampling" in ev else "; its threads' stacks tell which")
                    + f"{busy_with}.", ev)
    return make("host_bound", "warning", 0.5, f"{head}: it runs no GPU work meanwhile; the host does something else.",
                ev)


def _held_for(memory: list[tuple[float, float]], held: float, end: float) -> float:
    """Seconds up to `end` during which at least 90 % of `held` bytes were held."""
    since = end
    for t, v in reversed(memory):
        if v < 0.9 * held:
            break
        since = t
    return max(0.0, end - since) if memory else 0.0


def _growth(w: Any, p: Any, th: Thresholds, make: Any) -> list[Any]:
    """memory_growth of one process: its GPU memory grows steadily enough to fill the GPU within the horizon."""
    mem = p.memory
    if len(mem) < 3 or not w.memory_total_bytes:
        return []
    fit = _linear(mem)
    if fit is None:
        return []
    slope, r2 = fit
    grown = mem[-1][1] - mem[0][1]
    used = _vals(w, "gpu_memory_used_bytes")
    free = w.memory_total_bytes - (used[-1] if used else mem[-1][1])
    if slope <= 0 or r2 < th.growth_r2 or grown < th.growth_min_bytes or free / slope > th.oom_horizon_s:
        return []
    tto = free / slope
    return [make("memory_growth", "warning", min(1.0, r2),
                 f"Process {p.pid} ({p.name or '?'}) grows its GPU memory {slope / 2**20:.0f} MiB/s: GPU {w.gpu} "
                 f"is out of memory in about {tto / 60:.0f} min at this rate.",
                 {"pid": p.pid, "bytes_per_s": slope, "r2": r2, "time_to_oom_s": tto, "used_bytes": mem[-1][1]},
                 primary=False)]
