"""`gpuscope fleet`: who wastes GPUs and what it costs, from the Prometheus server that scrapes the agents;
and the recording rules that make the report cheap over long ranges."""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

HELP = "fleet answers over Prometheus: GPU-hours allocated, used and idle, energy, cost and waste per group"
DESCRIPTION = """\
Reads a Prometheus-compatible server (Prometheus, VictoriaMetrics, Thanos, Mimir) that scrapes the gpuscope
agents, and says per group what its GPUs cost and how much of that went to GPUs that were idle or starved:
GPU-hours observed, allocated, truly used (the integral of SM activity) and idle; hours throttled by reason;
energy, cost, CO2e; the share of time in each verdict; memory headroom. Groups are ranked by money wasted,
each with one line of why and the fix.

  gpuscope fleet report --prometheus http://prometheus:9090 --since 7d
  gpuscope fleet report --prometheus URL --since 7d --by job --prices prices.toml --html fleet.html
  gpuscope fleet rules -o gpuscope-fleet-rules.yml     # load it in Prometheus (rule_files) for long ranges
                                                       # (with hourly tiles: --tile 1h, the default)

Every figure is computed by the server (sum_over_time, count_over_time, increase over the range, by the
GPU's and the group's labels); no raw points are pulled. docs/FLEET.md says what each figure means, exactly.
Exit status: 0 done, 1 the server cannot answer or holds no gpuscope series, 2 bad usage or input."""

REPORT_HELP = "the report: per group, ranked by money wasted (text; --html, --csv, --json files)"
RULES_HELP = "write the Prometheus recording rules the report reads over long ranges"
#: --since: a bare number from this on is a unix time, below it a duration in seconds.
UNIX_TIME_FROM = 1e9
BY_CHOICES = ("namespace", "pod", "job", "user", "node", "model")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="fleet_action", metavar="ACTION")
    r = sub.add_parser("report", help=REPORT_HELP, description=REPORT_HELP + ".")
    r.add_argument("--prometheus", required=True, metavar="URL",
                   help="the server that scrapes the agents, e.g. http://prometheus:9090")
    r.add_argument("--since", default="7d", metavar="WHEN",
                   help="the range's start: a duration back from --until (7d, 24h, 90m, 3600) or a time (RFC 3339, "
                        "or unix seconds: a number from 10^9 on); default 7d")
    r.add_argument("--until", default="now", metavar="WHEN",
                   help="the range's end: now (default), -1h (an hour ago; --until -1h or --until=-1h), RFC 3339 or "
                        "unix seconds")
    r.add_argument("--by", default="namespace", choices=BY_CHOICES, metavar="DIMENSION",
                   help="group by namespace (default), pod, job (the agents' workload label: Slurm job, torchrun "
                        "run, a pod's owner), user (of the GPUs' processes), node or model")
    r.add_argument("--prices", metavar="FILE",
                   help="a TOML prices file ([gpu_hour] per model, energy_per_kwh, grid_kg_co2e_per_kwh, currency); "
                        "defaults in docs/FLEET.md")
    r.add_argument("--html", metavar="FILE", help="write the report as one self-contained HTML page")
    r.add_argument("--csv", metavar="FILE", help="write one CSV row per group")
    r.add_argument("--json", metavar="FILE", help="write the whole report as JSON ('-': to stdout, alone)")
    r.add_argument("--source", default="auto", choices=("auto", "raw", "recorded", "tiles"),
                   help="auto (default): the tiles of `gpuscope fleet rules` where a complete record of them covers "
                        "the range (not for --by user), else its recorded series where they cover it, else subqueries "
                        "over the raw ones (the JSON's source_note says why not tiles); raw: always the raw ones; "
                        "recorded: only the recorded; tiles: only the tiles")
    r.add_argument("--top", type=int, default=15, metavar="N", help="groups in the text output (default 15)")
    r.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="seconds to wait for each query (default 120)")
    r.add_argument("--prometheus-token-file", metavar="PATH",
                   help="a file holding a bearer token the server wants (sent as 'Authorization: Bearer <token>')")
    r.add_argument("--prometheus-header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="a header sent with every query (repeatable), e.g. 'X-Scope-OrgID: gpu' for Mimir, or "
                        "'Authorization: Basic ...'")
    # `--until -1h`: argparse takes an argument that starts with '-' for an option unless it looks like a
    # negative number; a negative duration is one here (`--until=-1h` works whatever argparse does).
    r._negative_number_matcher = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d+(\.\d+)?(ms|s|m|h|d|w)$")
    w = sub.add_parser("rules", help=RULES_HELP, description=RULES_HELP + " (a Prometheus rule file).")
    w.add_argument("-o", "--output", metavar="FILE", help="where to write them (default: stdout)")
    w.add_argument("--scrape-interval", default="15s", metavar="DURATION",
                   help="the agents' scrape interval: a sample counts while at most 1.5 of it old (default 15s)")
    w.add_argument("--interval", metavar="DURATION",
                   help="how often Prometheus evaluates the rules (default: the scrape interval)")
    w.add_argument("--tile", default="1h", metavar="DURATION",
                   help="the tile group's length (default 1h: a week is 168 tiles): evaluated once a tile, it records "
                        "what the raw series held in the tile before, so the report reads a week as 168 samples a "
                        "series; at least twice the scrape interval, at most 1d")


