"""Kineto / Chrome-trace JSON (plain or gzipped, ours or any PyTorch profiler's) -> `Trace`.

    >>> from gpuscope.trace.kineto import load
    >>> trace = load("tests/fixtures/traces/launch_bound.pt.trace.json.gz")  # doctest: +SKIP

One parse (orjson), one Python pass that appends each complete event's fields to plain lists (names
interned as they come), then numpy does the rest: the typed columns, the sort, the Python-parent rows.
Flows, instants and counters are not rows: the ac2g flows repeat what `args.correlation` already says.
"""

from __future__ import annotations

import gzip
import os
import zlib
from typing import Any

import numpy as np
import orjson

from .model import COLUMNS, EventKind, Trace, TraceError

_KIND_OF_CAT = {
    "cpu_op": EventKind.CPU_OP, "python_function": EventKind.PYTHON, "cuda_runtime": EventKind.RUNTIME,
    "cuda_driver": EventKind.DRIVER, "kernel": EventKind.KERNEL, "gpu_memcpy": EventKind.MEMCPY,
    "gpu_memset": EventKind.MEMSET, "cuda_sync": EventKind.SYNC, "user_annotation": EventKind.ANNOTATION,
    "gpu_user_annotation": EventKind.GPU_ANNOTATION, "overhead": EventKind.OVERHEAD,
}
# Events that Kineto puts on a (device, stream) row: pid = device, tid = stream.
_ON_GPU = frozenset((EventKind.KERNEL, EventKind.MEMCPY, EventKind.MEMSET, EventKind.GPU_ANNOTATION,
                     EventKind.SYNC))
# Kineto writes schemaVersion 1; a file claiming another is a format we have not seen.
_SCHEMA_VERSIONS = (1,)


def load(path: str | os.PathLike[str]) -> Trace:
    """Reads one rank's trace; any problem with the file is a `TraceError` of one sentence."""
    src = os.fspath(path)
    doc = _parse(src)
    events = doc.pop("traceEvents")
    base = doc.get("baseTimeNanoseconds", 0)
    if type(base) is not int:
        raise TraceError(f"{src} is not a usable trace: baseTimeNanoseconds is {base!r}, not an integer.")
    trace = _build(src, events, base)
    del events
    trace.meta.update(doc)
    info = doc.get("distributedInfo")
    rank = info.get("rank") if isinstance(info, dict) else None
    trace.rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else None
    return trace


def _parse(src: str) -> dict[str, Any]:
    try:
        with open(src, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise TraceError(f"Cannot read {src}: there is no such file.") from None
    except IsADirectoryError:
        raise TraceError(f"Cannot read {src}: it is a directory, not a trace file.") from None
    except OSError as e:
        raise TraceError(f"Cannot read {src}: {e.strerror or e}.") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error):
            raise TraceError(f"{src} is a truncated or corrupt gzip file.") from None
    if not raw.strip():
        raise TraceError(f"{src} is empty, not a trace.")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise TraceError(f"{src} is not valid JSON (truncated or corrupt near byte {e.pos}).") from None
    del raw
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise TraceError(f"{src} is JSON but not a Chrome/Kineto trace: it has no traceEvents.")
    if not isinstance(doc["traceEvents"], list):
        raise TraceError(f"{src} is not a usable trace: traceEvents is a {type(doc['traceEvents']).__name__}, "
                         "not a list of events.")
    version = doc.get("schemaVersion", 1)
    if version not in _SCHEMA_VERSIONS or isinstance(version, bool):
        raise TraceError(f"{src} was written by an unknown Kineto schema version ({version!r}); "
                         f"gpuscope reads schema {', '.join(map(str, _SCHEMA_VERSIONS))}.")
    return doc


