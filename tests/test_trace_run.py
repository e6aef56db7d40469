"""`gpuscope trace -- python prog.py` with a fake `torch` (no torch, no GPU here): the bootstrap's
behaviour inside a real child interpreter, the files it writes, and what the parent passes through."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuscope.trace.run import NO_TRACE, with_run_action

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
    "profiler.py": textwrap.dedent("""
        import json, os, time

        class ProfilerActivity:
            CPU = "CPU"
            CUDA = "CUDA"

        class _ExperimentalConfig:
            def __init__(self, profile_all_threads=False):
                self.profile_all_threads = profile_all_threads

        class profile:
            def __init__(self, activities=None, with_stack=False, record_shapes=False, experimental_config=None):
                assert record_shapes is False and experimental_config.profile_all_threads

            def start(self):
                if os.environ.get("FAKE_TORCH_START_FAILS"):
                    raise RuntimeError("CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED\\ndetails")
                self.t0 = time.time_ns()

            def stop(self):
                pass

            def export_chrome_trace(self, path):
                base = self.t0 // 10**9 * 10**9
                ts = (self.t0 - base) / 1000.0
                pid = os.getpid()
                events = [
                    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": pid, "tid": pid, "ts": ts, "dur": 5.0,
                     "args": {"External id": 1}},
                    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": pid,
                     "ts": ts + 1, "dur": 2.0, "args": {"correlation": 7, "External id": 1}},
                    {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": ts + 3, "dur": 10.0,
                     "args": {"correlation": 7, "External id": 1, "device": 0, "stream": 7}},
                    {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": ts, "args": {"name": "python"}},
                ]
                with open(path, "w") as f:
                    json.dump({"schemaVersion": 1, "baseTimeNanoseconds": base, "traceEvents": events}, f, indent=1)
    """),
}

PROG = textwrap.dedent("""
    import os, signal, sys, time
    print("out 1", flush=True)
    mode = sys.argv[1]
    if mode != "no-torch":
        import torch
        torch.cuda.init()
    if mode == "fork":
        pid = os.fork()
        if pid == 0:
            print("child", flush=True)
            sys.exit(0)
        os.waitpid(pid, 0)
    time.sleep(float(os.environ.get("PROG_SLEEP", "0.8")))
    if mode == "raise":
        raise ValueError("the program's own error")
    if mode == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    print("out 2", flush=True)
    sys.exit(int(os.environ.get("PROG_EXIT", "0")))