def _range(since: str, until: str) -> tuple[float, float]:
    from ..errors import UsageError
    from ..timeparse import TimeError, parse_duration, parse_time

    now = time.time()
    end = parse_time(until, now, "--until") / 1e9
    text = since.strip()
    if text.startswith("-"):
        raise UsageError(f"--since {since!r}: give a duration back from --until (such as 7d), without a minus "
                         "sign, or a time.")
    try:  # a bare number past 10^9 is unix seconds (2001 on), anything else a duration back from --until
        bare = float(text)
    except ValueError:
        bare = None
    if bare is not None and bare >= UNIX_TIME_FROM:
        start = parse_time(text, now, "--since") / 1e9
    else:
        try:
            start = end - parse_duration(text, "--since")
        except TimeError as e:
            if bare is not None:
                raise
            try:
                start = parse_time(text, now, "--since") / 1e9
            except TimeError:
                raise e from None
    if start >= end:
        raise UsageError(f"The range is empty or inverted: --since {since!r} is not before --until {until!r}.")
    if start < 0:
        raise UsageError(f"--since {since!r} reaches back before 1970.")
    return start, end


def _outputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    from .._args import check_writable
    from ..errors import UsageError

    outs = [(flag, path) for flag, path in (("--html", args.html), ("--csv", args.csv), ("--json", args.json))
            if path and path != "-"]
    for flag, path in outs:
        check_writable(flag, path)
    seen: dict[str, str] = {}
    import os

    for flag, path in outs:
        real = os.path.realpath(path)
        if real in seen:
            raise UsageError(f"{seen[real]} and {flag} name the same file {path}; give each its own.")
        seen[real] = flag
    if args.prices:
        for flag, path in outs:
            if os.path.realpath(path) == os.path.realpath(args.prices):
                raise UsageError(f"{flag} {path} would overwrite the prices file it reads; name another file.")
    return outs


