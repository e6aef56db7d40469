"""Every fix in its framework's words (gpuscope.diagnose.advice): every verdict kind the rules can make and
every trace rule has words for every framework or falls back to the CUDA-level ones explicitly; no PyTorch
words in another framework's fix; a CuPy trace written by the CUPTI backend gets CuPy's fixes; the H200
recordings keep their verdicts and the PyTorch advice they were given live."""

from __future__ import annotations

import ast
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_run_recordings import load as load_run
from test_run_recordings import window as run_window
from workload_labels import EXPECTED

from gpuscope import Sampler, SamplerConfig
from gpuscope.diagnose import advice, diagnose, windows_from_snapshots
from gpuscope.diagnose.rules import ADVICE
from gpuscope.sim import SimulatedNode
from gpuscope.trace import rules as trace_rules
from gpuscope.trace import tensor_cores
from gpuscope.trace.kineto import load
from gpuscope.trace.rules import findings, trace_frameworks
from gpuscope.trace.verdicts import verdicts as trace_verdicts

SRC = Path(__file__).resolve().parents[1] / "src" / "gpuscope"
TRACES = Path(__file__).parent / "fixtures" / "traces"
CUPY_TRACE = TRACES / "cupy_loop.cupti.pt.trace.json.gz"
OTHERS = [f for f in advice.FRAMEWORKS if f != "torch"]
# PyTorch's words: none of them belongs in another framework's fix (CuPy's Stream(non_blocking=True) is its own).
TORCH_WORDS = ("torch", ".item()", "DataLoader", "autocast", "pin_memory", "num_workers", "loss.detach",
               "channels_last", "reduce-overhead")
# Verdicts that carry another verdict's fixes: a trace_note has the trace verdict's, framework-aware already.
CARRIES_ANOTHERS = {"trace_note"}


def _calls(path: Path) -> list[ast.Call]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]


