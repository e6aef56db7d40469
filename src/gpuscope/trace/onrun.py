"""`gpuscope run --trace`: trace a GPU whose verdict the metrics cannot settle, and let the trace's
verdict speak for it.

CMD runs with the tracing bootstrap in on-demand mode (trace/ondemand.py), its requests and traces in a
private temporary directory. A GPU whose primary verdict stays unsettled (`unsettled`) for
`TRACE_AFTER` verdicts in a row gets one `TRACE_WINDOW_S` trace of the command's processes on it; the
trace is analysed on a thread, and its verdict then replaces the metrics' for that GPU
(trace.verdicts.refine). `OnRun` is the face gpuscope run (runcmd.py) sees; `Tracing` does the asking.

Decisions: the run never waits for a trace (a request unanswered in `TRACE_TIMEOUT_S` is given up, the
metrics' verdict stands); a trace that cannot be analysed leaves the metrics' verdicts as they are; one
trace per GPU, one more only when the unsettled verdict changes family; requests stay private to the
run (never beside a kept trace).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._child import RunError

if TYPE_CHECKING:
    from ..diagnose import Verdict

__all__ = ["TRACE_AFTER", "TRACE_TIMEOUT_S", "TRACE_WAITING", "TRACE_WINDOW_S", "OnRun", "Tracing", "report_lines",
           "traceable", "unsettled"]

TRACE_WINDOW_S = 3.0  # how long one trace window lasts
TRACE_AFTER = 2  # an unsettled verdict this many times in a row asks for a trace
TRACE_TIMEOUT_S = 30.0  # no answer this long after the request: no trace will come
TRACE_WAITING = f"tracing {TRACE_WINDOW_S:.0f} s to tell launch- from sync-bound…"


def unsettled(v: Verdict) -> str | None:
    """The family of a primary verdict that the metrics and stack samples leave open, or None.

    launch_or_sync_bound only says that the GPU waits on a busy host thread; host_bound is what stacks
    say when no cause stands out (0.6); input_starved under 0.8 is the metrics' reading of idle gaps
    (from stacks it is 0.85). sync_bound and launch_bound come from stacks only and are taken as said."""
    if v.kind in ("launch_or_sync_bound", "host_bound"):
        return "host"
    if v.kind == "input_starved" and v.confidence < 0.8:
        return "input"
    return None


def traceable(sampler: Any, procs: Any, child_pid: int) -> Callable[[str], list[int]]:
    """The pids a trace of one GPU is asked from: the command's processes on that GPU (`sampler` a
    gpuscope.sampler.Sampler, `procs` the run's report.processes.RunProcesses).

    On the simulated node the GPU processes are made up (no process has their pids) and the command
    runs on the CPU only, so the command's own processes stand for every simulated GPU: a trace one of
    them writes refines the verdicts of the GPU that asked (refine's gpu_of_pid maps their pids to it)."""

    def pids_of(gpu: str) -> list[int]:
        if sampler.simulated is not None:
            return [child_pid] + [p.pid for p in procs.live_descendants()]
        snap = sampler.latest()
        return sorted({p.pid for p in (snap.processes if snap is not None else []) if p.gpu == gpu and procs.ours(p.pid)})

    return pids_of


class Tracing:
    """Asks the command's processes of a GPU for one trace when its verdict stays unsettled, waits for
    the answer without blocking the run, analyses the trace on a thread, and from then on refines that
    GPU's verdicts with it. One trace per GPU, or one more if the unsettled verdict changes family.
    Used from the run's main loop; the analysis thread hands over under a lock."""

    def __init__(self, req_dir: str, trace_dir: str, pids_of: Callable[[str], list[int]],
                 timeout_s: float = TRACE_TIMEOUT_S) -> None:
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
            family = unsettled(v)
            last, n = self._streak.get(v.gpu, (None, 0))
            n = n + 1 if family is not None and family == last else int(family is not None)
            self._streak[v.gpu] = (family, n)
            busy = v.gpu in self._pending or v.gpu in self._loading
            if family is not None and n >= TRACE_AFTER and self._asked.get(v.gpu) != family and not busy:
                self._ask(v.gpu, family, t_s)

    def _ask(self, gpu: str, family: str, t_s: float) -> None:
        from . import ondemand

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
        from . import ondemand

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
        from .kineto import load
        from .verdicts import verdicts

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
        from .verdicts import refine

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


class OnRun:
    """What `gpuscope run` calls, in this order: `environment()` for CMD (before it starts), `watch()`
    once it runs, then from its main loop `status()`, `poll()` and `verdicts()` each round, `finish()`
    in its clean-up (always), and `report()` for the report's "trace".

    Traces go into `trace_dir` (kept, beside the run's report) or, when it is None, into the private
    temporary directory that `finish` removes with the requests."""

    def __init__(self, trace_dir: str | None, timeout_s: float = TRACE_TIMEOUT_S) -> None:
        self.trace_dir, self.timeout_s = trace_dir, timeout_s
        self.tmp = tempfile.mkdtemp(prefix="gpuscope-run-")  # private: mode 0700
        self.req_dir = os.path.join(self.tmp, "requests")
        self.traces_at = trace_dir or os.path.join(self.tmp, "traces")
        self.tracing: Tracing | None = None

    def environment(self) -> dict[str, str]:
        """CMD's environment: ours with the bootstrap on demand. The trace directory is made here: one
        that cannot be is a RunError (exit 2) before CMD starts."""
        from .run import environment

        try:
            os.makedirs(self.traces_at, exist_ok=True)
        except OSError as e:
            raise RunError(f"Cannot create the trace directory {self.traces_at}: {e.strerror or e}.", 2) from None
        return environment(self.traces_at, 0.0, TRACE_WINDOW_S, 0.0, True, uuid.uuid4().hex, requests_dir=self.req_dir)

    def watch(self, sampler: Any, procs: Any, child_pid: int) -> None:
        """CMD runs as `child_pid`: from now on its verdicts may ask for traces (see `traceable`)."""
        self.tracing = Tracing(self.req_dir, self.traces_at, traceable(sampler, procs, child_pid), self.timeout_s)

    def status(self) -> str:
        """What the live status line adds: that a trace is under way, or nothing."""
        return "  " + TRACE_WAITING if self.tracing is not None and self.tracing.waiting() else ""

    def poll(self) -> None:
        if self.tracing is not None:
            self.tracing.poll()

    def verdicts(self, found: list[Verdict], t_s: float, final: bool) -> list[Verdict]:
        """A window's verdicts refined by the traces that came; unless it is the run's last window, they
        also count towards asking for one (made at `t_s`, seconds since the run began)."""
        if self.tracing is None:
            return found
        found = self.tracing.refine(found)
        if not final:
            self.tracing.observe(found, t_s)
        return found

    def finish(self) -> None:
        """The run ended: the last answers and analyses in (bounded by the timeout), the private
        directory removed (the requests, and the traces unless `trace_dir` keeps them)."""
        try:
            if self.tracing is not None:
                self.tracing.finish()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def report(self) -> dict[str, Any]:
        return {"dir": self.trace_dir, "kept": self.trace_dir is not None,
                "requests": self.tracing.records if self.tracing is not None else []}


def report_lines(trace: dict[str, Any], secs: Callable[[float], str]) -> list[str]:
    """What `run --trace` asked for and what each trace said, for the end-of-run text; `secs` formats
    seconds as the rest of that text does."""
    if not trace["requests"]:
        return ["  traces: none needed (no GPU's verdict stayed unsettled)"]
    lines = []
    for r in trace["requests"]:
        head = f"  trace of GPU {r['gpu']} (asked at {secs(r['requested_at_s'])} s)"
        if r["file"] is None or r["verdict"] is None:
            lines.append(f"{head}: {r['note'] or 'no trace came'}" + (f" [{r['file']}]" if r["file"] else ""))
            continue
        sure = " (certain)" if (r["confidence"] or 0) >= 0.9 else ""
        lines.append(f"{head}: {r['file']}" + ("" if trace["kept"] else " (removed at the end)"))
        lines.append(f"    {r['verdict']}{sure}" + (f" at {r['line']}" if r["line"] else "")
                     + f"; it replaced the metrics' verdict {r['refined_verdicts']} time(s)")
    return lines
