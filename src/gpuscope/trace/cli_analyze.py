"""`gpuscope trace analyze FILE...`: the analyses of gpuscope.trace.analyze as tables or JSON.

Kept light at import (the parser is built on every gpuscope command): numpy and the loader load in run().
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "statistics and breakdowns of Kineto traces (kernels, API calls, copies, idle time and why)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="Kineto / PyTorch profiler trace files (.json or .json.gz), one per rank")
    p.add_argument("--json", action="store_true", help="print everything as one JSON document")
    p.add_argument("--top", type=int, default=10, metavar="N", help="rows per table (default 10)")


def run(args: argparse.Namespace) -> int:
    """A bad file raises TraceError for the caller to report as a usage error."""
    from ..errors import UsageError
    from .analyze import analyze, stragglers
    from .kineto import load
    from .rules import as_dicts, findings
    from .verdicts import verdicts

    if args.top < 1:
        raise UsageError(f"--top must be 1 or more, not {args.top}.")
    traces = [load(f) for f in args.files]
    reports = [analyze(t) for t in traces]
    found = [findings(t) for t in traces]
    judged = [verdicts(t, r, f) for t, r, f in zip(traces, reports, found, strict=True)]
    slow = stragglers(traces)
    if args.json:
        doc: dict[str, Any] = {"traces": [{**r.to_dict(), "verdicts": [vars(v) for v in vs], "findings": as_dicts(f)}
                                          for r, f, vs in zip(reports, found, judged, strict=True)],
                               "stragglers": [vars(s) for s in slow]}
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    for r, f, vs in zip(reports, found, judged, strict=True):
        _print_report(r, args.top, [f"Verdict {v.kind} ({v.confidence:.0%}): {v.summary}" for v in vs])
        print("Findings" + ("" if f else "\n  (none)\n"))
        for d in as_dicts(f):
            print(f"  [{d['severity']}] {d['rule']}: {d['summary']}\n    fix: {d['fix']}\n")
    if len(traces) > 1:
        print("stragglers (GPU busy time > 10 % above the median rank):")
        if not slow:
            print("  none")
        for s in slow:
            who = s.source if s.rank is None else f"rank {s.rank} ({s.source})"
            print(f"  {who}: busy {_ms(s.busy_ns)} vs median {_ms(s.median_busy_ns)} "
                  f"(+{s.excess_ratio:.0%})")
    return 0


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f} ms"


def _us(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e3:.1f} us"


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def _table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(title)
    if not rows:
        print("  (none)\n")
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    # the last column (a name) is left-aligned and unpadded; the numbers are right-aligned
    print("  " + "  ".join(h.rjust(w) for h, w in zip(header[:-1], widths[:-1], strict=True)) + "  " + header[-1])
    for r in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r[:-1], widths[:-1], strict=True)) + "  " + r[-1])
    print()


def _print_report(r: Any, top: int, verdicts: list[str]) -> None:
    rank = "" if r.rank is None else f" (rank {r.rank})"
    print(f"== {r.source}{rank}: {r.events} events\n")
    print("\n".join(verdicts) + "\n" if verdicts else "Verdict: none (no GPU work in the trace)\n")
    _table("temporal breakdown (HTA: share of the span from the first GPU op to the last)",
           ["device", "span", "idle", "compute", "non-compute", ""],
           [[str(t.device), _ms(t.span_ns), f"{t.idle_ratio:.1%}", f"{t.compute_ratio:.1%}",
             f"{t.non_compute_ratio:.1%}", ""] for t in r.temporal])
    _table("idle time per stream, by cause (host wait: the CPU launched too late)",
           ["device", "stream", "idle", "host wait", "kernel wait", "other", ""],
           [[str(i.device), str(i.stream), _ms(i.idle_ns), f"{i.host_wait_ratio:.1%}", f"{i.kernel_wait_ratio:.1%}",
             f"{i.other_ratio:.1%}", ""] for i in r.idle])
    _table(f"top kernels by total time (of {len(r.kernels)})",
           ["time %", "total", "count", "mean", "p50", "p99", "launch delay p50", "name"],
           [[f"{k.share_ratio:.1%}", _ms(k.total_ns), str(k.count), _us(k.mean_ns), _us(k.p50_ns), _us(k.p99_ns),
             _us(k.launch_delay_p50_ns), _short(k.name)] for k in r.kernels[:top]])
    _table(f"CUDA API calls by total time (of {len(r.api)})",
           ["time %", "total", "count", "p50", "p99", "name"],
           [[f"{a.share_ratio:.1%}", _ms(a.total_ns), str(a.count), _us(a.p50_ns), _us(a.p99_ns), a.name]
            for a in r.api[:top]])
    _table("synchronisation (the host waits for the GPU)",
           ["total", "count", "p50", "max", "name"],
           [[_ms(s.total_ns), str(s.count), _us(s.p50_ns), _us(s.max_ns), s.name] for s in r.sync[:top]])
    _table("memcpy / memset",
           ["count", "bytes", "time", "bandwidth", "name"],
           [[str(c.count), f"{c.bytes / 1e6:.1f} MB", _ms(c.total_ns),
             "-" if c.bandwidth_bytes_per_s is None else f"{c.bandwidth_bytes_per_s / 1e9:.2f} GB/s",
             c.name + ("  <- pageable: pin the host memory" if c.pageable else "")] for c in r.memcpy[:top]])
    dists = [("launch call duration", r.launch_overhead), ("queue delay (launch end -> start)", r.queue_delay)]
    _table("launch overhead and queue delay",
           ["count", "p50", "p90", "p99", "max", ""],
           [[str(d.count), _us(d.p50_ns), _us(d.p90_ns), _us(d.p99_ns), _us(d.max_ns), label]
            for label, d in dists if d is not None])
    if r.overlap is not None:
        print(f"communication overlapped with compute: {r.overlap.overlap_ratio:.1%} of {_ms(r.overlap.comm_ns)} "
              "of NCCL kernels\n")
