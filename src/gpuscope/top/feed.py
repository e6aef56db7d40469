"""Where `gpuscope top` gets its overview: a running agent, or a sampler of its own. Each feed polls on
its own thread, so no HTTP call or NVML read ever runs on the UI's event loop; the UI only picks up
`latest()`, a reference swap.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from .. import viewmodel
from ..agent.client import ClientError, get_json
from ..http.net import is_loopback_host

log = logging.getLogger(__name__)

VERDICT_EVERY_S = 2.0  # verdicts and alerts change slowly; diagnose costs more than a frame
VERDICT_WINDOW_S = 10.0


class Feed:
    """Polls `_poll()` every `refresh` seconds on a daemon thread. `describe` says where the data comes
    from (for the header); `note` why it comes from there (a fallback); `local_pids` whether the pids
    it shows are processes of this machine (so they may be signalled)."""

    describe = ""
    local_pids = False

    def __init__(self, refresh: float) -> None:
        self.refresh = refresh
        self.note = ""
        self.error = ""  # the last failure, one sentence; '' while all is well
        self._latest: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first = threading.Event()
        self._failed: set[str] = set()

    def latest(self) -> dict[str, Any] | None:
        return self._latest

    def start(self) -> Feed:
        self._thread = threading.Thread(target=self._run, name="gpuscope-top-feed", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def wait_first(self, timeout: float) -> dict[str, Any] | None:
        """The first overview (for --once), or None if none came within `timeout` seconds."""
        self._first.wait(timeout)
        return self._latest

    def _publish(self, overview: dict[str, Any]) -> None:
        self._latest = overview
        self._first.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self._poll()
            except Exception as e:  # a bug in one poll must not kill the view; say it once
                key = type(e).__name__
                if key not in self._failed:
                    self._failed.add(key)
                    log.exception("gpuscope top: reading the data failed")
                self.error = f"Reading the data failed ({key}: {e})."
            self._stop.wait(max(0.0, self.refresh - (time.monotonic() - t0)))

    def _poll(self) -> None:
        raise NotImplementedError


def _is_loopback(url: str) -> bool:
    try:
        host = urllib.parse.urlsplit(url).hostname or ""
    except ValueError:  # 'http://[::1': the probe says what is wrong with it, in one sentence
        return False
    return is_loopback_host(host)


class AgentFeed(Feed):
    """GET /api/v1/latest every refresh; /api/v1/diagnose?window=10s and /api/v1/alerts every 2 s."""

    def __init__(self, url: str, token: str | None, refresh: float,
                 fetch: Callable[..., Any] = get_json) -> None:
        super().__init__(refresh)
        self.url, self.token, self._fetch = url, token, fetch
        self.describe = f"agent {url}"
        self._loopback = _is_loopback(url)
        self._verdicts: list[Any] = []
        self._alerts: dict[str, Any] = {}
        self._slow_at = 0.0

    def probe(self) -> dict[str, Any]:
        """One /api/v1/latest, quickly: raises ClientError (one sentence) when no agent answers."""
        return self._get("/api/v1/latest", {}, timeout=2.0)

    def _get(self, path: str, params: dict[str, str], timeout: float = 5.0) -> Any:
        return self._fetch(self.url, path, params, self.token, timeout=timeout)

    def _poll(self) -> None:
        try:
            latest = self._get("/api/v1/latest", {})
            now = time.monotonic()
            if now - self._slow_at >= VERDICT_EVERY_S:
                self._slow_at = now
                diag = self._get("/api/v1/diagnose", {"window": f"{VERDICT_WINDOW_S:g}s"}, timeout=10.0)
                self._verdicts = diag.get("verdicts", [])
                self._alerts = self._get("/api/v1/alerts", {})
        except ClientError as e:
            self.error = str(e)
            if self._latest is not None:  # keep showing the last data, marked stale by the error
                self._publish({**self._latest, "errors": [str(e)]})
            return
        self.error = ""
        # The pids are this machine's only when the agent is, so the tree (ppid) and kill need both.
        self.local_pids = self._loopback and latest.get("hostname") in ("", socket.gethostname())
        self._publish(viewmodel.from_snapshot(latest, self._verdicts, source="agent", alerts=self._alerts,
                                              with_ppid=self.local_pids))


class LocalFeed(Feed):
    """This process's own sampler (started and stopped with the feed) and diagnose over its last 10 s."""

    describe = "sampling this machine"

    def __init__(self, sampler: Any, refresh: float) -> None:
        super().__init__(refresh)
        self.sampler = sampler
        self.local_pids = sampler.simulated is None
        if sampler.simulated:
            self.describe = "sampling a simulated node here"
        self._last: Any = None
        self._verdicts: list[Any] = []
        self._slow_at = 0.0

    def start(self) -> Feed:
        self.sampler.start()
        return super().start()

    def stop(self) -> None:
        super().stop()
        self.sampler.stop()

    def _poll(self) -> None:
        from ..diagnose import diagnose, windows_from_snapshots

        snap = self.sampler.latest()
        if snap is None or snap is self._last:
            return
        self._last = snap
        now = time.monotonic()
        if now - self._slow_at >= VERDICT_EVERY_S:
            self._slow_at = now
            cutoff = snap.time_ns - int(VERDICT_WINDOW_S * 1e9)
            self._verdicts = diagnose(windows_from_snapshots(
                [s for s in list(self.sampler.history) if s.time_ns >= cutoff]))
        self._publish(viewmodel.from_snapshot(snapshot_dict(snap), self._verdicts, source="local"))


def snapshot_dict(snap: Any) -> dict[str, Any]:
    """What viewmodel.from_snapshot reads of a Snapshot, without dataclasses.asdict's deep copies
    (from_snapshot only reads; asdict of 100 processes took 2.7 ms, a third of a frame's cost)."""

    def flat(o: Any) -> dict[str, Any]:
        return {f: getattr(o, f) for f in o.__slots__}

    return {"gpus": [{"identity": flat(g.identity), "values": g.values, "healthy": g.healthy,
                      "throttle_reasons": g.throttle_reasons} for g in snap.gpus],
            "processes": [flat(p) for p in snap.processes], "simulated": snap.simulated,
            "host": None if snap.host is None else {"values": snap.host.values},
            "time_ns": snap.time_ns, "hostname": snap.hostname}


class StaticFeed(Feed):
    """A fixed overview: for tests, and for showing a saved one."""

    def __init__(self, overview: dict[str, Any], local_pids: bool = False, describe: str = "a fixed overview") -> None:
        super().__init__(3600.0)
        self.local_pids = local_pids
        self.describe = describe
        self._publish(overview)

    def _poll(self) -> None:
        return
