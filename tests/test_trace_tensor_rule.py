"""The trace's counterparts of the metric verdicts tensor_cores_unused and memory_bound, on golden H200
traces: an FP32 GEMM loop (tests/gpu/workloads/fp32_gemm.py, cuBLAS's ffma kernels, no tensor-core
kernel) is tensor_cores_unused at its matmul line, by the kernels' names; memory_bound's elementwise
passes are elementwise_heavy; the workloads that use the tensor cores or mix kernels raise neither."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpuscope.diagnose import Verdict
from gpuscope.trace import tensor_cores
from gpuscope.trace.kineto import load
from gpuscope.trace.model import EventKind, Trace
from gpuscope.trace.rule_thresholds import RuleThresholds
from gpuscope.trace.rules import findings
from gpuscope.trace.verdicts import refine, verdicts

TRACES = Path(__file__).parent / "fixtures" / "traces"
WORKLOADS = Path(__file__).parent / "gpu" / "workloads"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "workloads"


def _trace(name: str) -> Trace:
    return load(TRACES / f"{name}.pt.trace.json.gz")


def _rules(name: str, roots: list[str] | None = None, th: RuleThresholds | None = None) -> dict:
    return {f.rule: f for f in findings(_trace(name), th or RuleThresholds(), source_roots=roots or [])}


def test_fp32_gemm_is_matrix_math_on_the_cuda_cores_at_its_line():
    f = _rules("fp32_gemm", [str(WORKLOADS)])["tensor_cores_unused"]
    e = f.evidence
    assert f.severity == "high" and e["launches"] == 50 and e["share"] > 0.9 and e["kernel_time_share"] == 1.0
    assert e["tensor_core_launches"] == 0 and e["inferred_launches"] == 0 and e["precision"] == "fp32"
    assert all("ffma" in name for name in e["kernels"])
    assert "no kernel of the trace used the tensor cores" in f.summary
    loc, n = f.locations[0]
    src = (WORKLOADS / "fp32_gemm.py").read_text().splitlines()
    assert (loc.file, loc.function, n) == ("fp32_gemm.py", "step", 50) and src[loc.line - 1].strip() == "torch.matmul(x, y)"
    assert "torch.set_float32_matmul_precision('high')" in f.fix and f"fp32_gemm.py:{loc.line}" in f.fix


def test_fp32_gemm_trace_verdict_is_tensor_cores_unused_not_compute_bound():
    [v] = verdicts(_trace("fp32_gemm"))
    assert v.kind == "tensor_cores_unused" and v.confidence == 0.9 and v.evidence["simt_kernel_share"] == 1.0
    assert "FP32" in v.summary and v.recommendations and "TF32" in v.recommendations[0]


def test_refine_keeps_a_metrics_verdict_and_notes_the_traces_disagreement():
    [t] = verdicts(_trace("fp32_gemm"))
    same = Verdict("0", "tensor_cores_unused", "warning", 0.8, "metrics", {}, [])
    assert [v.kind for v in refine([same], [t])] == ["tensor_cores_unused"]
    other = replace(same, kind="compute_bound")
    out = refine([other], [t])
    assert [v.kind for v in out] == ["compute_bound", "trace_note"] and out[1].evidence["trace_verdict"] == t.kind


@pytest.mark.parametrize("name", ["compute_bound", "healthy_training", "input_starved", "h2d_pageable", "memory_bound"])
def test_workloads_on_the_tensor_cores_or_without_matrix_math_raise_no_tensor_finding(name):
    assert "tensor_cores_unused" not in _rules(name)


@pytest.mark.parametrize("name", ["sync_heavy", "launch_bound"])
def test_a_little_fp32_matrix_math_in_a_host_bound_loop_is_under_the_threshold(name):
    """Both run FP32 matmuls on the CUDA cores, a few % of their traced time: found with no threshold, not with it."""
    assert "tensor_cores_unused" not in _rules(name)
    f = _rules(name, th=RuleThresholds(tensor_unused_min_share=0.0))["tensor_cores_unused"]
    assert 0 < f.evidence["share"] < RuleThresholds().tensor_unused_min_share and f.evidence["tensor_core_launches"] == 0


def _renamed(trace: Trace, rename: dict[str, str]) -> Trace:
    names = [next((new for old, new in rename.items() if old in n), n) for n in trace.names]
    return replace(trace, names=names)


def test_a_matrix_kernel_whose_name_says_neither_counts_only_without_any_tensor_core_kernel():
    t = _trace("fp32_gemm")
    plain = _renamed(t, {"sm80_xmma_gemm": "my_gemm_kernel"})  # no marker either way
    f = {x.rule: x for x in findings(plain, source_roots=[])}["tensor_cores_unused"]
    assert f.evidence["inferred_launches"] == 50 and f.evidence["launches"] == 50
    # the same, beside one tensor-core kernel (one of the matmuls given an nvjet name): nothing inferred
    ev = t.events
    first = int(ev["name"][ev["kind"] == EventKind.KERNEL][0])
    names = list(plain.names) + ["nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"]
    column = ev["name"].copy()
    column[int(next(i for i, k in enumerate(ev["kind"]) if k == EventKind.KERNEL and ev["name"][i] == first))] = len(names) - 1
    mixed = replace(plain, names=names, events={**ev, "name": column})
    assert "tensor_cores_unused" not in {x.rule for x in findings(mixed, source_roots=[])}


def test_memory_bound_is_elementwise_heavy_at_its_step():
    roots = [str(SHARED)] if SHARED.is_dir() else []
    f = _rules("memory_bound", roots)["elementwise_heavy"]
    e = f.evidence
    assert f.severity == "high" and e["launches"] == 10 and e["kernel_time_share"] == 1.0 and e["share"] > 0.5
    assert e["median_kernel_us"] > 500 and f.locations[0][0].function == "step"
    assert "torch.compile" in f.fix and "counters" in e["note"]
    [v] = verdicts(_trace("memory_bound"))
    assert v.kind == "healthy"  # a trace still does not call it memory-bound: it has no DRAM counters


@pytest.mark.parametrize("name", ["healthy_training", "compute_bound", "fp32_gemm", "launch_bound", "sync_heavy",
                                  "input_starved"])
def test_no_elementwise_finding_where_the_kernel_time_is_mixed_or_tiny(name):
    assert "elementwise_heavy" not in _rules(name)


@pytest.mark.parametrize(("name", "expected"), [
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_nn_align1>(cutlass_80_simt_sgemm_64x64_8x5_nn_align1::Params)",
     "simt"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize256x128x8_stage3_warpsize4x2x1_ffma_aligna4_alignc4_execute_kernel",
     "simt"),
    ("void gemmSN_TN_kernel<float, 128, 16, 2, 4, 4, 4, true>(cublasGemmSmallNParams<float const, float const, float>)",
     "simt"),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>(...)", "simt"),
    ("ampere_sgemm_128x64_nn", "simt"),
    ("void cudnn::detail::implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>(...)", "simt"),
    ("void cudnn::detail::wgrad_alg0_engine<float, 128, 6, 8, 3, 3, 5, false, 512>(...)", "simt"),
    ("void cutlass::Kernel2<cutlass_80_simt_dgemm_64x64_8x5_nn_align1>(...)", "simt"),
    ("volta_h884gemm_64x64_ldg8_nn", "tensor"),
    ("turing_s1688gemm_fp16_128x128_ldg8_nn", "tensor"),
    ("ampere_h16816gemm_256x128_ldg8_stages_64x3_nn", "tensor"),
    ("cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4", "tensor"),
    ("sm90_xmma_wgrad_indexed_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize64x64x32_warpgroupsize1x1x1", "tensor"),
    ("sm80_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x32", "tensor"),
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", "tensor"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0", "tensor"),
    ("sm90_xmma_gemm_f64f64_f64f64_f64_nn_n_tilesize64x64x16_dmma", "tensor"),
    ("my_custom_gemm_kernel", "matmul"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, false, float, float, float>(...)", None),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true>(...)", None),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<float> >(...)", None),
    ("triton_tem_fused_mm_0", None),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>(...)", None),
])
def test_kernel_names(name, expected):
    assert tensor_cores.kind(name) == expected


def test_every_matrix_kernel_of_the_golden_traces_is_told():
    """In the H200 traces, every matrix-multiply / convolution kernel is named one way or the other."""
    told = {}
    for path in sorted(TRACES.glob("*.pt.trace.json.gz")):
        t = load(path)
        ev = t.events
        for i in set(ev["name"][ev["kind"] == EventKind.KERNEL].tolist()):
            told[t.names[i]] = tensor_cores.kind(t.names[i])
    assert "matmul" not in told.values(), [n for n, k in told.items() if k == "matmul"]
    assert {k for n, k in told.items() if "nvjet" in n or "tf32" in n} == {"tensor"}
    assert {k for n, k in told.items() if "ffma" in n or "simt" in n} == {"simt"}


@pytest.mark.parametrize(("name", "expected"), [
    ("cutlass_80_simt_dgemm_64x64_8x5_nn_align1", "fp64"), ("ampere_sgemm_128x64_nn", "fp32"),
    ("void gemv2T_kernel_val<int, int, double, double, double, double, 128>", "fp64"),
    ("cutlass_80_simt_cgemm_32x32_8x5_nn", "complex"), ("maxwell_hgemm_256x128_nn", "fp16"),
])
def test_precision_from_the_name(name, expected):
    assert tensor_cores.precision(name) == expected


def test_the_readme_maps_every_metric_verdict_to_a_trace_counterpart():
    """The README's verdict -> trace table is closed: every metric verdict has a row, every rule it names exists."""
    import re

    from gpuscope.diagnose.rules import ADVICE
    from gpuscope.trace import rules

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = text.split("<!-- verdict-to-trace -->", 1)[1].split("<!-- /verdict-to-trace -->", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+) \|$", table, re.MULTILINE))
    assert set(rows) == set(ADVICE)
    named = {r for cell in rows.values() for r in re.findall(r"rules? ((?:`\w+`(?:, )?)+)", cell) for r in
             re.findall(r"`(\w+)`", r)}
    have = {f.__name__.lstrip("_") for f in rules._RULES}
    assert named == have, (named - have, have - named)  # each rule it names exists; every rule answers a verdict
