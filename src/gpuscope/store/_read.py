"""Reading: chunk decoding (skipping corrupt blocks), the consistent fetch of a range across tiers,
and the queries built on it. Every read runs in one SQLite read transaction, so it sees one commit
of the writer whole and never blocks it."""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from .._choices import did_you_mean
from .._records import Event, GpuIdentity, GpuRecord, HostRecord, ProcessRecord, Snapshot
from ..catalog import CATALOG, decode_clock_event_reasons, series_key
from ._aggregate import ALL, INF, Points, aggregate, needs, parse_agg, plan, preferred_tier
from ._codec import FloatArray, Int64Array, decode_chunk, decode_staging
from ._config import TIERS
from ._errors import CorruptChunk, QueryError
from ._ingest import PROCESS_METRICS, Group, HotWindow, Layout
from ._schema import DB_NAME

log = logging.getLogger("gpuscope.store")

MAX_POINTS = 100_000
ACTIVE_FILTER_OVER = 256  # a query matching more series first asks which have data in its range
SERIES_CACHE = 10_000  # parsed labels of this many series, per reader (about 5 MB)
Columns = dict[int, tuple[Int64Array, FloatArray]]
# (series ids, lo, hi) -> (raw watermark, columns with t >= max(lo, watermark)): the writer's hot window.
Tail = Callable[[set[int], int, int], tuple[int, Columns]]


@dataclass
class SeriesResult:
    """One series of a query: bucket start stamps (ns) and the aggregated values."""

    metric: str
    labels: dict[str, str]
    timestamps_ns: Int64Array = field(repr=False)
    values: FloatArray = field(repr=False)

    def __len__(self) -> int:
        return len(self.timestamps_ns)


class _LRU(OrderedDict[Any, Any]):
    """Bounded by entries and, for arrays, by their bytes; oldest insertion first out; safe to share between
    query threads."""

    def __init__(self, size: int, max_bytes: int | None = None) -> None:
        super().__init__()
        self.size = size
        self.max_bytes = max_bytes
        self.bytes = 0
        self.lock = threading.Lock()

    def put(self, key: Any, value: Any) -> None:
        with self.lock:
            old = self.pop(key, None)
            self.bytes += _nbytes(value) - _nbytes(old)
            self[key] = value
            while len(self) > self.size or (self.max_bytes is not None and self.bytes > self.max_bytes and len(self) > 1):
                _, gone = self.popitem(last=False)
                self.bytes -= _nbytes(gone)

    def clear(self) -> None:
        with self.lock:
            super().clear()
            self.bytes = 0


def _nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, tuple):
        return sum(int(v.nbytes) for v in value if isinstance(v, np.ndarray))
    return 0


TIMELINE_CACHE_BYTES = 16 << 20  # decoded time lines kept per decoder (a churning node has thousands of distinct ones)
STAGING_CACHE_BYTES = 16 << 20
_MISSING = object()


