"""`gpuscope run -- CMD ...`: run a program, watch the GPUs while it runs, say what limited it.

While CMD runs, the sampler reads the GPUs at 10 Hz; every 5 s the last 10 s get a verdict per GPU.
The whole run's key series go into a bounded timeline (report.timeline), the child and all its
descendants into a process table (report.processes), and at the end come the verdict timeline, the
time share of each verdict, the energy used and what to change first (`render`), plus the JSON and
HTML reports (cli.py writes them).

Signals: Ctrl-C at a terminal reaches CMD directly (it shares our process group); a SIGINT or SIGTERM
sent to gpuscope alone is forwarded to CMD. A second one terminates CMD (SIGTERM, then SIGKILL after
5 s). Either way gpuscope waits for CMD, reports what it saw and exits with CMD's exit code (128 + N
when a signal N ended it, as a shell would say). The child is never left running behind.

With `trace` (`gpuscope run --trace`), CMD runs with the tracing bootstrap in on-demand mode (see
trace/ondemand.py), and a GPU whose verdict the metrics cannot settle (`_Tracing`) gets one 3 s trace
of its processes; that trace's verdict then replaces the metrics' for that GPU (trace.verdicts.refine).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from ._redact import redact_cmdline
from .diagnose import Profiler, Verdict, diagnose, windows_from_snapshots
from .diagnose.thresholds import DEFAULT
from .errors import UserError
from .report.processes import RunProcesses
from .report.timeline import GpuTimeline, gpu_order
from .sampler import Sampler, SamplerConfig

WINDOW_S = 10.0  # each verdict looks at this much history
EVERY_S = 5.0  # and a new one is made this often
TREE_EVERY_S = 2.0  # how often the child's process tree is read
TERM_GRACE_S = 5.0  # after SIGTERM, this long before SIGKILL
#: Primary verdicts that need no change: never "what to change first".
FINE = {"healthy", "compute_bound", "idle", "power_capped"}
TRACE_WINDOW_S = 3.0  # `run --trace`: how long one trace window lasts
TRACE_AFTER = 2  # an unsettled verdict this many times in a row asks for a trace
TRACE_TIMEOUT_S = 30.0  # no answer this long after the request: no trace will come
TRACE_WAITING = f"tracing {TRACE_WINDOW_S:.0f} s to tell launch- from sync-bound…"


class RunError(UserError, RuntimeError):
    """One sentence for the user (the command could not be started). `code` is the exit code."""

    def __init__(self, message: str, code: int = 127) -> None:
        super().__init__(message)
        self.code = self.exit_code = code


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


def _terminal_reaches(pgrp: int) -> bool:
    """True when a terminal's Ctrl-C reaches process group `pgrp` by itself (it is the foreground group
    of our controlling terminal), so forwarding would deliver the signal twice."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == pgrp
    except OSError:
        return False
    finally:
        os.close(fd)


class Forwarder:
    """The SIGINT/SIGTERM handler while a command runs under gpuscope (`run`, `trace`): a signal sent
    to gpuscope alone goes to the command and every process it started (as a terminal's Ctrl-C would;
    not again when the terminal already delivered it); a second one terminates the command."""

    def __init__(self, descendants: Callable[[subprocess.Popen[bytes]], Iterable[Any]]) -> None:
        self.descendants = descendants
        self.child: subprocess.Popen[bytes] | None = None
        self.interrupts = 0
        self._old: dict[int, Any] = {}

    def __call__(self, signum: int, _frame: Any) -> None:
        self.interrupts += 1
        child = self.child
        if child is None or child.poll() is not None:
            return
        try:
            if self.interrupts >= 2:
                child.terminate()
            elif signum != signal.SIGINT or not _terminal_reaches(os.getpgid(child.pid)):
                child.send_signal(signum)
                for p in self.descendants(child):
                    p.send_signal(signum)
        except (OSError, psutil.Error):  # gone meanwhile
            pass

    def install(self) -> None:
        self._old = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _check(cmd: list[str]) -> None:
    if not cmd:
        raise RunError("Nothing to run: give a command after --, e.g. gpuscope run -- python train.py.", 2)
    if not cmd[0].strip():  # `run -- "$UNSET_VAR"`: which('') is None and the message read "Command not found: ."
        raise RunError("The command to run is an empty string; give one after --, e.g. gpuscope run -- python "
                       "train.py.", 2)
    if os.sep not in cmd[0] and shutil.which(cmd[0]) is None:
        raise RunError(f"Command not found: {cmd[0]}.", 127)
    if os.sep in cmd[0] and not os.path.exists(cmd[0]):
        raise RunError(f"Command not found: {cmd[0]} does not exist.", 127)
    if os.sep in cmd[0] and os.path.isdir(cmd[0]):
        raise RunError(f"Cannot run {cmd[0]}: it is a directory.", 126)


