"""The trace rules fire where the golden H200 traces say they should, name the workload's own line, and
hold their thresholds on small synthetic traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpuscope.trace.kineto import load
from gpuscope.trace.model import COLUMNS, EventKind, Trace
from gpuscope.trace.rules import as_dicts, findings

TRACES = Path(__file__).parent / "fixtures" / "traces"
# The workloads' source, to recover calling lines; without it the rules still name the function.
WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
CHECKED = ("pageable_memcpy", "sync_in_loop", "tiny_kernel_storm")


def _rules(name: str, roots: list[str] | None = None) -> dict:
    return {f.rule: f for f in findings(load(TRACES / f"{name}.pt.trace.json.gz"), source_roots=roots or [])}


@pytest.mark.parametrize("name", ["healthy_training", "compute_bound", "memory_bound"])
def test_healthy_workloads_raise_none_of_the_problem_rules(name):
    found = _rules(name)
    assert not set(found) & {*CHECKED, "gpu_gaps", "sync_memcpy", "sync_memset"}, {r: f.summary for r, f in found.items()}


def test_pageable_memcpy_on_h2d_pageable_names_the_copy_line():
    f = _rules("h2d_pageable")["pageable_memcpy"]
    assert f.severity == "high" and f.evidence["count"] == 4 and f.evidence["bytes"] == 4 * 128 * 2**20
    assert f.evidence["share"] > 0.5 and "pin_memory=True" in f.fix
    loc = f.locations[0][0]
    assert (loc.file, loc.function, loc.def_line) == ("h2d_pageable.py", "step", 9)  # g = host.to(a.device)


def test_sync_in_loop_on_sync_heavy_names_the_item_line():
    found = _rules("sync_heavy")
    f = found["sync_in_loop"]
    assert f.evidence["count"] == 60 and f.evidence["share"] > 0.5 and f.severity == "high"
    loc = f.locations[0][0]
    assert (loc.file, loc.function, loc.def_line) == ("sync_heavy.py", "step", 9)
    assert ".item()" in f.summary and "accumulate on the GPU" in f.fix
    assert "tiny_kernel_storm" not in found and "pageable_memcpy" not in found


@pytest.mark.skipif(not WORKLOADS.is_dir(), reason="the reference workloads' source is not beside the repository")
def test_with_the_source_the_calling_lines_are_recovered():
    src = (WORKLOADS / "sync_heavy.py").read_text().splitlines()
    loc = _rules("sync_heavy", [str(WORKLOADS)])["sync_in_loop"].locations[0][0]
    assert loc.line == 13 and ".item()" in src[loc.line - 1]
    loc = _rules("launch_bound", [str(WORKLOADS)])["tiny_kernel_storm"].locations[0][0]
    assert (loc.file, loc.line) == ("launch_bound.py", 14)
    gaps = _rules("sync_heavy", [str(WORKLOADS)])["gpu_gaps"]
    assert "sum" in gaps.evidence["largest"][0]["host"] and gaps.locations[0][0].line == 14  # the host-side work


def test_tiny_kernel_storm_on_launch_bound():
    found = _rules("launch_bound")
    f = found["tiny_kernel_storm"]
    assert f.evidence["tiny_kernels"] == 6000 and f.evidence["gpu_idle_share"] > 0.5
    assert f.locations[0][0].file == "launch_bound.py" and f.locations[0][0].function == "step"
    assert f.locations[0][1] == 6000 and "reduce-overhead" in f.fix and "torch.cuda.graphs" in f.fix
    assert "sync_in_loop" not in found and "pageable_memcpy" not in found


def test_findings_are_json_ready():
    out = as_dicts(findings(load(TRACES / "sync_heavy.pt.trace.json.gz")))
    assert json.loads(json.dumps(out)) == out
    assert {d["rule"] for d in out} >= {"sync_in_loop", "gpu_gaps"}
    assert all(d["severity"] in ("high", "medium", "low") and d["summary"].endswith(".") for d in out)


TWICE = """import cupy


def step(x):
    cupy.cuda.Device().synchronize()
    y = x.sum()
    cupy.cuda.Device().synchronize()
    return y