""")


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake")
    (root / "torch").mkdir()
    for name, text in FAKE_TORCH.items():
        (root / "torch" / name).write_text(text)
    (root / "prog.py").write_text(PROG)
    return root


def trace(fake: Path, out: Path, *args: str, env: dict[str, str] | None = None, opts: tuple[str, ...] = (),
          timeout: float = 60) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "PYTHONPATH")}
    e["PYTHONPATH"] = str(fake)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "--out", str(out), "--delay", "0.1",
                           "--duration", "0.3", *opts, "--", sys.executable, str(fake / "prog.py"), *args],
                          capture_output=True, text=True, env=e, timeout=timeout)


def traces(out: Path) -> list[Path]:
    return sorted(out.glob("*.pt.trace.json.gz"))


def test_trace_file_named_by_host_pid_rank_with_clock_pair_and_stdout_untouched(fake, tmp_path):
    p = trace(fake, tmp_path, "plain", env={"RANK": "3", "PROG_EXIT": "3"})
    assert p.returncode == 3, p.stderr
    assert p.stdout == "out 1\nout 2\n"
    [f] = traces(tmp_path)
    m = re.fullmatch(r"(.+)\.(\d+)\.rank3\.pt\.trace\.json\.gz", f.name)
    assert m, f.name
    host, pid = m.groups()
    doc = json.loads(gzip.decompress(f.read_bytes()))
    facts = doc["gpuscope"]
    assert facts["rank"] == 3 and facts["pid"] == int(pid) and facts["host"] == host
    assert facts["profiler_start_unix_ns"] > 1.6e18 and facts["profiler_start_monotonic_ns"] > 0
    assert facts["cpu_ops_all_threads"] is True
    assert [e["name"] for e in doc["traceEvents"]][:3] == ["aten::mm", "cudaLaunchKernel", "gemm"]
    assert f.name in p.stderr and "1 kernels" in p.stderr


def test_exit_zero_and_the_bare_and_run_forms_agree(fake, tmp_path):
    bare = trace(fake, tmp_path / "a", "plain")
    e = dict(os.environ, PYTHONPATH=str(fake))
    long = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "run", "--out", str(tmp_path / "b"),
                           "--delay", "0.1", "--duration", "0.3", "--", sys.executable, str(fake / "prog.py"),
                           "plain"], capture_output=True, text=True, env=e, timeout=60)
    assert bare.returncode == long.returncode == 0
    assert len(traces(tmp_path / "a")) == len(traces(tmp_path / "b")) == 1


def test_sigterm_flushes_the_trace_and_exits_128_plus_n(fake, tmp_path):
    p = trace(fake, tmp_path, "sigterm", opts=("--duration", "60"))
    assert p.returncode == 128 + signal.SIGTERM, p.stderr
    assert p.stdout == "out 1\n"
    assert len(traces(tmp_path)) == 1  # the 60 s window was cut short and written


def test_a_program_that_raises_keeps_its_traceback_and_exit_code(fake, tmp_path):
    p = trace(fake, tmp_path, "raise")
    assert p.returncode == 1
    assert "ValueError: the program's own error" in p.stderr and "Traceback" in p.stderr
    assert len(traces(tmp_path)) == 1


def test_a_program_without_torch_gets_the_no_trace_sentence(fake, tmp_path):
    p = trace(fake, tmp_path, "no-torch", env={"PROG_EXIT": "4"})
    assert p.returncode == 4
    assert NO_TRACE in p.stderr
    assert traces(tmp_path) == [] and list(tmp_path.glob("*.gpuscope.json")) == []


def test_not_python_at_all(tmp_path):
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "--out", str(tmp_path), "--", "sh", "-c",
                        "echo hi; exit 5"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 5 and p.stdout == "hi\n"
    assert NO_TRACE in p.stderr


def test_the_users_own_sitecustomize_still_runs(fake, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['PROG_EXIT'] = '7'\n")
    p = trace(fake, tmp_path / "out", "plain", env={"PYTHONPATH": f"{fake}{os.pathsep}{site}"})
    assert p.returncode == 7, p.stderr  # the user's sitecustomize set it
    assert len(traces(tmp_path / "out")) == 1


def test_a_profiler_that_cannot_start_steps_aside_with_one_line(fake, tmp_path):
    p = trace(fake, tmp_path, "plain", env={"FAKE_TORCH_START_FAILS": "1"})
    assert p.returncode == 0 and p.stdout == "out 1\nout 2\n"
    lines = [line for line in p.stderr.splitlines() if "could not start" in line]
    assert len(lines) == 2  # the child's own line, and the parent's summary of it
    assert "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED" in lines[0] and "goes on" in lines[0]
    assert traces(tmp_path) == []


def test_a_forked_child_that_never_uses_cuda_writes_nothing(fake, tmp_path):
    p = trace(fake, tmp_path, "fork")
    assert p.returncode == 0 and "child" in p.stdout
    assert len(traces(tmp_path)) == 1
    assert len(list(tmp_path.glob("*.gpuscope.json"))) == 1


def test_exit_before_the_window_is_said(fake, tmp_path):
    p = trace(fake, tmp_path, "plain", opts=("--delay", "30"), env={"PROG_SLEEP": "0.2"})
    assert p.returncode == 0
    assert "exited before its window began" in p.stderr and traces(tmp_path) == []


def test_windows_every(fake, tmp_path):
    p = trace(fake, tmp_path, "plain", opts=("--duration", "0.2", "--every", "0.5", "--budget", "100"),
              env={"PROG_SLEEP": "1.6"})
    assert p.returncode == 0, p.stderr
    names = [f.name for f in traces(tmp_path)]
    assert len(names) >= 2 and all(".w" in n for n in names)


def test_the_budget_spaces_repeated_windows_by_their_measured_cost(fake, tmp_path):
    # At the default 1 % a window that cost ~0.3 s pushes the next ~30 s away: one window in 1.6 s,
    # its cost recorded, and the status says why the others did not come.
    p = trace(fake, tmp_path, "plain", opts=("--duration", "0.2", "--every", "0.5"), env={"PROG_SLEEP": "1.6"})
    assert p.returncode == 0, p.stderr
    assert len(traces(tmp_path)) == 1
    [status] = [json.loads(f.read_text()) for f in tmp_path.glob("*.gpuscope.json")]
    [entry] = status["traces"]
    assert entry["cost_s"] >= 0.2 and entry["max_duty"] == 0.01
    # where the cost went: every phase measured, the window itself its asked length, the sum the whole cost
    phases = entry["cost_phases_s"]
    assert set(phases) == {"start", "window", "stop", "export", "compress"} and min(phases.values()) >= 0
    assert phases["window"] >= 0.2 and sum(phases.values()) <= entry["cost_s"] + 0.01
    assert entry["raw_bytes"] > 0
    assert "not the 0.5 s asked" in status["budget_note"] and "1 %" in status["budget_note"]
    assert p.stderr.count("not the 0.5 s asked") == 1  # the user hears it once, from the traced process
    p = trace(fake, tmp_path, "plain", opts=("--budget", "0"))
    assert p.returncode == 2 and "percentage" in p.stderr


def test_samples_write_a_perfetto_timeline_with_counters(fake, tmp_path):
    p = trace(fake, tmp_path, "plain", opts=("--samples", "--simulate", "healthy"), env={"PROG_SLEEP": "1.0"})
    assert p.returncode == 0, p.stderr
    [f] = tmp_path.glob("*.perfetto.json.gz")
    doc = json.loads(gzip.decompress(f.read_bytes()))
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert {"SM active %", "NVML utilization %", "Power W"} <= {e["name"] for e in counters}


def test_usage_errors(fake, tmp_path):
    p = trace(fake, tmp_path, "plain", opts=("--every", "0.1"))
    assert p.returncode == 2 and "--every" in p.stderr and p.stdout == ""
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "--"], capture_output=True, text=True)
    assert p.returncode == 2 and "Nothing to run" in p.stderr


@pytest.mark.parametrize("argv, expected", [
    (["trace", "--", "python", "x.py"], ["trace", "run", "--", "python", "x.py"]),
    (["-v", "trace", "--delay", "1", "--", "x"], ["-v", "trace", "run", "--delay", "1", "--", "x"]),
    (["trace", "merge", "a", "b"], ["trace", "merge", "a", "b"]),
    (["trace", "--help"], ["trace", "--help"]),
    (["run", "--", "trace"], ["run", "--", "trace"]),
])
def test_the_bare_form_is_the_run_action(argv, expected):
    assert with_run_action(argv, {"analyze": 1, "run": 1, "merge": 1}) == expected


def test_the_bootstrap_never_writes_through_a_planted_link(tmp_path, monkeypatch):
    """The trace directory may be shared (the agent's, on demand): a symlink planted at any name the
    traced program writes must not redirect the write (the old temporary names were predictable)."""
    import importlib.util
    import socket

    from gpuscope.trace.bootstrap import DIR

    monkeypatch.delenv("GPUSCOPE_TRACE_DIR", raising=False)  # loading it installs nothing
    for var in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    spec = importlib.util.spec_from_file_location("_boot_under_test", os.path.join(DIR, "sitecustomize.py"))
    boot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(boot)
    out = tmp_path / "traces"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    stem = f"{socket.gethostname()}.{os.getpid()}"
    for name in (".gpuscope.json.tmp", ".pt.trace.json.tmp", ".pt.trace.json.gz.tmp"):
        os.symlink(victim, out / (stem + name))

    class Prof:
        def stop(self):
            pass

        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                f.write('{"traceEvents": []}')

    tracer = boot._Tracer(str(out))
    tracer.status = {"traces": []}
    tracer._stop_and_write(Prof(), 0, {"unix_ns": 1, "monotonic_ns": 1}, True)
    assert victim.read_text() == "precious"
    assert json.loads((out / f"{stem}.gpuscope.json").read_text())["status"] == "written"
    written = json.loads(gzip.decompress((out / f"{stem}.pt.trace.json.gz").read_bytes()))
    assert written["traceEvents"] == [] and written["gpuscope"]["pid"] == os.getpid()
    assert sorted(p.name for p in out.iterdir() if not p.is_symlink()) == [f"{stem}.gpuscope.json",
                                                                          f"{stem}.pt.trace.json.gz"]
