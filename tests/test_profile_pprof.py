"""GPU time by stack (trace/profile.py): the golden traces folded, merged and written as pprof, decoded by a
third-party reader (DataDog's pprof-format, from npm) and held against the traces' own GPU ops; the folded
form read back under its caps; speedscope; the generated profile.proto module."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpuscope.trace.flame import gpu_flame
from gpuscope.trace.kineto import load
from gpuscope.trace.model import GPU_KINDS
from gpuscope.trace.profile import (
    NO_LAUNCHER,
    SAMPLE_TYPES,
    NoProtobuf,
    Profile,
    ProfileError,
    _function_name,
    _thread,
    fold,
    merge,
)

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "fixtures" / "traces"
READER = ROOT / "tests" / "pprof_reader"
GOLDEN = sorted(p.name for p in TRACES.glob("*.pt.trace.json.gz"))


@pytest.fixture(scope="session")
def decode():
    """pprof-format decoding a file in node: its JSON (tests/pprof_reader/decode.js)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the pprof-format reader (apt-get install nodejs npm)")
    if not (READER / "node_modules" / "pprof-format").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=READER, check=True, capture_output=True)

    def run(path: Path) -> dict:
        out = subprocess.run(["node", str(READER / "decode.js"), str(path)], capture_output=True, text=True,
                             check=True)
        return json.loads(out.stdout)

    return run


@pytest.fixture(scope="module")
def traces():
    return {name: load(TRACES / name) for name in GOLDEN}


def expected_stacks(trace, node: str) -> dict[tuple, list[int]]:
    """From the trace itself: the flame's stacks ((function, file, line) root first, as pprof writes them),
    [ns, ops] each, plus the ops whose launch is not in the trace under one frame."""
    flame = gpu_flame(trace)
    meta_pid = int(np.unique(trace.events["pid"][(trace.events["device"] == -1) & (trace.events["pid"] > 0)])[0])
    out: dict[tuple, list[int]] = {}
    for stack, ns in flame.stacks.items():
        key = (node,) + tuple((_function_name(f), f.file, f.line) for f in (_thread(f, meta_pid) for f in stack))
        out[key] = [ns, flame.launches[stack]]
    if flame.unattributed_ops:
        out[(node, (NO_LAUNCHER, "", 0))] = [flame.unattributed_ns, flame.unattributed_ops]
    return out


def test_pprof_totals_per_stack_are_the_traces_gpu_time(traces, decode, tmp_path):
    """Every golden trace on a node of its own, merged into one pprof: per stack and node the decoded GPU time
    and launches are the flame's, and per node the total is every GPU op's time in that trace."""
    profiles, want = [], {}
    for i, (name, trace) in enumerate(traces.items()):
        node = f"node-{i}"
        profiles.append(fold(trace, node=node, job="slurm/42" if i % 2 else ""))
        want.update(expected_stacks(trace, node))
        gpu = np.isin(trace.events["kind"], GPU_KINDS)
        assert sum(v[0] for k, v in want.items() if k[0] == node) == int(trace.events["dur_ns"][gpu].sum()), name
        assert sum(v[1] for k, v in want.items() if k[0] == node) == int(gpu.sum()), name
    merged = merge(profiles)
    path = tmp_path / "gpu.pb.gz"
    path.write_bytes(merged.pprof())
    assert path.read_bytes()[:2] == b"\x1f\x8b"  # gzip, as pprof expects on disk

    got = decode(path)
    assert got["sampleTypes"] == [list(t) for t in SAMPLE_TYPES] and got["defaultSampleType"] == "gpu_time"
    decoded: dict[tuple, list[int]] = {}
    for s in got["samples"]:
        key = (s["labels"]["node"],) + tuple(tuple(f) for f in s["stack"])
        assert key not in decoded  # one sample per stack and labels
        decoded[key] = s["values"]
        assert isinstance(s["labels"]["pid"], int) and s["labels"].get("job") in (None, "slurm/42")
    assert decoded == want
    assert got["comments"] == [merged.summary()]
    # a user frame keeps its file and line apart from the function, as pprof's tools show them
    assert any(f == ["step", "launch_bound.py", 10] for s in got["samples"] for f in s["stack"])


def test_the_same_stacks_of_two_processes_merge_into_one_per_label_set(traces):
    trace = traces["launch_bound.pt.trace.json.gz"]
    a, b = fold(trace, node="n1", job="j"), fold(trace, node="n2", job="j")
    m = merge([a, b, a])
    assert m.total_ns == 3 * a.total_ns and m.total_launches == 3 * a.total_launches
    assert len(m.frames) == len(a.frames) and len(m.samples) == 2 * len(a.samples)  # one set per node
    assert merge([m]).by_stack() == m.by_stack()
    assert {k: [3 * v[0], 3 * v[1]] for k, v in a.by_stack().items()} == m.by_stack()
    assert len(m.windows) == 3


def test_a_sampled_launcher_trace_keeps_its_launch_counts(traces):
    """The CUPTI fixture's launches were sampled: inferred time and ops stay whole, under [sampled launcher]."""
    trace = traces["cupy_loop.cupti.pt.trace.json.gz"]
    p = fold(trace)
    gpu = np.isin(trace.events["kind"], GPU_KINDS)
    assert p.total_ns == int(trace.events["dur_ns"][gpu].sum()) and p.total_launches == int(gpu.sum())