class ChunkDecoder:
    """Decodes chunks, time lines and staging rows; a corrupt one is skipped and logged once."""

    def __init__(self) -> None:
        self.timelines = _LRU(8192, TIMELINE_CACHE_BYTES)
        self.staging = _LRU(4096, STAGING_CACHE_BYTES)
        self._logged: set[tuple[str, int]] = set()
        self.corrupt = 0

    def bad(self, what: str, ident: int, err: Exception) -> None:
        self.corrupt += 1
        if (what, ident) not in self._logged:
            self._logged.add((what, ident))
            log.warning("skipping corrupt %s %d in the store (%s); the rest is served", what, ident, err)

    def load_timelines(self, conn: sqlite3.Connection, ids: set[int]) -> dict[int, Any]:
        """The decoded time lines `ids` (None for a corrupt one; absent when missing), for points(): the cache
        is bounded, so what one call needs is handed over whole rather than looked up in it again."""
        got: dict[int, Any] = {}
        missing = []
        for i in ids:
            t = self.timelines.get(i, _MISSING)
            if t is _MISSING:
                missing.append(i)
            else:
                got[i] = t
        for k in range(0, len(missing), 500):
            part = missing[k:k + 500]
            q = f"SELECT id, data FROM timelines WHERE id IN ({','.join('?' * len(part))})"
            for tid, blob in conn.execute(q, part):
                try:
                    got[tid] = decode_chunk(blob)[0]
                except CorruptChunk as e:
                    self.bad("time line", tid, e)
                    got[tid] = None
                self.timelines.put(tid, got[tid])
        return got

    def points(self, tier: int, chunk_id: int, tid: int, n: int, blob: bytes,
               need: tuple[bool, ...] = ALL, timelines: dict[int, Any] | None = None) -> Points | None:
        """A chunk as Points; rollup columns not in `need` are left as NaN placeholders. `timelines`: what
        load_timelines() returned for these chunks."""
        t = timelines.get(tid) if timelines is not None else self.timelines.get(tid)
        if t is None:
            self.bad("chunk (its time line is missing or corrupt)", chunk_id, CorruptChunk("no time line"))
            return None
        try:
            cols = decode_chunk(blob, None if tier == 0 else need)
            if len(t) != n or any(c is not None and len(c) != n for c in cols) or len(cols) != (1 if tier == 0 else 5):
                raise CorruptChunk("length mismatch")
        except CorruptChunk as e:
            self.bad("chunk", chunk_id, e)
            return None
        if tier == 0:
            return Points.raw(t, cols[0].astype(np.float64, copy=False))  # type: ignore[union-attr]
        nan = np.broadcast_to(np.float64(np.nan), (n,))
        cnt = cols[0] if cols[0] is not None else np.ones(n, dtype=np.int64)
        return Points(t, cnt, *(nan if c is None else c.astype(np.float64, copy=False) for c in cols[1:]))  # type: ignore[arg-type]

    def staging_rows(self, rid: int, blob: bytes, cache: bool = True) -> tuple[Int64Array, FloatArray] | None:
        hit = self.staging.get(rid)
        if hit is None:
            try:
                hit = decode_staging(blob)
            except CorruptChunk as e:
                self.bad("staging row", rid, e)
                return None
            if cache:
                self.staging.put(rid, hit)
        return hit


def _deletions(conn: sqlite3.Connection) -> str:
    """How many series the writer has deleted so far (changes whenever series or layouts go)."""
    row = conn.execute("SELECT value FROM meta WHERE key = 'series.deleted'").fetchone()
    return "0" if row is None else str(row[0])


def read_meta(conn: sqlite3.Connection) -> dict[str, str]:
    return dict(conn.execute("SELECT key, value FROM meta"))


def watermarks(meta: dict[str, str]) -> list[int]:
    return [int(meta.get(f"w.{t.index}", 0)) for t in TIERS]


def chunk_rows(conn: sqlite3.Connection, tier: int, sids: list[int], a: int, b: int) -> list[tuple[Any, ...]]:
    """Chunks of `sids` in `tier` that may hold stamps in [a, b)."""
    block = TIERS[tier].block_ns
    out: list[tuple[Any, ...]] = []
    for k in range(0, len(sids), 500):
        part = sids[k:k + 500]
        q = ("SELECT series_id, id, timeline, n, data FROM chunks INDEXED BY chunks_series WHERE series_id IN "
             f"({','.join('?' * len(part))}) AND tier = ? AND t_min >= ? AND t_min < ? AND t_max >= ? "
             "ORDER BY series_id, t_min")
        out.extend(conn.execute(q, (*part, tier, a - block, b, a)))
    return out


def oldest(conn: sqlite3.Connection, tier: int) -> int | None:
    row = conn.execute("SELECT MIN(t_min) FROM chunks WHERE tier = ?1 AND t_max < "
                       "(SELECT MIN(t_max) FROM chunks WHERE tier = ?1) + ?2", (tier, TIERS[tier].block_ns)).fetchone()
    return None if row[0] is None else int(row[0])


