"""A flame graph of GPU time charged to the Python stack that launched it.

Each GPU op (kernel, memcpy, memset) is tied to its launching runtime/driver call by `correlation`
(a kernel replayed from a CUDA graph carries its cudaGraphLaunch's correlation, so it lands on the
stack that replayed the graph; the golden fixtures launch no graphs), then to the Python frames and CPU
ops enclosing that call on its thread (`gpuscope.trace.stacks`). The op's duration is added to that
stack: thread > Python frames > CPU ops > the GPU op's name. Ops whose launch is not in the trace
(the profiler started after it) are left out and counted as unattributed. A Python frame that knows the
exact calling line (`args.line`, written by the CUPTI backend) is named by that line.

A CUPTI trace whose launches were sampled (its `gpuscope_cupti.launchers` is "sampled") has the exact
launcher of the sampled kernels only. A kernel not sampled is charged to the launch stacks sampled for
the same kernel name, in proportion to how many of that name's sampled launches each stack made, under
a `[sampled launcher]` frame just above the stack, so that inferred time reads apart from exact time; a
kernel name never sampled stays unattributed.

    >>> from gpuscope.trace.kineto import load
    >>> trace = load("tests/fixtures/traces/launch_bound.pt.trace.json.gz")
    >>> write_svg(trace, "launch_bound.svg"); write_speedscope(trace, "launch_bound.speedscope.json")
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from html import escape

import numpy as np

from .model import GPU_KINDS, EventKind, Trace
from .stacks import Stacks, frame_label, is_user_file, parse_frame

SPEEDSCOPE_SCHEMA = "https://www.speedscope.app/file-format-schema.json"
SAMPLED_LAUNCHER = "[sampled launcher]"


@dataclass(frozen=True)
class Frame:
    name: str
    file: str = ""
    line: int = 0
    kind: str = "thread"  # thread, user, python, op, sampled, kernel, memcpy, memset: how the SVG colours it


@dataclass
class GpuFlame:
    """GPU time per launching stack, in ns; what could not be attributed is counted beside it."""

    stacks: dict[tuple[Frame, ...], int] = field(default_factory=dict)
    launches: dict[tuple[Frame, ...], int] = field(default_factory=dict)  # GPU ops per stack
    attributed_ns: int = 0
    unattributed_ns: int = 0
    unattributed_ops: int = 0
    inferred_ns: int = 0  # of attributed_ns: kernels charged to the stacks sampled for their name
    inferred_ops: int = 0

    @property
    def unattributed_ratio(self) -> float:
        total = self.attributed_ns + self.unattributed_ns
        return self.unattributed_ns / total if total else 0.0


_LEAF_KIND = {EventKind.KERNEL: "kernel", EventKind.MEMCPY: "memcpy", EventKind.MEMSET: "memset"}


def sampled_launchers(trace: Trace) -> bool:
    """Whether the trace's kernel launches were sampled (the CUPTI backend's default), not all recorded."""
    meta = trace.meta.get("gpuscope_cupti")
    return isinstance(meta, dict) and meta.get("launchers") == "sampled"


def gpu_flame(trace: Trace) -> GpuFlame:
    """Sums each GPU op's duration into the host stack that launched it (or, for a kernel whose launch was
    not sampled, into the stacks sampled for its name: see the module's docstring)."""
    stacks = Stacks(trace)
    ev = trace.events
    flame = GpuFlame()
    infer = sampled_launchers(trace)
    host_stack: dict[int, tuple[Frame, ...]] = {}
    launched_by: dict[int, Counter[tuple[Frame, ...]]] = {}  # kernel name id -> sampled launch stacks
    unsampled: dict[int, list[int]] = {}  # kernel name id -> [ns, ops] without a launcher
    rows = np.flatnonzero(np.isin(ev["kind"], GPU_KINDS))
    for r, dur, kind, name in zip(rows.tolist(), ev["dur_ns"][rows].tolist(), ev["kind"][rows].tolist(),
                                  ev["name"][rows].tolist(), strict=True):
        launch = stacks.launcher(r)
        if launch < 0:
            if infer and kind == EventKind.KERNEL:
                pending = unsampled.setdefault(name, [0, 0])
                pending[0] += dur
                pending[1] += 1
            else:
                flame.unattributed_ns += dur
                flame.unattributed_ops += 1
            continue
        prefix = host_stack.get(launch)
        if prefix is None:
            prefix = host_stack[launch] = _host_frames(trace, stacks, launch)
        if infer and kind == EventKind.KERNEL:
            launched_by.setdefault(name, Counter())[prefix] += 1
        key = prefix + (Frame(trace.names[name], kind=_LEAF_KIND[EventKind(kind)]),)
        flame.stacks[key] = flame.stacks.get(key, 0) + dur
        flame.launches[key] = flame.launches.get(key, 0) + 1
        flame.attributed_ns += dur
    for name, (ns, ops) in unsampled.items():
        _charge_sampled(flame, trace.names[name], ns, ops, launched_by.get(name))
    return flame


