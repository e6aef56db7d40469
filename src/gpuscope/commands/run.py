"""`gpuscope run`: run a command, watch the GPUs meanwhile, say what limited it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .._args import add_source_args, check_sim, check_writable
from ..errors import UsageError

HELP = 'run a command, watch the GPUs meanwhile, say what limited it'
DESCRIPTION = "Runs CMD (and its children), samples the GPUs at 10 Hz, shows a live status line, gives a verdict every 5 s, and at the end prints the time share of each verdict per GPU, the energy used and what to change first. Ctrl-C is forwarded to CMD. The exit code is CMD's."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_args(p)
    p.add_argument("--json", metavar="FILE", help="also write the report (with the verdict timeline) as JSON")
    p.add_argument("--html", metavar="FILE",
                   help="where to write the HTML report (default gpuscope-run-YYYYmmdd-HHMMSS.html here)")
    p.add_argument("--no-html", action="store_true", help="write no HTML report")
    p.add_argument("--no-stacks", action="store_true",
                   help="never sample the command's Python stacks (py-spy) to tell launch-, sync- and input-bound apart")
    p.add_argument("--trace", action="store_true",
                   help="run CMD with the tracing bootstrap on demand (PyTorch programs): a GPU whose verdict stays "
                        "launch-or-sync-, host- or input-bound without certainty for 2 verdicts gets one 3 s trace "
                        "of its processes, and the trace's verdict (certain, with the file:line) replaces the "
                        "metrics' from then on; traces are kept in <report stem>-traces/ beside the HTML report "
                        "(or the JSON one with --no-html), else in a temporary directory removed at the end")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")


def run(args: argparse.Namespace) -> int:
    from .. import runcmd
    from ..report.htmlpage import write_atomic, write_html

    check_sim(args)
    if args.html and args.no_html:
        raise UsageError("--html and --no-html contradict each other; give one.")
    if args.html and args.json and os.path.abspath(args.html) == os.path.abspath(args.json):
        raise UsageError(f"--html and --json both name {args.json}; give each report its own file.")
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    for flag, path in (("--html", args.html), ("--json", args.json)):
        check_writable(flag, path)  # before the command runs: a report lost after an hour's run is lost data
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