def _name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _const(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def verdict_kinds() -> set[str]:
    """Every kind the metric and trace verdict rules can make, read from their source (a new kind is found
    here the day it is written), and every kind ADVICE names."""
    kinds = set(ADVICE)
    for path in (SRC / "diagnose" / "rules.py", SRC / "trace" / "verdicts.py"):
        for call in _calls(path):
            name = _name(call)
            if name == "make" and call.args and _const(call.args[0]):
                kinds.add(_const(call.args[0]))
            elif name in ("verdict", "Verdict") and len(call.args) > 1 and _const(call.args[1]):
                kinds.add(_const(call.args[1]))
    return kinds - CARRIES_ANOTHERS


def test_the_walk_finds_the_kinds():
    kinds = verdict_kinds()
    assert {"launch_bound", "sync_bound", "idle_allocated", "imbalance", "gpu_lost", "memory_growth"} <= kinds
    assert len(kinds) >= 20


@pytest.mark.parametrize("kind", sorted(verdict_kinds()))
def test_every_verdict_kind_has_a_fix_for_every_framework_or_falls_back_explicitly(kind):
    cuda = advice.VERDICTS["cuda"].get(kind)
    assert cuda, f"{kind}: no CUDA-level fix (the fallback) in diagnose/advice.py"
    for f in advice.FRAMEWORKS:
        words = advice.VERDICTS[f].get(kind)
        assert words and all(w.strip() for w in words), f"{kind}: no fix for {f} in diagnose/advice.py"
        if f not in ("cuda", "torch") and words == cuda:  # torch's are ADVICE's own, wherever they match
            assert kind in advice.NEUTRAL or kind in advice.SAME_AS_CUDA.get(f, ()), \
                f"{kind}: {f} has the CUDA-level words without saying so (advice.SAME_AS_CUDA)"
        assert advice.fixes(kind, (f,)) == words
    assert advice.fixes(kind, ()) == cuda  # nothing known: the CUDA-level fix
    if kind in advice.NEUTRAL:
        assert all(advice.VERDICTS[f][kind] == cuda for f in advice.FRAMEWORKS)


def rule_keys() -> tuple[set[str], set[str], set[str]]:
    """From trace/rules.py: the rules its findings name, the fix keys it asks advice for (exact), and the
    prefixes of keys it builds (f"low_occupancy.{...}")."""
    names, keys, prefixes = set(), set(), set()
    for call in _calls(SRC / "trace" / "rules.py"):
        name = _name(call)
        if name == "Finding":
            if call.args and _const(call.args[0]):
                names.add(_const(call.args[0]))
            fix = call.args[5] if len(call.args) > 5 else next((k.value for k in call.keywords if k.arg == "fix"), None)
            assert isinstance(fix, ast.Call) and _name(fix) == "rule_fix", \
                f"trace/rules.py line {call.lineno}: a finding's fix must come from advice.rule_fix"
        elif name == "_sync_transfers" and len(call.args) > 1 and _const(call.args[1]):
            names.add(_const(call.args[1]))
        elif name == "rule_fix" and call.args:
            key = call.args[0]
            if _const(key):
                keys.add(_const(key))
            elif isinstance(key, ast.JoinedStr) and key.values and _const(key.values[0]):
                prefixes.add(_const(key.values[0]))
    return names, keys, prefixes


def test_every_trace_rule_has_a_fix_for_every_framework_or_falls_back_explicitly():
    names, keys, prefixes = rule_keys()
    assert {"pageable_memcpy", "sync_memcpy", "sync_in_loop", "gpu_gaps", "tiny_kernel_storm", "low_occupancy",
            "tensor_cores_unused"} <= names
    torch_keys = set(advice.RULES["torch"])
    for rule in names:
        assert rule in torch_keys or any(k.startswith(rule + ".") for k in torch_keys), f"no fix for rule {rule}"
    assert keys <= torch_keys, keys - torch_keys
    assert all(any(k.startswith(p) for k in torch_keys) for p in prefixes), prefixes
    # The keys the rules build cover what they can build: every limiter, every precision.
    limiters = {trace_rules._limit_key(s) for s in ("grid size (3 blocks for 132 SMs)", "registers (255 per thread: 1)",
                                                    "shared (99000 B per block: 2)", "threads (1024 per block: 2)",
                                                    "grid size (unknown)")}
    precisions = {tensor_cores.precision(n) for n in ("sgemm", "dgemm", "cgemm", "hgemm")} | {"gemv"}
    assert {f"low_occupancy.{k}" for k in limiters} | {f"tensor_cores_unused.{p}" for p in precisions} <= torch_keys
    cuda = advice.RULES["cuda"]
    for f in advice.FRAMEWORKS:
        assert set(advice.RULES[f]) == torch_keys, (f, torch_keys ^ set(advice.RULES[f]))
        for key, text in advice.RULES[f].items():
            assert text.strip(), (f, key)
            if f not in ("cuda", "torch") and text == cuda[key]:
                assert key in advice.RULES_SAME_AS_CUDA.get(f, ()), \
                    f"{key}: {f} has the CUDA-level words without saying so (advice.RULES_SAME_AS_CUDA)"
            filled = advice.rule_fix(key, (f,), call="cudaDeviceSynchronize", where="step.py:12", at=" at step.py:3")
            assert "{" not in filled and "}" not in filled, (f, key, filled)
        assert advice.rule_fix("pageable_memcpy", ()) == cuda["pageable_memcpy"]


@pytest.mark.parametrize("framework", OTHERS)
def test_no_pytorch_words_in_another_framework_s_fixes(framework):
    texts = [w for words in advice.VERDICTS[framework].values() for w in words] + list(advice.RULES[framework].values())
    for text in texts:
        for word in TORCH_WORDS:
            assert word.lower() not in text.lower(), (framework, word, text)


def test_which_framework_speaks():
    lb = "launch_bound"
    assert advice.fixes(lb, ("torch", "triton")) == ADVICE[lb]  # torch.compile's code generator is torch's
    assert advice.fixes(lb, ("jax", "tensorflow")) == advice.VERDICTS["jax"][lb]  # tf.data beside JAX
    assert advice.fixes(lb, ("numba", "cuda-python")) == advice.VERDICTS["numba"][lb]  # numba-cuda's bindings
    assert advice.fixes(lb, ("cuda",)) == advice.fixes(lb, ()) == advice.fixes(lb, ("no-such", "")) \
        == advice.VERDICTS["cuda"][lb]
    both = advice.fixes(lb, ("cupy", "torch"))  # a PyTorch process that runs CuPy kernels: each says its own
    assert both == [f"PyTorch: {w}" for w in ADVICE[lb]] + [f"CuPy: {w}" for w in advice.VERDICTS["cupy"][lb]]
    assert advice.fixes("hardware", ("cupy", "torch")) == ADVICE["hardware"]  # the same words: said once
    assert advice.fixes("no_such_kind", ("torch",)) == []
    assert advice.leads(["triton"]) == ("triton",) and advice.leads(["numba", "torch"]) == ("torch",)
    two = advice.rule_fix("sync_in_loop", ("jax", "cupy"), call="x", where="a.py:1")
    assert two.startswith("JAX: Move the x out of the loop at a.py:1") and " CuPy: Move the x" in two
    assert advice.rule_fix("sync_in_loop", ("cupy",)).startswith("Move the synchronisation out of the loop at its line")


def test_a_gpus_processes_frameworks_reach_its_verdict():
    class P:
        def __init__(self, *fw: str) -> None:
            self.frameworks = fw

    assert advice.frameworks_of([P("torch"), P(), P("cupy", "torch"), object()]) == ("torch", "cupy")


# -- traces ---------------------------------------------------------------------------------------------


def test_a_cupy_trace_from_the_cupti_backend_gets_cupy_s_fixes():
    t = load(CUPY_TRACE)
    assert t.meta["gpuscope"]["backend"] == "cupti" and trace_frameworks(t) == ("cupy",)
    found = {f.rule: f for f in findings(t)}
    assert {"sync_in_loop", "pageable_memcpy", "gpu_gaps"} <= set(found)
    cupy = advice.RULES["cupy"]
    assert found["pageable_memcpy"].fix == cupy["pageable_memcpy"] and "cupyx.empty_pinned" in cupy["pageable_memcpy"]
    assert found["gpu_gaps"].fix == cupy["gpu_gaps"]
    sync = found["sync_in_loop"]
    loc = sync.locations[0][0]
    assert (loc.file, loc.line) == ("cupy_loop.py", 12)
    assert sync.fix == cupy["sync_in_loop"].format(call="cudaDeviceSynchronize", where="cupy_loop.py:12")
    assert "torch" not in sync.summary  # the sync is named as CUDA named it, not torch.cuda.synchronize()
    for f in found.values():
        assert not any(w.lower() in f.fix.lower() for w in TORCH_WORDS), (f.rule, f.fix)
    [v] = trace_verdicts(t)
    assert v.kind == "sync_bound" and v.recommendations == [sync.fix]


def test_trace_analyze_prints_cupy_s_fixes():
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "analyze", "--json", str(CUPY_TRACE)],
                       capture_output=True, text=True, timeout=120, cwd=TRACES)
    assert p.returncode == 0, p.stderr
    fixes = {f["rule"]: f["fix"] for f in json.loads(p.stdout)["traces"][0]["findings"]}
    assert fixes["pageable_memcpy"] == advice.RULES["cupy"]["pageable_memcpy"]
    assert "cupy.asnumpy" in fixes["sync_in_loop"] and "torch" not in json.dumps(fixes)


