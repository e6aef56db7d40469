"""`gpuscope trace [options] -- CMD ...`: trace a CUDA program's kernels, copies and syncs, unchanged.

CMD runs with gpuscope's bootstrap directory first on PYTHONPATH (the user's PYTHONPATH after it, and
the program's own sitecustomize still runs): every Python process of the command that imports torch
and initialises CUDA runs the PyTorch profiler for a window, by default 10 s after a 5 s warm-up
(`--delay`, `--duration`), or a window every `--every`, and writes its own Kineto trace into `--out`
(see bootstrap/sitecustomize.py). With `--samples` the GPUs are sampled at 10 Hz meanwhile and each
trace is also written as a Perfetto timeline with the GPU's metrics as counter tracks. With
`--on-demand` there is no window of its own: each process waits for the agent's requests
(`POST /api/v1/trace`) in `--agent-dir`/trace-requests and writes into `--agent-dir`/traces, within
a duty budget (trace/ondemand.py).

Two backends (`--backend`, default auto): a process that imports torch runs the PyTorch profiler (CPU
ops too); one that imports cupy, numba.cuda, jax or cuda-python and not torch is traced through CUPTI
with NVIDIA's cupti-python (trace/cupti_backend.py, docs/trace-cupti.md): GPU kernels, copies, memsets
and syncs, plus the runtime/driver calls the rules read with their Python lines; `--api all` records
every runtime and driver call, at a cost of several times the run time of a launch-bound loop.
A CMD that is a native program (an ELF executable, not a Python interpreter), or any CMD with
`--backend inject`, is traced by gpuscope's CUDA injection library instead (trace/inject/: built at
first use with the C compiler against NVIDIA's CUPTI wheel, loaded by the driver through
CUDA_INJECTION64_PATH): the same windows, records and budget, written as raw lines that become the same
Kineto-compatible traces once CMD has exited. Where it cannot work (no driver, no compiler, no CUPTI,
another injection library already set) one sentence says why and CMD runs untraced.

The program's stdout and stderr are its own: what the profiler's C++ prints while it starts, stops and
exports (Kineto's "External init callback must run in same thread as registerClient", CUPTI warnings)
goes to <host>.<pid>[.rank<N>].profiler.log beside the trace; the end-of-run report says how many lines,
and `--verbose` shows them.

Signals and exit code as `gpuscope run`: a SIGINT or SIGTERM sent to gpuscope alone is forwarded to
CMD and its processes (each flushes its trace as it exits), a second one terminates CMD, and the exit
code is CMD's (128 + N when signal N ended it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import sys
import time
import uuid
from typing import Any

import psutil

from .._child import Forwarder, RunError, check, exit_code, reap, reap_all, start
from ..sampler import Sampler, SamplerConfig
from .bootstrap import DIR as BOOTSTRAP_DIR
from .perfetto import points, with_counters

#: After the second signal CMD gets this long to write its traces before SIGKILL (an export of a
#: long window takes seconds).
FLUSH_GRACE_S = 30.0
HELP = ("run a CUDA program unchanged (PyTorch, CuPy, Numba, JAX, cuda-python) and trace its kernels, copies "
        "and syncs (gpuscope trace -- CMD)")
NO_TRACE = ("no trace: no process of the program imported torch, cupy, numba.cuda, jax or cuda-python "
            "(the Python CUDA libraries gpuscope trace knows).")
BACKENDS = ("auto", "torch", "cupti", "inject")
# Why a process wrote no trace, by the status its bootstrap left (bootstrap/sitecustomize.py).
_WHY = {"exited_before_window": "it exited before its window began (lower --delay)",
        "profiler_failed": "the {backend} could not start ({error})",
        "failed": "the tracer failed ({error})",
        "waiting": "it ended before its window could be written",
        "no_cuda": "it imported a CUDA library but never created a CUDA context",
        "cupti_missing": "{error}",
        "cupti_held": "{error}",
        "cupti_failed": "CUPTI tracing could not start ({error})"}


def environment(out_dir: str, delay_s: float, duration_s: float, every_s: float, stack: bool,
                run_id: str, base: dict[str, str] | None = None, requests_dir: str | None = None,
                backend: str = "auto", api: str = "rules", max_duty: float | None = None,
                inject_library: str | None = None) -> dict[str, str]:
    """CMD's environment: ours plus the bootstrap first on PYTHONPATH and the tracing settings; with
    `inject_library`, the injection hook too. One CUPTI subscriber per process: with --backend inject the
    library traces every process and the bootstrap is left out; in auto, the library leaves the processes
    that run Python to the bootstrap (GPUSCOPE_TRACE_INJECT_SKIP_PYTHON)."""
    env = dict(os.environ if base is None else base)
    if inject_library:
        env["CUDA_INJECTION64_PATH"] = inject_library
        if backend != "inject":
            env["GPUSCOPE_TRACE_INJECT_SKIP_PYTHON"] = "1"
    if backend != "inject":
        env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update({"GPUSCOPE_TRACE_DIR": os.path.abspath(out_dir), "GPUSCOPE_TRACE_DELAY_S": repr(delay_s),
                "GPUSCOPE_TRACE_DURATION_S": repr(duration_s), "GPUSCOPE_TRACE_EVERY_S": repr(every_s),
                "GPUSCOPE_TRACE_STACK": "1" if stack else "0", "GPUSCOPE_TRACE_RUN": run_id,
                "GPUSCOPE_TRACE_BACKEND": backend, "GPUSCOPE_TRACE_API": api})
    if requests_dir:
        env["GPUSCOPE_TRACE_ON_DEMAND"] = os.path.abspath(requests_dir)
    if max_duty is not None:
        env["GPUSCOPE_TRACE_MAX_DUTY"] = repr(max_duty)
    return env


def check_windows(delay_s: float, duration_s: float, every_s: float) -> None:
    if delay_s < 0 or duration_s <= 0:
        raise RunError("--delay must be 0 or more and --duration more than 0.", 2)
    if every_s and every_s <= duration_s:
        raise RunError(f"--every ({every_s:g} s) must be longer than --duration ({duration_s:g} s).", 2)


def trace(cmd: list[str], *, out_dir: str = "gpuscope-traces", delay_s: float = 5.0, duration_s: float = 10.0,
        every_s: float = 0.0, stack: bool = True, samples: bool = False, simulate: str | None = None,
        gpus: int | None = None, requests_dir: str | None = None, backend: str = "auto",
        api: str = "rules", max_duty: float | None = None) -> tuple[int, dict[str, Any]]:
    """Run `cmd` traced; return (the exit code to use, what was written: {"processes": [...], "traces": [...]})."""
    check(cmd)
    check_windows(delay_s, duration_s, every_s)
    if backend not in BACKENDS:
        raise RunError(f"--backend must be one of {', '.join(BACKENDS)}, not {backend!r}.", 2)
    if api not in ("rules", "all"):
        raise RunError(f"--api must be 'rules' or 'all', not {api!r}.", 2)
    if api == "all" and backend == "torch":
        raise RunError("--api all applies to the CUPTI backend; the PyTorch profiler records every call already.", 2)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise RunError(f"Cannot create the trace directory {out_dir}: {e.strerror or e}.", 2) from None
    inject_library, untraced = _injection(cmd, backend, requests_dir)
    if untraced:
        print(f"gpuscope trace: {untraced}", file=sys.stderr)
    run_id = uuid.uuid4().hex
    sampler = kept = None
    if samples:
        sampler = Sampler(SamplerConfig(interval=0.1), simulate=simulate, gpus=gpus)
        sampler.open()
        kept = []
        sampler.subscribe(lambda snap: kept.extend(points([snap])))
    forward = Forwarder(lambda c: psutil.Process(c.pid).children(recursive=True))
    forward.install()
    child = None
    started = time.time()
    try:
        child = forward.child = start(cmd, environment(out_dir, delay_s, duration_s, every_s, stack, run_id,
                                       requests_dir=requests_dir, backend=backend, api=api, max_duty=max_duty,
                                       inject_library=inject_library)
                                 if not (untraced and backend == "inject") else dict(os.environ))
        if forward.interrupts:
            child.send_signal(signal.SIGINT)
        if sampler is not None:
            sampler.start()
        while child.poll() is None:
            time.sleep(0.1)
            forward.kill_if_overdue(FLUSH_GRACE_S)
    finally:
        if child is not None:
            descendants = []
            if forward.interrupts:
                try:
                    descendants = psutil.Process(child.pid).children(recursive=True)
                except psutil.Error:
                    pass
            reap(child)
            reap_all(descendants)
        forward.restore()
        if sampler is not None:
            sampler.stop()
    code = exit_code(child.returncode)
    problems = []
    if inject_library and not untraced:
        from .._redact import redact_cmdline
        from .inject.convert import convert_run

        problems = convert_run(out_dir, run_id, argv=[redact_cmdline(cmd)])
    report = collect(out_dir, run_id)
    report.update({"exit_code": code, "duration_s": time.time() - started, "out_dir": out_dir,
                   "backend": "inject" if inject_library else backend, "untraced": untraced,
                   "problems": problems})
    if kept:
        for t in report["traces"]:
            path = t["path"].replace(".pt.trace.json.gz", ".perfetto.json.gz")
            t["counter_events"] = with_counters(t["path"], kept, path)
            t["perfetto"] = path
    return code, report


def _injection(cmd: list[str], backend: str, requests_dir: str | None) -> tuple[str | None, str]:
    """(the injection library for CMD, or None: the Python bootstrap traces it; why CMD runs untraced, or "")."""
    from . import inject

    if backend != "inject" and not (backend == "auto" and inject.is_native(cmd[0])):
        return None, ""
    if requests_dir:
        raise RunError("--on-demand is not available for programs traced by injection yet (native programs, "
                       "--backend inject); trace them with --delay/--duration or --every.", 2)
    held = os.environ.get("CUDA_INJECTION64_PATH")
    if held:
        return "", (f"CUDA_INJECTION64_PATH is already set ({held}: another profiler's injection), so "
                    f"{os.path.basename(cmd[0])} runs untraced by gpuscope.")
    try:
        inject.driver()
        return inject.build(), ""
    except inject.InjectUnavailable as e:
        return "", f"{os.path.basename(cmd[0])} runs untraced: {str(e).rstrip('.')}."


def collect(out_dir: str, run_id: str) -> dict[str, Any]:
    """The status files of this run's processes, and the traces they wrote."""
    processes, traces = [], []
    for path in sorted(glob.glob(os.path.join(out_dir, "*.gpuscope.json"))):
        try:
            with open(path) as f:
                status = json.load(f)
        except (OSError, ValueError):
            continue
        if status.get("run") != run_id:
            continue
        processes.append(status)
        for t in status.get("traces", []):
            full = os.path.join(out_dir, t["file"])
            if os.path.exists(full):
                traces.append(dict(t, path=full, bytes=os.path.getsize(full)))
    return {"processes": processes, "traces": traces}


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def render(report: dict[str, Any], verbose: bool = False) -> str:
    """The end-of-run text: each trace written, then why any process wrote none; with `verbose`, what the
    profiler printed in each process (kept out of the program's stderr, in its log)."""
    lines = [f"gpuscope trace: exit code {report['exit_code']}, {report['duration_s']:.0f} s, "
             f"{len(report['traces'])} trace file(s) in {report['out_dir']}"]
    for t in report["traces"]:
        who = f"pid {t['pid']}" + (f" rank {t['rank']}" if t.get("rank") is not None else "")
        lines.append(f"  {t['path']}  {_size(t['bytes'])}  ({who})"
                     + (f"\n    + {t['perfetto']} (with {t['counter_events']} GPU counter samples)"
                        if t.get("perfetto") else ""))
        lines.extend("    " + s for s in _kernel_summary(t["path"]).splitlines())
    for p in report["processes"]:
        why = _WHY.get(p.get("status", ""), "").format(
            error=p.get("error", ""), backend="CUPTI backend" if p.get("backend") == "cupti" else "PyTorch profiler")
        if why and not p.get("traces"):
            lines.append(f"  no trace from pid {p.get('pid')}: {why.rstrip('.')}.")
        if p.get("torch_after_cupti"):
            lines.append(f"  pid {p.get('pid')}: {p['torch_after_cupti']}.")
        if p.get("profiler_log"):
            lines.extend(_profiler_log(report["out_dir"], p, verbose))
    for problem in report.get("problems") or ():
        lines.append(f"  {problem}")
    if report.get("untraced"):
        pass  # said once, before CMD started
    elif not report["processes"] and report.get("backend") == "inject":
        lines.append("  no trace: no process of the program initialised CUDA (cuInit), so the driver never loaded "
                     "gpuscope's injection library.")
    elif not report["processes"]:
        lines.append(f"  {NO_TRACE}")
    return "\n".join(lines)


