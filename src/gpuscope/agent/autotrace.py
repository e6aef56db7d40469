"""Windows the agent starts itself: when a GPU's verdict turns host-side, and on a schedule.

**Opting in is one variable.** The agent publishes the tracing bootstrap (trace/bootstrap/sitecustomize.py
and the two modules it loads by path) into DATA_DIR/bootstrap, beside agent.json (its host name and PID
namespace), at every start. A program opts in with

    PYTHONPATH=/var/lib/gpuscope/bootstrap          # a Slurm script: export it; a pod: env + hostPath mounts

and nothing else: Python imports sitecustomize from the first directory on the path that has one, and
the bootstrap finds the request and trace directories by convention, as its own directory's siblings
(DATA_DIR/trace-requests, DATA_DIR/traces). Why this and not GPUSCOPE_PROFILE=1 through a .pth file of
an installed gpuscope: the program's environment need not have gpuscope (a pod's image rarely does), the
bootstrap that runs is always the agent's own version (no skew between the two sides of the file
protocol), and the same line works for a pod (mount the three directories), a Slurm job and a shell.
A pod mounts bootstrap/ read-only and the two others, never DATA_DIR itself (it holds the API token).

**Safety.** A directory on PYTHONPATH is code: whoever can write it runs code in every program that opted
in. So the agent makes bootstrap/ and its files its own, 0755/0644, and will not publish into one that
is a symlink or belongs to someone else (one warning line); the bootstrap itself checks the same
(owner root or the program's user, writable by no one else) before it loads anything from there, and
otherwise takes its directory off sys.path and runs untraced. When the agent runs as root (a node
service whose users' programs run as other uids), trace-requests/ and traces/ are made 1777, as /tmp:
anyone may register and write a trace, no one may remove or replace another's file, and a process acts
only on requests written by root, its own user or the directory's owner (trace/ondemand.py).

**When.** Every `check_interval` the agent diagnoses the last VERDICT_WINDOW_S of its history; a GPU whose
primary verdict turns launch-, sync-, host- or input-bound (from another verdict, or from none at the
agent's start) is a flip, recorded with its time. For FLIP_OPEN_S after it, each opted-in process on that
GPU (NVML's pids; a container's pids are mapped to the host's through /proc/PID/status NSpid) that has
not been asked for that flip gets one request of `duration`; so a process that opts in after the flip
still gets its window. `every` asks every opted-in process on a GPU once per period ("off": never). On
the simulated node no real process runs on a GPU: every opted-in process counts as on each of them.

**Budget.** The process enforces it (ondemand.Budget: 1 % of any 10 minutes, its own clock, no request
can lift it); the agent reads the spend each process records in its registration and does not ask one
whose next window is not allowed yet, and says so (a log line once per process, and the listing).

**Results.** A thread here reads each written window (on demand or the agent's own) once: its verdicts
(trace.verdicts) and findings (trace.rules), cached beside it as <file>.verdicts.json and stored at the
window's end as gpu_trace_verdict{gpu, kind} (confidence) and gpu_trace_finding{rule, severity} (1).
GET /api/v1/autotrace lists the flips, the requests with their outcome (written, refused, the process
exited before it answered, no answer) and the windows' verdicts and findings; the dashboard shows them
beside the last trace's kernels.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from aiohttp import web

from .._version import __version__
from ..http.responses import json_response
from ..trace import ondemand as od
from ._face import AgentFace
from .trace_api import TRACE_SUFFIX, _gpu_labels, _regular, _unlink, _write_new, read_trace

log = logging.getLogger("gpuscope.agent.autotrace")

#: Verdicts where the GPU waits on its host: the kinds a trace can explain line by line.
TRIGGERS = frozenset({"launch_bound", "sync_bound", "host_bound", "input_starved", "launch_or_sync_bound"})
VERDICT_WINDOW_S = 10.0   # the verdict that flips is the one over the last 10 s of the history
FLIP_OPEN_S = 30.0        # a flip asks its GPU's processes for a window for this long after it
ANSWER_WAIT_S = 120.0     # past duration + this, a request nobody answered is "no answer"
CACHE_SUFFIX = ".verdicts.json"
KEPT_EVENTS = 200
SCAN_ANSWERS = 2000       # the newest answers a pass looks at
_TRACE_FILES = ("ondemand.py", "cupti_backend.py")


# -- publishing the bootstrap -------------------------------------------------------------------------
def publish(data_path: Path, host: str) -> str:
    """Copy the bootstrap into data_path/bootstrap (agent.json beside it) and make the request and trace
    directories fit for other users' programs when the agent is root; '' or why it could not."""
    import gpuscope.trace.bootstrap as bootstrap_pkg

    src = Path(bootstrap_pkg.DIR)
    target = data_path / "bootstrap"
    private = target / "_gpuscope_trace"
    for d in (target, private):
        why = _own_dir(d, 0o755)
        if why:
            return why
    agent = {"host": host, "pid_ns": _pid_ns("self"), "version": __version__, "published_unix": time.time()}
    copies = [(src / "sitecustomize.py", target / "sitecustomize.py"),
              (src.parent.parent / "_frameworks.py", target / "_frameworks.py")]
    copies += [(src.parent / name, private / name) for name in _TRACE_FILES]
    for a, b in copies:
        _write_file(b, a.read_bytes())
    _write_file(target / "agent.json", json.dumps(agent).encode())
    shared = 0o1777 if os.geteuid() == 0 else 0o755
    for name in ("trace-requests", "traces"):
        why = _own_dir(data_path / name, shared)
        if why:
            return why
    return ""


