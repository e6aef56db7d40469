"""What the CUPTI backend of `gpuscope trace` costs a launch-bound CuPy loop, beside cupti-python used the
naive way (GPU machine with cupy and cupti-python).

    python benchmarks/bench_trace_cupti.py [--seconds 3] [--repeat 2]

A loop of tiny CuPy kernels (`x += 1` on one float, about 100 k launches/s) runs for --seconds, one run
after the other on the same GPU: plain; under `gpuscope trace --backend cupti` (default record kinds:
kernels, copies, memsets, syncs, the rules' API calls with stacks) with the whole loop inside the
window; the same with `--api all`; and the peer: the loop with cupti-python enabled by its own code the
way NVIDIA's sample does it (cupti_common.default_activity_list's kinds that apply here: CONCURRENT_KERNEL,
RUNTIME, DRIVER, MEMCPY, MEMSET, SYNCHRONIZATION, 8 MiB buffers, every record walked). Prints each
one's launches/s (best of --repeat), its overhead against plain, and our overhead against the peer's.
The traces' export after the loop is not in the figure (the program's own time is).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

LOOP = '''
import sys, time
import cupy as cp

if sys.argv[2] == "peer":
    from cupti import cupti
    seen = [0]

    def requested():
        return 8 << 20, 0

    def completed(activities):
        for a in activities:  # what a naive tool does with each record: read it
            seen[0] += a.kind

    cupti.activity_register_callbacks(requested, completed)
    for k in ("CONCURRENT_KERNEL", "RUNTIME", "DRIVER", "MEMCPY", "MEMSET", "SYNCHRONIZATION"):
        cupti.activity_enable(getattr(cupti.ActivityKind, k))

seconds = float(sys.argv[1])
x = cp.zeros(1, dtype=cp.float32)
x += 1
cp.cuda.Device().synchronize()
time.sleep(0.3)  # a traced run's window opens at the context: be inside it
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < seconds:
    for _ in range(100):
        x += 1
    n += 100
cp.cuda.Device().synchronize()
print(f"launches_per_s={n / (time.perf_counter() - t0):.1f}", flush=True)
if sys.argv[2] == "peer":
    cupti.activity_flush_all(1)
'''


def _run(cmd: list[str], env: dict[str, str]) -> float:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    m = re.search(r"launches_per_s=([\d.]+)", p.stdout)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"{' '.join(cmd[:6])}... failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return float(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        loop = os.path.join(tmp, "loop.py")
        with open(loop, "w") as f:
            f.write(LOOP)
        py = [sys.executable, loop, str(args.seconds)]
        traced = [sys.executable, "-m", "gpuscope.cli", "trace", "--backend", "cupti", "--delay", "0",
                  "--duration", str(args.seconds + 60), "--out", os.path.join(tmp, "t")]
        runs = {"plain": py + ["plain"],
                "gpuscope trace --backend cupti": traced + ["--", *py, "plain"],
                "gpuscope trace --backend cupti --api all": traced[:-2] + ["--out", os.path.join(tmp, "a"),
                                                                            "--api", "all", "--", *py, "plain"],
                "peer: cupti-python, sample's kinds": py + ["peer"]}
        best = {name: max(_run(cmd, env) for _ in range(args.repeat)) for name, cmd in runs.items()}
    plain = best["plain"]
    overhead = {name: (plain / v - 1) * 100 for name, v in best.items()}
    for name, v in best.items():
        print(f"{name:45s} {v:12.0f} launches/s  overhead {overhead[name]:7.1f} %")
    peer = overhead["peer: cupti-python, sample's kinds"]
    ours = overhead["gpuscope trace --backend cupti"]
    print(f"our overhead / peer's overhead: {ours / peer:.3f}" if peer > 0 else "peer showed no overhead")
    return 0


if __name__ == "__main__":
    sys.exit(main())
