"""Rollups and step aggregation over sorted points, and which tier serves which part of a range.

A rollup bucket holds count, min, max, sum and last of the raw samples in it, so re-aggregating
buckets into a coarser step is exact for count, sum, mean (sum / count), min, max and last.

Percentiles (pXX) are exact over raw samples ('inverted CDF': the smallest sample with at least XX %
of the samples at or below it, numpy's method='inverted_cdf'). Over a rollup tier they are
approximated by the count-weighted percentile of the bucket means: a spike shorter than one bucket
is averaged away, so tails are under-estimated (use max for the worst case). To keep that error
small a percentile reads the finest tier that still holds the range, with at most ~1000 source
points per step per series: raw for steps up to 10 s, 1 s rollups up to 1000 s, 1 min rollups up to
~16 h, 1 h rollups beyond.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ._codec import FloatArray, Int64Array
from ._config import TIERS
from ._errors import QueryError

AGGS = ("mean", "max", "min", "last", "count", "sum")
_PCT = re.compile(r"^p(\d{1,2}(?:\.\d+)?)$")
INF = 2**63 - 1
RESOLUTIONS = [max(1, t.resolution_ns) for t in TIERS]


# Rollup columns (count, min, max, sum, last) each aggregation reads.
ALL = (True, True, True, True, True)
_NEEDS = {"mean": (True, False, False, True, False), "sum": (True, False, False, True, False),
          "count": (True, False, False, False, False), "min": (True, True, False, False, False),
          "max": (True, False, True, False, False), "last": (True, False, False, False, True)}


def needs(agg: str) -> tuple[bool, ...]:
    return _NEEDS.get(agg, _NEEDS["mean"])


def parse_agg(agg: str) -> float | None:
    """None for the plain aggregations, the percentile (0..100) for pXX; QueryError otherwise."""
    if agg in AGGS:
        return None
    m = _PCT.match(agg) if isinstance(agg, str) else None
    if m and 0 < float(m.group(1)) < 100:
        return float(m.group(1))
    raise QueryError(f"Unknown aggregation {agg!r}; use one of {', '.join(AGGS)} or a percentile p1..p99.9 "
                     "(e.g. p50, p99).")


@dataclass
class Points:
    """Raw samples (cnt is None, and mn/mx/sm/last are the values) or rollup buckets, sorted by time."""

    t: Int64Array
    cnt: Int64Array | None
    mn: FloatArray
    mx: FloatArray
    sm: FloatArray
    last: FloatArray

    @classmethod
    def raw(cls, t: Int64Array, v: FloatArray) -> Points:
        return cls(t, None, v, v, v, v)

    @classmethod
    def empty(cls) -> Points:
        e = np.empty(0)
        return cls(np.empty(0, dtype=np.int64), None, e, e, e, e)

    def __len__(self) -> int:
        return len(self.t)

    def counts(self) -> Int64Array:
        return np.ones(len(self.t), dtype=np.int64) if self.cnt is None else self.cnt

    def select(self, lo: int, hi: int) -> Points:
        a, b = np.searchsorted(self.t, [lo, hi])
        if a == 0 and b == len(self.t):
            return self
        c = None if self.cnt is None else self.cnt[a:b]
        if self.cnt is None:
            v = self.mn[a:b]
            return Points(self.t[a:b], None, v, v, v, v)
        return Points(self.t[a:b], c, self.mn[a:b], self.mx[a:b], self.sm[a:b], self.last[a:b])

    @staticmethod
    def concat(parts: list[Points]) -> Points:
        parts = [p for p in parts if len(p)]
        if not parts:
            return Points.empty()
        if len(parts) == 1:
            return parts[0]
        t = np.concatenate([p.t for p in parts])
        if all(p.cnt is None for p in parts):
            v = np.concatenate([p.mn for p in parts])
            out = Points.raw(t, v)
        else:
            out = Points(t, np.concatenate([p.counts() for p in parts]),
                         *(np.concatenate([getattr(p, f) for p in parts]) for f in ("mn", "mx", "sm", "last")))
        if (np.diff(t) < 0).any():
            out = out.take(np.argsort(t, kind="stable"))
        return out

    def take(self, idx: npt.NDArray[np.intp]) -> Points:
        if self.cnt is None:
            v = self.mn[idx]
            return Points(self.t[idx], None, v, v, v, v)
        return Points(self.t[idx], self.cnt[idx], self.mn[idx], self.mx[idx], self.sm[idx], self.last[idx])


def _starts(b: Int64Array) -> npt.NDArray[np.intp]:
    if len(b) == 0:
        return np.empty(0, dtype=np.intp)
    return np.flatnonzero(np.concatenate(([True], b[1:] != b[:-1])))


def rollup(p: Points, res_ns: int) -> Points:
    """Buckets of res_ns aligned to the epoch (bucket start stamps)."""
    if not len(p):
        return Points.empty()
    b = (p.t // res_ns) * res_ns
    idx = _starts(b)
    ends = np.concatenate((idx[1:], [len(b)])) - 1
    cnt = np.diff(np.concatenate((idx, [len(b)]))) if p.cnt is None else np.add.reduceat(p.cnt, idx)
    return Points(b[idx], cnt.astype(np.int64), np.minimum.reduceat(p.mn, idx), np.maximum.reduceat(p.mx, idx),
                  np.add.reduceat(p.sm, idx), p.last[ends])


def rollup_rows(t: Int64Array, v: FloatArray, res_ns: int) -> tuple[Int64Array, Int64Array, list[FloatArray]]:
    """rollup() of k raw series sharing sorted stamps t (n,), values v (n, k): bucket starts, counts and
    [min, max, sum, last] as (m, k) arrays (column j is rollup() of v[:, j])."""
    b = (t // res_ns) * res_ns
    idx = _starts(b)
    ends = np.concatenate((idx[1:], [len(b)])) - 1
    cnt = np.diff(np.concatenate((idx, [len(b)]))).astype(np.int64)
    return b[idx], cnt, [np.minimum.reduceat(v, idx, axis=0), np.maximum.reduceat(v, idx, axis=0),
                         np.add.reduceat(v, idx, axis=0), v[ends]]


def aggregate(p: Points, start: int, step_ns: int, agg: str, pct: float | None) -> tuple[Int64Array, FloatArray]:
    """One value per non-empty step bucket [start + i*step, start + (i+1)*step)."""
    if not len(p):
        return np.empty(0, dtype=np.int64), np.empty(0)
    b = (p.t - start) // step_ns
    idx = _starts(b)
    ts = start + b[idx] * step_ns
    if pct is not None:
        return ts, _percentile(p, b, idx, pct)
    if agg == "min":
        return ts, np.minimum.reduceat(p.mn, idx)
    if agg == "max":
        return ts, np.maximum.reduceat(p.mx, idx)
    if agg == "last":
        return ts, p.last[np.concatenate((idx[1:], [len(b)])) - 1]
    cnt = (np.diff(np.concatenate((idx, [len(b)]))) if p.cnt is None else np.add.reduceat(p.cnt, idx)).astype(np.float64)
    if agg == "count":
        return ts, cnt
    s = np.add.reduceat(p.sm, idx)
    return ts, (s if agg == "sum" else s / cnt)


def _percentile(p: Points, b: Int64Array, idx: npt.NDArray[np.intp], pct: float) -> FloatArray:
    vals = p.mn if p.cnt is None else p.sm / np.maximum(p.cnt, 1)
    w = p.counts().astype(np.float64)
    order = np.lexsort((vals, b))  # b is sorted, so bucket runs keep their positions
    vs, ws = vals[order], w[order]
    cw = np.cumsum(ws)
    tot = np.add.reduceat(ws, idx)
    before = np.concatenate(([0.0], cw[idx[1:] - 1]))
    target = before + pct / 100.0 * tot - 1e-9 * tot  # smallest value with F >= pct ('inverted CDF')
    pos = np.searchsorted(cw, target, side="left")
    ends = np.concatenate((idx[1:], [len(vs)])) - 1
    return vs[np.clip(pos, idx, ends)]


def plan(start: int, end: int, pref: int, lo: list[int | None], hi: list[int],
         res: list[int] = RESOLUTIONS) -> list[tuple[int, int, int]]:
    """(tier, a, b) segments that cover [start, end): the preferred tier where it holds data, finer
    tiers for what it has not rolled up yet, coarser ones for what its retention has dropped.
    lo[k] is where tier k's data starts (retention dropped what is older; None: holds nothing),
    hi[k] the stamp it is complete up to, res[k] its bucket width."""

    def cover(k: int, a: int, b: int) -> tuple[int, int] | None:
        low = lo[k]
        if low is None:
            return None
        a2, b2 = max(a, low), min(b, hi[k])
        return (a2, b2) if a2 < b2 else None

    segs = []
    main = cover(pref, start, end)
    if main:
        segs.append((pref, *main))
    cur = max(start, hi[pref])
    for k in range(pref - 1, -1, -1):
        if cur >= end:
            break
        c = cover(k, cur, end)
        if c:
            segs.append((k, *c))
            cur = c[1]
    low = lo[pref]
    top = min(end, low if low is not None else hi[pref])
    for k in range(pref + 1, len(lo)):
        if top <= start:
            break
        c = cover(k, start, top)
        if c:
            segs.append((k, *c))
            top = c[0]
    segs.sort(key=lambda s: s[1])
    # Where an older part comes from a coarser tier, its last bucket may straddle the edge: move the
    # edge up to that tier's bucket boundary so each sample is counted once.
    out: list[tuple[int, int, int]] = []
    for k, a, b in segs:
        if out:
            pk, pa, pb = out[-1]
            if pk > k and pb == a:
                edge = min(-(-pb // res[pk]) * res[pk], b)
                out[-1] = (pk, pa, edge)
                a = edge
        if a < b:
            out.append((k, a, b))
    return out


def preferred_tier(step_ns: int, pct: float | None) -> int:
    """Coarsest tier not coarser than the step; for percentiles the finest with <= ~1000 points a step."""
    s = step_ns / 1e9
    if pct is not None:
        return 0 if s <= 10 else 1 if s <= 1000 else 2 if s <= 60_000 else 3
    return 0 if s < 1 else 1 if s < 60 else 2 if s < 3600 else 3
