"""Every `>>>` example in the package's docstrings runs, and gives what it shows: an example that a
newcomer copies must work (doctest, module by module)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "gpuscope"


def _modules_with_examples() -> list[str]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if "bootstrap" in rel.parts:  # loaded by path into traced programs, never imported as gpuscope.*
            continue
        if ">>>" not in path.read_text():
            continue
        name = ".".join(("gpuscope", *rel.with_suffix("").parts)).removesuffix(".__init__")
        out.append(name)
    return out


MODULES = _modules_with_examples()


def test_examples_are_found():
    assert len(MODULES) >= 30  # the walk itself works (or every test below passes for nothing)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    # Examples name the checked-in fixtures as tests/fixtures/...; files they write land in a temporary folder.
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, name) if t.examples]
    assert tests, f"{name} has '>>>' in its source but no example doctest can find (a typo in the prompt?)"
    report: list[str] = []
    for t in tests:
        runner.run(t, out=report.append)
    assert runner.failures == 0, "".join(report)
