"""The streamed merge (trace/merge.py) writes what the in-memory merge it replaced wrote, byte for byte, reading
each rank's trace once and holding one rank's events at a time; `gpuscope trace fleet`'s analyses over what it
keeps equal those over the whole traces."""

from __future__ import annotations

import builtins
import gzip
import json
import os
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from gpuscope.trace import fleet, kineto
from gpuscope.trace import merge as streamed
from gpuscope.trace.analyze import comm_overlap, stragglers
from gpuscope.trace.collectives import arrivals
from gpuscope.trace.kineto import load
from gpuscope.trace.model import TraceError
from gpuscope.trace.perfetto import load_json, to_epoch_us, write_json

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"


# -- the merge as it was before it streamed (every event in memory, one sort), the reference ----------------
def _old_relabel(doc: dict[str, Any], rank: int, index: int) -> None:
    base = (rank + 1) * streamed.PID_BLOCK
    named: set[Any] = set()
    pids: set[Any] = set()
    for e in doc["traceEvents"]:
        pid = e.get("pid")
        if isinstance(pid, int):
            pids.add(pid)
            e["pid"] = base + pid
        elif isinstance(pid, str):
            e["pid"] = f"rank {rank} {pid}"
        if e.get("ph") == "M" and isinstance(e.get("args"), dict):
            if e.get("name") == "process_name":
                named.add(pid)
                e["args"]["name"] = f"rank {rank} {e['args'].get('name', '')}".rstrip()
            elif e.get("name") == "process_sort_index" and isinstance(e["args"].get("sort_index"), int):
                e["args"]["sort_index"] = rank * 10**8 + e["args"]["sort_index"]
        if e.get("ph") in ("s", "t", "f") and isinstance(e.get("id"), int):
            e["id"] = index * streamed.FLOW_BLOCK + e["id"]
    for pid in sorted(pids - named):
        doc["traceEvents"].append({"ph": "M", "name": "process_name", "pid": base + pid, "tid": 0,
                                   "args": {"name": f"rank {rank} pid {pid}"}})


def old_merge(paths, out_path, clock_offsets_ns=None, ranks=None) -> dict[str, Any]:
    docs = [load_json(p) for p in paths]
    names = [os.fspath(p) for p in paths]
    ranks = [r if r is not None else streamed.rank_of(d, n)
             for d, n, r in zip(docs, names, ranks if ranks is not None else [None] * len(docs), strict=True)]
    if any(r is None for r in ranks):
        free = iter(r for r in range(len(docs) + max((r for r in ranks if r is not None), default=-1) + 1)
                    if r not in ranks)
        ranks = [r if r is not None else next(free) for r in ranks]
    facts = [d.get("gpuscope") if isinstance(d.get("gpuscope"), dict) else None for d in docs]
    shifts = streamed.clock_shifts(facts) if clock_offsets_ns is None else [-int(o) for o in clock_offsets_ns]
    events: list[dict[str, Any]] = []
    summary = []
    for i, (doc, name, rank, shift) in enumerate(zip(docs, names, ranks, shifts, strict=True)):
        to_epoch_us(doc, shift)
        _old_relabel(doc, rank, i)
        events.extend(doc["traceEvents"])
        summary.append({"file": name, "rank": rank, "events": len(doc["traceEvents"]), "clock_shift_ns": shift,
                        "distributedInfo": doc.get("distributedInfo"), "gpuscope": facts[i]})
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts") if isinstance(e.get("ts"), int | float) else 0.0))
    first = docs[ranks.index(min(ranks))]
    merged = {k: v for k, v in first.items() if k not in ("traceEvents", "gpuscope", "traceName")}
    merged.update({"traceEvents": events, "baseTimeNanoseconds": 0, "displayTimeUnit": "ms",
                   "traceName": os.fspath(out_path), "gpuscope_merge": {"ranks": summary}})
    write_json(merged, out_path)
    return {"out": os.fspath(out_path), "ranks": summary, "events": len(events)}


# -- ranks with real structure -------------------------------------------------------------------------------
def _doc(name: str) -> dict[str, Any]:
    return json.loads(gzip.decompress((FIXTURES / name).read_bytes()))


def _with_nccl(doc: dict[str, Any], late_us: float, count: int = 12) -> dict[str, Any]:
    """The fixture plus an all-reduce every 1 ms on its GPU 0 (a stream of its own), `late_us` late after one
    moment of the epoch (the fixtures were recorded at different times)."""
    ts0 = (1_764_000_000 * 10**9 - doc["baseTimeNanoseconds"]) / 1000
    doc["traceEvents"] += [{"ph": "X", "cat": "kernel", "name": NCCL, "pid": 0, "tid": 29,
                            "ts": ts0 + k * 1000.0 + late_us, "dur": 300.0,
                            "args": {"device": 0, "stream": 29, "correlation": 900_000 + k}} for k in range(count)]
    return doc


