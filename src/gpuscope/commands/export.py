"""`gpuscope export`: export a time range of the history to Parquet, CSV or JSONL."""

from __future__ import annotations

import argparse
import os

from .._args import check_data_dir, check_not_input, time_range
from ..errors import EXIT_OK, UsageError
from ._store import with_store

HELP = 'export a time range of the history to Parquet, CSV or JSONL'
DESCRIPTION = 'Reads the on-disk store directly (also while the agent runs) and writes one row per sample.'


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="FILE", help="the file to write (.parquet, .csv or .jsonl)")
    p.add_argument("--format", choices=("parquet", "csv", "jsonl"), help="default: from the file extension")
    p.add_argument("--since", default="1h", help="how far back (default 1h); or use --start/--end")
    p.add_argument("--start", help="start time (now, -1h, unix seconds or RFC 3339), instead of --since")
    p.add_argument("--end", default="now", help="end time (default now)")
    p.add_argument("--metric", action="append", default=None,
                   help="only this metric, e.g. gpu_sm_active_ratio (repeatable; default all)")
    p.add_argument("--data-dir", default=None, help="the agent's data directory (default: the agent's default)")


def run(args: argparse.Namespace) -> int:
    fmt = args.format or {".parquet": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}.get(
        os.path.splitext(args.out)[1].lower())
    if fmt is None:
        raise UsageError("Cannot tell the format from the file name; add --format parquet, csv or jsonl.")
    check_data_dir(args.data_dir)
    start_ns, end_ns = time_range(args)
    from .._paths import default_data_dir

    data_dir = os.path.expanduser(args.data_dir) if args.data_dir else str(default_data_dir())
    check_not_input("--out", args.out, [os.path.join(data_dir, "store")])  # the export would replace the database
    n = with_store(args.data_dir, lambda store: store.export(start_ns, end_ns, args.out, fmt=fmt,
                                                              metrics=args.metric))
    print(f"wrote {n} rows to {args.out}")
    return EXIT_OK
