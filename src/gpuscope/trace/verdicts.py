"""A trace's verdicts: each GPU's bottleneck, decided from what the trace shows kernel by kernel.

The metrics alone can say that a GPU waits on a saturated CPU thread (`launch_or_sync_bound`), not
why. A trace can: it holds every sync with the line that called it and the GPU idle after it, every
launch with the kernel it queued, and the host's Python stack at any moment the GPU sat idle. So the
host-bound kinds (sync-bound, launch-bound, input-starved, host-bound) and transfer-bound become
certain here, while compute- versus memory-bound stays the metrics' call (a trace has no counters).
One exception: matrix math on the CUDA cores instead of the tensor cores (`tensor_cores_unused`) shows
in the kernels' names.

    >>> from gpuscope.trace import load
    >>> for v in verdicts(load("tests/fixtures/traces/sync_heavy.pt.trace.json.gz")):
    ...     print(v.gpu, v.kind, v.confidence)
    0 sync_bound 0.95

`refine(metric_verdicts, trace_verdicts)` puts them into a metrics diagnosis (`gpuscope diagnose
--trace`). Thresholds: `gpuscope.trace.rule_thresholds` (the verdicts section).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from ..diagnose import HOST_BOUND, Verdict, advice
from ..diagnose.stacks import classify_profiler_frames
from .analyze import SYNC_CALLS, Report, _merge, analyze
from .model import GPU_KINDS, EventKind, Trace
from .rule_thresholds import DEFAULT, RuleThresholds
from .rules import Finding, findings, trace_frameworks
from .stacks import Location, Stacks, is_user_file

# Kernels that do matrix math (cuBLAS, cuBLASLt's nvjet, CUTLASS, cuDNN convolutions, attention): the
# work that keeps the tensor cores busy when the GPU is.
_GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|hmma|wgmma|conv|wgrad|dgrad|fprop|matmul|flash|fmha|attention",
                   re.IGNORECASE)
_ELEMENTWISE = re.compile(r"elementwise|reduce_kernel|vectorized|unrolled", re.IGNORECASE)
_SYNC_RUNTIME = re.compile(r"^(cudaMemcpy|cuMemcpy)(?!.*Async)")
#: What the host was doing at a moment the GPU was idle -> the verdict it makes.
_KIND_OF = {"data": "input_starved", "sync": "sync_bound", "launch": "launch_bound", "other": "host_bound"}
#: Metrics verdicts a trace may replace: the GPU waits and the counters cannot say on what.
REFINABLE = HOST_BOUND | {"underutilized"}
_EXPLAINS_IDLE = HOST_BOUND | {"transfer_bound"}


def verdicts(trace: Trace, report: Report | None = None, found: list[Finding] | None = None,
             thresholds: RuleThresholds = DEFAULT) -> list[Verdict]:
    """One primary verdict per GPU device in the trace (its `gpu` is the device index the process saw)."""
    report = report if report is not None else analyze(trace)
    found = found if found is not None else findings(trace, thresholds)
    stacks = Stacks(trace)
    ev = trace.events
    gpu_rows = np.flatnonzero(np.isin(ev["kind"], GPU_KINDS))
    out = []
    for t in report.temporal:
        rows = gpu_rows[ev["device"][gpu_rows] == t.device]
        out.append(_device_verdict(_Device(trace, stacks, rows, t, report, thresholds), found))
    return out


class _Device:
    """One GPU's numbers from the trace: span, idle, copies, kernels, launch cost, the launching threads."""

    def __init__(self, trace: Trace, stacks: Stacks, rows: np.ndarray, temporal: Any, report: Report,
                 th: RuleThresholds) -> None:
        ev = trace.events
        self.trace, self.stacks, self.th, self.device = trace, stacks, th, temporal.device
        self.span_s = temporal.span_ns / 1e9
        self.idle_share, self.compute_share = temporal.idle_ratio, temporal.compute_ratio
        copies = rows[ev["kind"][rows] == EventKind.MEMCPY]
        cs, ce = _merge(ev["ts_ns"][copies], ev["dur_ns"][copies])
        self.copy_share = float((ce - cs).sum()) / temporal.span_ns if temporal.span_ns else 0.0
        pageable = np.array(["Pageable" in trace.name_of(int(r)) for r in copies], dtype=bool)
        copy_ns = float(ev["dur_ns"][copies].sum())
        self.pageable_share = float(ev["dur_ns"][copies[pageable]].sum()) / copy_ns if copy_ns else 0.0
        self.copy_bytes = int(ev["bytes"][copies].clip(0).sum())
        self.copy_gb_per_s = self.copy_bytes / copy_ns if copy_ns else 0.0  # bytes/ns = GB/s
        kernels = rows[ev["kind"][rows] == EventKind.KERNEL]
        kernel_ns = ev["dur_ns"][kernels]
        ids, which = np.unique(ev["name"][kernels], return_inverse=True)
        ns_per_name = np.bincount(which, weights=kernel_ns, minlength=len(ids))
        total = float(kernel_ns.sum()) or 1.0
        self.gemm_share, self.elementwise_share = (
            sum(ns for i, ns in zip(ids.tolist(), ns_per_name.tolist(), strict=True)
                if pattern.search(trace.names[i])) / total for pattern in (_GEMM, _ELEMENTWISE))
        self.kernels = len(kernels)
        self.kernels_per_s = len(kernels) / self.span_s if self.span_s else 0.0
        self.median_kernel_us = float(np.median(kernel_ns)) / 1e3 if len(kernels) else None
        launchers = np.array([stacks.launcher(int(r)) for r in rows], dtype=np.int64)
        launched = launchers[launchers >= 0]
        self.median_launch_us = float(np.median(ev["dur_ns"][launched])) / 1e3 if len(launched) else None
        threads = Counter(zip(ev["pid"][launched].tolist(), ev["tid"][launched].tolist(), strict=True))
        self.threads = [t for t, _ in threads.most_common()]
        self.pid = self.threads[0][0] if self.threads else None
        mine = [i for i in report.idle if i.device == self.device]
        idle_ns = sum(i.idle_ns for i in mine)
        self.host_wait_share = sum(i.host_wait_ns for i in mine) / idle_ns if idle_ns else 0.0
        starts, ends = _merge(ev["ts_ns"][rows], ev["dur_ns"][rows])
        self.gaps = [(int(e), int(s)) for e, s in zip(ends[:-1], starts[1:], strict=True)
                     if s - e >= th.gap_min_s * 1e9]

    def evidence(self) -> dict[str, Any]:
        return {"trace": self.trace.source, "pid": self.pid, "device": self.device,
                "active_span_s": round(self.span_s, 6), "gpu_idle_share": round(self.idle_share, 4),
                "compute_share": round(self.compute_share, 4), "copy_share": round(self.copy_share, 4),
                "kernels_per_s": round(self.kernels_per_s, 1),
                "median_kernel_us": _round(self.median_kernel_us), "median_launch_us": _round(self.median_launch_us),
                "idle_host_wait_share": round(self.host_wait_share, 4)}

    def host_in_gaps(self) -> tuple[dict[str, float], dict[str, Counter[Location]]]:
        """What the launching threads did at `idle_samples` moments spread evenly over the GPU's idle
        time: shares of data / sync / launch / other / untraced, and the lines of each."""
        counts: Counter[str] = Counter()
        lines: dict[str, Counter[Location]] = {}
        total_ns = sum(s - e for e, s in self.gaps)
        if not total_ns or not self.threads:
            return {}, {}
        finder = _Innermost(self.trace, self.stacks, self.threads)
        step = total_ns / self.th.idle_samples
        at, done = step / 2, 0
        for e, s in self.gaps:
            while at < done + (s - e):
                row = finder.at(int(e + at - done))
                kind = self._kind(row)
                counts[kind] += 1
                loc = self.stacks.location(row)
                if loc is not None:
                    lines.setdefault(kind, Counter())[loc] += 1
                at += step
            done += s - e
        n = sum(counts.values())
        return {k: c / n for k, c in counts.items()}, lines

    def _kind(self, row: int) -> str:
        if row < 0:
            return "untraced"
        chain = self.stacks.chain(row)
        kinds = self.trace.events["kind"]
        names = [self.trace.name_of(r) for r in chain]
        if any(kinds[r] in (EventKind.RUNTIME, EventKind.DRIVER) and (n in SYNC_CALLS or _SYNC_RUNTIME.match(n))
               for r, n in zip(chain, names, strict=True)):
            return "sync"
        python = [n for r, n in zip(chain, names, strict=True) if kinds[r] == EventKind.PYTHON]
        kind = classify_profiler_frames(python, is_user_file) if python else "other"
        if kind == "other" and any(kinds[r] in (EventKind.CPU_OP, EventKind.RUNTIME, EventKind.DRIVER) for r in chain):
            return "launch"  # a PyTorch op or CUDA call below plain Python: issuing GPU work
        return kind if python else "untraced"


