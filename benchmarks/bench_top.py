"""What `gpuscope top` costs: the CPU of the view process itself at 4 refreshes per second.

Each view runs in a detached tmux session of a fixed size (a real terminal, as over SSH); its CPU time
(user + system, all its threads, not its children) is read with psutil after a warm-up and again
`--seconds` later.

    python benchmarks/bench_top.py                 # simulated 8 GPUs x 100 processes: agent mode, local mode
    python benchmarks/bench_top.py --real          # on a GPU machine: gpuscope top (local, agent) vs nvitop

Modes: 'agent' reads a separately started agent (the view's own cost; the agent's is printed beside
it); 'local' samples by itself (view + its sampler at 10 Hz + diagnose every 2 s). The peer is nvitop at
the same refresh (`nvitop --interval 0.25`, its minimum), which needs a real GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import psutil

GPUSCOPE = [sys.executable, "-m", "gpuscope.cli"]
SIM = ["--simulate", "mixed", "--gpus", "8", "--processes", "100"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class View:
    """A command in a detached tmux session of `size`; `pid` is the command itself (exec'd)."""

    def __init__(self, command: list[str], size: tuple[int, int]) -> None:
        self.socket = f"bench-top-{uuid.uuid4().hex[:8]}"
        self._tmux("new-session", "-d", "-x", str(size[0]), "-y", str(size[1]),
                   f"exec {shlex.join(command)}")
        self.pid = int(self._tmux("list-panes", "-F", "#{pane_pid}").split()[0])

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True,
                              env={**os.environ, "TERM": "xterm-256color"}).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def measure(name: str, command: list[str], seconds: float, size: tuple[int, int], ready: str,
            also: dict[str, int] | None = None) -> dict[str, float]:
    """CPU % of one core of the view (and of the processes in `also`) over `seconds`."""
    view = View(command, size)
    try:
        deadline = time.monotonic() + 60
        while ready not in view.screen():
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: the view did not show {ready!r} within 60 s:\n{view.screen()}")
            time.sleep(0.2)
        time.sleep(3.0)  # past start-up (imports, first layout, first verdicts)
        pids = {"view": view.pid, **(also or {})}
        t0, c0 = time.monotonic(), {k: cpu_seconds(p) for k, p in pids.items()}
        time.sleep(seconds)
        wall = time.monotonic() - t0
        out = {f"{k}_cpu_percent": 100.0 * (cpu_seconds(p) - c0[k]) / wall for k, p in pids.items()}
        print(f"{name:<28} view {out['view_cpu_percent']:5.2f} % of one core"
              + "".join(f"   ({k} {v:.2f} %)" for k, v in out.items() if k != "view_cpu_percent"), flush=True)
        return out
    finally:
        view.close()


def with_agent(args: argparse.Namespace, simulated: bool, run: callable) -> dict[str, float]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        agent = subprocess.Popen([*GPUSCOPE, "agent", *(SIM if simulated else []), "--port", str(port),
                                  "--data-dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(url + "/api/v1/latest", timeout=1).read()
                    break
                except OSError:
                    if agent.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("the agent did not start") from None
                    time.sleep(0.3)
            return run(url, agent.pid)
        finally:
            agent.terminate()
            agent.wait(timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0, help="measure this long per view (default 20)")
    p.add_argument("--refresh", type=float, default=0.25, help="refresh of every view (default 0.25 s)")
    p.add_argument("--size", default="120x40", help="terminal size (default 120x40)")
    p.add_argument("--real", action="store_true", help="the real GPUs, and nvitop beside gpuscope top")
    args = p.parse_args()
    if shutil.which("tmux") is None:
        raise SystemExit("bench_top needs tmux.")
    w, h = (int(x) for x in args.size.split("x"))
    size, refresh = (w, h), ["--refresh", str(args.refresh)]
    results: dict[str, object] = {"seconds": args.seconds, "refresh_s": args.refresh, "size": args.size,
                                  "real": args.real}
    print(f"gpuscope top, {args.size}, refresh {args.refresh:g} s, {args.seconds:g} s per view"
          + ("" if args.real else ", simulated 8 GPUs x 100 processes"), flush=True)

    results["agent"] = with_agent(args, not args.real, lambda url, agent_pid: measure(
        "gpuscope top (agent)", [*GPUSCOPE, "top", "--url", url, *refresh], args.seconds, size, "processes",
        {"agent": agent_pid}))
    results["local"] = measure("gpuscope top (local sampling)", [*GPUSCOPE, "top", *([] if args.real else SIM), *refresh],
                               args.seconds, size, "processes")
    nvitop = shutil.which("nvitop")
    if not args.real:
        print("nvitop: not measured (no GPU)")
    elif nvitop is None:
        print("nvitop: not measured (not installed: pip install nvitop)")
    else:
        results["nvitop"] = measure("nvitop", [nvitop, "--interval", str(args.refresh)], args.seconds, size, "MiB")
        theirs = results["nvitop"]["view_cpu_percent"]
        for mode in ("agent", "local"):
            ours = results[mode]["view_cpu_percent"]
            ratio = ours / theirs if theirs else float("inf")
            results[f"{mode}_vs_nvitop"] = ratio
            print(f"ratio ours/nvitop ({mode}): {ratio:.2f}")
    print(json.dumps({"bench": "top", **results}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.exit(main())
