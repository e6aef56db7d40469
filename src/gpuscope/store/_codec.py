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


def encode_chunk(columns: Sequence[npt.NDArray[np.generic]], scale: float | None = None,
                 level: int = LEVEL) -> bytes:
    """One block: int64 columns exact; float columns quantised by `scale` where they fit, else lossless."""
    n = len(columns[0])
    heads, parts = [], []
    for col in columns:
        if len(col) != n:
            raise ValueError("all columns of a chunk must have the same length")
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
            heads.append(_COL.pack(FLOAT, 0, 8, 0.0, 0, 0))
            parts.append(x.view(np.uint8).reshape(n, 8).T.tobytes())
        else:
            assert q is not None
            order, width, first, second, payload = _encode_int(q)
            heads.append(_COL.pack(kind, order, width, s, first, second))
            parts.append(payload)
    body = zlib.compress(b"".join(parts), level)
    return _HEAD.pack(_MAGIC, n, len(columns), zlib.crc32(body)) + b"".join(heads) + body


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
