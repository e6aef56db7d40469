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
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from .model import TraceError
from .perfetto import load_json, to_epoch_us, write_json

PID_BLOCK = 10**7  # above Linux's largest pid (2**22)
FLOW_BLOCK = 2**32  # CUPTI correlation ids are 32-bit
_RANK_IN_NAME = re.compile(r"\.rank(\d+)\.")


def rank_of(doc: dict[str, Any], path: str) -> int | None:
    """The rank a trace speaks for: distributedInfo, then gpuscope's key, then '.rankN.' in the name."""
    for holder in (doc.get("distributedInfo"), doc.get("gpuscope")):
        if isinstance(holder, dict) and isinstance(holder.get("rank"), int):
            return int(holder["rank"])
    m = _RANK_IN_NAME.search(os.path.basename(path))
    return int(m.group(1)) if m else None


def clock_shifts(facts: Sequence[dict[str, Any] | None]) -> list[int]:
    """ns to add to each file so that files of one host share that host's monotonic clock (the first
    such file of each host is the reference); 0 for files without the clock pair."""
    reference: dict[str, int] = {}
    shifts = []
    for f in facts:
        try:
            host, offset = f["host"], int(f["profiler_start_unix_ns"]) - int(f["profiler_start_monotonic_ns"])
        except (TypeError, KeyError, ValueError):
            shifts.append(0)
            continue
        shifts.append(reference.setdefault(host, offset) - offset)
    return shifts


def _relabel(doc: dict[str, Any], rank: int, index: int) -> None:
    base = (rank + 1) * PID_BLOCK
    named: set[Any] = set()
    pids: set[Any] = set()
    for e in doc["traceEvents"]:
        pid = e.get("pid")
        if isinstance(pid, int):
            pids.add(pid)
            e["pid"] = base + pid
        elif isinstance(pid, str):  # Kineto's "Spans" row
            e["pid"] = f"rank {rank} {pid}"
        if e.get("ph") == "M" and isinstance(e.get("args"), dict):
            if e.get("name") == "process_name":
                named.add(pid)
                e["args"]["name"] = f"rank {rank} {e['args'].get('name', '')}".rstrip()
            elif e.get("name") == "process_sort_index" and isinstance(e["args"].get("sort_index"), int):
                e["args"]["sort_index"] = rank * 10**8 + e["args"]["sort_index"]
        if e.get("ph") in ("s", "t", "f") and isinstance(e.get("id"), int):
            e["id"] = index * FLOW_BLOCK + e["id"]
    for pid in sorted(pids - named):
        doc["traceEvents"].append({"ph": "M", "name": "process_name", "pid": base + pid, "tid": 0,
                                   "args": {"name": f"rank {rank} pid {pid}"}})


def merge(paths: Sequence[str | os.PathLike[str]], out_path: str | os.PathLike[str],
          clock_offsets_ns: Sequence[int] | None = None, ranks: Sequence[int | None] | None = None) -> dict[str, Any]:
    """Writes the merged timeline; returns what was done per file (rank, events, clock shift).

    `clock_offsets_ns`: per file, how far its host's clock was ahead of the caller's, measured (`gpuscope
    trace fleet`): each file is moved back by it onto the caller's clock, instead of the per-host alignment
    above. `ranks`: per file, the rank it speaks for, where the caller knows better than the file (None:
    the file's own)."""
    if not paths:
        raise TraceError("Nothing to merge: give at least one trace file.")
    docs = [load_json(p) for p in paths]
    names = [os.fspath(p) for p in paths]
    ranks = [r if r is not None else rank_of(d, n)
             for d, n, r in zip(docs, names, ranks if ranks is not None else [None] * len(docs), strict=True)]
    if any(r is None for r in ranks):  # unknown ranks get the places after the known ones, in the given order
        free = iter(r for r in range(len(docs) + max((r for r in ranks if r is not None), default=-1) + 1)
                    if r not in ranks)
        ranks = [r if r is not None else next(free) for r in ranks]
    dupes = sorted({r for r in ranks if ranks.count(r) > 1})
    if dupes:
        raise TraceError(f"Two traces claim rank {dupes[0]}: "
                         f"{', '.join(n for n, r in zip(names, ranks, strict=True) if r == dupes[0])}.")
    facts = [d.get("gpuscope") if isinstance(d.get("gpuscope"), dict) else None for d in docs]
    shifts = clock_shifts(facts) if clock_offsets_ns is None else [-int(o) for o in clock_offsets_ns]
    events: list[dict[str, Any]] = []
    summary = []
    for i, (doc, name, rank, shift) in enumerate(zip(docs, names, ranks, shifts, strict=True)):
        to_epoch_us(doc, shift)
        _relabel(doc, rank, i)
        events.extend(doc["traceEvents"])
        summary.append({"file": name, "rank": rank, "events": len(doc["traceEvents"]), "clock_shift_ns": shift,
                        "distributedInfo": doc.get("distributedInfo"), "gpuscope": facts[i]})
    # Metadata first (viewers name tracks before drawing them), then time order.
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts") if isinstance(e.get("ts"), int | float) else 0.0))
    first = docs[ranks.index(min(ranks))]
    merged = {k: v for k, v in first.items() if k not in ("traceEvents", "gpuscope", "traceName")}
    merged.update({"traceEvents": events, "baseTimeNanoseconds": 0, "displayTimeUnit": "ms",
                   "traceName": os.fspath(out_path), "gpuscope_merge": {"ranks": summary}})
    write_json(merged, out_path)
    return {"out": os.fspath(out_path), "ranks": summary, "events": len(events)}


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
