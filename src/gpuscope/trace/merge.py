"""Per-rank traces -> one timeline on one clock (`gpuscope trace merge FILE... --out merged.json.gz`).

    >>> merge(["h.1.rank0.pt.trace.json.gz", "h.2.rank1.pt.trace.json.gz"], "merged.json.gz")  # doctest: +SKIP

Clock: every file goes to epoch µs through its baseTimeNanoseconds (Kineto maps its clock to Unix
time). When the files were written by `gpuscope trace` they carry the pair (time.time_ns(),
time.monotonic_ns()) taken as their profiler started; files of one host are then put on that host's
monotonic clock, so a wall-clock step (NTP) between two ranks' starts does not tear them apart.
Across hosts only the wall clocks can be compared.

Each rank stays apart: its pids become (rank + 1) * 10**7 + pid (so OS pids and Kineto's GPU pids
0..7 of different ranks never collide; the last digits still read as the pid), its process names
start with "rank N", its flow ids are moved to their own 2**32 block. Each file's distributedInfo
and gpuscope facts are kept under the merged file's "gpuscope_merge" key.

Streamed: each file is read once and only one is held at a time. Its events are moved onto the clock,
relabelled, serialized and sorted, and go to a temporary run file (zlib level 1) beside the others; the
output is then written as the runs' merge, event by event, gzip streamed. So memory holds one rank's events
(and, for `gpuscope trace fleet`, each rank's GPU ops for the analyses), whatever the number of ranks. The
output equals what holding every event and sorting them all at once wrote (tests/test_trace_merge_stream.py):
metadata first, then time order, ties in the order the files were given.
"""

from __future__ import annotations

import contextlib
import gzip
import heapq
import os
import re
import shutil
import tempfile
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import orjson

from .._files import kind_of
from ..errors import UsageError
from . import kineto
from .model import GPU_KINDS, Trace, TraceError

PID_BLOCK = 10**7  # above Linux's largest pid (2**22)
FLOW_BLOCK = 2**32  # CUPTI correlation ids are 32-bit
SORT_BLOCK = 10**8  # each rank's process_sort_index values move to their own block
_RANK_IN_NAME = re.compile(r"\.rank(\d+)\.")
# The run files hold a few hundred bytes an event; zlib level 1 makes them a seventh of that at no CPU time that
# the merge's measures (8 ranks: 3.1 s either way), where plain ones would take the merged trace's whole size.
RUN_LEVEL = 1
OUT_LEVEL = 3  # the merged file's gzip level, as perfetto.write_json's
# Run files open at once in the final merge; more ranks are merged in groups first (file descriptors).
MAX_OPEN_RUNS = 256
_WRITE_BYTES = 1 << 20
_READ_BYTES = 32 << 10  # of a compressed run at a time: about 300 kB of lines in memory per open run
_BLOCK_EVENTS = 1 << 16
# A run file's line: the order key (17 characters), the file's index (8 hex digits), the event's JSON; lines
# end in "\n", which orjson never writes inside a document.
_KEY_CHARS = 17 + 8
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_NIBBLES = np.arange(60, -1, -4, dtype=np.uint64)
_EVENTS: Any = object()  # where the events go in the merged document's top level


def rank_of(doc: dict[str, Any], path: str) -> int | None:
    """The rank a trace speaks for: distributedInfo, then gpuscope's key, then '.rankN.' in the name."""
    for holder in (doc.get("distributedInfo"), doc.get("gpuscope")):
        if isinstance(holder, dict) and isinstance(holder.get("rank"), int):
            return int(holder["rank"])
    m = _RANK_IN_NAME.search(os.path.basename(path))
    return int(m.group(1)) if m else None


class _HostClocks:
    """`clock_shifts` one file at a time: the first file seen of each host is that host's reference."""

    def __init__(self) -> None:
        self.reference: dict[str, int] = {}

    def shift_ns(self, facts: dict[str, Any] | None) -> int:
        try:
            host, offset = facts["host"], int(facts["profiler_start_unix_ns"]) - int(facts["profiler_start_monotonic_ns"])  # type: ignore[index]
            return self.reference.setdefault(host, offset) - offset
        except (TypeError, KeyError, ValueError):
            return 0


def clock_shifts(facts: Sequence[dict[str, Any] | None]) -> list[int]:
    """ns to add to each file so that files of one host share that host's monotonic clock (the first
    such file of each host is the reference); 0 for files without the clock pair."""
    clocks = _HostClocks()
    return [clocks.shift_ns(f) for f in facts]


