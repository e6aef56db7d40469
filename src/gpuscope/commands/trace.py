"""`gpuscope trace`: trace CUDA programs unchanged (PyTorch, CuPy, Numba, JAX) and analyse the traces."""

from __future__ import annotations

import argparse
import importlib

from .._args import Parser
from ..errors import UsageError

# `gpuscope trace ACTION`: each action is a module with HELP, add_arguments(parser) and run(args) -> int;
# a new action is one line here.
ACTIONS = {"analyze": "gpuscope.trace.cli_analyze", "run": "gpuscope.trace.run", "merge": "gpuscope.trace.merge",
           "flame": "gpuscope.trace.cli_flame", "fleet": "gpuscope.trace.fleet"}

HELP = 'trace CUDA programs unchanged (PyTorch, CuPy, Numba, JAX) and analyse the traces'
DESCRIPTION = 'Traces of what a program did on the CPU and the GPUs, and why the GPUs waited.'


def add_arguments(p: argparse.ArgumentParser) -> None:
    trsub = p.add_subparsers(dest="trace_verb", metavar="ACTION", parser_class=Parser)
    for action, module in ACTIONS.items():
        mod = importlib.import_module(module)
        mod.add_arguments(trsub.add_parser(action, help=mod.HELP))


def run(args: argparse.Namespace) -> int:

    if args.trace_verb is None:
        raise UsageError(f"Say what to do: gpuscope trace {'|'.join(ACTIONS)} (see 'gpuscope trace --help').")
    return int(importlib.import_module(ACTIONS[args.trace_verb]).run(args))  # a TraceError is a UsageError
