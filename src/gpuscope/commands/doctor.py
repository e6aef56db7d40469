"""`gpuscope doctor`: what this machine supports, per GPU and metric, and why not."""

from __future__ import annotations

import argparse
import json

from .._args import add_source_args, check_sim
from ..errors import EXIT_OK

HELP = 'what this machine supports, per GPU and metric, and why not'
DESCRIPTION = 'Checks the driver, NVML, GPM, permissions and processes, and lists for every metric whether this machine supports it and, if not, why.'


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_args(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from .. import doctor

    check_sim(args)
    report = doctor.run(args.simulate, args.gpus)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(doctor.render(report))
    return EXIT_OK
