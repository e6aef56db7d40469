"""Prometheus remote write 1.0: push the series to Prometheus, VictoriaMetrics, Mimir, Thanos receive...
for nodes that push instead of being scraped.

    >>> from gpuscope import Sampler
    >>> from gpuscope.export.remote_write import RemoteWriter
    >>> w = RemoteWriter("http://127.0.0.1:8428/api/v1/write", interval=10.0)   # doctest: +SKIP
    >>> sampler = Sampler(simulate="healthy"); sampler.subscribe(w.add); sampler.start()  # doctest: +SKIP
    >>> ...; sampler.stop(); w.stop()   # stop() flushes              # doctest: +SKIP

`add(snapshot)` runs on the sampler thread and only appends a reference to a bounded queue (one
snapshot per `resolution` seconds; the others are skipped, not queued). A sender thread wakes every
`interval` seconds, turns the queued snapshots into samples with the same names and labels as the
canonical exposition, and POSTs them in requests of at most `max_samples_per_send` samples: a
protobuf `WriteRequest`, snappy block-compressed, with `Content-Encoding: snappy`,
`Content-Type: application/x-protobuf` and `X-Prometheus-Remote-Write-Version: 0.1.0`.
5xx, 429 and connection errors are retried with exponential backoff (0.5 s doubling to `max_backoff`,
with jitter) for up to `max_retry_s`; other 4xx answers drop the request (the receiver will not take
it). When the queue holds more than `max_queue_samples`, the oldest snapshots are dropped and
counted. Nothing here raises into the caller; `stats()` says what happened.

The protobuf encoding is written by hand: the schema is three tiny messages (WriteRequest
{TimeSeries timeseries = 1}, TimeSeries {Label labels = 1; Sample samples = 2}, Label {name = 1;
value = 2}, Sample {double value = 1; int64 timestamp = 2}), fixed since 2017, and encoding them is
~30 lines of varints. That avoids the protobuf runtime (a large dependency whose generated code is
tied to its version) and lets each series' encoded label set be cached, so a request is mostly a
join of cached bytes. Snappy comes from cramjam (maintained Rust bindings with wheels for every
platform; python-snappy needs the C library). The encoding is checked against a real Prometheus
and a real VictoriaMetrics in the tests.
"""

from __future__ import annotations

import logging
import random
import struct
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from .._records import Snapshot
from .._version import __version__
from ._model import CANONICAL, Ctx, Family, Labels, Model, sorted_labels

__all__ = ["RemoteWriter", "encode_write_request"]

log = logging.getLogger("gpuscope.remote_write")

_pack_double = struct.Struct("<d").pack


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field_bytes(tag: int, data: bytes) -> bytes:
    return bytes((tag,)) + _varint(len(data)) + data


def encode_labels(pairs: list[tuple[str, str]]) -> bytes:
    """The `labels` fields of a TimeSeries (repeated Label, field 1), pairs already sorted by name."""
    out = []
    for name, value in pairs:
        lab = _field_bytes(0x0A, name.encode("utf-8", "replace")) + _field_bytes(0x12, value.encode("utf-8", "replace"))
        out.append(_field_bytes(0x0A, lab))
    return b"".join(out)


def encode_sample(value: float, ts_ms: int) -> bytes:
    """One `samples` field of a TimeSeries (Sample, field 2)."""
    body = b"\x09" + _pack_double(value) + b"\x10" + _varint(ts_ms)
    return _field_bytes(0x12, body)


def encode_write_request(series: list[tuple[list[tuple[str, str]], list[tuple[float, int]]]]) -> bytes:
    """A WriteRequest from (sorted label pairs incl. __name__, [(value, timestamp ms)]) per series."""
    return b"".join(_field_bytes(0x0A, encode_labels(p) + b"".join(encode_sample(v, t) for v, t in s))
                    for p, s in series)


class _Batch:
    """Samples grouped by series, in time order, with cached encoded labels."""

    __slots__ = ("series", "count")

    def __init__(self) -> None:
        self.series: dict[tuple[Family, Ctx, Labels], list[bytes]] = {}
        self.count = 0


