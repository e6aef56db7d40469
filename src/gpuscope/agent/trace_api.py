"""Traces on demand through the agent: POST /api/v1/trace, GET /api/v1/traces, GET /api/v1/traces/<id>/kernels,
GET /api/v1/traces/<id>/file?pid=N (the trace itself, to the token holder), GET /api/v1/clock.

The agent never runs anything a request names: it writes a request file into DATA_DIR/trace-requests
and the processes that opted in (`gpuscope trace --on-demand -- CMD`) decide, under their own duty
budget, whether to trace (trace/ondemand.py holds the protocol). A thread here picks up each trace
they write into DATA_DIR/traces, computes its kernel statistics once (cached beside the trace as
<file>.kernels.json) and stores, at the trace's end, per GPU and kernel (the 20 longest in total,
the rest as kernel="other"):

    gpu_kernel_time_seconds{kernel, gpu}   GPU time of the kernel in that window, seconds
    gpu_kernel_launches{kernel, gpu}       how many times it ran in that window

Retention: the newest KEEP_TRACES trace files, at most KEEP_TRACES_BYTES of them, and the newest
KEEP_ANSWERS answers stay; older ones are deleted after each pass (nothing else ever deletes them).

For a trace of a whole job across nodes (`gpuscope trace fleet`, trace/fleet.py) a request may name
`"job"` (the workload label: slurm/<id>, torchrun/<run id>, k8s/<namespace>/<owner>) instead of pids, and
`"start_unix"` (this agent's clock, at most od.MAX_START_AHEAD_S ahead): every agent's processes then start
at one moment. Its answer, and GET /api/v1/clock, carry this agent's clock when the request came in and
when the answer left (`received_unix_ns`, `answered_unix_ns`): with the caller's own send and receive
times that measures the agent's clock offset, as NTP does.

`gpu` is the CUDA device index inside the process mapped through its CUDA_VISIBLE_DEVICES when that
lists indices; it matches the agent's NVML index unless CUDA orders the devices differently.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import re
import socket
import stat
import tempfile
import threading
import time
from typing import Any

from aiohttp import web

from .._cgroup import MAX_WORKLOAD_CHARS, read_attribution, workload_of
from ..http.auth import authorized
from ..http.responses import BadRequest, error_response, json_response
from ..timeparse import TimeError, parse_duration
from ..trace import ondemand as od
from ._face import AgentFace

log = logging.getLogger("gpuscope.agent.traces")

TOP_KERNELS = 20           # kernel names stored per GPU and trace; the rest are summed as "other"
CACHED_KERNELS = 200       # kernel names kept per GPU in <file>.kernels.json
SCAN_INTERVAL_S = 1.0
PRUNE_EVERY = 60           # ingest passes between two retention passes
KEEP_TRACES = 500          # trace files kept in DATA_DIR/traces, newest first ...
KEEP_TRACES_BYTES = 4 << 30  # ... and at most this many bytes of them
KEEP_ANSWERS = 2000        # done markers kept in DATA_DIR/trace-requests
TRACE_SUFFIX = ".pt.trace.json.gz"
NO_ONE = "no process opted in: start it with gpuscope trace --on-demand -- ..."
_ID = re.compile(r"[0-9a-f]{16}")
#: GET /api/v1/traces/<id>/file serves trace files (gzip, as written) up to this size; a bigger one is a 413
#: that names it, to be copied from the node by hand.
SERVE_MAX_BYTES = 256 << 20
_CHUNK_BYTES = 1 << 20
#: Tests only, and only on a simulated node (--simulate): this agent's clock reads this many ns off the real
#: one, as another host's might, in everything it says about time (its clock, start_unix, the traces it
#: serves), so that a test on one host can check that `gpuscope trace fleet` measures and removes it.
TEST_CLOCK_SHIFT_ENV = "GPUSCOPE_TEST_CLOCK_SHIFT_NS"
#: A start_unix that passed at most this long ago (a slow network, a loaded node) starts the window at once;
#: the caller sees how late in the trace's own start.
START_LATE_S = 5.0



def short_name(kernel: str) -> str:
    """A kernel's name without its return type, template and parameter lists, at most 80 characters:
    'void at::native::vectorized_elementwise_kernel<4, ...>(int, ...)' -> 'at::native::vectorized_elementwise_kernel'."""
    name = kernel.strip()
    if name.startswith("void "):
        name = name[5:]
    cut = min((i for i in (name.find("<"), name.find("(")) if i > 0), default=len(name))
    return name[:cut].strip()[:80] or kernel[:80]


def _gpu_labels(visible: str | None) -> dict[int, str]:
    parts = [p.strip() for p in (visible or "").split(",") if p.strip()]
    return {i: p for i, p in enumerate(parts)} if parts and all(p.isdigit() for p in parts) else {}


#: The agent reads traces other users' programs wrote: at most this much uncompressed (a 30 s window of
#: a launch-bound loop with Python stacks is about 100 MiB), so a planted gzip bomb cannot exhaust it.
INGEST_MAX_BYTES = 512 << 20
#: What the agent makes of each written trace, each on its own thread: its kernel statistics (here), its
#: verdicts and findings (autotrace.window_verdicts) and its folded stacks (profile_api.Profiles.fold). They
#: share one parse of the file (`read_trace`): it is kept until each has taken it, or SHARED_FOR_S.
READERS = ("kernels", "verdicts", "profile")
SHARED_FOR_S = 30.0      # the readers scan every second: one that comes later than this reads the file again
SHARED_MAX = 2           # parsed traces kept at once (a 512 MiB trace is some hundred MB parsed)


class _Shared:
    """One parse of a trace file for all READERS: the first to ask reads it, one asking meanwhile waits for
    that read, and what it gave (the Trace, or the error) is theirs too. Keyed by the file's identity (device,
    inode, size, mtime): a file rewritten in place is read again. The Trace is shared: readers only read it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[Any, ...], dict[str, Any]] = {}

    def get(self, path: str, reader: str) -> Any:
        from ..trace.kineto import load

        try:
            st = os.stat(path)
        except OSError:
            return load(path, max_bytes=INGEST_MAX_BYTES)  # its one sentence says what is wrong
        key = (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            self._forget(time.monotonic())
            entry = self._entries.get(key)
            first = entry is None
            if entry is None:
                entry = self._entries[key] = {"ready": threading.Event(), "at": None, "trace": None,
                                              "error": None, "taken": set()}
        if first:
            try:
                entry["trace"] = load(path, max_bytes=INGEST_MAX_BYTES)
            except Exception as e:  # noqa: BLE001 - the same error for every reader, read once
                entry["error"] = e
            finally:
                entry["at"] = time.monotonic()
                entry["ready"].set()
        else:
            entry["ready"].wait()
        with self._lock:
            entry["taken"].add(reader)
            if entry["taken"].issuperset(READERS):
                self._entries.pop(key, None)
        if entry["error"] is not None:
            raise entry["error"].with_traceback(None)
        return entry["trace"]

    def _forget(self, now: float) -> None:
        """Drops what was read more than SHARED_FOR_S ago, then the oldest past SHARED_MAX (none being read)."""
        done = sorted((e["at"], k) for k, e in self._entries.items() if e["at"] is not None)
        for i, (at, k) in enumerate(done):
            if now - at > SHARED_FOR_S or len(done) - i > SHARED_MAX:
                del self._entries[k]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_shared = _Shared()


def read_trace(path: str, reader: str) -> Any:
    """The parsed trace (`trace.model.Trace`) at `path` for one of READERS, read once for all of them; a bad
    file raises the loader's TraceError (the same one for each reader)."""
    return _shared.get(path, reader)


def kernel_table(path: str, visible: str | None) -> list[dict[str, Any]]:
    """Per GPU and kernel name: count, total/p50/p99 time and launch delay p50 (seconds), longest first."""
    import numpy as np

    from ..trace.analyze import kernel_stats, launcher_rows
    from ..trace.model import EventKind

    trace = read_trace(path, "kernels")
    ev = trace.events
    kernels = np.flatnonzero(ev["kind"] == EventKind.KERNEL)
    labels = _gpu_labels(visible)
    out = []
    for device in np.unique(ev["device"][kernels]):
        rows = kernels[ev["device"][kernels] == device]
        gpu = labels.get(int(device), str(int(device)))
        for k in kernel_stats(trace, rows, launcher_rows(trace, rows))[:CACHED_KERNELS]:
            out.append({"gpu": gpu, "name": k.name, "short_name": short_name(k.name), "count": k.count,
                        "total_s": k.total_ns / 1e9, "p50_s": k.p50_ns / 1e9, "p99_s": k.p99_ns / 1e9,
                        "launch_delay_p50_s": None if k.launch_delay_p50_ns is None else k.launch_delay_p50_ns / 1e9})
    return out


def store_rows(kernels: list[dict[str, Any]]) -> tuple[list[tuple[str, dict[str, str]]], list[float]]:
    """The store series of one trace: per GPU the TOP_KERNELS short names by time, the rest as 'other'."""
    per: dict[tuple[str, str], list[float]] = {}
    for k in kernels:
        acc = per.setdefault((k["gpu"], k["short_name"]), [0.0, 0])
        acc[0] += k["total_s"]
        acc[1] += k["count"]
    series: list[tuple[str, dict[str, str]]] = []
    values: list[float] = []
    for gpu in sorted({g for g, _ in per}):
        ranked = sorted(((n, v) for (g, n), v in per.items() if g == gpu), key=lambda x: -x[1][0])
        top, rest = ranked[:TOP_KERNELS], ranked[TOP_KERNELS:]
        if rest:
            top.append(("other", [sum(v[0] for _, v in rest), sum(v[1] for _, v in rest)]))
        for name, (total_s, count) in top:
            series += [("gpu_kernel_time_seconds", {"kernel": name, "gpu": gpu}),
                       ("gpu_kernel_launches", {"kernel": name, "gpu": gpu})]
            values += [total_s, float(count)]
    return series, values


class Traces:
    """The agent's side: requests out, traces in, their kernel statistics into the store."""

    def __init__(self, agent: AgentFace) -> None:
        self.agent = agent
        self.requests_dir = str(agent.cfg.data_path / "trace-requests")
        self.traces_dir = str(agent.cfg.data_path / "traces")
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed: set[str] = set()
        self.clock_shift_ns = _test_clock_shift(agent)

    def now_ns(self) -> int:
        """This agent's clock, unix ns (the real one but for the tests' shift)."""
        return time.time_ns() + self.clock_shift_ns

    # -- the ingest thread -------------------------------------------------------------------------
    async def start(self, _app: web.Application) -> None:
        for d in (self.requests_dir, self.traces_dir):
            os.makedirs(d, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name="gpuscope-traces", daemon=True)
        self._thread.start()

    async def stop(self, _app: web.Application) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _loop(self) -> None:
        passes = 0
        while not self._stop.wait(SCAN_INTERVAL_S):
            try:
                self.ingest()
                if passes % PRUNE_EVERY == 0:
                    self.prune()
                passes += 1
            except Exception:  # noqa: BLE001 - the agent keeps sampling and serving
                log.exception("ingesting traces failed")

    def ingest(self) -> None:
        """Kernel statistics of every written trace not seen yet: cached, and into the store."""
        for done in od.list_traces(self.requests_dir):
            file = done.get("file")
            if done.get("status") != "written" or not isinstance(file, str) or file in self._failed:
                continue
            path = os.path.join(self.traces_dir, os.path.basename(file))
            cache = path + ".kernels.json"
            if os.path.lexists(cache) or not _regular(path):
                continue  # a symlink planted in the traces directory is never followed by the agent
            try:
                kernels = kernel_table(path, done.get("cuda_visible_devices"))
            except Exception as e:  # noqa: BLE001 - an unreadable trace is reported, not retried
                self._failed.add(file)
                log.warning("trace %s: no kernel statistics (%s: %s)", file, type(e).__name__, e)
                continue
            _write_new(cache, json.dumps({"kernels": kernels}))
            series, values = store_rows(kernels)
            end_ns = int(done.get("profiler_stop_unix_ns") or 0)
            if series and end_ns > 0 and self.agent.store is not None:
                self.agent.store.append_batch(series, [end_ns], [values])
            log.info("trace %s: %d kernel name(s) stored", file, len(kernels), extra={"f_event": "trace"})

    def prune(self) -> None:
        """Retention: delete all but the newest KEEP_TRACES traces (at most KEEP_TRACES_BYTES) and
        all but the newest KEEP_ANSWERS answers."""
        traces = _newest_first(self.traces_dir, lambda n: n.endswith(TRACE_SUFFIX))
        kept_bytes = 0
        for i, (size, name) in enumerate(traces):
            kept_bytes += size
            if i >= KEEP_TRACES or kept_bytes > KEEP_TRACES_BYTES:
                for path in (name, name + ".kernels.json", name.replace(TRACE_SUFFIX, ".perfetto.json.gz")):
                    _unlink(os.path.join(self.traces_dir, path))
        answers = _newest_first(self.requests_dir, lambda n: n.startswith("done.") and n.endswith(".json"))
        for _, name in answers[KEEP_ANSWERS:]:
            _unlink(os.path.join(self.requests_dir, name))
        self._failed.clear()  # bounded: a trace that failed and is still there is tried once more

    def _kernels(self, done: dict[str, Any]) -> list[dict[str, Any]] | None:
        file = done.get("file")
        if not isinstance(file, str):
            return None
        path = os.path.join(self.traces_dir, os.path.basename(file)) + ".kernels.json"
        if not _regular(path):
            return None
        try:
            with open(path) as f:
                kernels = json.load(f)["kernels"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            return None
        if not isinstance(kernels, list):
            return None
        # the traces directory may be writable by others: keep only rows shaped like ours
        return [k for k in kernels if isinstance(k, dict) and _count(k.get("count")) is not None]

    # -- HTTP --------------------------------------------------------------------------------------
    async def request_trace(self, request: web.Request) -> web.Response:
        received_ns = self.now_ns()
        body = await request.read()
        try:
            doc = json.loads(body) if body.strip() else {}
        except (ValueError, RecursionError):  # RecursionError: '[' nested 30000 deep
            return error_response(400, 'The body must be JSON such as {"duration": "5s", "pids": [1234]}.')
        try:
            duration_s, pids = _parse_request(doc)
            job, start_unix = _parse_fleet_fields(doc, received_ns / 1e9)
        except (BadRequest, TimeError) as e:
            return error_response(400, str(e))
        loop = asyncio.get_running_loop()
        live = await loop.run_in_executor(None, od.opted_in, self.requests_dir, self.host)
        if job is not None:
            jobs = await loop.run_in_executor(None, _jobs_of, [p["pid"] for p in live])
            mine = [p for p in live if jobs.get(p["pid"]) == job]
            if not mine:
                held = sorted({j for j in jobs.values() if j})
                return error_response(404, f"No process of job {job!r} opted in on this node"
                                           + (f" (the jobs here: {', '.join(held)})." if held else "."))
            pids = sorted(p["pid"] for p in mine)
        targets = live if pids == "all" else [p for p in live if p["pid"] in pids]
        if not live:
            return error_response(409, NO_ONE)
        if not targets:
            return error_response(409, f"none of the pids {pids} opted in; these did: {sorted(p['pid'] for p in live)}.")
        od.expire_requests(self.requests_dir)
        # the processes wait on the real clock: a test's shift comes off here
        real_start = None if start_unix is None else start_unix - self.clock_shift_ns / 1e9
        req = od.write_request(self.requests_dir, duration_s, pids, host=self.host, start_unix=real_start)
        log.info("trace requested: %g s from %s%s", duration_s, pids, "" if job is None else f" (job {job})",
                 extra={"f_event": "trace_request"})
        answer: dict[str, Any] = {"id": req["id"], "duration_s": duration_s, "processes": [
            {k: p.get(k) for k in ("pid", "host", "rank", "max_duty", "next_allowed_unix")} for p in targets]}
        if job is not None:
            answer["job"] = job
        if start_unix is not None:
            answer["start_unix"] = start_unix
        answer["clock"] = {"received_unix_ns": received_ns, "answered_unix_ns": self.now_ns()}
        return json_response(answer, status=202)

    async def clock(self, request: web.Request) -> web.Response:
        """This agent's clock, at the request's arrival and at the answer (for the caller's offset)."""
        received_ns = self.now_ns()
        return json_response({"host": self.host, "received_unix_ns": received_ns, "answered_unix_ns": self.now_ns()})

    async def file(self, request: web.Request) -> web.StreamResponse:
        """One process's trace of one request, gzip as written, to the token holder only (a trace holds the
        program's Python stacks and kernel names)."""
        if not (self.agent.token and authorized(request, self.agent.token)):
            return error_response(401, "A trace file is served only to the token holder: send 'Authorization: "
                                       "Bearer <token>' (the token is in the file 'token' in the agent's data "
                                       "directory).")
        trace_id, pid = request.match_info["id"], request.query.get("pid", "")
        if not _ID.fullmatch(trace_id):
            return error_response(404, f"No trace with id {trace_id[:40]!r}; see /api/v1/traces.")
        if not (pid.isascii() and pid.isdigit()) or not 0 < int(pid) < 2**31:
            return error_response(400, "pid must be the process id whose trace is asked for, such as ?pid=1234.")
        found = [d for d in od.list_traces(self.requests_dir) if d.get("id") == trace_id and d.get("pid") == int(pid)]
        if not found:
            return error_response(404, f"Process {pid} has not answered request {trace_id}; see /api/v1/traces.")
        done = found[0]
        name = os.path.basename(done["file"]) if isinstance(done.get("file"), str) else ""
        if done.get("status") != "written" or not name.endswith(TRACE_SUFFIX):
            why = done.get("reason") or done.get("status")
            return error_response(404, f"Process {pid} wrote no trace for request {trace_id} ({str(why)[:200]}).")
        fd = _open_regular(os.path.join(self.traces_dir, name))
        if fd is None:
            return error_response(404, f"The trace {name} of process {pid} is gone (retention) or not a regular file.")
        try:
            size = os.fstat(fd).st_size
            if size > SERVE_MAX_BYTES:
                return error_response(413, f"The trace {name} is {size / 2**20:.0f} MiB, over the "
                                           f"{SERVE_MAX_BYTES / 2**20:.0f} MiB this agent serves; copy it from the "
                                           "node's traces directory.")
            if self.clock_shift_ns:
                body = await asyncio.get_running_loop().run_in_executor(None, _shifted, fd, self.clock_shift_ns)
                return web.Response(body=body, content_type="application/gzip", headers={"Cache-Control": "no-store"})
            resp = web.StreamResponse(headers={"Content-Type": "application/gzip", "Content-Length": str(size),
                                               "Cache-Control": "no-store",
                                               "Content-Disposition": f'attachment; filename="{name}"'})
            await resp.prepare(request)
            left = size
            while left > 0:  # what was there at fstat: a file that grows meanwhile is cut, not streamed forever
                chunk = await asyncio.get_running_loop().run_in_executor(None, os.read, fd, min(left, _CHUNK_BYTES))
                if not chunk:
                    break
                await resp.write(chunk)
                left -= len(chunk)
            await resp.write_eof()
            return resp
        finally:
            os.close(fd)

    async def list_(self, request: web.Request) -> web.Response:
        only = request.query.get("id") if request is not None else None  # one request's answers (a fleet trace's poll)

        def run() -> list[dict[str, Any]]:
            out = []
            answers = od.list_traces(self.requests_dir)
            for d in (answers if only is None else [d for d in answers if d.get("id") == only])[:200]:
                kernels = self._kernels(d) if d.get("status") == "written" else None
                start = od._unix(d.get("profiler_start_unix_ns"))
                out.append({"id": d.get("id"), "pid": d.get("pid"), "host": d.get("host"), "rank": d.get("rank"),
                            "status": d.get("status"), "reason": d.get("reason") or None,
                            "start_unix": start / 1e9 if start else None,
                            "duration_s": d.get("duration_s"), "asked_duration_s": d.get("asked_duration_s"),
                            "cost_s": d.get("cost_s"), "cost_phases_s": d.get("cost_phases_s"),
                            "file": d.get("file"),
                            "kernel_names": None if kernels is None else len(kernels),
                            "kernel_launches": None if kernels is None else sum(_count(k.get("count")) or 0 for k in kernels)})
            return out

        traces = await asyncio.get_running_loop().run_in_executor(None, run)
        processes = await asyncio.get_running_loop().run_in_executor(None, od.opted_in, self.requests_dir, self.host)
        return json_response({"traces": traces, "opted_in": processes})

    async def kernels(self, request: web.Request) -> web.Response:
        trace_id = request.match_info["id"]
        if not _ID.fullmatch(trace_id):
            return error_response(404, f"No trace with id {trace_id!r}; see /api/v1/traces.")
        found = [d for d in od.list_traces(self.requests_dir) if d.get("id") == trace_id and d.get("status") == "written"]
        if not found:
            return error_response(404, f"No trace was written for request {trace_id}; see /api/v1/traces.")
        return json_response({"id": trace_id, "traces": [
            {"pid": d.get("pid"), "host": d.get("host"), "file": d.get("file"), "kernels": self._kernels(d)}
            for d in found]})


def _regular(path: str) -> bool:
    """A regular file, not a symlink (a symlink in a shared directory could point anywhere)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53 else None


def _newest_first(directory: str, wanted: Any) -> list[tuple[int, str]]:
    """(bytes, name) of the entries of `directory` whose name is `wanted`, newest (mtime) first."""
    try:
        names = [n for n in os.listdir(directory) if wanted(n)]
    except OSError:
        return []
    found = []
    for name in names:
        try:
            st = os.lstat(os.path.join(directory, name))
        except OSError:
            continue
        found.append((st.st_mtime_ns, st.st_size, name))
    return [(size, name) for _, size, name in sorted(found, reverse=True)]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_new(path: str, text: str) -> None:
    """`text` into `path` through a fresh temporary file (O_EXCL, random name) renamed into place:
    the agent, often root, must not write through a name someone planted in the traces directory."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _parse_request(doc: Any) -> tuple[float, list[int] | str]:
    if not isinstance(doc, dict):
        raise BadRequest('The body must be a JSON object such as {"duration": "5s"}.')
    unknown = sorted(set(doc) - {"duration", "pids", "job", "start_unix"})
    if unknown:
        raise BadRequest(f"Unknown field(s) {', '.join(unknown)[:200]}: a request has duration, pids, job "
                         "and start_unix.")
    raw = doc.get("duration", "5s")
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise BadRequest(f"duration must be a duration such as \"5s\", not {raw!r}.")
    duration_s = parse_duration(str(raw), "duration")
    if not od.MIN_DURATION_S <= duration_s <= od.MAX_DURATION_S:
        raise BadRequest(f"duration must be between {od.MIN_DURATION_S:g} s and {od.MAX_DURATION_S:g} s, "
                              f"not {duration_s:g} s.")
    pids = doc.get("pids")
    if pids is None:
        return duration_s, "all"
    if not isinstance(pids, list) or not pids or not all(isinstance(p, int) and not isinstance(p, bool) and p > 0
                                                         for p in pids):
        raise BadRequest("pids must be a non-empty list of process ids (integers), or left out for all.")
    return duration_s, sorted(set(pids))


def _parse_fleet_fields(doc: dict[str, Any], now_unix: float) -> tuple[str | None, float | None]:
    """The job selector and the window's start (this agent's clock), both optional."""
    job = doc.get("job")
    if job is not None:
        if doc.get("pids") is not None:
            raise BadRequest("Name either pids or a job, not both.")
        if (not isinstance(job, str) or not job or len(job) > MAX_WORKLOAD_CHARS or not job.isprintable()
                or job != job.strip()):
            raise BadRequest(f"job must be a workload such as \"slurm/4242\" or \"torchrun/RUN_ID\" (at most "
                             f"{MAX_WORKLOAD_CHARS} printable characters).")
    start = doc.get("start_unix")
    if start is None:
        return job, None
    if isinstance(start, bool) or not isinstance(start, int | float) or start != start or abs(start) == float("inf"):
        raise BadRequest("start_unix must be a time in unix seconds, such as 1767225600.5.")
    ahead = float(start) - now_unix
    if ahead < -START_LATE_S:
        raise BadRequest(f"start_unix is {-ahead:.3f} s in the past by this agent's clock (more than the "
                         f"{START_LATE_S:g} s after which a window would start too late to be one moment's).")
    if ahead > od.MAX_START_AHEAD_S:
        raise BadRequest(f"start_unix is {ahead:.1f} s ahead by this agent's clock, more than the "
                         f"{od.MAX_START_AHEAD_S:g} s a window may be asked in advance.")
    return job, float(start)


def _jobs_of(pids: list[int]) -> dict[int, str]:
    """Each process's workload (the job it is one rank of), '' for none: its cgroup and environment."""
    out = {}
    for pid in pids:
        a = read_attribution(pid)
        out[pid] = workload_of(a.slurm_job, a.torchrun_run, a.namespace, a.pod)
    return out


def _open_regular(path: str) -> int | None:
    """A read-only descriptor of a regular file (never through a symlink, never a FIFO), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _test_clock_shift(agent: Any) -> int:
    """TEST_CLOCK_SHIFT_ENV's ns on a simulated node, else 0 (a real node's clock is never shifted)."""
    raw = os.environ.get(TEST_CLOCK_SHIFT_ENV, "")
    if not raw or not getattr(getattr(agent, "sampler", None), "simulated", None):
        return 0
    try:
        shift = int(raw)
    except ValueError:
        log.warning("%s=%r is not a whole number of ns; the clock is not shifted", TEST_CLOCK_SHIFT_ENV, raw[:40])
        return 0
    log.warning("TEST ONLY: this simulated agent's clock reads %+d ns off the real one (%s)", shift,
                TEST_CLOCK_SHIFT_ENV)
    return shift


def _shifted(fd: int, shift_ns: int) -> bytes:
    """The trace at `fd` as if recorded on a clock `shift_ns` ahead (tests only: TEST_CLOCK_SHIFT_ENV)."""
    with os.fdopen(os.dup(fd), "rb") as f:
        doc = json.loads(gzip.decompress(f.read(SERVE_MAX_BYTES + 1)))
    doc["baseTimeNanoseconds"] = int(doc.get("baseTimeNanoseconds") or 0) + shift_ns
    facts = doc.get("gpuscope")
    if isinstance(facts, dict):
        for key in ("profiler_start_unix_ns", "profiler_stop_unix_ns"):
            if isinstance(facts.get(key), int):
                facts[key] += shift_ns
    return gzip.compress(json.dumps(doc).encode(), compresslevel=3)


def register(app: web.Application, agent: AgentFace) -> None:
    """The trace routes on the agent's app, and the ingest thread for its lifetime."""
    traces = Traces(agent)
    app.router.add_post("/api/v1/trace", traces.request_trace)
    app.router.add_get("/api/v1/traces", traces.list_)
    app.router.add_get("/api/v1/traces/{id}/kernels", traces.kernels)
    app.router.add_get("/api/v1/traces/{id}/file", traces.file)
    app.router.add_get("/api/v1/clock", traces.clock)
    app.on_startup.append(traces.start)
    app.on_cleanup.append(traces.stop)
