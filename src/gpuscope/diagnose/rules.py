"""The verdict rules: stateless functions from a GPU's window to verdicts with evidence."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, TypeVar

from ..catalog import decode_clock_event_reasons
from . import advice, hostside, timeslice
from .thresholds import Thresholds

SLOWDOWN_REASONS = ("hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")

#: Each verdict kind's fixes in PyTorch's words (the fleet report and the trace verdicts read them); every
#: framework's, and the CUDA-level ones, are in advice.py, which the verdicts take theirs from.
ADVICE = advice.VERDICTS["torch"]


def _vals(w: Any, key: str) -> list[float]:
    return [v for v in w.series.get(key, []) if v is not None]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f} %"


def _idle_sample(util: float | None, sm: float | None, th: Thresholds) -> bool:
    if util is None and sm is None:
        return False
    return util is None or util < th.gap_util and (sm is None or sm < th.sm_idle)


def _steady(w: Any, th: Thresholds) -> tuple[Any, float, float]:
    """The window without fully idle samples at its start (the job starting) and a short idle tail
    (the job just ended), when what remains still spans `min_window_s`. Returns it and the seconds
    left out at each end; None for the window when the GPU began working too recently to judge."""
    n = len(w.times)
    if not th.trim_idle_edges or n == 0:
        return w, 0.0, 0.0
    util = w.series.get("gpu_utilization_ratio") or [None] * n
    sm = w.series.get("gpu_sm_active_ratio") or [None] * n
    flags = [not _idle_sample(util[i], sm[i], th) and not (util[i] is None and sm[i] is None) for i in range(n)]
    # Work starts with the first run of three active samples (a lone blip, such as the CUDA context
    # being created, is not the job running) and ends with the last such run.
    runs = [i for i in range(n - 2) if flags[i] and flags[i + 1] and flags[i + 2]]
    if not runs or (runs[0] == 0 and runs[-1] + 2 == n - 1):
        return w, 0.0, 0.0
    i0, i1 = runs[0], runs[-1] + 2
    if w.times[-1] - w.times[i1] >= th.min_window_s:  # idle for a while now: that is the state, keep it
        i1 = n - 1
    if w.times[i1] - w.times[i0] < th.min_window_s or i1 - i0 + 1 < th.min_samples:
        if i0 > 0 and i1 == n - 1:  # work began moments ago: too early to judge it
            return None, w.times[i0] - w.times[0], 0.0
        return w, 0.0, 0.0
    cut = replace(w, times=w.times[i0:i1 + 1], series={k: v[i0:i1 + 1] for k, v in w.series.items()})
    return cut, w.times[i0] - w.times[0], w.times[-1] - w.times[i1]


def _held_for(w: Any, held: float) -> float:
    """Seconds up to the window's end during which at least 90 % of `held` bytes were in use."""
    since = w.times[-1] if w.times else 0.0
    for t, v in zip(reversed(w.times), reversed(w.series.get("gpu_memory_used_bytes", [])), strict=False):
        if v is None:
            continue
        if v < 0.9 * held:
            break
        since = t
    return w.times[-1] - since if w.times else 0.0


def _runs(flags: list[bool]) -> int:
    """How many separate runs of True there are."""
    return sum(1 for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1]))