def _charge_sampled(flame: GpuFlame, name: str, ns: int, ops: int,
                    launches: Counter[tuple[Frame, ...]] | None) -> None:
    """A kernel name's unsampled time, split over the stacks that launched it among the samples by their
    number of launches (whole ns and ops; the remainders to the most frequent stack)."""
    if not launches:
        flame.unattributed_ns += ns
        flame.unattributed_ops += ops
        return
    total = sum(launches.values())
    ranked = launches.most_common()
    shares = [ns * n // total for _, n in ranked]
    shares[0] += ns - sum(shares)
    counts = [ops * n // total for _, n in ranked]
    counts[0] += ops - sum(counts)
    leaf = (Frame(SAMPLED_LAUNCHER, kind="sampled"), Frame(name, kind="kernel"))
    for (prefix, _), share, count in zip(ranked, shares, counts, strict=True):
        if share or count:
            key = prefix + leaf
            flame.stacks[key] = flame.stacks.get(key, 0) + share
            flame.launches[key] = flame.launches.get(key, 0) + count
    flame.attributed_ns += ns
    flame.inferred_ns += ns
    flame.inferred_ops += ops


def _host_frames(trace: Trace, stacks: Stacks, launch: int) -> tuple[Frame, ...]:
    ev = trace.events
    frames = [Frame(f"thread {int(ev['tid'][launch])}")]
    for r in stacks.chain(launch)[:-1]:  # the launch call itself adds nothing a reader acts on
        kind, name = ev["kind"][r], trace.name_of(r)
        if kind == EventKind.PYTHON:
            parsed = parse_frame(name)
            if parsed:
                file, line, func = parsed
                line = trace.args.get(r, {}).get("line", line)  # the calling line, where the writer knew it
                frames.append(Frame(f"{func} ({file}:{line})", file, line, "user" if is_user_file(file) else "python"))
            else:
                frames.append(Frame(frame_label(name), kind="python"))
        elif kind in (EventKind.CPU_OP, EventKind.ANNOTATION):
            frames.append(Frame(name, kind="op"))
    return tuple(frames)


def speedscope(trace: Trace) -> dict:
    """The flame as a speedscope "sampled" profile: one sample per distinct stack, weighted by µs of GPU time."""
    flame = gpu_flame(trace)
    name = os.path.basename(trace.source) or "trace"
    return speedscope_doc(f"GPU time by launching stack: {name}", flame.stacks,
                          f"GPU time (µs), {flame.unattributed_ratio:.1%} unattributed" + _inferred_note(flame))


def speedscope_doc(title: str, stacks: dict[tuple[Frame, ...], int], profile_name: str) -> dict:
    """Speedscope's file format for ns per stack (weights in µs, heaviest first); `gpuscope.trace.profile`
    writes merged profiles through it too."""
    index: dict[Frame, int] = {}
    samples, weights = [], []
    for stack, ns in sorted(stacks.items(), key=lambda kv: -kv[1]):
        samples.append([index.setdefault(f, len(index)) for f in stack])
        weights.append(ns / 1e3)
    frames = [{"name": f.name, **({"file": f.file, "line": f.line} if f.file else {})} for f in index]
    return {
        "$schema": SPEEDSCOPE_SCHEMA, "exporter": "gpuscope", "name": title,
        "activeProfileIndex": 0, "shared": {"frames": frames},
        "profiles": [{"type": "sampled", "name": profile_name,
                      "unit": "microseconds", "startValue": 0, "endValue": sum(stacks.values()) / 1e3,
                      "samples": samples, "weights": weights}],
    }


def _inferred_note(flame: GpuFlame) -> str:
    if not flame.inferred_ops:
        return ""
    share = flame.inferred_ns / flame.attributed_ns if flame.attributed_ns else 0.0
    return f", {share:.1%} charged by sampled launchers (under '{SAMPLED_LAUNCHER}')"


def write_speedscope(trace: Trace, path: str) -> None:
    """Writes the speedscope JSON (open it at https://www.speedscope.app)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(speedscope(trace), f)


@dataclass
class _Node:
    frame: Frame
    ns: int = 0
    children: dict[Frame, _Node] = field(default_factory=dict)


_COLOURS = {"thread": "#c8c8c8", "user": "#f28e2b", "python": "#edc948", "op": "#76b7b2", "sampled": "#b07aa1",
            "kernel": "#59a14f", "memcpy": "#e15759", "memset": "#ff9da7"}
_WIDTH, _ROW, _CHAR = 1200.0, 17, 6.6
_MIN_PX = 0.5  # narrower frames are invisible; leaving them out keeps the file small


def svg(trace: Trace) -> str:
    """A self-contained SVG flame graph (root at the bottom), a <title> per frame for hover."""
    flame = gpu_flame(trace)
    root = _Node(Frame("all GPU time"))
    for stack, ns in flame.stacks.items():
        node = root
        node.ns += ns
        for f in stack:
            node = node.children.setdefault(f, _Node(f))
            node.ns += ns
    depth = _depth(root)
    top = 44
    height = top + (depth + 1) * _ROW + 10
    total = root.ns or 1
    title = f"GPU time by launching stack: {os.path.basename(trace.source)}"
    note = (f"{total / 1e6:.2f} ms attributed, {flame.unattributed_ratio:.1%} unattributed "
            f"({flame.unattributed_ops} ops whose launch is not in the trace){_inferred_note(flame)}")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH:.0f}" height="{height}" '
           f'viewBox="0 0 {_WIDTH:.0f} {height}" font-family="monospace" font-size="11">',
           '<rect width="100%" height="100%" fill="#ffffff"/>',
           f'<text x="6" y="16" font-size="14">{escape(title)}</text>',
           f'<text x="6" y="33">{escape(note)}</text>']
    todo = [(root, 0.0, 0)]
    while todo:
        node, x, level = todo.pop()
        w = node.ns / total * _WIDTH
        if w < _MIN_PX:
            continue
        y = height - 10 - (level + 1) * _ROW
        label = f"{node.frame.name} — {node.ns / 1e3:,.1f} µs ({node.ns / total:.1%})"
        fits = int((w - 6) / _CHAR)
        text = node.frame.name if len(node.frame.name) <= fits else node.frame.name[:max(fits - 1, 0)] + "…"
        out.append(f'<g><title>{escape(label)}</title><rect x="{x:.2f}" y="{y}" width="{max(w - 0.5, 0.1):.2f}" '
                   f'height="{_ROW - 1}" fill="{_COLOURS[node.frame.kind]}" rx="2"/>'
                   + (f'<text x="{x + 3:.2f}" y="{y + _ROW - 5}">{escape(text)}</text>' if fits >= 3 else "")
                   + "</g>")
        cx = x
        for child in sorted(node.children.values(), key=lambda c: -c.ns):
            todo.append((child, cx, level + 1))
            cx += child.ns / total * _WIDTH
    out.append("</svg>")
    return "\n".join(out)


def _depth(node: _Node) -> int:
    return 1 + max((_depth(c) for c in node.children.values()), default=-1) if node.children else 0


def write_svg(trace: Trace, path: str) -> None:
    """Writes the SVG flame graph."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(svg(trace))