def _order_keys(metadata: np.ndarray, ts: np.ndarray, index: int) -> np.ndarray:
    """Per event, the merge's order (metadata first, then time) and then the file's index as 25 characters
    that sort as (ph != "M", ts, index) does: "0" or "1", the ts's float64 bits turned so that they sort as
    unsigned numbers, in hex, and the index in hex. (An integer ts beyond 2**53 µs, 285 years, counts as the
    nearest float.)"""
    bits = (ts + 0.0).view(np.uint64)  # + 0.0: -0.0 sorts as 0.0
    bits = np.where(bits >> np.uint64(63), ~bits, bits | np.uint64(1 << 63))
    keys = np.empty((len(ts), _KEY_CHARS), dtype=np.uint8)
    keys[:, 0] = np.where(metadata, ord("0"), ord("1"))
    keys[:, 1:17] = _HEX[(bits[:, None] >> _NIBBLES) & np.uint64(15)]
    keys[:, 17:] = np.frombuffer(b"%08x" % index, dtype=np.uint8)
    return keys


class _Run:
    """One file's events moved onto the merged clock and relabelled for `rank`, kept serialized until the file
    is read, then sorted into its run file."""

    def __init__(self, src: str, index: int, rank: int, header: dict[str, Any], base_ns: int, shift_ns: int) -> None:
        self.src, self.index, self.rank, self.header, self.base_ns, self.shift_ns = src, index, rank, header, base_ns, shift_ns
        self.base_us = (base_ns + shift_ns) / 1000.0
        header["baseTimeNanoseconds"] = 0  # as in the merged document: its events are in epoch µs
        # each event's JSON, one after the other in the file's order (one bytes object each would hold 4 kB an
        # event: orjson.dumps allocates that much and does not give back what its document leaves unused)
        self.json = bytearray()
        self.ends = array("q")         # ... where each ends
        self.metadata = array("b")     # ... whether it is metadata ("ph": "M")
        self.times = array("d")        # ... and its ts (0 when it has none), for the order
        self.pids: set[Any] = set()
        self.named: set[Any] = set()
        self.events = 0
        self.path = ""
        self.claimed: int | None = None

    def take(self, events: Iterable[Any]) -> None:
        """The same changes, event by event, as moving the document to epoch µs and relabelling it whole."""
        base_us, base, rank, flow = self.base_us, (self.rank + 1) * PID_BLOCK, self.rank, self.index * FLOW_BLOCK
        pids, named, blob, ends, dumps = self.pids, self.named, self.json, self.ends, orjson.dumps
        metadata, times = self.metadata, self.times
        e: Any = None
        try:
            for e in events:
                if type(e) is not dict:
                    raise TraceError(f"{self.src} is not a usable trace: traceEvents holds {kind_of(e)}, "
                                     "not an event object.")
                ts = e.get("ts")
                if isinstance(ts, int | float):
                    if base_us:
                        ts = e["ts"] = round(ts + base_us, 3)
                    times.append(ts)
                else:
                    times.append(0.0)
                pid = e.get("pid")
                if isinstance(pid, int):
                    pids.add(pid)
                    e["pid"] = base + pid
                elif isinstance(pid, str):  # Kineto's "Spans" row
                    e["pid"] = f"rank {rank} {pid}"
                ph = e.get("ph")
                metadata.append(ph == "M")
                if ph == "M" and isinstance(e.get("args"), dict):
                    if e.get("name") == "process_name":
                        named.add(pid)
                        e["args"]["name"] = f"rank {rank} {e['args'].get('name', '')}".rstrip()
                    elif e.get("name") == "process_sort_index" and isinstance(e["args"].get("sort_index"), int):
                        e["args"]["sort_index"] = rank * SORT_BLOCK + e["args"]["sort_index"]
                if (ph == "s" or ph == "t" or ph == "f") and isinstance(e.get("id"), int):
                    e["id"] = flow + e["id"]
                blob += dumps(e)
                ends.append(len(blob))
        except TypeError:  # an unhashable pid on a process_name
            raise TraceError(f"{self.src} is not a usable trace: an event's pid is {kind_of(e.get('pid'))}.") from None

    def finish(self, directory: str) -> None:
        """Names the pids that had no name, sorts (stable: ties keep the file's order) and writes the run file."""
        for pid in sorted(self.pids - self.named):
            self.take([{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"pid {pid}"}}])
        self.events = len(self.ends)
        ts = np.frombuffer(self.times, dtype=np.float64)
        metadata = np.frombuffer(self.metadata, dtype=np.int8).astype(bool)
        order = np.lexsort((ts, ~metadata))  # stable: ties keep the file's order
        ends = np.frombuffer(self.ends, dtype=np.int64)
        starts = np.concatenate(([0], ends[:-1]))
        self.path = os.path.join(directory, f"{self.index}.run")
        blob, z, nl = memoryview(self.json), zlib.compressobj(RUN_LEVEL), b"\n"
        with open(self.path, "wb") as f:
            for b in range(0, len(order), _BLOCK_EVENTS):
                rows = order[b:b + _BLOCK_EVENTS]
                keys = _order_keys(metadata[rows], ts[rows], self.index).tobytes()
                parts: list[Any] = []
                for k, a, e in zip(range(0, len(keys), _KEY_CHARS), starts[rows].tolist(), ends[rows].tolist(),
                                   strict=True):
                    parts += (keys[k:k + _KEY_CHARS], blob[a:e], nl)
                f.write(z.compress(b"".join(parts)))
            f.write(z.flush())
        del blob
        self.json, self.ends, self.metadata, self.times = bytearray(), array("q"), array("b"), array("d")
        self.pids, self.named = set(), set()


