"""What `gpuscope trace` costs a training loop, beside the PyTorch profiler driven by hand (GPU machine).

    python benchmarks/bench_trace_overhead.py [--workloads DIR] [--seconds 10] [--delay 2] [--duration 3]

For launch_bound, healthy_training and compute_bound (each prints steps_per_s over its whole run),
one after the other on the same GPU: plain; under `gpuscope trace --delay D --duration T`; and under
torch.profiler.profile(activities=[CPU, CUDA], with_stack=True, record_shapes=False) started and
stopped by the workload's own loop for the same window (after D s, for T s) and exported gzipped, as
tests/fixtures/traces/capture.py drives it. Prints each one's steps/s, its overhead against plain, and
the ratio of our overhead to the profiler's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

NAMES = ["launch_bound", "healthy_training", "compute_bound"]

# Runs a workload with the profiler driven from its own step loop: the hand-written equivalent.
DIRECT = '''
import runpy, sys, time
sys.path.insert(0, sys.argv[1])
import _common, torch
from torch.profiler import ProfilerActivity, profile

delay, duration, out = float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]

def traced_run_for(seconds, step):
    # As tests/fixtures/traces/capture.py drives it (a `with` block on the loop's own thread), which is
    # what ran cleanly on the H200; the export is inside the timed run, as a hand-written one would be.
    t0 = time.time()
    n = 0
    while time.time() - t0 < delay:
        step()
        n += 1
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                 record_shapes=False) as prof:
        t1 = time.time()
        while time.time() - t1 < duration:
            step()
            n += 1
        torch.cuda.synchronize()
    prof.export_chrome_trace(out)
    while time.time() - t0 < seconds:
        step()
        n += 1
    torch.cuda.synchronize()
    print(f"steps={n} steps_per_s={n / (time.time() - t0):.2f}", flush=True)

_common.run_for = traced_run_for
sys.argv = [sys.argv[2], "--seconds", sys.argv[6]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def steps_per_s(cmd: list[str], cwd: Path) -> float:
    p = subprocess.run(cmd, cwd=str(cwd), capture_output=True, text=True, timeout=300)
    m = re.search(r"steps_per_s=([0-9.]+)", p.stdout)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {p.returncode}): {p.stderr[-1500:]}")
    return float(m.group(1))


def _kernels(path: Path) -> int:
    from gpuscope.trace import kineto
    from gpuscope.trace.model import EventKind

    return int((kineto.load(path).events["kind"] == EventKind.KERNEL).sum())


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", type=Path,
                    default=Path(os.environ.get("GPUSCOPE_WORKLOADS", root.parent / "shared" / "workloads")))
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--delay", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--names", nargs="*", default=NAMES)
    a = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        direct = Path(tmp) / "direct.py"
        direct.write_text(DIRECT)
        print(f"{'workload':18} {'plain':>9} {'gpuscope':>9} {'profiler':>9} {'ours %':>7} {'prof %':>7} {'ratio':>6}")
        for name in a.names:
            script = a.workloads / f"{name}.py"
            plain = steps_per_s([py, str(script), "--seconds", str(a.seconds)], a.workloads)
            ours = steps_per_s([py, "-m", "gpuscope.cli", "trace", "--out", str(Path(tmp) / name), "--delay",
                                str(a.delay), "--duration", str(a.duration), "--", py, str(script), "--seconds",
                                str(a.seconds)], a.workloads)
            prof = steps_per_s([py, str(direct), str(a.workloads), str(script), str(a.delay), str(a.duration),
                                str(Path(tmp) / f"{name}.direct.pt.trace.json.gz"), str(a.seconds)], a.workloads)
            written = sorted((Path(tmp) / name).glob("*.pt.trace.json.gz"))
            if not written:
                raise SystemExit(f"{name}: gpuscope trace wrote no trace, so its figure would mean nothing")
            kernels = _kernels(written[0])
            o_ours, o_prof = (1 - ours / plain) * 100, (1 - prof / plain) * 100
            ratio = f"{o_ours / o_prof:6.2f}" if abs(o_prof) > 0.5 else "     -"
            print(f"{name:18} {plain:9.1f} {ours:9.1f} {prof:9.1f} {o_ours:7.1f} {o_prof:7.1f} {ratio}"
                  f"   (our trace: {kernels} kernels)", flush=True)
    print(f"(steps/s over each whole {a.seconds:g} s run, traced {a.duration:g} s after {a.delay:g} s; "
          "overhead % = 1 - traced/plain; ratio = ours / profiler's)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