def _build(src: str, events: list[Any], base_ns: int) -> Trace:
    kind_of_cat, on_gpu, other = _KIND_OF_CAT, _ON_GPU, EventKind.OTHER
    python, memcpy, memset, kernel = EventKind.PYTHON, EventKind.MEMCPY, EventKind.MEMSET, EventKind.KERNEL
    name_ids: dict[str, int] = {}
    kinds: list[int] = []
    names: list[int] = []
    ts: list[Any] = []
    dur: list[Any] = []
    pids: list[Any] = []
    tids: list[Any] = []
    devices: list[Any] = []
    streams: list[Any] = []
    corrs: list[Any] = []
    exts: list[Any] = []
    nbytes: list[Any] = []
    py_ids: list[Any] = []
    py_parents: list[Any] = []
    extras: dict[int, dict[str, Any]] = {}
    process_names: dict[Any, Any] = {}
    thread_names: dict[Any, Any] = {}
    for e in events:
        if type(e) is not dict:
            raise TraceError(f"{src} is not a usable trace: traceEvents holds a {type(e).__name__}, not an event object.")
        ph = e.get("ph")
        if ph != "X":
            if ph == "M":
                a = e.get("args")
                if isinstance(a, dict):
                    if e.get("name") == "process_name":
                        process_names[e.get("pid")] = a.get("name")
                    elif e.get("name") == "thread_name":
                        thread_names[(e.get("pid"), e.get("tid"))] = a.get("name")
            elif not isinstance(ph, str):
                raise TraceError(f"{src} is not a usable trace: an event has no phase (\"ph\").")
            continue
        kind = kind_of_cat.get(e.get("cat"), other)
        name = e.get("name", "")
        nid = name_ids.get(name)
        if nid is None:
            if not isinstance(name, str):
                raise TraceError(f"{src} is not a usable trace: an event's name is {name!r}, not a string.")
            nid = name_ids[name] = len(name_ids)
        a = e.get("args")
        if a is None:
            a = {}
        elif type(a) is not dict:
            raise TraceError(f"{src} is not a usable trace: an event's args is a {type(a).__name__}, not an object.")
        kinds.append(kind)
        names.append(nid)
        ts.append(e.get("ts"))
        dur.append(e.get("dur", 0))
        pid, tid = e.get("pid", -1), e.get("tid", -1)
        pids.append(pid)
        tids.append(tid)
        c = a.get("correlation")
        corrs.append(-1 if c is None else c)
        x = a.get("External id")
        exts.append(-1 if x is None else x)
        if kind in on_gpu:
            d = a.get("device")
            devices.append(pid if d is None else d)
            s = a.get("stream")
            streams.append(tid if s is None else s)
            if kind == kernel or kind == memcpy or kind == memset:
                b = a.get("bytes")
                nbytes.append(-1 if b is None else b)
                extras[len(kinds) - 1] = a
            else:
                nbytes.append(-1)
        else:
            devices.append(-1)
            streams.append(-1)
            nbytes.append(-1)
        if kind == python:
            i, p = a.get("Python id"), a.get("Python parent id")
            py_ids.append(-1 if i is None else i)
            py_parents.append(-1 if p is None else p)
        else:
            py_ids.append(-1)
            py_parents.append(-1)

    cols: dict[str, np.ndarray] = {
        "kind": np.array(kinds, dtype=COLUMNS["kind"]),
        "name": np.array(names, dtype=COLUMNS["name"]),
    }
    del kinds, names
    ts_us = _numbers(src, ts, "ts", required=True)
    del ts
    dur_us = _numbers(src, dur, "dur", required=False)
    del dur
    if len(dur_us) and dur_us.min() < 0:
        raise TraceError(f"{src} is not a usable trace: an event has a negative duration.")
    cols["ts_ns"] = np.rint(ts_us * 1000.0).astype(np.int64) + np.int64(base_ns)
    cols["dur_ns"] = np.rint(dur_us * 1000.0).astype(np.int64)
    del ts_us, dur_us
    cols["pid"] = _ids(pids)
    cols["tid"] = _ids(tids)
    for col, values in (("device", devices), ("stream", streams), ("correlation", corrs), ("external", exts),
                        ("bytes", nbytes)):
        cols[col] = _ints(src, values, col).astype(COLUMNS[col], copy=False)
    del pids, tids, devices, streams, corrs, exts, nbytes
    py_id = _ints(src, py_ids, "Python id")
    py_parent = _ints(src, py_parents, "Python parent id")
    del py_ids, py_parents

    order = np.lexsort((-cols["dur_ns"], cols["ts_ns"]))
    for col in cols:
        cols[col] = cols[col][order]
    cols["parent"] = _parent_rows(py_id[order], py_parent[order])
    rank_of = np.empty(len(order), dtype=np.int64)
    rank_of[order] = np.arange(len(order))
    args = {int(rank_of[i]): a for i, a in extras.items()}
    meta: dict[str, Any] = {"process_names": process_names, "thread_names": thread_names}
    return Trace(events=cols, names=list(name_ids), args=args, meta=meta, source=src)


def _numbers(src: str, values: list[Any], key: str, required: bool) -> np.ndarray:
    arr = np.array(values)
    if arr.dtype.kind in "iuf" and arr.ndim == 1:
        return arr.astype(np.float64, copy=False)
    if len(values) == 0:
        return np.zeros(0, dtype=np.float64)
    bad = next(v for v in values if type(v) not in (int, float))
    if bad is None and required:
        raise TraceError(f"{src} is not a usable trace: a complete event has no \"{key}\".")
    raise TraceError(f"{src} is not a usable trace: an event's \"{key}\" is {bad!r}, not a number.")


def _ints(src: str, values: list[Any], key: str) -> np.ndarray:
    try:
        arr = np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        bad = next((v for v in values if type(v) is not int), None)
        raise TraceError(f"{src} is not a usable trace: an event's \"{key}\" is {bad!r}, not an integer.") from None
    return arr


def _ids(values: list[Any]) -> np.ndarray:
    """pid/tid: integers, except that Kineto labels its own span rows with strings ("Spans"): those get -1."""
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return np.array([v if type(v) is int else -1 for v in values], dtype=np.int64)


def _parent_rows(py_id: np.ndarray, py_parent: np.ndarray) -> np.ndarray:
    """Row of each Python event's enclosing python_function, from Kineto's "Python id"/"Python parent id"."""
    parent = np.full(len(py_id), -1, dtype=np.int64)
    rows = np.flatnonzero(py_id >= 0)
    if len(rows) == 0:
        return parent
    ids = py_id[rows]
    by_id = np.argsort(ids, kind="stable")
    sorted_ids = ids[by_id]
    wanted = py_parent[rows]
    pos = np.searchsorted(sorted_ids, wanted)
    pos[pos == len(sorted_ids)] = 0
    found = (wanted >= 0) & (sorted_ids[pos] == wanted)
    parent[rows[found]] = rows[by_id[pos[found]]]
    return parent
