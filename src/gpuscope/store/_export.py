"""Export a time range to Parquet (pyarrow, optional), CSV or JSON lines, one row per sample.

Columns: time_ns, metric, one column per label name (empty where a series lacks it), value and
resolution_s (0 for raw samples; 1, 60 or 3600 where only a rollup still holds that time, the value
then being the bucket mean). JSON lines nest the labels in an object.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import repeat
from pathlib import Path
from typing import IO, Any

import numpy as np

from ._aggregate import Points
from ._config import TIERS
from ._errors import StoreError
from ._read import Reader, check_range

FORMATS = ("parquet", "csv", "jsonl")
_BATCH = 8  # series fetched at once: bounds memory on a day of raw samples


def _pyarrow() -> Any:
    try:
        import pyarrow as pa  # type: ignore[import-untyped,unused-ignore]
        import pyarrow.parquet as pq  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        raise StoreError("Parquet export needs pyarrow, which is not installed; install it with "
                         "`pip install pyarrow`, or export with fmt='csv' or fmt='jsonl'.") from None
    return pa, pq


@contextmanager
def _opened(path: Path) -> Iterator[IO[str]]:
    try:
        f = open(path, "w", newline="", encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        raise StoreError(f"Cannot write the export to {path}: {e.strerror or e}.") from e
    with f:
        yield f


def export(reader: Reader, start_ns: object, end_ns: object, path: str | Path, fmt: str = "parquet",
           metrics: list[str] | None = None) -> int:
    start, end = check_range(start_ns, end_ns)
    if fmt not in FORMATS:
        raise StoreError(f"Unknown export format {fmt!r}; use one of {', '.join(FORMATS)}.")
    path = Path(path)
    if metrics is None:
        found = reader.find(None, {})
    else:
        if isinstance(metrics, str):
            metrics = [metrics]
        found = [r for m in metrics for r in reader.find(m, {})]
    names = sorted({k for _, _, lab in found for k in lab})
    if fmt == "parquet":
        return _parquet(reader, found, names, start, end, path)
    with _opened(path) as f:
        if fmt == "csv":
            w = csv.writer(f)
            w.writerow(["time_ns", "metric", *names, "value", "resolution_s"])
        rows = 0
        for metric, lab, t, v, res in _samples(reader, found, start, end):
            if fmt == "csv":
                w.writerows(zip(t.tolist(), repeat(metric), *(repeat(lab.get(k, "")) for k in names),
                                v.tolist(), repeat(res), strict=False))
            else:
                head = f'{{"time_ns": {{}}, "metric": {json.dumps(metric)}, "labels": {json.dumps(lab, sort_keys=True)}, '
                f.writelines(head.replace("{}", str(ti), 1) + f'"value": {_json_num(vi)}, "resolution_s": {res}}}\n'
                             for ti, vi in zip(t.tolist(), v.tolist(), strict=True))
            rows += len(t)
    return rows


def _json_num(v: float) -> str:
    return repr(v) if math.isfinite(v) else "null"


def _samples(reader: Reader, found: list[tuple[int, str, dict[str, str]]], start: int,
             end: int) -> Iterator[tuple[str, dict[str, str], Any, Any, float]]:
    for k in range(0, len(found), _BATCH):
        part = found[k:k + _BATCH]
        data = reader.fetch([s for s, _, _ in part], start, end, 0)
        for sid, metric, lab in part:
            # one run per tier, in time order: chunks of late samples (a clock stepped back) overlap others
            for tier, run in itertools.groupby(data[sid], key=lambda x: x[0]):
                p = Points.concat([q for _, q in run])
                v = p.mn if p.cnt is None else p.sm / np.maximum(p.cnt, 1)
                yield metric, lab, p.t, v, TIERS[tier].resolution_ns / 1e9


def _parquet(reader: Reader, found: list[tuple[int, str, dict[str, str]]], names: list[str], start: int,
             end: int, path: Path) -> int:
    pa, pq = _pyarrow()
    fields = [pa.field("time_ns", pa.int64()), pa.field("metric", pa.string()),
              *(pa.field(k, pa.string()) for k in names),
              pa.field("value", pa.float64()), pa.field("resolution_s", pa.float64())]
    schema = pa.schema(fields)
    try:
        writer = pq.ParquetWriter(str(path), schema, compression="zstd")
    except OSError as e:
        raise StoreError(f"Cannot write the export to {path}: {e}.") from e
    rows = 0
    with writer:
        for metric, lab, t, v, res in _samples(reader, found, start, end):
            n = len(t)
            cols = [pa.array(t, pa.int64()), pa.array([metric] * n, pa.string()),
                    *(pa.array([lab.get(k)] * n, pa.string()) for k in names),
                    pa.array(v, pa.float64()), pa.array(np.full(n, res), pa.float64())]
            writer.write_table(pa.Table.from_arrays(cols, schema=schema))
            rows += n
    return rows