def classify(w: Any, th: Thresholds, verdict: Any) -> list[Any]:
    steady, lead_s, tail_s = _steady(w, th)
    starting = steady is None
    w = w if starting else steady
    t0, t1 = (w.times[0], w.times[-1]) if w.times else (0.0, 0.0)

    def make(kind: str, severity: str, confidence: float, summary: str, evidence: dict[str, Any],
             primary: bool = True) -> Any:
        return verdict(w.gpu, kind, severity, round(confidence, 2), summary,
                       {k: (round(v, 4) if isinstance(v, float) else v) for k, v in evidence.items()},
                       advice.fixes(kind, advice.frameworks_of(w.processes)), t0, t1, primary)

    if not w.healthy:
        return [make("gpu_lost", "critical", 1.0, f"GPU {w.gpu} is lost (NVML cannot reach it).", {})]
    if len(w.times) < th.min_samples or t1 - t0 < th.min_window_s:
        return []
    if starting:  # no primary verdict on a few seconds of work; side verdicts still hold
        return _side(w, th, make)
    sm_all = _vals(w, "gpu_sm_active_ratio")
    sm, util = _median(sm_all), _median(_vals(w, "gpu_utilization_ratio"))
    tensor, dram = _median(_vals(w, "gpu_tensor_active_ratio")), _median(_vals(w, "gpu_dram_active_ratio"))
    fp32, fp16 = _median(_vals(w, "gpu_fp32_active_ratio")) or 0.0, _median(_vals(w, "gpu_fp16_active_ratio")) or 0.0
    fp64 = _median(_vals(w, "gpu_fp64_active_ratio")) or 0.0
    pcie = (_median(_vals(w, "gpu_pcie_rx_bytes_per_second")) or 0.0) + (
        _median(_vals(w, "gpu_pcie_tx_bytes_per_second")) or 0.0)
    mem = _vals(w, "gpu_memory_used_bytes")
    busiest = max((p.thread_cpu_max_ratio or 0.0 for p in w.processes), default=None)
    cpu_known = busiest is not None and any(p.thread_cpu_max_ratio is not None for p in w.processes)
    base: dict[str, Any] = {"sm_active": sm, "nvml_utilization": util, "tensor_active": tensor,
                            "dram_active": dram, "pcie_bytes_per_s": pcie, "window_s": t1 - t0}
    if cpu_known:
        base["busiest_cpu_thread"] = busiest
    host = hostside.busiest(w.processes, th)  # the process most busy on the host, if one is
    main = _main_user(w, th, sm, util)  # a time-sliced GPU's main user, whose turns keep its SMs busy
    if host is not None and hostside.spread_busy(host, th) and sm is not None and sm < th.sm_busy and main is None:
        base.update({k: v for k, v in hostside.evidence(host).items() if k != "pid"})
    if sm is not None and sm < th.sm_busy and main is None and timeslice.unread(w, util, th):
        # Shared in turns, its time full, but most of it no process's on record yet: who holds the GPU, and so
        # what limits it, is not known until the next per-process read (a job starting, as above).
        return _side(w, th, make)
    if lead_s or tail_s:
        base["left_out_idle_s"] = {"start": round(lead_s, 1), "end": round(tail_s, 1)}
    out: list[Any] = []

    if any(p.profile_error for p in w.processes):
        base["stack_sampling"] = next(p.profile_error for p in w.processes if p.profile_error)
    if sm is None:  # no GPM: NVML utilization alone cannot name a bottleneck
        out.append(make("underutilized" if (util or 0) < th.sm_busy else "healthy", "info", 0.2,
                        f"GPU {w.gpu}: only NVML utilization ({_pct(util)}) is available here (no GPM); it "
                        "counts any kernel or copy as busy and cannot tell what limits the GPU.", base))
    elif sm >= th.sm_busy:
        out.append(_busy_verdict(w, th, make, base, sm, tensor, dram, fp32, fp16, fp64))
    elif main is not None:
        out.append(_time_sliced_verdict(w, th, make, base, main, sm, util, tensor, dram, fp32, fp16, fp64))
    else:
        out.append(_low_sm_verdict(w, th, make, base, sm, util, pcie, mem, busiest, cpu_known, host))

    from . import driverapi  # what the eBPF probes' driver calls say of the process the GPU waits on

    found = driverapi.of_window(w.processes, th)
    if found is not None and out:
        driverapi.sharpen(out[0], found[1], th, lambda k: advice.fixes(k, advice.frameworks_of(w.processes)))
    out.extend(_side(w, th, make))
    return out


