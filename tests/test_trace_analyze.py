"""The Kineto loader and the trace analyses, on the golden H200 traces (tests/fixtures/traces)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from gpuscope import cli
from gpuscope.trace import COLUMNS, EventKind, Trace, TraceError, load
from gpuscope.trace.analyze import analyze, comm_overlap, idle_breakdown, stragglers, temporal_breakdown

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
WORKLOADS = ["compute_bound", "h2d_pageable", "healthy_training", "input_starved", "launch_bound", "memory_bound",
             "sync_heavy"]
_cache: dict[str, object] = {}


def trace_of(workload: str):
    if workload not in _cache:
        _cache[workload] = load(FIXTURES / f"{workload}.pt.trace.json.gz")
    return _cache[workload]


def profiler_gpu_rows(workload: str) -> dict[str, dict]:
    summary = json.loads((FIXTURES / f"{workload}.summary.json").read_text())
    return {r["name"]: r for r in summary["key_averages"] if r["device_type"].endswith("CUDA")}


@pytest.mark.parametrize("workload", WORKLOADS)
def test_loads_every_fixture_into_the_model(workload):
    t = trace_of(workload)
    ev = t.events
    assert set(ev) == set(COLUMNS)
    assert all(len(ev[c]) == len(t) and ev[c].dtype == np.dtype(COLUMNS[c]) for c in COLUMNS)
    ts, dur = ev["ts_ns"], ev["dur_ns"]
    assert np.all((ts[1:] > ts[:-1]) | ((ts[1:] == ts[:-1]) & (dur[1:] <= dur[:-1])))
    assert (dur >= 0).all()
    gpu = np.isin(ev["kind"], (EventKind.KERNEL, EventKind.MEMCPY, EventKind.MEMSET))
    assert (ev["device"][gpu] == 0).all() and (ev["stream"][gpu] >= 0).all() and (ev["device"][~gpu & (ev["kind"] != EventKind.GPU_ANNOTATION)] == -1).all()
    parents = ev["parent"][ev["parent"] >= 0]
    assert (ev["kind"][parents] == EventKind.PYTHON).all()
    assert (ev["kind"] == EventKind.PYTHON).sum() - 1 <= (ev["parent"] >= 0).sum()  # all but the root(s)
    assert ts.min() > 1_700_000_000 * 10**9  # epoch ns, from baseTimeNanoseconds
    assert t.rank is None and t.meta["schemaVersion"] == 1 and t.meta["deviceProperties"]
    kernel_rows = np.flatnonzero(ev["kind"] == EventKind.KERNEL)
    assert all("grid" in t.args[int(r)] for r in kernel_rows)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_kernel_counts_and_times_match_the_profilers_own_summary(workload):
    # The profiler's key_averages lists every GPU-side event under device type CUDA: kernels, but also
    # memcpy, memset and GPU user annotations (healthy_training's 5 'Optimizer.step' spans, 5.2 ms). So
    # compare kernel names one by one, and the whole CUDA total against all four kinds.
    rows = profiler_gpu_rows(workload)
    report = analyze(trace_of(workload))
    for k in report.kernels:
        assert k.count == rows[k.name]["count"], k.name
        assert k.total_ns / 1e3 == pytest.approx(rows[k.name]["self_device_time_total_us"], rel=0.02), k.name
    ev = trace_of(workload).events
    gpu_side = np.isin(ev["kind"], (EventKind.KERNEL, EventKind.MEMCPY, EventKind.MEMSET, EventKind.GPU_ANNOTATION))
    assert gpu_side.sum() == sum(r["count"] for r in rows.values())
    assert ev["dur_ns"][gpu_side].sum() / 1e3 == pytest.approx(
        sum(r["self_device_time_total_us"] for r in rows.values()), rel=0.02)
    assert sum(k.share_ratio for k in report.kernels) == pytest.approx(1.0)


def test_fixture_kernel_counts_are_the_ones_captured():
    counts = {w: sum(k.count for k in analyze(trace_of(w)).kernels) for w in WORKLOADS}
    assert counts == {"compute_bound": 50, "memory_bound": 10, "h2d_pageable": 4, "launch_bound": 6000,
                      "sync_heavy": 180, "input_starved": 160, "healthy_training": 1690}


def test_temporal_breakdown_tells_busy_from_starved():
    compute = temporal_breakdown(trace_of("compute_bound"))[0]
    assert compute.compute_ratio > 0.95 and compute.idle_ratio < 0.02
    for workload in ("sync_heavy", "launch_bound"):
        t = temporal_breakdown(trace_of(workload))[0]
        assert t.idle_ratio > 0.8, workload
        assert t.idle_ns + t.compute_ns + t.non_compute_ns == t.span_ns
    # pageable copies keep the GPU "busy" without computing
    h2d = temporal_breakdown(trace_of("h2d_pageable"))[0]
    assert h2d.non_compute_ratio > 0.9


def test_idle_breakdown_of_a_launch_bound_loop_is_host_wait():
    (stream,) = idle_breakdown(trace_of("launch_bound"))
    assert stream.host_wait_ratio > 0.9
    assert stream.host_wait_ns + stream.kernel_wait_ns + stream.other_ns == stream.idle_ns


def test_launch_delay_and_queue_delay_exist():
    report = analyze(trace_of("launch_bound"))
    assert all(k.launch_delay_p50_ns is not None and k.launch_delay_p50_ns >= 0 for k in report.kernels)
    assert report.queue_delay.count == 6000 and report.launch_overhead.count == 6000
    # a launch-bound loop: the GPU starts each kernel microseconds after the launch returns
    assert report.queue_delay.p50_ns < 10_000
    # a compute-bound loop queues work far ahead of the GPU
    assert analyze(trace_of("compute_bound")).queue_delay.p50_ns > 1_000_000


def test_api_and_sync_summaries():
    report = analyze(trace_of("sync_heavy"))
    sync = {s.name: s for s in report.sync}
    assert sync["cudaStreamSynchronize"].count == 60
    api = {a.name: a for a in report.api}
    assert api["cudaStreamSynchronize"].total_ns == sync["cudaStreamSynchronize"].total_ns
    assert sum(a.share_ratio for a in report.api) == pytest.approx(1.0)


def test_memcpy_summary_shows_pageable_host_to_device():
    (copy,) = analyze(trace_of("h2d_pageable")).memcpy
    assert copy.op == "HtoD" and copy.pageable and copy.count == 4
    assert copy.bytes == 4 * 128 * 2**20
    assert 1e9 < copy.bandwidth_bytes_per_s < 20e9   # pageable: far below the ~50 GB/s pinned copies reach
    pinned = {c.op: c for c in analyze(trace_of("sync_heavy")).memcpy}
    assert not pinned["DtoH"].pageable


def test_no_nccl_no_overlap_and_a_single_rank_has_no_straggler():
    assert comm_overlap(trace_of("healthy_training")) is None
    assert stragglers([trace_of("healthy_training")]) == []


def test_straggler_among_ranks():
    fast, slow = trace_of("memory_bound"), trace_of("compute_bound")
    (s,) = stragglers([fast, fast, slow, fast])
    assert s.source.endswith("compute_bound.pt.trace.json.gz") and s.excess_ratio > 1


@pytest.mark.parametrize("content, expect", [
    (b"", "is empty"),
    (b"{not json", "is not valid JSON"),
    (b'{"traceEvents": [{"ph": "X", "ts": 1', "is not valid JSON"),
    (b"[]", "no traceEvents"),
    (b'{"schemaVersion": 1}', "no traceEvents"),
    (b'{"traceEvents": 5}', "traceEvents is a number, not a list"),
    (b'{"traceEvents": [5]}', "not an event object"),
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "12", "dur": 1}]}', "\"ts\" is '12'"),
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "dur": 1}]}', "has no \"ts\""),
    (b'{"traceEvents": [{"ph": "X", "name": "k", "ts": 1, "dur": 1, "args": {"correlation": "x"}}]}',
     "\"correlation\" is 'x'"),
    (b'{"traceEvents": [{"ph": "X", "name": "k", "ts": 1, "dur": -5}]}', "negative duration"),
    (b'{"schemaVersion": 7, "traceEvents": []}', "unknown Kineto schema version"),
    (b'{"baseTimeNanoseconds": "soon", "traceEvents": []}', "baseTimeNanoseconds"),
    (b'{"baseTimeNanoseconds": 10000000000000000000, "traceEvents": []}', "baseTimeNanoseconds"),
    (b'{"traceEvents": [{"ph": "X", "name": "k", "ts": 1, "dur": 1e300}]}', "out of range"),
    (b'{"traceEvents": [{"ph": "X", "name": "k", "ts": -1e20, "dur": 1}]}', "out of range"),
])
def test_bad_input_is_one_sentence_naming_the_file(tmp_path, content, expect):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(TraceError) as e:
        load(path)
    _one_sentence(str(e.value), str(path), expect)


def test_truncated_and_corrupt_gzip(tmp_path):
    good = (FIXTURES / "memory_bound.pt.trace.json.gz").read_bytes()
    for name, content, expect in [("cut.json.gz", good[: len(good) // 2], "truncated or corrupt gzip"),
                                  ("garbled.json.gz", good[:20] + b"\x00" * 200 + good[220:], "corrupt gzip"),
                                  ("cut-json.json.gz", gzip.compress(gzip.decompress(good)[:5000]), "not valid JSON")]:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(TraceError) as e:
            load(path)
        _one_sentence(str(e.value), str(path), expect)


def test_missing_file_and_directory(tmp_path):
    for path, expect in [(tmp_path / "nope.json", "no such file"), (tmp_path, "directory")]:
        with pytest.raises(TraceError) as e:
            load(path)
        _one_sentence(str(e.value), str(path), expect)


def test_tolerates_unknown_categories_missing_args_and_other_phases(tmp_path):
    doc = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python3"}},
        {"ph": "X", "cat": "something_new", "name": "a", "pid": 1, "tid": 1, "ts": 10.5, "dur": 2},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 11, "dur": 1},
        {"ph": "X", "cat": "Trace", "name": "span", "pid": "Spans", "tid": "PyTorch Profiler", "ts": 10},
        {"ph": "i", "name": "mark", "ts": 12, "s": "g"},
        {"ph": "s", "id": 1, "cat": "ac2g", "name": "ac2g", "ts": 10},
        {"ph": "C", "name": "counter", "ts": 10, "args": {"v": 1}},
    ]}
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(doc))
    t = load(path)
    assert len(t) == 3
    assert [t.name_of(i) for i in range(3)] == ["span", "a", "k"]
    assert list(t.events["kind"]) == [EventKind.OTHER, EventKind.OTHER, EventKind.KERNEL]
    assert t.events["ts_ns"][1] == 10_500 and t.events["pid"][0] == -1
    assert t.events["device"][2] == 0 and t.events["stream"][2] == 7 and t.events["correlation"][2] == -1
    assert t.meta["process_names"] == {1: "python3"}
    report = analyze(t)
    assert report.kernels[0].launch_delay_p50_ns is None and report.queue_delay is None


def test_rank_from_distributed_info(tmp_path):
    path = tmp_path / "rank3.json"
    path.write_text(json.dumps({"distributedInfo": {"rank": 3, "world_size": 4}, "traceEvents": []}))
    t = load(path)
    assert t.rank == 3 and len(t) == 0
    assert analyze(t).temporal == []


def test_cli_tables_json_and_bad_file(tmp_path, capsys):
    fixture = str(FIXTURES / "h2d_pageable.pt.trace.json.gz")
    assert cli.main(["trace", "analyze", fixture, "--top", "3"]) == 0
    out = capsys.readouterr().out
    for heading in ("temporal breakdown", "idle time per stream", "top kernels", "CUDA API calls", "synchronisation",
                    "memcpy / memset", "queue delay", "Memcpy HtoD (Pageable -> Device)"):
        assert heading in out
    assert cli.main(["trace", "analyze", fixture, str(FIXTURES / "memory_bound.pt.trace.json.gz"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["traces"]) == 2 and doc["traces"][0]["memcpy"][0]["pageable"] is True
    assert {"kernels", "api", "sync", "temporal", "idle", "launch_overhead", "queue_delay", "overlap"} <= set(doc["traces"][0])
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert cli.main(["trace", "analyze", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err
    assert cli.main(["trace", "analyze", fixture, "--top", "0"]) == 2
    assert cli.main(["trace"]) == 2


def test_temporal_breakdown_agrees_with_hta(tmp_path):
    hta = pytest.importorskip("hta.trace_analysis")
    # (HTA 0.5 under pandas 3 fails on h2d_pageable, memory_bound and sync_heavy: an int8 index column overflows.)
    for workload in ("launch_bound", "healthy_training", "input_starved", "compute_bound"):
        doc = json.loads(gzip.decompress((FIXTURES / f"{workload}.pt.trace.json.gz").read_bytes()))
        doc["distributedInfo"] = {"rank": 0}  # HTA reads the rank from here
        d = tmp_path / workload
        d.mkdir()
        (d / "rank0.pt.trace.json").write_text(json.dumps(doc))
        theirs = hta.TraceAnalysis(trace_dir=str(d)).get_temporal_breakdown(visualize=False).iloc[0]
        # HTA rounds every event inward to whole microseconds (start up, end down), shaving up to 2 us off
        # each kernel: launch_bound's 1-3 us kernels then read 96 % idle where the ns truth is 89 %. (Its
        # switch to keep ns, HTA_DISABLE_NS_ROUNDING=1, fails in HTA 0.5 with pandas 3.) Compare the
        # definition on the trace rounded the same way.
        t = trace_of(workload)
        ts = -(-t.events["ts_ns"] // 1000) * 1000
        end = (t.events["ts_ns"] + t.events["dur_ns"]) // 1000 * 1000
        rounded = Trace(events={**t.events, "ts_ns": ts, "dur_ns": end - ts}, names=t.names)
        ours = temporal_breakdown(rounded)[0]
        assert ours.span_ns / 1e3 == pytest.approx(theirs["kernel_time(us)"], rel=0.01), workload
        assert ours.idle_ratio == pytest.approx(theirs["idle_time_pctg"] / 100, abs=0.01), workload
        assert ours.compute_ratio == pytest.approx(theirs["compute_time_pctg"] / 100, abs=0.01), workload
        assert ours.non_compute_ratio == pytest.approx(theirs["non_compute_time_pctg"] / 100, abs=0.01), workload
        if workload == "compute_bound":  # ms-long kernels: the rounding does not matter
            assert temporal_breakdown(t)[0].idle_ratio == pytest.approx(ours.idle_ratio, abs=0.01)


def _one_sentence(message: str, path: str, expect: str) -> None:
    assert path in message and expect in message, message
    assert message.endswith(".") and "\n" not in message and ". " not in message.replace(path, ""), message


def test_parsing_in_chunks_gives_the_same_trace(tmp_path, monkeypatch):
    from gpuscope.trace import kineto

    whole = load(FIXTURES / "input_starved.pt.trace.json.gz")
    monkeypatch.setattr(kineto, "_CHUNK_BYTES", 2000)
    chunked = load(FIXTURES / "input_starved.pt.trace.json.gz")
    assert all(np.array_equal(whole.events[c], chunked.events[c]) for c in COLUMNS)
    assert whole.names == chunked.names and whole.args == chunked.args
    # a cut inside a string or a nested list is invalid JSON on its own: the whole file is parsed instead
    tricky = {"traceEvents": [{"ph": "X", "name": "a}, {b" * 500, "ts": 1, "dur": 1, "args": {"l": [{}, {}] * 400}},
                              {"ph": "X", "name": "k", "ts": 2, "dur": 1}], "traceName": "x]y"}
    path = tmp_path / "tricky.json"
    path.write_text(json.dumps(tricky))
    t = load(path)
    assert [t.name_of(i) for i in range(2)] == ["a}, {b" * 500, "k"] and t.meta["traceName"] == "x]y"


def test_a_trace_past_the_size_cap_is_one_sentence_and_a_gzip_bomb_is_not_expanded(tmp_path):
    import tracemalloc

    from gpuscope.trace import kineto

    bomb = tmp_path / "bomb.json.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:  # 64 MiB of zeros from a ~64 KiB file
        chunk = b"0" * (1 << 20)
        for _ in range(64):
            f.write(chunk)
    tracemalloc.start()
    with pytest.raises(TraceError, match="larger than 8 MiB uncompressed"):
        kineto.load(bomb, max_bytes=8 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 32 << 20, peak  # stopped soon after the cap, not after 64 MiB
    plain = tmp_path / "big.json"
    plain.write_bytes(b'{"traceEvents": []}' + b" " * (2 << 20))
    with pytest.raises(TraceError, match="larger than 1 MiB"):
        kineto.load(plain, max_bytes=1 << 20)
    fixture = Path(__file__).parent / "fixtures" / "traces" / "compute_bound.pt.trace.json.gz"
    assert len(kineto.load(fixture, max_bytes=8 << 20)) > 0  # under the cap: read as before