@pytest.fixture(scope="module")
def rank_files(tmp_path_factory) -> list[Path]:
    """Six ranks: Kineto traces with flows, the "Spans" row, metadata and sort indexes; two on one host with
    the clock pair (one 50 µs apart), one naming its rank only in distributedInfo, one in its file name only,
    one claiming none; two copies of one trace (every ts ties across them); an unnamed pid, an event without
    ts, a ts of -0.0, all-reduces (the analyses)."""
    root = tmp_path_factory.mktemp("ranks")
    files = []

    def put(name: str, doc: dict[str, Any], gz: bool = True) -> None:
        raw = json.dumps(doc).encode()
        f = root / name
        f.write_bytes(gzip.compress(raw) if gz else raw)
        files.append(f)

    a = _with_nccl(_doc("h2d_pageable.pt.trace.json.gz"), 0.0)
    a["gpuscope"] = {"host": "n1", "pid": 100, "rank": 3, "profiler_start_unix_ns": 10**18 + 1_000,
                     "profiler_start_monotonic_ns": 10**18}
    a["traceEvents"].append({"ph": "X", "cat": "cpu_op", "name": "unnamed", "pid": 4242, "tid": 1, "ts": -0.0,
                             "dur": 1.0})
    a["traceEvents"].append({"ph": "i", "name": "no time", "pid": 100, "tid": 1, "s": "t"})
    put("a.json.gz", a)
    b = _with_nccl(_doc("compute_bound.pt.trace.json.gz"), 40.0)
    b["gpuscope"] = {"host": "n1", "pid": 200, "rank": 1, "profiler_start_unix_ns": 10**18 + 51_000,
                     "profiler_start_monotonic_ns": 10**18}
    put("b.json", b, gz=False)
    c = _with_nccl(_doc("input_starved.pt.trace.json.gz"), 10.0)
    c["distributedInfo"] = {"backend": "nccl", "rank": 0, "world_size": 6}
    put("c.json.gz", c)
    put("node.300.rank2.pt.trace.json.gz", _with_nccl(_doc("memory_bound.pt.trace.json.gz"), 5.0))
    d = _with_nccl(_doc("memory_bound.pt.trace.json.gz"), 5.0)
    put("copy.pt.trace.json.gz", d)  # claims no rank: placed after the others
    put("fp32.pt.trace.json.gz", _with_nccl(_doc("fp32_gemm.pt.trace.json.gz"), 20.0))
    return files


def _merged_bytes(fn, out: Path, *args, **kw) -> tuple[bytes, dict[str, Any]]:
    done = fn(*args, out, **kw)
    raw = out.read_bytes()
    out.unlink()
    return (gzip.decompress(raw) if out.name.endswith(".gz") else raw), done


@pytest.mark.parametrize("out_name", ["merged.pt.trace.json.gz", "merged.json"])
@pytest.mark.parametrize("how", ["own ranks, host clocks", "given ranks and offsets", "given in part"])
def test_streamed_output_equals_the_in_memory_merge(rank_files, tmp_path, out_name, how):
    kw: dict[str, Any] = {}
    if how == "given ranks and offsets":
        kw = {"ranks": [5, 4, 3, 2, 1, 0], "clock_offsets_ns": [0, 250_000_000, -7, 1_000, 0, 123_456_789]}
    elif how == "given in part":
        kw = {"ranks": [None, None, 7, None, None, 9], "clock_offsets_ns": [0] * 6}
    out = tmp_path / out_name
    old, old_done = _merged_bytes(old_merge, out, rank_files, **kw)
    new, new_done = _merged_bytes(streamed.merge, out, rank_files, **kw)
    assert new == old  # the same document, byte for byte
    assert new_done == old_done
    doc = json.loads(new)
    assert new_done["events"] == len(doc["traceEvents"]) > 6 * 250
    assert {e["args"]["name"].split()[1] for e in doc["traceEvents"] if e.get("name") == "process_name"} == set(
        str(r["rank"]) for r in new_done["ranks"])


def test_more_ranks_than_open_files_are_merged_in_groups(rank_files, tmp_path, monkeypatch):
    out = tmp_path / "m.json.gz"
    old, _ = _merged_bytes(old_merge, out, rank_files)
    monkeypatch.setattr(streamed, "MAX_OPEN_RUNS", 2)
    new, _ = _merged_bytes(streamed.merge, out, rank_files)
    assert new == old


def test_memory_holds_one_rank_not_every_event(tmp_path, monkeypatch):
    """Merging 8 copies of a trace allocates at its peak what merging 2 does (the parse of one file); the
    in-memory merge's peak doubled."""
    read = kineto._read  # reads to a cap of 4 GiB with one f.read(cap + 1): that buffer would be the peak
    monkeypatch.setattr(kineto, "_read", lambda src, max_bytes=0: read(src, 1 << 20))
    src = FIXTURES / "input_starved.pt.trace.json.gz"
    files = []
    for i in range(8):
        files.append(tmp_path / f"n.{i}.rank{i}.pt.trace.json.gz")
        shutil.copy(src, files[-1])

    def peak(fn, n: int) -> int:
        tracemalloc.start()
        try:
            fn(files[:n], tmp_path / "m.json.gz")
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    assert peak(streamed.merge, 8) < 1.1 * peak(streamed.merge, 2)
    assert peak(old_merge, 8) > 1.8 * peak(old_merge, 2)  # what the test would catch