def _lines(f: Any) -> Iterator[bytes]:
    """The lines of a run file (without their "\n"), a block at a time."""
    z, rest = zlib.decompressobj(), b""
    while block := f.read(_READ_BYTES):
        lines = (rest + z.decompress(block)).split(b"\n")
        rest = lines.pop()
        yield from lines
    lines = (rest + z.flush()).split(b"\n")
    if lines.pop():
        raise ValueError("a run file's last line has no end")
    yield from lines


def _rebased(lines: Iterator[bytes], old: int, new: int) -> Iterator[bytes]:
    """A run relabelled for rank `old`, relabelled for rank `new` instead (the ranks are known once every file
    is read: a file without one, or two claiming one, get theirs then)."""
    d_pid, d_sort, was, now = (new - old) * PID_BLOCK, (new - old) * SORT_BLOCK, f"rank {old}", f"rank {new}"
    for line in lines:
        e = orjson.loads(line[_KEY_CHARS:])
        pid = e.get("pid")
        if isinstance(pid, int):
            e["pid"] = pid + d_pid
        elif isinstance(pid, str):
            e["pid"] = now + pid[len(was):]
        a = e.get("args")
        if e.get("ph") == "M" and isinstance(a, dict):
            if e.get("name") == "process_name":
                a["name"] = now + a["name"][len(was):]
            elif e.get("name") == "process_sort_index" and isinstance(a.get("sort_index"), int):
                a["sort_index"] += d_sort
        yield line[:_KEY_CHARS] + orjson.dumps(e)


def _gpu_ops(t: Trace) -> Trace:
    """The rows the fleet's analyses read (stragglers, comm_overlap, arrivals: GPU ops only), without the rest."""
    rows = np.flatnonzero(np.isin(t.events["kind"], GPU_KINDS))
    cols = {k: v[rows] for k, v in t.events.items()}
    cols["parent"] = np.full(len(rows), -1, dtype=np.int64)  # rows of events left out
    return Trace(events=cols, names=t.names, source=t.source, rank=t.rank)