def as_ns(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise QueryError(f"{name} must be a time in integer nanoseconds since the epoch, got {v!r}.")
    return int(float(v)) if not isinstance(v, numbers.Integral) else int(v)


def check_range(start_ns: object, end_ns: object) -> tuple[int, int]:
    start, end = as_ns("start_ns", start_ns), as_ns("end_ns", end_ns)
    if start >= end:
        raise QueryError(f"The range is inverted or empty: start_ns {start} is not before end_ns {end}.")
    return start, end


class Reader:
    """Queries over a store directory; `tail` is the writer's in-memory hot window when it asks."""

    def __init__(self, path: Path, connect: Callable[[], sqlite3.Connection], tail: Tail | None = None) -> None:
        self.path = path
        self._connect = connect
        self._tail = tail
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self.decoder = ChunkDecoder()
        # Series are looked up in the store per query (a node that ran many jobs keeps millions); their
        # parsed labels are cached, bounded (ids are never reused, so an entry is never wrong). Layouts
        # are kept for the staging rows only, the ones not sealed yet.
        self._series: _LRU = _LRU(SERIES_CACHE)
        self._series_gen: str | None = None
        self._layouts: dict[int, Layout] = {}
        self._sid_layouts: dict[int, list[int]] = {}
        self._mirror = HotWindow()  # staging rows already read, per layout
        self._mirror_last: dict[int, int] = {}
        self._mirror_w0 = 0
        self._cache_lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        conn = self._conn()
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("COMMIT")

    def close(self) -> None:
        with self._conns_lock:
            for c in self._conns:
                c.close()
            self._conns.clear()
        self._local = threading.local()

    def _rows(self, conn: sqlite3.Connection, q: str, args: list[object]) -> list[tuple[int, str, dict[str, str]]]:
        """(id, metric, labels) of the series rows the query selects (id, metric, labels text)."""
        out = []
        cache = self._series
        gen = _deletions(conn)
        if gen != self._series_gen:  # the writer deleted series: no use keeping them
            cache.clear()
            self._series_gen = gen
        for sid, metric, text in conn.execute(q, args):
            lab = cache.get(sid)
            if lab is None:
                lab = json.loads(text)
                cache.put(sid, lab)
            out.append((sid, metric, lab))
        return out

    # -- catalogue ---------------------------------------------------------------------------------
    def find(self, metric: str | None, filters: dict[str, object]) -> list[tuple[int, str, dict[str, str]]]:
        want = {str(k): str(v) for k, v in filters.items()}
        q = "SELECT id, metric, labels FROM series WHERE 1"
        args: list[object] = []
        if metric is not None:
            q, args = q + " AND metric = ?", [metric]
        for k, v in want.items():  # a prefilter on the key (canonical: sorted labels, escaped); checked exactly below
            frag = series_key("x", **{k: v})[2:-1]
            q, args = q + " AND (instr(key, ?) > 0 OR instr(key, ?) > 0)", [*args, "{" + frag, "," + frag]
        with self.tx() as conn:
            rows = self._rows(conn, q, args)
            known = metric is None or bool(rows) or metric in CATALOG or conn.execute(
                "SELECT 1 FROM series WHERE metric = ? LIMIT 1", (metric,)).fetchone() is not None
        if not known:
            with self.tx() as conn:
                stored = [m for (m,) in conn.execute("SELECT DISTINCT metric FROM series")]
            hint = did_you_mean(str(metric), sorted(set(CATALOG) | set(stored)),
                                "the agent's /api/v1/series lists what is stored")
            raise QueryError(f"Unknown metric {metric!r}: it is neither in the catalog nor stored here ({hint}).")
        out = [(sid, m, lab) for sid, m, lab in rows if all(lab.get(k) == v for k, v in want.items())]
        return sorted(out, key=lambda r: (r[1], sorted(r[2].items())))

    def labels(self) -> dict[str, list[str]]:
        with self.tx() as conn:
            pairs = conn.execute("SELECT DISTINCT j.key, j.value FROM series, json_each(series.labels) AS j").fetchall()
        out: dict[str, set[str]] = {}
        for k, v in pairs:
            out.setdefault(str(k), set()).add(str(v))
        return {k: sorted(v, key=_natural) for k, v in sorted(out.items())}

    def metrics(self) -> list[str]:
        with self.tx() as conn:
            return [m for (m,) in conn.execute("SELECT DISTINCT metric FROM series ORDER BY metric")]

    # -- the range fetch ---------------------------------------------------------------------------
    def fetch(self, sids: list[int], start: int, end: int, pref: int,
              need: tuple[bool, ...] = ALL) -> dict[int, list[tuple[int, Points]]]:
        """Per series, the (tier, points) parts that cover [start, end), oldest first."""
        pre = self._tail(set(sids), start, end) if self._tail is not None else None
        out: dict[int, list[tuple[int, Points]]] = {s: [] for s in sids}
        with self.tx() as conn:
            meta = read_meta(conn)
            w = watermarks(meta)
            w0 = pre[0] if pre is not None else w[0]
            hi = [INF, min(w[1], w0), 0, 0]
            hi[2], hi[3] = min(w[2], hi[1]), min(w[3], w[2], hi[1])
            lows: list[int | None] = [int(meta.get(f"floor.{t.index}", 0)) for t in TIERS]
            for tier, a, b in plan(start, end, pref, lows, hi):
                if tier == 0:
                    if a < min(b, w0):
                        self._chunks(conn, 0, sids, a, min(b, w0), out, need)
                    if b > w0:
                        tail = pre[1] if pre is not None else self._staging(conn, set(sids), max(a, w0), b, w0)
                        for sid, (t, v) in tail.items():
                            p = Points.raw(t, v).select(max(a, w0), b)
                            if len(p):
                                out[sid].append((0, p))
                else:
                    self._chunks(conn, tier, sids, a, b, out, need)
        return out

    def _chunks(self, conn: sqlite3.Connection, tier: int, sids: list[int], a: int, b: int,
                out: dict[int, list[tuple[int, Points]]], need: tuple[bool, ...]) -> None:
        rows = chunk_rows(conn, tier, sids, a, b)
        tls = self.decoder.load_timelines(conn, {r[2] for r in rows})
        for sid, cid, tid, n, blob in rows:
            p = self.decoder.points(tier, cid, tid, n, blob, need, tls)
            if p is not None:
                p = p.select(a, b)
                if len(p):
                    out[sid].append((tier, p))

    def _staging(self, conn: sqlite3.Connection, sids: set[int], lo: int, hi: int, w0: int) -> Columns:
        """Unsealed rows of the layouts holding `sids`, mirrored in memory: each staging row is read
        and decoded once per reader, not once per query."""
        with self._cache_lock:
            staged = {lid for (lid,) in conn.execute("SELECT DISTINCT layout FROM staging WHERE t_max >= ?", (w0,))}
            if set(self._layouts) - staged:  # layouts whose rows were sealed: forget them
                self._layouts = {k: v for k, v in self._layouts.items() if k in staged}
                self._sid_layouts = {}
                for lay in self._layouts.values():
                    for s in lay.col:
                        self._sid_layouts.setdefault(s, []).append(lay.id)
                self._mirror_last = {k: v for k, v in self._mirror_last.items() if k in staged}
            new = sorted(staged - set(self._layouts))
            for k in range(0, len(new), 500):
                part = new[k:k + 500]
                for lid, blob in conn.execute(f"SELECT id, sids FROM layouts WHERE id IN ({','.join('?' * len(part))})",
                                              part):
                    lay = Layout(lid, np.frombuffer(blob, dtype=np.int64).copy())
                    self._layouts[lid] = lay
                    for s in lay.col:
                        self._sid_layouts.setdefault(s, []).append(lid)
            lids = {lid for s in sids for lid in self._sid_layouts.get(s, ())}
            mirror = self._mirror
            if w0 > self._mirror_w0:  # sealed rows go, with one block of slack for older snapshots
                mirror.trim(w0 - TIERS[0].block_ns)
                self._mirror_w0 = w0
            for lid in lids:
                last = self._mirror_last.get(lid, 0)
                for rid, blob in conn.execute("SELECT id, data FROM staging WHERE layout = ? AND id > ? ORDER BY id",
                                              (lid, last)):
                    self._mirror_last[lid] = rid
                    tv = self.decoder.staging_rows(rid, blob, cache=False)
                    if tv is None or tv[1].shape[1] != len(self._layouts[lid].sids):
                        continue
                    t, v = tv
                    keep = t >= w0 - TIERS[0].block_ns
                    if keep.any():
                        mirror.add(Group(self._layouts[lid], t[keep], v[keep]))
            return mirror.columns(max(lo, w0), hi, sids)

    # -- queries -----------------------------------------------------------------------------------
    def query(self, metric: str, start_ns: object, end_ns: object, step_s: object, agg: str = "mean",
              labels: dict[str, object] | None = None) -> list[SeriesResult]:
        if not isinstance(metric, str) or not metric:
            raise QueryError(f"metric must be a metric name, got {metric!r}.")
        start, end = check_range(start_ns, end_ns)
        if isinstance(step_s, bool) or not isinstance(step_s, numbers.Real) or not math.isfinite(float(step_s)) \
                or float(step_s) <= 0:
            raise QueryError(f"step_s must be a positive number of seconds, got {step_s!r}.")
        step_ns = max(1, round(float(step_s) * 1e9))
        span = end - start
        if step_ns > span:
            raise QueryError(f"The step ({float(step_s):g} s) is longer than the range ({span / 1e9:g} s); "
                             "use a step of at most the range.")
        points = -(-span // step_ns)
        if points > MAX_POINTS:
            raise QueryError(f"A {float(step_s):g} s step over {span / 1e9:g} s gives {points:,} points per series, "
                             f"more than the {MAX_POINTS:,} allowed; use a step of at least "
                             f"{span / MAX_POINTS / 1e9:.3g} s.")
        pct = parse_agg(agg)
        found = self.find(metric, dict(labels or {}))
        if len(found) > ACTIVE_FILTER_OVER:  # many series (processes that came and went): read only the ones with data here
            active = self._active([s for s, _, _ in found], start, end)
            found = [f for f in found if f[0] in active]
        if not found:
            return []
        data = self.fetch([s for s, _, _ in found], start, end, preferred_tier(step_ns, pct),
                          needs("mean" if pct is not None else agg))
        out = []
        for sid, m, lab in found:
            pts = Points.concat([p for _, p in data[sid]])
            if len(pts):
                ts, vals = aggregate(pts, start, step_ns, agg, pct)
                out.append(SeriesResult(m, dict(lab), ts, vals))
        return out

    def _active(self, sids: list[int], start: int, end: int) -> set[int]:
        """Which of `sids` may hold samples in [start, end): a chunk of any tier overlaps it, or rows not yet sealed
        (staging, late rows, the writer's hot window). A superset, never missing one."""
        want = set(sids)
        out: set[int] = set()
        with self.tx() as conn:
            for tier in TIERS:
                out.update(sid for (sid,) in conn.execute(
                    "SELECT DISTINCT series_id FROM chunks INDEXED BY chunks_age WHERE tier = ? AND t_max >= ? "
                    "AND t_min < ?", (tier.index, start, end)) if sid in want)
            for (blob,) in conn.execute("SELECT sids FROM layouts WHERE id IN (SELECT layout FROM staging WHERE "
                                        "t_max >= ? AND t_min < ? UNION SELECT layout FROM late)", (start, end)):
                out.update(s for s in np.frombuffer(blob, dtype=np.int64).tolist() if s in want)
        if self._tail is not None:
            out.update(self._tail(want - out, start, end)[1])
        return out

    def events(self, start_ns: object, end_ns: object, kind: str | None = None,
               gpu: object | None = None) -> list[Event]:
        start, end = check_range(start_ns, end_ns)
        q = "SELECT time_ns, kind, gpu, message, data, count FROM events WHERE time_ns >= ? AND time_ns < ?"
        args: list[object] = [start, end]
        if kind is not None:
            q, args = q + " AND kind = ?", [*args, kind]
        if gpu is not None:
            q, args = q + " AND gpu = ?", [*args, str(gpu)]
        with self.tx() as conn:
            rows = conn.execute(q + " ORDER BY time_ns, id", args).fetchall()
        return [Event(t, k, g, msg, json.loads(d), c) for t, k, g, msg, d, c in rows]

    def node(self) -> dict[str, Any]:
        """hostname, simulated (scenario or None) and the GPUs' identities as last seen."""
        with self.tx() as conn:
            raw = conn.execute("SELECT value FROM meta WHERE key = 'node'").fetchone()
        node = json.loads(raw[0]) if raw else {"hostname": "", "simulated": None, "gpus": []}
        node["gpus"] = [identity_from_dict(g) for g in node.get("gpus", [])]
        return node

    def latest(self) -> Snapshot | None:
        with self.tx() as conn:
            got = conn.execute("SELECT l.series_id, l.time_ns, l.value, s.metric, s.labels FROM latest AS l "
                               "JOIN series AS s ON s.id = l.series_id").fetchall()
        if not got:
            return None
        rows = [(sid, t, v) for sid, t, v, _, _ in got]
        series = {sid: (m, json.loads(lab)) for sid, _, _, m, lab in got}
        return snapshot_from_latest(rows, series, self.node())

    def stats(self) -> dict[str, Any]:
        tiers: dict[str, dict[str, Any]] = {}
        with self.tx() as conn:
            meta = read_meta(conn)
            w = watermarks(meta)
            tl = {t: (b, c) for t, b, c in conn.execute("SELECT tier, SUM(nbytes), COUNT(*) FROM timelines GROUP BY tier")}
            for t in TIERS:
                n, nbytes, pts, newest = conn.execute(
                    "SELECT COUNT(*), SUM(nbytes), SUM(n), MAX(t_max) FROM chunks WHERE tier = ?", (t.index,)).fetchone()
                tiers[t.name] = {"bytes": int(nbytes or 0) + int(tl.get(t.index, (0, 0))[0] or 0), "chunks": int(n),
                                 "points": int(pts or 0), "oldest_ns": oldest(conn, t.index),
                                 "newest_ns": None if newest is None else int(newest),
                                 "complete_to_ns": w[t.index] or None}
            srows, sbytes, ssamples, smin = conn.execute(
                "SELECT COUNT(*), SUM(LENGTH(data)), SUM(n), MIN(t_min) FROM staging WHERE t_max >= ?", (w[0],)).fetchone()
            nseries = conn.execute("SELECT COUNT(*) FROM series").fetchone()[0]
            nevents = conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        olds = [v["oldest_ns"] for v in tiers.values() if v["oldest_ns"] is not None] + ([smin] if smin else [])
        files = sum(os.path.getsize(self.path / n) for n in (DB_NAME, DB_NAME + "-wal")
                    if (self.path / n).exists())
        return {
            "path": str(self.path), "series": int(nseries), "events": int(nevents),
            "samples": tiers["raw"]["points"] + int(ssamples or 0),
            "oldest_ns": min(olds) if olds else None,
            "newest_ns": int(meta["newest"]) if "newest" in meta else None,
            "file_bytes": files, "tiers": tiers,
            "staging": {"rows": int(srows), "bytes": int(sbytes or 0), "samples": int(ssamples or 0)},
            "corrupt_blocks_skipped": self.decoder.corrupt,
        }


def _natural(v: str) -> tuple[int, int | str]:
    return (0, int(v)) if v.isdigit() else (1, v)


_ID_FIELDS = {f.name for f in fields(GpuIdentity)}


def identity_from_dict(d: dict[str, Any]) -> GpuIdentity:
    return GpuIdentity(**{k: v for k, v in d.items() if k in _ID_FIELDS})


def snapshot_from_latest(rows: list[tuple[int, int, float | None]], series: dict[int, tuple[str, dict[str, str]]],
                         node: dict[str, Any]) -> Snapshot:
    """The newest value of every series, regrouped as the snapshot that produced them. A GPU, process
    set or host contributes the series stamped with its newest time (what its last record held)."""
    ids = {g.label: g for g in node["gpus"]}
    gpus: dict[str, dict[str, tuple[int, float]]] = {}
    procs: dict[tuple[str, str, str, str], dict[str, tuple[int, float]]] = {}
    host: dict[str, tuple[int, float]] = {}
    for sid, t, v in rows:
        if sid not in series:
            continue
        metric, lab = series[sid]
        val = float("nan") if v is None else float(v)
        if "pid" in lab and metric in PROCESS_METRICS:
            procs.setdefault((lab.get("gpu", ""), lab["pid"], lab.get("process", ""), lab.get("user", "")), {})[metric] = (t, val)
        elif "gpu" in lab:
            own = {k: x for k, x in lab.items() if k not in ("gpu", "uuid")}
            gpus.setdefault(lab["gpu"], {})[series_key(metric, **own)] = (t, val)
        else:
            host[series_key(metric, **lab)] = (t, val)
    newest = max(t for _, t, _ in rows)
    records = []
    for label in sorted(gpus, key=_natural):
        vals = gpus[label]
        tmax = max(t for t, _ in vals.values())
        values = {k: v for k, (t, v) in vals.items() if t == tmax}
        ident = ids.get(label) or GpuIdentity(index=int(label) if label.isdigit() else -1, uuid="", name="")
        mask = values.get("gpu_clock_event_reasons")
        reasons = decode_clock_event_reasons(int(mask)) if mask is not None and math.isfinite(mask) else []
        records.append(GpuRecord(ident, tmax, values, values.get("gpu_healthy", 1.0) != 0.0, reasons))
    ptime = max((t for d in procs.values() for t, _ in d.values()), default=None)
    processes = []
    for (g, pid, name, user), d in sorted(procs.items(), key=lambda kv: (_natural(kv[0][0]), int(kv[0][1]))):
        if max(t for t, _ in d.values()) != ptime:
            continue
        kw: dict[str, Any] = {PROCESS_METRICS[m]: v for m, (_, v) in d.items()}
        for count in ("threads", "threads_busy"):
            if count in kw and math.isfinite(kw[count]):
                kw[count] = int(kw[count])
        uuid = ids[g].uuid if g in ids else ""
        processes.append(ProcessRecord(pid=int(pid), gpu=g, gpu_uuid=uuid, type="", name=name, user=user, **kw))
    hrec = None
    if host:
        htime = max(t for t, _ in host.values())
        hrec = HostRecord(htime, {k: v for k, (t, v) in host.items() if t == htime})
    return Snapshot(newest, records, processes, hrec, [], node.get("simulated"), node.get("hostname", ""))


__all__ = ["Reader", "SeriesResult"]