class _Bar:
    """A progress bar on stderr while the queries run; nothing when stderr is not a terminal."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.on = bool(getattr(stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()

    def __call__(self, done: int, total: int, what: str) -> None:
        if not self.on:
            return
        width = 28
        k = int(width * done / max(1, total))
        line = f"\rquerying [{'#' * k}{'.' * (width - k)}] {done}/{total} {what[:28]:<28} {time.monotonic() - self.t0:5.1f}s"
        self.stream.write(line)
        self.stream.flush()

    def close(self) -> None:
        if self.on:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _report(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..http.net import parse_upstream
    from ..promql import Client
    from . import _prices
    from ._compute import build

    url = parse_upstream(args.prometheus, "--prometheus", "http://prometheus:9090")
    start, end = _range(args.since, args.until)
    if args.top < 1:
        raise UsageError(f"--top must be at least 1, not {args.top}.")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, not {args.timeout:g}.")
    outs = _outputs(args)
    prices = _prices.load(args.prices) if args.prices else _prices.DEFAULT
    headers = _headers(args.prometheus_header, args.prometheus_token_file)
    bar = _Bar(sys.stderr)
    try:
        report = build(Client(url, timeout=args.timeout, headers=headers), start, end, args.by, prices, progress=bar,
                       source=args.source)
    finally:
        bar.close()
    _write(report, outs)
    if args.json == "-":
        import json

        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        from ._html import text

        sys.stdout.write(text(report, args.top))
    return 0


def _headers(given: list[str], token_file: str | None) -> dict[str, str]:
    """--prometheus-header 'Name: value' and --prometheus-token-file as request headers (never echoed)."""
    from ..errors import UsageError

    out: dict[str, str] = {}
    for h in given:
        name, sep, value = h.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", name) or not value or "\n" in value or \
                "\r" in value:
            raise UsageError(f"--prometheus-header takes 'Name: value' (a header name, a colon, a value on one line), "
                             f"not {name[:40]!r}{'...' if sep else ''}.")
        out[name] = value
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read(64 * 1024).strip()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or "not UTF-8 text"
            raise UsageError(f"--prometheus-token-file {token_file} cannot be read: {why}.") from None
        if not token or any(c.isspace() for c in token):
            raise UsageError(f"--prometheus-token-file {token_file} must hold one token (no spaces), and it is "
                             f"{'empty' if not token else 'more than one word'}.")
        out["Authorization"] = f"Bearer {token}"
    return out


def _write(report: dict[str, Any], outs: list[tuple[str, str]]) -> None:
    """Every file whole or not at all: each is rendered first, then written through a temporary file."""
    import json

    from ..errors import UsageError
    from ..report.htmlpage import write_atomic
    from ._html import csv_text, render_html

    texts = []
    for flag, path in outs:
        if flag == "--html":
            texts.append((flag, path, render_html(report)))
        elif flag == "--csv":
            texts.append((flag, path, csv_text(report)))
        else:
            texts.append((flag, path, json.dumps(report, indent=1) + "\n"))
    for flag, path, body in texts:
        try:
            write_atomic(path, body)
        except OSError as e:
            raise UsageError(f"{flag} {path} could not be written: {e.strerror or e}.") from None


def _rules(args: argparse.Namespace) -> int:
    from .._args import check_writable
    from ..errors import UsageError
    from ..report.htmlpage import write_atomic
    from ..timeparse import parse_duration
    from ._tiles import rules_yaml

    scrape = parse_duration(args.scrape_interval, "--scrape-interval")
    every = parse_duration(args.interval, "--interval") if args.interval else None
    tile = parse_duration(args.tile, "--tile")
    if not 2 * scrape <= tile <= 86400:
        raise UsageError(f"--tile {args.tile} must be at least twice the scrape interval ({2 * scrape:g} s) and at "
                         "most 1d.")
    body = rules_yaml(scrape, every, tile)
    if args.output and args.output != "-":
        check_writable("--output", args.output)
        try:
            write_atomic(args.output, body)
        except OSError as e:
            raise UsageError(f"--output {args.output} could not be written: {e.strerror or e}.") from None
        print(f"wrote {args.output}: load it in Prometheus (rule_files) and `gpuscope fleet report` reads the "
              "recorded series.", file=sys.stderr)
    else:
        sys.stdout.write(body)
    return 0


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError

    action = getattr(args, "fleet_action", None)
    if action == "report":
        return _report(args)
    if action == "rules":
        return _rules(args)
    raise UsageError("Say what to do: gpuscope fleet report|rules (see 'gpuscope fleet --help').")