def _own_dir(path: Path, mode: int) -> str:
    """`path` a real directory of ours with `mode`, made when missing; '' or why not."""
    try:
        path.mkdir(mode=0o755, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        return f"{path} cannot be made ({e.strerror})"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory (a symlink?)"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not the agent's ({os.geteuid()})"
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
    return ""


def _write_file(path: Path, data: bytes) -> None:
    """Through a fresh temporary file renamed into place, 0644: never through a planted name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _pid_ns(pid: int | str, proc: str = "/proc") -> int | None:
    """The inode of a process's PID namespace (what /proc/PID/ns/pid links to), None when unreadable."""
    try:
        return os.stat(f"{proc}/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _ns_pid(pid: int, proc: str = "/proc") -> int | None:
    """The pid a process has inside its own namespace: the last NSpid of /proc/PID/status."""
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _uid(pid: int, proc: str = "/proc") -> int | None:
    try:
        return os.stat(f"{proc}/{pid}").st_uid
    except OSError:
        return None


# -- whom to ask --------------------------------------------------------------------------------------
def targets(req_dir: str, host: str, gpu_pids: set[int], proc: str = "/proc") -> list[dict[str, Any]]:
    """The registrations of processes that opted in and run on a GPU here, each with `host_pid` (the pid
    NVML and the sampler know it by). A registration from another PID namespace (a container) names itself
    <host>+pidns<inode>: it is matched through /proc/PID/ns/pid and NSpid of the GPU's processes. A
    registration counts only when its file belongs to root or to the process's own user."""
    foreign: dict[tuple[int, int], int] = {}
    mine = _pid_ns("self", proc)
    out = []
    regs = []
    for name in os.listdir(req_dir) if os.path.isdir(req_dir) else ():
        if not (name.startswith("proc.") and name.endswith(".json")):
            continue
        path = os.path.join(req_dir, name)
        doc = od._read_json(path)
        if doc is None or not od._valid_pid(doc.get("pid")) or not isinstance(doc.get("host"), str):
            continue
        try:
            owner = os.lstat(path).st_uid
        except OSError:
            continue
        regs.append((doc, owner))
    if any(d["host"].startswith(host + "+pidns") for d, _ in regs):
        for pid in gpu_pids:
            ns = _pid_ns(pid, proc)
            inner = _ns_pid(pid, proc)
            if ns is not None and inner is not None and ns != mine:
                foreign[(ns, inner)] = pid
    for doc, owner in regs:
        if doc["host"] == host:
            host_pid = doc["pid"] if od._alive(doc["pid"]) else None
        elif doc["host"].startswith(host + "+pidns") and doc["host"][len(host) + 6:].isdigit():
            host_pid = foreign.get((int(doc["host"][len(host) + 6:]), doc["pid"]))
        else:
            continue
        if host_pid is None or host_pid not in gpu_pids:
            continue
        if owner not in (0, _uid(host_pid, proc)):  # someone else's file naming this process
            continue
        out.append(dict(doc, host_pid=host_pid))
    return out


class AutoTrace:
    """The agent's own windows: flips and the schedule in, requests out, the windows' verdicts into the store."""

    def __init__(self, agent: AgentFace) -> None:
        self.agent = agent
        self.cfg = agent.cfg.profiling
        self.requests_dir = str(agent.cfg.data_path / "trace-requests")
        self.traces_dir = str(agent.cfg.data_path / "traces")
        self.host = socket.gethostname()
        self.published = ""  # the directory to put on PYTHONPATH, once published
        self.publish_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last_kind: dict[str, str | None] = {}
        self._open: dict[str, dict[str, Any]] = {}  # gpu -> the flip whose window is still being asked for
        self.flips: deque[dict[str, Any]] = deque(maxlen=KEPT_EVENTS)
        self.requests: deque[dict[str, Any]] = deque(maxlen=KEPT_EVENTS)
        self._told: set[tuple[int, float]] = set()  # (pid, next_allowed) already said to be over budget
        self._next_scheduled = time.monotonic() + self.cfg.every if self.cfg.every > 0 else float("inf")
        self._failed: set[str] = set()

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self, _app: web.Application) -> None:
        if self.cfg.publish_bootstrap:
            try:
                why = publish(self.agent.cfg.data_path, self.host)
            except OSError as e:
                why = f"{e.filename or 'a file'}: {e.strerror}"
            if why:
                self.publish_error = why
                log.warning("profiling: the bootstrap is not published (%s); PYTHONPATH=%s/bootstrap opts in "
                            "nothing until it is.", why, self.agent.cfg.data_path, extra={"f_event": "autotrace"})
            else:
                self.published = str(self.agent.cfg.data_path / "bootstrap")
                log.info("profiling: programs opt in with PYTHONPATH=%s", self.published,
                         extra={"f_event": "autotrace"})
        self._thread = threading.Thread(target=self._loop, name="gpuscope-autotrace", daemon=True)
        self._thread.start()

    async def stop(self, _app: web.Application) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.check_interval):
            try:
                self.tick()
                self.ingest()
            except Exception:  # noqa: BLE001 - the agent keeps sampling and serving
                log.exception("profiling: a pass failed")

    # -- deciding ----------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """One pass: the verdicts over the last VERDICT_WINDOW_S, flips, the schedule, the answers."""
        now = time.time() if now is None else now
        sampler = self.agent.sampler
        snaps = list(sampler.history) if sampler is not None else []
        if snaps:
            cutoff = snaps[-1].time_ns - int(VERDICT_WINDOW_S * 1e9)
            snaps = [s for s in snaps if s.time_ns >= cutoff]
        on_gpu: dict[str, set[int]] = {}
        if snaps:
            last = snaps[-1]
            for p in last.processes:
                on_gpu.setdefault(p.gpu, set()).add(p.pid)
            if self.cfg.on_verdict:
                self._flips(snaps, now)
        simulated = bool(snaps and snaps[-1].simulated)
        if self._open or time.monotonic() >= self._next_scheduled:
            live = self._live(on_gpu, simulated)
            for gpu, flip in list(self._open.items()):
                if now - flip["flip_unix"] > FLIP_OPEN_S:
                    del self._open[gpu]
                    continue
                todo = [r for r in live.get(gpu, []) if r["host_pid"] not in flip["asked"]]
                flip["asked"].update(r["host_pid"] for r in todo)
                self._ask(todo, f"verdict {flip['kind']} on GPU {gpu}", now, flip=flip)
            if time.monotonic() >= self._next_scheduled:
                self._next_scheduled = time.monotonic() + self.cfg.every
                every = {r["host_pid"]: r for rs in live.values() for r in rs}
                self._ask(list(every.values()), f"schedule every {self.cfg.every:g} s", now)
        self._outcomes(now)

    def _flips(self, snaps: list[Any], now: float) -> None:
        from ..diagnose import diagnose, windows_from_snapshots

        for v in diagnose(windows_from_snapshots(snaps)):
            if not v.primary or v.pid is not None:
                continue
            before = self._last_kind.get(v.gpu)
            self._last_kind[v.gpu] = v.kind
            if v.kind in TRIGGERS and (before is None or before not in TRIGGERS):
                flip = {"gpu": v.gpu, "kind": v.kind, "from": before, "flip_unix": now, "asked": set(),
                        "requests": []}
                self._open[v.gpu] = flip
                with self._lock:
                    self.flips.append(flip)
                log.info("profiling: GPU %s turned %s (was %s): asking its opted-in processes for a window",
                         v.gpu, v.kind, before or "unknown", extra={"f_event": "autotrace_flip", "f_gpu": v.gpu})

    def _live(self, on_gpu: dict[str, set[int]], simulated: bool) -> dict[str, list[dict[str, Any]]]:
        """Per GPU, the opted-in processes on it (on a simulated node: every opted-in process on each)."""
        if simulated:
            regs = [dict(d, host_pid=d["pid"]) for d in od.opted_in(self.requests_dir, self.host)]
            return {gpu: regs for gpu in set(on_gpu) | set(self._open)}
        pids = set().union(*on_gpu.values()) if on_gpu else set()
        regs = targets(self.requests_dir, self.host, pids) if pids else []
        return {gpu: [r for r in regs if r["host_pid"] in gp] for gpu, gp in on_gpu.items()}

    def _ask(self, regs: list[dict[str, Any]], trigger: str, now: float, flip: dict[str, Any] | None = None) -> None:
        """One request per PID namespace for the processes whose budget allows a window now."""
        groups: dict[str, list[int]] = {}
        for r in regs:
            nxt = r.get("next_allowed_unix")
            if isinstance(nxt, int | float) and not isinstance(nxt, bool) and nxt > now:
                key = (r["host_pid"], float(nxt))
                if key not in self._told:
                    self._told.add(key)
                    log.info("profiling: process %d spent its budget (%s s of the last %s s): no window "
                             "before %s s from now (%s)", r["host_pid"], r.get("spent_s"), r.get("horizon_s"),
                             round(nxt - now), trigger, extra={"f_event": "autotrace_budget"})
                with self._lock:
                    self.requests.append({"at_unix": now, "trigger": trigger, "pid": r["host_pid"], "id": None,
                                          "outcome": "not_asked", "reason": "its budget is spent until "
                                          f"{nxt:.0f} (unix s): {r.get('spent_s')} s of the last "
                                          f"{r.get('horizon_s')} s"})
                continue
            groups.setdefault(r["host"], []).append(r["pid"])
        if len(self._told) > 10_000:
            self._told.clear()
        for host, pids in groups.items():
            req = od.write_request(self.requests_dir, self.cfg.duration, sorted(pids), host=host, trigger=trigger)
            entry = {"at_unix": req["created_unix"], "trigger": trigger, "id": req["id"], "host": host,
                     "pids": sorted(pids), "duration_s": self.cfg.duration, "outcome": "pending", "answers": []}
            if flip is not None:
                entry["flip_unix"] = flip["flip_unix"]
                flip["requests"].append(req["id"])
            with self._lock:
                self.requests.append(entry)
            log.info("profiling: %g s window asked of %s (%s)", self.cfg.duration, sorted(pids), trigger,
                     extra={"f_event": "autotrace_request", "f_id": req["id"]})

    def _outcomes(self, now: float) -> None:
        """Each pending request's answers, or why none came."""
        with self._lock:
            pending = [e for e in self.requests if e.get("outcome") == "pending"]
        if not pending:
            return
        answers: dict[str, list[dict[str, Any]]] = {}
        for d in od.list_traces(self.requests_dir)[:2000]:
            answers.setdefault(str(d.get("id")), []).append(d)
        # a process killed before its exit hook leaves its registration: a pid of this namespace is checked
        live = {(d.get("host"), d.get("pid")) for d in _registrations(self.requests_dir)
                if d.get("host") != self.host or (od._valid_pid(d.get("pid")) and od._alive(d["pid"]))}
        for e in pending:
            got = answers.get(e["id"], [])
            e["answers"] = [{k: d.get(k) for k in ("pid", "status", "reason", "file", "cost_s",
                                                        "cost_phases_s")} for d in got]
            missing = [p for p in e["pids"] if p not in {d.get("pid") for d in got}]
            gone = [p for p in missing if (e["host"], p) not in live]
            if not missing:
                e["outcome"] = "answered"
            elif len(gone) == len(missing):
                e["outcome"] = "answered" if got else "exited"
                e["reason"] = f"process(es) {gone} exited before they answered"
            elif now - e["at_unix"] > e["duration_s"] + ANSWER_WAIT_S:
                e["outcome"] = "no_answer"
                e["reason"] = f"process(es) {missing} did not answer within {ANSWER_WAIT_S:g} s"

    # -- the windows' verdicts ---------------------------------------------------------------------
    def ingest(self) -> int:
        """Verdicts and findings of every written window not seen yet: cached, and into the store (and the
        caches of traces gone to trace_api's retention dropped)."""
        done = 0
        try:
            names = set(os.listdir(self.traces_dir))
        except OSError:
            names = set()
        for name in names:
            if name.endswith(TRACE_SUFFIX + CACHE_SUFFIX) and name.removesuffix(CACHE_SUFFIX) not in names:
                _unlink(os.path.join(self.traces_dir, name))
        for d in od.list_traces(self.requests_dir)[:SCAN_ANSWERS]:
            file = d.get("file")
            if d.get("status") != "written" or not isinstance(file, str) or file in self._failed:
                continue
            path = os.path.join(self.traces_dir, os.path.basename(file))
            cache = path + CACHE_SUFFIX
            if not path.endswith(TRACE_SUFFIX) or os.path.lexists(cache) or not _regular(path):
                continue
            try:
                result = window_verdicts(path, d.get("cuda_visible_devices"))
            except Exception as e:  # noqa: BLE001 - an unreadable trace is reported once, not retried
                self._failed.add(file)
                log.warning("trace %s: no verdicts (%s: %s)", file, type(e).__name__, e)
                continue
            result.update(id=d.get("id"), pid=d.get("pid"), trigger=d.get("trigger"))
            _write_new(cache, json.dumps(result))
            end_ns = d.get("profiler_stop_unix_ns")
            if isinstance(end_ns, int) and end_ns > 0 and self.agent.store is not None:
                series, values = _store_rows(result)
                if series:
                    self.agent.store.append_batch(series, [end_ns], [values])
            done += 1
        if len(self._failed) > 10_000:
            self._failed.clear()
        return done

    def windows(self, limit: int = 50) -> list[dict[str, Any]]:
        out = []
        for d in od.list_traces(self.requests_dir)[:500]:
            if d.get("status") != "written" or not isinstance(d.get("file"), str):
                continue
            cache = os.path.join(self.traces_dir, os.path.basename(d["file"])) + CACHE_SUFFIX
            doc = od._read_json(cache) if _regular(cache) else None
            if doc is None:
                continue
            out.append({"id": d.get("id"), "pid": d.get("pid"), "trigger": d.get("trigger"),
                        "end_unix": (d.get("profiler_stop_unix_ns") or 0) / 1e9 or None,
                        "verdicts": _shaped(doc.get("verdicts")), "findings": _shaped(doc.get("findings"))})
            if len(out) >= limit:
                break
        return out

    # -- HTTP --------------------------------------------------------------------------------------
    async def listing(self, request: web.Request) -> web.Response:
        def run() -> dict[str, Any]:
            with self._lock:
                flips = [dict(f, asked=sorted(f["asked"])) for f in reversed(self.flips)]
                requests = [dict(e) for e in reversed(self.requests)]
            c = self.cfg
            return {"published": self.published or None, "publish_error": self.publish_error or None,
                    "opt_in": f"PYTHONPATH={self.published}" if self.published else None,
                    "on_verdict": c.on_verdict, "every_s": c.every or None, "duration_s": c.duration,
                    "check_interval_s": c.check_interval, "triggers": sorted(TRIGGERS),
                    "flips": flips, "requests": requests, "windows": self.windows()}

        return json_response(await asyncio.get_running_loop().run_in_executor(None, run))


