"""`gpuscope run -- CMD ...`: run a program, watch the GPUs while it runs, say what limited it.

While CMD runs, the sampler reads the GPUs at 10 Hz; every 5 s the last 10 s get a verdict per GPU.
The whole run's key series go into a bounded timeline (report.timeline), the child and all its
descendants into a process table (report.processes), and at the end come the verdict timeline, the
time share of each verdict, the energy used and what to change first (`render`), plus the JSON and
HTML reports (cli.py writes them).

Signals: Ctrl-C at a terminal reaches CMD directly (it shares our process group); a SIGINT or SIGTERM
sent to gpuscope alone is forwarded to CMD. A second one terminates CMD (SIGTERM, then SIGKILL after
5 s). Either way gpuscope waits for CMD, reports what it saw and exits with CMD's exit code (128 + N
when a signal N ended it, as a shell would say). The child is never left running behind, and its
output never passes through gpuscope (gpuscope._child holds these decisions for `trace run` too).

With `trace` (`gpuscope run --trace`), CMD runs with the tracing bootstrap in on-demand mode, and a GPU
whose verdict the metrics cannot settle gets one 3 s trace of its processes; that trace's verdict then
replaces the metrics' for that GPU (trace/onrun.py, which this module reaches through its `OnRun`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ._child import TERM_GRACE_S, Forwarder, RunError, check, exit_code, reap, reap_all, start
from ._redact import redact_cmdline
from .diagnose import Profiler, diagnose, windows_from_snapshots
from .diagnose.thresholds import DEFAULT
from .report.processes import RunProcesses
from .report.timeline import GpuTimeline, gpu_order
from .sampler import Sampler, SamplerConfig

if TYPE_CHECKING:
    from .trace.onrun import OnRun

# RunError lives in gpuscope._child (trace run raises it too); gpuscope.runcmd.RunError is the same class.
__all__ = ["EVERY_S", "FINE", "TERM_GRACE_S", "WINDOW_S", "RunError", "Segment", "process_spans", "render", "run",
           "spans"]

WINDOW_S = 10.0  # each verdict looks at this much history
EVERY_S = 5.0  # and a new one is made this often
TREE_EVERY_S = 2.0  # how often the child's process tree is read
#: Primary verdicts that need no change: never "what to change first".
FINE = {"healthy", "compute_bound", "idle", "power_capped"}


@dataclass
class Segment:
    """One verdict on one GPU; start_s..end_s (seconds since the run began) is the part of the run it
    speaks for: from the previous verdict on that GPU (or its window's start) to its window's end."""

    gpu: str
    kind: str
    start_s: float
    end_s: float
    summary: str
    recommendations: list[str] = field(default_factory=list)
    severity: str = "info"
    primary: bool = True
    evidence: dict[str, Any] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)  # the GPU's processes in the verdict's window
    # on a GPU they share, each process's own verdicts: {pid, kind, severity, summary, recommendations,
    # evidence, primary}; empty where one process had the GPU (the GPU's verdict is its own)
    processes: list[dict[str, Any]] = field(default_factory=list)


class _Collector:
    """Fed on the sampler thread after every tick: the timelines and the GPU processes."""

    def __init__(self, t0: float, procs: RunProcesses | None, max_points: int) -> None:
        self.t0 = t0
        self.procs = procs
        self.max_points = max_points
        self.timelines: dict[str, GpuTimeline] = {}
        self.gpus: dict[str, dict[str, Any]] = {}

    def __call__(self, snap: Any) -> None:
        t = snap.time_ns / 1e9 - self.t0
        for g in snap.gpus:
            label = g.identity.label
            tl = self.timelines.get(label)
            if tl is None:
                tl = self.timelines[label] = GpuTimeline(self.max_points)
                i = g.identity
                self.gpus[label] = {"gpu": label, "name": i.name, "uuid": i.uuid,
                                    "memory_total_bytes": i.memory_total_bytes or None,
                                    "power_limit_watts": i.power_limit_watts, "sm_clock_max_hertz": i.sm_clock_max_hertz}
            tl.add(t, g.values)
            if not g.healthy:
                self.gpus[label].setdefault("lost_at_s", t)
        if self.procs is not None:
            self.procs.observe(snap, t)


def _status(snap: Any, elapsed: float) -> str:
    parts = [f"{elapsed:6.0f}s"]
    for g in snap.gpus[:4]:
        sm, util = g.sm_active_ratio, g.utilization_ratio
        parts.append(f"GPU{g.identity.label} SM {'-' if sm is None else f'{sm * 100:3.0f}%'}"
                     f" util {'-' if util is None else f'{util * 100:3.0f}%'}"
                     f" {(g.power_watts or 0):4.0f}W")
    if len(snap.gpus) > 4:
        parts.append(f"+{len(snap.gpus) - 4} GPUs")
    return "  ".join(parts)


def run(cmd: list[str], *, simulate: str | None = None, gpus: int | None = None, interval: float = 0.1,
        out: Any = sys.stderr, max_points: int = 6144, stacks: bool = True, trace: bool = False,
        trace_dir: str | None = None, trace_timeout_s: float | None = None) -> tuple[int, dict[str, Any]]:
    """Run `cmd`, watch the GPUs meanwhile; return (the exit code to use, the report dict).

    With `stacks`, a GPU that waits on a saturated thread of the command's processes (never another
    user's) has that process's Python stacks sampled for 2 s (py-spy), at most every 30 s. With `trace`,
    such a GPU whose verdict stays unsettled gets a trace (trace.onrun), written into `trace_dir` (kept)
    or into a temporary directory removed at the end; `trace_timeout_s` (default trace.onrun's 30 s) is
    how long a request for one waits for its answer."""
    check(cmd)  # before touching the GPUs: a typo gets its sentence at once
    sampler = Sampler(SamplerConfig(interval=interval), simulate=simulate, gpus=gpus)
    sampler.open()
    tracing = _on_run(trace_dir, trace_timeout_s) if trace else None
    one = _Run(sampler, out, max_points, stacks, tracing)
    one.supervise(cmd)
    return one.report(cmd)


def _on_run(trace_dir: str | None, timeout_s: float | None) -> OnRun:
    from .trace.onrun import TRACE_TIMEOUT_S, OnRun  # only for --trace: the trace package is not light

    return OnRun(trace_dir, TRACE_TIMEOUT_S if timeout_s is None else timeout_s)


class _Run:
    """One `gpuscope run`, from the command's start to its report: what the main loop, the clean-up
    and the report share. `supervise` then `report`, once each."""

    def __init__(self, sampler: Sampler, out: Any, max_points: int, stacks: bool, tracing: OnRun | None) -> None:
        self.sampler, self.out, self.max_points, self.stacks, self.tracing = sampler, out, max_points, stacks, tracing
        self.started_at = time.time()
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.child: subprocess.Popen[bytes] | None = None
        self.procs: RunProcesses | None = None
        self.forward = Forwarder(lambda c: self.procs.live_descendants() if self.procs is not None else [])
        self.profiler: Any = None
        self.first: Any = None  # the snapshot before the command started
        self.t0 = 0.0  # time.time() when it started: the reports' seconds count from here
        self.collector: _Collector | None = None
        self.segments: list[Segment] = []
        self.last_end: dict[str, float] = {}

    def supervise(self, cmd: list[str]) -> None:
        """Start `cmd` and watch it until it exits. From here on a signal is ours to handle, and
        whatever happens, the child is not left behind."""
        self.forward.install()
        try:
            self._start(cmd)
            self._watch()
        finally:
            self._close()

    def _start(self, cmd: list[str]) -> None:
        self.first = self.sampler.sample_once()
        env = self.tracing.environment() if self.tracing is not None else None
        child = self.child = self.forward.child = start(cmd, env)
        self.t0 = time.time()
        if self.forward.interrupts:  # a Ctrl-C while it started: the command hears of it too
            child.send_signal(signal.SIGINT)
        procs = self.procs = RunProcesses(child.pid, simulated=self.sampler.simulated is not None)
        if self.stacks and self.sampler.simulated is None:
            self.profiler = _profiler(procs)
        if self.tracing is not None:
            self.tracing.watch(self.sampler, procs, child.pid)
        self.collector = _Collector(self.t0, procs, self.max_points)
        self.sampler.subscribe(self.collector)

    def _watch(self) -> None:
        """The main loop, every 0.1 s until the command exits: its process tree, the status line, the
        trace requests, the verdicts, and SIGKILL for a command terminated but still there."""
        assert self.child is not None and self.procs is not None
        mono0 = time.monotonic()
        next_verdict = mono0 + EVERY_S
        next_tree = mono0 + 0.3  # a first look soon: short-lived children should be seen
        last_status = 0.0 if self.tty else mono0  # without a terminal: a line every 10 s, the first at 10 s
        self.sampler.start()
        while self.child.poll() is None:
            time.sleep(0.1)
            now = time.monotonic()
            if now >= next_tree:
                self.procs.poll_tree(time.time() - self.t0)
                next_tree = now + (TREE_EVERY_S if now - mono0 > 2 else 0.5)
            if (self.tty or now - last_status >= 10.0) and now - last_status >= 1.0 and self._show_status():
                last_status = now
            if self.tracing is not None:
                self.tracing.poll()
            if now >= next_verdict:
                made = self._verdicts()
                self.segments.extend(made)
                # Until the history is long enough for a verdict, look again soon.
                next_verdict = now + (EVERY_S if made or now - mono0 > WINDOW_S else 0.5)
            self.forward.kill_if_overdue(TERM_GRACE_S)

    def _show_status(self) -> bool:
        """The live line (a terminal: rewritten in place; else one line); False when nothing was sampled yet."""
        snap = self.sampler.latest()
        if snap is None:
            return False
        line = _status(snap, time.time() - self.t0)
        if self.tracing is not None:
            line += self.tracing.status()
        print(("\r" + line + "\033[K") if self.tty else line, end="" if self.tty else "\n", file=self.out, flush=True)
        return True

    def _verdicts(self, final: bool = False) -> list[Segment]:
        return _verdicts(self.sampler, self.t0, self.last_end, final=final, profiler=self.profiler,
                         tracing=self.tracing)

    def _close(self) -> None:
        if self.child is not None:
            reap(self.child)
            if self.forward.interrupts and self.procs is not None:  # interrupted: nothing the command started may outlive it
                reap_all(self.procs.live_descendants())
        self.forward.restore()
        self.sampler.stop()
        if self.tty and self.child is not None:
            print("\r\033[K", end="", file=self.out, flush=True)  # the live line gives way to the summary
        if self.tracing is not None:  # the requests, and the traces unless trace_dir keeps them beside a report
            self.tracing.finish()

    def report(self, cmd: list[str]) -> tuple[int, dict[str, Any]]:
        """(the exit code to use, the report dict), with the verdict of the run's tail."""
        child, procs, collector = self.child, self.procs, self.collector
        assert child is not None and procs is not None and collector is not None  # supervise ends no other way
        self.segments.extend(self._verdicts(final=True))
        last = self.sampler.latest()
        duration = time.time() - self.t0
        rc = child.returncode
        code = exit_code(rc)
        table = procs.table()
        report = _summarise(self.segments, duration, _energy(self.first), _energy(last) if last is not None else {},
                            code, self.forward.interrupts > 0, self.sampler.simulated,
                            ours={r["pid"] for r in table if r["ours"]})
        _process_verdicts(table, self.segments, report["process_spans"])
        report.update({
            "command": redact_cmdline(cmd), "started_at": self.started_at, "hostname": self.first.hostname,
            "gpu_start_s": procs.gpu_start_s, "gpu_start_by_gpu": procs.gpu_start_by_gpu,
            "gpus": [collector.gpus[k] for k in sorted(collector.gpus, key=gpu_order)],
            "processes": table,
            "series": {k: collector.timelines[k].points() for k in sorted(collector.timelines, key=gpu_order)},
            "killed_by_signal": -rc if rc is not None and rc < 0 else None,
        })
        if self.tracing is not None:
            report["trace"] = self.tracing.report()
        return code, report


def _profiler(procs: RunProcesses) -> Any:
    """Stack sampling for the diagnosis, restricted to the command's own processes."""
    sample = Profiler(seconds=2.0, every_s=30.0)

    def profiler(pid: int) -> tuple[Any, str | None]:
        if not procs.ours(pid):
            return None, f"process {pid} is not the command's, so its stacks were not sampled"
        return sample(pid)

    return profiler



def _energy(snap: Any) -> dict[str, float]:
    out = {}
    for g in snap.gpus:
        v = g.get("gpu_energy_joules_total")
        if v is not None:
            out[g.identity.label] = v
    return out


def _verdicts(sampler: Sampler, t0: float, last_end: dict[str, float], final: bool = False,
              profiler: Any = None, tracing: OnRun | None = None) -> list[Segment]:
    history = list(sampler.history)
    if not history:
        return []
    end = history[-1].time_ns
    span_s = WINDOW_S
    if final:  # the tail since the last verdict, if it is long enough to say something
        span_s = max(DEFAULT.min_window_s, min(WINDOW_S, end / 1e9 - t0 - min(last_end.values(), default=0.0)))
    # A little more than span_s: at 10 Hz, "the last 5 s" would otherwise hold 4.9 s of samples.
    window = [s for s in history if s.time_ns >= end - int((span_s + 0.25) * 1e9)]
    if (window[-1].time_ns - window[0].time_ns) / 1e9 < DEFAULT.min_window_s:
        return []
    out = []
    primary_seen: set[str] = set()
    ends: dict[str, float] = {}
    windows = windows_from_snapshots(window)
    pids = {w.gpu: [p.pid for p in w.processes] for w in windows}
    found = diagnose(windows, profiler=profiler)
    if tracing is not None:
        shared = {v.gpu: v.processes for v in found if v.primary and v.processes}
        found = tracing.verdicts(found, end / 1e9 - t0, final)
        for v in found:  # a trace's verdict for a shared GPU keeps its processes' own
            if v.primary and not v.processes and v.gpu in shared:
                v.processes = shared.pop(v.gpu)
    for v in found:
        if not (v.primary or v.severity != "info"):
            continue
        # One primary verdict per GPU and window (the rules give it first); any other, such as a
        # straggler among peers, is a side verdict.
        primary = v.primary and v.gpu not in primary_seen
        if primary:
            primary_seen.add(v.gpu)
        w_start, w_end = max(0.0, v.start_s - t0), v.end_s - t0  # the first sample precedes the start
        start = max(w_start, last_end.get(v.gpu, w_start))
        if final and w_end - start < 1.0:
            continue  # nothing new since the last verdict
        out.append(Segment(v.gpu, v.kind, start, w_end, v.summary, list(v.recommendations), v.severity, primary,
                           dict(v.evidence), pids.get(v.gpu, []) if primary else [],
                           [{"pid": pv.pid, "kind": pv.kind, "severity": pv.severity, "summary": pv.summary,
                             "recommendations": list(pv.recommendations), "evidence": dict(pv.evidence),
                             "primary": pv.primary} for pv in v.processes] if primary else []))
        ends[v.gpu] = max(ends.get(v.gpu, w_end), w_end)
    last_end.update(ends)
    return out


def spans(segments: list[Segment], primary: bool = True) -> list[dict[str, Any]]:
    """Consecutive equal verdicts per GPU merged: [{gpu, kind, start_s, end_s, summary, evidence,
    recommendations, verdicts}], by GPU then time. The summary and evidence are those of the span's
    first verdict."""
    by_gpu: dict[str, list[Segment]] = defaultdict(list)
    for s in segments:
        if s.primary == primary:
            by_gpu[s.gpu].append(s)
    out: list[dict[str, Any]] = []
    for gpu in sorted(by_gpu, key=gpu_order):
        open_: dict[str, dict[str, Any]] = {}  # side verdicts can overlap each other: one open span per kind
        cur: dict[str, Any] | None = None
        for s in sorted(by_gpu[gpu], key=lambda s: s.start_s):
            key = "primary" if primary else s.kind
            cur = open_.get(key)
            if cur is not None and cur["kind"] == s.kind and s.start_s <= cur["end_s"] + 1.0:
                cur["end_s"] = max(cur["end_s"], s.end_s)
                cur["verdicts"] += 1
                continue
            cur = {"gpu": gpu, "kind": s.kind, "start_s": s.start_s, "end_s": s.end_s, "severity": s.severity,
                   "summary": s.summary, "evidence": s.evidence, "recommendations": s.recommendations, "verdicts": 1}
            open_[key] = cur
            out.append(cur)
    return out


def process_spans(segments: list[Segment]) -> list[dict[str, Any]]:
    """Each process's own verdicts on a shared GPU, consecutive equal ones merged: [{gpu, pid, kind, start_s,
    end_s, severity, summary, evidence, recommendations, primary, verdicts}], by GPU, pid, then time."""
    out: list[dict[str, Any]] = []
    open_: dict[tuple[str, int, bool, str], dict[str, Any]] = {}
    for s in sorted((s for s in segments if s.primary and s.processes), key=lambda s: s.start_s):
        for pv in s.processes:
            key = (s.gpu, pv["pid"], pv["primary"], "" if pv["primary"] else pv["kind"])
            cur = open_.get(key)
            if cur is not None and cur["kind"] == pv["kind"] and s.start_s <= cur["end_s"] + 1.0:
                cur["end_s"] = max(cur["end_s"], s.end_s)
                cur["verdicts"] += 1
                continue
            cur = open_[key] = {"gpu": s.gpu, "pid": pv["pid"], "kind": pv["kind"], "start_s": s.start_s,
                                "end_s": s.end_s, "severity": pv["severity"], "summary": pv["summary"],
                                "evidence": pv["evidence"], "recommendations": pv["recommendations"],
                                "primary": pv["primary"], "verdicts": 1}
            out.append(cur)
    out.sort(key=lambda sp: (gpu_order(sp["gpu"]), sp["pid"], sp["start_s"]))
    return out


def _process_verdicts(table: list[dict[str, Any]], segments: list[Segment], pspans: list[dict[str, Any]]) -> None:
    """Each GPU row of the process table gets its verdict over the run: `verdict_share` (kind -> share of the
    time it was judged), `verdict` (the longest), its severity and summary. On a shared GPU the process's own
    verdicts count; where it had the GPU alone, the GPU's (it was its own)."""
    held: dict[tuple[str, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    said: dict[tuple[str, int, str], tuple[str, str]] = {}
    for sp in pspans:
        if sp["primary"]:
            held[(sp["gpu"], sp["pid"])][sp["kind"]] += max(0.0, sp["end_s"] - sp["start_s"])
            said.setdefault((sp["gpu"], sp["pid"], sp["kind"]), (sp["severity"], sp["summary"]))
    for s in segments:
        if s.primary and not s.processes and len(s.pids) == 1:
            held[(s.gpu, s.pids[0])][s.kind] += max(0.0, s.end_s - s.start_s)
            said.setdefault((s.gpu, s.pids[0], s.kind), (s.severity, s.summary))
    for row in table:
        kinds = held.get((row["gpu"], row["pid"])) if row["gpu"] is not None else None
        if not kinds:
            row.update({"verdict": None, "verdict_share": {}, "verdict_severity": None, "verdict_summary": None})
            continue
        total = sum(kinds.values())
        top = max(kinds, key=lambda k: (kinds[k], k))
        severity, summary = said[(row["gpu"], row["pid"], top)]
        row.update({"verdict": top, "verdict_severity": severity, "verdict_summary": summary,
                    "verdict_share": {k: (v / total if total > 0 else 1.0 / len(kinds))
                                      for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}})


def _summarise(segments: list[Segment], duration: float, e0: dict[str, float], e1: dict[str, float],
               code: int, interrupted: bool, simulated: str | None, ours: set[int] | None = None) -> dict[str, Any]:
    main, side = spans(segments, True), spans(segments, False)
    pspans = process_spans(segments)
    share: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in main:
        share[s["gpu"]][s["kind"]] += max(0.0, s["end_s"] - s["start_s"])
    verdict_share = {g: {k: v / sum(kinds.values()) for k, v in kinds.items()} if sum(kinds.values()) > 0
                     else {k: 1.0 / len(kinds) for k in kinds} for g, kinds in share.items()}
    energy = {g: e1[g] - e0[g] for g in e1 if g in e0 and e1[g] >= e0[g]}
    return {
        "duration_s": duration, "exit_code": code, "interrupted": interrupted, "simulated": simulated,
        "energy_joules": sum(energy.values()) if energy else None, "energy_joules_by_gpu": energy,
        "verdict_share": verdict_share,
        "spans": main, "side_spans": side,
        "timeline": [asdict(s) for s in segments],
        "process_spans": pspans,
        # a problem of one of the run's own processes on a shared GPU is the run's to change too
        "change_first": _change_first(main + side + [p for p in pspans if ours is None or p["pid"] in ours]),
    }


def _change_first(all_spans: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The problem that matters most: critical ones (hardware, a lost GPU) before warnings before the
    rest; among equals, the one that held longest over all GPUs."""
    problems = [s for s in all_spans if s["kind"] not in FINE]
    if not problems:
        return None
    # A trace that settled a GPU's verdict (sync- rather than launch-bound) speaks for the time before it
    # too: the time that GPU spent under the metrics' unsettled verdict counts for the trace's.
    settled = {(s["gpu"], s["evidence"]["metrics_verdict"]): s["kind"] for s in problems
               if isinstance(s.get("evidence"), dict) and s["evidence"].get("metrics_verdict")}
    total: dict[str, float] = defaultdict(float)
    for s in problems:
        total[settled.get((s["gpu"], s["kind"]), s["kind"])] += s["end_s"] - s["start_s"]
    rank = {"critical": 2, "warning": 1}
    kind = max(total, key=lambda k: (max(rank.get(s["severity"], 0) for s in problems if s["kind"] == k), total[k]))
    first = next(s for s in problems if s["kind"] == kind)
    return {"gpu": first["gpu"], "kind": kind, "summary": first["summary"], "advice": first["recommendations"][:2],
            "seconds": total[kind]}


def _secs(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def render(report: dict[str, Any]) -> str:
    """The end-of-run text: summary, verdict timeline per GPU, what to change first."""
    sim = report["simulated"]
    cmd0 = os.path.basename((report.get("command") or "the command").split(" ")[0])
    if not report["spans"] and report["duration_s"] < DEFAULT.min_window_s + 1:
        how = "was interrupted" if report["interrupted"] else f"exited with code {report['exit_code']}"
        return (f"gpuscope run: {cmd0} {how} after {report['duration_s']:.1f} s, too soon for a verdict "
                f"(a steady state needs at least {DEFAULT.min_window_s:.0f} s)"
                + (f" [SIMULATED node '{sim}']." if sim else "."))
    lines = []
    head = (f"gpuscope run: {report['duration_s']:.0f} s, exit code {report['exit_code']}"
            + (" (interrupted)" if report["interrupted"] else "")
            + (f", energy {report['energy_joules'] / 1000:.1f} kJ" if report["energy_joules"] is not None else "")
            + (f"  [SIMULATED node '{sim}']" if sim else ""))
    lines.append(head)
    if report.get("gpu_start_s") is not None:
        lines.append(f"  the run's processes first used a GPU at {report['gpu_start_s']:.1f} s")
    if not report["verdict_share"]:
        lines.append(f"  no verdict: the GPUs were never watched for a steady {DEFAULT.min_window_s:.0f} s.")
    for gpu, kinds in sorted(report["verdict_share"].items(), key=lambda kv: gpu_order(kv[0])):
        lines.append(f"  GPU {gpu}: " + ", ".join(f"{k} {v * 100:.0f} %" for k, v in
                                                   sorted(kinds.items(), key=lambda kv: -kv[1])))
        tl = [f"{_secs(s['start_s'])}–{_secs(s['end_s'])} s {s['kind']}" for s in report["spans"] if s["gpu"] == gpu]
        lines.append("    timeline: " + ", ".join(tl))
        side = [f"{s['kind']} {_secs(s['start_s'])}–{_secs(s['end_s'])} s" for s in report["side_spans"]
                if s["gpu"] == gpu]
        if side:
            lines.append("    also: " + ", ".join(side))
        shared = {sp["pid"] for sp in report.get("process_spans") or [] if sp["gpu"] == gpu}
        for row in report.get("processes") or []:  # a shared GPU: what limited each of its processes
            if row.get("gpu") == gpu and row["pid"] in shared and row.get("verdict_share"):
                lines.append(f"    process {row['pid']} ({row.get('name') or '?'}): " + ", ".join(
                    f"{k} {v * 100:.0f} %" for k, v in row["verdict_share"].items()))
    if report.get("trace") is not None:
        from .trace.onrun import report_lines

        lines.extend(report_lines(report["trace"], _secs))
    cf = report["change_first"]
    if cf:
        lines.append(f"  change first: {cf['summary']}")
        lines.extend(f"    -> {a}" for a in cf["advice"])
    return "\n".join(lines)
