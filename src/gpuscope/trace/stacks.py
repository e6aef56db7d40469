"""Who launched it: the host call stack (Python frames, CPU ops, the CUDA call) behind any event of a Trace.

Kineto nests events on one thread in time (a python_function encloses the cpu_op it called, which
encloses the cudaLaunchKernel), and ties a GPU op to the runtime/driver call that launched it by the
CUPTI `correlation`. Kernels that a CUDA graph replays carry the correlation of their cudaGraphLaunch
(CUPTI stamps every node's record with the launching API call's id, and Kineto copies it), so they are
charged to the graph launch's stack — the line that replayed the graph, which is all that is known.

PyTorch names a Python frame `file.py(N): func` where N is the line the function starts on (its code
object's first line), not the line that made the call. A frame written by the CUPTI backend also has the
exact calling line in `args.line` (kept in `Trace.args`), and `Stacks.location` uses it. Otherwise it
recovers the calling line when the source is readable: the next frame in (e.g. `<built-in method item
of Tensor object>`) names what was called, and if exactly one call of that name sits in the function's
body, that is the line.

    >>> stacks = Stacks(trace)                           # doctest: +SKIP
    >>> stacks.location(stacks.launcher(kernel_row))     # doctest: +SKIP
    Location(file='launch_bound.py', line=14, function='step', def_line=10)
"""

from __future__ import annotations

import ast
import functools
import os
import re
import sys
from dataclasses import dataclass

import numpy as np

from .model import EventKind, Trace

_FRAME = re.compile(r"^(.*)\((\d+)\): (.*)$")
_BUILTIN = re.compile(r"^<built-in (?:method|function) (\w+)")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# Frames of these packages are never the line to change; the stdlib is recognised by sys.stdlib_module_names.
_LIBRARIES = frozenset((
    "torch", "torchvision", "torchaudio", "triton", "functorch", "numpy", "transformers", "accelerate",
    "lightning", "pytorch_lightning", "deepspeed", "apex", "timm", "diffusers", "vllm", "xformers", "flash_attn",
))
_HOST_STACK_KINDS = (EventKind.PYTHON, EventKind.CPU_OP, EventKind.RUNTIME, EventKind.DRIVER, EventKind.ANNOTATION)
_LAUNCH_KINDS = (EventKind.RUNTIME, EventKind.DRIVER)


@dataclass(frozen=True)
class Location:
    """A line of Python: `line` is the calling line when it could be recovered, else `def_line`."""

    file: str
    line: int
    function: str
    def_line: int

    def __str__(self) -> str:
        where = f"{self.file}:{self.line} in {self.function}()"
        return where if self.line != self.def_line else f"{where} (the function; the call's line is unknown)"


