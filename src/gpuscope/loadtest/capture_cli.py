"""`gpuscope capture`: the command's help and arguments, light to import (the CLI builds every command's
parser at start); the proxy itself is in capture.py, imported when the command runs."""

from __future__ import annotations

import argparse

from ..http.limits import add_limit_args

HELP = "record a live service's requests through a local proxy, for 'gpuscope loadtest --replay'"
DESCRIPTION = ("A reverse proxy on --listen that forwards every request to --upstream, streams each answer "
               "back unchanged and writes one JSON line per request to --out (format: docs/loadtest-replay.md). "
               "Secret headers are never written; --anonymise replaces prompt text with same-length filler.")

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", required=True, metavar="URL",
                        help="the service to forward to, such as http://127.0.0.1:8000")
    parser.add_argument("--listen", default="127.0.0.1:8081", metavar="HOST:PORT",
                        help="where clients connect: HOST:PORT, :PORT (127.0.0.1) or [::1]:PORT (default "
                             "127.0.0.1:8081; port 0 picks a free one)")
    parser.add_argument("--out", default="capture.jsonl", metavar="FILE",
                        help="the JSON Lines file to write, replaced if it exists (default capture.jsonl)")
    parser.add_argument("--anonymise", "--anonymize", action="store_true",
                        help="replace prompt and message text with same-length filler (structure, roles, "
                             "model and numbers are kept)")
    parser.add_argument("--count", type=int, default=0, metavar="N",
                        help="stop after N requests are recorded (default 0: until interrupted)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="longest a forwarded request may take (default 600)")
    add_limit_args(parser)


def run(args: argparse.Namespace) -> int:
    from .capture import run as run_capture

    return run_capture(args)
