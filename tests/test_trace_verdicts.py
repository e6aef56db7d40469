"""A trace's verdicts on the golden H200 traces name each workload's bottleneck (and its line), stay
honest where a trace cannot tell (compute- vs memory-bound), and refine a metrics diagnosis."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from gpuscope.cli import main
from gpuscope.diagnose import Verdict
from gpuscope.trace.kineto import load
from gpuscope.trace.verdicts import refine, verdicts

TRACES = Path(__file__).parent / "fixtures" / "traces"
HOST_BOUND = {"launch_or_sync_bound", "input_starved", "launch_bound", "sync_bound", "host_bound"}


@cache
def _verdict(name: str) -> Verdict:
    found = verdicts(load(TRACES / f"{name}.pt.trace.json.gz"))
    assert len(found) == 1 and found[0].primary and found[0].gpu == "0", found
    return found[0]


def test_sync_heavy_is_sync_bound_at_its_line():
    v = _verdict("sync_heavy")
    assert v.kind == "sync_bound" and v.confidence >= 0.9 and "certain" in v.summary
    assert "sync_heavy.py" in v.evidence["line"] and "step()" in v.evidence["line"]
    assert v.evidence["syncs"] == 60 and v.evidence["syncs_per_s"] > 1000
    assert v.evidence["gpu_idle_share"] > 0.8 and v.evidence["idle_after_syncs_share"] > 0.9
    assert ".item()" in v.recommendations[0]


def test_launch_bound_is_launch_bound_with_kernel_against_launch_time():
    v = _verdict("launch_bound")
    assert v.kind == "launch_bound" and v.confidence >= 0.9
    e = v.evidence
    assert e["median_kernel_us"] < e["median_launch_us"] and e["kernels_per_s"] > 50_000
    assert "launch_bound.py" in e["line"] and "torch.compile" in v.recommendations[0]


def test_h2d_pageable_is_transfer_bound_from_pageable_memory():
    v = _verdict("h2d_pageable")
    assert v.kind == "transfer_bound" and v.confidence >= 0.9 and "pageable" in v.summary
    assert v.evidence["pageable"] is True and v.evidence["copy_share"] > 0.9
    assert "h2d_pageable.py" in v.evidence["line"] and "pin_memory" in v.recommendations[0]


@pytest.mark.parametrize("name", ["healthy_training", "compute_bound"])
def test_busy_gpus_are_compute_bound_or_healthy(name):
    v = _verdict(name)
    assert v.kind in ("compute_bound", "healthy") and v.evidence["gpu_idle_share"] < 0.1


def test_compute_bound_is_named_from_its_matmul_kernels():
    v = _verdict("compute_bound")
    assert v.kind == "compute_bound" and v.evidence["gemm_kernel_share"] > 0.9


def test_memory_bound_is_only_called_busy_since_a_trace_has_no_counters():
    v = _verdict("memory_bound")
    assert v.kind == "healthy" and v.kind not in HOST_BOUND
    assert v.evidence["elementwise_kernel_share"] > 0.9
    assert "memory bandwidth" in v.summary and "no hardware counters" in v.summary


def test_input_starved_names_load_batch():
    v = _verdict("input_starved")
    assert v.kind == "input_starved" and v.confidence >= 0.9
    assert "load_batch" in v.evidence["line"] and v.evidence["host_in_gaps"]["data"] > 0.5


def _metric(kind: str, gpu: str = "0") -> Verdict:
    return Verdict(gpu, kind, "warning", 0.7, f"GPU {gpu}: {kind} from the metrics.", {"sm_active": 0.2}, [], 1.0, 7.0)


def test_refine_makes_launch_or_sync_bound_certain_with_the_trace():
    out = refine([_metric("launch_or_sync_bound"), _metric("throttled")], [_verdict("sync_heavy")])
    assert [v.kind for v in out] == ["sync_bound", "throttled"]
    v = out[0]
    assert "certain" in v.summary and v.evidence["metrics_verdict"] == "launch_or_sync_bound"
    assert (v.start_s, v.end_s) == (1.0, 7.0) and v.evidence["line"].startswith("sync_heavy.py")


def test_refine_keeps_a_clear_metrics_verdict_and_notes_the_disagreeing_trace():
    out = refine([_metric("compute_bound")], [_verdict("launch_bound")])
    assert [(v.kind, v.primary) for v in out] == [("compute_bound", True), ("trace_note", False)]
    assert "launch_bound" in out[1].summary and out[1].evidence["trace_verdict"] == "launch_bound"


def test_refine_matches_a_trace_to_its_gpu_by_process():
    trace = _verdict("input_starved")
    out = refine([_metric("launch_or_sync_bound", "0"), _metric("launch_or_sync_bound", "3")], [trace],
                 gpu_of_pid={trace.evidence["pid"]: "3"})
    assert [(v.gpu, v.kind) for v in out] == [("0", "launch_or_sync_bound"), ("3", "input_starved")]


def test_trace_analyze_prints_and_returns_the_verdicts(capsys):
    assert main(["trace", "analyze", str(TRACES / "launch_bound.pt.trace.json.gz")]) == 0
    head = capsys.readouterr().out.splitlines()[:4]
    assert any(line.startswith("Verdict launch_bound") for line in head), head
    assert main(["trace", "analyze", "--json", str(TRACES / "h2d_pageable.pt.trace.json.gz")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["traces"][0]["verdicts"][0]["kind"] == "transfer_bound"


def test_diagnose_with_a_trace_turns_the_simulated_sync_bound_certain(capsys):
    # Without the trace the simulated sync_bound node's metrics can only say launch_or_sync_bound.
    assert main(["diagnose", "--simulate", "sync_bound", "--seconds", "6",
                 "--trace", str(TRACES / "sync_heavy.pt.trace.json.gz")]) == 0
    out = capsys.readouterr().out
    primary = [line for line in out.splitlines() if line.lstrip("! ").startswith("GPU")]
    assert len(primary) == 1 and "sync_bound" in primary[0] and "certain" in primary[0], out


def test_diagnose_with_an_unreadable_trace_says_so_in_one_sentence(tmp_path, capsys):
    bad = tmp_path / "x.pt.trace.json"
    bad.write_text("{not json")
    assert main(["diagnose", "--simulate", "sync_bound", "--seconds", "6", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(bad) in err and "Traceback" not in err


@pytest.mark.parametrize(("frames", "kind"), [
    (["input_starved.py(13): load_batch", "numpy/_core/numeric.py(1222): roll"], "data"),
    (["sync_heavy.py(9): step", "<built-in method item of Tensor object at 0x7f87a5298690>"], "sync"),
    (["train.py(5): step", "torch/nn/modules/module.py(1783): _call_impl"], "launch"),
    (["sync_heavy.py(9): step", "sync_heavy.py(14): <genexpr>"], "other"),
])
def test_profiler_frame_names_sort_like_py_spy_stacks(frames, kind):
    from gpuscope.diagnose.stacks import classify_profiler_frames
    from gpuscope.trace.stacks import is_user_file

    assert classify_profiler_frames(frames, is_user_file) == kind
