"""Encoding of columns and chunks: quantise, delta (or delta-of-delta), zigzag, narrowest integer width,
zlib.

Values are quantised to the precision their unit can mean (the catalog gives the unit):

===============  ==========  ===============================================================
unit             quantum     why
===============  ==========  ===============================================================
ratio, cores     1e-4        0.01 percentage point; NVML reports whole percents, GPM ~0.01 %
watts            1e-3        NVML reports milliwatts
joules           1e-3        NVML's energy counter counts millijoules
celsius          1e-2        NVML reports whole degrees; room for averaged sources
seconds          1e-6        throttle time accumulates per tick; a microsecond is below any tick
hertz            1           clocks are whole MHz: exact
bytes, bytes/s   1           exact (whole bytes)
'' counters      1           event counts (XIDs, ECC errors, replays): exact
'' gauges        1e-4        load averages, P-state, bitmasks, thread counts: exact or 0.0001
not catalogued   lossless    float64 bits, XOR with the previous value
===============  ==========  ===============================================================

A column whose values are not finite or do not fit 2**53 quanta is stored lossless instead. Time
stamps and counts are exact integers. Delta order 1 or 2 is chosen per column (2 wins on counters
and regular time stamps). zlib, not zstd: on our series the two were within 5 % of each other
(noise dominates what is left after the deltas), and zlib is in the standard library.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ..catalog import CATALOG, Kind
from ._errors import CorruptChunk

Int64Array = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

_SCALE_BY_UNIT: dict[str, float] = {
    "ratio": 1e4, "cores": 1e4, "watts": 1e3, "joules": 1e3, "celsius": 1e2, "seconds": 1e6,
    "hertz": 1.0, "bytes": 1.0, "bytes/s": 1.0,
}
_LIMIT = float(2**53)
LEVEL = 6

_MAGIC = b"G1"
_HEAD = struct.Struct("<2sIBI")  # magic, rows, columns, crc32 of the compressed payload
_COL = struct.Struct("<BBBdqq")  # kind, delta order, width in bytes, scale, first value, first delta
INT, QUANT, FLOAT = 0, 1, 2
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def scale_for(metric: str) -> float | None:
    """Quanta per unit for a metric (1e4 for ratios), or None to store it lossless."""
    m = CATALOG.get(metric)
    if m is None:
        return None
    if m.unit in _SCALE_BY_UNIT:
        return _SCALE_BY_UNIT[m.unit]
    if m.unit == "":
        return 1.0 if m.kind is Kind.COUNTER else 1e4
    return None


def quantise(v: FloatArray, scale: float | None) -> Int64Array | None:
    """Values as whole quanta, or None where they do not fit (then the column is stored lossless)."""
    if scale is None or len(v) == 0:
        return None
    q = np.rint(v * scale)
    if not np.isfinite(q).all() or float(np.abs(q).max()) >= _LIMIT:
        return None
    return q.astype(np.int64)


def _zigzag(d: Int64Array) -> npt.NDArray[np.uint64]:
    return ((d << 1) ^ (d >> 63)).view(np.uint64)


def _unzigzag(u: npt.NDArray[np.uint64]) -> Int64Array:
    return (u >> np.uint64(1)).view(np.int64) ^ -(u & np.uint64(1)).view(np.int64)


def _encode_int(q: Int64Array) -> tuple[int, int, int, int, bytes]:
    """(order, width, first, first delta, payload) of an int64 column."""
    n = len(q)
    if n == 0:
        return 1, 1, 0, 0, b""
    first = int(q[0])
    if n == 1:
        return 1, 1, first, 0, b""
    d = np.diff(q)
    order, second = 1, 0
    if n > 2:
        d2 = np.diff(d)
        if float(np.abs(d2.astype(np.float64)).sum()) < float(np.abs(d.astype(np.float64)).sum()):
            order, second, d = 2, int(d[0]), d2
    u = _zigzag(d)
    top = int(u.max())
    width = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4 if top < 1 << 32 else 8
    return order, width, first, second, u.astype(_UINT[width]).tobytes()


# Zigzag decoding tables for the narrow widths (most columns): one gather instead of five ufuncs.
_LUT = {w: _unzigzag(np.arange(1 << (8 * w), dtype=np.uint64)) for w in (1, 2)}


def _decode_int(order: int, width: int, first: int, second: int, payload: bytes, n: int) -> Int64Array:
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out
    out[0] = first
    if n == 1:
        return out
    u = np.frombuffer(payload, dtype=_UINT[width])
    lut = _LUT.get(width)
    d = lut[u] if lut is not None else _unzigzag(u.astype(np.uint64))
    if order == 2:
        d1 = np.empty(n - 1, dtype=np.int64)
        d1[0] = second
        np.cumsum(d, out=d1[1:])
        d1[1:] += second
        d = d1
    np.cumsum(d, out=out[1:])
    out[1:] += first
    return out


def _payload_len(kind: int, order: int, width: int, n: int) -> int:
    if kind == FLOAT:
        return 8 * n
    return max(0, n - order) * width if n > 1 else 0


def _encode_col(col: npt.NDArray[np.generic], scale: float | None) -> tuple[bytes, bytes]:
    """(column head, payload) of one column."""
    n = len(col)
    q: Int64Array | None
    if col.dtype.kind in "iu":
        kind, q, s = INT, col.astype(np.int64, copy=False), 1.0
    else:
        q = quantise(col.astype(np.float64, copy=False), scale)
        kind, s = (QUANT, float(scale)) if q is not None and scale is not None else (FLOAT, 0.0)
    if kind == FLOAT:
        bits = np.ascontiguousarray(col, dtype=np.float64).view(np.int64)
        x = bits.copy()
        x[1:] ^= bits[:-1]
        return _COL.pack(FLOAT, 0, 8, 0.0, 0, 0), x.view(np.uint8).reshape(n, 8).T.tobytes()
    assert q is not None
    order, width, first, second, payload = _encode_int(q)
    return _COL.pack(kind, order, width, s, first, second), payload


def _pack(n: int, cols: Sequence[tuple[bytes, bytes]], level: int) -> bytes:
    body = zlib.compress(b"".join(p for _, p in cols), level)
    return _HEAD.pack(_MAGIC, n, len(cols), zlib.crc32(body)) + b"".join(h for h, _ in cols) + body


def encode_chunk(columns: Sequence[npt.NDArray[np.generic]], scale: float | None = None,
                 level: int = LEVEL) -> bytes:
    """One block: int64 columns exact; float columns quantised by `scale` where they fit, else lossless."""
    n = len(columns[0])
    if any(len(col) != n for col in columns):
        raise ValueError("all columns of a chunk must have the same length")
    return _pack(n, [_encode_col(col, scale) for col in columns], level)


def encode_chunks(columns: Sequence[npt.NDArray[np.generic]], scales: Sequence[float | None],
                  level: int = LEVEL) -> list[bytes]:
    """k chunks at once, the same bytes as k encode_chunk() calls: column c of chunk j is columns[c][:, j]
    (an (n, k) array) or columns[c] itself (an (n,) array shared by all k). The series of one layout share
    their time stamps, so a seal encodes them together: numpy's per-call cost is paid per layout, not per
    series (under process churn most series are short and that cost was most of a seal)."""
    k = len(scales)
    n = len(columns[0])
    enc: list[list[tuple[bytes, bytes]]] = []
    for col in columns:
        if len(col) != n:
            raise ValueError("all columns of a chunk must have the same length")
        if col.ndim == 1:
            enc.append([_encode_col(col, None)] * k if col.dtype.kind in "iu" else [_encode_col(col, s) for s in scales])
        else:
            enc.append(_encode_matrix(col, scales))
    return [_pack(n, [e[j] for e in enc], level) for j in range(k)]


def _encode_matrix(m: npt.NDArray[np.generic], scales: Sequence[float | None]) -> list[tuple[bytes, bytes]]:
    """(head, payload) of each column of m (n, k), as _encode_col(m[:, j], scales[j]) gives them."""
    n, k = m.shape
    out: list[tuple[bytes, bytes] | None] = [None] * k
    if m.dtype.kind in "iu":
        _encode_ints(m.T.astype(np.int64), [1.0] * k, INT, list(range(k)), out)
        return out  # type: ignore[return-value]
    v = m.T.astype(np.float64)  # (k, n), rows contiguous
    sc = np.array([np.nan if s is None else float(s) for s in scales])
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.rint(v * sc[:, None])
        ok = np.isfinite(q).all(axis=1)
        ok[ok] = np.abs(q[ok]).max(axis=1, initial=0.0) < _LIMIT
    if n == 0:
        ok[:] = False
    rows = np.flatnonzero(ok).tolist()
    if rows:
        _encode_ints(q[rows].astype(np.int64), [float(scales[j]) for j in rows], QUANT, rows, out)  # type: ignore[arg-type]
    for j in np.flatnonzero(~ok).tolist():
        out[j] = _encode_col(np.ascontiguousarray(v[j]), None)
    return out  # type: ignore[return-value]


def _encode_ints(q: Int64Array, scales: list[float], kind: int, rows: list[int],
                 out: list[tuple[bytes, bytes] | None]) -> None:
    """_encode_int over the rows of q (r, n), into out[rows[i]]."""
    r, n = q.shape
    if n == 1:
        for i, j in enumerate(rows):
            out[j] = _COL.pack(kind, 1, 1, scales[i], int(q[i, 0]), 0), b""
        return
    d = np.diff(q, axis=1)
    two = np.zeros(r, dtype=bool)
    if n > 2:
        d2 = np.diff(d, axis=1)
        two = np.abs(d2.astype(np.float64)).sum(axis=1) < np.abs(d.astype(np.float64)).sum(axis=1)
    firsts, seconds = q[:, 0].tolist(), d[:, 0].tolist()
    for order, sel in ((1, np.flatnonzero(~two)), (2, np.flatnonzero(two))):
        if not len(sel):
            continue
        u = _zigzag(np.ascontiguousarray((d if order == 1 else d2)[sel]))
        top = u.max(axis=1)
        width = np.where(top < 1 << 8, 1, np.where(top < 1 << 16, 2, np.where(top < 1 << 32, 4, 8)))
        for w in (1, 2, 4, 8):
            pick = np.flatnonzero(width == w)
            if not len(pick):
                continue
            b = u[pick].astype(_UINT[w])
            for p, i in enumerate(sel[pick].tolist()):
                out[rows[i]] = (_COL.pack(kind, order, w, scales[i], firsts[i], seconds[i] if order == 2 else 0),
                                b[p].tobytes())


def decode_chunk(blob: bytes, want: Sequence[bool] | None = None) -> list[npt.NDArray[np.generic] | None]:
    """Inverse of encode_chunk: int64 arrays for INT columns, float64 for the others; a column whose
    `want` flag is False is checked but not decoded (None)."""
    try:
        magic, n, ncols, crc = _HEAD.unpack_from(blob, 0)
        if magic != _MAGIC:
            raise CorruptChunk("bad magic")
        off = _HEAD.size + ncols * _COL.size
        body = memoryview(blob)[off:]
        if zlib.crc32(body) != crc:
            raise CorruptChunk("checksum mismatch")
        raw = zlib.decompress(body)
        out: list[npt.NDArray[np.generic] | None] = []
        pos = 0
        for i in range(ncols):
            kind, order, width, scale, first, second = _COL.unpack_from(blob, _HEAD.size + i * _COL.size)
            size = _payload_len(kind, order, width, n)
            payload = raw[pos:pos + size]
            if len(payload) != size:
                raise CorruptChunk("short payload")
            pos += size
            if want is not None and not want[i]:
                out.append(None)
            elif kind == FLOAT:
                x = np.frombuffer(payload, dtype=np.uint8).reshape(8, n).T.copy().view(np.int64).ravel()
                out.append(np.bitwise_xor.accumulate(x).view(np.float64))
            else:
                q = _decode_int(order, width, first, second, payload, n)
                out.append(q if kind == INT else q / scale)
        if pos != len(raw):
            raise CorruptChunk("trailing bytes")
        return out
    except CorruptChunk:
        raise
    except (struct.error, zlib.error, ValueError, KeyError) as e:
        raise CorruptChunk(str(e)) from e


_STAGE = struct.Struct("<II")


def encode_staging(times: Int64Array, values: FloatArray) -> bytes:
    """A flush's rows of one layout, as they came (float64), lightly compressed: it lives minutes."""
    n, k = values.shape
    return _STAGE.pack(n, k) + zlib.compress(times.tobytes() + np.ascontiguousarray(values).tobytes(), 1)


def decode_staging(blob: bytes) -> tuple[Int64Array, FloatArray]:
    try:
        n, k = _STAGE.unpack_from(blob, 0)
        raw = zlib.decompress(memoryview(blob)[_STAGE.size:])
        if len(raw) != 8 * n * (k + 1):
            raise CorruptChunk("staging rows of the wrong size")
        t = np.frombuffer(raw, dtype=np.int64, count=n)
        v = np.frombuffer(raw, dtype=np.float64, offset=8 * n).reshape(n, k)
        return t, v
    except (struct.error, zlib.error, ValueError) as e:
        raise CorruptChunk(str(e)) from e