class Merger:
    """Per-rank traces merged as they are read: `add` each file (read once; its events go to a run file), then
    `write` the merged trace. Use it as a context manager: the run files go with it.

        >>> with Merger() as m:  # doctest: +SKIP
        ...     for p in paths:
        ...         m.add(p)
        ...     m.write("merged.json.gz", ranks=[0, 1])
    """

    def __init__(self, work_dir: str | None = None) -> None:
        self.runs: list[_Run] = []
        self._clocks = _HostClocks()
        try:
            self._dir = tempfile.mkdtemp(prefix="gpuscope-merge-", dir=work_dir)
        except OSError as e:
            raise _no_room(work_dir or tempfile.gettempdir(), e) from None

    def __enter__(self) -> Merger:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def add(self, path: str | os.PathLike[str], rank: int | None = None, shift_ns: int | None = None,
            max_bytes: int = kineto.MAX_BYTES, analyse: bool = False) -> tuple[dict[str, Any], Trace | None]:
        """Reads one rank's file, once: -> its top level (without traceEvents) and, with `analyse`, its GPU ops
        as a `Trace` (what the fleet's analyses read). `rank`: the one it speaks for (None: its own, or a place
        given in `write`); `shift_ns`: what to add to its clock (None: onto its host's monotonic clock, as
        `clock_shifts`). A bad file is a TraceError of one sentence, and nothing of it is kept."""
        src = os.fspath(path)
        raw = kineto._read(src, max_bytes)
        split = kineto._split(raw)
        run = trace = None
        if split is not None:
            header, chunks = split
            run = self._start(src, header, rank, shift_ns)
            try:
                trace = self._consume(src, chunks, run, analyse)
            except kineto._SplitFailed:  # a cut between two events fell inside one: the whole file at once
                run = None
            del chunks
        del split
        if run is None:
            header = kineto._parse_whole(src, raw)
            raw = b""
            events = header.pop("traceEvents")
            run = self._start(src, header, rank, shift_ns)
            trace = self._consume(src, iter([events]), run, analyse)
            del events
        raw = b""  # the file's bytes go before its events are sorted and written
        try:
            run.finish(self._dir)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(run.path)
            if isinstance(e, OSError):
                raise _no_room(self._dir, e) from None
            raise
        self.runs.append(run)
        return run.header, trace

    def _start(self, src: str, header: dict[str, Any], rank: int | None, shift_ns: int | None) -> _Run:
        base_ns = kineto._check(src, header)
        facts = header.get("gpuscope") if isinstance(header.get("gpuscope"), dict) else None
        shift = self._clocks.shift_ns(facts) if shift_ns is None else int(shift_ns)
        claimed = rank if rank is not None else rank_of(header, src)
        run = _Run(src, len(self.runs), claimed if claimed is not None else 0, header, base_ns, shift)
        run.claimed = claimed
        return run

    @staticmethod
    def _consume(src: str, chunks: Iterator[list[Any]], run: _Run, analyse: bool) -> Trace | None:
        if not analyse:
            for events in chunks:
                run.take(events)
            return None

        def seen_first() -> Iterator[list[Any]]:  # the Trace is built from the events as the file has them
            for events in chunks:
                yield events
                run.take(events)

        return _gpu_ops(kineto._build(src, seen_first(), run.base_ns))

    def write(self, out_path: str | os.PathLike[str], ranks: Sequence[int]) -> dict[str, Any]:
        """Writes the merged trace of the files added, `ranks` their ranks in the order added (distinct);
        returns what was done per file (rank, events, clock shift). Through a temporary file: no half file."""
        if not self.runs or len(ranks) != len(self.runs):
            raise ValueError("write() needs one rank per file added")
        summary = [{"file": r.src, "rank": rank, "events": r.events, "clock_shift_ns": r.shift_ns,
                    "distributedInfo": r.header.get("distributedInfo"),
                    "gpuscope": r.header.get("gpuscope") if isinstance(r.header.get("gpuscope"), dict) else None}
                   for r, rank in zip(self.runs, ranks, strict=True)]
        first = self.runs[list(ranks).index(min(ranks))].header
        head = {k: v for k, v in first.items() if k not in ("traceEvents", "gpuscope", "traceName")}
        head.update({"traceEvents": _EVENTS, "baseTimeNanoseconds": 0, "displayTimeUnit": "ms",
                     "traceName": os.fspath(out_path), "gpuscope_merge": {"ranks": summary}})
        out = os.fspath(out_path)
        tmp = out + ".tmp"
        try:
            with contextlib.ExitStack() as stack:
                f = stack.enter_context(gzip.open(tmp, "wb", compresslevel=OUT_LEVEL) if out.endswith(".gz")
                                        else open(tmp, "wb"))
                runs = stack.enter_context(contextlib.ExitStack())
                for i, (k, v) in enumerate(head.items()):
                    f.write((b"," if i else b"{") + orjson.dumps(k) + b":")
                    if v is _EVENTS:
                        _write_events(f, heapq.merge(*self._streams(runs, ranks)))
                    else:
                        f.write(orjson.dumps(v))
                f.write(b"}")
            os.replace(tmp, out)
        except BaseException:  # a failed write (disk full, --out a directory) leaves no half file behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return {"out": out, "ranks": summary, "events": sum(r.events for r in self.runs)}

    def _streams(self, files: contextlib.ExitStack, ranks: Sequence[int]) -> list[Iterator[bytes]]:
        """Each run's lines, relabelled where its rank changed; past MAX_OPEN_RUNS, groups merged first."""
        def lines(path: str) -> Iterator[bytes]:
            return _lines(files.enter_context(open(path, "rb")))

        streams = [lines(r.path) if rank == r.rank else _rebased(lines(r.path), r.rank, rank)
                   for r, rank in zip(self.runs, ranks, strict=True)]
        level = 0
        while len(streams) > MAX_OPEN_RUNS:  # the file index in each line keeps ties in the given order
            level += 1
            grouped = []
            for g in range(0, len(streams), MAX_OPEN_RUNS):
                path = os.path.join(self._dir, f"merged.{level}.{g}.run")
                with open(path, "wb") as f:
                    _copy(f, heapq.merge(*streams[g:g + MAX_OPEN_RUNS]))
                grouped.append(path)
            files.close()  # the runs just merged
            streams = [lines(p) for p in grouped]
        return streams


