"""`gpuscope top`: live terminal view: per GPU the true activity, the verdict, the processes."""

from __future__ import annotations

import argparse
import sys

from .._args import add_source_args, check_data_dir, check_sim, interval
from ..errors import UsageError

HELP = 'live terminal view: per GPU the true activity, the verdict, the processes'
DESCRIPTION = 'A live view of every GPU (SM, tensor and FP pipes, DRAM, PCIe/NVLink beside NVML utilization, memory, power, clocks and throttling, the verdict) and of the processes on them. Reads the local agent (--url), else samples here. Keys: q quit, s sort, r reverse, / filter, t tree, k kill.'


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_args(p, processes=True)
    p.add_argument("--refresh", type=interval, default=0.25, metavar="SECONDS",
                    help="redraw this often (default 0.25 s, 4 per second)")
    p.add_argument("--url", default=None, help="the agent (default $GPUSCOPE_URL or http://127.0.0.1:9471)")
    p.add_argument("--token", default=None,
                   help="bearer token (default $GPUSCOPE_TOKEN, else the token file in --data-dir)")
    p.add_argument("--data-dir", default=None,
                   help="the agent's data directory, where its token is (default: the agent's default)")
    p.add_argument("--once", action="store_true", help="print one overview and exit (no terminal UI)")
    p.add_argument("--json", action="store_true", help="with --once: the overview as JSON, for scripts")


def run(args: argparse.Namespace) -> int:
    from ..agent.client import default_url, find_token

    check_sim(args)
    check_data_dir(args.data_dir)
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
    from .. import top

    url = "" if args.simulate is not None else args.url or default_url()  # a simulated node reads no agent
    feed = top.open_feed(url, find_token(args.token, args.data_dir), args.refresh,  # NoSource: exit 1
                         args.simulate, args.gpus, args.processes)
    return top.run(feed, args.refresh, once=args.once, as_json=args.json)
