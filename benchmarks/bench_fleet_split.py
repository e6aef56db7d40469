"""The counters' split on tests/test_fleet_truths.py's fleet: how many groups' energy or throttling is off the
simulation's truth by more than 1 % (or 0.001 kWh / h under 0.1), per `--by` and server, and how long the report
over raw series takes.

That fleet is the hard case: pods 12 times shorter than the benchmark's (minutes to hours), 10-minute tiles, label
sets that recur, a node powered off and a gap in scraping (tests/test_fleet_truths.py). It is written with the
simulator, backfilled into a real Prometheus and imported into a real VictoriaMetrics (Debian packages).

    python benchmarks/bench_fleet_split.py [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", dest="json_out", type=Path, help="write the figures here")
    args = ap.parse_args()
    import test_fleet_truths as fleet

    out: dict[str, dict[str, dict[str, object]]] = {}
    world = fleet.World(Path(tempfile.mkdtemp(prefix="gpuscope-split-")))
    try:
        for server in ("prometheus", "victoria-metrics"):
            for dim in fleet.DIMS:
                t0 = time.monotonic()
                got = fleet._groups(world.report(server, dim))
                took = time.monotonic() - t0
                want = world.truth[dim]
                off = []
                for group, t in want.items():
                    if group not in got:
                        continue
                    for figure in ("energy_kwh", "throttled_hours"):
                        if abs(got[group][figure] - t[figure]) > max(0.01 * t[figure], 0.001):
                            off.append([group, figure, round(got[group][figure], 4), round(float(t[figure]), 4)])
                out.setdefault(server, {})[dim] = {"groups": len(want), "off": len(off), "report_s": round(took, 2),
                                                   "examples": off[:3]}
                print(f"{server:17} --by {dim:9} {len(off):3} of {len(want):3} groups off, report {took:.2f} s",
                      flush=True)
    finally:
        world.stop()
    if args.json_out:
        args.json_out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
