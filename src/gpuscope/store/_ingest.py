"""From snapshots to columns: series identity, layouts, and the in-memory hot window.

A *layout* is an ordered set of series that arrive together with one time stamp (one GPU's values,
one process's numbers, the host). A snapshot becomes one row per layout, so ingest costs a tuple of
the keys, a dict lookup and a list of the values per GPU; the split into per-series columns happens
in bulk with numpy when a block is sealed.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .._records import Event, GpuIdentity, ProcessRecord, Snapshot
from .._text import valid_text
from ..catalog import PROCESS_SERIES, series_key, split_series_key
from ._codec import FloatArray, Int64Array, scale_for

PROCESS_METRICS = {name: attr for attr, name in PROCESS_SERIES}


def canonical_key(metric: str, labels: Mapping[str, str]) -> str:
    """metric{a="1",b="2"} with labels sorted by name: the identity of a series."""
    return series_key(metric, **{k: labels[k] for k in sorted(labels)})


@dataclass
class Layout:
    id: int
    sids: Int64Array
    col: dict[int, int] = field(default_factory=dict)  # series id -> column

    def __post_init__(self) -> None:
        self.col = {int(s): j for j, s in enumerate(self.sids)}


@dataclass
class Group:
    """Rows of one layout: times (n,) and values (n, k)."""

    layout: Layout
    t: Int64Array
    v: FloatArray


class Registry:
    """The series and layouts the writer is using now; new ones are inserted with the next flush's transaction.

    Only the working set is held in memory: the series of the layouts that rows arrived for lately (the hot
    window, the late rows, staging). `park()` lets go of the rest after each seal; they stay in the store,
    queryable, and a key seen again is found there (`series_id` looks it up by key), so a node that runs
    thousands of short jobs keeps memory flat while its store keeps their history for the retention.

    Retention deletes the series whose data is gone everywhere and `evict()`s them here, so a key seen again
    later gets a new id. Ids are never reused: the next free ids are kept in `meta` ('series.next',
    'layouts.next'), since max(id) + 1 would hand a deleted id out again after a restart, to readers that may
    still have it cached."""

    def __init__(self) -> None:
        self.by_key: dict[str, int] = {}
        self.key: dict[int, str] = {}
        self.metric: dict[int, str] = {}
        self.labels: dict[int, dict[str, str]] = {}
        self.scale: dict[int, float | None] = {}
        self.layout_by_sids: dict[tuple[int, ...], Layout] = {}
        self.layouts: dict[int, Layout] = {}
        self.sid_layouts: dict[int, set[int]] = {}  # series id -> ids of the layouts holding it
        self.new_series: list[tuple[int, str, str, str]] = []
        self.repaired = 0  # series whose metric or labels were not valid text
        self.new_layouts: list[Layout] = []
        self.found = 0  # series found in the store again after they were parked
        self.parked = 0  # series let go from memory (still stored)
        self._conn: sqlite3.Connection | None = None
        self._next_sid = 1
        self._next_layout = 1

    def load(self, conn: sqlite3.Connection) -> None:
        """The layouts that unsealed rows (staging, late) use, and their series; the next free ids."""
        self._conn = conn
        lids = [lid for (lid,) in conn.execute("SELECT DISTINCT layout FROM staging UNION SELECT DISTINCT layout FROM late")]
        for part in _batches(lids):
            q = f"SELECT id, sids FROM layouts WHERE id IN ({','.join('?' * len(part))})"
            for lid, blob in conn.execute(q, part):
                self._add_layout(Layout(lid, np.frombuffer(blob, dtype=np.int64).copy()))
        for part in _batches(sorted(self.sid_layouts)):
            q = f"SELECT id, key, metric, labels FROM series WHERE id IN ({','.join('?' * len(part))})"
            for sid, key, metric, labels in conn.execute(q, part):
                self._remember(sid, key, metric, json.loads(labels))
        meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('series.next', 'layouts.next')"))
        top_sid = conn.execute("SELECT MAX(id) FROM series").fetchone()[0] or 0
        top_layout = conn.execute("SELECT MAX(id) FROM layouts").fetchone()[0] or 0
        self._next_sid = max(int(top_sid) + 1, int(meta.get("series.next", 1)))
        self._next_layout = max(int(top_layout) + 1, int(meta.get("layouts.next", 1)))

    def next_ids(self) -> tuple[int, int]:
        """The next series and layout ids: persisted with deletions so that no id is handed out twice."""
        return self._next_sid, self._next_layout

    def _remember(self, sid: int, key: str, metric: str, labels: dict[str, str]) -> None:
        self.by_key[key] = sid
        self.key[sid] = key
        self.metric[sid] = metric
        self.labels[sid] = labels
        self.scale[sid] = scale_for(metric)

    def _stored(self, key: str) -> int | None:
        """The id of a stored series with this key that is not in memory (parked), made resident again."""
        if self._conn is None:
            return None
        row = self._conn.execute("SELECT id, metric, labels FROM series WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        self._remember(int(row[0]), key, row[1], json.loads(row[2]))
        self.found += 1
        return int(row[0])

    def series_id(self, metric: str, labels: Mapping[str, str]) -> int:
        labels = {str(k): str(v) for k, v in labels.items()}
        key = canonical_key(metric, labels)
        sid = self.by_key.get(key)
        if sid is None:
            if valid_text(key) is not key:  # text SQLite cannot encode (a surrogate): stored valid, counted
                metric = valid_text(metric)
                labels = {valid_text(k): valid_text(v) for k, v in labels.items()}
                key = canonical_key(metric, labels)
                sid = self.by_key.get(key)
                if sid is not None:
                    return sid
                self.repaired += 1
            sid = self._stored(key)
            if sid is not None:
                return sid
            sid = self._next_sid
            self._next_sid += 1
            self._remember(sid, key, metric, labels)
            self.new_series.append((sid, key, metric, json.dumps(labels, sort_keys=True)))
        return sid

    def layout(self, sids: Sequence[int]) -> Layout:
        key = tuple(sids)
        lay = self.layout_by_sids.get(key)
        if lay is None:
            lid = self._next_layout
            self._next_layout += 1
            lay = Layout(lid, np.array(key, dtype=np.int64))
            self._add_layout(lay)
            self.new_layouts.append(lay)
        return lay

    def _add_layout(self, lay: Layout) -> None:
        self.layouts[lay.id] = lay
        self.layout_by_sids[tuple(int(s) for s in lay.sids)] = lay
        for s in lay.col:
            self.sid_layouts.setdefault(s, set()).add(lay.id)

    def layouts_of(self, sids: Iterable[int]) -> set[int]:
        """Ids of the layouts in memory that hold any of `sids`."""
        return {lid for s in sids for lid in self.sid_layouts.get(s, ())}

    def scales(self, sids: Sequence[int]) -> list[float | None]:
        """The encoding scale of each series, also of those not in memory (rollups of series long parked)."""
        got = self.scale
        missing = [s for s in sids if s not in got]
        if not missing or self._conn is None:
            return [got.get(s) for s in sids]
        found: dict[int, float | None] = {}
        for part in _batches(missing):
            q = f"SELECT id, metric FROM series WHERE id IN ({','.join('?' * len(part))})"
            found.update((int(sid), scale_for(metric)) for sid, metric in self._conn.execute(q, part))
        return [got[s] if s in got else found.get(s) for s in sids]

    def park(self, keep: set[int]) -> set[int]:
        """Let go of every layout not in `keep` and every series no kept layout holds (nor about to be
        inserted); they stay stored. Returns the ids of the layouts let go."""
        gone = set(self.layouts) - keep - {lay.id for lay in self.new_layouts}
        if not gone:
            return set()
        pending = {s for s, *_ in self.new_series}
        for lid in gone:
            self._forget_layout(lid)
        idle = [sid for sid in self.metric if sid not in self.sid_layouts and sid not in pending]
        self._forget_series(idle)
        self.parked += len(idle)
        return gone

    def evict(self, sids: Iterable[int], lids: Iterable[int]) -> None:
        """Forget deleted series and layouts (after the deleting transaction committed)."""
        for lid in lids:
            self._forget_layout(lid)
        self._forget_series(sids)

    def _forget_layout(self, lid: int) -> None:
        lay = self.layouts.pop(lid, None)
        if lay is None:
            return
        shape = tuple(int(s) for s in lay.sids)
        if self.layout_by_sids.get(shape) is lay:
            del self.layout_by_sids[shape]
        for s in lay.col:
            held = self.sid_layouts.get(s)
            if held is not None:
                held.discard(lid)
                if not held:
                    del self.sid_layouts[s]

    def _forget_series(self, sids: Iterable[int]) -> None:
        for sid in sids:
            key = self.key.pop(sid, None)
            if key is not None and self.by_key.get(key) == sid:
                del self.by_key[key]
            self.metric.pop(sid, None)
            self.labels.pop(sid, None)
            self.scale.pop(sid, None)
            self.sid_layouts.pop(sid, None)

    def persist(self, conn: sqlite3.Connection) -> None:
        """Insert what is new (inside the caller's transaction); call committed() after COMMIT."""
        if self.new_series:
            conn.executemany("INSERT OR IGNORE INTO series (id, key, metric, labels) VALUES (?, ?, ?, ?)",
                             self.new_series)
        if self.new_layouts:
            conn.executemany("INSERT OR IGNORE INTO layouts (id, sids) VALUES (?, ?)",
                             [(lay.id, lay.sids.tobytes()) for lay in self.new_layouts])

    def committed(self) -> None:
        self.new_series.clear()
        self.new_layouts.clear()


def _batches(ids: Sequence[int], n: int = 500) -> list[list[int]]:
    """`ids` in lists short enough for one IN (...) of bound parameters."""
    ids = list(ids)
    return [ids[i:i + n] for i in range(0, len(ids), n)]


class Decomposer:
    """Turns snapshots into rows per layout. Runs on the flush thread, never on the sampler's."""

    def __init__(self, registry: Registry) -> None:
        self.reg = registry
        self._gpu: dict[tuple[str, str], tuple[tuple[str, ...], Layout]] = {}  # last shape per GPU
        self._gpu_shapes: dict[tuple[tuple[str, str], tuple[str, ...]], Layout] = {}  # every shape seen
        self._host: tuple[tuple[str, ...], Layout] | None = None
        self._proc: dict[tuple[object, ...], Layout] = {}
        self._last_procs: list[ProcessRecord] = []
        self._last_host: object = None
        self._seen_ids: dict[tuple[str, str], GpuIdentity] = {}
        self.identities: dict[str, GpuIdentity] = {}  # by label, for the node metadata
        self.node_changed = False
        self.hostname = ""
        self.simulated: str | None = None

    def decompose(self, snaps: Iterable[Snapshot], events: list[Event]) -> list[Group]:
        rows: dict[int, tuple[Layout, list[int], list[list[float]]]] = {}
        for snap in snaps:
            if snap.hostname != self.hostname or snap.simulated != self.simulated:
                self.hostname, self.simulated, self.node_changed = snap.hostname, snap.simulated, True
            for g in snap.gpus:
                ident = g.identity
                ck = (ident.uuid, ident.label)
                values = g.values
                keys = tuple(values)
                ent = self._gpu.get(ck)
                if ent is None or ent[0] != keys:
                    lay = self._gpu_shapes.get((ck, keys))
                    if lay is None:
                        if len(self._gpu_shapes) > 1000:
                            self._gpu_shapes.clear()
                        lay = self._gpu_shapes[(ck, keys)] = self._gpu_layout(ident, keys)
                    ent = self._gpu[ck] = (keys, lay)
                if self._seen_ids.get(ck) is not ident:
                    self._note_identity(ck, ident)
                lay = ent[1]
                r = rows.get(lay.id)
                if r is None:
                    r = rows[lay.id] = (lay, [], [])
                r[1].append(g.time_ns)
                r[2].append(list(values.values()))
            procs = snap.processes
            if procs and not (len(procs) == len(self._last_procs)
                              and all(a is b for a, b in zip(procs, self._last_procs, strict=True))):
                self._last_procs = procs
                for p in procs:
                    self._add_process(p, snap.time_ns, rows)
            host = snap.host
            if host is not None and host is not self._last_host and host.values:
                self._last_host = host
                keys = tuple(host.values)
                if self._host is None or self._host[0] != keys:
                    self._host = (keys, self.reg.layout([self.reg.series_id(*split_series_key(k)) for k in keys]))
                lay = self._host[1]
                r = rows.get(lay.id) or rows.setdefault(lay.id, (lay, [], []))
                r[1].append(host.time_ns)
                r[2].append(list(host.values.values()))
            if snap.events:
                events.extend(snap.events)
        return [Group(lay, np.array(ts, dtype=np.int64), _matrix(vs, len(lay.sids))) for lay, ts, vs in rows.values()]

    def forget(self, lids: set[int]) -> None:
        """Drop cached layouts that retention deleted: the next snapshot builds them anew."""
        if not lids:
            return
        self._gpu = {k: v for k, v in self._gpu.items() if v[1].id not in lids}
        self._gpu_shapes = {k: v for k, v in self._gpu_shapes.items() if v.id not in lids}
        if self._host is not None and self._host[1].id in lids:
            self._host = None
        self._proc = {k: v for k, v in self._proc.items() if v.id not in lids}

    def _gpu_layout(self, ident: GpuIdentity, keys: tuple[str, ...]) -> Layout:
        sids = []
        for k in keys:
            metric, own = split_series_key(k)
            sids.append(self.reg.series_id(metric, {**own, "gpu": ident.label, "uuid": ident.uuid}))
        return self.reg.layout(sids)

    def _note_identity(self, ck: tuple[str, str], ident: GpuIdentity) -> None:
        self._seen_ids[ck] = ident
        old = self.identities.get(ident.label)
        if old != ident:
            self.identities[ident.label] = ident
            self.node_changed = True

    def _add_process(self, p: ProcessRecord, t: int,
                     rows: dict[int, tuple[Layout, list[int], list[list[float]]]]) -> None:
        vals = [getattr(p, attr) for attr, _ in PROCESS_SERIES]
        mask = tuple(v is not None for v in vals)
        if not any(mask):
            return
        ck = (p.gpu, p.pid, p.name, p.user, mask)
        lay = self._proc.get(ck)
        if lay is None:
            labels = {"gpu": p.gpu, "pid": str(p.pid), "process": p.name, "user": p.user}
            lay = self.reg.layout([self.reg.series_id(name, labels)
                                   for (_, name), m in zip(PROCESS_SERIES, mask, strict=True) if m])
            if len(self._proc) > 10_000:  # pids churn; forget old shapes, they are rebuilt on demand
                self._proc.clear()
            self._proc[ck] = lay
        r = rows.get(lay.id) or rows.setdefault(lay.id, (lay, [], []))
        r[1].append(t)
        r[2].append([float(v) for v in vals if v is not None])


def _matrix(rows: list[list[float]], k: int) -> FloatArray:
    try:
        return np.array(rows, dtype=np.float64).reshape(len(rows), k)
    except (TypeError, ValueError):  # a None or a string among the values: keep the rest
        return np.array([[_num(x) for x in r] for r in rows], dtype=np.float64).reshape(len(rows), k)


def _num(x: object) -> float:
    try:
        return float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return float("nan")


class _Buf:
    """Rows of one layout in a growable array; rows before `lo` are trimmed."""

    __slots__ = ("layout", "t", "v", "lo", "hi", "ordered")

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.t: Int64Array = np.empty(0, dtype=np.int64)
        self.v: FloatArray = np.empty((0, len(layout.sids)))
        self.lo = self.hi = 0
        self.ordered = True

    def append(self, t: Int64Array, v: FloatArray) -> None:
        n = len(t)
        if self.hi + n > len(self.t):
            live = self.hi - self.lo
            cap = max(64, 2 * (live + n))
            nt, nv = np.empty(cap, dtype=np.int64), np.empty((cap, self.v.shape[1]))
            nt[:live], nv[:live] = self.t[self.lo:self.hi], self.v[self.lo:self.hi]
            self.t, self.v, self.lo, self.hi = nt, nv, 0, live
        if self.ordered and n and ((self.hi > self.lo and t[0] < self.t[self.hi - 1]) or bool((np.diff(t) < 0).any())):
            self.ordered = False
        self.t[self.hi:self.hi + n] = t
        self.v[self.hi:self.hi + n] = v
        self.hi += n

    def rows(self, lo: int, hi: int) -> tuple[Int64Array, FloatArray]:
        t, v = self.t[self.lo:self.hi], self.v[self.lo:self.hi]
        if self.ordered:
            a, b = np.searchsorted(t, [lo, hi])
            return t[a:b], v[a:b]
        m = (t >= lo) & (t < hi)
        return t[m], v[m]

    def trim(self, before: int) -> int:
        """Drop rows older than `before`; returns how many values went."""
        t = self.t[self.lo:self.hi]
        if self.ordered:
            drop = int(np.searchsorted(t, before))
            self.lo += drop
            return drop * int(self.v.shape[1])
        keep = t >= before
        drop = int(len(t) - keep.sum())
        if drop:
            kt, kv = t[keep], self.v[self.lo:self.hi][keep]
            self.t, self.v, self.lo, self.hi = kt.copy(), kv.copy(), 0, len(kt)
            self.ordered = bool((np.diff(self.t) >= 0).all())
        return drop * int(self.v.shape[1])

    def __len__(self) -> int:
        return self.hi - self.lo


class HotWindow:
    """The recent samples at full rate, in memory, grouped by layout. Holds at least everything not
    yet sealed into chunks; older rows go once they are sealed and older than the window."""

    def __init__(self) -> None:
        self.bufs: dict[int, _Buf] = {}
        self.values = 0  # samples held

    def add(self, g: Group) -> None:
        buf = self.bufs.get(g.layout.id)
        if buf is None:
            buf = self.bufs[g.layout.id] = _Buf(g.layout)
        buf.append(g.t, g.v)
        self.values += g.v.size

    def columns(self, lo: int, hi: int, sids: set[int] | None = None) -> dict[int, tuple[Int64Array, FloatArray]]:
        """Per series: (times, values) with lo <= t < hi, sorted by time. Copies."""
        pieces: dict[int, list[tuple[Int64Array, FloatArray]]] = {}
        for buf in self.bufs.values():
            if not len(buf):
                continue
            cols = buf.layout.col if sids is None else {s: buf.layout.col[s] for s in sids if s in buf.layout.col}
            if not cols:
                continue
            t, v = buf.rows(lo, hi)
            if not len(t):
                continue
            for sid, j in cols.items():
                pieces.setdefault(sid, []).append((t, v[:, j]))
        return {sid: merge_pieces(p) for sid, p in pieces.items()}

    def count_since(self, since: int) -> int:
        """Samples held with t >= since."""
        return sum(len(buf.rows(since, 2**63 - 1)[0]) * len(buf.layout.sids) for buf in self.bufs.values())

    def oldest(self) -> int | None:
        ts = [int(b.t[b.lo:b.hi].min()) for b in self.bufs.values() if len(b)]
        return min(ts) if ts else None

    def drop(self, lids: set[int]) -> None:
        """Forget the rows of these layouts."""
        for lid in lids:
            buf = self.bufs.pop(lid, None)
            if buf is not None:
                self.values -= len(buf) * int(buf.v.shape[1])

    def trim(self, before: int) -> None:
        gone = []
        for lid, buf in self.bufs.items():
            if buf.ordered and buf.hi > buf.lo and buf.t[buf.lo] >= before:
                continue  # nothing that old (most layouts, most flushes): no search
            self.values -= buf.trim(before)
            if not len(buf):
                gone.append(lid)
        for lid in gone:
            del self.bufs[lid]


def merge_pieces(pieces: list[tuple[Int64Array, FloatArray]]) -> tuple[Int64Array, FloatArray]:
    """Concatenate (t, v) pieces into one time-sorted pair (stable: equal stamps keep arrival order)."""
    if len(pieces) == 1:
        t, v = pieces[0]
        t, v = t.copy(), np.ascontiguousarray(v)
    else:
        t = np.concatenate([p[0] for p in pieces])
        v = np.concatenate([p[1] for p in pieces])
    if len(t) > 1 and (np.diff(t) < 0).any():
        order = np.argsort(t, kind="stable")
        t, v = t[order], v[order]
    return t, v
