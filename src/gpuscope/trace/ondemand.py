"""Traces on demand: the file protocol between the agent and the processes that opted in.

Standard library only, no relative imports, nothing newer than Python 3.8: the bootstrap (bootstrap/sitecustomize.py) loads this
file by its path inside the traced program, where gpuscope itself may not be importable. One copy of
the protocol, read by both sides, instead of a second one in the bootstrap that could drift.

Everything lives in one request directory (the agent's `DATA_DIR/trace-requests`):

    proc.<host>.<pid>.json          a process that opted in: pid, host, rank, budget (removed at exit)
    req.<id>.json                   a request: {"id", "duration_s", "pids": [..] | "all", "created_unix"}
                                    and, for windows that start together across nodes, "start_unix"
    done.<id>.<host>.<pid>.json     one process's answer: status written | refused | profiler_failed,
                                    the reason, and the trace file (in the agent's DATA_DIR/traces)

Files are written to a temporary name and renamed, so a reader never sees half of one. The agent
only writes requests; a process decides for itself, under its own duty budget, whether to trace.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> register(d, {"host": "h", "pid": 7, "rank": None})
    >>> req = write_request(d, 5.0, "all", host="h")
    >>> [r["id"] for r in pending_for(d, 7, "h", since_unix=0)] == [req["id"]]
    True
    >>> mark_done(d, req["id"], "h", 7, status="refused", reason="test")
    >>> pending_for(d, 7, "h", since_unix=0), [t["status"] for t in list_traces(d)]
    ([], ['refused'])
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import socket
import stat
import tempfile
import time
from typing import Any

MIN_DURATION_S = 1.0
MAX_DURATION_S = 30.0
DEFAULT_MAX_DUTY = 0.01
# The budget holds over any this many seconds of wall time (max_duty of it: 6 s of any 10 minutes at 1 %).
HORIZON_S = 600.0
# Before a process has had a window, each second of window is estimated to cost this much beyond itself
# (stop, export, compression): a launch-bound PyTorch process on the H200 (76k launches/s) spent 7.3 s beyond
# a 2 s window, 2026-12-03 (BENCHMARKS.md), the most records a second of the reference workloads.
PRIOR_OVERHEAD_PER_S = 4.0
# A request older than this is history: a process that opts in later does not act on it.
REQUEST_TTL_S = 60.0
_ID = re.compile(r"[0-9a-f]{16}")
# A request may ask its window to start later (every rank of a job at one moment), at most this far ahead.
MAX_START_AHEAD_S = 30.0
# A protocol file is a few hundred bytes; anything bigger is not one of ours (and is not read whole).
MAX_FILE_BYTES = 64 << 10
MAX_TRIGGER_CHARS = 200


def _write_json(path: str, doc: dict[str, Any]) -> None:
    """Through a new file of a random name (O_EXCL, no symlink followed), renamed into place: in a
    directory other users can write, a name planted in advance must not redirect the write."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-", suffix=".json")
    try:
        os.fchmod(fd, 0o644)  # the other side (the agent, or the traced process's user) reads it
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _read_json(path: str) -> dict[str, Any] | None:
    """A regular file's JSON object, or None: never a symlink, FIFO or device (which could block the
    reader or feed it forever), never more than MAX_FILE_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
            return None
        with os.fdopen(fd, "rb") as f:
            fd = -1
            doc = json.loads(f.read(MAX_FILE_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        if fd >= 0:
            os.close(fd)
    return doc if isinstance(doc, dict) else None


def _unix(value: Any) -> float:
    """A time stamp from a file anyone could have written: a finite number, else 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    try:
        value = float(value)
    except OverflowError:
        return 0.0
    return value if value == value and abs(value) != float("inf") else 0.0


def _listing(req_dir: str, prefix: str) -> list[str]:
    try:
        names = os.listdir(req_dir)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(prefix) and n.endswith(".json"))


# -- the agent's side -------------------------------------------------------------------------------
def write_request(req_dir: str, duration_s: float, pids: list[int] | str, host: str | None = None,
                  start_unix: float | None = None, trigger: str | None = None) -> dict[str, Any]:
    """Write a request for `pids` (or "all") to trace `duration_s` seconds, from `start_unix` (this host's
    clock; None: at once); returns it, with its new id. `trigger` says why (the agent's own windows: the
    verdict that flipped, or the schedule); the process copies it into its answer."""
    os.makedirs(req_dir, exist_ok=True)
    req = {"id": secrets.token_hex(8), "duration_s": float(duration_s), "pids": pids,
           "host": host or socket.gethostname(), "created_unix": time.time()}
    if start_unix is not None:
        req["start_unix"] = float(start_unix)
    if trigger:
        req["trigger"] = str(trigger)[:MAX_TRIGGER_CHARS]
    _write_json(os.path.join(req_dir, f"req.{req['id']}.json"), req)
    return req


