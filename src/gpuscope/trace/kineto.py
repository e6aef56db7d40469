"""Kineto / Chrome-trace JSON (plain or gzipped, ours or any PyTorch profiler's) -> `Trace`.

    >>> from gpuscope.trace.kineto import load
    >>> trace = load("tests/fixtures/traces/launch_bound.pt.trace.json.gz")
    >>> len(trace) > 0
    True

One parse (orjson), one Python pass that appends each complete event's fields to plain lists (names
interned as they come), then numpy does the rest: the typed columns, the sort, the Python-parent rows.
Flows, instants and counters are not rows: the ac2g flows repeat what `args.correlation` already says.
"""

from __future__ import annotations

import gzip
import os
import re
import zlib
from array import array
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson

from .._files import kind_of
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


#: The most a trace may be, uncompressed: about 8 M events. A bigger file (or a gzip bomb) would take
#: several times this in memory to analyse; the agent, which reads what others write, asks for less.
MAX_BYTES = 4 << 30


def load(path: str | os.PathLike[str], max_bytes: int = MAX_BYTES) -> Trace:
    """Reads one rank's trace; any problem with the file is a `TraceError` of one sentence."""
    src = os.fspath(path)
    raw = _read(src, max_bytes)
    split = _split(raw)
    trace = None
    if split is not None:
        doc, chunks = split
        try:
            trace = _build(src, chunks, _check(src, doc))
        except _SplitFailed:
            trace = None
    if trace is None:
        doc = _parse_whole(src, raw)
        del raw
        trace = _build(src, iter([doc.pop("traceEvents")]), _check(src, doc))
    trace.meta.update(doc)
    info = doc.get("distributedInfo")
    rank = info.get("rank") if isinstance(info, dict) else None
    trace.rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else None
    return trace


def _parse(src: str) -> dict[str, Any]:
    """The whole document, checked like `load` checks it (perfetto.py rewrites whole documents)."""
    doc = _parse_whole(src, _read(src))
    _check(src, doc)
    return doc


def _read(src: str, max_bytes: int = MAX_BYTES) -> bytes:
    too_big = TraceError(f"{src} is larger than {max_bytes / 2**20:.0f} MiB uncompressed; "
                         "trace a shorter window (gpuscope trace --duration) to analyse it.")
    try:
        with open(src, "rb") as f:
            raw = f.read(max_bytes + 1)
            if raw[:2] == b"\x1f\x8b":
                f.seek(0)
                raw = _gunzip(src, f, max_bytes)
    except FileNotFoundError:
        raise TraceError(f"Cannot read {src}: there is no such file.") from None
    except IsADirectoryError:
        raise TraceError(f"Cannot read {src}: it is a directory, not a trace file.") from None
    except OSError as e:
        raise TraceError(f"Cannot read {src}: {e.strerror or e}.") from None
    if len(raw) > max_bytes:
        raise too_big
    if not raw.strip():
        raise TraceError(f"{src} is empty, not a trace.")
    return raw


def _gunzip(src: str, f: Any, max_bytes: int) -> bytes:
    """Decompressed in pieces, stopping past `max_bytes`: a small file cannot expand into all memory."""
    out = bytearray()
    try:
        with gzip.GzipFile(fileobj=f) as z:
            while piece := z.read(1 << 20):
                out += piece
                if len(out) > max_bytes:
                    break
    except (EOFError, OSError, zlib.error):
        raise TraceError(f"{src} is a truncated or corrupt gzip file.") from None
    return bytes(out)


class _SplitFailed(Exception):
    """A chunk of traceEvents did not parse on its own: parse the whole file instead."""


_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_BOUNDARY = re.compile(rb"\}\s*,\s*\{")
_CHUNK_BYTES = 4 << 20
# Times in ns are int64: a base, stamp or duration past 2**62 ns (146 years) is no trace of ours and
# would overflow (or wrap around) once added up.
_MAX_NS = 1 << 62