#: The most of a profiler log that --verbose shows (the file keeps all of it).
LOG_SHOWN_LINES, LOG_SHOWN_BYTES = 200, 64 * 1024


def _profiler_log(out_dir: str, status: dict[str, Any], verbose: bool) -> list[str]:
    """Where a process's profiler messages are; with `verbose`, the messages too."""
    path = os.path.join(out_dir, os.path.basename(str(status["profiler_log"])))
    n = int(status.get("profiler_log_lines") or 0)
    head = f"  pid {status.get('pid')}: {n} line{'s' if n != 1 else ''} from the profiler itself, kept in {path}"
    if not verbose:
        return [head + " (--verbose shows them)."]
    try:
        with open(path, "rb") as f:
            text = f.read(LOG_SHOWN_BYTES).decode("utf-8", "replace")
    except OSError as e:
        return [head + f" (unreadable: {e.strerror or e})."]
    shown = text.splitlines()[:LOG_SHOWN_LINES]
    return [head + ":"] + ["    " + line for line in shown] + (
        ["    ... (the rest is in the file)"] if len(shown) < n else [])


def _kernel_summary(path: str, top: int = 5) -> str:
    """The trace's kernels in a few lines (trace.analyze's kernel statistics)."""
    from .analyze import kernel_stats
    from .kineto import load

    try:
        stats = kernel_stats(load(path))
    except Exception as e:  # an analysis bug must not hide the files that were written
        return f"(no kernel summary: {type(e).__name__}: {e})"
    if not stats:
        return "no kernels in this window"
    total_ns = sum(k.total_ns for k in stats)
    lines = [f"{sum(k.count for k in stats)} kernels, {total_ns / 1e6:.1f} ms on the GPU; the longest in total:"]
    for k in sorted(stats, key=lambda k: -k.total_ns)[:top]:
        name = k.name if len(k.name) <= 60 else k.name[:57] + "..."
        lines.append(f"  {k.share_ratio * 100:5.1f} %  {k.count:7d} x {k.mean_ns / 1e3:8.1f} us  {name}")
    return "\n".join(lines)