def test_a_cupti_trace_that_names_no_frameworks_gets_the_cuda_level_fixes(tmp_path):
    doc = json.loads(gzip.decompress(CUPY_TRACE.read_bytes()))
    del doc["gpuscope_cupti"]["frameworks"]  # as the backend wrote them before it named them
    path = tmp_path / "old.pt.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    t = load(path)
    assert trace_frameworks(t) == ()
    found = {f.rule: f for f in findings(t, source_roots=[str(TRACES)])}
    assert found["pageable_memcpy"].fix == advice.RULES["cuda"]["pageable_memcpy"]
    assert "cudaMallocHost" in found["pageable_memcpy"].fix


def test_the_pytorch_traces_keep_pytorch_s_fixes():
    for name, rule in (("h2d_pageable", "pageable_memcpy"), ("launch_bound", "tiny_kernel_storm")):
        t = load(TRACES / f"{name}.pt.trace.json.gz")
        assert trace_frameworks(t) == ("torch",)
        [f] = [f for f in findings(t) if f.rule == rule]
        assert f.fix == advice.RULES["torch"][rule]
    t = load(TRACES / "sync_heavy.pt.trace.json.gz")
    [f] = [f for f in findings(t) if f.rule == "sync_in_loop"]
    loc = f.locations[0][0]
    assert f.fix == advice.RULES["torch"]["sync_in_loop"].format(call=".item()", where=f"{loc.file}:{loc.line}")


