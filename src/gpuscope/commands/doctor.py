"""`gpuscope doctor`: what this machine supports, per GPU and metric, and why not."""

from __future__ import annotations

import argparse
import json

from .._args import add_source_args, check_sim
from .._nvml import NvmlUnavailable
from ..errors import EXIT_OK

HELP = "what this machine supports, per GPU and metric, and why not"
DESCRIPTION = ("Checks the driver, NVML, GPM, permissions and processes, and lists for every metric whether this "
               "machine supports it and, if not, why. With --json a machine without a usable driver is a JSON "
               "answer too (available: false, with the reason), exit 1.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_args(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _tracing() -> dict:
    """Whether `gpuscope trace` can trace native CUDA programs here (the injection library), and why not."""
    from ..trace.inject import availability

    try:
        return {"injection": availability()}
    except Exception as e:  # noqa: BLE001 - a check that breaks must not hide the rest of the report
        return {"injection": {"works": False, "reason": f"the check failed: {type(e).__name__}: {e}"}}


def run(args: argparse.Namespace) -> int:
    from .. import doctor

    check_sim(args)
    try:
        report = doctor.run(args.simulate, args.gpus)
    except NvmlUnavailable as e:
        tracing = _tracing()
        if not args.json:
            print("\n".join(doctor.tracing_lines(tracing)))
            raise
        # A script asked: the answer stays JSON, with the reason, and the exit code still says "not here".
        print(json.dumps({"available": False, "reason": str(e), "simulated": None, "gpus": [], "tracing": tracing},
                         indent=2))
        return e.exit_code
    report = {"available": True, **report, "tracing": _tracing()}
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(doctor.render(report))
    return EXIT_OK