def _split(raw: bytes) -> tuple[dict[str, Any], Iterator[list[Any]]] | None:
    """The document without its events, and the events parsed a few MB at a time.

    Parsing the whole file at once holds every event as a Python dict at the same time (about 1.5 kB
    each: gigabytes for a million events); a chunk at a time holds a few thousand. A cut between two
    events is a guess ("}, {" could sit inside a string or a nested list), but a wrong cut always leaves
    a chunk that is not valid JSON on its own, and then `load` parses the whole file instead.
    """
    m = _EVENTS_KEY.search(raw)
    if m is None:
        return None
    end = len(raw)
    for _ in range(8):  # the array's "]" is the last one after which the rest of the document parses
        end = raw.rfind(b"]", m.end(), end)
        if end < 0:
            return None
        try:
            doc = orjson.loads(raw[: m.start()] + b'"traceEvents": []' + raw[end + 1:])
        except orjson.JSONDecodeError:
            continue
        if isinstance(doc, dict) and doc.pop("traceEvents", None) == []:
            return doc, _chunks(raw, m.end(), end)
        return None
    return None


def _chunks(raw: bytes, pos: int, end: int) -> Iterator[list[Any]]:
    while pos < end:
        cut = _BOUNDARY.search(raw, pos + _CHUNK_BYTES, end) if end - pos > _CHUNK_BYTES else None
        try:
            events = orjson.loads(b"[" + raw[pos: cut.start() + 1 if cut else end] + b"]")
        except orjson.JSONDecodeError:
            raise _SplitFailed from None
        yield events
        pos = cut.end() - 1 if cut else end