def _busy_verdict(w: Any, th: Thresholds, make: Any, base: dict[str, Any], sm: float, tensor: float | None,
                  dram: float | None, fp32: float, fp16: float, fp64: float) -> Any:
    """The primary verdict of a GPU whose SMs are busy: which pipe or memory limits it, or none."""
    pipes = (tensor or 0.0) + fp32 + fp16 + fp64
    if dram is not None and dram >= th.dram_bound:
        return make("memory_bound", "info", min(1.0, 0.6 + (dram - th.dram_bound)),
                        f"GPU {w.gpu} is memory-bandwidth-bound: DRAM at {_pct(dram)} of its peak with SMs "
                        f"{_pct(sm)} busy and tensor pipes at {_pct(tensor)}.", base)
    elif tensor is not None and tensor >= 0.6:
        return make("compute_bound", "info", 0.9,
                        f"GPU {w.gpu} is compute-bound on the tensor cores ({_pct(tensor)}), SMs {_pct(sm)} "
                        "busy: well used.", base)
    elif (tensor or 0.0) < th.tensor_unused and fp32 + fp16 >= th.fp_pipes_busy:
        return make("tensor_cores_unused", "warning", 0.8,
                        f"GPU {w.gpu} does its math on the FP32/FP16 pipes ({_pct(fp32 + fp16)}) while the "
                        f"tensor cores idle ({_pct(tensor)}).", {**base, "fp32_active": fp32, "fp16_active": fp16})
    elif pipes < th.pipes_low and (dram or 0.0) < th.dram_low:
        return make("memory_access_bound", "warning", 0.6,
                        f"GPU {w.gpu}: SMs {_pct(sm)} busy, yet math pipes ({_pct(pipes)}) and DRAM "
                        f"({_pct(dram)}) are both low: kernels stall on memory access.", base)
    else:
        return make("healthy", "info", 0.8,
                        f"GPU {w.gpu} is well used: SMs {_pct(sm)} busy, tensor {_pct(tensor)}, DRAM "
                        f"{_pct(dram)}.", base)


def _main_user(w: Any, th: Thresholds, sm: float | None, util: float | None) -> Any:
    """The main user of a GPU shared in turns (timeslice.main_user) whose turns keep the SMs busy, where the GPU's
    SMs in all are not; None otherwise."""
    if sm is None or sm >= th.sm_busy:
        return None
    main = timeslice.main_user(w, util, th)
    if main is None or (timeslice.over_turns(sm, main.utilization_ratio * th.timeslice_turn_scale) or 0.0) < th.sm_busy:
        return None
    return main


def _time_sliced_verdict(w: Any, th: Thresholds, make: Any, base: dict[str, Any], main: Any, sm: float,
                         util: float | None, tensor: float | None, dram: float | None, fp32: float, fp16: float,
                         fp64: float) -> Any:
    """The primary verdict of a GPU its processes take turns on, its time full: the busy verdict of its main
    user's turns (the GPU's figures over its share of the time), which says that contention between the
    processes, not a host, leaves the SMs partly idle in all."""
    share = main.utilization_ratio
    figures = (("sm", sm), ("tensor", tensor), ("dram", dram), ("fp32", fp32), ("fp16", fp16), ("fp64", fp64))
    on = {k: timeslice.over_turns(x, share) for k, x in figures}  # what the evidence says
    # what the busy rules judge: the turns as the part of its share its kernels ran (th.timeslice_turn_scale)
    judged = {k: timeslice.over_turns(x, share * th.timeslice_turn_scale) for k, x in figures}
    takers = timeslice.turn_takers(w, th)
    ev = {**base, "time_sliced_by": len(takers), "main_pid": main.pid, "main_time_share": share,
          "main_sm_active": on["sm"], "main_tensor_active": on["tensor"], "main_dram_active": on["dram"],
          "main_fp_active": round(min(1.0, (on["fp32"] or 0.0) + (on["fp16"] or 0.0)), 4)}
    v = _busy_verdict(w, th, make, ev, judged["sm"] or 0.0, judged["tensor"], judged["dram"], judged["fp32"] or 0.0,
                      judged["fp16"] or 0.0, judged["fp64"] or 0.0)
    v.evidence.pop("fp32_active", None)  # tensor_cores_unused's, judged: main_fp_active says it
    v.evidence.pop("fp16_active", None)
    v.confidence = round(v.confidence * 0.8, 2)  # the turns' figures are estimates (an upper bound per pipe)
    v.summary = (f"GPU {w.gpu} is time-sliced between {len(takers)} processes with work on it (NVML utilization "
                 f"{_pct(util)}: a kernel ran all the time; SMs {_pct(sm)} busy in all, tensor pipes {_pct(tensor)}). "
                 f"Process {main.pid} ({main.name or '?'}) holds it {share * 100:.0f} % of the time, and over its "
                 f"turns it is {timeslice.turns_words(v.kind, v.evidence)}: the other turns, not a host, leave the "
                 "SMs idle the rest of the time.")
    return v


