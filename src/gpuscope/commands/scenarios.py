"""`gpuscope scenarios`: list the simulated scenarios."""

from __future__ import annotations

import argparse

from ..errors import EXIT_OK

HELP = 'list the simulated scenarios'


def add_arguments(p: argparse.ArgumentParser) -> None:
    del p


def run(args: argparse.Namespace) -> int:
    from ..sim import SCENARIOS, describe

    for s in SCENARIOS:
        print(f"{s:<16} {describe(s)}")
    return EXIT_OK
