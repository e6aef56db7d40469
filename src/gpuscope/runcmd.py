"""`gpuscope run -- CMD ...`: run a program, watch the GPUs while it runs, say what limited it.

The child gets the terminal's signals as usual; Ctrl-C is forwarded to it (and to its process group),
and gpuscope reports what it saw before exiting with the child's exit code. The child is never left
running behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .diagnose import diagnose, windows_from_snapshots
from .diagnose.thresholds import DEFAULT
from .sampler import Sampler, SamplerConfig

WINDOW_S = 10.0  # each verdict looks at this much history
EVERY_S = 5.0  # and a new one is made this often


class RunError(RuntimeError):
    """One sentence for the user (the command could not be started)."""


@dataclass
class Segment:
    gpu: str
    kind: str
    start_s: float
    end_s: float
    summary: str
    recommendations: list[str] = field(default_factory=list)


def _status(snap: Any, elapsed: float) -> str:
    parts = [f"{elapsed:6.0f}s"]
    for g in snap.gpus[:4]:
        sm, util = g.sm_active_ratio, g.utilization_ratio
        parts.append(f"GPU{g.identity.label} SM {'-' if sm is None else f'{sm * 100:3.0f}%'}"
                     f" util {'-' if util is None else f'{util * 100:3.0f}%'}"
                     f" {(g.power_watts or 0):4.0f}W")
    return "  ".join(parts)


def run(cmd: list[str], *, simulate: str | None = None, gpus: int | None = None, interval: float = 0.1,
        out: Any = sys.stderr) -> tuple[int, dict[str, Any]]:
    if not cmd:
        raise RunError("Nothing to run: give a command after --, e.g. gpuscope run -- python train.py.")
    if shutil.which(cmd[0]) is None and not os.path.exists(cmd[0]):
        raise RunError(f"Command not found: {cmd[0]}.")
    sampler = Sampler(SamplerConfig(interval=interval), simulate=simulate, gpus=gpus)
    sampler.open()
    segments: list[Segment] = []
    t0 = time.time()
    e0 = _energy(sampler.sample_once())
    try:
        child = subprocess.Popen(cmd, start_new_session=False)
    except OSError as e:
        sampler.stop()
        raise RunError(f"Cannot start {cmd[0]}: {e.strerror}.") from None
    sampler.start()
    interrupted = False
    tty = hasattr(out, "isatty") and out.isatty()

    def forward(signum: int, _frame: Any) -> None:
        nonlocal interrupted
        interrupted = True
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    next_verdict = time.monotonic() + EVERY_S
    last_status = 0.0
    try:
        while child.poll() is None:
            time.sleep(0.2)
            snap = sampler.latest()
            now = time.monotonic()
            if snap is not None and (tty or now - last_status >= 10.0) and now - last_status >= 1.0:
                line = _status(snap, time.time() - t0)
                print(("\r" + line + "\033[K") if tty else line, end="" if tty else "\n", file=out, flush=True)
                last_status = now
            if now >= next_verdict:
                next_verdict = now + EVERY_S
                segments.extend(_verdicts(sampler))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if child.poll() is None:  # we are leaving: never leave the child behind
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if tty:
            print(file=out)
        segments.extend(_verdicts(sampler, final=True))
        last = sampler.latest()
        sampler.stop()
    duration = time.time() - t0
    e1 = _energy(last) if last is not None else e0
    report = _summarise(segments, duration, (e1 - e0) if e0 is not None and e1 is not None else None,
                        child.returncode, interrupted, sampler.simulated)
    return child.returncode if child.returncode is not None else 1, report


def _energy(snap: Any) -> float | None:
    vals = [g.get("gpu_energy_joules_total") for g in snap.gpus]
    vals = [v for v in vals if v is not None]
    return sum(vals) if vals else None


def _verdicts(sampler: Sampler, final: bool = False) -> list[Segment]:
    history = list(sampler.history)
    if not history:
        return []
    end = history[-1].time_ns
    window = [s for s in history if s.time_ns >= end - int(WINDOW_S * 1e9)]
    if final:  # the tail since the last verdict, if it is long enough to say something
        window = [s for s in history if s.time_ns >= end - int(EVERY_S * 1e9)]
        if (window[-1].time_ns - window[0].time_ns) / 1e9 < DEFAULT.min_window_s:
            return []
    out = []
    for v in diagnose(windows_from_snapshots(window)):
        if v.primary or v.severity != "info":
            out.append(Segment(v.gpu, v.kind, v.start_s, v.end_s, v.summary, v.recommendations))
    return out


def _summarise(segments: list[Segment], duration: float, energy_j: float | None, code: int | None,
               interrupted: bool, simulated: str | None) -> dict[str, Any]:
    share: dict[str, Counter[str]] = {}
    for s in segments:
        share.setdefault(s.gpu, Counter())[s.kind] += 1
    first: Segment | None = None
    problems = [s for s in segments if s.kind not in ("healthy", "compute_bound", "idle", "power_capped")]
    if problems:
        common = Counter(s.kind for s in problems).most_common(1)[0][0]
        first = next(s for s in problems if s.kind == common)
    return {
        "duration_s": duration, "exit_code": code, "interrupted": interrupted, "simulated": simulated,
        "energy_joules": energy_j,
        "verdict_share": {g: {k: n / sum(c.values()) for k, n in c.items()} for g, c in share.items()},
        "timeline": [s.__dict__ for s in segments],
        "change_first": None if first is None else {"gpu": first.gpu, "kind": first.kind, "summary": first.summary,
                                                     "advice": first.recommendations[:1]},
    }


def render(report: dict[str, Any]) -> str:
    lines = []
    sim = report["simulated"]
    head = (f"gpuscope run: {report['duration_s']:.0f} s, exit code {report['exit_code']}"
            + (" (interrupted)" if report["interrupted"] else "")
            + (f", energy {report['energy_joules'] / 1000:.1f} kJ" if report["energy_joules"] is not None else "")
            + (f"  [SIMULATED node '{sim}']" if sim else ""))
    lines.append(head)
    if not report["verdict_share"]:
        lines.append("  too short for a verdict (a steady state needs at least 5 s).")
    for gpu, kinds in sorted(report["verdict_share"].items()):
        lines.append(f"  GPU {gpu}: " + ", ".join(f"{k} {v * 100:.0f} %" for k, v in
                                                   sorted(kinds.items(), key=lambda kv: -kv[1])))
    cf = report["change_first"]
    if cf:
        lines.append(f"  change first: {cf['summary']}")
        lines.extend(f"    -> {a}" for a in cf["advice"])
    return "\n".join(lines)
