"""`gpuscope <verb>`. Every error a user can cause ends in one sentence and a non-zero exit.

Exit codes: 0 ok, 1 the machine cannot do it (no driver, no GPU, no agent), 2 bad usage or input. Every
such error is a `gpuscope.errors.UserError` carrying its exit code, caught once in `main`.

Each verb is a module with HELP, optionally DESCRIPTION, add_arguments(parser) and run(args) -> int
(see gpuscope.commands); a new verb is one module and one line in VERBS.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from ._args import Parser
from ._version import __version__
from .errors import EXIT_OK, EXIT_USAGE, UsageError, UserError

# In the order `gpuscope --help` lists them.
VERBS = {
    "doctor": "gpuscope.commands.doctor",
    "sample": "gpuscope.commands.sample",
    "scenarios": "gpuscope.commands.scenarios",
    "diagnose": "gpuscope.commands.diagnose",
    "run": "gpuscope.commands.run",
    "agent": "gpuscope.commands.agent",
    "query": "gpuscope.commands.query",
    "export": "gpuscope.commands.export",
    "top": "gpuscope.commands.top",
    "alerts": "gpuscope.commands.alerts",
    "trace": "gpuscope.commands.trace",
    "profile": "gpuscope.commands.profile",
    "loadtest": "gpuscope.loadtest.cli",
    "capture": "gpuscope.loadtest.capture_cli",
    "guard": "gpuscope.guard.cli",
    "dashboard": "gpuscope.commands.dashboard",
    "fleet": "gpuscope.fleet.cli",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line's parser; with `only` (a verb), that verb's alone: a command imports only its
    own verb's module, not every verb's (a third of a second of start-up, paid by every run of every command)."""
    p = Parser(prog="gpuscope", description="The truth about how well NVIDIA GPUs are used.",
               epilog="Start with 'gpuscope doctor' (what this machine can measure); without a GPU, try "
                      "'gpuscope top --simulate mixed'. 'gpuscope VERB --help' explains each verb. "
                      "Exit status: 0 done, 1 the machine cannot do it (no driver, no agent, nothing there), "
                      "2 bad usage or input.")
    p.add_argument("--version", action="version", version=f"gpuscope {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the sampler does")
    sub = p.add_subparsers(dest="verb", metavar="VERB", parser_class=Parser)
    for verb, module in VERBS.items():
        if only is not None and verb != only:
            continue
        mod = importlib.import_module(module)
        mod.add_arguments(sub.add_parser(verb, help=mod.HELP, description=getattr(mod, "DESCRIPTION", None)))
    return p


def _verb(argv: list[str]) -> str | None:
    """The verb argv names (the first word that is no option: the global options take no value), if any."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in VERBS else None


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    verb = _verb(words)
    if verb == "trace":  # `gpuscope trace [options] -- CMD` is `gpuscope trace run ...`
        from .commands.trace import ACTIONS
        from .trace.run import with_run_action

        words = with_run_action(words, ACTIONS)
    if verb is None and words and words[0] == "--version":
        print(f"gpuscope {__version__}")
        return EXIT_OK
    # every verb's parser only where the words name none: --help, a misspelt verb
    parser = build_parser(verb)
    try:
        args, extra = parser.parse_known_args(words)
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
        return int(importlib.import_module(VERBS[args.verb]).run(args))
    except UserError as e:  # every one-sentence error: UsageError, ConfigError, ClientError, TraceError, ...
        print(f"gpuscope: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    # Run as `python -m gpuscope.cli`, this file is loaded twice (as __main__ and as gpuscope.cli): call the
    # package's main so that one copy of everything is used.
    from gpuscope.cli import main as _package_main

    sys.exit(_package_main())
