"""A Kineto trace with the GPU's own metrics beside it, as one Chrome/Perfetto JSON timeline.

    >>> with_counters("host.123.pt.trace.json.gz", snapshots, "host.123.perfetto.json.gz")  # doctest: +SKIP

Perfetto UI (ui.perfetto.dev, "Open trace file") and chrome://tracing read the result. Every event is
moved to one clock, epoch microseconds (ts_epoch_us = baseTimeNanoseconds / 1000 + ts, the file's
baseTimeNanoseconds then 0), so traces and sampler snapshots (epoch ns) line up, and merged ranks too.
The sampler's metrics become counter events ("ph": "C") on one process track per GPU, named
"GPU <i> metrics (gpuscope)": SM active, tensor and DRAM activity (GPM), NVML utilization, power,
memory and PCIe rates, so a kernel gap can be read against what the GPU itself measured.
"""

from __future__ import annotations

import contextlib
import gzip
import os
from collections.abc import Iterable
from typing import Any

import orjson

from .kineto import _parse

#: (counter track name, sampler series key, factor from base units to the track's unit)
METRICS = (
    ("SM active %", "gpu_sm_active_ratio", 100.0),
    ("Tensor active %", "gpu_tensor_active_ratio", 100.0),
    ("DRAM active %", "gpu_dram_active_ratio", 100.0),
    ("NVML utilization %", "gpu_utilization_ratio", 100.0),
    ("Power W", "gpu_power_watts", 1.0),
    ("Memory used GiB", "gpu_memory_used_bytes", 1.0 / 2**30),
    ("PCIe TX MB/s", "gpu_pcie_tx_bytes_per_second", 1e-6),
    ("PCIe RX MB/s", "gpu_pcie_rx_bytes_per_second", 1e-6),
)
#: Counter tracks get pids far above any OS pid (at most 2**22 on Linux) and Kineto's device pids.
COUNTER_PID_BASE = 1_000_000_000
#: Samples this far outside the trace's span are left out: a 10 s window of a day-long run stays 10 s.
MARGIN_NS = 2_000_000_000

Point = tuple[int, str, dict[str, float]]  # (epoch ns, GPU label, {counter track name: value})


def points(samples: Iterable[Any]) -> list[Point]:
    """Sampler snapshots (anything with .time_ns and .gpus[*].identity.label/.values) or points
    already -> points; unsupported or missing values are left out."""
    out: list[Point] = []
    for s in samples:
        if isinstance(s, tuple):
            out.append(s)
            continue
        for g in s.gpus:
            values = {name: g.values[key] * factor for name, key, factor in METRICS
                      if isinstance(g.values.get(key), int | float) and g.values[key] == g.values[key]}
            if values:
                out.append((int(g.time_ns or s.time_ns), g.identity.label, values))
    return out


def load_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The trace file as a dict (plain or gzip JSON); a bad file is a TraceError of one sentence."""
    return _parse(os.fspath(path))


def to_epoch_us(doc: dict[str, Any], shift_ns: int = 0) -> None:
    """Moves every event of `doc` to epoch µs in place (plus `shift_ns`); baseTimeNanoseconds becomes 0."""
    base_us = (int(doc.get("baseTimeNanoseconds") or 0) + shift_ns) / 1000.0
    if base_us:
        for e in doc["traceEvents"]:
            ts = e.get("ts")
            if isinstance(ts, int | float):
                e["ts"] = round(ts + base_us, 3)
    doc["baseTimeNanoseconds"] = 0


def span_us(events: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(first start, last end) of the timed events, in their clock."""
    lo = hi = None
    for e in events:
        ts = e.get("ts")
        if e.get("ph") == "M" or not isinstance(ts, int | float):
            continue
        end = ts + (e.get("dur") or 0)
        lo = ts if lo is None or ts < lo else lo
        hi = end if hi is None or end > hi else hi
    return None if lo is None or hi is None else (lo, hi)


def counter_events(pts: Iterable[Point], lo_us: float | None = None, hi_us: float | None = None) -> list[dict[str, Any]]:
    """Perfetto/Chrome counter events (epoch µs) for the points inside [lo_us, hi_us] ± MARGIN_NS,
    with the metadata naming each GPU's track."""
    out: list[dict[str, Any]] = []
    tracks: dict[str, int] = {}
    margin_us = MARGIN_NS / 1000.0
    for t_ns, label, values in sorted(pts, key=lambda p: p[0]):
        ts = t_ns / 1000.0
        if (lo_us is not None and ts < lo_us - margin_us) or (hi_us is not None and ts > hi_us + margin_us):
            continue
        pid = tracks.get(label)
        if pid is None:
            pid = tracks[label] = COUNTER_PID_BASE + (int(label) if label.isdigit() else len(tracks) + 1000)
            out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                        "args": {"name": f"GPU {label} metrics (gpuscope)"}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                        "args": {"sort_index": pid}})
        for name, v in values.items():
            out.append({"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": round(ts, 3), "args": {"value": v}})
    return out


def write_json(doc: dict[str, Any], out_path: str | os.PathLike[str]) -> None:
    """Writes `doc` as JSON, gzip when the name ends in .gz, through a temporary file (no half file)."""
    out = os.fspath(out_path)
    raw = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    tmp = out + ".tmp"
    try:
        if out.endswith(".gz"):
            with gzip.open(tmp, "wb", compresslevel=3) as f:
                f.write(raw)
        else:
            with open(tmp, "wb") as f:
                f.write(raw)
        os.replace(tmp, out)
    except BaseException:  # a failed write (disk full, --out a directory) leaves no half file behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def with_counters(trace_json_path: str | os.PathLike[str], samples: Iterable[Any],
                  out_path: str | os.PathLike[str]) -> int:
    """Writes the trace on the epoch-µs clock plus the samples' GPU metrics as counter tracks to
    `out_path` (gzip if it ends in .gz); returns the number of counter events written."""
    doc = load_json(trace_json_path)
    to_epoch_us(doc)
    span = span_us(doc["traceEvents"])
    counters = counter_events(points(samples), *(span or (None, None)))
    doc["traceEvents"].extend(counters)
    doc["displayTimeUnit"] = doc.get("displayTimeUnit") or "ms"
    write_json(doc, out_path)
    return sum(1 for e in counters if e["ph"] == "C")
