"""Does windowed tracing cost a training run at most 1 % on average over 10 minutes? (issue 6's goal)

Needs a GPU and torch (the workloads are PyTorch programs):

    python benchmarks/bench_trace_windowed.py                      # 10 min plain + 10 min traced
    python benchmarks/bench_trace_windowed.py --on-demand          # + 10 min on demand
    python benchmarks/bench_trace_windowed.py --minutes 0.5        # smoke: does it all work (figures mean little)

The workload (default healthy_training.py from $GPUSCOPE_WORKLOADS, else ../shared/workloads) runs for
--minutes in each mode, split into --rounds runs whose order alternates (plain first, then traced
first, ...) so a GPU that warms up or clocks down over time weighs on both alike:

- plain: the workload alone;
- windowed: under `gpuscope trace --every 60s --duration 1s --delay 5s` (the issue's setting);
- on demand (--on-demand): under `gpuscope trace --on-demand`, with this script asking every --every
  seconds for a --duration window, as the agent would; the process's 1 % duty budget refuses some.

Each mode's steps/s is its steps over its seconds, summed over its runs (the workload prints both).
Printed: steps/s per mode and run, the overhead (1 - traced/plain, in %), the traced/plain ratio, the
windows each traced mode actually wrote (every file is loaded and must hold kernels) beside the number
its schedule allows, and whether the 1 % goal is met. It exits 1 when a traced mode wrote no trace or
a file is not a trace with kernels: then its figure would mean nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GOAL_PERCENT = 1.0


def _run(cmd: list[str], cwd: Path, seconds: float, gpu: int | None = None) -> tuple[int, float]:
    """(steps, seconds) of one workload run, from its `steps=N steps_per_s=X` line."""
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {}))
    p = subprocess.run(cmd, cwd=str(cwd), capture_output=True, text=True, timeout=seconds + 600, env=env)
    m = re.search(r"steps=(\d+) steps_per_s=([0-9.]+)", p.stdout)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {p.returncode}): {p.stderr[-1500:]}")
    steps, rate = int(m.group(1)), float(m.group(2))
    return steps, steps / rate


class _Asker:
    """Asks the on-demand processes of one request directory for a window every `every_s` seconds,
    the first `delay_s` after one opted in: what the agent's POST /api/v1/trace does."""

    def __init__(self, req_dir: str, delay_s: float, every_s: float, duration_s: float) -> None:
        self.req_dir, self.delay_s, self.every_s, self.duration_s = req_dir, delay_s, every_s, duration_s
        self.asked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _Asker:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        from gpuscope.trace import ondemand

        while not ondemand.opted_in(self.req_dir):
            if self._stop.wait(0.5):
                return
        if self._stop.wait(self.delay_s):
            return
        while True:
            ondemand.write_request(self.req_dir, self.duration_s, "all")
            self.asked += 1
            if self._stop.wait(self.every_s):
                return


def _windows(out_dir: Path) -> tuple[int, int]:
    """(trace files, kernels in all of them); exits when a file is not a trace with kernels."""
    from gpuscope.trace import TraceError, kineto
    from gpuscope.trace.model import EventKind

    files = sorted(out_dir.glob("*.pt.trace.json.gz"))
    kernels = 0
    for f in files:
        try:
            n = int((kineto.load(f).events["kind"] == EventKind.KERNEL).sum())
        except TraceError as e:
            raise SystemExit(f"{f} is not a readable trace: {e}") from None
        if n == 0:
            raise SystemExit(f"{f} holds no kernels: the window traced nothing of the workload")
        kernels += n
    return len(files), kernels