DEFAULT_OUT, DEFAULT_DELAY_S, DEFAULT_DURATION_S = "gpuscope-traces", 5.0, 10.0


def run(args: Any) -> int:
    """The `gpuscope trace [run]` handler (cli.py parses; the exit code is CMD's)."""
    from .._args import check_sim
    from ..errors import UsageError

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    check_sim(args)  # an unknown --simulate scenario is a typo, not a request for no samples
    if args.agent_dir and not args.on_demand:
        print("gpuscope: --agent-dir only applies with --on-demand.", file=sys.stderr)
        return 2
    window_flags = [flag for flag, value in (("--out", args.out), ("--delay", args.delay),
                                             ("--duration", args.duration), ("--every", args.every))
                    if value is not None]
    if args.on_demand and window_flags:  # silently ignored, they would leave the user waiting for traces
        raise UsageError(f"--on-demand traces when the agent asks, into the agent's data directory; "
                         f"{', '.join(window_flags)} {'does' if len(window_flags) == 1 else 'do'} not apply with it.")
    out, requests_dir = args.out or DEFAULT_OUT, None
    if args.on_demand:
        from .._paths import default_data_dir

        if args.agent_dir and not os.path.isdir(args.agent_dir):  # the agent made it; a typo would trace into a void
            raise UsageError(f"--agent-dir {args.agent_dir} is not a directory; name the agent's --data-dir.")
        agent_dir = args.agent_dir or str(default_data_dir())
        out, requests_dir = os.path.join(agent_dir, "traces"), os.path.join(agent_dir, "trace-requests")
    delay_s = DEFAULT_DELAY_S if args.delay is None else args.delay
    duration_s = DEFAULT_DURATION_S if args.duration is None else args.duration
    try:
        code, report = trace(cmd, out_dir=out, requests_dir=requests_dir, delay_s=delay_s, duration_s=duration_s,
                           every_s=args.every or 0.0, stack=not args.no_stack, samples=args.samples,
                           simulate=args.simulate, gpus=args.gpus, backend=getattr(args, "backend", "auto"),
                           api=getattr(args, "api", "rules"), max_duty=getattr(args, "budget", 1.0) / 100)
    except RunError as e:
        print(f"gpuscope: {e}", file=sys.stderr)
        return e.code
    print(render(report, verbose=getattr(args, "trace_verbose", False) or getattr(args, "verbose", False)), file=sys.stderr)
    return code


