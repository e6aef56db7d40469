"""The Store facade: one writer per data directory, any number of readers."""

from __future__ import annotations

import atexit
import logging
import math
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._records import Event, Snapshot
from ._config import Retention
from ._errors import StoreError
from ._export import export
from ._read import Reader, SeriesResult
from ._schema import WriterLock, open_reader_db, open_writer_db, prepare_dir
from ._writer import Batch, Writer, _reason

log = logging.getLogger("gpuscope.store")


class Store:
    """The embedded time-series store of one node.

    A writer (`readonly=False`, one per directory; a second gets StoreLocked) buffers appended
    snapshots in memory and persists them from a background thread every `flush_interval` seconds;
    readers (`readonly=True`, any number, any process) see everything up to the writer's last flush.
    The writer never stops on a failed write or a record it cannot store: `health()` says whether it can
    write, since when it cannot, and what it repaired or dropped. `clock` (monotonic seconds) times the
    health; with `wall_clock_ns` at open it is the store's own 'now', which retention never measures past
    (a host clock that jumps ahead and back deletes nothing early). Tests inject both.

        >>> import tempfile
        >>> from gpuscope import Sampler
        >>> with Store(tempfile.mkdtemp()) as store, Sampler(simulate="healthy") as s:
        ...     store.append(s.sample_once())
        ...     store.flush()
        ...     [r["labels"]["gpu"] for r in store.series("gpu_power_watts")]
        ['0']
    """

    def __init__(self, path: str | Path, *, readonly: bool = False, flush_interval: float = 1.0,
                 retention: Retention | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.path = Path(path)
        self.readonly = readonly
        if isinstance(flush_interval, bool) or not isinstance(flush_interval, int | float) \
                or not math.isfinite(flush_interval) or not 0 < flush_interval <= 3600:
            raise StoreError(f"flush_interval must be a number of seconds in (0, 3600], got {flush_interval!r}.")
        self.flush_interval = float(flush_interval)
        self.retention = retention if retention is not None else Retention()
        self.retention.validate()
        self._writer: Writer | None = None
        self._lock: WriterLock | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._last: Snapshot | None = None
        self._norm: dict[int, tuple[object, list[tuple[str, dict[str, str]]]]] = {}
        self._closed = False
        if readonly:
            open_reader_db(self.path).close()  # fail now, in one sentence, if there is no store
            self._reader = Reader(self.path, lambda: open_reader_db(self.path))
            return
        prepare_dir(self.path)
        self._lock = WriterLock(self.path)
        self._lock.acquire()
        try:
            # unhealthy once no flush has completed for three flush intervals (and a margin for a slow disk)
            self._writer = Writer(self.path, open_writer_db(self.path), self.retention, clock=clock,
                                  wall_clock_ns=wall_clock_ns, stale_after_s=3 * self.flush_interval + 2.0)
        except BaseException:
            self._lock.release()
            raise
        self._reader = Reader(self.path, lambda: open_reader_db(self.path), tail=self._writer.tail)
        self._thread = threading.Thread(target=self._writer.run, args=(self.flush_interval, self._stop),
                                        name="gpuscope-store-flush", daemon=True)
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))  # the flush thread is a daemon: flush at exit

    # -- writing -----------------------------------------------------------------------------------
    def append(self, snapshot: Snapshot) -> None:
        """Queue one snapshot (memory only, O(1)); it is on disk at most flush_interval later."""
        w = self._writer
        if w is None:
            raise StoreError("This store is open read-only (or closed); open it with readonly=False to write.")
        self._last = snapshot
        w.append(snapshot)

    def append_batch(self, series: Sequence[tuple[str, Mapping[str, str]]], times_ns: npt.ArrayLike,
                     values: npt.ArrayLike) -> None:
        """Queue rows for k series that share time stamps: times_ns (n,), values (n, k). The arrays
        are taken over, not copied: do not change them afterwards. For bulk loads and importers."""
        w = self._writer
        if w is None:
            raise StoreError("This store is open read-only (or closed); open it with readonly=False to write.")
        t = np.ascontiguousarray(times_ns, dtype=np.int64)
        v = np.ascontiguousarray(values, dtype=np.float64)
        if v.ndim == 1 and len(series) == 1:
            v = v.reshape(-1, 1)
        if t.ndim != 1 or v.ndim != 2 or v.shape != (len(t), len(series)):
            raise StoreError(f"append_batch needs times_ns of shape (n,) and values of shape (n, {len(series)}), "
                             f"got {t.shape} and {v.shape}.")
        hit = self._norm.get(id(series))
        if hit is None or hit[0] is not series:  # the caller usually passes the same list every time
            hit = (series, _normalise(series))
            if len(self._norm) > 10_000:
                self._norm.clear()
            self._norm[id(series)] = hit
        w.append(Batch(hit[1], t, v))

    def flush(self) -> None:
        """Persist everything appended so far, now (the background thread does it every flush_interval)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush, stop the flush thread, release the directory. Idempotent; never raises: what could not be
        written is said in one log line."""
        if self._closed:
            return
        self._closed = True
        w = self._writer
        if self._thread is not None and w is not None:
            self._stop.set()
            w.wake.set()
            self._thread.join()
        if w is not None:
            try:
                w.flush()
            except Exception as e:  # noqa: BLE001 - flush() keeps its own failures; this is the last guard
                w._failed("close", e)
            if w.failing_since is not None:
                unsaved = sum(g.v.size for g in w._unstaged + w._unstaged_late)
                log.warning("store closed while it could not write (%s): %d samples and %d events were not written, "
                            "the last successful flush was %.1f s earlier", w.last_error, unsaved,
                            len(w._unsaved_events), w.clock() - w.last_ok)
            try:
                w.conn.close()
            except sqlite3.Error as e:
                log.warning("store closed, but closing its database failed: %s", _reason(e))
            self._writer = None
            if self._lock is not None:
                self._lock.release()
        self._reader.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -----------------------------------------------------------------------------------
    def series(self, metric: str | None = None, /, **label_filters: object) -> list[dict[str, Any]]:
        """Stored series as {'metric': name, 'labels': {...}}, filtered by metric and exact label values
        (any label name works as a filter, 'self' and 'metric' included)."""
        return [{"metric": m, "labels": lab} for _, m, lab in self._reader.find(metric, label_filters)]

    def metrics(self) -> list[str]:
        """Names of the stored metrics."""
        return self._reader.metrics()

    def labels(self) -> dict[str, list[str]]:
        """Every label name and its values across the stored series."""
        return self._reader.labels()

    def query(self, metric: str, start_ns: int, end_ns: int, step_s: float, agg: str = "mean",
              labels: dict[str, Any] | None = None) -> list[SeriesResult]:
        """One SeriesResult per matching series: `agg` (mean, max, min, last, count, sum, pXX) of the
        samples in each step bucket [start + i*step, start + (i+1)*step); empty buckets are left out.
        The tier follows the step (raw below 1 s, 1 s rollups below 1 min, 1 min below 1 h, else
        1 h) and retention: parts of the range a tier no longer holds come from the next coarser one.
        """
        return self._reader.query(metric, start_ns, end_ns, step_s, agg, labels)

    def latest(self) -> Snapshot | None:
        """The writer's last appended snapshot; for a reader, the last flushed values regrouped as one
        (cmdline and process type are not stored)."""
        if self._last is not None:
            return self._last
        return self._reader.latest()

    def node(self) -> dict[str, Any]:
        """{'hostname', 'simulated', 'gpus': [GpuIdentity, ...]} as last seen by the writer."""
        return self._reader.node()

    def events(self, start_ns: int, end_ns: int, kind: str | None = None, gpu: str | int | None = None) -> list[Event]:
        """Events with start_ns <= time_ns < end_ns, oldest first."""
        return self._reader.events(start_ns, end_ns, kind, gpu)

    def export(self, start_ns: int, end_ns: int, path: str | Path, fmt: str = "parquet",
               metrics: list[str] | None = None) -> int:
        """Write [start_ns, end_ns) to `path` as parquet (needs pyarrow), csv or jsonl; returns rows written."""
        return export(self._reader, start_ns, end_ns, path, fmt, metrics)

    def stats(self) -> dict[str, Any]:
        """Bytes, chunks and points per tier, samples, series, oldest/newest stamps; writer counters; health."""
        out = self._reader.stats()
        w = self._writer
        if w is not None:
            out["writer"] = {"pending": len(w.pending), "hot_window_samples": w.hot.values,
                             "dropped_snapshots": w.dropped_snapshots, "dropped_late_samples": w.dropped_late,
                             "dropped_unsealed_samples": w.dropped_memory, "late_samples": w.late_samples,
                             "flushes": w.flushes, "last_flush_seconds": w.last_flush_s}
        out["health"] = self.health()
        return out

    def health(self) -> dict[str, Any]:
        """Whether this store can write: {'healthy', 'reason' (one sentence, or None), 'last_flush_age_seconds',
        'failing_for_seconds', 'last_error' and 'last_error_at' (unix seconds; kept after a recovery),
        'write_errors', 'records_repaired' (text made valid), 'records_dropped' (records it could not store),
        'snapshots_dropped' (queue full), 'samples_dropped' (memory bound while writes failed),
        'late_samples' (stamped before the sealed block: kept), 'flush_thread_alive', 'flush_running_seconds'
        (None when idle), 'longest_flush_seconds' and 'memory_given_back_bytes' (heap handed back to the OS after seals)}. Unhealthy while writes fail, when no flush has completed
        for three flush intervals (plus 2 s) unless one is under way for less than BUSY_MAX_S (sealing a block of
        many series takes seconds; the samples wait in memory meanwhile), or when the flush thread is gone. A
        reader is healthy while it is open."""
        w = self._writer
        if w is None:
            if self.readonly and not self._closed:
                return {"healthy": True, "reason": None, "readonly": True}
            return {"healthy": False, "reason": "the store is closed"}
        return w.health(self._thread is not None and self._thread.is_alive())

    def self_metrics(self) -> dict[str, float]:
        """The store's health as the agent's own series on /metrics."""
        h = self.health()
        out = {"gpuscope_store_healthy": 1.0 if h["healthy"] else 0.0}
        if "write_errors" in h:
            out.update({
                "gpuscope_store_last_flush_age_seconds": float(h["last_flush_age_seconds"]),
                "gpuscope_store_write_errors_total": float(h["write_errors"]),
                "gpuscope_store_records_repaired_total": float(h["records_repaired"]),
                "gpuscope_store_records_dropped_total": float(h["records_dropped"] + h["snapshots_dropped"]),
                "gpuscope_store_samples_dropped_total": float(h["samples_dropped"]),
                "gpuscope_store_late_samples_total": float(h["late_samples"]),
            })
        return out


def _close_at_exit(ref: weakref.ref[Store]) -> None:
    store = ref()
    if store is not None:
        store.close()


def _normalise(series: Sequence[tuple[str, Mapping[str, str]] | str]) -> list[tuple[str, dict[str, str]]]:
    out = []
    for item in series:
        metric, labels = (item, {}) if isinstance(item, str) else item
        if not isinstance(metric, str) or not metric:
            raise StoreError(f"A series needs a metric name, got {metric!r}.")
        out.append((metric, {str(k): str(x) for k, x in labels.items()}))
    return out
