"""`python -m gpuscope` and `python -m gpuscope.cli`: a usage error in a verb that lives in its own package
(loadtest, capture, guard) is one sentence and exit 2, not a traceback. Run as `-m gpuscope.cli`, cli.py is
loaded twice (as __main__ and as gpuscope.cli), so the verbs' UsageError used to escape the one caught."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpuscope

# The subprocess imports the same gpuscope as this test does, wherever it is installed from.
SRC = str(Path(gpuscope.__file__).resolve().parents[1])

BAD_FLAGS = {
    "loadtest": (["loadtest", "http://127.0.0.1:9", "--rate", "-1"], "rate above 0"),
    "capture": (["capture", "--upstream", "nope"], "--upstream must be an http:// or https:// URL"),
    "guard": (["guard", "check", "/nonexistent/guard.yaml"], "does not exist"),
    "unknown flag": (["loadtest", "http://127.0.0.1:9", "--no-such-flag"], "Unrecognized arguments"),
}


@pytest.mark.parametrize("module", ["gpuscope", "gpuscope.cli"])
@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_a_bad_flag_is_one_sentence_and_exit_2(module, case):
    argv, expected = BAD_FLAGS[case]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuscope: ") and expected in lines[0], p.stderr
