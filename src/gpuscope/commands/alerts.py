"""`gpuscope alerts`: check alert rule files, export them for Prometheus, list an agent's alerts."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .._args import Parser, check_not_input
from ..errors import EXIT_OK, UsageError

HELP = "check alert rule files, export them for Prometheus, list an agent's alerts"
DESCRIPTION = "Alert rules (TOML or YAML) on metrics and verdicts; see the README's Alerts section for the format."


def add_arguments(p: argparse.ArgumentParser) -> None:
    alsub = p.add_subparsers(dest="alerts_verb", metavar="ACTION", parser_class=Parser)
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
    alist.add_argument("--token", default=None,
                       help="bearer token (default $GPUSCOPE_TOKEN, else the local agent's token file)")
    alist.add_argument("--json", action="store_true", help="print the agent's answer as JSON")


def run(args: argparse.Namespace) -> int:
    from ..alerts import load_rules, to_prometheus

    if args.alerts_verb is None:
        raise UsageError("Say what to do: gpuscope alerts check|export-rules|list (see 'gpuscope alerts --help').")
    if args.alerts_verb == "list":
        return _alerts_list(args)
    if args.alerts_verb == "export-rules" and not args.group.strip():
        raise UsageError("--group must name the rule group, such as --group gpuscope.")
    rules = load_rules(args.files, builtins=not args.no_builtins)  # a RuleError is a UsageError
    if args.alerts_verb == "check":
        own = [r for r in rules if r.source != "built-in"]
        print(f"ok: {len(own)} rule(s) from {', '.join(args.files)}; {len(rules)} rule(s) in all with the built-ins"
              if not args.no_builtins else f"ok: {len(rules)} rule(s) from {', '.join(args.files)}")
        return EXIT_OK
    if args.out != "-":
        check_not_input("--out", args.out, args.files)
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
    from ..agent.client import default_url, find_token, get_json

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
        from ..agent.client import ClientError

        raise ClientError(f"{url} answered /api/v1/alerts with alerts this version cannot read; is it a gpuscope "
                          "agent?") from None
    print("\n".join(lines))
    return EXIT_OK