def opted_in(req_dir: str, host: str | None = None) -> list[dict[str, Any]]:
    """The status files of the live processes of this host that opted in (files of dead ones are removed)."""
    host = host or socket.gethostname()
    out = []
    for name in _listing(req_dir, "proc."):
        doc = _read_json(os.path.join(req_dir, name))
        if doc is None or doc.get("host") != host or not _valid_pid(doc.get("pid")):
            continue
        if not _alive(doc["pid"]):
            _remove(os.path.join(req_dir, name))  # killed before its exit hook could remove it
            continue
        out.append(doc)
    return out


def list_traces(req_dir: str) -> list[dict[str, Any]]:
    """Every process's answer to every request (done markers), newest first."""
    read = [_read_json(os.path.join(req_dir, n)) for n in _listing(req_dir, "done.")]
    docs = [d for d in read if d is not None]
    return sorted(docs, key=lambda d: -_unix(d.get("answered_unix")))


def expire_requests(req_dir: str, now: float | None = None) -> None:
    """Remove requests nobody will act on any more (their answers stay)."""
    now = time.time() if now is None else now
    for name in _listing(req_dir, "req."):
        path = os.path.join(req_dir, name)
        doc = _read_json(path)
        if doc is None or now - _unix(doc.get("created_unix")) > REQUEST_TTL_S:
            _remove(path)


def _valid_pid(pid: Any) -> bool:
    # 0 and negative pids name process groups for kill(); beyond pid_t, kill() raises OverflowError
    return isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's process: alive
        return True
    except (OSError, OverflowError):  # ProcessLookupError: gone
        return False
    return True


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# -- the traced process's side ----------------------------------------------------------------------
def register(req_dir: str, status: dict[str, Any]) -> None:
    """Say (or update) that this process takes requests: proc.<host>.<pid>.json."""
    os.makedirs(req_dir, exist_ok=True)
    _write_json(os.path.join(req_dir, f"proc.{status['host']}.{status['pid']}.json"), status)


def unregister(req_dir: str, host: str, pid: int) -> None:
    _remove(os.path.join(req_dir, f"proc.{host}.{pid}.json"))


def pending_for(req_dir: str, pid: int, host: str, since_unix: float) -> list[dict[str, Any]]:
    """Requests addressed to this pid (or to all) on this host, made after `since_unix`, not expired,
    not answered yet, from a trusted writer (this process's user, root, or the directory's owner),
    oldest first."""
    try:
        trusted = {os.getuid(), 0, os.stat(req_dir).st_uid}
    except OSError:
        return []
    now = time.time()
    out = []
    for name in _listing(req_dir, "req."):
        path = os.path.join(req_dir, name)
        try:
            st = os.lstat(path)  # the file itself: a symlink is never a request
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in trusted:
            continue
        req = _read_json(path)
        if req is None or not _valid(req) or req.get("host") != host:
            continue
        if req["pids"] != "all" and pid not in req["pids"]:
            continue
        if not since_unix <= req["created_unix"] <= now + 5 or now - req["created_unix"] > REQUEST_TTL_S:
            continue
        if os.path.exists(os.path.join(req_dir, f"done.{req['id']}.{host}.{pid}.json")):
            continue
        out.append(req)
    return sorted(out, key=lambda r: r["created_unix"])


def start_delay_s(req: dict[str, Any], now: float | None = None) -> float:
    """How long to wait before a request's window starts: 0 without a start_unix or when it has passed,
    never more than MAX_START_AHEAD_S."""
    start = _unix(req.get("start_unix"))
    now = time.time() if now is None else now
    return min(max(0.0, start - now), MAX_START_AHEAD_S) if start else 0.0