def parse_frame(name: str) -> tuple[str, int, str] | None:
    """`file.py(12): step` -> ("file.py", 12, "step"); None for built-ins and other names."""
    m = _FRAME.match(name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def frame_label(name: str) -> str:
    """A frame's name without object addresses, so that calls on different objects merge."""
    return _ADDRESS.sub("", name)


def is_user_file(path: str) -> bool:
    """Code of the program itself: not frozen or built-in, not an installed package, not the stdlib."""
    if path.startswith("<") or "site-packages" in path or "dist-packages" in path:
        return False
    if os.path.isabs(path):
        return not path.startswith(sys.base_prefix + os.sep)
    top = path.replace("\\", "/").split("/", 1)[0].removesuffix(".py")
    return top not in _LIBRARIES and top not in sys.stdlib_module_names


class Stacks:
    """The enclosing host event of every host event (per thread, by time), and launches by correlation."""

    def __init__(self, trace: Trace, source_roots: list[str] | None = None) -> None:
        self.trace = trace
        self.roots = list(source_roots) if source_roots is not None else _default_roots(trace)
        ev = trace.events
        kind = ev["kind"]
        self.parent = np.full(len(trace), -1, dtype=np.int64)
        host = np.flatnonzero(np.isin(kind, _HOST_STACK_KINDS) & (ev["device"] == -1))
        ts, end = ev["ts_ns"][host], ev["ts_ns"][host] + ev["dur_ns"][host]
        thread = ev["pid"][host] * (1 << 32) + ev["tid"][host]
        # Rows are sorted by start then longest first, so a stable sort by thread keeps parents before children.
        order = np.argsort(thread, kind="stable")
        parent = self.parent
        stack: list[int] = []
        ends: list[int] = []
        last_thread = None
        for row, t, e, th in zip(host[order].tolist(), ts[order].tolist(), end[order].tolist(),
                                 thread[order].tolist(), strict=True):
            if th != last_thread:
                stack.clear()
                ends.clear()
                last_thread = th
            while ends and ends[-1] <= t:
                stack.pop()
                ends.pop()
            if stack:
                parent[row] = stack[-1]
            stack.append(row)
            ends.append(e)
        launches = np.flatnonzero(np.isin(kind, _LAUNCH_KINDS) & (ev["correlation"] >= 0))
        self._launch_of = dict(zip(ev["correlation"][launches].tolist(), launches.tolist(), strict=True))

    def launcher(self, gpu_row: int) -> int:
        """Row of the runtime/driver call that launched a GPU op, -1 when the trace lacks it."""
        return self._launch_of.get(int(self.trace.events["correlation"][gpu_row]), -1)

    def chain(self, row: int) -> list[int]:
        """Rows of the host events enclosing `row` (itself included), outermost first."""
        rows = []
        while row >= 0:
            rows.append(row)
            row = int(self.parent[row])
        return rows[::-1]

    def innermost_host(self, pid: int, tid: int, t_ns: int) -> int:
        """The innermost host event running on a thread at a moment, -1 if none."""
        ev = self.trace.events
        on = np.flatnonzero((ev["pid"] == pid) & (ev["tid"] == tid) & (ev["device"] == -1)
                            & np.isin(ev["kind"], _HOST_STACK_KINDS) & (ev["ts_ns"] <= t_ns))
        if len(on) == 0:
            return -1
        row = int(on[-1])
        while row >= 0 and int(ev["ts_ns"][row] + ev["dur_ns"][row]) <= t_ns:
            row = int(self.parent[row])
        return row

    def location(self, row: int) -> Location | None:
        """The line of the program's own code responsible for `row`: the innermost user frame enclosing it,
        else the innermost Python frame; None when no Python frame encloses it."""
        if row < 0:
            return None
        frames = [r for r in self.chain(row) if self.trace.events["kind"][r] == EventKind.PYTHON]
        parsed = [(r, parse_frame(self.trace.name_of(r))) for r in frames]
        users = [i for i, (_, p) in enumerate(parsed) if p is not None and is_user_file(p[0])]
        anyfile = [i for i, (_, p) in enumerate(parsed) if p is not None]
        if not anyfile:
            return None
        i = users[-1] if users else anyfile[-1]
        file, def_line, func = parsed[i][1]  # type: ignore[misc]
        exact = self.trace.args.get(parsed[i][0], {}).get("line")
        if exact is not None:
            return Location(file, exact, func, def_line)
        callee = _callee_name(self.trace.name_of(parsed[i + 1][0])) if i + 1 < len(parsed) else None
        line = def_line
        if callee:
            lines = _call_lines(self._resolve(file), def_line, func, callee)
            if len(lines) == 1:
                line = lines[0]
        return Location(file, line, func, def_line)

    def _resolve(self, file: str) -> str | None:
        if os.path.isabs(file):
            return file if os.path.isfile(file) else None
        for root in self.roots:
            path = os.path.join(root, file)
            if os.path.isfile(path):
                return path
        return None


def _default_roots(trace: Trace) -> list[str]:
    """Frames are named relative to the traced program's sys.path; its working directory is the best guess."""
    roots = [os.getcwd()]
    if trace.source:
        roots.append(os.path.dirname(os.path.abspath(trace.source)))
    return roots


def _callee_name(frame_name: str) -> str | None:
    m = _BUILTIN.match(frame_name)
    if m:
        return m.group(1)
    parsed = parse_frame(frame_name)
    return parsed[2] if parsed and parsed[2].isidentifier() else None


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.GeneratorExp)


@functools.lru_cache(maxsize=64)
def _parse_source(path: str) -> ast.Module | None:
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


def _call_lines(path: str | None, def_line: int, func: str, callee: str) -> list[int]:
    """Lines in function `func` (starting at `def_line`) of `path` that call something named `callee`."""
    tree = _parse_source(path) if path else None
    if tree is None:
        return []
    scope: ast.AST | None = tree if func == "<module>" else None
    if scope is None:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == func:
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if def_line in (first, node.lineno):
                    scope = node
                    break
            elif isinstance(node, (ast.Lambda, ast.GeneratorExp)) and node.lineno == def_line and func.startswith("<"):
                scope = node
                break
    if scope is None:
        return []
    lines: set[int] = set()
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if isinstance(node, _SCOPES):
            continue  # its own frame in the trace
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name == callee:
                lines.add(node.lineno)
        todo.extend(ast.iter_child_nodes(node))
    return sorted(lines)