class _Innermost:
    """The innermost host event of the first launching thread that is in traced code at a moment."""

    def __init__(self, trace: Trace, stacks: Stacks, threads: list[tuple[int, int]]) -> None:
        ev = trace.events
        host = (ev["device"] == -1) & np.isin(ev["kind"], (EventKind.PYTHON, EventKind.CPU_OP, EventKind.RUNTIME,
                                                           EventKind.DRIVER, EventKind.ANNOTATION))
        self.ev, self.stacks = ev, stacks
        self.rows = [np.flatnonzero(host & (ev["pid"] == p) & (ev["tid"] == t)) for p, t in threads]

    def at(self, t_ns: int) -> int:
        first = -1
        for rows in self.rows:
            i = int(np.searchsorted(self.ev["ts_ns"][rows], t_ns, side="right")) - 1
            row = int(rows[i]) if i >= 0 else -1
            while row >= 0 and int(self.ev["ts_ns"][row] + self.ev["dur_ns"][row]) <= t_ns:
                row = int(self.stacks.parent[row])
            # The autograd thread launches much but runs no Python; the thread in Python code is the one
            # whose work the GPU waits for.
            if row >= 0 and any(self.ev["kind"][r] == EventKind.PYTHON for r in self.stacks.chain(row)):
                return row
            first = row if first < 0 else first
        return first


