"""`gpuscope <verb>`. Every error a user can cause ends in one sentence and a non-zero exit.

Exit codes: 0 ok, 1 the machine cannot do it (no driver, no GPU), 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from typing import Any

from . import __version__
from ._args import Parser as _Parser
from ._args import add_source_args as _add_source_args
from ._args import check_not_input as _check_not_input
from ._args import check_sim as _check_sim
from ._args import check_writable as _check_writable
from ._args import interval as _interval
from ._args import time_range as _time_range
from .errors import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, Unavailable, UsageError, UserError
from .sampler import Sampler, SamplerConfig


def _with_store(data_dir: str | None, use: Callable[[Any], Any], elsewhere: str = "") -> Any:
    """`use(store)` on the agent's store, opened read-only (the agent may be writing meanwhile)."""
    from .agent.config import default_data_dir
    from .store import Store, StoreError

    path = os.path.join(os.path.expanduser(data_dir) if data_dir else str(default_data_dir()), "store")
    if not os.path.isdir(path):
        raise Unavailable(f"No gpuscope store at {path}; point --data-dir at the agent's data directory{elsewhere}.")
    try:
        store = Store(path, readonly=True)
        try:
            return use(store)
        finally:
            store.close()
    except StoreError as e:
        raise UsageError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpuscope", description="The truth about how well NVIDIA GPUs are used.")
    p.add_argument("--version", action="version", version=f"gpuscope {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the sampler does")
    sub = p.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)

    d = sub.add_parser("doctor", help="what this machine supports, per GPU and metric, and why not",
                       description="Checks the driver, NVML, GPM, permissions and processes, and lists for "
                                   "every metric whether this machine supports it and, if not, why.")
    _add_source_args(d)
    d.add_argument("--json", action="store_true", help="print the report as JSON")

    s = sub.add_parser("sample", help="print snapshots: per GPU the true SM activity beside NVML utilization",
                       description="Samples the GPUs and prints one line per GPU per snapshot "
                                   "(or JSON lines with --json). Ctrl-C stops.")
    _add_source_args(s, processes=True)
    s.add_argument("--interval", type=_interval, default=0.1, help="sampling interval (default 100ms)")
    s.add_argument("--every", type=_interval, default=1.0, help="print every this often (default 1s)")
    s.add_argument("--count", type=int, default=0, help="stop after this many prints (default: run until Ctrl-C)")
    s.add_argument("--json", action="store_true", help="JSON lines: one snapshot per line")

    sc = sub.add_parser("scenarios", help="list the simulated scenarios")
    del sc

    dg = sub.add_parser("diagnose", help="name each GPU's bottleneck, with the evidence and what to change",
                        description="Samples the GPUs for --seconds (or a simulated node), then gives each GPU "
                                    "a verdict: compute-, memory-, transfer-, launch/sync-bound, input-starved, "
                                    "idle but allocated, throttled, memory growth, hardware errors; with the "
                                    "numbers behind it and a concrete fix.")
    _add_source_args(dg)
    dg.add_argument("--seconds", type=_interval, default=10.0,
                    help="how long to watch (default 10s); with an agent, how far back to look")
    dg.add_argument("--url", default=None,
                    help="read from this agent (default: the local agent if one answers, else sample here)")
    dg.add_argument("--token", default=None, help="the agent's bearer token (default $GPUSCOPE_TOKEN or its file)")
    dg.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    dg.add_argument("--since", default=None,
                    help="diagnose a past range from the store instead, e.g. --since 1h (verdict spans and shares)")
    dg.add_argument("--start", default=None, help="start of a past range (with --end; instead of --since)")
    dg.add_argument("--end", default="now", help="end of a past range (default now)")
    dg.add_argument("--data-dir", default=None, help="the agent's data directory (for a past range without --url)")
    dg.add_argument("--stacks", action="store_true",
                    help="when a GPU waits on a busy CPU thread, sample that process's Python stacks for 2 s "
                         "(py-spy; needs permission to trace it) to tell launch-, sync- and input-bound apart")
    dg.add_argument("--trace", nargs="+", metavar="FILE", default=None,
                    help="PyTorch profiler / `gpuscope trace` files of the GPUs' processes: a GPU that waits on "
                         "its host takes the trace's verdict (sync-, launch-, input-bound, ... for certain); a "
                         "trace that disagrees with a clear verdict is shown as a note")

    r = sub.add_parser("run", help="run a command, watch the GPUs meanwhile, say what limited it",
                       description="Runs CMD (and its children), samples the GPUs at 10 Hz, shows a live status "
                                   "line, gives a verdict every 5 s, and at the end prints the time share of each "
                                   "verdict per GPU, the energy used and what to change first. Ctrl-C is "
                                   "forwarded to CMD. The exit code is CMD's.")
    _add_source_args(r)
    r.add_argument("--json", metavar="FILE", help="also write the report (with the verdict timeline) as JSON")
    r.add_argument("--html", metavar="FILE",
                   help="where to write the HTML report (default gpuscope-run-YYYYmmdd-HHMMSS.html here)")
    r.add_argument("--no-html", action="store_true", help="write no HTML report")
    r.add_argument("--no-stacks", action="store_true",
                   help="never sample the command's Python stacks (py-spy) to tell launch-, sync- and input-bound apart")
    r.add_argument("--trace", action="store_true",
                   help="run CMD with the tracing bootstrap on demand (PyTorch programs): a GPU whose verdict stays "
                        "launch-or-sync-, host- or input-bound without certainty for 2 verdicts gets one 3 s trace "
                        "of its processes, and the trace's verdict (certain, with the file:line) replaces the "
                        "metrics' from then on; traces are kept in <report stem>-traces/ beside the HTML report "
                        "(or the JSON one with --no-html), else in a temporary directory removed at the end")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")

    a = sub.add_parser("agent", help="run the agent: sampler, on-disk history, /metrics and the query API",
                       description="The main job on a GPU node: samples every GPU, keeps the history on disk "
                                   "(no database needed), serves Prometheus /metrics and a JSON query API. "
                                   "Binds to 127.0.0.1 unless told otherwise. SIGTERM or Ctrl-C stops it cleanly.")
    a.add_argument("--config", metavar="FILE", help="TOML config file (see the README for every key)")
    a.add_argument("--port", type=int, help="TCP port (default 9471)")
    a.add_argument("--bind", help="address to listen on (default 127.0.0.1; anything else requires the token)")
    a.add_argument("--data-dir", help="where the history and the token live")
    a.add_argument("--interval", type=_interval, help="sampling interval (default 100ms)")
    a.add_argument("--naming", choices=("canonical", "dcgm"), help="metric names on /metrics")
    a.add_argument("--log-format", choices=("text", "json"), help="log lines as text or JSON")
    _add_source_args(a, processes=True)

    q = sub.add_parser("query", help="query a running agent's history",
                       description="Reads a metric's history from a running agent (--url, default the local "
                                   "agent). Times: now, -1h, unix seconds or RFC 3339.")
    q.add_argument("metric", help="metric name, e.g. gpu_sm_active_ratio (see /api/v1/series)")
    q.add_argument("--since", default="1h", help="how far back (default 1h); or use --start/--end")
    q.add_argument("--start", help="start time")
    q.add_argument("--end", default="now", help="end time (default now)")
    q.add_argument("--step", default="", help="resolution (default: about 60 points)")
    q.add_argument("--agg", default="mean", help="mean, max, min, last, count, sum or pXX")
    q.add_argument("--gpu", help="only this GPU (label, e.g. 0)")
    q.add_argument("--label", action="append", default=[], metavar="K=V", help="label filter, repeatable")
    q.add_argument("--format", choices=("table", "json", "csv"), default="table")
    q.add_argument("--url", default=None, help="the agent (default $GPUSCOPE_URL or http://127.0.0.1:9471)")
    q.add_argument("--token", default=None, help="bearer token (default $GPUSCOPE_TOKEN or the data dir's token)")
    q.add_argument("--data-dir", default=None, help="where to look for the token")

    e = sub.add_parser("export", help="export a time range of the history to Parquet, CSV or JSONL",
                       description="Reads the on-disk store directly (also while the agent runs) and writes "
                                   "one row per sample.")
    e.add_argument("--out", required=True, help="output file")
    e.add_argument("--format", choices=("parquet", "csv", "jsonl"), help="default: from the file extension")
    e.add_argument("--since", default="1h", help="how far back (default 1h); or use --start/--end")
    e.add_argument("--start")
    e.add_argument("--end", default="now")
    e.add_argument("--metric", action="append", default=None, help="only these metrics (repeatable)")
    e.add_argument("--data-dir", default=None, help="the agent's data directory")

    tp = sub.add_parser("top", help="live terminal view: per GPU the true activity, the verdict, the processes",
                        description="A live view of every GPU (SM, tensor and FP pipes, DRAM, PCIe/NVLink beside "
                                    "NVML utilization, memory, power, clocks and throttling, the verdict) and of "
                                    "the processes on them. Reads the local agent (--url), else samples here. "
                                    "Keys: q quit, s sort, r reverse, / filter, t tree, k kill.")
    _add_source_args(tp, processes=True)
    tp.add_argument("--refresh", type=_interval, default=0.25, metavar="SECONDS",
                    help="redraw this often (default 0.25 s, 4 per second)")
    tp.add_argument("--url", default=None, help="the agent (default $GPUSCOPE_URL or http://127.0.0.1:9471)")
    tp.add_argument("--token", default=None, help="bearer token (default $GPUSCOPE_TOKEN or the data dir's token)")
    tp.add_argument("--data-dir", default=None, help="where to look for the token")
    tp.add_argument("--once", action="store_true", help="print one overview and exit (no terminal UI)")
    tp.add_argument("--json", action="store_true", help="with --once: the overview as JSON (gpuscope.viewmodel)")

    al = sub.add_parser("alerts", help="check alert rule files, export them for Prometheus, list an agent's alerts",
                        description="Alert rules (TOML or YAML) on metrics and verdicts; see the README's Alerts "
                                    "section for the format.")
    alsub = al.add_subparsers(dest="alerts_verb", metavar="ACTION", parser_class=_Parser)
    ac = alsub.add_parser("check", help="validate rule files (exit 0 when valid, 2 with one sentence when not)")
    ac.add_argument("files", nargs="+", metavar="FILE", help="rule files (.toml, .yaml, .yml)")
    ac.add_argument("--no-builtins", action="store_true", help="leave out the built-in rules")
    ae = alsub.add_parser("export-rules", help="write the rules as a Prometheus rule file",
                          description="Writes the built-in rules and those of FILE... as a Prometheus rule file "
                                      "(check it with 'promtool check rules').")
    ae.add_argument("files", nargs="*", metavar="FILE", help="rule files (none: the built-in rules alone)")
    ae.add_argument("-o", "--out", default="-", help="output file (default: standard output)")
    ae.add_argument("--no-builtins", action="store_true", help="leave out the built-in rules")
    ae.add_argument("--group", default="gpuscope", help="the rule group's name (default gpuscope)")
    alist = alsub.add_parser("list", help="the firing and pending alerts of a running agent")
    alist.add_argument("--url", default=None, help="the agent (default $GPUSCOPE_URL or http://127.0.0.1:9471)")
    alist.add_argument("--token", default=None, help="bearer token (default $GPUSCOPE_TOKEN or the data dir's token)")
    alist.add_argument("--json", action="store_true", help="print the agent's answer as JSON")

    tr = sub.add_parser("trace", help="trace CUDA programs unchanged (PyTorch, CuPy, Numba, JAX) and analyse the traces",
                        description="Traces of what a program did on the CPU and the GPUs, and why the GPUs waited.")
    trsub = tr.add_subparsers(dest="trace_verb", metavar="ACTION", parser_class=_Parser)
    for action, module in _TRACE_ACTIONS.items():
        mod = importlib.import_module(module, __package__)
        mod.add_arguments(trsub.add_parser(action, help=mod.HELP))

    for verb, module in _MODULE_VERBS.items():
        mod = importlib.import_module(module, __package__)
        mod.add_arguments(sub.add_parser(verb, help=mod.HELP, description=getattr(mod, "DESCRIPTION", None)))

    from .web.dashboard_cmd import add_arguments as _dashboard_arguments

    db = sub.add_parser("dashboard", help="the web dashboard over a Prometheus server: a whole fleet in one UI",
                        description="Serves the agent's dashboard with the data of every agent a Prometheus "
                                    "server scrapes (GPU keys are hostname/gpu). Binds to 127.0.0.1 unless told "
                                    "otherwise; anything else requires the token.")
    _dashboard_arguments(db)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        from .trace.run import with_run_action

        args, extra = parser.parse_known_args(with_run_action(list(sys.argv[1:] if argv is None else argv),
                                                              _TRACE_ACTIONS))
        if extra:  # argparse would blame the top-level parser; point at the verb's help instead
            where = " ".join(["gpuscope", *([args.verb] if args.verb else []), "--help"])
            raise UsageError(f"Unrecognized arguments: {' '.join(extra)} (see '{where}').")
    except UsageError as e:
        print(f"gpuscope: {e}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.verb is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return _VERBS[args.verb](args)
    except UserError as e:  # every one-sentence error: UsageError, ConfigError, ClientError, ...
        print(f"gpuscope: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


def _doctor(args: argparse.Namespace) -> int:
    from . import doctor

    _check_sim(args)
    report = doctor.run(args.simulate, args.gpus)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(doctor.render(report))
    return EXIT_OK


def _fmt(v: float | None, scale: float = 100.0, width: int = 5, unit: str = "%") -> str:
    return f"{'-':>{width}}{' ' * len(unit)}" if v is None else f"{v * scale:>{width}.1f}{unit}"


def _line(snap: Any) -> list[str]:
    out = []
    for g in snap.gpus:
        if not g.healthy:
            out.append(f"GPU {g.identity.label:<4} LOST")
            continue
        mem = g.get("gpu_memory_used_bytes")
        out.append(
            f"GPU {g.identity.label:<4} SM active {_fmt(g.sm_active_ratio)}  tensor {_fmt(g.get('gpu_tensor_active_ratio'))}"
            f"  DRAM {_fmt(g.get('gpu_dram_active_ratio'))}  PCIe rx {_fmt(g.get('gpu_pcie_rx_bytes_per_second'), 1e-9, 6, 'GB/s')}"
            f"  | NVML util {_fmt(g.utilization_ratio)}  mem {_fmt(mem, 2**-30, 6, 'GiB')}"
            f"  {_fmt(g.power_watts, 1, 5, 'W')}  {','.join(r for r in g.throttle_reasons if r != 'gpu_idle')}"
        )
    return out


def _sample(args: argparse.Namespace) -> int:
    _check_sim(args)
    if args.count < 0:
        raise UsageError(f"--count must be 0 (no limit) or more, not {args.count}.")
    if args.every < args.interval:
        raise UsageError("--every must not be shorter than --interval.")
    sampler = Sampler(SamplerConfig.for_interval(args.interval), simulate=args.simulate, gpus=args.gpus,
                      processes=args.processes)
    stop = {"now": False}

    def _term(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, _term)
    events: deque[Any] = deque(maxlen=10_000)  # appended on the sampler thread, popped here
    sampler.subscribe(lambda snap: events.extend(snap.events))
    sampler.start()
    if sampler.simulated and not args.json:
        print(f"SIMULATED node — scenario '{sampler.simulated}' (not real GPUs)", flush=True)
    n = 0
    try:
        while not stop["now"]:
            time.sleep(args.every)
            snap = sampler.latest()
            if snap is None:
                continue
            if args.json:
                print(json.dumps(asdict(snap), default=str), flush=True)
            else:
                print(time.strftime("%H:%M:%S"), flush=False)
                for line in _line(snap):
                    print("  " + line)
                while events:
                    e = events.popleft()
                    print(f"  event: {e.message}" + (f" (x{e.count})" if e.count > 1 else ""))
                sys.stdout.flush()
            n += 1
            if args.count and n >= args.count:
                break
    except KeyboardInterrupt:
        pass
    finally:
        sampler.stop()
    return EXIT_OK


def _scenarios(args: argparse.Namespace) -> int:
    from .sim import SCENARIOS, describe

    for s in SCENARIOS:
        print(f"{s:<16} {describe(s)}")
    return EXIT_OK


def _top(args: argparse.Namespace) -> int:
    from .agent.client import default_url, find_token

    _check_sim(args)
    if not 0.05 <= args.refresh <= 60:
        raise UsageError(f"--refresh must be between 0.05 and 60 seconds, not {args.refresh:g}.")
    if args.json and not args.once:
        raise UsageError("--json prints one overview; add --once (the live view is for a terminal).")
    if args.simulate is not None and args.url is not None:
        raise UsageError("--simulate and --url name two different sources; give one.")
    if args.url is not None:  # a URL typed wrong is the user's mistake, not a reason to sample here
        import urllib.parse

        try:
            parts = urllib.parse.urlsplit(args.url)
            _ = parts.port
        except ValueError as e:
            raise UsageError(f"--url {args.url!r} is not a usable URL: {e}.") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"--url must be an http:// or https:// URL of an agent, not {args.url!r}.")
    if not args.once and not (sys.stdout.isatty() and sys.stdin.isatty()):
        raise UsageError("The live view needs a terminal; for scripts use 'gpuscope top --once --json'.")
    from . import top

    try:
        url = "" if args.simulate is not None else args.url or default_url()  # a simulated node reads no agent
        feed = top.open_feed(url, find_token(args.token, args.data_dir), args.refresh,
                             args.simulate, args.gpus, args.processes)
    except top.NoSource as e:
        raise Unavailable(str(e)) from None
    return top.run(feed, args.refresh, once=args.once, as_json=args.json)


def _agent(args: argparse.Namespace) -> int:
    from .agent import Agent, AgentError, setup_logging
    from .agent import config as agent_config

    _check_sim(args)
    try:
        cfg = agent_config.load(args.config)
        for flag, section, key in (("port", "agent", "port"), ("bind", "agent", "bind"),
                                   ("data_dir", "agent", "data_dir"), ("interval", "sampler", "interval"),
                                   ("naming", "prometheus", "naming"), ("log_format", "agent", "log_format")):
            if getattr(args, flag) is not None:  # a flag overrides the file
                setattr(getattr(cfg, section), key, getattr(args, flag))
        agent_config.validate(cfg)
    except agent_config.ConfigError as e:
        raise UsageError(str(e)) from None
    setup_logging(cfg.agent.log_format, "debug" if args.verbose else cfg.agent.log_level)
    try:
        return Agent(cfg, simulate=args.simulate, gpus=args.gpus, processes=args.processes).run()
    except AgentError as e:
        print(f"gpuscope: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE


def _query(args: argparse.Namespace) -> int:
    from .agent.client import default_url, find_token, format_range, get_json
    from .timeparse import TimeError, parse_duration

    start_ns, end_ns = _time_range(args)
    step = args.step or f"{max(1.0, (end_ns - start_ns) / 1e9 / 60):.3f}s"
    try:
        parse_duration(step, "--step")
    except TimeError as e:
        raise UsageError(str(e)) from None
    params = {"metric": args.metric, "start": f"{start_ns / 1e9:.3f}", "end": f"{end_ns / 1e9:.3f}",
              "step": step, "agg": args.agg}
    if args.gpu is not None:
        params["gpu"] = args.gpu
    for kv in args.label:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise UsageError(f"--label takes K=V, not {kv!r}.")
        params[k] = v
    url = args.url or default_url()
    data = get_json(url, "/api/v1/query_range", params, find_token(args.token, args.data_dir),
                    require={"metric": str, "series": list})
    if data.get("simulated") and args.format == "table":
        print(f"(SIMULATED node, scenario '{data['simulated']}')")
    print(format_range(data, args.format))
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    fmt = args.format or {".parquet": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}.get(
        os.path.splitext(args.out)[1].lower())
    if fmt is None:
        raise UsageError("Cannot tell the format from the file name; add --format parquet, csv or jsonl.")
    start_ns, end_ns = _time_range(args)
    from .agent.config import default_data_dir

    data_dir = os.path.expanduser(args.data_dir) if args.data_dir else str(default_data_dir())
    _check_not_input("--out", args.out, [os.path.join(data_dir, "store")])  # the export would replace the database
    n = _with_store(args.data_dir, lambda store: store.export(start_ns, end_ns, args.out, fmt=fmt,
                                                              metrics=args.metric))
    print(f"wrote {n} rows to {args.out}")
    return EXIT_OK


def _diagnose(args: argparse.Namespace) -> int:
    from .diagnose import diagnose, windows_from_snapshots
    from .diagnose.thresholds import DEFAULT

    _check_sim(args)
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
        from .diagnose import Profiler

        profiler = Profiler() if args.stacks and sampler.simulated is None else None
        windows = windows_from_snapshots(list(sampler.history))
        gpu_of_pid = {p.pid: w.gpu for w in windows for p in w.processes}
        verdicts = diagnose(windows, profiler=profiler)
        data = {"simulated": sampler.simulated, "verdicts": [asdict(v) for v in verdicts]}
    if traced is not None:
        from .diagnose import Verdict
        from .trace.verdicts import refine

        names = {f.name for f in fields(Verdict)}
        metric = [Verdict(**{k: v for k, v in d.items() if k in names}) for d in data["verdicts"]]
        data["verdicts"] = [asdict(v) for v in refine(metric, traced, gpu_of_pid)]
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
    return EXIT_OK


def _trace_verdicts(files: list[str]) -> list[Any]:
    from .trace.kineto import load
    from .trace.model import TraceError
    from .trace.verdicts import verdicts

    try:
        return [v for f in files for v in verdicts(load(f))]
    except TraceError as e:
        raise UsageError(str(e)) from None


def _diagnose_range(args: argparse.Namespace) -> int:
    """Verdict spans over a past range: from --url's agent, else from the local store (read-only)."""
    from .diagnose.history import NoData, diagnose_range, range_as_dict

    if args.simulate is not None:
        raise UsageError("--since/--start read the store's history; --simulate has none (run an agent with it).")
    start_ns, end_ns = _time_range(args)
    if args.url:
        from .agent.client import find_token, get_json

        data = get_json(args.url, "/api/v1/diagnose", {"start": f"{start_ns / 1e9:.3f}", "end": f"{end_ns / 1e9:.3f}"},
                        find_token(args.token, args.data_dir), timeout=60.0,
                        require={"start": (int, float), "end": (int, float), "window_s": (int, float),
                                 "share": dict, "spans": list})
    else:
        try:
            data = _with_store(args.data_dir, lambda store: range_as_dict(diagnose_range(store, start_ns, end_ns)),
                               " or --url at a running agent")
        except NoData as e:
            raise Unavailable(str(e)) from None
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
    from .agent.client import ClientError, default_url, find_token, get_json

    url = args.url or default_url()
    try:
        # Fixed-point: the agent reads no exponent, and --seconds 100000d is 8.64e+09 with :g
        return get_json(url, "/api/v1/diagnose", {"window": f"{args.seconds:.3f}s"},
                        find_token(args.token, None), timeout=30.0 if args.url else 2.0, require={"verdicts": list})
    except ClientError as e:
        if args.url is not None or "No gpuscope agent answers" not in str(e):
            raise
        return None


def _run(args: argparse.Namespace) -> int:
    from . import runcmd
    from .report.htmlpage import write_atomic, write_html

    _check_sim(args)
    if args.html and args.no_html:
        raise UsageError("--html and --no-html contradict each other; give one.")
    if args.html and args.json and os.path.abspath(args.html) == os.path.abspath(args.json):
        raise UsageError(f"--html and --json both name {args.json}; give each report its own file.")
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    for flag, path in (("--html", args.html), ("--json", args.json)):
        _check_writable(flag, path)  # before the command runs: a report lost after an hour's run is lost data
    html = None if args.no_html else (args.html or time.strftime("gpuscope-run-%Y%m%d-%H%M%S.html"))
    beside = html or args.json
    trace_dir = os.path.splitext(beside)[0] + "-traces" if args.trace and beside else None
    try:
        code, report = runcmd.run(cmd, simulate=args.simulate, gpus=args.gpus, stacks=not args.no_stacks,
                                  trace=args.trace, trace_dir=trace_dir)
    except runcmd.RunError as e:
        print(f"gpuscope: {e}", file=sys.stderr)
        return e.code
    print(runcmd.render(report), file=sys.stderr)
    # Writing failures are one sentence each; the exit code stays the command's.
    if args.json:
        try:
            write_atomic(args.json, json.dumps(report, indent=1, default=str))
        except OSError as e:
            print(f"gpuscope: cannot write the JSON report {args.json}: {e.strerror or e}.", file=sys.stderr)
    if html is not None:
        try:
            write_html(report, html)
            print(f"  report: {html}", file=sys.stderr)
        except OSError as e:
            print(f"gpuscope: cannot write the HTML report {html}: {e.strerror or e}.", file=sys.stderr)
    return code


def _alerts(args: argparse.Namespace) -> int:
    from .alerts import RuleError, load_rules, to_prometheus

    if args.alerts_verb is None:
        raise UsageError("Say what to do: gpuscope alerts check|export-rules|list (see 'gpuscope alerts --help').")
    if args.alerts_verb == "list":
        return _alerts_list(args)
    if args.alerts_verb == "export-rules" and not args.group.strip():
        raise UsageError("--group must name the rule group, such as --group gpuscope.")
    try:
        rules = load_rules(args.files, builtins=not args.no_builtins)
    except RuleError as e:
        raise UsageError(str(e)) from None
    if args.alerts_verb == "check":
        own = [r for r in rules if r.source != "built-in"]
        print(f"ok: {len(own)} rule(s) from {', '.join(args.files)}; {len(rules)} rule(s) in all with the built-ins"
              if not args.no_builtins else f"ok: {len(rules)} rule(s) from {', '.join(args.files)}")
        return EXIT_OK
    if args.out != "-":
        _check_not_input("--out", args.out, args.files)
    text = to_prometheus(rules, group=args.group, sources=args.files)
    if args.out == "-":
        sys.stdout.write(text)
        return EXIT_OK
    try:
        with open(args.out, "w") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"Cannot write {args.out}: {e.strerror or e}.") from None
    print(f"wrote {len(rules)} rule(s) to {args.out}", file=sys.stderr)
    return EXIT_OK


def _alerts_list(args: argparse.Namespace) -> int:
    from .agent.client import default_url, find_token, get_json

    url = args.url or default_url()
    data = get_json(url, "/api/v1/alerts", {}, find_token(args.token, None), timeout=10.0)
    if args.json:
        print(json.dumps(data, indent=1))
        return EXIT_OK
    if not data.get("enabled", True):
        print("alerts are off in this agent's config ([alerts] enabled = false)")
        return EXIT_OK
    if data.get("simulated"):
        print(f"SIMULATED node — scenario '{data['simulated']}'")
    lines = []
    try:  # what another server (or another version) answered must end in one sentence, not a KeyError
        active = list(data.get("firing") or []) + list(data.get("pending") or [])
        if not active:
            lines.append(f"no alert firing or pending ({len(data.get('rules') or [])} rule(s) evaluated)")
        for a in active:
            lab = a["labels"]
            where = " ".join(f"{k}={lab[k]}" for k in ("gpu", "xid") if lab.get(k))
            since = time.strftime("%H:%M:%S", time.localtime(a["active_at"]))
            lines.append(f"{a['state']:<8} {lab.get('severity', ''):<8} {a['rule']:<22} {where:<10} since {since}  "
                         f"{a['annotations'].get('summary', '')}")
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, OSError):
        from .agent.client import ClientError

        raise ClientError(f"{url} answered /api/v1/alerts with alerts this version cannot read; is it a gpuscope "
                          "agent?") from None
    print("\n".join(lines))
    return EXIT_OK