def _low_sm_verdict(w: Any, th: Thresholds, make: Any, base: dict[str, Any], sm: float, util: float | None,
                    pcie: float, mem: list[float], busiest: float | None, cpu_known: bool, host: Any = None) -> Any:
    """The primary verdict of a GPU whose SMs are mostly idle: what it waits for (input, transfers, its host
    side), or that it is idle, idle with memory held, or underused. `host` is its process most busy on the host
    (hostside.busiest), if one is: a GPU held by a process busy on the CPU is never idle."""
    sm_all = _vals(w, "gpu_sm_active_ratio")
    t0, t1 = w.times[0], w.times[-1]
    idle_share = sum(1 for v in sm_all if v < th.sm_idle) / len(sm_all)
    p90 = _q(sm_all, 0.9) or 0.0
    held = mem[-1] if mem else 0.0
    bursts = _runs([v >= th.burst_sm for v in sm_all])
    utils = _vals(w, "gpu_utilization_ratio")
    gap_flags = [v < th.gap_util for v in utils]
    gaps, gap_share = _runs(gap_flags), (sum(gap_flags) / len(utils) if utils else 0.0)
    step_s = (t1 - t0) / max(1, len(w.times) - 1)
    mean_gap_s = sum(gap_flags) * step_s / gaps if gaps else 0.0
    saturated = cpu_known and busiest >= th.thread_saturated
    # Busy on the host over several threads, none saturated (a runtime dispatching from several threads).
    spread = host is not None and hostside.spread_busy(host, th) and not saturated
    waits_on = (f"a process thread runs at {_pct(busiest)} of a core" if not spread
                else f"its process keeps {hostside.describe(host)}")
    intermittent = (gaps >= th.min_bursts and gap_share >= th.gap_share
                    and _runs([v >= th.util_active for v in utils]) >= th.min_bursts
                    and (saturated or mean_gap_s <= 1.0))
    prof = _profile_of(w, th)
    if idle_share >= th.idle_share and p90 >= th.burst_sm and bursts >= th.min_bursts:
        return make("input_starved", "warning", 0.7,
                        f"GPU {w.gpu} works in bursts (SMs idle {idle_share * 100:.0f} % of the time, "
                        f"{_pct(p90)} busy in {bursts} bursts): it waits for input.",
                        {**base, "idle_share": idle_share, "sm_active_p90": p90, "bursts": bursts})
    elif pcie >= th.pcie_busy_bytes_per_s and sm < th.sm_idle:
        pageable = pcie < th.pcie_pageable_below_bytes_per_s and cpu_known and busiest >= th.thread_saturated
        return make("transfer_bound", "warning", 0.8,
                        f"GPU {w.gpu} is transfer-bound: PCIe moves {pcie / 1e9:.1f} GB/s while the SMs are "
                        f"{_pct(sm)} busy (NVML 'utilization' says {_pct(util)})"
                        + ("; the rate and a saturated CPU thread point to pageable (unpinned) memory."
                           if pageable else "."), {**base, "pageable_likely": pageable})
    elif (saturated or spread) and prof is not None:
        return _host_verdict(w, prof, base, sm, util, busiest, th, make,
                             head=None if not spread else f"GPU {w.gpu} waits on its process's CPU threads (SMs "
                             f"{_pct(sm)} busy, {hostside.describe(host)})")
    elif intermittent:
        # The GPU stops completely, again and again, between short bursts of real work: it is fed
        # too slowly. Steady small work (launch- or sync-bound) never leaves it fully idle.
        return make("input_starved", "warning", 0.7 if saturated else 0.5,
                        f"GPU {w.gpu} works intermittently: fully idle in {gap_share * 100:.0f} % of the samples "
                        f"({gaps} gaps of {mean_gap_s:.1f} s on average), SMs {_pct(sm)} busy overall"
                        + (f", while its process's busiest thread runs at {_pct(busiest)} of a core: the host "
                           "side (data loading, preprocessing) is too slow." if saturated
                           else ": it waits for input."),
                        {**base, "idle_gap_share": gap_share, "idle_gaps": gaps, "mean_gap_s": mean_gap_s})
    elif (util or 0.0) >= th.util_active and (saturated or spread):
        return make("launch_or_sync_bound", "warning", 0.7,
                        f"GPU {w.gpu} waits on the CPU: SMs {_pct(sm)} busy while {waits_on}"
                        + (" and kernels are tiny (launch-bound likely)" if sm < 0.02 else "")
                        + ". Launches, synchronisations or data preparation: the thread's stacks tell which"
                        + (f" ({base['stack_sampling']})" if "stack_sampling" in base else "") + ".", base)
    elif host is not None and hostside.spread_busy(host, th):
        # Held by a process busy on the CPU: it launches work too small to show (NVML's utilization counts any
        # kernel) or computes something else meanwhile; the GPU waits on it either way, and is not idle.
        launching = (util or 0.0) > 0.0
        return make("launch_or_sync_bound" if launching else "host_bound", "warning", 0.6 if launching else 0.5,
                    f"GPU {w.gpu} waits on its process's CPU: SMs {_pct(sm)} busy (NVML 'utilization' {_pct(util)}) "
                    f"while it keeps {hostside.describe(host)}"
                    + (": it dispatches work too small to fill the GPU, or waits on synchronisations; the "
                       "threads' stacks tell which" + (f" ({base['stack_sampling']})" if "stack_sampling" in base
                                                       else "") + "."
                       if launching else ": it runs no GPU work meanwhile; the host does something else."), base)
    elif held >= th.held_bytes and (util or 0.0) < 0.02 and sm < 0.01:
        held_s = _held_for(w, held)
        if held_s < th.min_window_s:  # memory still arriving: a program setting up, not a reservation
            return make("idle", "info", 0.6,
                            f"GPU {w.gpu} is idle while its memory grows to {held / 2**30:.1f} GiB: a program "
                            "is setting up.", {**base, "memory_held_bytes": held})
        else:
            pods = _pods_of(w)
            return make("idle_allocated", "warning", 0.9,
                            f"GPU {w.gpu} holds {held / 2**30:.1f} GiB with nothing running (SMs {_pct(sm)})"
                            + (f", allocated to pod{'s' if len(pods) > 1 else ''} {', '.join(pods)}." if pods else "."),
                            {**base, "memory_held_bytes": held, "held_for_s": held_s, **({"pods": pods} if pods else {})})
    elif sm < th.sm_idle and (util or 0.0) < th.util_active:
        return make("idle", "info", 0.9, f"GPU {w.gpu} is idle.", base)
    else:
        return make("underutilized", "warning", 0.4,
                        f"GPU {w.gpu} is underused: SMs {_pct(sm)} busy (NVML 'utilization' {_pct(util)}).",
                        base)


