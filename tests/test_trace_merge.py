"""trace merge on the golden traces, two of them pretending to be ranks 0 and 1."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from test_trace_perfetto import check_chrome_trace

from gpuscope.trace.merge import PID_BLOCK, clock_shifts, merge
from gpuscope.trace.model import TraceError

FIXTURES = Path(__file__).parent / "fixtures" / "traces"


def read(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


@pytest.fixture
def ranks(tmp_path):
    a = tmp_path / "node.100.rank0.pt.trace.json.gz"
    b = tmp_path / "node.200.rank1.pt.trace.json.gz"
    shutil.copy(FIXTURES / "h2d_pageable.pt.trace.json.gz", a)
    shutil.copy(FIXTURES / "compute_bound.pt.trace.json.gz", b)
    return a, b


def test_two_ranks_on_one_clock_kept_apart(ranks, tmp_path):
    a, b = ranks
    out = tmp_path / "merged.json.gz"
    done = merge([b, a], out)  # order given does not decide the rank
    doc = read(out)
    check_chrome_trace(doc)
    ins = [read(a), read(b)]
    assert [r["rank"] for r in done["ranks"]] == [1, 0]
    events = doc["traceEvents"]
    # counts: every input event, plus a name for pids that had none
    added = sum(1 for e in events if e["ph"] == "M" and e["args"].get("name", "").startswith("rank ")
                and " pid " in e["args"]["name"])
    assert len(events) == sum(len(d["traceEvents"]) for d in ins) + added
    assert Counter(e.get("cat") for e in events if e["ph"] == "X")["kernel"] == sum(
        1 for d in ins for e in d["traceEvents"] if e.get("cat") == "kernel")
    # ordering: metadata first, then time
    timed = [e["ts"] for e in events if e["ph"] != "M"]
    assert timed == sorted(timed)
    assert all(e["ph"] == "M" for e in events[:sum(1 for e in events if e["ph"] == "M")])
    # each rank's pids in its own block; GPU 0 of both ranks stays two processes
    gpu_pids = {e["pid"] for e in events if e.get("cat") == "kernel"}
    assert gpu_pids == {PID_BLOCK + 0, 2 * PID_BLOCK + 0}
    names = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert all(n.startswith(("rank 0", "rank 1")) for n in names)
    # flows: ids unique per rank, each start still meets its end
    flows: dict[int, set[int]] = {}
    for e in events:
        if e["ph"] in ("s", "f"):
            flows.setdefault(e["id"], set()).add(e["pid"] // PID_BLOCK)
    assert all(len(r) == 1 for r in flows.values())
    assert len(flows) == sum(len({e["id"] for e in d["traceEvents"] if e["ph"] in ("s", "f")}) for d in ins)
    # one clock: each event's epoch µs = its file's baseTimeNanoseconds / 1000 + ts
    k0 = next(e for e in ins[0]["traceEvents"] if e.get("cat") == "kernel")
    m0 = next(e for e in events if e.get("cat") == "kernel" and e["pid"] == PID_BLOCK and e["name"] == k0["name"])
    assert m0["ts"] == pytest.approx(ins[0]["baseTimeNanoseconds"] / 1000 + k0["ts"], abs=0.5)
    assert doc["baseTimeNanoseconds"] == 0
    assert [r["rank"] for r in doc["gpuscope_merge"]["ranks"]] == [1, 0]


def test_distributed_info_and_gpuscope_facts_decide_rank_and_clock(ranks, tmp_path):
    a, b = ranks
    docs = []
    for path, rank, offset in ((a, 0, 1_000), (b, 1, 51_000)):
        d = read(path)
        d["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": 2}
        d["gpuscope"] = {"host": "node", "pid": 1, "rank": rank, "profiler_start_unix_ns": 10**18 + offset,
                         "profiler_start_monotonic_ns": 10**18}
        path.write_bytes(gzip.compress(json.dumps(d).encode()))
        docs.append(d)
    done = merge([a, b], tmp_path / "m.json")
    # the second file's wall clock ran 50 µs ahead of the host's monotonic clock: moved back
    assert [r["clock_shift_ns"] for r in done["ranks"]] == [0, -50_000]
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["distributedInfo"]["world_size"] == 2
    assert [r["distributedInfo"]["rank"] for r in doc["gpuscope_merge"]["ranks"]] == [0, 1]


def test_clock_shifts_per_host():
    f = lambda host, wall, mono: {"host": host, "profiler_start_unix_ns": wall, "profiler_start_monotonic_ns": mono}  # noqa: E731
    assert clock_shifts([f("a", 100, 0), f("b", 500, 0), f("a", 130, 20), None]) == [0, 0, -10, 0]


def test_two_files_claiming_one_rank_and_bad_files(ranks, tmp_path):
    a, _ = ranks
    c = tmp_path / "other.rank0.json.gz"
    shutil.copy(a, c)
    with pytest.raises(TraceError, match="rank 0"):
        merge([a, c], tmp_path / "m.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(TraceError, match="bad.json"):
        merge([a, bad], tmp_path / "m.json")


def test_cli_merge(ranks, tmp_path):
    a, b = ranks
    out = tmp_path / "m.json.gz"
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "merge", str(a), str(b), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "rank 0" in p.stdout and "rank 1" in p.stdout and out.exists()
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "merge", str(tmp_path / "nope.json")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no such file" in p.stderr and "Traceback" not in p.stderr
