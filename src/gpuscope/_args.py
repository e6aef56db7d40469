"""The argparse helpers every verb shares: the parser that ends in one sentence, durations, the
simulated-node flags, and the checks made before a command runs (outputs that would overwrite their
inputs, reports that could not be written later).

Every failure is a `UsageError` (exit 2) naming the flag and what was typed:

>>> p = Parser(prog="gpuscope demo")
>>> _ = p.add_argument("--every", type=interval)
>>> p.parse_args(["--every", "250ms"]).every
0.25
>>> try:
...     p.parse_args(["--every", "soon"])
... except UsageError as e:
...     print(e)
Argument --every: the duration 'soon' is not a duration such as 1s, 30s, 5m or 1h (see 'gpuscope demo --help').
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

from ._choices import did_you_mean
from .errors import UsageError
from .timeparse import TimeError, parse_duration, parse_time

__all__ = ["Parser", "add_source_args", "check_data_dir", "check_not_input", "check_sim", "check_writable",
           "interval", "time_range"]


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one sentence, exit 2, no usage dump
        message = message.rstrip(".")
        where = " ".join(["gpuscope", *self.prog.split()[1:], "--help"])  # 'gpuscope alerts check --help'
        raise UsageError(f"{message[0].upper()}{message[1:]} (see '{where}').")


def interval(text: str) -> float:
    """Seconds, or a duration with a unit: 100ms, 0.5s, 2s, 1m (an argparse `type=`)."""
    try:
        return parse_duration(text, "the duration")
    except TimeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def time_range(args: argparse.Namespace) -> tuple[int, int]:
    """--start (or --since back from now) and --end, in ns; one sentence when they make no range."""
    now = time.time()
    if args.start:
        start_ns = parse_time(args.start, now, "--start")
    else:  # a duration back from now; its errors quote what the user typed, not '-' + it
        back_s = parse_duration(args.since, "--since")
        if back_s > now:
            raise UsageError(f"--since {args.since!r} reaches back before 1970.")
        start_ns = int((now - back_s) * 1e9)
    end_ns = parse_time(args.end, now, "--end")
    if end_ns <= start_ns:
        raise UsageError("--end must be after --start.")
    return start_ns, end_ns


def add_source_args(p: argparse.ArgumentParser, processes: bool = False) -> None:
    """--simulate SCENARIO, --gpus N (and --processes N) for verbs that can read a simulated node."""
    from .sim import SCENARIOS

    p.add_argument("--simulate", metavar="SCENARIO",
                   help=f"use a simulated node instead of the real GPUs; one of: {', '.join(SCENARIOS)}")
    p.add_argument("--gpus", type=int, metavar="N", help="number of simulated GPUs (with --simulate)")
    if processes:
        p.add_argument("--processes", type=int, metavar="N",
                       help="number of simulated processes, dealt over the GPUs (with --simulate; default one per GPU)")


def check_sim(args: argparse.Namespace) -> None:
    """The flags of `add_source_args` make sense together, and the scenario exists."""
    from .sim import SCENARIOS, UnknownScenario

    if args.gpus is not None and args.simulate is None:
        raise UsageError("--gpus only applies to a simulated node; add --simulate SCENARIO.")
    if args.simulate is not None and args.simulate.replace("-", "_") not in SCENARIOS:
        raise UsageError(str(UnknownScenario(f"Unknown scenario '{args.simulate}'; " + did_you_mean(
            args.simulate.replace("-", "_"), SCENARIOS, f"choose one of: {', '.join(SCENARIOS)}."))))
    if args.gpus is not None and not 1 <= args.gpus <= 64:
        raise UsageError(f"--gpus must be between 1 and 64, not {args.gpus}.")
    processes = getattr(args, "processes", None)
    if processes is not None and args.simulate is None:
        raise UsageError("--processes only applies to a simulated node; add --simulate SCENARIO.")
    if processes is not None and not 1 <= processes <= 4096:
        raise UsageError(f"--processes must be between 1 and 4096, not {processes}.")


def check_not_input(flag: str, out: str, inputs: Sequence[str]) -> None:
    """One sentence when `out` is one of the files (or inside one of the directories) being read: writing it
    would destroy what it was made from (a trace, a rule file, the store's database)."""
    target = os.path.realpath(out)
    for given in inputs:
        src = os.path.realpath(given)
        if target == src:
            raise UsageError(f"{flag} {out} would overwrite {given}, which it is made from; name another file.")
        if os.path.isdir(src) and os.path.commonpath([target, src]) == src:
            raise UsageError(f"{flag} {out} is inside {given}, which it is made from; name a file elsewhere.")


def check_writable(flag: str, path: str | None) -> None:
    """One sentence now when a report could not be written at `path` later (a directory, no parent)."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a directory; name a file in it.")
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: {parent} is not an existing directory.")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {path}: the directory {parent} is not writable.")


def check_data_dir(path: str | None, flag: str = "--data-dir") -> None:
    """One sentence when a data directory the user named is a file, or lies below one (mkdir would say
    'File exists' or 'Not a directory'). A directory that does not exist yet is left to the caller."""
    if not path:
        return
    full = os.path.abspath(os.path.expanduser(path))
    below = full
    while not os.path.lexists(below) and os.path.dirname(below) != below:
        below = os.path.dirname(below)
    if os.path.lexists(below) and not os.path.isdir(below):
        if below == full:
            raise UsageError(f"{flag} {path} is a file, not a directory.")
        raise UsageError(f"{flag} {path} lies below {below}, which is a file, not a directory.")