def test_the_folded_form_round_trips_through_json(traces):
    p = fold(traces["healthy_training.pt.trace.json.gz"], node="n", job="torchrun/r1")
    q = Profile.from_json(json.loads(json.dumps(p.to_json())))
    assert q.by_stack() == p.by_stack() and q.samples == p.samples and q.windows == p.windows


def good_doc() -> dict:
    return {"format": "gpuscope.profile/1", "frames": [["main thread", "thread", "", 0], ["k", "kernel", "", 0]],
            "samples": [[[0, 1], {"node": "n"}, 10, 1]], "windows": [{"node": "n", "pid": 3}]}


@pytest.mark.parametrize("change, words", [
    (lambda d: d.pop("format"), "not a gpuscope profile"),
    (lambda d: d.update(frames={}), "not lists"),
    (lambda d: d["frames"].append(["x", "rootkit", "", 0]), "frame 2 is not"),
    (lambda d: d["frames"].append(["", "op", "", 0]), "frame 2 is not"),
    (lambda d: d["frames"].append(["x" * 5000, "op", "", 0]), "frame 2 is not"),
    (lambda d: d["frames"].append(["k", "kernel", "", 0]), "lists a frame twice"),
    (lambda d: d["samples"].append([[0, 9], {}, 1, 1]), "sample 1 is not"),
    (lambda d: d["samples"].append([[], {}, 1, 1]), "sample 1 is not"),
    (lambda d: d["samples"].append([[0], {}, -1, 1]), "sample 1 is not"),
    (lambda d: d["samples"].append([[0], {}, 1.5, 1]), "sample 1 is not"),
    (lambda d: d["samples"].append([[0], {}, True, 1]), "sample 1 is not"),
    (lambda d: d["samples"].append([[0] * 2000, {}, 1, 1]), "sample 1 is not"),
    (lambda d: d["samples"].append([[0], {"__import__": "os"}, 1, 1]), "sample 1's labels"),
    (lambda d: d["samples"].append([[0], {"node": 7}, 1, 1]), "sample 1's labels"),
    (lambda d: d["samples"].extend([[[0], {}, 2**61, 1]] * 3), "beyond what a profile can hold"),
    (lambda d: d["windows"].append({"cmd": "rm -rf /"}), "window 1 is not"),
    (lambda d: d["windows"].append([1]), "window 1 is not"),
])
def test_a_hostile_folded_profile_is_one_sentence(change, words):
    doc = good_doc()
    Profile.from_json(doc)  # the baseline reads
    change(doc)
    with pytest.raises(ProfileError) as e:
        Profile.from_json(doc)
    assert words in str(e.value) and "\n" not in str(e.value), e.value


def test_caps_bound_what_is_read(monkeypatch):
    import gpuscope.trace.profile as mod

    monkeypatch.setattr(mod, "MAX_SAMPLES", 2)
    doc = good_doc()
    doc["samples"] *= 3
    with pytest.raises(ProfileError, match="3 samples, more than the 2 allowed"):
        Profile.from_json(doc)
    with pytest.raises(ProfileError):
        Profile.from_json([])


def test_speedscope_of_a_merge_reuses_the_flame_writer(traces):
    p = merge([fold(traces[n], node=n) for n in ("launch_bound.pt.trace.json.gz", "sync_heavy.pt.trace.json.gz")])
    doc = p.speedscope("title")
    prof = doc["profiles"][0]
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json" and doc["name"] == "title"
    assert abs(sum(prof["weights"]) - p.total_ns / 1e3) < 1e-6 * p.total_ns
    assert len(prof["samples"]) == len(p.by_stack())
    frames = doc["shared"]["frames"]
    assert all(0 <= i < len(frames) for s in prof["samples"] for i in s)
    assert {"name": "step (launch_bound.py:10)", "file": "launch_bound.py", "line": 10} in frames


def test_pprof_without_protobuf_is_one_sentence(monkeypatch, traces):
    monkeypatch.setitem(sys.modules, "gpuscope.trace._pprof.profile_pb2", None)
    with pytest.raises(NoProtobuf, match=r"pip install 'gpuscope\[profile\]'"):
        fold(traces["sync_heavy.pt.trace.json.gz"]).pprof()


def test_generated_code_matches_the_proto(tmp_path):
    """The checked-in module is what grpcio-tools makes from the checked-in proto, and the proto is pprof's."""
    pytest.importorskip("grpc_tools")
    pkg = Path("gpuscope/trace/_pprof")
    src = ROOT / "src" / pkg
    (tmp_path / pkg).mkdir(parents=True)
    shutil.copy(src / "profile.proto", tmp_path / pkg / "profile.proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_path}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", str(pkg / "profile.proto")], cwd=tmp_path, check=True)
    for name in ("profile_pb2.py", "profile_pb2.pyi"):
        assert (tmp_path / pkg / name).read_text() == (src / name).read_text(), f"{name}: regenerate it"
    proto = (src / "profile.proto").read_text()
    assert "Licensed under the Apache License, Version 2.0" in proto and "b9395ee17fa0d001" in proto
    assert "package perftools.profiles;" in proto and "repeated string string_table = 6;" in proto