class RemoteWriter:
    """Pushes snapshots to a Prometheus remote-write endpoint from its own thread (started here).

    url: the receiver, e.g. http://host:9090/api/v1/write (Prometheus with
    --web.enable-remote-write-receiver) or http://host:8428/api/v1/write (VictoriaMetrics).
    interval: seconds between pushes. resolution: seconds between snapshots kept (the sampler ticks
    faster than anyone needs remotely). headers: extra HTTP headers (Authorization, X-Scope-OrgID).
    timeout: seconds per HTTP request. max_queue_samples: bound on queued samples; past it the oldest
    snapshots are dropped and counted. external_labels: added to every series (e.g. cluster).
    extra: a callable returning the agent's own metrics (e.g. Sampler.self_metrics), read at add().
    Raises ValueError for a URL that is not http(s) or a non-positive interval; never after that.
    """

    def __init__(self, url: str, *, interval: float = 10.0, headers: dict[str, str] | None = None,
                 timeout: float = 5.0, max_queue_samples: int = 500_000, resolution: float = 1.0,
                 max_samples_per_send: int = 20_000, top_processes: int = 16, hostname: str | None = None,
                 external_labels: dict[str, str] | None = None,
                 extra: Callable[[], dict[str, float]] | None = None,
                 max_backoff: float = 30.0, max_retry_s: float = 120.0) -> None:
        u = urlparse(url)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise ValueError(f"The remote-write URL must be http:// or https://host[:port]/path, got {url!r}.")
        if not interval > 0 or not timeout > 0 or not resolution >= 0:
            raise ValueError("The remote-write interval and timeout must be positive and the resolution not negative.")
        if max_queue_samples < 1 or max_samples_per_send < 1:
            raise ValueError("max_queue_samples and max_samples_per_send must be at least 1.")
        self.url = url
        self.interval = float(interval)
        self.timeout = float(timeout)
        self.resolution_ns = int(resolution * 1e9)
        self.max_queue_samples = int(max_queue_samples)
        self.max_samples_per_send = int(max_samples_per_send)
        self.top_processes = top_processes
        self.hostname = hostname
        self.external_labels = tuple(sorted((external_labels or {}).items()))
        self.extra = extra
        self.max_backoff = max_backoff
        self.max_retry_s = max_retry_s
        self.headers = {
            "Content-Encoding": "snappy",
            "Content-Type": "application/x-protobuf",
            "X-Prometheus-Remote-Write-Version": "0.1.0",
            "User-Agent": f"gpuscope/{__version__}",
        }
        self.headers.update(headers or {})
        self._model = Model()
        self._labels: dict[tuple[Family, Ctx, Labels], bytes] = {}
        self._queue: deque[tuple[Snapshot, dict[str, float] | None, int]] = deque()
        self._queued = 0
        self._last_ns = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._flush_deadline: float | None = None
        self._stats: dict[str, Any] = {
            "samples_sent": 0, "samples_dropped": 0, "snapshots_dropped": 0, "samples_failed": 0, "requests": 0,
            "request_failures": 0, "retries": 0, "bytes_sent": 0, "last_error": "", "last_success_time": 0.0,
        }
        self._logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="gpuscope-remote-write", daemon=True)
        self._thread.start()

    # -- the producer side (sampler thread) ----------------------------------------------------
    def add(self, snapshot: Snapshot | None) -> None:
        """Queue a snapshot for sending. Cheap; never raises; skipped when within `resolution` of the
        previous one kept, or after stop()."""
        try:
            if snapshot is None or self._stop.is_set():
                return
            if snapshot.time_ns - self._last_ns < self.resolution_ns:
                return
            self._last_ns = snapshot.time_ns
            extra = self.extra() if self.extra is not None else None
            # An upper bound on the samples it will make (top-N folding and absent process fields
            # make fewer); exact counting would mean converting here, on the sampler thread.
            n = sum(len(g.values) + 1 for g in snapshot.gpus) + 7 * len(snapshot.processes)
            n += len(snapshot.host.values) if snapshot.host is not None else 0
            n += len(extra) if extra else 0
            with self._lock:
                self._queue.append((snapshot, extra, n))
                self._queued += n
                while self._queued > self.max_queue_samples and len(self._queue) > 1:
                    _, _, dropped = self._queue.popleft()
                    self._queued -= dropped
                    self._stats["samples_dropped"] += dropped
                    self._stats["snapshots_dropped"] += 1
        except Exception as e:  # noqa: BLE001 - never raise into the sampler
            self._log_once("add", f"remote write: queuing a snapshot failed: {type(e).__name__}: {e}")

    __call__ = add  # so that sampler.subscribe(writer) works

    def flush(self) -> None:
        """Ask the sender to push now instead of at its next interval (returns at once)."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Send what is queued (retrying for at most `timeout` seconds, default 2x the request
        timeout), then end the sender thread."""
        if not self._thread.is_alive():
            return
        budget = timeout if timeout is not None else 2 * self.timeout
        self._flush_deadline = time.monotonic() + budget
        self._stop.set()
        self._wake.set()
        self._thread.join(budget + self.timeout + 1.0)

    def __enter__(self) -> RemoteWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> dict[str, Any]:
        """Counters since start: samples sent, samples failed (rejected or given up), samples and
        snapshots dropped because the queue was full, requests, failed requests, retries, bytes sent
        (compressed), queued samples, last error. Queued and dropped samples are counted as add()
        estimates them (one per value, gpu_info, 7 per process; an upper bound), sent and failed
        ones exactly."""
        with self._lock:
            out = dict(self._stats)
            out["queued_samples"] = self._queued
        return out

    def self_metrics(self) -> dict[str, float]:
        """The writer's health as agent metrics, for `render(extra=...)`."""
        s = self.stats()
        return {
            "gpuscope_remote_write_samples_total": float(s["samples_sent"]),
            "gpuscope_remote_write_dropped_samples_total": float(s["samples_dropped"]),
            "gpuscope_remote_write_failed_samples_total": float(s["samples_failed"]),
            "gpuscope_remote_write_requests_total": float(s["requests"]),
            "gpuscope_remote_write_request_failures_total": float(s["request_failures"]),
            "gpuscope_remote_write_retries_total": float(s["retries"]),
            "gpuscope_remote_write_queued_samples": float(s["queued_samples"]),
        }

    # -- the sender thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            stopping = self._stop.is_set()
            try:
                self._drain()
            except Exception as e:  # noqa: BLE001 - the sender must survive its own bugs
                self._log_once("drain", f"remote write: sending failed: {type(e).__name__}: {e}")
            if stopping:
                return

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                if (self._stop.is_set() and self._flush_deadline is not None
                        and time.monotonic() > self._flush_deadline):
                    self._stats["samples_dropped"] += self._queued
                    self._stats["snapshots_dropped"] += len(self._queue)
                    self._queue.clear()
                    self._queued = 0
                    return
                taken: list[tuple[Snapshot, dict[str, float] | None, int]] = []
                n = 0
                while self._queue and (not taken or n + self._queue[0][2] <= self.max_samples_per_send):
                    item = self._queue.popleft()
                    self._queued -= item[2]
                    n += item[2]
                    taken.append(item)
            batch = self._build(taken)
            if batch.count:
                self._send(self._encode(batch), batch.count)

    def _build(self, taken: list[tuple[Snapshot, dict[str, float] | None, int]]) -> _Batch:
        batch = _Batch()
        series = batch.series
        labels_cache = self._labels
        if len(labels_cache) > 50_000:
            labels_cache.clear()
        for snap, extra, _ in taken:
            ts = _varint(snap.time_ns // 1_000_000)
            head = bytes((0x12, 10 + len(ts))) + b"\x09"
            tail = b"\x10" + ts
            fams = self._model.rows(snap, mode=CANONICAL, top_processes=self.top_processes, extra=extra,
                                    hostname=self.hostname)
            for fam, rows in fams:
                for ctx, sl, v in rows:
                    key = (fam, ctx, sl)
                    samples = series.get(key)
                    if samples is None:
                        samples = series[key] = []
                        if key not in labels_cache:
                            pairs = sorted_labels(fam.name, ctx, sl)
                            if self.external_labels:
                                pairs = sorted(dict(pairs + list(self.external_labels)).items())
                            labels_cache[key] = encode_labels(pairs)
                    samples.append(head + _pack_double(v) + tail)
                    batch.count += 1
        return batch

    def _encode(self, batch: _Batch) -> bytes:
        labels_cache = self._labels
        parts = []
        for key, samples in batch.series.items():
            body = labels_cache[key] + b"".join(samples)
            parts.append(b"\x0a" + _varint(len(body)) + body)
        return b"".join(parts)

    def _send(self, payload: bytes, count: int) -> None:
        import cramjam

        data = bytes(cramjam.snappy.compress_raw(payload))
        started = time.monotonic()
        delay = min(0.5, self.max_backoff)
        while True:
            ok, retry, err = self._post(data)
            with self._lock:
                self._stats["requests"] += 1
                if ok:
                    self._stats["samples_sent"] += count
                    self._stats["bytes_sent"] += len(data)
                    self._stats["last_success_time"] = time.time()
                    return
                self._stats["request_failures"] += 1
                self._stats["last_error"] = err
            now = time.monotonic()
            deadline = self._flush_deadline if self._stop.is_set() else None
            give_up = (not retry or now - started + delay > self.max_retry_s
                       or (deadline is not None and now + delay > deadline))
            if give_up:
                with self._lock:
                    self._stats["samples_failed"] += count
                self._log_once(f"fail {err[:40]}", f"remote write to {self.url}: {err}; dropped {count} samples")
                return
            with self._lock:
                self._stats["retries"] += 1
            self._log_once(f"retry {err[:40]}", f"remote write to {self.url}: {err}; retrying with backoff")
            # Sleep, but wake for stop() so that its flush deadline applies.
            wait = delay * (0.8 + 0.4 * random.random())
            if self._stop.wait(wait) and self._flush_deadline is not None:
                remaining = self._flush_deadline - time.monotonic()
                if remaining > 0:
                    time.sleep(min(wait, remaining))
            delay = min(self.max_backoff, delay * 2)

    def _post(self, data: bytes) -> tuple[bool, bool, str]:
        """(ok, retryable, error)."""
        req = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                resp.read()
                return True, False, ""
        except urllib.error.HTTPError as e:
            try:
                body = e.read(300).decode("utf-8", "replace").strip()
            except Exception:  # noqa: BLE001
                body = ""
            retry = e.code == 429 or e.code >= 500
            return False, retry, f"HTTP {e.code} {body}".strip()
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            return False, True, f"connection failed: {reason}"

    def _log_once(self, key: str, msg: str) -> None:
        if key not in self._logged and len(self._logged) < 100:
            self._logged.add(key)
            log.warning("%s (logged once)", msg)