def _device_verdict(d: _Device, found: list[Finding]) -> Verdict:
    th, ev = d.th, d.evidence()
    gpu = str(d.device)
    head = f"GPU {gpu} (trace of process {d.pid})"
    frameworks = trace_frameworks(d.trace)

    def make(kind: str, confidence: float, summary: str, extra: dict[str, Any], recs: list[str],
             severity: str = "warning") -> Verdict:
        sure = " (certain: from the trace)" if confidence >= 0.9 else ""
        return Verdict(gpu, kind, severity, confidence, f"{head} is {kind.replace('_', '-')}{sure}: {summary}",
                       {**ev, **extra}, recs or advice.fixes(kind, frameworks))

    rule = {f.rule: f for f in found}
    if d.copy_share >= th.transfer_min_share and d.copy_share > d.compute_share:
        pageable = d.pageable_share >= th.transfer_pageable_share
        f = rule.get("pageable_memcpy") if pageable else rule.get("sync_memcpy")
        where = _line(f)
        return make("transfer_bound", 0.95,
                    f"copies keep it busy {d.copy_share:.0%} of its active span ({d.copy_bytes / 2**20:.0f} MiB at "
                    f"{d.copy_gb_per_s:.1f} GB/s), kernels only {d.compute_share:.0%}"
                    + (f"; {d.pageable_share:.0%} of the copy time is from pageable (unpinned) host memory"
                       if pageable else "") + (f", from {where}." if where else "."),
                    {"pageable": pageable, "pageable_copy_share": round(d.pageable_share, 4),
                     "copy_bytes": d.copy_bytes, "copy_gb_per_s": round(d.copy_gb_per_s, 2), "line": where},
                    [f.fix] if f else [])
    if d.idle_share <= th.busy_max_idle_share:
        counters = ("A trace has no hardware counters: whether the kernels are limited by the tensor cores or "
                    "by DRAM bandwidth is for `gpuscope diagnose` on the metrics to say.")
        extra = {"gemm_kernel_share": round(d.gemm_share, 4), "elementwise_kernel_share": round(d.elementwise_share, 4),
                 "note": counters}
        simt = rule.get("tensor_cores_unused")
        if simt is not None and simt.evidence["kernel_time_share"] >= th.cause_min_share:
            e = simt.evidence
            return make("tensor_cores_unused", 0.9,
                        f"busy {1 - d.idle_share:.0%} of its active span, {e['kernel_time_share']:.0%} of the kernel "
                        f"time in {e['precision'].upper()} matrix-multiply / convolution kernels on the CUDA cores, "
                        "not the tensor cores (told by the kernels' names)"
                        + (f", from {_line(simt)}." if _line(simt) else "."),
                        {**extra, "simt_kernel_share": round(e["kernel_time_share"], 4), "line": _line(simt)},
                        [simt.fix])
        if d.gemm_share >= th.gemm_min_share:
            return make("compute_bound", 0.8,
                        f"busy {1 - d.idle_share:.0%} of its active span, {d.gemm_share:.0%} of the kernel time in "
                        "matrix-multiply / convolution kernels: the host keeps it fed. " + counters, extra, [], "info")
        kinds = (f"{d.elementwise_share:.0%} of the kernel time in elementwise / reduction kernels, which are "
                 "usually limited by memory bandwidth" if d.elementwise_share >= th.cause_min_share
                 else f"{d.gemm_share:.0%} of the kernel time in matrix math")
        return Verdict(gpu, "healthy", "info", 0.8,
                       f"{head} is busy {1 - d.idle_share:.0%} of its active span ({kinds}): the host keeps it fed, "
                       "nothing on the host side to fix. " + counters, {**ev, **extra}, advice.fixes("healthy", frameworks))
    waiting = d.idle_share >= th.gap_idle_share
    idle = f"idle {d.idle_share:.0%} of its active span"
    syncs = [f for f in found if f.rule == "sync_in_loop"]
    sync_idle_s = sum(f.evidence["gpu_idle_after_seconds"] for f in syncs)
    idle_s = d.idle_share * d.span_s
    if syncs and idle_s and sync_idle_s / idle_s >= th.cause_min_share:
        f = max(syncs, key=lambda f: f.evidence["gpu_idle_after_seconds"])
        return make("sync_bound", 0.95 if waiting else 0.6,
                    f"{idle}, {sync_idle_s / idle_s:.0%} of that right after {f.evidence['count']} host-device syncs "
                    f"({f.evidence['per_second']:.0f}/s) from {_line(f)}, while the host worked before queueing more.",
                    {"syncs": f.evidence["count"], "syncs_per_s": round(f.evidence["per_second"], 1),
                     "idle_after_syncs_share": round(sync_idle_s / idle_s, 4), "line": _line(f)}, [f.fix])
    storm = rule.get("tiny_kernel_storm")
    if storm is not None:
        e = storm.evidence
        return make("launch_bound", 0.95 if waiting else 0.6,
                    f"{idle} between {e['tiny_kernels']} tiny kernels ({e['per_second']:.0f}/s, median "
                    f"{e['median_kernel_us']:.1f} µs each against a median {e['median_launch_us']:.1f} µs launch call) "
                    f"from {_line(storm)}: the host cannot launch them as fast as the GPU runs them.",
                    {"tiny_kernels": e["tiny_kernels"], "line": _line(storm)}, [storm.fix])
    shares, lines = d.host_in_gaps()
    gaps = rule.get("gpu_gaps")
    causes = {k: v for k, v in shares.items() if k in _KIND_OF}
    if not causes:
        return make("underutilized", 0.6,
                    f"{idle}; the trace shows no host code in the gaps (recorded without Python stacks, or the "
                    "process waited on something outside it: I/O, other processes).",
                    {"host_in_gaps": _rounded(shares)}, [gaps.fix] if gaps else [])
    top = max(causes, key=lambda k: causes[k])
    kind = _KIND_OF[top]
    top_lines = lines.get(top, Counter()).most_common(1)
    line = str(top_lines[0][0]) if top_lines else None
    what = {"data": "preparing data", "sync": "waiting for the GPU", "launch": "issuing GPU work",
            "other": "other Python work"}[top]
    sure = causes[top] >= th.cause_min_share and waiting
    return make(kind, 0.9 if sure else 0.6,
                f"{idle}, and in {causes[top]:.0%} of that time the host was {what}"
                + (f", at {line}." if line else "."),
                {"host_in_gaps": _rounded(shares), "line": line},
                advice.fixes(kind, frameworks) + ([gaps.fix] if gaps else []))


