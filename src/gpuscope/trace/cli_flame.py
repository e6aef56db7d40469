"""`gpuscope trace flame FILE --out PATH`: GPU time charged to the Python stacks that launched it, as
a speedscope profile (.json, open in https://www.speedscope.app) or a self-contained SVG (.svg)."""

from __future__ import annotations

import argparse

HELP = "a flame graph of GPU time by the Python stack that launched it (speedscope JSON or SVG)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="a Kineto / PyTorch profiler trace (.json or .json.gz)")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="where to write it: *.svg for an SVG, *.json for speedscope")


def run(args: argparse.Namespace) -> int:
    """A bad trace raises TraceError for the caller to report; a bad --out is a usage error."""
    from .._args import check_not_input
    from ..errors import UsageError
    from .flame import write_speedscope, write_svg
    from .kineto import load

    if not args.out.endswith((".svg", ".json")):
        raise UsageError(f"--out must end in .svg (an SVG flame graph) or .json (speedscope), not {args.out!r}.")
    check_not_input("--out", args.out, [args.file])  # a .json --out would replace the trace with speedscope's
    trace = load(args.file)
    try:
        (write_svg if args.out.endswith(".svg") else write_speedscope)(trace, args.out)
    except OSError as e:
        raise UsageError(f"Cannot write {args.out}: {e.strerror}.") from None
    print(f"wrote {args.out}")
    return 0
