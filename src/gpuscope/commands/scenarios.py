"""`gpuscope scenarios`: list the simulated scenarios."""

from __future__ import annotations

import argparse

from ..errors import EXIT_OK

HELP = 'list the simulated scenarios'
DESCRIPTION = ("The scenarios that --simulate takes (agent, top, diagnose, sample, run, doctor, trace run): "
               "simulated GPUs that show one bottleneck or failure each, for trying gpuscope without a GPU.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    del p


def run(args: argparse.Namespace) -> int:
    from ..sim import SCENARIOS, describe

    for s in SCENARIOS:
        print(f"{s:<16} {describe(s)}")
    return EXIT_OK