def refine(metric_verdicts: Iterable[Verdict], trace_verdicts: Iterable[Verdict],
           gpu_of_pid: Mapping[int, str] | None = None) -> list[Verdict]:
    """Metrics verdicts with what traces of the same GPUs show.

    A GPU whose metrics verdict says it waits without knowing why (launch_or_sync_bound, the host-bound
    kinds, underutilized) takes its trace's verdict when that explains an idle GPU. A trace that disagrees
    with a clear metrics verdict is added beside it as a `trace_note` (not primary): the metrics cover the
    whole window, a trace a few steps. `gpu_of_pid` maps a traced process to its GPU's label (the device
    index a process sees can differ from NVML's under CUDA_VISIBLE_DEVICES); without it, the device index.
    """
    metrics = list(metric_verdicts)
    by_gpu: dict[str, Verdict] = {}
    for v in trace_verdicts:
        gpu = (gpu_of_pid or {}).get(v.evidence.get("pid"), v.gpu)  # type: ignore[arg-type]
        by_gpu.setdefault(gpu, replace(v, gpu=gpu))
    out: list[Verdict] = []
    for m in metrics:
        t = by_gpu.pop(m.gpu, None) if m.primary else None
        if t is None:
            out.append(m)
        elif m.kind in REFINABLE and t.kind in _EXPLAINS_IDLE:
            out.append(replace(t, start_s=m.start_s, end_s=m.end_s,
                               evidence={**t.evidence, "metrics_verdict": m.kind, "metrics_summary": m.summary}))
        elif m.kind == t.kind or {m.kind, t.kind} <= {"compute_bound", "healthy", "memory_bound"}:
            out.append(m)  # the trace agrees; the counters say more about a busy GPU than a trace can
        else:
            out.append(m)
            out.append(Verdict(m.gpu, "trace_note", "info", t.confidence,
                               f"GPU {m.gpu}: a trace ({os.path.basename(str(t.evidence.get('trace', '')))}) says "
                               f"{t.kind}, unlike the metrics' {m.kind}; the metrics cover the whole window and the "
                               f"trace only its steps, so {m.kind} stands. The trace: {t.summary}",
                               {"trace_verdict": t.kind, **t.evidence}, t.recommendations, m.start_s, m.end_s,
                               primary=False))
    out.extend(by_gpu.values())  # traced GPUs the metrics had nothing on
    return out


def _line(f: Finding | None) -> str | None:
    return str(f.locations[0][0]) if f is not None and f.locations else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _rounded(shares: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}