def _parse_whole(src: str, raw: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise TraceError(f"{src} is not valid JSON (truncated or corrupt near byte {e.pos}).") from None
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise TraceError(f"{src} is JSON but not a Chrome/Kineto trace: it has no traceEvents.")
    if not isinstance(doc["traceEvents"], list):
        raise TraceError(f"{src} is not a usable trace: traceEvents is {kind_of(doc['traceEvents'])}, "
                         "not a list of events.")
    return doc


def _check(src: str, doc: dict[str, Any]) -> int:
    """The top level's version and base time; -> baseTimeNanoseconds."""
    version = doc.get("schemaVersion", 1)
    if version not in _SCHEMA_VERSIONS or isinstance(version, bool):
        raise TraceError(f"{src} was written by an unknown Kineto schema version ({version!r}); "
                         f"gpuscope reads schema {', '.join(map(str, _SCHEMA_VERSIONS))}.")
    base = doc.get("baseTimeNanoseconds", 0)
    if type(base) is not int or not 0 <= base < _MAX_NS:
        raise TraceError(f"{src} is not a usable trace: baseTimeNanoseconds is {base!r}, not an integer "
                         "number of nanoseconds.")
    return base


# What Trace.args keeps of a GPU op's args (the rest is in the columns or of no use to an analysis);
# of a python_function's, only "line" (the calling line, where the writer knew it).
_KEPT_ARGS = ("grid", "block", "registers per thread", "shared memory", "est. achieved occupancy %",
              "blocks per SM", "warps per SM", "memory bandwidth (GB/s)")


def _build(src: str, chunks: Iterator[list[Any]], base_ns: int) -> Trace:
    kind_of_cat, on_gpu, other = _KIND_OF_CAT, _ON_GPU, EventKind.OTHER
    python, memcpy, memset, kernel = EventKind.PYTHON, EventKind.MEMCPY, EventKind.MEMSET, EventKind.KERNEL
    kept_args = _KEPT_ARGS
    name_ids: dict[str, int] = {}
    # array.array: 8 bytes a value instead of a list slot plus a Python number, and a wrong type
    # (a string ts) fails on append
    kinds, names = array("b"), array("i")
    ts, dur = array("d"), array("d")
    pids: list[Any] = []
    tids: list[Any] = []
    devices, streams, corrs, exts, nbytes, py_ids, py_parents = (array("q") for _ in range(7))
    extras: dict[int, dict[str, Any]] = {}
    process_names: dict[Any, Any] = {}
    thread_names: dict[Any, Any] = {}
    n = 0
    e: Any = None
    try:
        for events in chunks:
            for e in events:
                if type(e) is not dict:
                    raise TraceError(f"{src} is not a usable trace: traceEvents holds {kind_of(e)}, "
                                     "not an event object.")
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
                    raise TraceError(f"{src} is not a usable trace: an event's args is {kind_of(a)}, "
                                     "not an object.")
                ts.append(e.get("ts"))
                dur.append(e.get("dur", 0))
                c = a.get("correlation")
                corrs.append(-1 if c is None else c)
                x = a.get("External id")
                exts.append(-1 if x is None else x)
                pid, tid = e.get("pid", -1), e.get("tid", -1)
                if kind in on_gpu:
                    d = a.get("device")
                    devices.append(pid if d is None else d)
                    s = a.get("stream")
                    streams.append(tid if s is None else s)
                    if kind == kernel or kind == memcpy or kind == memset:
                        b = a.get("bytes")
                        nbytes.append(-1 if b is None else b)
                        extras[n] = {k: a[k] for k in kept_args if k in a}
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
                    line = a.get("line")
                    if type(line) is int and line > 0:
                        # The CUPTI backend's frames carry the exact calling line (the frame name has only
                        # the function's first line); the PyTorch profiler's do not.
                        extras[n] = {"line": line}
                else:
                    py_ids.append(-1)
                    py_parents.append(-1)
                pids.append(pid)
                tids.append(tid)
                kinds.append(kind)
                names.append(nid)
                n += 1
    except (TypeError, OverflowError):
        raise TraceError(f"{src} is not a usable trace: {_what_is_wrong(e)}.") from None

    cols: dict[str, np.ndarray] = {
        "kind": np.frombuffer(kinds, dtype=np.int8)[:n].astype(COLUMNS["kind"]),
        "name": np.frombuffer(names, dtype=np.int32)[:n].astype(COLUMNS["name"]),
    }
    ts_us = np.frombuffer(ts, dtype=np.float64)[:n]
    dur_us = np.frombuffer(dur, dtype=np.float64)[:n]
    if n and dur_us.min() < 0:
        raise TraceError(f"{src} is not a usable trace: an event has a negative duration.")
    if n and max(np.abs(ts_us).max(), dur_us.max()) * 1000.0 >= _MAX_NS:
        raise TraceError(f"{src} is not a usable trace: an event's time stamp or duration is out of range "
                         "(beyond a century).")
    cols["ts_ns"] = np.rint(ts_us * 1000.0).astype(np.int64) + np.int64(base_ns)
    cols["dur_ns"] = np.rint(dur_us * 1000.0).astype(np.int64)
    del ts, dur, ts_us, dur_us
    cols["pid"] = _ids(pids)
    cols["tid"] = _ids(tids)
    del pids, tids
    for col, values in (("device", devices), ("stream", streams), ("correlation", corrs), ("external", exts),
                        ("bytes", nbytes)):
        cols[col] = np.frombuffer(values, dtype=np.int64)[:n].astype(COLUMNS[col])
    del devices, streams, corrs, exts, nbytes
    py_id = np.frombuffer(py_ids, dtype=np.int64)[:n]
    py_parent = np.frombuffer(py_parents, dtype=np.int64)[:n]

    order = np.lexsort((-cols["dur_ns"], cols["ts_ns"]))
    for col in cols:
        cols[col] = cols[col][order]
    cols["parent"] = _parent_rows(py_id[order], py_parent[order])
    rank_of = np.empty(len(order), dtype=np.int64)
    rank_of[order] = np.arange(len(order))
    args = {int(rank_of[i]): a for i, a in extras.items()}
    meta: dict[str, Any] = {"process_names": process_names, "thread_names": thread_names}
    return Trace(events=cols, names=list(name_ids), args=args, meta=meta, source=src)


def _what_is_wrong(e: dict[str, Any]) -> str:
    """The clause naming the field of event `e` that has the wrong type (the pass failed on it)."""
    if "ts" not in e:
        return 'a complete event has no "ts"'
    for key in ("ts", "dur"):
        v = e.get(key, 0)
        if type(v) not in (int, float):
            return f'an event\'s "{key}" is {v!r}, not a number'
    a = e.get("args") or {}
    for key in ("correlation", "External id", "device", "stream", "bytes", "Python id", "Python parent id"):
        v = a.get(key)
        if v is not None and type(v) is not int:
            return f'an event\'s "{key}" is {v!r}, not an integer'
    for key in ("pid", "tid"):
        v = e.get(key)
        if type(v) is not int:
            return f'an event\'s "{key}" is {v!r}, not an integer'
    return "an event has a field of the wrong type"


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