def _registrations(req_dir: str) -> list[dict[str, Any]]:
    try:
        names = [n for n in os.listdir(req_dir) if n.startswith("proc.") and n.endswith(".json")]
    except OSError:
        return []
    return [d for d in (od._read_json(os.path.join(req_dir, n)) for n in names) if d is not None]


def _shaped(rows: Any) -> list[dict[str, Any]]:
    """Rows of a cache another user could have written: dicts only, at most 50."""
    return [r for r in rows if isinstance(r, dict)][:50] if isinstance(rows, list) else []


def window_verdicts(path: str, visible: str | None) -> dict[str, Any]:
    """One trace's verdicts per GPU (the agent's GPU label, through CUDA_VISIBLE_DEVICES) and findings."""
    from ..trace.rules import findings
    from ..trace.verdicts import verdicts

    trace = read_trace(path, "verdicts")  # one parse shared with the kernel statistics and the profile
    found = findings(trace)
    labels = _gpu_labels(visible)
    vs = []
    for v in verdicts(trace, found=found):
        gpu = labels.get(int(v.gpu), str(v.gpu)) if str(v.gpu).isdigit() else str(v.gpu)
        vs.append({"gpu": gpu, "kind": v.kind, "confidence": round(float(v.confidence), 3),
                   "severity": v.severity, "summary": v.summary})
    return {"verdicts": vs, "findings": [{"rule": f.rule, "severity": f.severity, "summary": f.summary}
                                         for f in found][:50]}


def _store_rows(result: dict[str, Any]) -> tuple[list[tuple[str, dict[str, str]]], list[float]]:
    series: list[tuple[str, dict[str, str]]] = []
    values: list[float] = []
    for v in result["verdicts"]:
        series.append(("gpu_trace_verdict", {"gpu": v["gpu"], "kind": v["kind"]}))
        values.append(float(v["confidence"]))
    seen = set()
    for f in result["findings"]:
        key = (f["rule"], f["severity"])
        if key not in seen:
            seen.add(key)
            series.append(("gpu_trace_finding", {"rule": f["rule"], "severity": f["severity"]}))
            values.append(1.0)
    return series, values


def register(app: web.Application, agent: AgentFace) -> None:
    """GET /api/v1/autotrace, and the thread that starts windows, for the agent's lifetime."""
    auto = AutoTrace(agent)
    app.router.add_get("/api/v1/autotrace", auto.listing)
    app.on_startup.append(auto.start)
    app.on_cleanup.append(auto.stop)


__all__ = ["TRIGGERS", "AutoTrace", "publish", "register", "targets", "window_verdicts"]