def _pods_of(w: Any) -> list[str]:
    """The pods (namespace/pod) that hold the GPU: the kubelet's holders, else the pods its processes run in."""
    held = sorted({f"{h.namespace}/{h.pod}" for h in getattr(w, "pods", [])})
    return held or sorted({f"{p.namespace}/{p.pod}" if p.namespace else p.pod
                           for p in w.processes if getattr(p, "pod", "")})


def _profile_of(w: Any, th: Thresholds) -> Any:
    """The stack profile of the busiest process of the window, if one was taken and says enough."""
    profs = [p for p in w.processes if getattr(p, "profile", None) is not None]
    profs.sort(key=lambda p: (-(p.thread_cpu_max_ratio or 0.0), -(p.cpu_cores or 0.0)))
    return profs[0].profile if profs and profs[0].profile.samples >= th.stack_min_samples else None


def _host_verdict(w: Any, prof: Any, base: dict[str, Any], sm: float, util: float | None, busiest: float,
                  th: Thresholds, make: Any, head: str | None = None) -> Any:
    """The GPU waits on its process's busy host side, and its stacks say what the threads do. `head` opens the
    summary (what waits on what); by default the GPU on its process's busiest thread."""
    sh = prof.shares
    ev = {**base, **prof.as_evidence()}
    head = head or (f"GPU {w.gpu} waits on its process's CPU thread (SMs {_pct(sm)} busy, the thread at "
                    f"{_pct(busiest)} of a core)")
    if sh["data"] >= th.stack_data and prof.dominant() == "data":
        return make("input_starved", "warning", 0.85,
                    f"{head}: {sh['data'] * 100:.0f} % of its time goes to preparing data, at {prof.where('data')}.",
                    ev)
    if sh["sync"] >= th.stack_sync:
        return make("sync_bound", "warning", 0.8,
                    f"{head}: it waits for the GPU {sh['sync'] * 100:.0f} % of its time, at {prof.where('sync')}, "
                    "so GPU and host take turns instead of overlapping.", ev)
    if sh["launch"] >= th.stack_launch:
        tiny = util is not None and util > 0 and sm / util < 0.1
        return make("launch_bound", "warning", 0.8,
                    f"{head}: {sh['launch'] * 100:.0f} % of its time goes to issuing GPU work, at "
                    f"{prof.where('launch')}" + (", and the kernels are tiny." if tiny else "."), ev)
    top = prof.dominant()
    return make("host_bound", "warning", 0.6,
                f"{head}: its time goes mostly to {top} work, at {prof.where(top)}.", ev)


