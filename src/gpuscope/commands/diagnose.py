"""`gpuscope diagnose`: name each GPU's bottleneck, with the evidence and what to change."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields
from typing import Any

from .._args import add_source_args, check_data_dir, check_sim, interval, time_range
from ..errors import EXIT_OK, UsageError
from ..sampler import Sampler, SamplerConfig
from ._store import with_store

HELP = "name each GPU's bottleneck, with the evidence and what to change"
DESCRIPTION = 'Samples the GPUs for --seconds (or a simulated node), then gives each GPU a verdict: compute-, memory-, transfer-, launch/sync-bound, input-starved, idle but allocated, throttled, memory growth, hardware errors; with the numbers behind it and a concrete fix. A GPU that several processes share also gets a verdict per process (indented under it, with its pid).'


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_args(p)
    p.add_argument("--seconds", type=interval, default=10.0,
                    help="how long to watch (default 10s); with an agent, how far back to look")
    p.add_argument("--url", default=None,
                    help="read from this agent (default: the local agent if one answers, else sample here)")
    p.add_argument("--token", default=None,
                   help="the agent's bearer token (default $GPUSCOPE_TOKEN, else the agent's token file)")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.add_argument("--since", default=None,
                    help="diagnose a past range from the store instead, e.g. --since 1h (verdict spans and shares)")
    p.add_argument("--start", default=None, help="start of a past range (with --end; instead of --since)")
    p.add_argument("--end", default="now", help="end of a past range (default now)")
    p.add_argument("--data-dir", default=None, help="the agent's data directory (for a past range without --url)")
    p.add_argument("--stacks", action="store_true",
                    help="when a GPU waits on a busy CPU thread, sample that process's Python stacks for 2 s "
                         "(py-spy; needs permission to trace it) to tell launch-, sync- and input-bound apart")
    p.add_argument("--trace", nargs="+", metavar="FILE", default=None,
                    help="PyTorch profiler / `gpuscope trace` files of the GPUs' processes: a GPU that waits on "
                         "its host takes the trace's verdict (sync-, launch-, input-bound, ... for certain); a "
                         "trace that disagrees with a clear verdict is shown as a note")


def run(args: argparse.Namespace) -> int:
    from ..diagnose import diagnose, windows_from_snapshots
    from ..diagnose.thresholds import DEFAULT

    check_sim(args)
    check_data_dir(args.data_dir)
    if args.since is not None or args.start is not None:
        if args.trace:
            raise UsageError("--trace refines a diagnosis of the last --seconds, not of a past range; drop one.")
        return _diagnose_range(args)
    if args.seconds < DEFAULT.min_window_s:
        raise UsageError(f"--seconds must be at least {DEFAULT.min_window_s:g}: a shorter window is no steady state.")
    traced = _trace_verdicts(args.trace) if args.trace else None  # a bad file fails before the wait
    gpu_of_pid: dict[int, str] = {}
    data = None
    if args.simulate is None:
        data = _diagnose_from_agent(args)
    if data is None:
        sampler = Sampler(SamplerConfig(interval=0.1), simulate=args.simulate, gpus=args.gpus)
        sampler.start()
        try:
            if not args.json:
                what = (f"SIMULATED node '{sampler.simulated}'" if sampler.simulated
                        else f"{len(sampler.devices)} GPU(s)")
                print(f"watching {what} for {args.seconds:g} s ...", file=sys.stderr, flush=True)
            time.sleep(args.seconds)
        finally:
            sampler.stop()
        from ..diagnose import Profiler

        profiler = Profiler() if args.stacks and sampler.simulated is None else None
        windows = windows_from_snapshots(list(sampler.history))
        gpu_of_pid = {p.pid: w.gpu for w in windows for p in w.processes}
        verdicts = diagnose(windows, profiler=profiler)
        data = {"simulated": sampler.simulated, "verdicts": [asdict(v) for v in verdicts]}
    if traced is not None:
        from ..diagnose import Verdict
        from ..trace.verdicts import refine

        names = {f.name for f in fields(Verdict)}
        metric = [Verdict(**{k: v for k, v in d.items() if k in names}) for d in data["verdicts"]]
        shared = {v.gpu: v.processes for v in metric if v.primary and v.processes}
        refined = refine(metric, traced, gpu_of_pid)
        for v in refined:  # a trace's verdict for a shared GPU keeps its processes' own
            if v.primary and not v.processes and v.gpu in shared:
                v.processes = shared.pop(v.gpu)
        data["verdicts"] = [asdict(v) for v in refined]
    if args.json:
        print(json.dumps(data, indent=1, default=str))
        return EXIT_OK
    if data.get("simulated"):
        print(f"SIMULATED node — scenario '{data['simulated']}'")
    if not data["verdicts"]:
        print("no verdict: the window holds no steady state yet (it needs at least 5 s of samples).")
    for v in data["verdicts"]:
        mark = {"critical": "!!", "warning": "! ", "info": "  "}[v["severity"]]
        print(f"{mark} GPU {v['gpu']:<5} {v['kind']:<22} {v['summary']}")
        for r in v["recommendations"][:1] if v["kind"] not in ("healthy", "idle") else []:
            print(f"{'':31}-> {r}")
        for pv in v.get("processes") or []:  # a shared GPU: each process's own verdicts
            mark = {"critical": "!!", "warning": "! ", "info": "  "}[pv["severity"]]
            print(f"{mark}   {'pid ' + str(pv['pid']):<13} {pv['kind']:<22} {pv['summary']}")
            for r in pv["recommendations"][:1] if pv["kind"] not in ("healthy", "idle") else []:
                print(f"{'':40}-> {r}")
    return EXIT_OK


def _trace_verdicts(files: list[str]) -> list[Any]:
    from ..trace.kineto import load
    from ..trace.verdicts import verdicts

    return [v for f in files for v in verdicts(load(f))]  # a TraceError is a UsageError


def _diagnose_range(args: argparse.Namespace) -> int:
    """Verdict spans over a past range: from --url's agent, else from the local store (read-only)."""
    from ..diagnose.history import diagnose_range, range_as_dict

    if args.simulate is not None:
        raise UsageError("--since/--start read the store's history; --simulate has none (run an agent with it).")
    start_ns, end_ns = time_range(args)
    if args.url:
        from ..agent.client import find_token, get_json

        data = get_json(args.url, "/api/v1/diagnose", {"start": f"{start_ns / 1e9:.3f}", "end": f"{end_ns / 1e9:.3f}"},
                        find_token(args.token, args.data_dir), timeout=60.0,
                        require={"start": (int, float), "end": (int, float), "window_s": (int, float),
                                 "share": dict, "spans": list})
    else:
        data = with_store(args.data_dir, lambda store: range_as_dict(diagnose_range(store, start_ns, end_ns)),
                          " or --url at a running agent")  # NoData is Unavailable: exit 1
    if args.json:
        print(json.dumps(data, indent=1, default=str))
        return EXIT_OK
    if data.get("simulated"):
        print(f"SIMULATED node — scenario '{data['simulated']}'")
    t0 = data["start"]
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t0))} .. "
          f"{time.strftime('%H:%M:%S', time.localtime(data['end']))}, windows of {data['window_s']:.0f} s")
    for gpu, share in sorted(data["share"].items()):
        print(f"  GPU {gpu}: " + ", ".join(f"{k} {v * 100:.0f} %" for k, v in sorted(share.items(), key=lambda kv: -kv[1])))
    for sp in data["spans"]:
        mark = {"critical": "!!", "warning": "! ", "info": "  "}[sp["severity"]]
        print(f"{mark} GPU {sp['gpu']:<5} {sp['start'] - t0:7.0f}-{sp['end'] - t0:<7.0f}s {sp['kind']:<22} "
              f"{sp['summary']}")
    return EXIT_OK


def _diagnose_from_agent(args: argparse.Namespace) -> dict[str, Any] | None:
    """Verdicts from a running agent; None when no agent answers and none was named (then sample here)."""
    from ..agent.client import ClientError, default_url, find_token, get_json

    url = args.url or default_url()
    try:
        # Fixed-point: the agent reads no exponent, and --seconds 100000d is 8.64e+09 with :g
        return get_json(url, "/api/v1/diagnose", {"window": f"{args.seconds:.3f}s"},
                        find_token(args.token, None), timeout=30.0 if args.url else 2.0, require={"verdicts": list})
    except ClientError as e:
        if args.url is not None or "No gpuscope agent answers" not in str(e):
            raise
        return None