def _valid(req: dict[str, Any]) -> bool:
    """A request's fields are used in file names and as a duration: check them all, trust none."""
    pids = req.get("pids")
    start = req.get("start_unix")
    return (isinstance(req.get("id"), str) and _ID.fullmatch(req["id"]) is not None
            and (start is None or (isinstance(start, (int, float)) and not isinstance(start, bool)))
            and isinstance(req.get("duration_s"), (int, float)) and not isinstance(req["duration_s"], bool)
            and isinstance(req.get("created_unix"), (int, float))
            and (pids == "all" or (isinstance(pids, list)
                                  and all(isinstance(p, int) and not isinstance(p, bool) for p in pids))))


def mark_done(req_dir: str, request_id: str, host: str, pid: int, **fields: Any) -> None:
    """This process's answer to one request (status, reason, file, ...)."""
    doc = {"id": request_id, "host": host, "pid": pid, "answered_unix": time.time(), **fields}
    _write_json(os.path.join(req_dir, f"done.{request_id}.{host}.{pid}.json"), doc)


class Watcher:
    """Whether the request directory may hold something new, for one stat() a second: its mtime
    changes when a file is created or renamed in it. Filesystems with coarse mtimes (1 s, 2 s) can
    hide a second change within one tick, so a recent mtime is listed again until it is old enough."""

    def __init__(self, req_dir: str) -> None:
        self.req_dir = req_dir
        self._seen_ns = -1

    def changed(self) -> bool:
        try:
            mtime_ns = os.stat(self.req_dir).st_mtime_ns
        except OSError:
            return False
        recent = time.time_ns() - mtime_ns < 3 * 10**9
        if mtime_ns == self._seen_ns and not recent:
            return False
        self._seen_ns = mtime_ns
        return True


