"""Stack evidence for host-bound GPUs: py-spy sampling real processes, classification, verdicts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpuscope.diagnose import GpuWindow, ProcessView, diagnose
from gpuscope.diagnose.stacks import HostProfile, Profiler, ProfileUnavailable, parse_raw, profile, py_spy

needs_pyspy = pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed")

LOADER = """
import numpy as np, time
rng = np.random.default_rng(0)
def load_batch():
    imgs = rng.random((16, 3, 128, 128), dtype=np.float32)
    for _ in range(3):
        imgs = np.clip(imgs * 1.1 - 0.05, 0, 1)
        imgs = (imgs + np.roll(imgs, 1, axis=-1)) * 0.5
    return imgs
t = time.time()
while time.time() - t < 20:
    load_batch()
"""

SYNCER = """
import functools, time
class Scalar:  # stands in for a CUDA tensor: .item() spins in native code until the GPU is done
    item = staticmethod(functools.partial(sum, range(60000)))
def step():
    s = 0.0
    for _ in range(20):
        y = Scalar()
        s += y.item()
        s += sum(i * 0.5 for i in range(2000))
t = time.time()
while time.time() - t < 20:
    step()
"""


def _spawn(tmp_path: Path, name: str, code: str) -> subprocess.Popen:
    """The child says when its imports and set-up are done (a file, before its loop): sampling starts then, not
    after a guessed second (on a loaded machine numpy's import alone took most of the sampled window)."""
    script, ready = tmp_path / f"{name}.py", tmp_path / f"{name}.ready"
    assert "\nt = time.time()\n" in code
    script.write_text(textwrap.dedent(code).replace("\nt = time.time()\n",
                                                    f"\nopen({str(ready)!r}, 'w').close()\nt = time.time()\n"))
    p = subprocess.Popen([sys.executable, str(script)])
    deadline = time.monotonic() + 120
    while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), f"{name} never reached its loop (exit {p.poll()})"
    return p


def _profile_child(tmp_path: Path, name: str, code: str) -> HostProfile:
    """The stacks of a real child process running `code`, sampled by py-spy for 1.5 s."""
    p = _spawn(tmp_path, name, code)
    try:
        return profile(p.pid, seconds=1.5)
    except ProfileUnavailable as e:
        pytest.skip(f"no ptrace permission here: {e}")
    finally:
        p.kill()
        p.wait()


@needs_pyspy
def test_a_data_loading_loop_is_data(tmp_path):
    prof = _profile_child(tmp_path, "loader", LOADER)
    assert prof.samples >= 20
    assert prof.dominant() == "data", prof.shares
    assert "loader.py" in prof.where("data") and "load_batch" in prof.where("data")


@needs_pyspy
def test_a_loop_reading_values_back_is_sync(tmp_path):
    prof = _profile_child(tmp_path, "syncer", SYNCER)
    assert prof.shares["sync"] >= 0.2, prof.shares
    assert ".item()" not in prof.where("sync")  # it names the line, not its text
    assert "syncer.py:" in prof.where("sync")


