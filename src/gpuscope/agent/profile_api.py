"""GPU time by launching stack, per node and job: GET /api/v1/profile.

A thread here folds every trace that lands in DATA_DIR/traces (windows asked for on demand, and any other
trace a process that opted in writes there) once, into GPU time and launches per stack
(`gpuscope.trace.profile.fold`), cached beside the trace as <file>.profile.json and labelled with this
node's name, the process's pid and its job (the workload the sampler saw it in: slurm job, torchrun run or
Kubernetes owner; else read from the live process's cgroup and environment; '' once it has gone, and '' when
the trace's file belongs to neither root nor the process's user: the directory may be writable by everyone). The
endpoint merges the windows that ended within `since`:

    GET /api/v1/profile?since=1h&job=slurm/42&format=pprof|speedscope|json

pprof (gzip-compressed profile.proto, what Pyroscope, Parca and `go tool pprof` read) is the default; json is
the folded form `gpuscope profile` merges across agents. A cache is dropped once its trace is (trace_api's
retention); a cache that is not ours (the directory may be writable by the traced programs) is skipped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time

from aiohttp import web

from .._node import node_name
from ..http.responses import error_response, json_response
from ..timeparse import TimeError, parse_duration
from ..trace.profile import NoProtobuf, Profile, ProfileError, fold, merge, window_overlaps
from ._face import AgentFace
from .trace_api import TRACE_SUFFIX, _regular, _unlink, _write_new

log = logging.getLogger("gpuscope.agent.profile")

CACHE_SUFFIX = ".profile.json"
SCAN_INTERVAL_S = 1.0
MAX_CACHE_BYTES = 32 << 20  # one window's folded stacks are some kB to a few MB
MAX_SINCE_S = 366 * 86400.0
FORMATS = ("pprof", "speedscope", "json")


class Profiles:
    """Folds each trace once; answers the merge of those in a time range and job."""

    def __init__(self, agent: AgentFace) -> None:
        self.agent = agent
        self.traces_dir = str(agent.cfg.data_path / "traces")
        self.node = node_name()
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed: set[str] = set()

    async def start(self, _app: web.Application) -> None:
        os.makedirs(self.traces_dir, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name="gpuscope-profiles", daemon=True)
        self._thread.start()

    async def stop(self, _app: web.Application) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _loop(self) -> None:
        while not self._stop.wait(SCAN_INTERVAL_S):
            try:
                self.ingest()
            except Exception:  # noqa: BLE001 - the agent keeps sampling and serving
                log.exception("folding traces failed")

    # -- ingest ------------------------------------------------------------------------------------
    def ingest(self) -> int:
        """Folds every trace without a cache (and drops caches whose trace is gone); how many it folded."""
        try:
            names = set(os.listdir(self.traces_dir))
        except OSError:
            return 0
        folded = 0
        for name in sorted(names):
            if name.endswith(TRACE_SUFFIX + CACHE_SUFFIX) and name.removesuffix(CACHE_SUFFIX) not in names:
                _unlink(os.path.join(self.traces_dir, name))  # its trace fell to retention
                continue
            if not name.endswith(TRACE_SUFFIX) or name.startswith(".") or name in self._failed:
                continue
            path = os.path.join(self.traces_dir, name)
            if name + CACHE_SUFFIX in names or not _regular(path):
                continue  # a symlink planted in the traces directory is never followed
            try:
                profile = self.fold(path)
            except Exception as e:  # noqa: BLE001 - an unreadable trace is reported once, not retried
                self._failed.add(name)
                log.warning("trace %s: no profile (%s: %s)", name, type(e).__name__, e)
                continue
            profile.windows[0]["file"] = name
            _write_new(path + CACHE_SUFFIX, json.dumps(profile.to_json(), separators=(",", ":")))
            folded += 1
            log.info("trace %s: %d stack(s) folded", name, len(profile.samples), extra={"f_event": "profile"})
        if len(self._failed) > 10_000:
            self._failed.clear()  # bounded: a trace that failed and is still there is tried once more
        return folded

    def fold(self, path: str) -> Profile:
        from .trace_api import read_trace

        trace = read_trace(path, "profile")  # one parse shared with the kernel statistics and the verdicts
        meta = trace.meta.get("gpuscope")
        meta = meta if isinstance(meta, dict) else {}
        pid = meta.get("pid") if isinstance(meta.get("pid"), int) and not isinstance(meta.get("pid"), bool) else None
        job = ""
        if pid is not None and meta.get("host") == self.host and _written_by_owner_of(path, pid):
            job = self.job_of(pid)
        return fold(trace, node=self.node, job=job[:256], pid=pid)

    def job_of(self, pid: int) -> str:
        """The workload of a process on this host: as the sampler last saw it, else from its cgroup and
        environment while it runs; '' when neither knows."""
        snap = self.agent.sampler.latest() if self.agent.sampler is not None else None
        for p in snap.processes if snap is not None else ():
            if p.pid == pid and p.workload:
                return str(p.workload)
        from .._cgroup import read_attribution, workload_of

        try:
            att = read_attribution(pid)
        except Exception:  # noqa: BLE001 - gone, or not ours to read
            return ""
        return workload_of(att.slurm_job, att.torchrun_run, att.namespace, att.pod)

    # -- reading -----------------------------------------------------------------------------------
    def merged(self, since_unix_ns: int, job: str | None) -> tuple[Profile, int]:
        """The windows that ended at or after `since_unix_ns` (of `job`), merged; and how many caches were
        skipped as unreadable."""
        try:
            names = sorted(n for n in os.listdir(self.traces_dir) if n.endswith(TRACE_SUFFIX + CACHE_SUFFIX))
        except OSError:
            names = []
        chosen, skipped = [], 0
        for name in names:
            path = os.path.join(self.traces_dir, name)
            try:
                if not _regular(path) or os.path.getsize(path) > MAX_CACHE_BYTES:
                    raise ProfileError("not a regular file within the size cap")
                with open(path, "rb") as f:
                    p = Profile.from_json(json.loads(f.read(MAX_CACHE_BYTES + 1)))
            except (OSError, ValueError, RecursionError) as e:  # ProfileError is a ValueError
                skipped += 1
                log.debug("profile cache %s skipped: %s", name, e)
                continue
            if any(window_overlaps(w, since_unix_ns) and (job is None or w.get("job") == job) for w in p.windows):
                chosen.append(p)
        return merge(chosen), skipped

    async def get(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        unknown = sorted(set(q) - {"since", "job", "format"})
        if unknown:
            return error_response(400, f"Unknown parameter(s) {', '.join(unknown)}: /api/v1/profile takes since, "
                                       "job and format.")
        fmt = q.get("format", "pprof")
        if fmt not in FORMATS:
            return error_response(400, f"format must be one of {', '.join(FORMATS)}, not {fmt!r}.")
        try:
            since_s = parse_duration(q.get("since", "1h"), "since")
        except TimeError as e:
            return error_response(400, str(e))
        if not 0 < since_s <= MAX_SINCE_S:
            return error_response(400, f"since must be a duration between 1s and 366d, not {q.get('since')!r}.")
        job = q.get("job") or None
        since_ns = time.time_ns() - int(since_s * 1e9)
        loop = asyncio.get_running_loop()
        profile, skipped = await loop.run_in_executor(None, self.merged, since_ns, job)
        headers = {"X-Gpuscope-Windows": str(len(profile.windows)), "X-Gpuscope-Skipped": str(skipped)}
        if fmt == "json":
            return json_response({**profile.to_json(), "node": self.node, "skipped_caches": skipped}, headers=headers)
        if fmt == "speedscope":
            return json_response(profile.speedscope(f"GPU time by launching stack: {self.node}"), headers=headers)
        try:
            body = await loop.run_in_executor(None, profile.pprof)
        except NoProtobuf as e:
            return error_response(501, str(e))
        return web.Response(body=body, content_type="application/octet-stream", headers={
            **headers, "Cache-Control": "no-store",
            "Content-Disposition": f'attachment; filename="gpu-{_safe(self.node)}.pb.gz"'})


def _written_by_owner_of(path: str, pid: int) -> bool:
    """Whether the trace's file belongs to the user running `pid` (or to root): the traces directory may be
    writable by every user, and a trace one user planted must not charge GPU time to another user's job."""
    try:
        owner = os.lstat(path).st_uid
        return owner == 0 or owner == os.stat(f"/proc/{int(pid)}").st_uid
    except (OSError, ValueError):
        return False


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:100] or "node"


def register(app: web.Application, agent: AgentFace) -> None:
    """The profile route on the agent's app, and the folding thread for its lifetime."""
    profiles = Profiles(agent)
    app.router.add_get("/api/v1/profile", profiles.get)
    app.on_startup.append(profiles.start)
    app.on_cleanup.append(profiles.stop)