# `gpuscope trace ACTION`: each action is a module with HELP, add_arguments(parser) and run(args) -> int;
# a new action is one line here.
_TRACE_ACTIONS = {"analyze": ".trace.cli_analyze", "run": ".trace.run", "merge": ".trace.merge",
                  "flame": ".trace.cli_flame"}


def _trace(args: argparse.Namespace) -> int:
    from .trace.model import TraceError

    if args.trace_verb is None:
        raise UsageError(f"Say what to do: gpuscope trace {'|'.join(_TRACE_ACTIONS)} (see 'gpuscope trace --help').")
    try:
        return importlib.import_module(_TRACE_ACTIONS[args.trace_verb], __package__).run(args)
    except TraceError as e:
        raise UsageError(str(e)) from None


def _dashboard(args: argparse.Namespace) -> int:
    from .web.dashboard_cmd import run

    return run(args)

# Commands that live in their own package: each module has HELP (and optionally DESCRIPTION),
# add_arguments(parser) and run(args) -> int, and imports nothing heavy at module level.
_MODULE_VERBS = {"loadtest": ".loadtest.cli", "capture": ".loadtest.capture_cli", "guard": ".guard.cli"}


def _module_verb(args: argparse.Namespace) -> int:
    return importlib.import_module(_MODULE_VERBS[args.verb], __package__).run(args)


_VERBS = {"alerts": _alerts, "doctor": _doctor, "diagnose": _diagnose, "run": _run, "sample": _sample, "scenarios": _scenarios, "agent": _agent, "query": _query, "top": _top,
          "export": _export, "dashboard": _dashboard, "trace": _trace,
          **{verb: _module_verb for verb in _MODULE_VERBS}}


if __name__ == "__main__":  # pragma: no cover
    # Run as `python -m gpuscope.cli`, this file is loaded twice (as __main__ and, through the verbs'
    # `from ..cli import UsageError`, as gpuscope.cli): call the package's main so that the UsageError
    # it catches is the one the verbs raise.
    from gpuscope.cli import main as _package_main

    sys.exit(_package_main())
