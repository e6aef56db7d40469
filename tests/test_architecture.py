"""The package's layers, checked on every run: no import cycle between modules or packages, no lower
layer importing a higher one, no feature taking another feature's private names, and the low modules
kept free of heavy imports.

The layers are written down here once (docs/ARCHITECTURE.md draws them). Every import counts, also
those inside functions: a lazy import still ties the two modules together.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gpuscope"

# Lowest first. A unit (a top-level module or package of gpuscope) may import units of its own layer or
# below; among the features, only the edges in FEATURE_EDGES.
LAYERS: list[tuple[str, set[str]]] = [
    ("floor", {"_version", "errors", "timeparse", "_paths", "_text", "_files", "_redact", "_serverlog", "_child",
               "_records", "catalog", "_nvml", "_cgroup", "_hostproc", "http", "_choices", "shares", "_node",
               "_recent", "_heap", "_frameworks"}),
    ("core", {"sources", "fakenvml", "testing", "sim", "sampler", "store", "diagnose", "export", "viewmodel"}),
    ("kit", {"_args", "report", "promql"}),
    ("features", {"alerts", "trace", "web", "agent", "top", "loadtest", "guard", "integrations", "doctor",
                  "runcmd", "fleet"}),
    ("surfaces", {"commands", "cli", "__main__", "__init__"}),
]
# Features that build on another feature's public face. Anything else between features is an error.
FEATURE_EDGES = {
    ("agent", "alerts"),  # the agent evaluates the alert rules
    ("agent", "web"),  # the agent serves the dashboard
    ("agent", "trace"),  # the agent's on-demand trace API
    ("runcmd", "trace"),  # `gpuscope run --trace`
    ("top", "agent"),  # top reads a running agent through its client
    ("loadtest", "web"),  # the load test's HTML report uses the dashboard's chart library files
    ("web", "fleet"),  # the dashboard's waste view (/ui/waste) is the fleet report, live, over its Prometheus
}
# Stdlib-only units: every layer may import them, so they must stay cheap (no numpy, aiohttp, psutil, ...).
STDLIB_ONLY = {"_version", "errors", "timeparse", "_paths", "_text", "_files", "_redact", "_child", "_choices",
               "_node", "_recent", "_heap", "_frameworks"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        if "bootstrap" in path.parts:  # loaded by path into traced programs, never imported as gpuscope.*
            continue
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(("gpuscope", *parts))
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every gpuscope import of the module."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "gpuscope":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub, "", node.lineno) if sub in MODULES else (target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "gpuscope"]
    return [(m, n, line) for m, n, line in out if m in MODULES and m != name]


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(unit: str) -> int:
    for i, (_, units) in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"gpuscope.{unit} is in no layer: add it to LAYERS in {__file__} and to "
                         "docs/ARCHITECTURE.md")


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_every_unit_has_a_layer():
    for module in MODULES:
        _layer(_unit(module))


def test_no_module_level_cycle():
    edges = {m: {t for t, _, _ in imps} for m, imps in GRAPH.items()}
    # A package's __init__ re-exporting its own modules is not a cycle of design; a module importing its
    # own package's __init__ is, so both directions are kept.
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_package_level_cycle_and_layers_point_down():
    bad = []
    unit_edges: dict[str, set[str]] = defaultdict(set)
    for module, imps in GRAPH.items():
        a = _unit(module)
        for target, _, line in imps:
            b = _unit(target)
            if a == b:
                continue
            unit_edges[a].add(b)
            la, lb = _layer(a), _layer(b)
            where = f"{MODULES[module].relative_to(SRC.parent)}:{line}"
            if lb > la:
                bad.append(f"{where}: {LAYERS[la][0]} gpuscope.{a} imports {LAYERS[lb][0]} gpuscope.{b}")
            elif la == lb == 3 and (a, b) not in FEATURE_EDGES:
                bad.append(f"{where}: feature gpuscope.{a} imports feature gpuscope.{b} (not in FEATURE_EDGES)")
    assert not bad, "\n".join(bad)
    cycle = _cycle(unit_edges)
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


def test_no_feature_takes_another_features_private_names():
    bad = []
    for module, imps in GRAPH.items():
        a = _unit(module)
        for target, name, line in imps:
            b = _unit(target)
            if a == b or _layer(b) != 3:
                continue
            private_module = any(p.startswith("_") and p != "__init__" for p in target.split(".")[2:])
            if private_module or name.startswith("_"):
                bad.append(f"{MODULES[module].relative_to(SRC.parent)}:{line}: {target} {name}".rstrip())
    assert not bad, "\n".join(bad)


def test_the_checker_sees_what_it_must():
    """The walker finds lazy imports, relative imports of modules and of names (or every test above passes
    for nothing)."""
    cli = {t for t, _, _ in GRAPH["gpuscope.cli"]}
    assert {"gpuscope._args", "gpuscope.errors", "gpuscope.commands.trace"} <= cli
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("unit", sorted(STDLIB_ONLY))
def test_low_modules_import_only_the_standard_library(unit):
    names = [m for m in MODULES if _unit(m) == unit]
    assert names, f"gpuscope.{unit} is listed as stdlib-only but does not exist: update STDLIB_ONLY"
    heavy = set()
    for m in names:
        for node in ast.walk(ast.parse(MODULES[m].read_text())):
            roots = []
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                roots = [node.module.split(".")[0]]
            heavy |= {r for r in roots if r != "gpuscope" and r not in sys.stdlib_module_names}
    # PyYAML may be loaded inside the function that parses YAML (only when a YAML file is read).
    heavy -= {"yaml", "tomli"} if unit == "_files" else {"tomli"}  # tomli: tomllib on Python 3.10
    assert not heavy, f"gpuscope.{unit} imports {sorted(heavy)}"


def test_import_gpuscope_stays_light():
    code = ("import sys, gpuscope, gpuscope.errors, gpuscope.timeparse, gpuscope._args, gpuscope.cli; "
            "print(','.join(sorted(m for m in ('numpy', 'aiohttp', 'psutil', 'yaml') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# Functions allowed past 100 lines: documented hot paths, where a call per step costs what the benchmark
# named beside each one measures (docs/ARCHITECTURE.md, "Hot paths").
HOT_PATHS = {
    ("guard/_core.py", "_inline_acquire"),  # the guard's local decision, 0.84 us (benchmarks/bench_guard.py)
    ("guard/asgi.py", "__call__"),  # the ASGI middleware per request and chunk (bench_guard_asgi_stream.py)
    ("trace/kineto.py", "_build"),  # one pass over every trace event (bench_trace_analyze.py)
}
MAX_FUNCTION_LINES = 100


def test_no_function_over_100_lines_outside_documented_hot_paths():
    long, hot = [], set()
    for path in MODULES.values():
        rel = str(path.relative_to(SRC))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and (rel, node.name) not in HOT_PATHS:
                    long.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
                elif n > MAX_FUNCTION_LINES:
                    hot.add((rel, node.name))
    assert not long, "\n".join(long)
    assert hot == HOT_PATHS, f"documented hot paths that are gone or short now: {sorted(HOT_PATHS - hot)}"


@pytest.mark.parametrize("rel", ["cli.py", "runcmd.py"])
def test_cli_and_runcmd_stay_small(rel):
    assert len((SRC / rel).read_text().splitlines()) < 500