def add_arguments(p: Any) -> None:
    """The options of `gpuscope trace [run]`."""
    from .._args import add_source_args, interval

    # Defaults of None, filled in by run(): --on-demand must tell a flag given from one left out.
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where each process writes <host>.<pid>[.rank<N>].pt.trace.json.gz (default ./gpuscope-traces)")
    def delay(text: str) -> float:  # 0 is a delay (trace from the first CUDA context on), not a bad duration
        return 0.0 if text.strip().rstrip("ms").strip() in ("0", "0.0") else interval(text)

    p.add_argument("--delay", type=delay, default=None,
                   help="warm-up after the process initialises CUDA, before tracing (default 5s; 0: none)")
    p.add_argument("--duration", type=interval, default=None, help="how long each window traces (default 10s)")
    p.add_argument("--every", type=interval, default=None,
                   help="trace a --duration window this often (e.g. 5m) instead of once")
    def percent(text: str) -> float:
        try:
            value = float(text.strip().rstrip("%"))
        except ValueError:
            value = -1.0
        if not 0 < value <= 100:
            raise argparse.ArgumentTypeError(f"'{text}' is not a percentage between 0 and 100")
        return value

    p.add_argument("--budget", type=percent, default=1.0, metavar="PERCENT",
                   help="hard overhead budget for --every and --on-demand (default 1): each window is charged its "
                        "whole measured cost (start, window, stop, export) and the next waits until the cost is "
                        "at most PERCENT of the wall time since")
    p.add_argument("--on-demand", action="store_true",
                   help="no window of its own: trace when the agent asks (POST /api/v1/trace), at most 1 %% of "
                        "wall time; traces go to the agent's data directory, --out/--delay/--duration/--every do not apply")
    p.add_argument("--agent-dir", metavar="DIR",
                   help="with --on-demand: the agent's data directory (default: the agent's default, "
                        "/var/lib/gpuscope as root, else ~/.local/share/gpuscope)")
    p.add_argument("-v", "--verbose", dest="trace_verbose", action="store_true",
                   help="after the run, also show what the profiler printed in each process (kept out of the "
                        "program's stderr, in <host>.<pid>.profiler.log beside its trace)")
    p.add_argument("--no-stack", action="store_true", help="leave out Python stacks (smaller, cheaper traces)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto (default): the PyTorch profiler in processes that import torch, CUPTI (needs "
                        "cupti-python) in those that import cupy, numba.cuda, jax or cuda-python and not torch, "
                        "gpuscope's CUDA injection library when CMD is a native program (C++, any ELF executable "
                        "that is not Python); torch, cupti or inject: only that one (cupti also traces torch "
                        "programs, without CPU ops; inject traces every process of CMD that initialises CUDA)")
    p.add_argument("--api", choices=("rules", "all"), default="rules",
                   help="CUPTI backend: record only the runtime/driver calls the rules read (memcpy, memset, "
                        "synchronize, malloc/free; default), or all of them, kernel launches included: about "
                        "50 us of Python each, several times slower for a launch-bound loop")
    p.add_argument("--samples", action="store_true",
                   help="sample the GPUs at 10 Hz meanwhile and also write each trace as <name>.perfetto.json.gz "
                        "with SM, tensor, DRAM, NVML utilization, power, memory and PCIe as counter tracks")
    add_source_args(p)  # --simulate/--gpus: the --samples counters without a GPU
    p.add_argument("cmd", nargs="...", help="-- CMD [ARGS...]")


def with_run_action(argv: list[str], actions: Any) -> list[str]:
    """`gpuscope trace [options] -- CMD` is `gpuscope trace run [options] -- CMD`: argparse cannot
    have both a sub-action and options of its own on one parser, so the bare form gets 'run' added."""
    verb = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if verb is None or argv[verb] != "trace":
        return argv
    rest = argv[verb + 1:]
    if not rest or rest[0] in actions or rest[0] in ("-h", "--help"):
        return argv
    return argv[:verb + 1] + ["run"] + rest