def _side(w: Any, th: Thresholds, make: Any) -> list[Any]:
    out = []
    masks = [int(v) for v in _vals(w, "gpu_clock_event_reasons")]
    if masks:
        slow = sum(1 for m in masks if set(decode_clock_event_reasons(m)) & set(SLOWDOWN_REASONS)) / len(masks)
        capped = sum(1 for m in masks if "sw_power_cap" in decode_clock_event_reasons(m)) / len(masks)
        clock = _median(_vals(w, "gpu_sm_clock_hertz"))
        lost = 1 - clock / w.sm_clock_max_hertz if clock and w.sm_clock_max_hertz else None
        ev = {"share_of_window": slow, "sm_clock_hertz": clock, "clock_lost": lost}
        if slow >= th.throttle_share:
            reasons = sorted({r for m in masks for r in decode_clock_event_reasons(m) if r in SLOWDOWN_REASONS})
            out.append(make("throttled", "warning", 0.9,
                            f"GPU {w.gpu} is throttled by {', '.join(reasons)} {slow * 100:.0f} % of the time"
                            + (f", SM clock {lost * 100:.0f} % below its maximum." if lost is not None else "."),
                            {**ev, "reasons": reasons}, primary=False))
        elif capped >= 0.5:
            out.append(make("power_capped", "info", 0.9,
                            f"GPU {w.gpu} runs at its power limit {capped * 100:.0f} % of the time"
                            + (f" (SM clock {lost * 100:.0f} % below max)." if lost is not None else "."),
                            {**ev, "share_of_window": capped}, primary=False))
    mem = [(t, v) for t, v in zip(w.times, w.series.get("gpu_memory_used_bytes", []), strict=False) if v is not None]
    if len(mem) >= th.min_samples and w.memory_total_bytes:
        fit = _linear(mem)
        if fit is not None:
            slope, r2 = fit
            grown = mem[-1][1] - mem[0][1]
            if slope > 0 and r2 >= th.growth_r2 and grown >= th.growth_min_bytes:
                tto = (w.memory_total_bytes - mem[-1][1]) / slope
                if tto <= th.oom_horizon_s:
                    out.append(make("memory_growth", "warning", min(1.0, r2),
                                    f"GPU {w.gpu} memory grows {slope / 2**20:.0f} MiB/s: out of memory in about "
                                    f"{tto / 60:.0f} min at this rate.",
                                    {"bytes_per_s": slope, "r2": r2, "time_to_oom_s": tto, "used_bytes": mem[-1][1]},
                                    primary=False))
    xids = [e for e in w.events if e.kind == "xid"]
    ecc = _vals(w, "gpu_ecc_uncorrected_errors_total")
    pending = _vals(w, "gpu_row_remap_pending") + _vals(w, "gpu_row_remap_failure")
    if xids or (len(ecc) >= 2 and ecc[-1] > ecc[0]) or any(v > 0 for v in pending):
        codes = sorted({e.data.get("xid") for e in xids if e.data.get("xid") is not None})
        out.append(make("hardware", "critical", 1.0,
                        f"GPU {w.gpu} reports hardware errors: " + ", ".join(
                            [f"{sum(e.count for e in xids)} XID event(s) ({', '.join(map(str, codes))})"] if xids else []
                            + (["uncorrected ECC errors"] if len(ecc) >= 2 and ecc[-1] > ecc[0] else [])
                            + (["row remapping pending or failed"] if any(v > 0 for v in pending) else [])) + ".",
                        {"xids": codes, "xid_events": sum(e.count for e in xids)}, primary=False))
    return out


