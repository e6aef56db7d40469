"""The step log: one record per step, as JSON Lines (written and flushed as steps are joined, so a crash
loses no complete line) or Parquet (row groups as steps come, the footer at stop; needs pyarrow)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

#: The step record's fields, in order (see README, "Training loops").
FIELDS: tuple[str, ...] = (
    "step", "start_time", "duration_s", "gpu_busy_ratio", "tensor_active_ratio", "dram_active_ratio",
    "nvml_utilization_ratio", "power_watts", "energy_joules", "memory_used_bytes", "gpu_coverage_ratio",
    "samples", "tokens", "samples_per_second", "tokens_per_second", "phases", "marks", "flags", "gpus",
)


class LogError(ValueError):
    """The step log cannot be written where the user asked. One sentence."""


class StepLog(Protocol):
    path: str

    def write(self, records: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def _clean(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


class JsonlLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open until close()

    def write(self, records: list[dict[str, Any]]) -> None:
        if records:
            self._f.write("".join(json.dumps({k: _clean(r[k]) for k in FIELDS}, separators=(",", ":")) + "\n"
                                  for r in records))
            self._f.flush()

    def close(self) -> None:
        self._f.close()


ROW_GROUP = 10_000


class ParquetLog:
    def __init__(self, path: str, pa: Any, pq: Any) -> None:
        self.path = path
        self._pa = pa
        f64, s = pa.float64(), pa.string()
        self.schema = pa.schema([
            ("step", pa.int64()), ("start_time", f64), ("duration_s", f64), ("gpu_busy_ratio", f64),
            ("tensor_active_ratio", f64), ("dram_active_ratio", f64), ("nvml_utilization_ratio", f64),
            ("power_watts", f64), ("energy_joules", f64), ("memory_used_bytes", f64), ("gpu_coverage_ratio", f64),
            ("samples", f64), ("tokens", f64), ("samples_per_second", f64), ("tokens_per_second", f64),
            ("phases", pa.map_(s, f64)), ("marks", pa.list_(s)), ("flags", pa.list_(s)), ("gpus", pa.list_(s)),
        ])
        self._writer = pq.ParquetWriter(path, self.schema)
        self._rows: list[dict[str, Any]] = []

    def write(self, records: list[dict[str, Any]]) -> None:
        self._rows.extend(records)
        if len(self._rows) >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            rows = [{k: _clean(r[k]) if k != "phases" else list(r[k].items()) for k in FIELDS} for r in self._rows]
            self._writer.write_table(self._pa.Table.from_pylist(rows, schema=self.schema))
            self._rows = []

    def close(self) -> None:
        try:
            self._flush()
        finally:
            self._writer.close()


def check_log_path(path: str | os.PathLike[str]) -> Path:
    """What can be said before the file is created: its suffix, its directory, pyarrow. Raises LogError."""
    p = Path(path).expanduser()
    suffix = p.suffix.lower()
    if suffix not in (".jsonl", ".ndjson", ".json", ".parquet", ".pq"):
        raise LogError(f"The step log {str(path)!r} must end in .jsonl or .parquet.")
    if not p.parent.is_dir():
        raise LogError(f"Cannot write the step log {str(path)!r}: the directory {str(p.parent)!r} does not exist.")
    if p.is_dir():
        raise LogError(f"Cannot write the step log {str(path)!r}: it is a directory.")
    if suffix in (".parquet", ".pq"):
        try:
            import pyarrow  # noqa: F401
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise LogError(f"A Parquet step log needs pyarrow (pip install pyarrow); use {p.stem}.jsonl "
                           "without it.") from None
    return p


def open_log(path: str | os.PathLike[str]) -> StepLog:
    """The writer for `path` by its suffix: .jsonl/.ndjson/.json or .parquet/.pq. Raises LogError."""
    p = check_log_path(path)
    if p.suffix.lower() in (".parquet", ".pq"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return ParquetLog(str(p), pa, pq)
        except OSError as e:
            raise LogError(f"Cannot write the step log {str(path)!r}: {e.strerror or e}.") from None
    try:
        return JsonlLog(str(p))
    except OSError as e:
        raise LogError(f"Cannot write the step log {str(path)!r}: {e.strerror or e}.") from None
