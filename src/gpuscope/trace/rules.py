"""Expert rules over a Trace: each finding names the cost, the line of Python responsible, and the fix.

Modelled on Nsight Systems' expert rules (pageable async memcpy, synchronous memcpy/memset, sync APIs,
GPU gaps) plus what a PyTorch trace shows that Nsight's do not: syncs repeated from one line, storms of
tiny launch-bound kernels, low-occupancy hot kernels, matrix math off the tensor cores, kernel time spent
in passes over memory (elementwise chains to fuse). Thresholds: `gpuscope.trace.rule_thresholds`.

    >>> from gpuscope.trace.kineto import load
    >>> for f in findings(load("tests/fixtures/traces/sync_heavy.pt.trace.json.gz")):
    ...     print(f.rule)
    sync_in_loop
    gpu_gaps
    low_occupancy
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..diagnose import advice
from . import tensor_cores
from .model import GPU_KINDS, EventKind, Trace
from .rule_thresholds import DEFAULT, RuleThresholds
from .stacks import Location, Stacks, frame_label

_SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cuCtxSynchronize",
               "cuStreamSynchronize", "cuEventSynchronize")
_SYNC_MEMCPY = re.compile(r"^(cudaMemcpy|cuMemcpy)(?!.*Async)")
_SYNC_MEMSET = re.compile(r"^(cudaMemset|cuMemset)(?!.*Async)")


@dataclass
class Finding:
    rule: str
    severity: str                       # "high", "medium" or "low": the cost as a share of the traced time
    summary: str                        # one sentence with the numbers
    evidence: dict[str, Any]            # counts, seconds, shares (0-1)
    locations: list[tuple[Location, int]] = field(default_factory=list)  # (line, events from it), most first
    fix: str = ""


def trace_frameworks(trace: Trace) -> tuple[str, ...]:
    """The frameworks of the traced process, for the fixes: a CUPTI trace says them (`gpuscope_cupti.frameworks`,
    from the process's own maps and modules; () in one written before it did), any other Kineto trace is the
    PyTorch profiler's."""
    cupti = trace.meta.get("gpuscope_cupti")
    if not isinstance(cupti, dict):
        return ("torch",)
    named = cupti.get("frameworks")
    return tuple(f for f in named if isinstance(f, str)) if isinstance(named, list) else ()


def findings(trace: Trace, thresholds: RuleThresholds = DEFAULT,
             source_roots: list[str] | None = None) -> list[Finding]:
    """Every rule over one trace, worst first. `source_roots`: where the traced program's files are (to
    recover calling lines; default the working directory and the trace's folder)."""
    ctx = _Context(trace, thresholds, Stacks(trace, source_roots))
    out: list[Finding] = []
    for rule in _RULES:
        out.extend(rule(ctx))
    rank = {"high": 0, "medium": 1, "low": 2}
    return sorted(out, key=lambda f: rank[f.severity])


def as_dicts(found: Iterable[Finding]) -> list[dict[str, Any]]:
    """Findings as plain JSON-ready dicts."""
    return [{"rule": f.rule, "severity": f.severity, "summary": f.summary, "evidence": f.evidence,
             "locations": [{"file": loc.file, "line": loc.line, "function": loc.function, "def_line": loc.def_line,
                            "events": n, "text": str(loc)} for loc, n in f.locations],
             "fix": f.fix} for f in found]


class _Context:
    def __init__(self, trace: Trace, th: RuleThresholds, stacks: Stacks) -> None:
        self.trace, self.th, self.stacks = trace, th, stacks
        self.frameworks = trace_frameworks(trace)
        ev = self.ev = trace.events
        timed = ev["kind"] != EventKind.OTHER
        self.traced_s = (float((ev["ts_ns"][timed] + ev["dur_ns"][timed]).max() - ev["ts_ns"][timed].min()) / 1e9
                         if timed.any() else 0.0)
        self.gpu_rows = np.flatnonzero(np.isin(ev["kind"], GPU_KINDS))
        self.busy_all = _merged(ev["ts_ns"][self.gpu_rows], ev["ts_ns"][self.gpu_rows] + ev["dur_ns"][self.gpu_rows])
        self._names = np.array(trace.names, dtype=object)

    def rows(self, *kinds: EventKind) -> np.ndarray:
        return np.flatnonzero(np.isin(self.ev["kind"], kinds))

    def named(self, rows: np.ndarray, match: Callable[[str], bool]) -> np.ndarray:
        names = self._names[self.ev["name"][rows]]
        return rows[np.fromiter((match(n) for n in names), dtype=bool, count=len(rows))]

    def share(self, seconds: float) -> float:
        return seconds / self.traced_s if self.traced_s > 0 else 0.0

    def severity(self, seconds: float) -> str:
        s = self.share(seconds)
        return "high" if s >= self.th.high_share else "medium" if s >= self.th.medium_share else "low"

    def locations(self, host_rows: Iterable[int], top: int = 3) -> list[tuple[Location, int]]:
        """The lines responsible for these host events, by how many came from each."""
        by_function: dict[tuple[str, int, str], Counter[int]] = defaultdict(Counter)
        for r in host_rows:
            loc = self.stacks.location(int(r))
            if loc is not None:
                by_function[(loc.file, loc.def_line, loc.function)][loc.line] += 1
        # Group by function: ops with no frame of their own (x @ w) only know the function, and belong with
        # the recovered calls in it; the line shown is the most frequent recovered one.
        ranked = sorted(by_function.items(), key=lambda kv: -sum(kv[1].values()))[:top]
        out = []
        for (file, def_line, func), lines in ranked:
            recovered = [(n, ln) for ln, n in lines.items() if ln != def_line]
            line = max(recovered)[1] if recovered else def_line
            out.append((Location(file, line, func, def_line), sum(lines.values())))
        return out

    def user_op(self, row: int) -> str:
        """The outermost CPU op under the innermost Python frame enclosing `row` (what the program called)."""
        chain = self.stacks.chain(row)
        kinds = self.ev["kind"]
        last_py = max((i for i, r in enumerate(chain) if kinds[r] == EventKind.PYTHON), default=-1)
        for r in chain[last_py + 1:]:
            if kinds[r] == EventKind.CPU_OP:
                return self.trace.name_of(r)
        return self.trace.name_of(row)


def _merged(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals: sorted, non-overlapping (starts, ends)."""
    if len(start) == 0:
        return start, end
    o = np.argsort(start, kind="stable")
    s, e = start[o], np.maximum.accumulate(end[o])
    new = np.r_[True, s[1:] > e[:-1]]
    first = np.flatnonzero(new)
    return s[first], np.r_[e[first[1:] - 1], e[-1]]


def _where(locs: list[tuple[Location, int]]) -> str:
    return f", mostly from {locs[0][0]}" if locs else ""


# -- the rules -------------------------------------------------------------------------------------------


def _pageable_memcpy(ctx: _Context) -> list[Finding]:
    rows = ctx.named(ctx.rows(EventKind.MEMCPY), lambda n: "Pageable" in n)
    launchers = [ctx.stacks.launcher(int(r)) for r in rows]
    # A synchronous cudaMemcpy from pageable memory is sync_memcpy's finding, as in Nsight.
    keep = [i for i, lr in enumerate(launchers) if lr < 0 or "Async" in ctx.trace.name_of(lr)]
    rows = rows[keep]
    seconds = float(ctx.ev["dur_ns"][rows].sum()) / 1e9
    if len(rows) == 0 or ctx.share(seconds) < ctx.th.pageable_min_share:
        return []
    nbytes = int(ctx.ev["bytes"][rows].clip(0).sum())
    kinds = Counter(ctx.trace.name_of(int(r)) for r in rows)
    locs = ctx.locations(launchers[i] for i in keep if launchers[i] >= 0)
    gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return [Finding(
        "pageable_memcpy", ctx.severity(seconds),
        f"{len(rows)} copies between the GPU and pageable host memory moved {nbytes / 2**20:.0f} MiB at "
        f"{gbps:.1f} GB/s and took {seconds * 1e3:.1f} ms ({ctx.share(seconds):.0%} of the traced time){_where(locs)}.",
        {"count": len(rows), "bytes": nbytes, "seconds": seconds, "share": ctx.share(seconds),
         "bandwidth_gb_per_s": gbps, "kinds": dict(kinds)},
        locs,
        advice.rule_fix("pageable_memcpy", ctx.frameworks))]


def _sync_transfers(ctx: _Context, rule: str, pattern: re.Pattern[str], what: str) -> list[Finding]:
    calls = ctx.named(ctx.rows(EventKind.RUNTIME, EventKind.DRIVER), lambda n: bool(pattern.match(n)))
    ops = ctx.rows(EventKind.MEMCPY, EventKind.MEMSET)
    op_of = dict(zip(ctx.ev["correlation"][ops].tolist(), ops.tolist(), strict=True))
    kept = []
    for r in calls.tolist():
        op = op_of.get(int(ctx.ev["correlation"][r]), -1)
        if (op >= 0 and "HtoD" in ctx.trace.name_of(op)
                and 0 <= int(ctx.ev["bytes"][op]) <= ctx.th.sync_htod_max_bytes):
            continue
        kept.append(r)
    seconds = float(ctx.ev["dur_ns"][kept].sum()) / 1e9
    if not kept or ctx.share(seconds) < ctx.th.sync_transfer_min_share:
        return []
    locs = ctx.locations(kept)
    return [Finding(
        rule, ctx.severity(seconds),
        f"{len(kept)} synchronous {what} blocked the host for {seconds * 1e3:.1f} ms "
        f"({ctx.share(seconds):.0%} of the traced time){_where(locs)}.",
        {"count": len(kept), "seconds": seconds, "share": ctx.share(seconds),
         "calls": dict(Counter(ctx.trace.name_of(r) for r in kept))},
        locs, advice.rule_fix(rule, ctx.frameworks))]


def _sync_memcpy(ctx: _Context) -> list[Finding]:
    return _sync_transfers(
        ctx, "sync_memcpy", _SYNC_MEMCPY, "memcpy calls")


def _sync_memset(ctx: _Context) -> list[Finding]:
    return _sync_transfers(
        ctx, "sync_memset", _SYNC_MEMSET, "memset calls")


def _sync_in_loop(ctx: _Context) -> list[Finding]:
    calls = ctx.named(ctx.rows(EventKind.RUNTIME, EventKind.DRIVER), lambda n: n in _SYNC_CALLS)
    calls = np.r_[calls, ctx.named(ctx.rows(EventKind.RUNTIME, EventKind.DRIVER),
                                   lambda n: bool(_SYNC_MEMCPY.match(n)))].astype(np.int64)
    if len(calls) == 0 or ctx.traced_s <= 0:
        return []
    starts, ends = ctx.busy_all
    # The GPU idles from a sync's return until the host queues work again: that is what the sync costs.
    done = ctx.ev["ts_ns"][calls] + ctx.ev["dur_ns"][calls]
    nxt = np.searchsorted(starts, done)
    busy_now = (nxt > 0) & (ends[np.maximum(nxt - 1, 0)] > done)
    idle_ns = np.where((nxt < len(starts)) & ~busy_now, starts[np.minimum(nxt, len(starts) - 1)] - done, 0)
    groups: dict[tuple[str, int, str], list[int]] = defaultdict(list)
    for i, r in enumerate(calls.tolist()):
        loc = ctx.stacks.location(r)
        if loc is not None:
            groups[(loc.file, loc.def_line, loc.function)].append(i)
    out = []
    for idx in groups.values():
        rows = calls[idx]
        idle_s = float(idle_ns[idx].sum()) / 1e9
        per_s = len(idx) / ctx.traced_s
        if (len(idx) < ctx.th.sync_min_count or per_s < ctx.th.sync_min_per_s
                or ctx.share(idle_s) < ctx.th.sync_idle_min_share):
            continue
        locs = ctx.locations(rows.tolist(), top=1)
        ops = Counter(ctx.user_op(r) for r in rows.tolist())
        op = ops.most_common(1)[0][0]
        call = (".item()" if op in ("aten::item", "aten::_local_scalar_dense")
                else ".cpu() / .to('cpu') / .tolist()" if op in ("aten::to", "aten::_to_copy", "aten::copy_")
                else "torch.cuda.synchronize()" if "Synchronize" in op and "torch" in ctx.frameworks else op)
        blocked_s = float(ctx.ev["dur_ns"][rows].sum()) / 1e9
        out.append(Finding(
            "sync_in_loop", ctx.severity(idle_s),
            f"{len(idx)} host-device syncs ({call}, {per_s:.0f}/s) from {locs[0][0]} left the GPU idle for "
            f"{idle_s * 1e3:.1f} ms after them ({ctx.share(idle_s):.0%} of the traced time) while the host worked.",
            {"count": len(idx), "per_second": per_s, "gpu_idle_after_seconds": idle_s, "share": ctx.share(idle_s),
             "host_blocked_seconds": blocked_s, "ops": dict(ops),
             "calls": dict(Counter(ctx.trace.name_of(r) for r in rows.tolist()))},
            locs,
            advice.rule_fix("sync_in_loop", ctx.frameworks, call=call, where=f"{locs[0][0].file}:{locs[0][0].line}")))
    return out


def _gpu_gaps(ctx: _Context) -> list[Finding]:
    ev, th = ctx.ev, ctx.th
    out = []
    for device in np.unique(ev["device"][ctx.gpu_rows]).tolist():
        rows = ctx.gpu_rows[ev["device"][ctx.gpu_rows] == device]
        starts, ends = _merged(ev["ts_ns"][rows], ev["ts_ns"][rows] + ev["dur_ns"][rows])
        span_s = float(ends[-1] - starts[0]) / 1e9
        gaps = starts[1:] - ends[:-1]
        counted = gaps >= th.gap_min_s * 1e9
        idle_s = float(gaps[counted].sum()) / 1e9
        long_gaps = int((gaps >= th.gap_long_s * 1e9).sum())
        idle_share = idle_s / span_s if span_s > 0 else 0.0
        if long_gaps == 0 and idle_share < th.gap_idle_share:
            continue
        examples = []
        locs: Counter[Location] = Counter()
        threads = _launching_threads(ctx, rows)
        for g in np.argsort(gaps)[::-1][:th.gap_examples].tolist():
            doing, loc = _host_at(ctx, threads, int(ends[g] + gaps[g] // 2))
            if loc is not None:
                locs[loc] += 1
            examples.append({"start_ns": int(ends[g]), "seconds": float(gaps[g]) / 1e9,
                             "host": frame_label(ctx.trace.name_of(doing)) if doing >= 0 else "nothing traced",
                             "location": str(loc) if loc else None})
        big = examples[0]
        severity = "high" if long_gaps else ctx.severity(idle_s)
        out.append(Finding(
            "gpu_gaps", severity,
            f"GPU {device} sat idle {idle_share:.0%} of its active span ({int(counted.sum())} gaps of "
            f"{th.gap_min_s * 1e6:.0f} µs or more, {long_gaps} over {th.gap_long_s:g} s); during the largest "
            f"({big['seconds'] * 1e3:.2f} ms) the host was in {big['host']}"
            + (f" at {big['location']}." if big["location"] else "."),
            {"device": device, "gaps": int(counted.sum()), "long_gaps": long_gaps, "idle_seconds": idle_s,
             "active_span_seconds": span_s, "idle_share": idle_share, "share": ctx.share(idle_s),
             "largest": examples},
            locs.most_common(),
            advice.rule_fix("gpu_gaps", ctx.frameworks)))
    return out


def _launching_threads(ctx: _Context, gpu_rows: np.ndarray) -> list[tuple[int, int]]:
    """The host threads that launched these GPU ops, most launches first."""
    launches = [ctx.stacks.launcher(int(r)) for r in gpu_rows[:: max(1, len(gpu_rows) // 500)]]
    threads = Counter((int(ctx.ev["pid"][r]), int(ctx.ev["tid"][r])) for r in launches if r >= 0)
    return [t for t, _ in threads.most_common()]


def _host_at(ctx: _Context, threads: list[tuple[int, int]], t_ns: int) -> tuple[int, Location | None]:
    """What the launching threads were doing at a moment: the first one inside the program's Python code
    (the autograd thread launches much but runs no Python; the main thread is where the host work is)."""
    first = -1
    for pid, tid in threads:
        row = ctx.stacks.innermost_host(pid, tid, t_ns)
        loc = ctx.stacks.location(row)
        if loc is not None:
            return row, loc
        first = row if first < 0 else first
    return first, None


def _tiny_kernel_storm(ctx: _Context) -> list[Finding]:
    ev, th = ctx.ev, ctx.th
    kernels = ctx.rows(EventKind.KERNEL)
    if len(kernels) == 0 or ctx.traced_s <= 0:
        return []
    tiny = kernels[ev["dur_ns"][kernels] < th.tiny_kernel_s * 1e9]
    starts, ends = ctx.busy_all
    span_s = float(ends[-1] - starts[0]) / 1e9
    idle_share = 1 - float((ends - starts).sum()) / 1e9 / span_s if span_s > 0 else 0.0
    per_s = len(tiny) / ctx.traced_s
    if (len(tiny) < th.tiny_min_count or per_s < th.tiny_min_per_s
            or len(tiny) / len(kernels) < th.tiny_min_kernel_share or idle_share < th.tiny_min_idle_share):
        return []
    launchers = [ctx.stacks.launcher(int(r)) for r in tiny]
    launch_ns = np.array([ev["dur_ns"][r] for r in launchers if r >= 0], dtype=np.int64)
    kernel_us = float(np.median(ev["dur_ns"][tiny])) / 1e3
    launch_us = float(np.median(launch_ns)) / 1e3 if len(launch_ns) else float("nan")
    locs = ctx.locations(r for r in launchers if r >= 0)
    return [Finding(
        "tiny_kernel_storm", ctx.severity(idle_share * span_s),
        f"{len(tiny)} kernels shorter than {th.tiny_kernel_s * 1e6:.0f} µs ({per_s:.0f}/s, median "
        f"{kernel_us:.1f} µs against a median {launch_us:.1f} µs launch call) left the GPU idle {idle_share:.0%} "
        f"of its span: launch-bound{_where(locs)}.",
        {"tiny_kernels": len(tiny), "kernels": len(kernels), "per_second": per_s, "median_kernel_us": kernel_us,
         "median_launch_us": launch_us, "gpu_idle_share": idle_share, "share": idle_share * span_s / ctx.traced_s},
        locs,
        advice.rule_fix("tiny_kernel_storm", ctx.frameworks))]


def _low_occupancy(ctx: _Context) -> list[Finding]:
    ev, th = ctx.ev, ctx.th
    kernels = ctx.rows(EventKind.KERNEL)
    total_ns = float(ev["dur_ns"][kernels].sum())
    if total_ns <= 0:
        return []
    by_name: dict[int, list[int]] = defaultdict(list)
    for r in kernels.tolist():
        by_name[int(ev["name"][r])].append(r)
    props = (ctx.trace.meta.get("deviceProperties") or [{}])[0]
    out = []
    for rows in by_name.values():
        dur = ev["dur_ns"][rows].astype(float)
        if dur.sum() / total_ns < th.occupancy_min_kernel_share:
            continue
        occ = np.array([float(ctx.trace.args.get(r, {}).get("est. achieved occupancy %", 0) or 0) for r in rows])
        known = occ > 0
        if not known.any():
            continue
        mean_occ = float((occ[known] * dur[known]).sum() / dur[known].sum())
        if mean_occ >= th.occupancy_low_pct:
            continue
        a = ctx.trace.args.get(rows[0], {})
        seconds = float(dur.sum()) / 1e9
        name = ctx.trace.names[int(ev["name"][rows[0]])]
        limiter = _occupancy_limiter(a, props)
        locs = ctx.locations(lr for lr in (ctx.stacks.launcher(r) for r in rows) if lr >= 0)
        out.append(Finding(
            "low_occupancy", ctx.severity(seconds * (1 - mean_occ / 100)),
            f"{name[:80]} took {dur.sum() / total_ns:.0%} of the GPU's kernel time ({len(rows)} launches, "
            f"{seconds * 1e3:.1f} ms) at {mean_occ:.0f} % estimated achieved occupancy, limited by {limiter}.",
            {"kernel": name, "launches": len(rows), "seconds": seconds, "kernel_time_share": dur.sum() / total_ns,
             "occupancy_pct": mean_occ, "registers_per_thread": a.get("registers per thread"),
             "shared_memory_bytes": a.get("shared memory"), "grid": a.get("grid"), "block": a.get("block"),
             "blocks_per_sm": a.get("blocks per SM"), "limiter": limiter, "share": ctx.share(seconds)},
            locs,
            advice.rule_fix(f"low_occupancy.{_limit_key(limiter)}", ctx.frameworks)))
    return out


def _limit_key(limiter: str) -> str:
    """The fix's key of a limiter ("registers (40 per thread: ...)" -> "registers"); the grid's by default."""
    key = limiter.split(" ")[0]
    return key if key in ("registers", "shared", "threads") else "grid"


def _occupancy_limiter(a: dict[str, Any], props: dict[str, Any]) -> str:
    """Which resource caps the blocks resident per SM: the grid, registers, shared memory or threads."""
    sms = int(props.get("numSms") or 0)
    grid = a.get("grid") or [0, 0, 0]
    blocks = int(np.prod(grid)) if grid else 0
    if sms and blocks and blocks < 2 * sms:
        return f"grid size ({blocks} blocks for {sms} SMs)"
    block = a.get("block") or [0, 0, 0]
    threads = int(np.prod(block)) if block else 0
    regs = int(a.get("registers per thread") or 0)
    smem = int(a.get("shared memory") or 0)
    limits = {}
    if threads and regs:
        limits["registers"] = int(props.get("regsPerMultiprocessor") or 65536) // (regs * threads)
    if smem:
        limits["shared"] = int(props.get("sharedMemPerMultiprocessor") or 233472) // smem
    if threads:
        limits["threads"] = int(props.get("maxThreadsPerMultiprocessor") or 2048) // threads
    if not limits:
        return "grid size (unknown)"
    which = min(limits, key=lambda k: limits[k])
    detail = {"registers": f"{regs} per thread", "shared": f"{smem} B per block", "threads": f"{threads} per block"}
    return f"{which} ({detail[which]}: {limits[which]} blocks per SM)"


def _tensor_cores_unused(ctx: _Context) -> list[Finding]:
    ev, th = ctx.ev, ctx.th
    kernels = ctx.rows(EventKind.KERNEL)
    if len(kernels) == 0 or ctx.traced_s <= 0:
        return []
    ids, which = np.unique(ev["name"][kernels], return_inverse=True)
    kinds = np.array([tensor_cores.kind(ctx.trace.names[i]) or "" for i in ids.tolist()], dtype=object)[which]
    tensor = kernels[kinds == "tensor"]
    # A matrix kernel whose name says neither counts only when no kernel of the trace used the tensor cores.
    inferred = kernels[kinds == "matmul"] if len(tensor) == 0 else kernels[:0]
    rows = np.sort(np.r_[kernels[kinds == "simt"], inferred])
    seconds = float(ev["dur_ns"][rows].sum()) / 1e9
    if len(rows) == 0 or ctx.share(seconds) < th.tensor_unused_min_share:
        return []
    by_name: Counter[str] = Counter()
    for r in rows.tolist():
        by_name[ctx.trace.name_of(r)] += int(ev["dur_ns"][r])
    top = by_name.most_common(1)[0][0]
    kernel_s = float(ev["dur_ns"][kernels].sum()) / 1e9
    tensor_s = float(ev["dur_ns"][tensor].sum()) / 1e9
    precision: Counter[str] = Counter()
    for name, ns in by_name.items():
        precision["gemv" if tensor_cores.is_gemv(name) else tensor_cores.precision(name)] += ns
    what = precision.most_common(1)[0][0]
    locs = ctx.locations(lr for lr in (ctx.stacks.launcher(r) for r in rows.tolist()) if lr >= 0)
    none = "; no kernel of the trace used the tensor cores" if len(tensor) == 0 else ""
    at = f" at {locs[0][0].file}:{locs[0][0].line}" if locs else ""
    return [Finding(
        "tensor_cores_unused", ctx.severity(seconds),
        f"{len(rows)} matrix-multiply / convolution kernels ran on the CUDA cores, not the tensor cores: "
        f"{seconds * 1e3:.1f} ms ({ctx.share(seconds):.0%} of the traced time, {seconds / kernel_s:.0%} of the "
        f"kernel time){none}; mostly {tensor_cores.short_name(top)}{_where(locs)}.",
        {"launches": len(rows), "seconds": seconds, "share": ctx.share(seconds),
         "kernel_time_share": seconds / kernel_s, "precision": what,
         "precision_shares": {k: v / 1e9 / seconds for k, v in precision.most_common()},
         "kernels": {name: ns / 1e9 for name, ns in by_name.most_common(5)},
         "inferred_launches": len(inferred), "tensor_core_launches": len(tensor), "tensor_core_seconds": tensor_s},
        locs, advice.rule_fix(f"tensor_cores_unused.{what}", ctx.frameworks, at=at))]


# Kernels that pass over memory once per op: PyTorch's elementwise and reduction kernels, CuPy's generated
# ElementwiseKernel / ReductionKernel ones (cupy_<op>__<types>), Eigen's (TensorFlow).
_ELEMENTWISE = re.compile(r"elementwise|reduce_kernel|vectorized|unrolled|^cupy_|eigenmetakernel", re.IGNORECASE)


def _elementwise_heavy(ctx: _Context) -> list[Finding]:
    ev, th = ctx.ev, ctx.th
    kernels = ctx.rows(EventKind.KERNEL)
    kernel_ns = float(ev["dur_ns"][kernels].sum())
    if kernel_ns <= 0:
        return []
    # The short ones are tiny_kernel_storm's: launch cost, not bandwidth, limits them.
    rows = ctx.named(kernels[ev["dur_ns"][kernels] >= th.tiny_kernel_s * 1e9], lambda n: bool(_ELEMENTWISE.search(n)))
    seconds = float(ev["dur_ns"][rows].sum()) / 1e9
    if (len(rows) == 0 or seconds * 1e9 / kernel_ns < th.elementwise_min_kernel_share
            or ctx.share(seconds) < th.elementwise_min_share):
        return []
    by_name: Counter[str] = Counter()
    for r in rows.tolist():
        by_name[ctx.trace.name_of(r)] += int(ev["dur_ns"][r])
    median_us = float(np.median(ev["dur_ns"][rows])) / 1e3
    locs = ctx.locations(lr for lr in (ctx.stacks.launcher(r) for r in rows.tolist()) if lr >= 0)
    return [Finding(
        "elementwise_heavy", ctx.severity(seconds),
        f"{len(rows)} elementwise / reduction kernels (median {median_us:.0f} µs) took {seconds * 1e3:.1f} ms "
        f"({ctx.share(seconds):.0%} of the traced time, {seconds * 1e9 / kernel_ns:.0%} of the kernel time): each "
        "reads and writes whole tensors for a few operations per element, so memory bandwidth, not math, limits "
        f"them; mostly {tensor_cores.short_name(by_name.most_common(1)[0][0])}{_where(locs)}.",
        {"launches": len(rows), "seconds": seconds, "share": ctx.share(seconds),
         "kernel_time_share": seconds * 1e9 / kernel_ns, "median_kernel_us": median_us,
         "kernels": {name: ns / 1e9 for name, ns in by_name.most_common(5)},
         "note": "A trace has no counters: how close DRAM runs to its peak is for `gpuscope diagnose` to say."},
        locs, advice.rule_fix("elementwise_heavy", ctx.frameworks))]


_RULES: tuple[Callable[[_Context], list[Finding]], ...] = (
    _pageable_memcpy, _sync_memcpy, _sync_memset, _sync_in_loop, _gpu_gaps, _tiny_kernel_storm, _low_occupancy,
    _tensor_cores_unused, _elementwise_heavy)