def _linear(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    sxx = sum((t - mx) ** 2 for t, _ in points)
    syy = sum((v - my) ** 2 for _, v in points)
    if sxx == 0 or syy == 0:
        return None
    sxy = sum((t - mx) * (v - my) for t, v in points)
    return sxy / sxx, (sxy * sxy) / (sxx * syy)


def _job(w: Any) -> str:
    """What a GPU runs, with numbers removed so that ranks of one job (--local-rank 3, --gpu 3) match."""
    return "".join(c for c in (w.processes[0].cmdline or w.processes[0].name) if not c.isdigit()) if w.processes else ""


def node_verdicts(windows: list[Any], verdicts: list[Any], th: Thresholds, verdict: Any) -> list[Any]:
    """A straggler among GPUs that run the same job (same command line but for rank numbers)."""
    out = []
    jobs: dict[str, list[Any]] = {}
    for w in windows:
        if w.healthy and w.processes:
            jobs.setdefault(_job(w), []).append(w)
    for peers in jobs.values():
        out.extend(_imbalance(peers, verdict, th))
    return out


K = TypeVar("K")


def imbalanced(busy: Mapping[K, float], th: Thresholds) -> tuple[K, K] | None:
    """(the least busy, the busiest) of the GPUs of one job, by SM activity (0..1), when the busiest does real
    work (th.imbalance_busy) and the least busy is th.imbalance_gap below it; None otherwise. The node's
    imbalance verdict asks it of one node's GPUs, gpuscope.fleet's straggler finder of a job's across nodes.

    >>> imbalanced({"a": 0.9, "b": 0.85, "c": 0.2}, Thresholds()), imbalanced({"a": 0.9, "b": 0.7}, Thresholds())
    (('c', 'a'), None)
    """
    if len(busy) < 2:
        return None
    top = max(busy, key=busy.__getitem__)
    low = min(busy, key=busy.__getitem__)
    if busy[top] >= th.imbalance_busy and busy[top] - busy[low] >= th.imbalance_gap:
        return low, top
    return None


def _imbalance(windows: list[Any], verdict: Any, th: Thresholds) -> list[Any]:
    busy = {i: sm for i, w in enumerate(windows) if (sm := _median(_vals(w, "gpu_sm_active_ratio"))) is not None}
    pair = imbalanced(busy, th)
    if pair is None:
        return []
    (w, low), (peer, top) = ((windows[i], busy[i]) for i in pair)
    return [verdict(w.gpu, "imbalance", "warning", 0.6,
                    f"GPU {w.gpu} is {_pct(low)} busy while GPU {peer.gpu} is {_pct(top)}: a straggler "
                    "or uneven work across GPUs.", {"sm_active": low, "peer_sm_active": top, "peer": peer.gpu},
                    advice.fixes("imbalance", advice.frameworks_of(w.processes)), w.times[0] if w.times else 0.0, w.times[-1] if w.times else 0.0, False)]
