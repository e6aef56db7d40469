"""The Store facade: one writer per data directory, any number of readers."""

from __future__ import annotations

import atexit
import math
import threading
import weakref
from collections.abc import Mapping, Sequence
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
from ._writer import Batch, Writer


class Store:
    """The embedded time-series store of one node.

    A writer (`readonly=False`, one per directory; a second gets StoreLocked) buffers appended
    snapshots in memory and persists them from a background thread every `flush_interval` seconds;
    readers (`readonly=True`, any number, any process) see everything up to the writer's last flush.

        >>> import tempfile
        >>> from gpuscope import Sampler
        >>> with Store(tempfile.mkdtemp()) as store, Sampler(simulate="healthy") as s:
        ...     store.append(s.sample_once())
        ...     store.flush()
        ...     [r["labels"]["gpu"] for r in store.series("gpu_power_watts")]
        ['0']
    """

    def __init__(self, path: str | Path, *, readonly: bool = False, flush_interval: float = 1.0,
                 retention: Retention | None = None) -> None:
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
            self._writer = Writer(self.path, open_writer_db(self.path), self.retention)
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
        """Flush, stop the flush thread, release the directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._stop.set()
            self._writer.wake.set()  # type: ignore[union-attr]
            self._thread.join()
        if self._writer is not None:
            try:
                self._writer.flush()
            finally:
                self._writer.conn.close()
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
        """Bytes, chunks and points per tier, samples, series, oldest/newest stamps; writer counters."""
        out = self._reader.stats()
        w = self._writer
        if w is not None:
            out["writer"] = {"pending": len(w.pending), "hot_window_samples": w.hot.values,
                             "dropped_snapshots": w.dropped_snapshots, "dropped_late_samples": w.dropped_late,
                             "dropped_unsealed_samples": w.dropped_memory,
                             "flushes": w.flushes, "last_flush_seconds": w.last_flush_s}
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
