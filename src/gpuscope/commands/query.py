"""`gpuscope query`: query a running agent's history."""

from __future__ import annotations

import argparse

from .._args import check_data_dir, time_range
from ..errors import EXIT_OK, UsageError

HELP = "query a running agent's history"
DESCRIPTION = "Reads a metric's history from a running agent (--url, default the local agent). Times: now, -1h, unix seconds or RFC 3339."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("metric",
                   help="metric name, e.g. gpu_sm_active_ratio (the agent's /api/v1/series lists those stored)")
    p.add_argument("--since", default="1h", help="how far back (default 1h); or use --start/--end")
    p.add_argument("--start", help="start time, instead of --since")
    p.add_argument("--end", default="now", help="end time (default now)")
    p.add_argument("--step", default="", help="time between points, e.g. 10s (default: about 60 points)")
    p.add_argument("--agg", default="mean", help="how the samples in each step combine: mean (default), max, min, "
                   "last, count, sum or a percentile such as p99")
    p.add_argument("--gpu", metavar="INDEX", help="only this GPU, e.g. 0")
    p.add_argument("--label", action="append", default=[], metavar="K=V",
                   help="only series with this label, e.g. pod=web-1 (repeatable)")
    p.add_argument("--format", choices=("table", "json", "csv"), default="table", help="default table")
    p.add_argument("--url", default=None, help="the agent (default $GPUSCOPE_URL or http://127.0.0.1:9471)")
    p.add_argument("--token", default=None,
                   help="bearer token (default $GPUSCOPE_TOKEN, else the token file in --data-dir)")
    p.add_argument("--data-dir", default=None,
                   help="the agent's data directory, where its token is (default: the agent's default)")


def run(args: argparse.Namespace) -> int:
    from ..agent.client import default_url, find_token, format_range, get_json
    from ..timeparse import parse_duration

    check_data_dir(args.data_dir)
    start_ns, end_ns = time_range(args)
    step = args.step or f"{max(1.0, (end_ns - start_ns) / 1e9 / 60):.3f}s"
    parse_duration(step, "--step")  # a TimeError is a UsageError
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