class Budget:
    """The hard overhead budget of one process, for windows on demand, repeated windows and windows the
    agent starts itself alike. It lives in the traced process, so no request can lift it.

    A window's cost is everything it took, measured: from the profiler's start call through the window,
    the stop, the export and the compression, all counted as if the program made no progress meanwhile
    (an upper bound: the program runs on during a window, only slower). Two rules, both enforced:

    - spacing: after a window that started at `started` and cost `cost_s`, the next may start only at
      started + cost_s / max_duty (1 %: a window that cost 2 s at most every 200 s), so the program is
      never slowed for long stretches at a time;
    - any 10 minutes: the windows that overlap any HORIZON_S (600 s) of wall time cost at most
      max_duty of it (6 s at 1 %), counting a window whole when any part of it falls inside. A window
      whose cost alone exceeds that (a 30 s window asked by hand) needs cost / max_duty seconds with
      nothing else in them instead.

    The next window's cost is estimated as its duration plus the overhead the last one measured beyond
    its duration (scaled up for a longer window: the export grows with the records); before the first,
    PRIOR_OVERHEAD_PER_S per second of window. The agent's own windows (`fit`) must also fit the 10
    minutes' allowance on their own estimate, shortened down to MIN_DURATION_S where a shorter one does;
    a window asked by hand is let through alone instead. Monotonic clock.

        >>> b = Budget(0.01)
        >>> b.spend(100.0, 2.0, duration_s=1.5)
        >>> b.refuse(2.0, now=300.0)    # spaced 200 s, and 2 s + 2.5 s est. <= 6 s of the last 600 s
        ''
        >>> b.spend(300.0, 2.5, duration_s=2.0)
        >>> b.refuse(2.0, now=600.0)[:40], b.refuse(2.0, now=699.5)
        ('over the duty budget of 1 % of wall time', '')
    """

    def __init__(self, max_duty: float = DEFAULT_MAX_DUTY, horizon_s: float = HORIZON_S) -> None:
        self.max_duty = max_duty if 0 < max_duty <= 1 else DEFAULT_MAX_DUTY
        self.horizon_s = horizon_s
        self.spent: list[tuple[float, float]] = []  # (start, cost) of the windows that may still count, monotonic s
        self.overhead_s = 0.0  # the last window's cost beyond its duration
        self.measured_duration_s: float | None = None  # that window's duration; None: none measured yet
        self.charged = False  # a window has been charged (before: the prior estimates the first)
        self.last_duration_s = MIN_DURATION_S

    def estimate(self, duration_s: float) -> float:
        """The whole cost expected of a window of duration_s (the prior before any window was charged)."""
        if not self.charged:
            return duration_s * (1.0 + PRIOR_OVERHEAD_PER_S)
        scale = max(1.0, duration_s / self.measured_duration_s) if self.measured_duration_s else 1.0
        return duration_s + self.overhead_s * scale

    def fit(self, duration_s: float, now: float | None = None) -> tuple[float, str]:
        """For the agent's own windows: the longest duration <= duration_s (down to MIN_DURATION_S, in
        tenths of a second) whose estimated cost fits max_duty of the horizon on its own and that may
        start now, and "" -- or (duration_s, why not)."""
        now = time.monotonic() if now is None else now
        allowance = self.max_duty * self.horizon_s
        d = duration_s
        while d > MIN_DURATION_S and self.estimate(d) > allowance:
            d = max(MIN_DURATION_S, math.floor(d * 10 - 1e-9) / 10)
        if self.estimate(d) > allowance:
            return duration_s, (f"a window of {d:g} s is estimated to cost {self.estimate(d):.1f} s in this process "
                                f"(start, stop, export), over the {allowance:g} s ({self.max_duty * 100:g} %) of "
                                f"any {self.horizon_s / 60:g} minutes that the agent's windows may take")
        why = self.refuse(d, now)
        return (d, "") if not why else (duration_s, why)

    def allowed_at(self, duration_s: float, now: float | None = None) -> float:
        """The earliest monotonic time >= now at which a window of duration_s may start."""
        now = time.monotonic() if now is None else now
        est = self.estimate(duration_s)
        span = max(self.horizon_s, est / self.max_duty)
        allowance = self.max_duty * span
        t = now
        if self.spent:
            start, cost = self.spent[-1]
            t = max(t, start + cost / self.max_duty)  # spacing
        # A window starting at t ends at t + est: every earlier window that ends within the span before
        # that counts. Windows leave the span as t moves on, oldest end first.
        ends = sorted((s + c, c) for s, c in self.spent if s + c > t + est - span)
        total = sum(c for _, c in ends)
        for end, cost in ends:
            if total + est <= allowance:
                break
            t = max(t, end + span - est)
            total -= cost
        return t

    def refuse(self, duration_s: float, now: float | None = None) -> str:
        """Why a window of duration_s cannot start now, or "" when it can."""
        now = time.monotonic() if now is None else now
        if not MIN_DURATION_S <= duration_s <= MAX_DURATION_S:
            return f"the duration {duration_s:g} s is outside {MIN_DURATION_S:g}..{MAX_DURATION_S:g} s"
        self.last_duration_s = duration_s
        at = self.allowed_at(duration_s, now)
        if at > now:
            return (f"over the duty budget of {self.max_duty * 100:g} % of wall time (spent "
                    f"{self.spent_s(now):.1f} s of the last {self.horizon_s / 60:g} min): the next window of "
                    f"{duration_s:g} s may start in {max(1.0, at - now):.0f} s")
        return ""

    def spend(self, started: float, cost_s: float, duration_s: float | None = None) -> None:
        """Charge a window that started at `started` (monotonic s) and cost `cost_s` seconds in all
        (of which `duration_s` was the window itself, when known: the rest is the next one's estimate)."""
        cost_s = max(0.0, cost_s)
        self.charged = True
        if duration_s is not None:
            self.overhead_s = max(0.0, cost_s - duration_s)
            self.measured_duration_s = duration_s if duration_s > 0 else None
        keep = started - max(self.horizon_s, (MAX_DURATION_S + self.overhead_s) / self.max_duty)
        self.spent = [(s, c) for s, c in self.spent if s + c > keep][-256:] + [(started, cost_s)]

    def spent_s(self, now: float | None = None) -> float:
        """Seconds of windows within the last horizon_s (10 minutes), counted whole."""
        now = time.monotonic() if now is None else now
        return sum(c for s, c in self.spent if s + c > now - self.horizon_s)

    def windows_unix(self, now: float | None = None) -> list[list[float]]:
        """[start unix s, cost s] of each window of the last horizon_s: what the status file records."""
        now = time.monotonic() if now is None else now
        off = time.time() - now
        return [[round(s + off, 3), round(c, 3)] for s, c in self.spent if s + c > now - self.horizon_s]

    @property
    def next_allowed(self) -> float:
        """The earliest monotonic time a window of the last duration asked may start (-inf: now)."""
        if not self.spent:
            return float("-inf")
        return self.allowed_at(self.last_duration_s, time.monotonic())

    def next_allowed_unix(self, now: float | None = None) -> float | None:
        if not self.spent:
            return None
        now = time.monotonic() if now is None else now
        return time.time() + max(0.0, self.allowed_at(self.last_duration_s, now) - now)