def _allowed(seconds: float, delay_s: float, every_s: float, duty: float, duration_s: float) -> int:
    """Windows one run of `seconds` can hold at most: from `delay_s` (after CUDA starts, so fewer in
    practice), one per `every_s`, and never more often than the duty budget lets (on demand)."""
    if seconds <= delay_s:
        return 0
    spacing = max(every_s, duration_s / duty) if duty else every_s
    return int((seconds - delay_s) // spacing) + 1


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", type=Path,
                    default=Path(os.environ.get("GPUSCOPE_WORKLOADS", root.parent / "shared" / "workloads")))
    ap.add_argument("--workload", default="healthy_training.py")
    ap.add_argument("--minutes", type=float, default=10.0, help="per mode (default 10; 0.5 is a smoke run)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per mode, in alternating order (default 2)")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between windows (default 60)")
    ap.add_argument("--duration", type=float, default=1.0, help="seconds per window (default 1)")
    ap.add_argument("--delay", type=float, default=5.0, help="seconds before the first window (default 5)")
    ap.add_argument("--on-demand", action="store_true", help="also measure on-demand tracing with its duty budget")
    ap.add_argument("--parallel-gpus", action="store_true",
                    help="run plain and windowed at the same time on GPUs 0 and 1, swapping GPUs each round "
                         "(so each mode gets --minutes in half the wall time; needs 2 GPUs, no --on-demand)")
    a = ap.parse_args()
    if a.parallel_gpus and a.on_demand:
        raise SystemExit("--parallel-gpus runs two modes on two GPUs; leave out --on-demand.")
    script = a.workloads / a.workload
    if not script.exists():
        raise SystemExit(f"No workload at {script}: give --workloads DIR or set GPUSCOPE_WORKLOADS.")
    if a.minutes <= 0 or a.rounds < 1:
        raise SystemExit("--minutes must be more than 0 and --rounds at least 1.")
    seconds = a.minutes * 60 / a.rounds
    py = sys.executable
    work = [py, str(script), "--seconds", f"{seconds:g}"]
    modes = ["plain", "windowed"] + (["on_demand"] if a.on_demand else [])
    totals = {m: [0, 0.0] for m in modes}
    per_run: dict[str, list[float]] = {m: [] for m in modes}
    asked = 0
    with tempfile.TemporaryDirectory() as tmp:
        win_dir, agent_dir = Path(tmp) / "windowed", Path(tmp) / "agent"
        agent_dir.mkdir()  # as the agent makes its data dir (trace --on-demand refuses a missing one)
        def windowed_cmd(r: int) -> list[str]:
            return [py, "-m", "gpuscope.cli", "trace", "--out", str(win_dir / f"r{r}"), "--delay", f"{a.delay:g}s",
                    "--duration", f"{a.duration:g}s", "--every", f"{a.every:g}s", "--", *work]

        for r in range(a.rounds):
            if a.parallel_gpus:  # both modes at once, on GPUs that swap each round so neither GPU favours one
                gpu = {"plain": r % 2, "windowed": 1 - r % 2}
                with ThreadPoolExecutor(len(modes)) as pool:
                    futures = {m: pool.submit(_run, work if m == "plain" else windowed_cmd(r), a.workloads,
                                              seconds, gpu[m]) for m in modes}
                    got = {m: f.result() for m, f in futures.items()}
                for mode in modes:
                    steps, secs = got[mode]
                    totals[mode][0] += steps
                    totals[mode][1] += secs
                    per_run[mode].append(steps / secs)
                    print(f"round {r + 1}/{a.rounds} {mode:10} GPU {gpu[mode]} {steps / secs:9.2f} steps/s", flush=True)
                continue
            order = modes if r % 2 == 0 else modes[::-1]
            for mode in order:
                if mode == "plain":
                    steps, secs = _run(work, a.workloads, seconds)
                elif mode == "windowed":
                    steps, secs = _run(windowed_cmd(r), a.workloads, seconds)
                else:
                    with _Asker(str(agent_dir / "trace-requests"), a.delay, a.every, a.duration) as asker:
                        steps, secs = _run([py, "-m", "gpuscope.cli", "trace", "--on-demand", "--agent-dir",
                                            str(agent_dir), "--", *work], a.workloads, seconds)
                    asked += asker.asked
                totals[mode][0] += steps
                totals[mode][1] += secs
                per_run[mode].append(steps / secs)
                print(f"round {r + 1}/{a.rounds} {mode:10} {steps / secs:9.2f} steps/s", flush=True)
        traced = {"windowed": _windows_all(win_dir)}
        _print_costs(win_dir)
        allowed = {"windowed": a.rounds * _allowed(seconds, a.delay, a.every, 0.0, a.duration)}
        if a.on_demand:
            traced["on_demand"] = _windows(agent_dir / "traces")
            allowed["on_demand"] = min(asked, a.rounds * _allowed(seconds, a.delay, a.every, 0.01, a.duration))
    plain = totals["plain"][0] / totals["plain"][1]
    print(f"\n{a.workload}, {a.minutes:g} min per mode in {a.rounds} alternating runs"
          f"{' (both modes at once on two GPUs, swapped each round)' if a.parallel_gpus else ''}; windows of "
          f"{a.duration:g} s every {a.every:g} s after {a.delay:g} s")
    print(f"{'mode':10} {'steps/s':>9} {'overhead %':>10} {'ratio':>6} {'windows':>8} {'at most':>8}  per run")
    failed = False
    for mode in modes:
        rate = totals[mode][0] / totals[mode][1]
        runs = " ".join(f"{x:.2f}" for x in per_run[mode])
        if mode == "plain":
            print(f"{mode:10} {rate:9.2f} {'':>10} {'':>6} {'':>8} {'':>8}  {runs}")
            continue
        files, kernels = traced[mode]
        overhead = (1 - rate / plain) * 100
        print(f"{mode:10} {rate:9.2f} {overhead:10.2f} {rate / plain:6.3f} {files:8d} {allowed[mode]:8d}  {runs}"
              f"   ({kernels} kernels traced)")
        if files == 0:
            print(f"  {mode}: no window was traced, so its overhead means nothing.")
            failed = True
        elif a.minutes >= 5:
            print(f"  {mode}: goal <= {GOAL_PERCENT:g} %: {'met' if overhead <= GOAL_PERCENT else 'MISSED'}")
    if a.minutes < 5:
        print("(a smoke run: too short for the overhead to say anything; it checks that every mode works)")
    return 1 if failed else 0


def _print_costs(out_dir: Path) -> None:
    """Each window's measured cost and any budget note, from the processes' status files: what the
    budget (--budget, default 1 %) spaced the windows by."""
    import json

    for f in sorted(out_dir.glob("r*/*.gpuscope.json")):
        status = json.loads(f.read_text())
        costs = [t.get("cost_s") for t in status.get("traces", [])]
        print(f"{f.parent.name}: window costs {costs} s" + (f"; {status['budget_note']}" if "budget_note" in status else ""))


def _windows_all(out_dir: Path) -> tuple[int, int]:
    """_windows over each run's own directory."""
    found = [_windows(d) for d in sorted(out_dir.glob("r*"))]
    return sum(f for f, _ in found), sum(k for _, k in found)


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"(took {(time.monotonic() - started) / 60:.1f} min)")
    raise SystemExit(code)
