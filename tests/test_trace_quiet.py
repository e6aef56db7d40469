"""A quiet tracer: what the profiler's C++ writes to fd 2 while it starts, stops and exports goes to the
trace's log, never to the traced program's stderr, and the program's own stderr passes whole and in
order, also what its main thread writes during those moments (a fake `torch` whose profiler writes
Kineto's and c10's lines with os.write(2, ...), as C++ does; no GPU here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

KINETO_LINES = [
    "ERROR: External init callback must run in same thread as registerClient (1234 != 1200)",
    "WARNING:2026-12-02 10:00:00 4242:4243 CuptiActivityApi.cpp:89] CUPTI_ERROR_NOT_INITIALIZED",
    "[W1202 10:00:00.123456789 kineto_shim.cpp:339] Warning: Profiler clearing previous trace",
]

FAKE_TORCH = {
    "__init__.py": "from . import cuda, profiler  # noqa: F401\n__version__ = '0.0+fake'\n",
    "cuda.py": textwrap.dedent("""
        _initialized = False

        def init():
            global _initialized
            _initialized = True

        def is_initialized():
            return _initialized
    """),
    "profiler.py": textwrap.dedent(f"""
        import json, os, time

        LINES = {KINETO_LINES!r}

        class ProfilerActivity:
            CPU = "CPU"
            CUDA = "CUDA"

        class _ExperimentalConfig:
            def __init__(self, profile_all_threads=False):
                pass

        class profile:
            def __init__(self, **kwargs):
                pass

            def start(self):
                # As Kineto does from C++ on the profiler's thread, slowly, while the program goes on.
                for line in LINES[:2]:
                    os.write(2, (line + "\\n").encode())
                    time.sleep(0.2)
                self.t0 = time.time_ns()

            def stop(self):
                os.write(2, (LINES[2] + "\\n").encode())
                time.sleep(0.2)

            def export_chrome_trace(self, path):
                with open(path, "w") as f:
                    json.dump({{"schemaVersion": 1, "baseTimeNanoseconds": self.t0, "traceEvents": []}}, f)
    """),
}

# The program writes to stderr every few ms, through Python and straight to fd 2, with a partial line
# (a progress bar) among them, for longer than the window: start and stop fall in the middle of it.
PROG = textwrap.dedent("""
    import os, sys, time
    import torch
    torch.cuda.init()
    print("out", flush=True)
    t0, n = time.time(), 0
    while time.time() - t0 < 1.6:
        if n % 2:
            sys.stderr.write(f"prog line {n}\\n")
            sys.stderr.flush()
        else:
            os.write(2, f"prog line {n}\\n".encode())
        if n == 50:
            os.write(2, b"progress 50%\\r")
        n += 1
        time.sleep(0.005)
    sys.stderr.write(f"prog done {n}\\n")
""")


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake")
    (root / "torch").mkdir()
    for name, text in FAKE_TORCH.items():
        (root / "torch" / name).write_text(text)
    (root / "prog.py").write_text(PROG)
    return root


def _trace(fake: Path, out: Path, *opts: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "PYTHONPATH")}
    env["PYTHONPATH"] = str(fake)
    return subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "--out", str(out), "--delay", "0.2",
                           "--duration", "0.4", *opts, "--", sys.executable, str(fake / "prog.py")],
                          capture_output=True, text=True, env=env, timeout=60)


def test_the_profilers_lines_go_to_the_log_and_the_programs_stderr_passes_whole(fake, tmp_path):
    p = _trace(fake, tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "out\n"
    for line in KINETO_LINES:
        assert line not in p.stderr, p.stderr
    prog = [line for line in p.stderr.replace("\r", "\n").splitlines() if line.startswith("prog ")]
    n = int(prog[-1].split()[-1])
    assert prog == [f"prog line {i}" for i in range(n)] + [f"prog done {n}"]  # none lost, none twice, in order
    assert "progress 50%" in p.stderr  # a partial line is passed on too (text mode reads its CR as a newline)
    [status] = [json.loads(f.read_text()) for f in tmp_path.glob("*.gpuscope.json")]
    assert status["status"] == "written" and status["profiler_log_lines"] == 3
    log = tmp_path / status["profiler_log"]
    assert log.read_text().splitlines() == KINETO_LINES
    assert f"3 lines from the profiler itself, kept in {log} (--verbose shows them)." in p.stderr


def test_verbose_shows_the_log_after_the_run(fake, tmp_path):
    p = _trace(fake, tmp_path, "--verbose")
    assert p.returncode == 0, p.stderr
    report = p.stderr[p.stderr.index("gpuscope trace: exit code"):]
    assert report.count("External init callback") == 1 and "kineto_shim.cpp:339" in report
    assert not any(line in p.stderr[:p.stderr.index("gpuscope trace: exit code")] for line in KINETO_LINES)


def test_the_profiler_line_patterns():
    import importlib.util

    import gpuscope.trace.bootstrap as bootstrap

    spec = importlib.util.spec_from_file_location("_gpuscope_quiet_test", Path(bootstrap.DIR) / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    env = os.environ.pop("GPUSCOPE_TRACE_DIR", None)  # load it without installing a tracer here
    try:
        spec.loader.exec_module(module)
    finally:
        if env is not None:
            os.environ["GPUSCOPE_TRACE_DIR"] = env
    ours = [*KINETO_LINES, "STAGE:2026-12-02 10:00:00 1:1 ActivityProfilerController.cpp:314] Completed Stage: Warm Up",
            "[W kineto_shim.cpp:337] Adding profiling metadata requires using torch.profiler",
            "/opt/venv/lib/python3.12/site-packages/torch/profiler/profiler.py:509: UserWarning: Profiler won't be "
            "using warmup"]
    theirs = ["ERROR: my program failed", "Traceback (most recent call last):", "WARNING: disk almost full",
              "[W1202 10:00:00.1 my_extension.cpp:12] Warning: my own", "epoch 3 loss 0.25",
              "/home/me/train.py:12: UserWarning: my own warning"]
    for line in ours:
        assert module._PROFILER_LINE.match(line.encode()), line
    for line in theirs:
        assert not module._PROFILER_LINE.match(line.encode()), line
