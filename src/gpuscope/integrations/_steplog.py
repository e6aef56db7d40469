"""The step log: one record per step, as JSON Lines (written and flushed as steps are joined, so a crash
loses no complete line) or Parquet (row groups as steps come, the footer at stop; needs pyarrow)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

from ..errors import UsageError

#: The step record's fields, in order (see README, "Training loops").
FIELDS: tuple[str, ...] = (
    "step", "start_time", "duration_s", "gpu_busy_ratio", "tensor_active_ratio", "dram_active_ratio",
    "nvml_utilization_ratio", "power_watts", "energy_joules", "memory_used_bytes", "gpu_coverage_ratio",
    "samples", "tokens", "samples_per_second", "tokens_per_second", "phases", "marks", "flags", "gpus",
)


class LogError(UsageError, ValueError):
    """The step log cannot be written where the user asked. One sentence."""


class StepLog(Protocol):
    path: str

    def write(self, cols: dict[str, Any]) -> None:
        """A joined batch as columns (see _joiner.Joiner._join)."""
        ...

    def close(self) -> None: ...


def _num(v: float) -> str:
    return "null" if v != v else repr(v)  # NaN -> null


def _opt(v: int | float | None) -> str:
    """samples/tokens: an int stays an int (the join made them int, float or None)."""
    return "null" if v is None else str(v) if isinstance(v, int) else _num(v)


_NUMS = ("gpu_busy_ratio", "tensor_active_ratio", "dram_active_ratio", "nvml_utilization_ratio", "power_watts",
         "energy_joules", "memory_used_bytes", "gpu_coverage_ratio")


class JsonlLog:
    """One JSON object per line, keys in FIELDS order. Written by hand, not json.dumps: at 100 steps a
    second the encoder was most of the monitor's CPU."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open until close()

    def write(self, cols: dict[str, Any]) -> None:
        n = len(cols["step"])
        if not n:
            return
        gpus = json.dumps(cols["gpus"], separators=(",", ":"))
        nums = [cols[k] for k in _NUMS]
        st, du = cols["start_time"], cols["duration_s"]
        sps, tps = cols["samples_per_second"], cols["tokens_per_second"]
        samples, tokens, phases, marks, flags = cols["samples"], cols["tokens"], cols["phases"], cols["marks"], cols["flags"]
        lines = []
        for i in range(n):
            b, t, dr, u, p, e, m, c = (_num(x[i]) for x in nums)
            lines.append(
                f'{{"step":{cols["step"][i]},"start_time":{st[i]!r},"duration_s":{du[i]!r},"gpu_busy_ratio":{b},'
                f'"tensor_active_ratio":{t},"dram_active_ratio":{dr},"nvml_utilization_ratio":{u},"power_watts":{p},'
                f'"energy_joules":{e},"memory_used_bytes":{m},"gpu_coverage_ratio":{c},"samples":{_opt(samples[i])},'
                f'"tokens":{_opt(tokens[i])},"samples_per_second":{_num(sps[i])},"tokens_per_second":{_num(tps[i])},'
                f'"phases":{json.dumps(phases[i]) if phases[i] else "{}"},'
                f'"marks":{json.dumps(marks[i]) if marks[i] else "[]"},'
                f'"flags":{json.dumps(flags[i]) if flags[i] else "[]"},"gpus":{gpus}}}\n')
        self._f.write("".join(lines))
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
        self._parts: list[Any] = []
        self._rows = 0

    def write(self, cols: dict[str, Any]) -> None:
        n = len(cols["step"])
        if not n:
            return
        pa = self._pa
        arrays = []
        for f in self.schema:
            v = cols[f.name]
            if f.name == "gpus":
                v = [v] * n
            elif f.name == "phases":
                v = [list(p.items()) for p in v]
            elif f.name in ("samples", "tokens"):
                v = [None if x is None else float(x) for x in v]
            arrays.append(pa.array(v, type=f.type, from_pandas=True))  # from_pandas: NaN -> null
        self._parts.append(pa.Table.from_arrays(arrays, schema=self.schema))
        self._rows += n
        if self._rows >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if self._parts:
            self._writer.write_table(self._pa.concat_tables(self._parts))
            self._parts, self._rows = [], 0

    def close(self) -> None:
        try:
            self._flush()
        finally:
            self._writer.close()


def check_log_path(path: str | os.PathLike[str]) -> Path:
    """What can be said before the file is created: its suffix, its directory, pyarrow. Raises LogError."""
    try:
        p = Path(path).expanduser()
    except (TypeError, RuntimeError):  # not a path; RuntimeError: '~user' without a home
        raise LogError(f"The step log must be a file path ending in .jsonl or .parquet, got {path!r}.") from None
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