def test_the_cupti_backend_still_names_the_frameworks(tmp_path):
    """The fixture's maker, run again: the real bootstrap and backend write `gpuscope_cupti.frameworks`."""
    sys.path.insert(0, str(TRACES))
    try:
        from capture_cupti import capture
    finally:
        sys.path.remove(str(TRACES))
    out = tmp_path / "again.pt.trace.json.gz"
    capture(out)
    assert json.loads(gzip.decompress(out.read_bytes()))["gpuscope_cupti"]["frameworks"] == ["cupy"]


# -- metric verdicts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_h200_run_recordings_keep_their_verdicts_and_pytorch_advice(name):
    """Replayed as the reference workloads (PyTorch) would be read now, with frameworks ('torch',): the same
    verdicts as without, and the very advice `gpuscope run` gave on the H200. Unknown: the CUDA-level words;
    JAX: the same verdicts in JAX's words."""
    data = load_run(name)
    live = {s["kind"]: s["recommendations"] for s in data["timeline"]}
    t, compared = 5.0, 0
    while t <= data["duration_s"] - 2.0:
        by_fw = {}
        for fw in (("torch",), (), ("jax",)):
            w = run_window(data, max(0.0, t - 10.0), t)
            for p in w.processes:
                p.frameworks = fw
            by_fw[fw] = [v for v in diagnose([w]) if v.primary]
        kinds = [v.kind for v in by_fw[("torch",)]]
        assert kinds == [v.kind for v in by_fw[()]] == [v.kind for v in by_fw[("jax",)]]
        for v, u, j in zip(by_fw[("torch",)], by_fw[()], by_fw[("jax",)], strict=True):
            assert v.recommendations == ADVICE[v.kind]
            if v.kind in live:
                assert v.recommendations == live[v.kind]
                compared += 1
            assert u.recommendations == advice.VERDICTS["cuda"][v.kind]
            assert j.recommendations == advice.VERDICTS["jax"][v.kind]
        t += 5.0
    assert compared > 0


def simulated(node: SimulatedNode, seconds: float = 12.0):
    """The real sampler on a simulated node with a fake clock (as tests/test_diagnose.py), fast."""
    s = Sampler(SamplerConfig(interval=0.1, collect_host=False), nvml=node.nvml, host_reader=node.host_reader,
                host_source=node.host_source)
    s.open()
    t = [0.0]
    s.nvml.lib.clock = lambda: t[0]
    s.nvml.lib.t0 = 0.0
    s._gpm_source.clock = lambda: t[0]
    snaps = []
    for k in range(int(seconds / 0.1)):
        t[0] = k * 0.1
        snap = s._tick(1000.0 + t[0])
        snap.time_ns = int((1000.0 + t[0]) * 1e9)
        snaps.append(snap)
    s.stop()
    return windows_from_snapshots(snaps)


@pytest.mark.parametrize("scenario", ["launch_bound", "transfer_bound", "memory_bound"])
def test_a_simulated_gpu_s_verdict_speaks_its_processes_framework(scenario):
    [torch_v] = [v for v in diagnose(simulated(SimulatedNode(scenario))) if v.primary]
    [cupy_v] = [v for v in diagnose(simulated(SimulatedNode(scenario, frameworks=("cupy",)))) if v.primary]
    assert torch_v.kind == cupy_v.kind
    assert torch_v.recommendations == ADVICE[torch_v.kind]
    assert cupy_v.recommendations == advice.VERDICTS["cupy"][cupy_v.kind] != torch_v.recommendations


def test_diagnose_cli_on_the_simulated_node_says_pytorch_s_words():
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "diagnose", "--simulate", "transfer_bound",
                        "--seconds", "5.5", "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    [v] = [v for v in json.loads(p.stdout)["verdicts"] if v["primary"]]
    assert v["kind"] == "transfer_bound" and v["recommendations"] == ADVICE["transfer_bound"]