step(cupy.ones(8))
"""


def _cupti_trace(tmp_path: Path, keep_line: bool) -> tuple[Trace, list[int]]:
    """`step` above as the CUPTI backend writes it (its own to_kineto): three calls, each with its Python
    stack; without keep_line the frames lose args.line, as the PyTorch profiler's have none. Returns the
    trace and the rows of the three CUDA calls in order."""
    from gpuscope.trace.cupti_backend import to_kineto

    src = tmp_path / "twice.py"
    src.write_text(TWICE)
    t0 = 1_700_000_000_000_000_000
    calls = [(5, 1, "cudaDeviceSynchronize"), (6, 2, "cudaLaunchKernel"), (7, 1, "cudaDeviceSynchronize")]
    records = [("runtime", t0 + i * 10_000, t0 + i * 10_000 + 5_000, 100, 7, i + 1, cbid)
               for i, (_, cbid, _) in enumerate(calls)]
    stacks = {i + 1: [(str(src), 4, "step", line), (str(src), 1, "<module>", 11)]
              for i, (line, _, _) in enumerate(calls)}
    doc = to_kineto(records, stacks, {"start": {"unix_ns": t0, "cupti_ns": t0}},
                    {2: {1: "cudaDeviceSynchronize", 2: "cudaLaunchKernel"}}, {})
    if not keep_line:
        for e in doc["traceEvents"]:
            if e.get("cat") == "python_function":
                e["args"].pop("line", None)
    path = tmp_path / "twice.json"
    path.write_text(json.dumps(doc))
    trace = load(path)
    api = sorted(np.flatnonzero(trace.events["kind"] == EventKind.RUNTIME).tolist(),
                 key=lambda r: int(trace.events["ts_ns"][r]))
    return trace, api


def test_cupti_frames_give_the_exact_line_of_an_api_called_twice(tmp_path):
    from gpuscope.trace.stacks import Stacks

    trace, api = _cupti_trace(tmp_path, keep_line=True)
    stacks = Stacks(trace, source_roots=[str(tmp_path)])
    assert [(loc.function, loc.line, loc.def_line) for loc in map(stacks.location, api)] == \
        [("step", 5, 4), ("step", 6, 4), ("step", 7, 4)]
    # Without args.line (the PyTorch profiler's frames) the line is recovered from the source only where
    # the call's name appears once in the function: `sum` yes, the two `synchronize` calls no.
    trace, api = _cupti_trace(tmp_path, keep_line=False)
    stacks = Stacks(trace, source_roots=[str(tmp_path)])
    assert [loc.line for loc in map(stacks.location, api)] == [4, 6, 4]


# -- synthetic traces ------------------------------------------------------------------------------

class _Builder:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.names: list[str] = []
        self.args: dict[int, dict] = {}

    def add(self, kind, name, ts_us, dur_us, gpu=False, corr=-1, nbytes=-1, args=None, tid=1) -> int:
        if name not in self.names:
            self.names.append(name)
        self.rows.append({"kind": kind, "name": self.names.index(name), "ts_ns": int(ts_us * 1000),
                          "dur_ns": int(dur_us * 1000), "pid": 0 if gpu else 100, "tid": 7 if gpu else tid,
                          "device": 0 if gpu else -1, "stream": 7 if gpu else -1, "correlation": corr,
                          "external": -1, "bytes": nbytes, "parent": -1})
        if args is not None:
            self.args[len(self.rows) - 1] = args
        return len(self.rows) - 1

    def trace(self) -> Trace:
        order = sorted(range(len(self.rows)), key=lambda i: (self.rows[i]["ts_ns"], -self.rows[i]["dur_ns"]))
        cols = {c: np.array([self.rows[i][c] for i in order], dtype=t) for c, t in COLUMNS.items()}
        new = {old: n for n, old in enumerate(order)}
        return Trace(cols, self.names, {new[r]: a for r, a in self.args.items()}, {"deviceProperties": [{"numSms": 132}]})


def _loop(syncs: int, period_us: float, host_work_us: float) -> Trace:
    """A Python step that launches a kernel and syncs on it `syncs` times, the host then working."""
    b = _Builder()
    b.add(EventKind.PYTHON, "train.py(3): step", 0, syncs * period_us)
    for i in range(syncs):
        t = i * period_us
        b.add(EventKind.RUNTIME, "cudaLaunchKernel", t + 1, 2, corr=2 * i)
        b.add(EventKind.KERNEL, "k", t + 4, period_us - host_work_us - 6, gpu=True, corr=2 * i)
        b.add(EventKind.CPU_OP, "aten::item", t + 4, period_us - host_work_us - 3)
        b.add(EventKind.RUNTIME, "cudaStreamSynchronize", t + 5, period_us - host_work_us - 4, corr=2 * i + 1)
    return b.trace()


def test_sync_in_loop_thresholds():
    busy_host = _loop(syncs=20, period_us=1000, host_work_us=600)
    f = {x.rule: x for x in findings(busy_host, source_roots=[])}["sync_in_loop"]
    assert f.evidence["count"] == 20 and f.locations[0][0].file == "train.py" and ".item()" in f.summary
    # Fewer syncs than a loop makes, or syncs after which the GPU at once gets work again: no finding.
    assert "sync_in_loop" not in {x.rule for x in findings(_loop(syncs=5, period_us=1000, host_work_us=600))}
    assert "sync_in_loop" not in {x.rule for x in findings(_loop(syncs=20, period_us=1000, host_work_us=1))}


def test_pageable_and_sync_memcpy_thresholds():
    b = _Builder()
    b.add(EventKind.PYTHON, "load.py(10): fetch", 0, 10_000)
    b.add(EventKind.RUNTIME, "cudaMemcpyAsync", 10, 5, corr=1)
    b.add(EventKind.MEMCPY, "Memcpy HtoD (Pageable -> Device)", 20, 2000, gpu=True, corr=1, nbytes=2**24)
    b.add(EventKind.RUNTIME, "cudaMemcpy", 3000, 3000, corr=2)  # a big synchronous copy: blocks the host
    b.add(EventKind.MEMCPY, "Memcpy DtoH (Device -> Pageable)", 3010, 2900, gpu=True, corr=2, nbytes=2**24)
    b.add(EventKind.RUNTIME, "cudaMemcpy", 7000, 800, corr=3)  # HtoD of 64 KB: Nsight does not count it
    b.add(EventKind.MEMCPY, "Memcpy HtoD (Pinned -> Device)", 7010, 700, gpu=True, corr=3, nbytes=65536)
    b.add(EventKind.RUNTIME, "cudaMemset", 8000, 1500, corr=4)
    b.add(EventKind.MEMSET, "Memset (Device)", 8010, 1400, gpu=True, corr=4, nbytes=2**20)
    found = {f.rule: f for f in findings(b.trace(), source_roots=[])}
    pageable = found["pageable_memcpy"]
    assert pageable.evidence["count"] == 1 and pageable.locations[0][0].file == "load.py"  # the sync one is not
    assert found["sync_memcpy"].evidence["count"] == 1 and found["sync_memcpy"].evidence["seconds"] == pytest.approx(3e-3)
    assert found["sync_memset"].evidence["count"] == 1


def test_gpu_gaps_long_gap_is_reported_with_what_the_host_did():
    b = _Builder()
    b.add(EventKind.PYTHON, "train.py(1): main", 0, 2_000_000)
    b.add(EventKind.PYTHON, "data.py(20): next_batch", 1000, 700_000)
    for i, t in enumerate((10, 900_000, 900_500)):
        b.add(EventKind.RUNTIME, "cudaLaunchKernel", t, 5, corr=i)
        b.add(EventKind.KERNEL, "k", t + 10, 400, gpu=True, corr=i)
    f = {x.rule: x for x in findings(b.trace(), source_roots=[])}["gpu_gaps"]
    assert f.severity == "high" and f.evidence["long_gaps"] == 1
    assert f.evidence["largest"][0]["host"] == "data.py(20): next_batch"
    assert f.locations[0][0].file == "data.py"


def test_tiny_kernels_on_a_busy_gpu_are_not_launch_bound():
    def storm(gap_us: float) -> set[str]:
        b = _Builder()
        b.add(EventKind.PYTHON, "m.py(1): step", 0, 2000 * (5 + gap_us) + 10)
        for i in range(2000):
            t = i * (5 + gap_us)
            b.add(EventKind.RUNTIME, "cudaLaunchKernel", t, 4, corr=i)
            b.add(EventKind.KERNEL, "tiny", t + 5, 5, gpu=True, corr=i)
        return {f.rule for f in findings(b.trace(), source_roots=[])}
    assert "tiny_kernel_storm" in storm(gap_us=20)   # idle 80 % between them
    assert "tiny_kernel_storm" not in storm(gap_us=0.5)  # queued back to back: the GPU is busy


def test_low_occupancy_names_the_limiter():
    b = _Builder()
    b.add(EventKind.PYTHON, "m.py(1): step", 0, 1000)
    b.add(EventKind.RUNTIME, "cudaLaunchKernel", 1, 3, corr=1)
    b.add(EventKind.KERNEL, "fat", 5, 900, gpu=True, corr=1, args={
        "est. achieved occupancy %": 12, "registers per thread": 255, "shared memory": 0,
        "grid": [4096, 1, 1], "block": [256, 1, 1]})
    f = {x.rule: x for x in findings(b.trace(), source_roots=[])}["low_occupancy"]
    assert f.evidence["limiter"].startswith("registers") and "255 per thread" in f.summary
    b.args[2]["est. achieved occupancy %"] = 0  # Kineto's "could not compute": no claim
    assert "low_occupancy" not in {x.rule for x in findings(b.trace(), source_roots=[])}