def test_a_file_that_is_not_a_trace_is_one_sentence_and_leaves_nothing(rank_files, tmp_path):
    bad = tmp_path / "bad.json"
    for text, words in (('{"traceEvents": [1, 2]}', "traceEvents holds"), ("{", "not valid JSON"),
                        ('{"traceEvents": [{"ph": "M", "name": "process_name", "pid": [1], "args": {}}]}', "pid is")):
        bad.write_text(text)
        with pytest.raises(TraceError, match=words) as e:
            streamed.merge([rank_files[0], bad], tmp_path / "m.json.gz")
        assert "bad.json" in str(e.value)
    assert not list(tmp_path.glob("m.json.gz*"))


def test_the_fleet_reads_each_trace_once_and_analyses_as_before(rank_files, tmp_path, monkeypatch):
    """trace fleet's merge and analyses open each pulled trace once (they opened it twice: the analyses'
    loader, then the merge's); stragglers, communication overlap and arrivals over the GPU ops it keeps
    equal those over the whole traces."""
    opened: dict[str, int] = {}
    real_open = builtins.open

    def counting_open(file, *a, **kw):
        if isinstance(file, str | os.PathLike) and Path(file) in rank_files:
            opened[os.fspath(file)] = opened.get(os.fspath(file), 0) + 1
        return real_open(file, *a, **kw)

    agent = fleet.Agent("http://127.0.0.1:1", "127.0.0.1:1", clock=fleet.Clock(offset_ns=2_000, delay_ns=0))
    ranks = [fleet.Rank(agent, pid=10 + i, rank=[None, 1, None, 2, 2, None][i], path=str(f))
             for i, f in enumerate(rank_files)]
    monkeypatch.setattr(builtins, "open", counting_open)
    done = fleet._merge_and_analyse([agent], ranks, "slurm/1", 0, 1.0, str(tmp_path / "f.json.gz"), 0.0)
    monkeypatch.setattr(builtins, "open", real_open)
    assert opened == {str(f): 1 for f in rank_files}
    assert done["exit_code"] == 0 and done["events"] > 0
    given = [r["rank"] for r in done["ranks"]]
    assert sorted(given) == list(range(6)) and given[1] == 1  # a duplicate 2 given a rank of its own

    whole = [load(f) for f in rank_files]
    for t, rank in zip(whole, given, strict=True):
        t.rank = rank
    assert done["stragglers"] == [vars(s) for s in stragglers(whole)]
    assert done["communication"] == [vars(o) for o in (comm_overlap(t) for t in whole) if o is not None]
    assert len(done["communication"]) == 6
    got = arrivals(whole, [-2_000] * 6)
    assert got is not None and got.collectives == 12 and done["arrivals"] == got.to_dict()
    # the merged file: what the in-memory merge wrote for those ranks and offsets
    new = gzip.decompress((tmp_path / "f.json.gz").read_bytes())
    old, _ = _merged_bytes(old_merge, tmp_path / "f.json.gz", rank_files, clock_offsets_ns=[2_000] * 6, ranks=given)
    assert new == old


def test_a_bad_trace_among_the_fleets_is_named_and_the_rest_merged(rank_files, tmp_path):
    bad = tmp_path / "pulled.9.pt.trace.json.gz"
    bad.write_bytes(gzip.compress(b'{"traceEvents": "no"}'))
    agent = fleet.Agent("http://127.0.0.1:1", "127.0.0.1:1", clock=fleet.Clock(offset_ns=0, delay_ns=0))
    ranks = [fleet.Rank(agent, pid=1, path=str(rank_files[0])), fleet.Rank(agent, pid=9, path=str(bad))]
    done = fleet._merge_and_analyse([agent], ranks, "slurm/1", 0, 1.0, str(tmp_path / "f.json.gz"), 0.0)
    assert done["exit_code"] == fleet.EXIT_PARTIAL and [r["pid"] for r in done["ranks"]] == [1]
    assert done["missing"] == ["The trace of process 9 on 127.0.0.1:1 is not usable: it is not a usable trace: "
                               "traceEvents is a string, not a list of events."]
    assert json.loads(gzip.decompress((tmp_path / "f.json.gz").read_bytes()))["gpuscope_merge"]["ranks"][0]["rank"] == 3


def test_no_room_for_the_temporary_files_is_one_sentence(rank_files, tmp_path, monkeypatch):
    import tempfile

    from gpuscope.errors import UsageError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    with pytest.raises(UsageError, match=r"Cannot write the merge's temporary files in .*gone: No such file"):
        streamed.merge(rank_files[:2], tmp_path / "m.json.gz")
    assert not (tmp_path / "m.json.gz").exists()
