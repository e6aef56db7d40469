"""A fleet trace at 64 nodes (issue 22): does the fan-out collect in 5 s, and what does merging 64 ranks cost?

    python benchmarks/bench_trace_fleet.py                       # 64 agents, then the merge of 64 ranks
    python benchmarks/bench_trace_fleet.py --agents 8 --mode full
    python benchmarks/bench_trace_fleet.py --merge-only --ranks 64

Fan-out: --agents agents on loopback, each with one program opted in on demand (the real bootstrap, loaded
as `gpuscope trace --on-demand` loads it, with a fake `torch` whose profiler writes a small trace with an
all-reduce every 100 ms: no GPU needed), then `gpuscope trace fleet`'s trace_fleet() over them all, in this
process. --mode full runs `gpuscope agent --simulate healthy --gpus 1 --interval 1s` per node (about 65 MB
and a share of a core each: 64 of them saturate a 2-core machine); --mode light (the default) runs, per
node, a process serving the agent's real trace API (gpuscope.agent.trace_api: its routes, its ingest thread,
behind the agent's auth middleware) without the sampler and store. Printed: the phases (clocks: NTP-style
offsets of every agent; ask: the window requested of all; pull: from the window's end until every trace is
pulled, which includes the programs' stop and export and the 0.5 s polls), the collection (everything but
the window and its lead time) against the 5 s goal, and the clock figures: on one host every true offset
is 0, so each measured offset is that agent's skew.

Merge: --ranks copies of a checked-in trace (healthy_training, 42,418 events), one rank each, merged in a
child process: wall time, CPU time and peak RSS (ru_maxrss), `gpuscope trace merge`'s merge alone and the
fleet's (each trace read once, merged, analysed).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
BOOTSTRAP = SRC / "gpuscope" / "trace" / "bootstrap"
FIXTURE = ROOT / "tests" / "fixtures" / "traces" / "healthy_training.pt.trace.json.gz"
TOKEN = "bench-fleet-token-0123456789abcdef"
GOAL_S = 5.0
JOB = "slurm/bench"

FAKE_TORCH = {
    "__init__.py": "from . import cuda, profiler  # noqa: F401\n__version__ = '0.0+fake'\n",
    "cuda.py": "_on = False\ndef init():\n    global _on\n    _on = True\ndef is_initialized():\n    return _on\n",
    "profiler.py": textwrap.dedent('''
        import json, os, time
        class ProfilerActivity:
            CPU = "CPU"
            CUDA = "CUDA"
        class _ExperimentalConfig:
            def __init__(self, profile_all_threads=False):
                pass
        class profile:
            def __init__(self, **kw):
                pass
            def start(self):
                self.t0 = time.time_ns()
            def stop(self):
                self.t1 = time.time_ns()
            def export_chrome_trace(self, path):
                base, pid, ev = self.t0 // 10**9 * 10**9, os.getpid(), []
                tick, k = -(-self.t0 // 10**8) * 10**8, 0
                while tick + 2 * 10**7 < self.t1:
                    ts = (tick - base) / 1000.0
                    ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": pid,
                            "ts": ts - 100, "dur": 5.0, "args": {"correlation": k}},
                           {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                            "pid": 0, "tid": 7, "ts": ts, "dur": 5000.0,
                            "args": {"correlation": k, "device": 0, "stream": 7}}]
                    tick, k = tick + 10**8, k + 1
                with open(path, "w") as f:
                    json.dump({"schemaVersion": 1, "baseTimeNanoseconds": base, "traceEvents": ev}, f)
    '''),
}
PROG = "import time, torch\ntorch.cuda.init()\ntime.sleep(3600)\n"


# -- one light node: the agent's trace API alone ------------------------------------------------------
def serve(data_dir: str, port: int) -> None:
    import types

    from aiohttp import web

    from gpuscope.agent import trace_api
    from gpuscope.http.auth import AGENT_TOKEN_HINT, access

    face = types.SimpleNamespace(cfg=types.SimpleNamespace(data_path=Path(data_dir)), store=None, token=TOKEN,
                                 sampler=None, loopback_only=True)
    app = web.Application(middlewares=[access(token=TOKEN, loopback_only=True, server="agent",
                                              token_hint=AGENT_TOKEN_HINT)])
    trace_api.register(app, face)  # type: ignore[arg-type]
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "SLURM_JOB_ID", "PYTHONPATH")}
    e["PYTHONPATH"] = str(SRC)
    return e


def start_nodes(root: Path, n: int, mode: str) -> tuple[list[subprocess.Popen], list[str], list[Path]]:
    procs, urls, dirs = [], [], []
    for i in range(n):
        data = root / f"node{i}"
        (data / "trace-requests").mkdir(parents=True)
        (data / "traces").mkdir()
        (data / "token").write_text(TOKEN + "\n")
        os.chmod(data / "token", 0o600)
        port = free_port()
        if mode == "full":
            cmd = [sys.executable, "-m", "gpuscope.cli", "agent", "--port", str(port), "--data-dir", str(data),
                   "--interval", "1s", "--simulate", "healthy", "--gpus", "1"]
        else:
            cmd = [sys.executable, __file__, "--serve", str(data), str(port)]
        procs.append(subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
        dirs.append(data)
    return procs, urls, dirs


def start_programs(root: Path, dirs: list[Path]) -> list[subprocess.Popen]:
    fake = root / "fake"
    (fake / "torch").mkdir(parents=True)
    for name, text in FAKE_TORCH.items():
        (fake / "torch" / name).write_text(text)
    (fake / "prog.py").write_text(PROG)
    progs = []
    for i, data in enumerate(dirs):
        e = _env()
        e.update(PYTHONPATH=f"{BOOTSTRAP}{os.pathsep}{fake}", GPUSCOPE_TRACE_DIR=str(data / "traces"),
                 GPUSCOPE_TRACE_ON_DEMAND=str(data / "trace-requests"), GPUSCOPE_TRACE_STACK="0",
                 RANK=str(i), SLURM_JOB_ID=JOB.split("/")[1])
        progs.append(subprocess.Popen([sys.executable, str(fake / "prog.py")], env=e,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return progs


def wait_until(what, timeout: float, label: str) -> None:
    end = time.monotonic() + timeout
    while not what():
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {label}")
        time.sleep(0.25)


def _up(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/api/v1/clock", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def fanout(n: int, mode: str, duration_s: float, start_in_s: float) -> int:
    from gpuscope.trace import fleet

    root = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    nodes, progs = [], []
    try:
        t = time.monotonic()
        nodes, urls, dirs = start_nodes(root, n, mode)
        wait_until(lambda: all(_up(u) for u in urls), 600, f"{n} agents to answer")
        progs = start_programs(root, dirs)
        wait_until(lambda: all(any(d.joinpath("trace-requests").glob("proc.*.json")) for d in dirs), 600,
                   f"{n} programs to opt in")
        print(f"{n} nodes ({mode}) and {n} programs up in {time.monotonic() - t:.1f} s; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        out = root / "fleet.pt.trace.json.gz"
        work = root / "pulled"
        work.mkdir()
        s = fleet.trace_fleet(urls, JOB, duration_s, start_in_s, TOKEN, str(work), 10.0, str(out))
    finally:
        for p in progs + nodes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in progs + nodes:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
    ph = s["phases_s"]
    collect_s = ph["clocks"] + ph["ask"] + ph["pull"]
    offsets = [abs(a["offset_ns"]) / 1e6 for a in s["agents"] if a["offset_ns"] is not None]
    bounds = [a["offset_error_ns"] / 1e6 for a in s["agents"] if a["offset_error_ns"] is not None]
    starts = [r["start_error_ns"] / 1e6 for r in s["ranks"] if r["start_error_ns"] is not None]
    print(f"merged {len(s['ranks'])} of {n} ranks, {s['events']} events; missing {len(s['missing'])}"
          + (f": {s['missing'][0]}" if s["missing"] else ""))
    print(f"phases: clocks {ph['clocks']:.2f} s, ask {ph['ask']:.2f} s, window {start_in_s:g}+{duration_s:g} s, "
          f"pull {ph['pull']:.2f} s, merge+analyses {ph['merge']:.2f} s")
    print(f"collection (clocks + ask + pull) {collect_s:.2f} s against the goal of {GOAL_S:g} s: "
          f"{'met' if collect_s <= GOAL_S else 'NOT met'}")
    if offsets:
        print(f"clock skew (|measured offset|, true offset 0 on one host): p50 {statistics.median(offsets):.3f} ms, "
              f"max {max(offsets):.3f} ms; bound (half the least delay) p50 {statistics.median(bounds):.3f} ms, "
              f"max {max(bounds):.3f} ms")
    if starts:
        print(f"window start after the one asked (on the caller's clock): p50 {statistics.median(starts):.1f} ms, "
              f"max {max(starts):.1f} ms")
    if s["arrivals"]:
        print(f"collectives matched across ranks: {s['arrivals']['collectives']}, arrival spread p50 "
              f"{s['arrivals']['spread_p50_ns'] / 1e6:.3f} ms")
    return 0 if len(s["ranks"]) == n else 1


# -- the merge of many ranks -------------------------------------------------------------------------
def merge_child(files: list[str], out: str, analyses: bool) -> None:
    """In a fresh process: the fleet's merge of `files`; prints wall s and peak RSS MiB as JSON.

    With `analyses`: what `gpuscope trace fleet` runs once the traces are pulled (fleet._merge_and_analyse:
    each trace read once, merged, and the straggler, communication and arrival analyses), every clock offset
    0; without: `gpuscope trace merge` (trace.merge.merge)."""
    t = time.monotonic()
    if analyses:
        from gpuscope.trace import fleet

        agent = fleet.Agent("http://127.0.0.1:1", "127.0.0.1:1", clock=fleet.Clock(offset_ns=0, delay_ns=0))
        ranks = [fleet.Rank(agent, pid=1000 + i, rank=i, path=f) for i, f in enumerate(files)]
        done = fleet._merge_and_analyse([agent], ranks, JOB, 0, 1.0, out, 0.0)
    else:
        from gpuscope.trace.merge import merge

        done = merge(files, out, clock_offsets_ns=[0] * len(files), ranks=list(range(len(files))))
    use = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"wall_s": time.monotonic() - t, "cpu_s": use.ru_utime + use.ru_stime, "peak_rss_mib": use.ru_maxrss / 1024,
                      "events": done["events"], "out_bytes": os.path.getsize(out)}))


def merge_bench(ranks: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-fleet-merge-"))
    try:
        doc = json.loads(gzip.decompress(FIXTURE.read_bytes()))
        files = []
        for i in range(ranks):
            doc["gpuscope"] = {"rank": i, "host": f"node{i}", "pid": 1000 + i}
            f = root / f"node{i}.{1000 + i}.rank{i}.pt.trace.json.gz"
            f.write_bytes(gzip.compress(json.dumps(doc).encode(), compresslevel=3))
            files.append(str(f))
        size = sum(os.path.getsize(f) for f in files)
        print(f"merge: {ranks} ranks of {FIXTURE.name} ({len(doc['traceEvents'])} events each, "
              f"{size / 2**20:.1f} MiB compressed in all)")
        for analyses in (False, True):
            p = subprocess.run([sys.executable, __file__, "--merge-child", str(root / "out.pt.trace.json.gz"),
                                "--analyses" if analyses else "--no-analyses", *files],
                               env=_env(), capture_output=True, text=True, timeout=1800)
            if p.returncode != 0:
                raise SystemExit(p.stderr[-2000:])
            r = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"  {'load + analyses + merge' if analyses else 'merge alone'}: {r['wall_s']:.1f} s "
                  f"({r['cpu_s']:.1f} s of CPU, start-up included), peak RSS "
                  f"{r['peak_rss_mib']:.0f} MiB, {r['events']} events, {r['out_bytes'] / 2**20:.1f} MiB out")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--merge-child":
        merge_child(sys.argv[4:], sys.argv[2], sys.argv[3] == "--analyses")
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--mode", choices=("light", "full"), default="light")
    ap.add_argument("--duration", type=float, default=1.0)
    ap.add_argument("--start-in", type=float, default=3.0)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--merge-only", action="store_true")
    ap.add_argument("--fanout-only", action="store_true")
    a = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {os.uname().nodename}, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    rc = 0
    if not a.merge_only:
        rc = fanout(a.agents, a.mode, a.duration, a.start_in)
    if not a.fanout_only:
        merge_bench(a.ranks)
    return rc


if __name__ == "__main__":
    sys.path.insert(0, str(SRC))
    sys.exit(main())