@needs_pyspy
def test_what_cannot_be_sampled_says_why():
    sleeper = subprocess.Popen(["sleep", "30"])  # not a Python process
    try:
        prof, why = Profiler(seconds=1.0)(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert prof is None and why and str(sleeper.pid) in why and "\n" not in why
    prof, why = Profiler(seconds=1.0)(2**22 + 12345)  # no such process
    assert prof is None and why


def test_without_py_spy_the_reason_is_one_sentence(monkeypatch):
    import gpuscope.diagnose.stacks as stacks
    monkeypatch.setattr(stacks, "py_spy", lambda: None)
    with pytest.raises(ProfileUnavailable, match="py-spy is not installed"):
        stacks.profile(1)


def test_classification_reads_the_user_lines(tmp_path):
    src = tmp_path / "train.py"
    src.write_text("def step():\n    s = y.mean().item()\n    h = torch.tanh(h @ m)\n    s = sum(range(9))\n")
    torch_mod = "/usr/lib/python3/site-packages/torch/nn/modules/module.py"
    raw = "\n".join([
        f"<module> ({src}:9);step ({src}:2) 30",  # .item(): waits for the GPU
        f"<module> ({src}:9);step ({src}:3) 10",  # a torch op: issues GPU work
        f"<module> ({src}:9);step ({src}:3);forward ({torch_mod}:100) 10",
        f"<module> ({src}:9);step ({src}:4) 50",  # plain host work
        "garbage line",
    ])
    prof = parse_raw(raw, pid=7)
    assert prof.samples == 100
    assert prof.shares == {"sync": 0.3, "data": 0.0, "launch": 0.2, "other": 0.5}
    assert prof.top["sync"][0][0] == "train.py:2 step"


def _host_bound_window(pid: int) -> GpuWindow:
    n = 60
    w = GpuWindow("0", [i * 0.1 for i in range(n)], {
        "gpu_utilization_ratio": [0.08] * n, "gpu_sm_active_ratio": [0.07] * n, "gpu_memory_used_bytes": [3e9] * n,
        "gpu_tensor_active_ratio": [0.0] * n, "gpu_dram_active_ratio": [0.01] * n,
    }, memory_total_bytes=80e9)
    w.processes = [ProcessView(pid, "python", thread_cpu_max_ratio=0.99, cpu_cores=1.0)]
    return w


@pytest.mark.parametrize("shares, kind", [
    ({"data": 0.8, "sync": 0.05, "launch": 0.1, "other": 0.05}, "input_starved"),
    ({"data": 0.0, "sync": 0.3, "launch": 0.1, "other": 0.6}, "sync_bound"),
    ({"data": 0.0, "sync": 0.02, "launch": 0.9, "other": 0.08}, "launch_bound"),
    ({"data": 0.1, "sync": 0.05, "launch": 0.1, "other": 0.75}, "host_bound"),
])
def test_the_stacks_name_the_host_bound_kind(shares, kind):
    calls = []

    def profiler(pid):
        calls.append(pid)
        top = {k: [(f"train.py:{i + 10} step", v)] for i, (k, v) in enumerate(shares.items()) if v}
        return HostProfile(pid, 200, shares, top, 2.0), None

    v = [x for x in diagnose([_host_bound_window(4242)], profiler=profiler) if x.primary]
    assert calls == [4242]
    assert [x.kind for x in v] == [kind], v[0].summary
    assert "train.py:" in v[0].summary and v[0].evidence["stack_samples"] == 200


def test_without_stacks_it_says_what_it_cannot_tell():
    v = [x for x in diagnose([_host_bound_window(4242)], profiler=lambda pid: (None, "no permission (ptrace)"))
         if x.primary]
    assert [x.kind for x in v] == ["launch_or_sync_bound"]
    assert v[0].evidence["stack_sampling"] == "no permission (ptrace)" and "no permission" in v[0].summary


def test_busy_gpus_are_never_sampled():
    w = _host_bound_window(1)
    w.series["gpu_sm_active_ratio"] = [0.95] * 60
    w.series["gpu_tensor_active_ratio"] = [0.9] * 60
    calls = []
    diagnose([w], profiler=lambda pid: calls.append(pid) or (None, "x"))
    assert calls == []


def test_run_samples_only_its_own_processes():
    from gpuscope.report.processes import RunProcesses

    root = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(20)']); time.sleep(20)"])
    try:
        import psutil
        deadline = time.monotonic() + 30
        while not psutil.Process(root.pid).children() and time.monotonic() < deadline:  # a loaded machine is slow
            time.sleep(0.05)
        grandchild = psutil.Process(root.pid).children()[0].pid
        procs = RunProcesses(root.pid)
        assert procs.ours(root.pid) and procs.ours(grandchild)
        assert not procs.ours(subprocess.os.getpid())  # the caller itself is no descendant
    finally:
        for p in psutil.Process(root.pid).children(recursive=True):
            p.kill()
        root.kill()
        root.wait()
