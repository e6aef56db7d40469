"""What `gpuscope.monitor()` costs a training loop, against the same loop without it, in the same run.

    python benchmarks/bench_monitor.py                    # GPU machine (real NVML); without one, simulated
    python benchmarks/bench_monitor.py --simulate healthy --seconds 10 --json out.json

Three figures (goal, issue 4: < 0.1 % of step time):
1. `m.step()` on the caller's thread, ns per call, against its peer: the bookkeeping a user would write
   by hand (`times.append(time.perf_counter())`).
2. The monitor thread's CPU per step (join, JSONL step log, verdicts), from the thread's own CPU clock,
   with steps of fixed length (10 ms and 100 ms by default, slept: a GPU-bound loop waits on the GPU).
   As a share of the step time, with the caller's cost added: the overhead the goal is about.
3. Fixed-work steps (pure Python that holds the GIL, calibrated to the step time; the worst case: a
   CPU-bound loop competing with the monitor's threads) with and without the monitor, interleaved
   rounds: the slowdown measured end to end, the sampler's thread included. The sampler's own CPU (its
   cost is in BENCHMARKS.md, "Sampler cost") is printed beside it; on the simulated node it is higher
   than on a GPU (the fake NVML is Python).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import numpy  # noqa: E402,F401 - a training process has it; its one-time import is not a per-step cost

import gpuscope  # noqa: E402


def make_monitor(args, log: str | None):
    kw = {"interval": args.interval, "log": log, "warmup_steps": 0}
    if args.simulate:
        return gpuscope.monitor(simulate=args.simulate, **kw)
    m = gpuscope.monitor(**kw)
    return m


def bench_call(args) -> dict:
    n = args.calls
    peer, ours = [], []
    with make_monitor(args, None) as m:
        step = m.step
        for _ in range(5):
            times: list[float] = []
            app, pc = times.append, time.perf_counter
            t0 = time.perf_counter_ns()
            for _ in range(n):
                app(pc())
            peer.append((time.perf_counter_ns() - t0) / n)
            t0 = time.perf_counter_ns()
            for _ in range(n):
                step()
            ours.append((time.perf_counter_ns() - t0) / n)
            time.sleep(0.3)  # let the monitor thread take them
    p, o = statistics.median(peer), statistics.median(ours)
    return {"step_call_ns": o, "peer_append_perf_counter_ns": p, "ratio": o / p}


def bench_thread(args, step_s: float, log_dir: str) -> dict:
    steps = max(20, int(args.seconds / step_s))
    m = make_monitor(args, os.path.join(log_dir, f"steps-{step_s}.jsonl")).start()
    smp0 = m.sampler.cpu_seconds if m.sampler is not None else 0.0
    w0 = time.perf_counter()
    for _ in range(steps):
        time.sleep(step_s)
        m.step()
    wall = time.perf_counter() - w0
    smp = (m.sampler.cpu_seconds - smp0) if m.sampler is not None else 0.0
    m.stop()  # joins the last steps: counted below (stop_cpu_seconds)
    rep = m.report()
    return {"step_s": step_s, "steps": steps, "wall_s": wall,
            "monitor_thread_cpu_s": m.cpu_seconds + m.stop_cpu_seconds, "sampler_thread_cpu_s": smp,
            "teardown_cpu_s": m.teardown_cpu_seconds,
            "joined": rep.steps, "source": rep.source, "simulated": rep.simulated}


def calibrate(step_s: float) -> int:
    def work(k: int) -> float:
        x = 0.0
        for i in range(k):
            x += i * 0.5
        return x

    k = 10_000
    while True:
        t0 = time.perf_counter()
        work(k)
        dt = time.perf_counter() - t0
        if dt > 0.02:
            break
        k *= 2
    return max(1, int(k * step_s / dt))


def fixed_work(args, step_s: float, log_dir: str) -> dict:
    k = calibrate(step_s)
    steps = max(10, int(args.seconds / 2 / step_s / args.rounds))

    def loop(m) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            x = 0.0
            for i in range(k):
                x += i * 0.5
            if m is not None:
                m.step()
        return (time.perf_counter() - t0) / steps

    without, with_ = [], []
    smp_cpu, smp_wall = 0.0, 0.0
    for r in range(args.rounds):
        without.append(loop(None))
        m = make_monitor(args, os.path.join(log_dir, f"work-{step_s}-{r}.jsonl")).start()
        c0, w0 = m.sampler.cpu_seconds if m.sampler is not None else 0.0, time.perf_counter()
        with_.append(loop(m))
        smp_cpu += (m.sampler.cpu_seconds - c0) if m.sampler is not None else 0.0
        smp_wall += time.perf_counter() - w0
        m.stop()
    a, b = statistics.median(without), statistics.median(with_)
    return {"step_s": step_s, "rounds": args.rounds, "steps_per_round": steps, "without_s": a, "with_s": b,
            "slowdown_ratio": b / a - 1, "sampler_core_ratio": smp_cpu / smp_wall if smp_wall else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--simulate", default=None, help="simulated scenario (default: real NVML, else 'healthy')")
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--steps", default="0.01,0.1", help="step times in seconds")
    ap.add_argument("--seconds", type=float, default=20.0, help="per step time, per part")
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.simulate is None:
        try:
            gpuscope.Sampler().open()
        except gpuscope.NvmlUnavailable:
            args.simulate = "healthy"
            print("no NVIDIA GPU here: the simulated node 'healthy' stands in (its sampler costs more CPU)")
    out: dict = {"simulate": args.simulate, "interval": args.interval}
    c = bench_call(args)
    out["call"] = c
    print(f"m.step() on the caller's thread: {c['step_call_ns']:.0f} ns; peer times.append(perf_counter()): "
          f"{c['peer_append_perf_counter_ns']:.0f} ns; ratio {c['ratio']:.2f}")
    with tempfile.TemporaryDirectory() as d:
        out["thread"], out["fixed_work"] = [], []
        for step_s in (float(x) for x in args.steps.split(",")):
            t = bench_thread(args, step_s, d)
            out["thread"].append(t)
            per_step = t["monitor_thread_cpu_s"] / t["steps"]
            share = (per_step + c["step_call_ns"] * 1e-9) / step_s
            t["monitor_cpu_per_step_us"], t["overhead_ratio"] = per_step * 1e6, share
            print(f"steps of {step_s * 1000:g} ms ({t['steps']} steps, JSONL log): monitor thread "
                  f"{per_step * 1e6:.1f} us CPU per step; with m.step(): {share * 100:.3f} % of step time "
                  f"(goal < 0.1 %); sampler thread {t['sampler_thread_cpu_s'] / t['wall_s'] * 100:.2f} % of a core; "
                  f"once at stop (sampler shutdown, not per step): {t['teardown_cpu_s'] * 1000:.1f} ms CPU")
            f = fixed_work(args, step_s, d)
            out["fixed_work"].append(f)
            print(f"fixed-work steps of {step_s * 1000:g} ms (GIL-bound, {f['rounds']} rounds x "
                  f"{f['steps_per_round']}): without {f['without_s'] * 1000:.3f} ms, with {f['with_s'] * 1000:.3f} ms: "
                  f"{f['slowdown_ratio'] * 100:+.2f} % (sampler thread {f['sampler_core_ratio'] * 100:.2f} % of a core)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
