"""The writer: buffers snapshots, and on each flush (its own thread, every `flush_interval`) commits
them in one SQLite transaction. Rows newer than the seal point go to `staging`, raw and 1 s chunks
are sealed per 10-minute block once the clock passes its end (plus a grace for late rows), the 1 min
and 1 h rollups are computed from the tier below when their block completes, and retention runs
after each seal. Watermarks in `meta` say how far each tier is complete; they move in the same
transaction as the data, so a crash at any instant leaves a consistent store.

Retention also deletes the series whose data it removed last (no chunk in any tier, no staging row,
nothing in the hot window: a process that ended long ago) and their `latest` rows, in the same
transaction; 'series.deleted' in `meta` counts the deleted series, so readers know to drop them from
their caches. After it, the writer lets go of the series and layouts no row in memory needs (a process
that ended more than the hot window ago): memory follows the series in use, while the store keeps every
series' history for its retention (see Registry)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .._heap import give_back
from .._records import Event, Snapshot
from .._text import valid_text
from ._aggregate import INF, Points, rollup, rollup_rows
from ._codec import FloatArray, Int64Array, decode_staging, encode_chunk, encode_chunks, encode_staging
from ._config import SECOND_NS, TIERS, Retention
from ._errors import CorruptChunk, StoreError
from ._ingest import PROCESS_METRICS, Decomposer, Group, HotWindow, Layout, Registry
from ._read import ChunkDecoder, Columns, identity_from_dict, oldest, read_meta, watermarks
from ._schema import DB_NAME

log = logging.getLogger("gpuscope.store")

INT64 = (-(2**63), 2**63 - 1)
RETRY_MAX_GROUPS = 10_000  # rows kept for the next flush while writes fail (they are in memory meanwhile)
REMIND_S = 60.0  # while writes keep failing, one reminder line a minute
CLOCK_SLACK_NS = 60 * 1_000_000_000  # stamps this close to the store's clock are 'now'
ROLL_BATCH = 500  # series rolled up together (one IN (...) of bound parameters)
BUSY_MAX_S = 120.0  # a flush running longer than this (sealing, retention) is stuck, not busy
REANCHOR_S = 3600.0  # stamps ahead of the store's clock for this long: the host clock was behind, follow it


class Batch:
    """Rows for several series sharing time stamps, handed over by append_batch()."""

    __slots__ = ("series", "t", "v")

    def __init__(self, series: list[tuple[str, dict[str, str]]], t: Int64Array, v: FloatArray) -> None:
        self.series, self.t, self.v = series, t, v


class Writer:
    def __init__(self, path: Path, conn: sqlite3.Connection, retention: Retention, *, hot_window_s: float = 600.0,
                 hot_max_samples: int = 4_000_000, grace_s: float = 2.0, max_pending: int = 20_000,
                 clock: Callable[[], float] = time.monotonic, wall_clock_ns: Callable[[], int] = time.time_ns,
                 stale_after_s: float = 5.0) -> None:
        self.path = path
        self.conn = conn
        self.retention = retention
        self.hot_window_ns = int(hot_window_s * 1e9)
        self.hot_max = hot_max_samples
        self.grace_ns = int(grace_s * 1e9)
        self.reg = Registry()
        self.reg.load(conn)
        self.dec = Decomposer(self.reg)
        self.hot = HotWindow()
        self.decoder = ChunkDecoder()
        self.lock = threading.Lock()  # hot window and raw watermark, as queries in this process see them
        self.flush_lock = threading.Lock()
        self.pending: deque[Snapshot | Batch] = deque(maxlen=max_pending)
        self.wake = threading.Event()
        self.dropped_snapshots = 0
        self.dropped_late = 0
        self.dropped_memory = 0
        self.flushes = 0
        self.last_flush_s = 0.0
        # health: what failed, when, and since when nothing could be written
        self.clock = clock
        self.stale_after_s = stale_after_s
        self.last_ok = clock()  # monotonic seconds of the last committed flush
        self.failing_since: float | None = None  # monotonic seconds of the first failure since then
        self.flushing_since: float | None = None  # monotonic seconds the flush under way started
        self.longest_flush_s = 0.0
        self.failed_flushes = 0  # in the current episode
        self.write_errors = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None  # unix seconds
        self._last_line: tuple[str, float] | None = None  # the last failure line logged, and when
        self.records_dropped = 0
        self.trimmed_bytes = 0  # heap given back to the OS after seals (malloc_trim), as RSS fell
        self._events_repaired = 0
        self.late_samples = 0  # stamped before the sealed block end (the clock stepped back): kept
        self.late = HotWindow()  # those rows until their block is written
        self._unstaged: list[Group] = []  # rows whose staging write failed: retried next flush
        self._unstaged_late: list[Group] = []
        self._late_seen: int | None = None  # newest late stamp of the current flush
        self._errors: set[str] = set()
        self._dropped_lines: dict[str, float] = {}
        # The store's own idea of now: the wall clock when it opened, moved on by the monotonic clock. A clock
        # that jumps ahead and back must not make retention delete what is not old yet (see _retention_now).
        self._wall0, self._mono0 = int(wall_clock_ns()), clock()
        self.db_path = path / DB_NAME
        self._file_id = _file_id(self.db_path)
        self._live = False  # stamps have been close to the store's clock: a live sampler feeds it
        self._ahead_since: float | None = None
        self._unsaved_events: list[EventRow] = []  # rows of events whose write failed: retried next flush
        self._batch_layouts: dict[int, tuple[object, Layout]] = {}  # by id() of the caller's series list
        self._tl_cache: dict[tuple[int, bytes], int] = {}  # committed time lines
        self._tl_new: dict[tuple[int, bytes], int] = {}  # inserted by the open transaction
        self._bytes_new = [0] * len(TIERS)
        self._dropped_sids: set[int] = set()  # series that lost chunks in the open retention transaction
        self._swept = False  # the first retention checks every series (stores written before deletion existed)
        meta = read_meta(conn)
        self.deleted_series = int(meta.get("series.deleted", 0))
        self.w = watermarks(meta)
        self.newest: int | None = int(meta["newest"]) if "newest" in meta else None
        self.tier_bytes = [0] * len(TIERS)
        for table in ("chunks", "timelines"):
            for tier, b in conn.execute(f"SELECT tier, SUM(nbytes) FROM {table} GROUP BY tier"):
                self.tier_bytes[tier] += int(b or 0)
        self._load_node(meta)
        self._load_staging()
        self.last_ok = clock()

    # -- start-up ----------------------------------------------------------------------------------
    def _load_node(self, meta: dict[str, str]) -> None:
        if "node" in meta:
            node = json.loads(meta["node"])
            self.dec.hostname, self.dec.simulated = node.get("hostname", ""), node.get("simulated")
            for d in node.get("gpus", []):
                ident = identity_from_dict(d)
                self.dec.identities[ident.label] = ident

    def _load_staging(self) -> None:
        """Rows flushed but not yet sealed (after a restart or a crash) go back into the hot window."""
        for rid, lid, blob in self.conn.execute(
                "SELECT id, layout, data FROM staging WHERE t_max >= ? ORDER BY id", (self.w[0],)).fetchall():
            lay = self.reg.layouts.get(lid)
            try:
                t, v = decode_staging(blob)
            except CorruptChunk as e:
                self.decoder.bad("staging row", rid, e)
                continue
            if lay is None or v.shape[1] != len(lay.sids):
                continue
            m = t >= self.w[0]
            self.hot.add(Group(lay, t[m].copy(), v[m].copy()))
        for rid, lid, blob in self.conn.execute("SELECT id, layout, data FROM late ORDER BY id").fetchall():
            lay = self.reg.layouts.get(lid)
            try:
                t, v = decode_staging(blob)
            except CorruptChunk as e:
                self.decoder.bad("late staging row", rid, e)
                continue
            if lay is not None and v.shape[1] == len(lay.sids):
                self.late.add(Group(lay, t, v))

    # -- the hot path ------------------------------------------------------------------------------
    def append(self, item: Snapshot | Batch) -> None:
        q = self.pending
        if len(q) == q.maxlen:
            self.dropped_snapshots += 1  # the deque drops the oldest; the flush thread is stuck
        q.append(item)
        if len(q) >= 512:
            self.wake.set()

    def tail(self, sids: set[int], lo: int, hi: int) -> tuple[int, Columns]:
        with self.lock:
            w0 = self.w[0]
            return w0, self.hot.columns(max(lo, w0), hi, sids)

    # -- flushing ----------------------------------------------------------------------------------
    def flush(self) -> None:
        """Commit everything queued so far (in slices, to bound the memory a burst takes)."""
        with self.flush_lock:
            self.flushing_since = self.clock()
            try:
                left = len(self.pending)
                while True:
                    n = min(left, 2048)
                    left -= n
                    self._flush_slice([self.pending.popleft() for _ in range(n)])
                    if left <= 0:
                        break
            finally:
                self.longest_flush_s = max(self.longest_flush_s, self.clock() - self.flushing_since)
                self.flushing_since = None

    def _flush_slice(self, items: list[Snapshot | Batch]) -> None:
        t0 = time.perf_counter()
        events: list[Event] = []
        self._late_seen = None
        groups, late = self._groups(items, events)
        with self.lock:
            for g in groups:
                self.hot.add(g)
            self._bound_memory()
        for g in late:
            self.late.add(g)
        stage, stage_late = self._unstaged + groups, self._unstaged_late + late
        self._unstaged, self._unstaged_late = [], []
        event_rows = self._unsaved_events + self._event_rows(events)
        self._unsaved_events = []
        nw = list(self.w)
        target = self._seal_target()
        late_cut = self._late_cut()
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            self.reg.persist(conn)
            self._stage(stage, max(target, nw[0]))
            self._stage_late(stage_late)
            if target > nw[0]:
                self._seal(nw[0], target)
                nw[0] = nw[1] = target
                self._cascade(nw)
            if late_cut is not None:
                self._seal_late(late_cut, nw)
            if event_rows:
                conn.executemany("INSERT INTO events (time_ns, kind, gpu, message, data, count) "
                                 "VALUES (?, ?, ?, ?, ?, ?)", event_rows)
            self._meta(groups + late)
            conn.execute("COMMIT")
        except Exception as e:  # noqa: BLE001 - whatever failed, the rows wait in memory for the next flush
            self._rollback()  # never leave the transaction open: the next flush retries
            self._unstaged = self._keep(stage)
            self._unstaged_late = self._keep(stage_late)
            self._unsaved_events = event_rows[-RETRY_MAX_GROUPS:]
            self._failed("flush", e)
            return
        self._committed()
        sealed = nw[0] > self.w[0]
        with self.lock:
            self.w = nw
            self._trim()
        if late_cut is not None:
            self.late.trim(late_cut)
        self.flushes += 1
        self.last_flush_s = time.perf_counter() - t0
        if _file_id(self.db_path) != self._file_id:  # committed, but into a file no longer reachable by its name
            self._failed("flush", StoreError(f"{self.db_path} was removed or replaced while the store had it open, "
                                             "so what it writes now is lost when it closes; restart the writer"),
                         retried=False)
        else:
            self._succeeded()
        if sealed:
            self._retain()
            self.trimmed_bytes += give_back()  # the seal is the writer's largest allocation

    def _keep(self, groups: list[Group]) -> list[Group]:
        """What a failed flush keeps for the next one: the newest RETRY_MAX_GROUPS groups. Older ones stay in
        memory (the hot window or the late rows) and are sealed from there; only a crash before then loses them."""
        return groups[-RETRY_MAX_GROUPS:]

    def _committed(self) -> None:
        self.reg.committed()
        if len(self._tl_cache) > 50_000:
            self._tl_cache.clear()
        self._tl_cache.update(self._tl_new)
        self._tl_new = {}
        for i, b in enumerate(self._bytes_new):
            self.tier_bytes[i] += b
        self._bytes_new = [0] * len(TIERS)

    def _rollback(self) -> None:
        try:
            self.conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        self._tl_new = {}
        self._bytes_new = [0] * len(TIERS)

    def _groups(self, items: Sequence[Snapshot | Batch], events: list[Event]) -> tuple[list[Group], list[Group]]:
        """Rows per layout, split into those at or after the sealed block end and the late ones before it."""
        snaps = [x for x in items if isinstance(x, Snapshot)]
        groups = self._decompose(snaps, events) if snaps else []
        for b in items:
            if isinstance(b, Batch):
                hit = self._batch_layouts.get(id(b.series))
                if hit is None or hit[0] is not b.series:
                    hit = (b.series, self.reg.layout([self.reg.series_id(m, lab) for m, lab in b.series]))
                    if len(self._batch_layouts) > 10_000:
                        self._batch_layouts.clear()
                    self._batch_layouts[id(b.series)] = hit
                groups.append(Group(hit[1], b.t, b.v))
        out, late = [], []
        w0 = self.w[0]
        for g in groups:
            if not len(g.t):
                continue
            if int(g.t.min()) < w0:
                # Older than what is sealed (the clock stepped back, or it had jumped ahead): kept, and written
                # into the blocks they belong to once those are complete (see _late_cut).
                m = g.t >= w0
                old = Group(g.layout, g.t[~m], g.v[~m])
                late.append(old)
                self.late_samples += old.v.size
                top = int(old.t.max())
                self._late_seen = top if self._late_seen is None else max(self._late_seen, top)
                if not m.any():
                    continue
                g = Group(g.layout, g.t[m], g.v[m])
            top = int(g.t.max())
            self.newest = top if self.newest is None else max(self.newest, top)
            out.append(g)
        tops = [int(g.t.max()) for g in out] + [int(g.t.max()) for g in late]
        if tops:
            self._note_clock(max(tops))
        if late and not self.late.bufs:  # one line when late rows start, not one per flush
            behind = ((self.newest or w0) - min(int(g.t.min()) for g in late)) / 1e9
            log.warning("store: samples stamped %.0f s before the newest stored one arrived (the clock stepped "
                        "back?); they are kept and written per 10-minute block", behind)
        return out, late

    def _decompose(self, snaps: list[Snapshot], events: list[Event]) -> list[Group]:
        """Rows of the snapshots; one the writer cannot take apart (a stamp out of range...) is dropped and
        counted, never the rest of the flush."""
        n = len(events)
        try:
            return self.dec.decompose(snaps, events)
        except Exception:  # noqa: BLE001 - find the snapshot at fault, keep the others
            del events[n:]
        groups: list[Group] = []
        for snap in snaps:
            evs: list[Event] = []
            try:
                groups.extend(self.dec.decompose([snap], evs))
            except Exception as e:  # noqa: BLE001
                self._discard("snapshot", e)
                continue
            events.extend(evs)
        return groups

    def _event_rows(self, events: list[Event]) -> list[EventRow]:
        """Rows for the events table; text made valid (counted), an event that cannot be written dropped (counted)."""
        rows: list[EventRow] = []
        for e in events:
            try:
                t = int(e.time_ns)
                if not INT64[0] <= t <= INT64[1]:
                    raise OverflowError(f"time_ns {t} is out of range")
                data, fixed = _valid_json(e.data)
                kind, msg = str(e.kind), str(e.message)
                gpu = None if e.gpu is None else str(e.gpu)
                ok = valid_text(kind), valid_text(msg), None if gpu is None else valid_text(gpu)
                fixed = fixed or ok[0] is not kind or ok[1] is not msg or ok[2] is not gpu
                row = (t, ok[0], ok[2], ok[1], json.dumps(data, default=lambda o: valid_text(str(o))), int(e.count))
            except Exception as err:  # noqa: BLE001 - a circular or odd payload: this event only
                self._discard("event", err)
                continue
            self._events_repaired += fixed
            rows.append(row)
        return rows

    def _now_ns(self) -> int:
        return self._wall0 + int((self.clock() - self._mono0) * 1e9)

    def _note_clock(self, top: int) -> None:
        """Compare the newest stamp of a flush with the store's clock: close to it, the store is fed live; far
        ahead of it after that, the host clock jumped forward (or was behind when the store opened)."""
        now = self._now_ns()
        if abs(top - now) <= CLOCK_SLACK_NS:
            self._live, self._ahead_since = True, None
        elif self._live and top > now + CLOCK_SLACK_NS:
            m = self.clock()
            if self._ahead_since is None:
                self._ahead_since = m
                log.warning("store: samples stamped %.0f s ahead of the store's clock (the host clock jumped "
                            "forward, or the machine was suspended?); retention measures ages from the store's "
                            "clock until they agree, or for an hour", (top - now) / 1e9)
            elif m - self._ahead_since >= REANCHOR_S:
                self._wall0 += top - now
                self._ahead_since = None
                log.warning("store: samples stayed %.0f s ahead of the store's clock for an hour; the host clock "
                            "is taken as right and retention follows it", (top - now) / 1e9)

    def _retention_now(self) -> int:
        """Where retention measures ages from: the newest stamp, but for a live store never further than its own
        clock (plus a minute): a clock that jumps a day ahead and back must not delete a day of history."""
        newest = self.newest if self.newest is not None else self._now_ns()
        return min(newest, self._now_ns() + CLOCK_SLACK_NS) if self._live else newest

    def _seal_target(self) -> int:
        if self.newest is None:
            return self.w[0]
        edge = self.newest - self.grace_ns
        block = TIERS[0].block_ns
        target = (edge // block) * block
        if self.hot.values > self.hot_max and self.hot.count_since(self.w[0]) > self.hot_max:
            target = max(target, (edge // SECOND_NS) * SECOND_NS)  # too much unsealed in memory
        return max(target, self.w[0])

    def _stage(self, groups: list[Group], since: int) -> None:
        rows = []
        for g in groups:
            m = g.t >= since
            if not m.any():
                continue
            t, v = (g.t, g.v) if m.all() else (g.t[m], g.v[m])
            rows.append((g.layout.id, int(t.min()), int(t.max()), v.size, encode_staging(t, v)))
        if rows:
            self.conn.executemany("INSERT INTO staging (layout, t_min, t_max, n, data) VALUES (?, ?, ?, ?, ?)", rows)

    def _stage_late(self, groups: list[Group]) -> None:
        """Late rows, one staging row per layout and raw block (so that a block's rows go when it is written)."""
        rows = []
        for g in groups:
            t, v = g.t, g.v
            if len(t) > 1 and bool((np.diff(t) < 0).any()):
                order = np.argsort(t, kind="stable")
                t, v = t[order], v[order]
            for a, b in _block_slices(t, TIERS[0].block_ns):
                rows.append((g.layout.id, int(t[a]), int(t[b - 1]), v[a:b].size, encode_staging(t[a:b], v[a:b])))
        if rows:
            self.conn.executemany("INSERT INTO late (layout, t_min, t_max, n, data) VALUES (?, ?, ?, ?, ?)", rows)

    def _late_cut(self) -> int | None:
        """Late rows before this stamp are written now (None: none). A block is complete once the late stamps
        pass its end by the grace, as for the others; when no late row came in this flush (the clock caught up,
        or the store closes) or they take too much memory, all of them are."""
        if not self.late.bufs:
            return None
        if self._late_seen is None or self.late.values > self.hot_max:
            return INF
        block = TIERS[0].block_ns
        cut = ((self._late_seen - self.grace_ns) // block) * block
        oldest = self.late.oldest()
        return cut if oldest is not None and cut > oldest else None

    def _seal_late(self, cut: int, nw: list[int]) -> None:
        """Chunks for the late rows before `cut`, beside those already in their blocks: raw, 1 s, and the 1 min
        and 1 h tiers where those already hold the block (elsewhere the cascade rolls the 1 s chunk up).
        Rollups merge exactly (count, min, max, sum), so readers merge overlapping chunks as one."""
        rows: list[tuple[int, int, int, int, int, int, int, bytes]] = []
        cols = self.late.columns(INT64[0], cut)
        for (sid, (t, v)), scale in zip(cols.items(), self.reg.scales(list(cols)), strict=True):
            for a, b in _block_slices(t, TIERS[0].block_ns):
                pt, pv = t[a:b], v[a:b]
                self._chunk(rows, 0, sid, pt, [pv], scale)
                raw = Points.raw(pt, pv)
                for k in range(1, len(TIERS)):
                    if k == 1 or int(pt[0]) < nw[k]:
                        r = rollup(raw, TIERS[k].resolution_ns)
                        self._chunk(rows, k, sid, r.t, [r.counts(), r.mn, r.mx, r.sm, r.last], scale)
        self._insert_chunks(rows)
        self.conn.execute("DELETE FROM late WHERE t_max < ?", (cut,))

    def _seal(self, lo: int, hi: int) -> None:
        """Raw and 1 s chunks for [lo, hi), split at block boundaries; staging rows before hi go. The series of
        one layout are encoded together (they share their stamps); a series in several layouts (a GPU whose
        set of series changed) has its pieces merged first."""
        rows: list[tuple[int, int, int, int, int, int, int, bytes]] = []
        pieces: list[tuple[Layout, Int64Array, FloatArray]] = []
        seen: dict[int, int] = {}
        for buf in self.hot.bufs.values():
            if not len(buf):
                continue
            t, v = buf.rows(lo, hi)
            if not len(t):
                continue
            if not buf.ordered and len(t) > 1 and bool((np.diff(t) < 0).any()):
                order = np.argsort(t, kind="stable")
                t, v = t[order], v[order]
            pieces.append((buf.layout, t, v))
            for sid in buf.layout.col:
                seen[sid] = seen.get(sid, 0) + 1
        shared = {sid for sid, c in seen.items() if c > 1}
        first = hi
        for lay, t, v in pieces:
            first = min(first, int(t[0]))
            own = [(sid, j) for sid, j in lay.col.items() if sid not in shared]
            if len(own) == v.shape[1]:
                self._seal_rows(rows, t, v, [sid for sid, _ in own])
            elif own:
                self._seal_rows(rows, t, v[:, [j for _, j in own]], [sid for sid, _ in own])
        if shared:
            for sid, (t, v) in self.hot.columns(lo, hi, shared).items():
                self._seal_rows(rows, t, v.reshape(-1, 1), [sid])
        self._insert_chunks(rows)
        hour = TIERS[1].block_ns
        first = max(lo, first)
        for start in range((first // hour) * hour, hi, hour):  # one 1 s chunk per series and hour
            self._compact(1, start, start + hour)
        self.conn.execute("DELETE FROM staging WHERE t_max < ?", (hi,))
        self._set_meta(("w.0", hi), ("w.1", hi))
        self.decoder.staging.clear()

    def _seal_rows(self, rows: list[tuple[int, int, int, int, int, int, int, bytes]], t: Int64Array, v: FloatArray,
                   sids: list[int]) -> None:
        """Raw and 1 s chunks of k series sharing sorted stamps t (n,), values v (n, k), per raw block."""
        scales = self.reg.scales(sids)
        for a, b in _block_slices(t, TIERS[0].block_ns):
            pt, pv = t[a:b], v[a:b]
            self._chunks(rows, 0, sids, pt, [pv], scales)
            bt, cnt, agg = rollup_rows(pt, pv, TIERS[1].resolution_ns)
            self._chunks(rows, 1, sids, bt, [cnt, *agg], scales)

    def _chunks(self, rows: list[tuple[int, int, int, int, int, int, int, bytes]], tier: int, sids: list[int],
                t: Int64Array, cols: list[Any], scales: list[float | None]) -> None:
        tid = self._timeline(tier, t)
        t0, t1, n = int(t[0]), int(t[-1]), len(t)
        for sid, blob in zip(sids, encode_chunks(cols, scales), strict=True):
            rows.append((tier, sid, t0, t1, n, tid, len(blob), blob))
            self._bytes_new[tier] += len(blob)

    def _chunk(self, rows: list[tuple[int, int, int, int, int, int, int, bytes]], tier: int, sid: int,
               t: Int64Array, cols: list[Any], scale: float | None) -> None:
        tid = self._timeline(tier, t)
        blob = encode_chunk(cols, scale)
        rows.append((tier, sid, int(t[0]), int(t[-1]), len(t), tid, len(blob), blob))
        self._bytes_new[tier] += len(blob)

    def _insert_chunks(self, rows: list[tuple[int, int, int, int, int, int, int, bytes]]) -> None:
        self.conn.executemany("INSERT INTO chunks (tier, series_id, t_min, t_max, n, timeline, nbytes, data) "
                              "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def _timeline(self, tier: int, t: Int64Array) -> int:
        h = hashlib.blake2b(t.tobytes(), digest_size=16).digest()
        key = (tier, h)
        tid = self._tl_cache.get(key) or self._tl_new.get(key)
        if tid is None:
            row = self.conn.execute("SELECT id FROM timelines WHERE tier = ? AND hash = ?", (tier, h)).fetchone()
            if row is not None:
                tid = int(row[0])
            else:
                blob = encode_chunk([t])
                cur = self.conn.execute("INSERT INTO timelines (tier, hash, t_min, t_max, n, nbytes, data) "
                                        "VALUES (?, ?, ?, ?, ?, ?, ?)", (tier, h, int(t[0]), int(t[-1]), len(t), len(blob), blob))
                tid = int(cur.lastrowid)  # type: ignore[arg-type]
                self._bytes_new[tier] += len(blob)
            self._tl_new[key] = tid
        return tid

    def _compact(self, tier: int, lo: int, hi: int) -> None:
        """Merge each series' chunks of `tier` with t_max in [lo, hi) into one."""
        multi = [sid for (sid,) in self.conn.execute(
            "SELECT series_id FROM chunks WHERE tier = ? AND t_max >= ? AND t_max < ? GROUP BY series_id "
            "HAVING COUNT(*) > 1", (tier, lo, hi))]  # a series with one chunk there (a short job) has nothing to merge
        if not multi:
            return
        merge: dict[int, list[tuple[Any, ...]]] = {}
        for k in range(0, len(multi), 500):
            part = multi[k:k + 500]
            for r in self.conn.execute(
                    "SELECT series_id, id, timeline, n, nbytes, data FROM chunks INDEXED BY chunks_series WHERE "
                    f"series_id IN ({','.join('?' * len(part))}) AND tier = ? AND t_max >= ? AND t_max < ? "
                    "ORDER BY series_id, t_min", (*part, tier, lo, hi)):
                merge.setdefault(r[0], []).append(r)
        tls = self.decoder.load_timelines(self.conn, {r[2] for rs in merge.values() for r in rs})
        out: list[tuple[int, int, int, int, int, int, int, bytes]] = []
        gone: list[tuple[int]] = []
        for (sid, rs), scale in zip(merge.items(), self.reg.scales(list(merge)), strict=True):
            parts = [self.decoder.points(tier, cid, tid, n, blob, timelines=tls) for _, cid, tid, n, _, blob in rs]
            p = Points.concat([x for x in parts if x is not None])
            if len(p):
                self._chunk(out, tier, sid, p.t, [p.counts(), p.mn, p.mx, p.sm, p.last], scale)
            gone.extend((r[1],) for r in rs)
            self._bytes_new[tier] -= sum(r[4] for r in rs)
        self.conn.executemany("DELETE FROM chunks WHERE id = ?", gone)
        self._insert_chunks(out)
        orphans = self.conn.execute(
            "SELECT id, nbytes FROM timelines WHERE tier = ?1 AND t_max >= ?2 AND t_max < ?3 AND id NOT IN "
            "(SELECT timeline FROM chunks WHERE tier = ?1 AND t_max >= ?2 AND t_max < ?3)", (tier, lo, hi)).fetchall()
        if orphans:
            self.conn.executemany("DELETE FROM timelines WHERE id = ?", [(i,) for i, _ in orphans])
            self._bytes_new[tier] -= sum(b for _, b in orphans)
            dead = {i for i, _ in orphans}
            self._tl_new = {k: v for k, v in self._tl_new.items() if v not in dead}
            self._tl_cache = {k: v for k, v in self._tl_cache.items() if v not in dead}

    def _cascade(self, nw: list[int]) -> None:
        """1 min rollups from 1 s, 1 h from 1 min, for every block of theirs now complete."""
        for k in (2, 3):
            tier, src = TIERS[k], k - 1
            boundary = (nw[src] // tier.block_ns) * tier.block_ns
            if boundary <= nw[k]:
                continue
            blk = self._next_block(src, nw[k], boundary, tier.block_ns)
            while blk < boundary:
                self._roll_block(k, blk)
                blk = self._next_block(src, blk + tier.block_ns, boundary, tier.block_ns)
            nw[k] = boundary
            self._set_meta((f"w.{k}", boundary))

    def _next_block(self, src: int, lo: int, hi: int, block: int) -> int:
        """Start of the first block of `block` ns at or after lo where tier src has data, else hi."""
        first = self.conn.execute("SELECT MIN(t_max) FROM chunks WHERE tier = ? AND t_max >= ? AND t_max < ?",
                                  (src, lo, hi)).fetchone()[0]
        return hi if first is None else (int(first) // block) * block

    def _roll_block(self, k: int, blk: int) -> None:
        """Roll tier k-1's chunks of one of tier k's blocks up into tier k, a batch of series at a time: a 6-hour
        block of a churning node holds hundreds of thousands of series, whose chunks at once would not fit."""
        tier, src = TIERS[k], k - 1
        hi = blk + tier.block_ns
        sids = [sid for (sid,) in self.conn.execute(
            "SELECT DISTINCT series_id FROM chunks INDEXED BY chunks_age WHERE tier = ? AND t_max >= ? AND t_max < ?",
            (src, blk, hi))]
        sids.sort()
        for i in range(0, len(sids), ROLL_BATCH):
            part = sids[i:i + ROLL_BATCH]
            rows = self.conn.execute(
                "SELECT series_id, id, timeline, n, data FROM chunks INDEXED BY chunks_series WHERE series_id IN "
                f"({','.join('?' * len(part))}) AND tier = ? AND t_max >= ? AND t_max < ? ORDER BY series_id, t_min",
                (*part, src, blk, hi)).fetchall()
            tls = self.decoder.load_timelines(self.conn, {r[2] for r in rows})
            parts: dict[int, list[Points]] = {}
            for sid, cid, tid, n, blob in rows:
                p = self.decoder.points(src, cid, tid, n, blob, timelines=tls)
                if p is not None:
                    parts.setdefault(sid, []).append(p)
            out: list[tuple[int, int, int, int, int, int, int, bytes]] = []
            for (sid, ps), scale in zip(parts.items(), self.reg.scales(list(parts)), strict=True):
                r = rollup(Points.concat(ps), tier.resolution_ns)
                self._chunk(out, k, sid, r.t, [r.counts(), r.mn, r.mx, r.sm, r.last], scale)
            self._insert_chunks(out)

    def _meta(self, groups: list[Group]) -> None:
        latest: dict[int, tuple[int, float]] = {}
        for g in groups:
            i = int(np.argmax(g.t))
            t, row = int(g.t[i]), g.v[i]
            for sid, x in zip(g.layout.sids.tolist(), row.tolist(), strict=True):
                old = latest.get(sid)
                if old is None or t >= old[0]:
                    latest[sid] = (t, x)
        if latest:
            self.conn.executemany("INSERT OR REPLACE INTO latest (series_id, time_ns, value) VALUES (?, ?, ?)",
                                  [(s, t, x) for s, (t, x) in latest.items()])
        if self.newest is not None:
            self._set_meta(("newest", self.newest))
        if self.dec.node_changed:
            node = {"hostname": self.dec.hostname, "simulated": self.dec.simulated,
                    "gpus": [asdict(i) for _, i in sorted(self.dec.identities.items())]}
            self._set_meta(("node", json.dumps(node)))
            self.dec.node_changed = False

    def _set_meta(self, *kv: tuple[str, object]) -> None:
        self.conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [(k, str(v)) for k, v in kv])

    def _trim(self) -> None:
        """Keep the last hot_window_s in memory, never anything unsealed; shed sealed rows when over cap."""
        if self.newest is None:
            return
        cut = min(self.w[0], self.newest - self.hot_window_ns)
        if self.hot.values > self.hot_max:
            cut = self.w[0]
        self.hot.trim(cut)

    def _bound_memory(self) -> None:
        """When sealing keeps failing (disk full?), drop the oldest unsealed rows beyond 4x the cap."""
        if self.hot.values > 4 * self.hot_max and self.newest is not None:
            before = self.hot.values
            self.hot.trim(self.newest - self.hot_window_ns)
            self.dropped_memory += before - self.hot.values
            self._log_once("memory", StoreError("unsealed samples dropped to bound memory while flushes fail"))
        if self.late.values > 4 * self.hot_max:
            before = self.late.values
            self.late.trim(self.late_newest() - self.hot_window_ns)
            self.dropped_memory += before - self.late.values
            self._log_once("memory", StoreError("late samples dropped to bound memory while flushes fail"))

    def late_newest(self) -> int:
        return max(int(b.t[b.lo:b.hi].max()) for b in self.late.bufs.values() if len(b))

    # -- retention ---------------------------------------------------------------------------------
    def _retain(self) -> None:
        if self.newest is None:
            return
        conn = self.conn
        r = self.retention
        now = self._retention_now()
        freed = [0] * len(TIERS)
        self._dropped_sids = set()
        try:
            conn.execute("BEGIN IMMEDIATE")
            for tier, age_s, cap in zip(TIERS, r.ages_s(), r.caps(), strict=True):
                i = tier.index
                freed[i] += self._drop(i, min(now - int(age_s * 1e9), self._guard(i)))
                if cap is not None:
                    freed[i] += self._shed(i, self.tier_bytes[i] - freed[i] - cap)
            excess = sum(self.tier_bytes) - sum(freed) - r.max_bytes
            for i in range(len(TIERS)):  # over the total: oldest first, finest tier first
                if excess <= 0:
                    break
                got = self._shed(i, excess)
                freed[i] += got
                excess -= got
            conn.execute("DELETE FROM events WHERE time_ns < ?", (now - int(r.events_max_age_s * 1e9),))
            conn.execute("DELETE FROM events WHERE id <= (SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?)",
                         (r.events_max_rows,))
            for i, b in enumerate(freed):  # queries use coarser tiers before a tier's floor
                if b:
                    floor = oldest(conn, i)
                    self._set_meta((f"floor.{i}", floor if floor is not None else self.w[i]))
            live_lids = self._live_layouts()
            dead = self._delete_dead_series(live_lids)
            conn.execute("COMMIT")
        except Exception as e:  # noqa: BLE001 - retried after the next seal
            self._rollback()
            self._failed("retention", e)
            return
        finally:
            self._dropped_sids = set()
        self._swept = True
        self._park(dead, live_lids)
        for i, b in enumerate(freed):
            self.tier_bytes[i] -= b
        if any(freed):
            self._tl_cache.clear()
            try:
                conn.execute("PRAGMA incremental_vacuum")
            except sqlite3.Error as e:
                self._log_once("vacuum", e)

    def _live_layouts(self) -> set[int]:
        """Layouts rows are held for: the hot window, the late rows, rows waiting for a retry, staging."""
        live = set(self.hot.bufs) | set(self.late.bufs) | {g.layout.id for g in self._unstaged + self._unstaged_late}
        live.update(lid for (lid,) in self.conn.execute("SELECT DISTINCT layout FROM staging UNION "
                                                        "SELECT DISTINCT layout FROM late"))
        return live

    def _delete_dead_series(self, live_lids: set[int]) -> list[int]:
        """Delete (in the open retention transaction) the series whose data is gone from every tier,
        from staging and from the hot window, with their `latest` rows; and the layouts no row needs."""
        reg = self.reg
        if self._swept:
            cand = self._dropped_sids
        else:  # the first retention checks every stored series (stores written before deletion existed)
            cand = {s for (s,) in self.conn.execute("SELECT id FROM series")}
        pending = {s for s, *_ in reg.new_series}
        live: set[int] = set()
        for lid in live_lids:
            lay = reg.layouts.get(lid) or next((w.bufs[lid].layout for w in (self.hot, self.late) if lid in w.bufs), None)
            if lay is not None:
                live.update(lay.col)
        for g in self._unstaged + self._unstaged_late:
            live.update(g.layout.col)
        q = "SELECT 1 FROM chunks INDEXED BY chunks_series WHERE series_id = ? LIMIT 1"
        dead = sorted(s for s in cand if s not in live and s not in pending
                      and self.conn.execute(q, (s,)).fetchone() is None)
        # A layout only matters while rows are written or staged for it: the others go (a series seen again
        # gets a layout anew). The writer lets go of the same ones from memory after the commit (_park).
        keep = live_lids | {lay.id for lay in reg.new_layouts}
        stale = [(lid,) for (lid,) in self.conn.execute("SELECT id FROM layouts") if lid not in keep]
        self.conn.executemany("DELETE FROM layouts WHERE id = ?", stale)
        # The newest values of processes that are gone: Reader.latest() shows the last snapshot's processes.
        idle = [(s,) for s, m in reg.metric.items() if m in PROCESS_METRICS and s not in live and s not in pending]
        self.conn.executemany("DELETE FROM latest WHERE series_id = ?", idle)
        if not dead:
            return []
        rows = [(s,) for s in dead]
        self.conn.executemany("DELETE FROM series WHERE id = ?", rows)
        self.conn.executemany("DELETE FROM latest WHERE series_id = ?", rows)
        nsid, nlid = reg.next_ids()
        self._set_meta(("series.next", nsid), ("layouts.next", nlid),
                       ("series.deleted", self.deleted_series + len(dead)))
        return dead

    def _park(self, dead: list[int], live_lids: set[int]) -> None:
        """After retention committed: forget the deleted series, and let go of the layouts and series no row
        in memory needs (they stay stored), everywhere the writer caches them."""
        self.deleted_series += len(dead)
        self.reg.evict(dead, ())
        gone = self.reg.park(live_lids)
        self.dec.forget(gone)
        if gone:
            self._batch_layouts = {k: v for k, v in self._batch_layouts.items() if v[1].id not in gone}

    def _guard(self, tier: int) -> int:
        """A tier keeps what the next tier has not rolled up yet."""
        return self.w[tier + 1] if tier + 1 < len(TIERS) else INF

    def _shed(self, tier: int, excess: int) -> int:
        """Drop the oldest blocks of `tier` until `excess` bytes are freed (or nothing droppable is left)."""
        if excess <= 0:
            return 0
        guard, got, cut = self._guard(tier), 0, None
        for t_max, b in self.conn.execute("SELECT t_max, SUM(nbytes) FROM chunks WHERE tier = ? AND t_max < ? "
                                          "GROUP BY t_max ORDER BY t_max", (tier, guard)):
            got += int(b)
            cut = int(t_max) + 1
            if got >= excess:
                break
        return 0 if cut is None else self._drop(tier, cut)

    def _drop(self, tier: int, cut: int) -> int:
        """Delete tier's chunks and time lines that end before cut; returns the bytes freed."""
        freed = 0
        self._dropped_sids.update(s for (s,) in self.conn.execute(
            "SELECT DISTINCT series_id FROM chunks WHERE tier = ? AND t_max < ?", (tier, cut)))
        for table in ("chunks", "timelines"):
            b = self.conn.execute(f"SELECT SUM(nbytes) FROM {table} WHERE tier = ? AND t_max < ?", (tier, cut)).fetchone()[0]
            if b:
                self.conn.execute(f"DELETE FROM {table} WHERE tier = ? AND t_max < ?", (tier, cut))
                freed += int(b)
        return freed

    # -- the flush thread and its health ----------------------------------------------------------
    def run(self, interval: float, stop: threading.Event) -> None:
        while not stop.is_set():
            self.wake.wait(interval)
            self.wake.clear()
            if stop.is_set():
                break
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001 - the flush thread must not die; the next flush retries
                self._failed("flush thread", e)

    def _failed(self, where: str, e: BaseException, retried: bool = True) -> None:
        """A write failed: counted, and said in one line when it starts, when the reason changes and once a
        minute while it lasts (never a traceback per flush)."""
        now = self.clock()
        reason = _reason(e)
        self.write_errors += 1
        self.last_error, self.last_error_at = f"{where} failed: {reason}", time.time()
        if self.failing_since is None:
            self.failing_since = now
        self.failed_flushes += where != "retention"
        line = self._last_line
        if line is None or line[0] != reason or now - line[1] >= REMIND_S:
            self._last_line = (reason, now)
            if line is None:
                log.warning("store cannot write (%s failed: %s)%s", where, reason,
                            "; the data is kept in memory and retried every flush" if retried else "")
            else:
                log.warning("store still cannot write, %.0f s after the last successful flush (%d failed): %s",
                            now - self.last_ok, self.failed_flushes, reason)

    def _succeeded(self) -> None:
        now = self.clock()
        down = now - self.last_ok
        if self.failing_since is not None or down > BUSY_MAX_S:
            log.warning("store recovered: a flush succeeded %.1f s after the last successful one (%d failed "
                        "meanwhile; last error: %s)", down, self.failed_flushes,
                        self.last_error if self.failing_since is not None else "none, the flushes were slow")
        self.last_ok = now
        self.failing_since = None
        self.failed_flushes = 0
        self._last_line = None

    def _discard(self, what: str, e: BaseException) -> None:
        """A record the writer cannot take: dropped and counted, one line per kind of failure and minute."""
        self.records_dropped += 1
        key = f"drop {what}: {type(e).__name__}"
        now = self.clock()
        last = self._dropped_lines.get(key)
        if last is None or now - last >= REMIND_S:
            self._dropped_lines[key] = now
            log.warning("store dropped a %s it cannot write: %s (%d dropped so far)", what, _reason(e),
                        self.records_dropped)

    def health(self, thread_alive: bool) -> dict[str, Any]:
        """Whether the writer can write, and what it had to repair, drop or retry; see Store.health()."""
        now = self.clock()
        age = now - self.last_ok
        busy = self.flushing_since
        if not thread_alive:
            reason: str | None = "the store's flush thread has stopped"
        elif self.failing_since is not None:
            reason = f"the store cannot write: {self.last_error}"
        elif age > self.stale_after_s and (busy is None or now - busy > BUSY_MAX_S):
            reason = f"no flush of the store has completed for {age:.0f} s"
        else:  # idle, or a long flush under way (a block being sealed): the samples wait in memory meanwhile
            reason = None
        return {
            "healthy": reason is None, "reason": reason,
            "last_flush_age_seconds": round(age, 3),
            "flush_running_seconds": None if busy is None else round(now - busy, 3),
            "longest_flush_seconds": round(self.longest_flush_s, 3),
            "failing_for_seconds": None if self.failing_since is None else round(now - self.failing_since, 3),
            "last_error": self.last_error, "last_error_at": self.last_error_at,
            "write_errors": self.write_errors, "records_repaired": self.reg.repaired + self._events_repaired,
            "records_dropped": self.records_dropped, "snapshots_dropped": self.dropped_snapshots,
            "samples_dropped": self.dropped_memory, "late_samples": self.late_samples,
            "late_samples_unwritten": self.late.values, "flush_thread_alive": thread_alive,
            "memory_given_back_bytes": self.trimmed_bytes,
        }

    def _log_once(self, where: str, e: BaseException) -> None:
        if where not in self._errors:
            self._errors.add(where)
            log.warning("store %s failed: %s: %s (logged once)", where, type(e).__name__, e)


EventRow = tuple[int, str, str | None, str, str, int]


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _block_slices(t: Int64Array, block: int) -> list[tuple[int, int]]:
    """[a, b) index ranges of sorted stamps `t` that fall in one block of `block` ns each."""
    if not len(t):
        return []
    cuts = np.searchsorted(t, np.arange((int(t[0]) // block + 1) * block, int(t[-1]) + 1, block))
    edges = np.concatenate(([0], cuts, [len(t)])).tolist()
    return [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if a != b]


def _valid_json(x: Any) -> tuple[Any, bool]:
    """`x` with every string (keys included) made valid text, and whether anything changed."""
    if isinstance(x, str):
        y = valid_text(x)
        return y, y is not x
    if isinstance(x, dict):
        out, changed = {}, False
        for k, v in x.items():
            if isinstance(k, str):
                k2: Any = valid_text(k)
                changed |= k2 is not k
            elif k is None or isinstance(k, int | float):
                k2 = k
            else:
                k2, changed = valid_text(str(k)), True
            out[k2], c = _valid_json(v)
            changed |= c
        return (out if changed else x), changed
    if isinstance(x, list | tuple):
        items = [_valid_json(v) for v in x]
        changed = any(c for _, c in items)
        return ([v for v, _ in items] if changed else x), changed
    return x, False


def _reason(e: BaseException) -> str:
    """One line for a log or a status page: the error's own words and its type."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, StoreError) and text:
        return text  # our own sentence
    return f"{text} ({type(e).__name__})" if text else type(e).__name__
