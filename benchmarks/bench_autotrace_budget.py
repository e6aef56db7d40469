"""The per-process budget of the agent's own windows over a long run, beside the same run unprofiled (GPU machine).

    python benchmarks/bench_autotrace_budget.py [--workloads DIR] [--workload launch_bound] [--minutes 10]
                                                [--ask-every 5] [--duration 1s] [--out result.json]

Two runs of one reference workload (shared/workloads, each prints steps_per_s over its whole run), one after
the other on the same GPU:

1. plain: no agent, no bootstrap;
2. profiled: a real agent (`gpuscope agent`, its own data directory, [profiling] on_verdict and every = "1m",
   duration 1 s) and the workload opted in by PYTHONPATH=<data>/bootstrap alone; besides the agent's own
   windows (the verdict flip, the schedule), this script asks POST /api/v1/trace every --ask-every seconds
   (with the token), far more often than the budget allows, so that the process's budget, not the asking,
   is what limits the windows.

From the process's answers (done.*.json: each written window's cost_s, ending at answered_unix) it reports the
windows' total cost, the largest cost over any 10-minute span of the run (every span that starts or ends at
a window's edge, a window counted by its overlap), that as a share of 10 minutes (the goal: <= 1 %), how many
asks were refused by the budget, and the two runs' steps/s (the overhead is 1 - profiled / plain). A run
shorter than 10 minutes has one span, the whole run, and its share is of 10 minutes all the same.
JSON on stdout (and --out); nothing is written to BENCHMARKS.md by the script. `--only plain|profiled`
runs one of the two (a session whose commands may last 10 minutes runs them one per command).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPAN_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(port: int, path: str, token: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body is not None else "GET",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _workload_env(pythonpath: str | None) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCOPE_") and k not in ("RANK", "LOCAL_RANK")}
    e.pop("PYTHONPATH", None)
    if pythonpath:
        e["PYTHONPATH"] = pythonpath
    return e


def _steps_per_s(out: str) -> float | None:
    m = re.search(r"steps_per_s=([0-9.]+)", out)
    return float(m.group(1)) if m else None


def plain(script: Path, seconds: float) -> dict:
    t0 = time.time()
    p = subprocess.run([sys.executable, str(script), "--seconds", str(seconds)], cwd=script.parent,
                       env=_workload_env(None), capture_output=True, text=True, timeout=seconds + 300)
    return {"steps_per_s": _steps_per_s(p.stdout), "wall_s": round(time.time() - t0, 1), "rc": p.returncode}


def profiled(script: Path, seconds: float, ask_every_s: float, duration: str, simulate: str | None = None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-autotrace-"))
    cfg = tmp / "agent.toml"
    cfg.write_text(f'[profiling]\ncheck_interval = "2s"\nduration = "{duration}"\nevery = "1m"\n')
    port = _free_port()
    data = tmp / "data"
    agent = subprocess.Popen([sys.executable, "-m", "gpuscope.cli", "agent", "--port", str(port), "--data-dir",
                              str(data), "--config", str(cfg), *(["--simulate", simulate] if simulate else [])],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep
                                  + os.environ.get("PYTHONPATH", "")})
    try:
        end = time.monotonic() + 60
        while not (data / "bootstrap" / "agent.json").exists():
            if time.monotonic() > end or agent.poll() is not None:
                raise SystemExit(f"the agent did not start: {agent.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
        token = (data / "token").read_text().strip()
        t0 = time.time()
        prog = subprocess.Popen([sys.executable, str(script), "--seconds", str(seconds)], cwd=script.parent,
                                env=_workload_env(str(data / "bootstrap")), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        asked = 0
        while prog.poll() is None:
            time.sleep(ask_every_s)
            code, _ = _http(port, "/api/v1/trace", token, {"duration": duration, "pids": [prog.pid]})
            asked += code == 202
        out, err = prog.communicate()
        wall = time.time() - t0
        answers = []
        for name in os.listdir(data / "trace-requests"):
            if name.startswith("done.") and name.endswith(f".{prog.pid}.json"):
                answers.append(json.loads((data / "trace-requests" / name).read_text()))
        _, auto = _http(port, "/api/v1/autotrace")
    finally:
        agent.terminate()
        agent.wait(60)
    windows = sorted((a["answered_unix"] - a["cost_s"], a["answered_unix"]) for a in answers
                     if a.get("status") == "written" and isinstance(a.get("cost_s"), int | float))
    refused = [a for a in answers if a.get("status") == "refused"]
    return {"steps_per_s": _steps_per_s(out), "wall_s": round(wall, 1), "rc": prog.returncode,
            "asked_by_this_script": asked,
            "asked_by_the_agent": sum(1 for r in auto.get("requests", []) if r.get("id")),
            "not_asked_by_the_agent_budget_spent": sum(1 for r in auto.get("requests", []) if not r.get("id")),
            "windows": len(windows), "refused": len(refused),
            "refusal_example": refused[0]["reason"] if refused else None,
            "cost_s_total": round(sum(b - a for a, b in windows), 3),
            "window_phases_s": [a.get("cost_phases_s") for a in sorted(answers, key=lambda a: a.get("answered_unix", 0))
                                if a.get("status") == "written"],
            "window_raw_bytes": [a.get("raw_bytes") for a in answers if a.get("status") == "written"],
            **_worst_span(windows, t0, t0 + wall), "stderr_tail": err[-500:]}


def _worst_span(windows: list[tuple[float, float]], start: float, end: float) -> dict:
    """The most window time inside any SPAN_S of [start, end], over spans starting or ending at an edge."""
    lefts = {start} | {a for a, _ in windows} | {b - SPAN_S for _, b in windows}
    worst, at = 0.0, start
    for left in lefts:
        left = max(start, min(left, max(start, end - SPAN_S)))
        inside = sum(max(0.0, min(b, left + SPAN_S) - max(a, left)) for a, b in windows)
        if inside > worst:
            worst, at = inside, left
    return {"worst_10min_cost_s": round(worst, 3), "worst_10min_duty": round(worst / SPAN_S, 5),
            "worst_10min_starts_s": round(at - start, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=os.environ.get("GPUSCOPE_WORKLOADS", str(ROOT.parent / "shared" / "workloads")))
    ap.add_argument("--workload", default="launch_bound")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--ask-every", type=float, default=5.0, help="seconds between this script's own asks")
    ap.add_argument("--duration", default="1s", help="each window asked for (default 1s, the agent's own default)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--simulate", default=None, help="the agent on a simulated node (a dry run without a GPU)")
    ap.add_argument("--only", choices=("plain", "profiled"), default=None,
                    help="one of the two runs (each in its own session where a session has a time limit)")
    a = ap.parse_args()
    script = (Path(a.workloads) / f"{a.workload}.py").resolve()  # the runs start in its folder
    if not script.exists():
        raise SystemExit(f"no workload {script} (set --workloads or GPUSCOPE_WORKLOADS)")
    seconds = a.minutes * 60
    result = {"workload": a.workload, "minutes": a.minutes, "machine": socket.gethostname(),
              "date_unix": round(time.time()),
              "plain": plain(script, seconds) if a.only != "profiled" else None,
              "profiled": profiled(script, seconds, a.ask_every, a.duration, a.simulate) if a.only != "plain" else None}
    p = (result["plain"] or {}).get("steps_per_s")
    q = (result["profiled"] or {}).get("steps_per_s")
    result["throughput_overhead"] = None if not p or not q else round(1 - q / p, 4)
    failed = [k for k in ("plain", "profiled") if result[k] is not None and (result[k]["rc"] != 0
                                                                          or result[k]["steps_per_s"] is None)]
    if result["profiled"] is not None and not failed:
        result["goal_met"] = result["profiled"]["worst_10min_duty"] <= 0.01
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    if failed:
        print(f"bench_autotrace_budget: the workload failed in the {' and '.join(failed)} run: no figure.",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