def _no_room(where: str, e: OSError) -> UsageError:
    return UsageError(f"Cannot write the merge's temporary files in {where}: {e.strerror or e} (they take about "
                      "a seventh of the merged trace uncompressed; set TMPDIR to a directory with room).")


def _copy(f: Any, lines: Iterator[bytes]) -> None:
    """Lines into a run file."""
    buf: list[bytes] = []
    z = zlib.compressobj(RUN_LEVEL)
    for line in lines:
        buf.append(line)
        if len(buf) == 4096:
            f.write(z.compress(b"\n".join(buf) + b"\n"))
            buf.clear()
    if buf:
        f.write(z.compress(b"\n".join(buf) + b"\n"))
    f.write(z.flush())


def _write_events(f: Any, lines: Iterator[bytes]) -> None:
    """The events of the merged runs as one JSON array, written a MiB at a time."""
    f.write(b"[")
    buf: list[bytes] = []
    size, sep, cut = 0, b"", _KEY_CHARS
    for line in lines:
        buf.append(line[cut:])
        size += len(line)
        if size > _WRITE_BYTES:
            f.write(sep + b",".join(buf))
            sep, size = b",", 0
            buf.clear()
    if buf:
        f.write(sep + b",".join(buf))
    f.write(b"]")


def _places(claimed: Sequence[int | None]) -> list[int]:
    """Ranks for files that claim none: the places after the known ones, in the given order."""
    free = iter(r for r in range(len(claimed) + max((r for r in claimed if r is not None), default=-1) + 1)
                if r not in claimed)
    return [r if r is not None else next(free) for r in claimed]


def merge(paths: Sequence[str | os.PathLike[str]], out_path: str | os.PathLike[str],
          clock_offsets_ns: Sequence[int] | None = None, ranks: Sequence[int | None] | None = None) -> dict[str, Any]:
    """Writes the merged timeline; returns what was done per file (rank, events, clock shift).

    `clock_offsets_ns`: per file, how far its host's clock was ahead of the caller's, measured (`gpuscope
    trace fleet`): each file is moved back by it onto the caller's clock, instead of the per-host alignment
    above. `ranks`: per file, the rank it speaks for, where the caller knows better than the file (None:
    the file's own)."""
    if not paths:
        raise TraceError("Nothing to merge: give at least one trace file.")
    given = list(ranks) if ranks is not None else [None] * len(paths)
    offsets = list(clock_offsets_ns) if clock_offsets_ns is not None else None
    if len(given) != len(paths) or (offsets is not None and len(offsets) != len(paths)):
        raise ValueError("merge() needs one rank and one clock offset per file")
    with Merger() as m:
        for i, p in enumerate(paths):
            m.add(p, rank=given[i], shift_ns=None if offsets is None else -int(offsets[i]))
        final = _places([r.claimed for r in m.runs])
        dupes = sorted({r for r in final if final.count(r) > 1})
        if dupes:
            raise TraceError(f"Two traces claim rank {dupes[0]}: "
                             f"{', '.join(r.src for r, x in zip(m.runs, final, strict=True) if x == dupes[0])}.")
        return m.write(out_path, final)


HELP = "merge per-rank traces into one timeline on one clock (Perfetto UI, chrome://tracing)"


def add_arguments(p: Any) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="one trace per rank (.json or .json.gz)")
    p.add_argument("--out", default="merged.pt.trace.json.gz", metavar="FILE",
                   help="the merged trace (default merged.pt.trace.json.gz; gzip when it ends in .gz)")


def run(args: Any) -> int:
    """A bad file raises TraceError for the caller to report as one sentence; so does a bad --out."""
    from .._args import check_not_input, check_writable
    from ..errors import UsageError

    check_writable("--out", args.out)  # before reading every rank's trace
    check_not_input("--out", args.out, args.files)
    try:
        done = merge(args.files, args.out)
    except OSError as e:  # the reads turn theirs into TraceError: this is the write
        raise UsageError(f"Cannot write {args.out}: {e.strerror or e}.") from None
    for r in done["ranks"]:
        shift = f", clock moved {r['clock_shift_ns'] / 1000:+.1f} us" if r["clock_shift_ns"] else ""
        print(f"rank {r['rank']}: {r['file']} ({r['events']} events{shift})")
    print(f"wrote {done['out']}: {done['events']} events")
    return 0
