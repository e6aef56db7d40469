"""The GPU-time flame graph: every attributable GPU op's time lands on its launching stack, the speedscope
JSON has the schema's required fields, and the SVG is XML that a real Chromium renders."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from gpuscope.trace.flame import (
    SAMPLED_LAUNCHER,
    SPEEDSCOPE_SCHEMA,
    gpu_flame,
    speedscope,
    svg,
    write_speedscope,
    write_svg,
)
from gpuscope.trace.kineto import load
from gpuscope.trace.model import COLUMNS, GPU_KINDS, EventKind, Trace

TRACES = Path(__file__).parent / "fixtures" / "traces"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


def _trace(name: str) -> Trace:
    return load(TRACES / f"{name}.pt.trace.json.gz")


@pytest.mark.parametrize("name", ["launch_bound", "healthy_training", "sync_heavy", "h2d_pageable"])
def test_flame_total_is_the_attributed_gpu_time(name):
    trace = _trace(name)
    ev = trace.events
    gpu = np.isin(ev["kind"], GPU_KINDS)
    flame = gpu_flame(trace)
    assert sum(flame.stacks.values()) == flame.attributed_ns
    assert flame.attributed_ns + flame.unattributed_ns == int(ev["dur_ns"][gpu].sum())
    assert flame.unattributed_ratio < 0.01  # the fixtures record every launch
    leaves = {s[-1].kind for s in flame.stacks}
    assert leaves <= {"kernel", "memcpy", "memset"}


def test_launch_bound_widest_user_frame_is_step():
    flame = gpu_flame(_trace("launch_bound"))
    user: dict[str, int] = {}
    for stack, ns in flame.stacks.items():
        for f in {f for f in stack if f.kind == "user"}:
            user[f.name] = user.get(f.name, 0) + ns
    innermost = {[f for f in s if f.kind == "user"][-1].name for s in flame.stacks}
    assert innermost == {"step (launch_bound.py:10)"}
    assert user["step (launch_bound.py:10)"] == flame.attributed_ns


def test_unattributed_ops_are_counted_not_drawn():
    cols = {c: np.array(v, dtype=t) for (c, t), v in zip(COLUMNS.items(), (
        [EventKind.PYTHON, EventKind.RUNTIME, EventKind.KERNEL, EventKind.KERNEL],  # kind
        [0, 1, 2, 2], [0, 10, 20, 40], [100, 5, 10, 30], [1, 1, 0, 0], [1, 1, 7, 7],  # name ts dur pid tid
        [-1, -1, 0, 0], [-1, -1, 7, 7], [-1, 5, 5, 9], [-1] * 4, [-1] * 4, [-1] * 4), strict=True)}
    trace = Trace(cols, ["a.py(1): f", "cudaLaunchKernel", "k"])
    flame = gpu_flame(trace)
    assert flame.attributed_ns == 10 and flame.unattributed_ns == 30 and flame.unattributed_ops == 1
    (stack, ns), = flame.stacks.items()
    assert [f.name for f in stack] == ["thread 1", "f (a.py:1)", "k"] and ns == 10


def test_speedscope_has_the_schema_required_fields(tmp_path):
    trace = _trace("launch_bound")
    path = tmp_path / "x.speedscope.json"
    write_speedscope(trace, str(path))
    doc = json.loads(path.read_text())
    assert doc["$schema"] == SPEEDSCOPE_SCHEMA and doc == speedscope(trace)
    frames = doc["shared"]["frames"]
    assert all(isinstance(f["name"], str) for f in frames)
    (p,) = doc["profiles"]
    for key in ("type", "name", "unit", "startValue", "endValue", "samples", "weights"):  # SampledProfile
        assert key in p
    assert p["type"] == "sampled" and p["unit"] == "microseconds" and len(p["samples"]) == len(p["weights"])
    assert all(0 <= i < len(frames) for s in p["samples"] for i in s)
    assert sum(p["weights"]) == pytest.approx(p["endValue"]) == pytest.approx(gpu_flame(trace).attributed_ns / 1e3)


def test_svg_escapes_names_and_parses():
    cols = {c: np.array(v, dtype=t) for (c, t), v in zip(COLUMNS.items(), (
        [EventKind.PYTHON, EventKind.RUNTIME, EventKind.KERNEL], [0, 1, 2], [0, 10, 20], [100, 5, 50],
        [1, 1, 0], [1, 1, 7], [-1, -1, 0], [-1, -1, 7], [-1, 5, 5], [-1] * 3, [-1] * 3, [-1] * 3), strict=True)}
    trace = Trace(cols, ["a<b>.py(1): f&g", "cudaLaunchKernel", 'void k<float, "x">(int)'], source="t.json")
    root = ET.fromstring(svg(trace))
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert any(t.startswith('void k<float, "x">(int)') for t in titles)
    assert any(t.startswith("f&g (a<b>.py:1)") for t in titles)


def test_svg_renders_in_chromium(tmp_path, chromium):
    exe = chromium
    sync_api = pytest.importorskip("playwright.sync_api")
    path = tmp_path / "healthy_training.svg"
    write_svg(_trace("healthy_training"), str(path))
    ET.parse(path)
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 700})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        # Inside a page, as users open it (an <img> or inline); a bare SVG document stalls screenshots.
        page.set_content(f'<!doctype html><body style="margin:0">{path.read_text()}</body>')
        rects = page.locator("svg rect").count()
        width = page.evaluate("document.querySelector('svg').getBBox().width")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "trace-flame-healthy_training.png"), full_page=True)
        browser.close()
    assert not errors and rects > 50 and width >= 1100


def test_the_flame_verb_writes_svg_or_speedscope_and_refuses_bad_paths(tmp_path, capsys):
    from gpuscope.cli import main

    fixture = str(Path(__file__).parent / "fixtures" / "traces" / "launch_bound.pt.trace.json.gz")
    assert main(["trace", "flame", fixture, "--out", str(tmp_path / "f.svg")]) == 0
    ET.parse(tmp_path / "f.svg")
    assert main(["trace", "flame", fixture, "--out", str(tmp_path / "f.json")]) == 0
    assert json.loads((tmp_path / "f.json").read_text())["$schema"] == SPEEDSCOPE_SCHEMA
    capsys.readouterr()
    for out in (str(tmp_path / "f.txt"), str(tmp_path / "missing" / "f.svg")):
        assert main(["trace", "flame", fixture, "--out", out]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("gpuscope: ") and len(err.splitlines()) == 1
    assert main(["trace", "flame", str(tmp_path / "none.json.gz"), "--out", str(tmp_path / "g.svg")]) == 2
    assert "no such file" in capsys.readouterr().err


def _sampled_trace(meta: dict) -> Trace:
    """Three sampled launches of k (two from f, one from g), one k and one m whose launches were not sampled."""
    P, R, K = EventKind.PYTHON, EventKind.RUNTIME, EventKind.KERNEL
    rows = [  # kind, name, ts, dur, pid, tid, device, stream, correlation
        (P, 0, 0, 100, 1, 1, -1, -1, -1), (R, 1, 10, 5, 1, 1, -1, -1, 5), (K, 2, 20, 10, 0, 7, 0, 7, 5),
        (P, 3, 200, 100, 1, 1, -1, -1, -1), (R, 1, 210, 5, 1, 1, -1, -1, 6), (K, 2, 220, 10, 0, 7, 0, 7, 6),
        (P, 0, 400, 100, 1, 1, -1, -1, -1), (R, 1, 410, 5, 1, 1, -1, -1, 7), (K, 2, 420, 10, 0, 7, 0, 7, 7),
        (K, 2, 600, 31, 0, 7, 0, 7, 99), (K, 4, 700, 40, 0, 7, 0, 7, 98)]
    cols = {c: np.array([r[i] for r in rows] if i < 9 else [-1] * len(rows), dtype=t)
            for i, (c, t) in enumerate(COLUMNS.items())}
    return Trace(cols, ["a.py(1): f", "cudaLaunchKernel", "k", "b.py(1): g", "m"], meta=meta, source="t.json")


def test_unsampled_kernels_are_charged_by_kernel_name_only_when_the_trace_sampled_launches():
    plain = gpu_flame(_sampled_trace({}))  # a torch trace, or --api all: nothing inferred
    assert (plain.unattributed_ops, plain.unattributed_ns, plain.inferred_ops) == (2, 71, 0)

    trace = _sampled_trace({"gpuscope_cupti": {"launchers": "sampled"}})
    flame = gpu_flame(trace)
    assert (flame.unattributed_ops, flame.unattributed_ns) == (1, 40)  # m: never sampled
    assert (flame.inferred_ops, flame.inferred_ns) == (1, 31)
    assert flame.attributed_ns == 61 == sum(flame.stacks.values())
    by_names = {tuple(f.name for f in s): ns for s, ns in flame.stacks.items()}
    # 31 ns over f's two launches of k and g's one: 20 (+1, the remainder, to the most frequent) and 10.
    assert by_names == {("thread 1", "f (a.py:1)", "k"): 20, ("thread 1", "g (b.py:1)", "k"): 10,
                        ("thread 1", "f (a.py:1)", SAMPLED_LAUNCHER, "k"): 21,
                        ("thread 1", "g (b.py:1)", SAMPLED_LAUNCHER, "k"): 10}
    assert [f.kind for f in next(s for s in flame.stacks if len(s) == 4)] == ["thread", "user", "sampled", "kernel"]
    assert "charged by sampled launchers" in speedscope(trace)["profiles"][0]["name"]
    assert "charged by sampled launchers" not in speedscope(_sampled_trace({}))["profiles"][0]["name"]
    root = ET.fromstring(svg(trace))
    texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert any("50.8% charged by sampled launchers" in t for t in texts)


def test_a_frame_with_its_exact_line_is_named_by_it():
    trace = _sampled_trace({})
    trace.args[0] = {"line": 42}
    names = {tuple(f.name for f in s) for s in gpu_flame(trace).stacks}
    assert ("thread 1", "f (a.py:42)", "k") in names and ("thread 1", "f (a.py:1)", "k") in names
