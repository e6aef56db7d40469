"""`gpuscope profile`'s merge of many agents' folded profiles: time and memory, by how many are merged.

    python benchmarks/bench_profile_merge.py [--profiles 64,512,4096]

The profiles are the nine golden traces (tests/fixtures/traces) folded once, dealt round-robin to N ranks:
rank i is pid 10000+i on node i//8, job torchrun/run-(i%4), as a fleet of 8-GPU nodes running four jobs of
the same code would be (the same stacks under other labels: what a fleet merge meets). Each rank's profile is
the JSON an agent answers. Per N, a child process (so that its peak RSS is the merge's alone) reads every
answer (json + the folded form's checks), merges them, writes the pprof (gzip-compressed profile.proto) and
the speedscope JSON, and reports each phase's time, its peak RSS and its RSS once gpuscope was imported (before the answers were read).
pprof-format (tests/pprof_reader, node) then decodes the pprof, as a check that what was measured is valid.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "tests" / "fixtures" / "traces"

CHILD = r"""
import json, os, resource, sys, time
from gpuscope.trace.profile import Profile, merge
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
src = sys.argv[1]
names = sorted(os.listdir(src))
raw = [open(os.path.join(src, n), "rb").read() for n in names]
t0 = time.perf_counter()
profiles = [Profile.from_json(json.loads(b)) for b in raw]
t1 = time.perf_counter()
merged = merge(profiles)
t2 = time.perf_counter()
pprof = merged.pprof()
t3 = time.perf_counter()
speedscope = json.dumps(merged.speedscope()).encode()
t4 = time.perf_counter()
open(sys.argv[2], "wb").write(pprof)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"read_s": t1 - t0, "merge_s": t2 - t1, "pprof_s": t3 - t2, "speedscope_s": t4 - t3,
                  "input_bytes": sum(map(len, raw)), "pprof_bytes": len(pprof), "speedscope_bytes": len(speedscope),
                  "samples": len(merged.samples), "frames": len(merged.frames), "total_ns": merged.total_ns,
                  "peak_rss_bytes": rss * 1024, "start_rss_bytes": rss0 * 1024}))
"""


def folded_golden() -> list[dict]:
    from gpuscope.trace.kineto import load
    from gpuscope.trace.profile import fold

    return [fold(load(p)).to_json() for p in sorted(TRACES.glob("*.pt.trace.json.gz"))]


def rank_doc(base: dict, i: int) -> dict:
    labels = {"node": f"node-{i // 8:04d}", "job": f"torchrun/run-{i % 4}", "pid": str(10000 + i)}
    return {**base, "samples": [[s[0], labels, s[2], s[3]] for s in base["samples"]],
            "windows": [{**w, **labels, "pid": 10000 + i} for w in base["windows"]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="64,512,4096", help="how many ranks' profiles to merge, comma-separated")
    args = ap.parse_args()
    golden = folded_golden()
    golden_ns = [sum(s[2] for s in g["samples"]) for g in golden]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(f"{'profiles':>8} {'input MB':>9} {'read s':>7} {'merge s':>8} {'pprof s':>8} {'speedscope s':>12} "
          f"{'total s':>8} {'RSS MB start/peak':>17} {'pprof kB':>9} {'samples':>8}  decoded")
    for n in (int(x) for x in args.profiles.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "answers"
            src.mkdir()
            for i in range(n):
                (src / f"{i:06d}.json").write_text(json.dumps(rank_doc(golden[i % len(golden)], i)))
            out = Path(tmp) / "merged.pb.gz"
            r = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out)], env=env, capture_output=True,
                               text=True, check=True)
            m = json.loads(r.stdout)
            assert m["total_ns"] == sum(golden_ns[i % len(golden)] for i in range(n))
            decoded = "-"
            if shutil.which("node") and (ROOT / "tests" / "pprof_reader" / "node_modules").is_dir():
                d = json.loads(subprocess.run(["node", str(ROOT / "tests" / "pprof_reader" / "decode.js"), str(out)],
                                              capture_output=True, text=True, check=True).stdout)
                ok = sum(s["values"][0] for s in d["samples"]) == m["total_ns"]
                decoded = f"pprof-format: {len(d['samples'])} samples, totals {'equal' if ok else 'DIFFER'}"
            total = m["read_s"] + m["merge_s"] + m["pprof_s"] + m["speedscope_s"]
            print(f"{n:>8} {m['input_bytes'] / 1e6:>9.1f} {m['read_s']:>7.2f} {m['merge_s']:>8.2f} {m['pprof_s']:>8.2f} "
                  f"{m['speedscope_s']:>12.2f} {total:>8.2f} {m['start_rss_bytes'] / 1e6:>8.0f}/{m['peak_rss_bytes'] / 1e6:<8.0f} "
                  f"{m['pprof_bytes'] / 1e3:>9.0f} {m['samples']:>8}  {decoded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