def _start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(cmd, env=env)
    except PermissionError:
        raise RunError(f"Cannot run {cmd[0]}: permission denied (is it executable?).", 126) from None
    except OSError as e:
        raise RunError(f"Cannot run {cmd[0]}: {(e.strerror or str(e)).rstrip('.')}.", 126) from None


def run(cmd: list[str], *, simulate: str | None = None, gpus: int | None = None, interval: float = 0.1,
        out: Any = sys.stderr, max_points: int = 6144, stacks: bool = True, trace: bool = False,
        trace_dir: str | None = None, trace_timeout_s: float = TRACE_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
    """Run `cmd`, watch the GPUs meanwhile; return (the exit code to use, the report dict).

    With `stacks`, a GPU that waits on a saturated thread of the command's processes (never another
    user's) has that process's Python stacks sampled for 2 s (py-spy), at most every 30 s. With `trace`,
    such a GPU whose verdict stays unsettled gets a trace (`_Tracing`), written into `trace_dir` (kept)
    or into a temporary directory removed at the end."""
    _check(cmd)  # before touching the GPUs: a typo gets its sentence at once
    sampler = Sampler(SamplerConfig(interval=interval), simulate=simulate, gpus=gpus)
    sampler.open()
    tmp = tempfile.mkdtemp(prefix="gpuscope-run-") if trace else None  # private: mode 0700
    started_at = time.time()
    child: subprocess.Popen[bytes] | None = None
    procs: RunProcesses | None = None
    forward = Forwarder(lambda c: procs.live_descendants() if procs is not None else [])

    # From here on a signal is ours to handle, and whatever happens, the child is not left behind.
    forward.install()
    tty = hasattr(out, "isatty") and out.isatty()
    segments: list[Segment] = []
    last_end: dict[str, float] = {}
    tracing: _Tracing | None = None
    try:
        first = sampler.sample_once()
        env = None
        if tmp is not None:
            from .trace.run import environment

            traces_at = _trace_dir(trace_dir, tmp)
            env = environment(traces_at, 0.0, TRACE_WINDOW_S, 0.0, True, uuid.uuid4().hex,
                              requests_dir=os.path.join(tmp, "requests"))
        child = forward.child = _start(cmd, env)
        t0 = time.time()
        if forward.interrupts:  # a Ctrl-C while it started: the command hears of it too
            child.send_signal(signal.SIGINT)
        procs = RunProcesses(child.pid, simulated=sampler.simulated is not None)
        profiler = _profiler(procs) if stacks and sampler.simulated is None else None
        if tmp is not None:
            tracing = _Tracing(os.path.join(tmp, "requests"), traces_at, _traceable(sampler, procs, child.pid),
                               trace_timeout_s)
        collector = _Collector(t0, procs, max_points)
        sampler.subscribe(collector)
        mono0 = time.monotonic()
        next_verdict = mono0 + EVERY_S
        next_tree = mono0 + 0.3  # a first look soon: short-lived children should be seen
        last_status = 0.0 if tty else mono0  # without a terminal: a line every 10 s, the first at 10 s
        terminated_at: float | None = None
        sampler.start()
        while child.poll() is None:
            time.sleep(0.1)
            now = time.monotonic()
            if now >= next_tree:
                procs.poll_tree(time.time() - t0)
                next_tree = now + (TREE_EVERY_S if now - mono0 > 2 else 0.5)
            snap = sampler.latest()
            if snap is not None and (tty or now - last_status >= 10.0) and now - last_status >= 1.0:
                line = _status(snap, time.time() - t0)
                if tracing is not None and tracing.waiting():
                    line += "  " + TRACE_WAITING
                print(("\r" + line + "\033[K") if tty else line, end="" if tty else "\n", file=out, flush=True)
                last_status = now
            if tracing is not None:
                tracing.poll()
            if now >= next_verdict:
                made = _verdicts(sampler, t0, last_end, profiler=profiler, tracing=tracing)
                segments.extend(made)
                # Until the history is long enough for a verdict, look again soon.
                next_verdict = now + (EVERY_S if made or now - mono0 > WINDOW_S else 0.5)
            if forward.interrupts >= 2:
                if terminated_at is None:
                    terminated_at = now
                elif now - terminated_at > TERM_GRACE_S:
                    child.kill()
    finally:
        if child is not None:
            _reap(child)
            if forward.interrupts and procs is not None:  # interrupted: nothing the command started may outlive it
                _reap_all(procs.live_descendants())
        forward.restore()
        sampler.stop()
        if tty and child is not None:
            print("\r\033[K", end="", file=out, flush=True)  # the live line gives way to the summary
        if tracing is not None:
            tracing.finish()
        if tmp is not None:  # the requests, and the traces unless trace_dir keeps them beside a report
            shutil.rmtree(tmp, ignore_errors=True)
    assert child is not None and procs is not None  # the try ends no other way
    segments.extend(_verdicts(sampler, t0, last_end, final=True, profiler=profiler, tracing=tracing))
    last = sampler.latest()
    duration = time.time() - t0
    rc = child.returncode
    code = 128 - rc if rc is not None and rc < 0 else (rc if rc is not None else 1)
    report = _summarise(segments, duration, _energy(first), _energy(last) if last is not None else {},
                        code, forward.interrupts > 0, sampler.simulated)
    report.update({
        "command": redact_cmdline(cmd), "started_at": started_at, "hostname": first.hostname,
        "gpu_start_s": procs.gpu_start_s, "gpu_start_by_gpu": procs.gpu_start_by_gpu,
        "gpus": [collector.gpus[k] for k in sorted(collector.gpus, key=gpu_order)],
        "processes": procs.table(),
        "series": {k: collector.timelines[k].points() for k in sorted(collector.timelines, key=gpu_order)},
        "killed_by_signal": -rc if rc is not None and rc < 0 else None,
    })
    if tracing is not None:
        report["trace"] = {"dir": trace_dir, "kept": trace_dir is not None, "requests": tracing.records}
    return code, report


def _trace_dir(wanted: str | None, tmp: str) -> str:
    path = wanted or os.path.join(tmp, "traces")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise RunError(f"Cannot create the trace directory {path}: {e.strerror or e}.", 2) from None
    return path


def _traceable(sampler: Sampler, procs: RunProcesses, child_pid: int) -> Any:
    """The pids a trace of one GPU is asked from: the command's processes on that GPU.

    On the simulated node the GPU processes are made up (no process has their pids) and the command
    runs on the CPU only, so the command's own processes stand for every simulated GPU: a trace one of
    them writes refines the verdicts of the GPU that asked (refine's gpu_of_pid maps their pids to it)."""

    def pids_of(gpu: str) -> list[int]:
        if sampler.simulated is not None:
            return [child_pid] + [p.pid for p in procs.live_descendants()]
        snap = sampler.latest()
        return sorted({p.pid for p in (snap.processes if snap is not None else []) if p.gpu == gpu and procs.ours(p.pid)})

    return pids_of


def _profiler(procs: RunProcesses) -> Any:
    """Stack sampling for the diagnosis, restricted to the command's own processes."""
    sample = Profiler(seconds=2.0, every_s=30.0)

    def profiler(pid: int) -> tuple[Any, str | None]:
        if not procs.ours(pid):
            return None, f"process {pid} is not the command's, so its stacks were not sampled"
        return sample(pid)

    return profiler


def _unsettled(v: Verdict) -> str | None:
    """The family of a primary verdict that the metrics and stack samples leave open, or None.

    launch_or_sync_bound only says that the GPU waits on a busy host thread; host_bound is what stacks
    say when no cause stands out (0.6); input_starved under 0.8 is the metrics' reading of idle gaps
    (from stacks it is 0.85). sync_bound and launch_bound come from stacks only and are taken as said."""
    if v.kind in ("launch_or_sync_bound", "host_bound"):
        return "host"
    if v.kind == "input_starved" and v.confidence < 0.8:
        return "input"
    return None


class _Tracing:
    """`run --trace`: asks the command's processes of a GPU for one trace when its verdict stays
    unsettled, waits for the answer without blocking the run, analyses the trace on a thread, and from
    then on refines that GPU's verdicts with it. One trace per GPU, or one more if the unsettled
    verdict changes family. Used from the main loop; the analysis thread hands over under a lock."""

    def __init__(self, req_dir: str, trace_dir: str, pids_of: Any, timeout_s: float = TRACE_TIMEOUT_S) -> None:
        self.req_dir, self.trace_dir, self.pids_of, self.timeout_s = req_dir, trace_dir, pids_of, timeout_s
        self.records: list[dict[str, Any]] = []
        self._streak: dict[str, tuple[str | None, int]] = {}
        self._asked: dict[str, str] = {}  # GPU -> the family its latest trace was asked for
        self._pending: dict[str, tuple[dict[str, Any], float]] = {}  # GPU -> (record, monotonic asked at)
        self._loading: dict[str, tuple[dict[str, Any], threading.Thread]] = {}
        self._traced: dict[str, tuple[dict[str, Any], list[Verdict]]] = {}
        self._gpu_of_pid: dict[int, str] = {}
        self._lock = threading.Lock()

    def waiting(self) -> bool:
        return bool(self._pending or self._loading)

    def observe(self, found: list[Verdict], t_s: float) -> None:
        """After a round of (refined) verdicts: count unsettled ones in a row, ask where it is due."""
        seen: set[str] = set()
        for v in found:
            if not v.primary or v.gpu in seen:
                continue
            seen.add(v.gpu)
            family = _unsettled(v)
            last, n = self._streak.get(v.gpu, (None, 0))
            n = n + 1 if family is not None and family == last else int(family is not None)
            self._streak[v.gpu] = (family, n)
            busy = v.gpu in self._pending or v.gpu in self._loading
            if family is not None and n >= TRACE_AFTER and self._asked.get(v.gpu) != family and not busy:
                self._ask(v.gpu, family, t_s)

    def _ask(self, gpu: str, family: str, t_s: float) -> None:
        from .trace import ondemand

        self._asked[gpu] = family
        pids = self.pids_of(gpu)
        rec: dict[str, Any] = {"gpu": gpu, "family": family, "requested_at_s": round(t_s, 1), "pids": pids,
                               "window_s": TRACE_WINDOW_S, "request_id": None, "pid": None, "file": None,
                               "verdict": None, "confidence": None, "summary": None, "line": None,
                               "refined_verdicts": 0, "note": None}
        self.records.append(rec)
        if not pids:
            rec["note"] = "no trace came: none of the command's processes uses this GPU"
            return
        rec["request_id"] = ondemand.write_request(self.req_dir, TRACE_WINDOW_S, pids)["id"]
        self._gpu_of_pid.update((pid, gpu) for pid in pids)
        self._pending[gpu] = (rec, time.monotonic())

    def poll(self, final: bool = False) -> None:
        """Take in the answers that came, the analyses that ended, and give up on requests that timed out."""
        from .trace import ondemand

        answers = ondemand.list_traces(self.req_dir) if self._pending else []
        for gpu, (rec, asked) in list(self._pending.items()):
            mine = [a for a in answers if a.get("id") == rec["request_id"]]
            written = next((a for a in mine if a.get("status") == "written" and a.get("file")), None)
            if written is not None:
                rec["pid"], rec["file"] = written.get("pid"), os.path.join(self.trace_dir, str(written["file"]))
                worker = threading.Thread(target=self._analyse, args=(gpu, rec), name="gpuscope-run-trace",
                                          daemon=True)
                self._loading[gpu] = (rec, worker)
                worker.start()
            elif len(mine) >= len(rec["pids"]) or final or time.monotonic() - asked > self.timeout_s:
                why = "; ".join(str(a.get("reason") or a.get("status")) for a in mine)
                rec["note"] = f"no trace came: {why or 'the process did not answer'}"
            else:
                continue
            del self._pending[gpu]
        for gpu, (_rec, worker) in list(self._loading.items()):
            if not worker.is_alive():
                del self._loading[gpu]

    def _analyse(self, gpu: str, rec: dict[str, Any]) -> None:
        from .trace.kineto import load
        from .trace.verdicts import verdicts

        try:
            found = verdicts(load(rec["file"]))
        except Exception as e:  # an unreadable trace or an analysis bug: the metrics' verdicts stand
            with self._lock:
                rec["note"] = f"the trace could not be analysed ({type(e).__name__}: {e})"
            return
        mine = [v for v in found if self._gpu_of_pid.get(v.evidence.get("pid", -1)) == gpu] or found[:1]
        with self._lock:
            if mine:
                v = mine[0]
                rec.update(verdict=v.kind, confidence=v.confidence, summary=v.summary, line=v.evidence.get("line"))
            else:
                rec["note"] = "the trace holds no GPU work"
            self._traced[gpu] = (rec, found)

    def finish(self) -> None:
        """The run ended: last answers in, and the analyses given up to `timeout_s` to end."""
        self.poll(final=True)
        end = time.monotonic() + self.timeout_s
        for rec, worker in list(self._loading.values()):
            worker.join(max(0.0, end - time.monotonic()))
            if worker.is_alive():
                rec["note"] = "the trace was still being analysed when the run ended"
        self._loading.clear()

    def refine(self, found: list[Verdict]) -> list[Verdict]:
        """The verdicts of a window, each traced GPU's refined with its trace (trace.verdicts.refine)."""
        from .trace.verdicts import refine

        with self._lock:
            traced = dict(self._traced)
        for gpu, (rec, trace_verdicts) in traced.items():
            mine = [v for v in found if v.gpu == gpu]
            if not trace_verdicts or not any(v.primary for v in mine):
                continue
            # Only this GPU's: a trace verdict that maps to no watched GPU has no window to stand for.
            refined = [v for v in refine(mine, trace_verdicts, self._gpu_of_pid) if v.gpu == gpu]
            rec["refined_verdicts"] += sum(1 for v in refined if v.primary and "metrics_verdict" in v.evidence)
            found = [v for v in found if v.gpu != gpu] + refined
        return found


def _reap(child: subprocess.Popen[bytes]) -> None:
    """We are leaving: never leave the child behind."""
    if child.poll() is not None:
        return
    try:
        child.terminate()
        child.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    except ProcessLookupError:
        child.wait()


def _reap_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=TERM_GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=1.0)


