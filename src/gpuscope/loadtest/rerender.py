"""Write a run's report again from its output directory (`gpuscope loadtest --report-from DIR`): after
a run made where the chart library was missing, or to get the page of an older run with a newer gpuscope.

It reads DIR/summary.json (required), DIR/records.jsonl and DIR/gpu.jsonl (each optional: without
records the latency plots are empty, without readings the GPU panels say why) and writes DIR/report.html.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from ..errors import UsageError
from .jsonl import json_lines
from .records import GpuReading, RequestRecord


class RerenderError(UsageError):
    """A directory that is not a load test's output: one sentence."""


def _lines(path: Path) -> list[dict[str, Any]]:
    """A run's JSON Lines file as objects ([] when the run wrote none)."""
    if not path.exists():
        return []
    out = []
    for n, obj in json_lines(path, f"the file {path}", RerenderError):
        if not isinstance(obj, dict):
            raise RerenderError(f"Line {n} of {path} is not a JSON object.")
        out.append(obj)
    return out


def rerender(out_dir: str | Path, gpus: Sequence[str] | None = None) -> Path:
    """Write out_dir/report.html from the run's files; return its path. With `gpus`, the page's GPU
    figures are computed from gpu.jsonl for those GPUs only. summary.json is left as the run wrote it."""
    d = Path(out_dir)
    try:
        summary = orjson.loads((d / "summary.json").read_bytes())
    except FileNotFoundError:
        raise RerenderError(f"{d} holds no summary.json: it is not a gpuscope loadtest output directory.") from None
    except orjson.JSONDecodeError:
        raise RerenderError(f"{d / 'summary.json'} is not valid JSON.") from None
    except OSError as e:
        raise RerenderError(f"Cannot read {d / 'summary.json'}: {e.strerror or e}.") from None
    if not isinstance(summary, dict) or summary.get("tool") != "gpuscope loadtest":
        raise RerenderError(f"{d / 'summary.json'} is not a gpuscope loadtest summary.")
    try:
        fields = GpuReading.__dataclass_fields__
        readings = [GpuReading(**{k: v for k, v in o.items() if k in fields}) for o in _lines(d / "gpu.jsonl")]
    except TypeError as e:
        raise RerenderError(f"{d} holds records of another shape ({e}).") from None
    if gpus:
        have = {r.gpu for r in readings}
        missing = sorted(set(gpus) - have)
        if missing:
            raise RerenderError(f"{d / 'gpu.jsonl'} holds no readings of GPU {', '.join(missing)} "
                                f"(it has {', '.join(sorted(have)) or 'none'}).")
        readings = [r for r in readings if r.gpu in set(gpus)]
        summary["gpu_source"] = f"{summary.get('gpu_source') or ''}; shown for GPU {', '.join(gpus)} only (--gpus)"
    if readings:  # the stage figures as this version computes them (per GPU, idle GPUs named)
        from .gpu import join_stages

        join_stages(summary, readings)
    from .report import write_html

    path = d / "report.html"
    write_html(str(path), summary, _records(d / "records.jsonl"), readings)
    return path


def _records(path: Path) -> Iterator[RequestRecord]:
    """records.jsonl as a stream (a long run's records need not fit in memory); none when the run wrote none."""
    if not path.exists():
        return
    for n, obj in json_lines(path, f"the file {path}", RerenderError):
        if not isinstance(obj, dict):
            raise RerenderError(f"Line {n} of {path} is not a JSON object.")
        try:
            yield RequestRecord.from_json(obj)
        except TypeError as e:
            raise RerenderError(f"Line {n} of {path} holds a record of another shape ({e}).") from None