def _energy(snap: Any) -> dict[str, float]:
    out = {}
    for g in snap.gpus:
        v = g.get("gpu_energy_joules_total")
        if v is not None:
            out[g.identity.label] = v
    return out


def _verdicts(sampler: Sampler, t0: float, last_end: dict[str, float], final: bool = False,
              profiler: Any = None, tracing: _Tracing | None = None) -> list[Segment]:
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
    found = diagnose(windows_from_snapshots(window), profiler=profiler)
    if tracing is not None:
        found = tracing.refine(found)
        if not final:
            tracing.observe(found, end / 1e9 - t0)
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
                           dict(v.evidence)))
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


def _summarise(segments: list[Segment], duration: float, e0: dict[str, float], e1: dict[str, float],
               code: int, interrupted: bool, simulated: str | None) -> dict[str, Any]:
    main, side = spans(segments, True), spans(segments, False)
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
        "change_first": _change_first(main + side),
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
    if report.get("trace") is not None:
        lines.extend(_trace_lines(report["trace"]))
    cf = report["change_first"]
    if cf:
        lines.append(f"  change first: {cf['summary']}")
        lines.extend(f"    -> {a}" for a in cf["advice"])
    return "\n".join(lines)


def _trace_lines(trace: dict[str, Any]) -> list[str]:
    """What `run --trace` asked for and what each trace said."""
    if not trace["requests"]:
        return ["  traces: none needed (no GPU's verdict stayed unsettled)"]
    lines = []
    for r in trace["requests"]:
        head = f"  trace of GPU {r['gpu']} (asked at {_secs(r['requested_at_s'])} s)"
        if r["file"] is None or r["verdict"] is None:
            lines.append(f"{head}: {r['note'] or 'no trace came'}" + (f" [{r['file']}]" if r["file"] else ""))
            continue
        sure = " (certain)" if (r["confidence"] or 0) >= 0.9 else ""
        lines.append(f"{head}: {r['file']}" + ("" if trace["kept"] else " (removed at the end)"))
        lines.append(f"    {r['verdict']}{sure}" + (f" at {r['line']}" if r["line"] else "")
                     + f"; it replaced the metrics' verdict {r['refined_verdicts']} time(s)")
    return lines
