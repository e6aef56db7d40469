"""The eBPF probes on the CUDA driver API (gpuscope.sources.cudaprobe), on this machine's real kernel: real
uprobes on a stand-in libcuda.so.1 (tests/cudaprobe/fakecuda.c: the driver's entry points with their real
signatures, since there is no NVIDIA driver here) called a known number of times by a real process
(tests/cudaprobe/callcuda.c). The real driver's side is tests/gpu/test_cudaprobe_gpu.py.

Needs root (or CAP_BPF + CAP_PERFMON), a kernel with uprobes and libbpf.so.1; where these are missing the
probe tests are skipped with the probe's own sentence, and the tests of that sentence still run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuscope import fakenvml
from gpuscope.export.exposition import render
from gpuscope.fakenvml import FakeNVML, FakeProcess
from gpuscope.sampler import Sampler, SamplerConfig
from gpuscope.sources import cudaprobe
from gpuscope.sources.cudaprobe import CudaProbe, symbol_offsets

HERE = Path(__file__).parent / "cudaprobe"
SRC = Path(cudaprobe.__file__).parent / "bpf"

# callcuda's fixed copies: bytes by direction (h2d, d2h, d2d, other) and counts
COPY_BYTES = (1000 + 2000 + 64 * 10, 30000 + 40000, 500 + 700, 11 + 22)
COPIES = (3, 2, 2, 2)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcuda")
    d = tmp_path_factory.mktemp("fakecuda")
    lib, prog = d / "libcuda.so.1", d / "callcuda"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", lib, HERE / "fakecuda.c"], check=True)
    subprocess.run([cc, "-O2", "-o", prog, HERE / "callcuda.c", "-ldl"], check=True)
    return lib, prog


@pytest.fixture(scope="module")
def probe(built):
    p = CudaProbe(enabled=True, libraries=(str(built[0]),))
    cap = p.open()
    if not cap.supported:
        pytest.skip(f"BPF is not usable here: {cap.reason}")
    yield p
    p.close()


class Caller:
    """callcuda as a child: loaded and waiting, then released to make its calls."""

    def __init__(self, built, launches: int, syncs: int, hold_ms: int, sync_us: int = 0):
        lib, prog = built
        env = {**os.environ, "FAKECUDA_SYNC_US": str(sync_us)}
        self.proc = subprocess.Popen([str(prog), str(lib), str(launches), str(syncs), str(hold_ms), "wait"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.pid = json.loads(self.proc.stdout.readline())["ready"]

    def go(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())


def test_symbol_offsets_match_the_dynamic_symbol_table(built):
    out = subprocess.run(["objdump", "-T", str(built[0])], capture_output=True, text=True, check=True).stdout
    want = {line.split()[-1]: int(line.split()[0], 16) for line in out.splitlines()
            if " .text" in line and line.split()[-1].startswith("cu")}
    got = symbol_offsets(str(built[0]), set(want) | {"cuNotThere"})
    # a shared object's .text is mapped at its file offset, so the offsets are the addresses here
    assert got == want and "cuNotThere" not in got and "cuInit" in got


def test_symbol_offsets_of_a_file_that_is_not_elf(tmp_path):
    bad = tmp_path / "libcuda.so.1"
    bad.write_bytes(b"#!/bin/sh\n" * 10)
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        symbol_offsets(str(bad), {"cuLaunchKernel"})


def test_counts_are_exact_with_bytes_by_direction_and_sync_time_inside_the_calls(built, probe):
    c = Caller(built, launches=5000, syncs=30, hold_ms=3000, sync_us=3000)
    did = c.go()
    got = probe.read()[c.pid]
    c.proc.wait(timeout=30)
    assert got.launches == did["launches"] == 5001  # cuLaunchKernel, its _ptsz twin and cuLaunchKernelEx
    assert got.graph_launches == 2
    assert got.copies == COPIES and got.copy_bytes == COPY_BYTES
    assert got.syncs == did["syncs"] == 30
    # Each probed interval lies inside the call the program timed around it, and each call slept 3 ms at least.
    assert 30 * 0.003 <= got.sync_seconds <= did["sync_seconds"]


def test_a_process_that_exits_while_probed_is_dropped(built, probe):
    c = Caller(built, launches=10, syncs=3, hold_ms=0)
    c.go()
    c.proc.wait(timeout=30)
    assert c.pid not in probe.read()
    assert c.pid not in {k.value for k, _ in probe._obj.items(probe._fd, cudaprobe.ctypes.c_uint32,
                                                              cudaprobe._Counters)}


def test_a_process_killed_inside_a_sync_leaves_nothing_behind(built, probe):
    c = Caller(built, launches=1, syncs=1, hold_ms=0, sync_us=30_000_000)
    c.proc.stdin.write("go\n")
    c.proc.stdin.flush()
    stuck = lambda: any(k.value >> 32 == c.pid for k, _ in probe._obj.items(  # noqa: E731
        probe._sync_fd, cudaprobe.ctypes.c_uint64, cudaprobe.ctypes.c_uint64))
    deadline = time.monotonic() + 20
    while not stuck() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stuck(), "the sync's entry was never seen"
    assert probe.read()[c.pid].syncs == 0  # inside it: not returned yet
    c.proc.send_signal(signal.SIGKILL)
    c.proc.wait(timeout=30)
    assert c.pid not in probe.read() and not stuck()


def test_the_sampler_fills_the_process_records_of_gpu_processes(built, probe):
    """The agent's path: NVML lists the process (here the fake NVML, with the real pid), the sampler's processes
    tick probes its libcuda from /proc/PID/maps and fills its record's counters from one read."""
    c = Caller(built, launches=700, syncs=6, hold_ms=5000)
    nvml = fakenvml.FakeNVML(gpus=[fakenvml.FakeGPU(index=0, processes=[FakeProcess(pid=c.pid, sm_percent=5)])])
    cfg = SamplerConfig(interval=0.05, processes=0.05, process_utilization=0.05, cuda_probe=True, collect_host=False)
    s = Sampler(cfg, nvml=nvml)
    try:
        s.sample_once()
        assert s.cuda_probe_capability.supported, s.cuda_probe_capability.reason
        did = c.go()
        time.sleep(0.1)  # the processes period is 50 ms
        snap = s.sample_once()
        rec = next(p for p in snap.processes if p.pid == c.pid)
    finally:
        s.stop()
        c.proc.kill()
        c.proc.wait()
    assert rec.cuda_launches == did["launches"] == 701 and rec.cuda_syncs == 6
    assert (rec.cuda_h2d_bytes, rec.cuda_d2h_bytes, rec.cuda_d2d_bytes, rec.cuda_other_copy_bytes) == COPY_BYTES
    assert rec.cuda_copies == sum(COPIES) and rec.cuda_graph_launches == 2
    # ... and /metrics carries them as the process's counters
    text = render(snap).decode()
    series = {line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("process_cuda_") and f'pid="{c.pid}"' in line}
    assert series["process_cuda_launches_total"] == 701 and series["process_cuda_d2h_bytes_total"] == COPY_BYTES[1]
    assert "# TYPE process_cuda_sync_seconds_total counter" in text


def test_the_shipped_object_is_built_from_its_source(tmp_path):
    clang = shutil.which("clang") or shutil.which("clang-14")
    if clang is None:
        pytest.skip("no clang to rebuild the BPF object")
    out = tmp_path / "cudaprobe.bpf.o"
    subprocess.run(["sh", str(SRC / "build.sh"), str(out)], check=True, env={**os.environ, "CLANG": clang})
    shipped = (SRC / "cudaprobe.bpf.o").read_bytes()
    version = subprocess.run([clang, "--version"], capture_output=True, text=True).stdout
    stripper = shutil.which("llvm-strip") or shutil.which("llvm-strip-14")
    if "version 14." in version and stripper:  # the compiler and stripper it was built with: the same bytes
        assert out.read_bytes() == shipped
    else:
        def names(p):
            return sorted(line.split()[-1] for line in subprocess.run(
                ["objdump", "-t", str(p)], capture_output=True, text=True).stdout.splitlines() if " g " in line)
        assert names(out) == names(SRC / "cudaprobe.bpf.o")


# -- BPF unavailable: one sentence, and sampling goes on -------------------------------------------------------

def test_switched_off_it_says_so_and_the_sampler_runs_on(monkeypatch):
    monkeypatch.setenv("GPUSCOPE_CUDAPROBE", "off")
    nvml = FakeNVML(gpus=[fakenvml.FakeGPU(index=0, processes=[FakeProcess(pid=os.getpid())])])
    with Sampler(SamplerConfig(cuda_probe=True, collect_host=False), nvml=nvml) as s:
        snap = s.sample_once()
    assert s.cuda_probe_capability.reason.startswith("off (GPUSCOPE_CUDAPROBE=off")
    assert snap.processes[0].cuda_launches is None


def test_an_injected_nvml_leaves_the_probes_off_by_default():
    with Sampler(SamplerConfig(collect_host=False), nvml=FakeNVML()) as s:
        s.sample_once()
    assert not s.cuda_probe_capability.supported
    assert s.cuda_probe_capability.reason == "off on the simulated node and with an injected NVML"


_UNPRIVILEGED = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
from gpuscope.fakenvml import FakeNVML, FakeGPU, FakeProcess
from gpuscope.sampler import Sampler, SamplerConfig
nvml = FakeNVML(gpus=[FakeGPU(index=0, processes=[FakeProcess(pid=1)])])
with Sampler(SamplerConfig(cuda_probe=True, collect_host=False), nvml=nvml) as s:
    snaps = [s.sample_once() for _ in range(3)]
print(repr(s.cuda_probe_capability.reason))
print(len(snaps[-1].processes), snaps[-1].processes[0].cuda_launches)
"""


def test_a_normal_user_gets_one_sentence_and_the_sampler_runs_on():
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a child as nobody")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                        sys.executable, "-c", _UNPRIVILEGED], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HOME": "/tmp"}, cwd="/tmp")
    assert r.returncode == 0, r.stderr
    reason, processes = r.stdout.splitlines()
    assert "no permission" in reason and "root, or CAP_BPF with CAP_PERFMON" in reason
    assert processes == "1 None"
    lines = [line for line in r.stderr.splitlines() if line.startswith("gpuscope.cudaprobe")]
    assert len(lines) == 1 and "CUDA driver probes (eBPF) are off" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_no_libbpf_is_one_sentence():
    code = ("from gpuscope.sources.cudaprobe import CudaProbe\n"
            "print(CudaProbe(enabled=True, libraries=()).open().reason)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "GPUSCOPE_LIBBPF": "/nonexistent/libbpf.so.1"})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith("libbpf is not installed (") and "GPUSCOPE_LIBBPF" in r.stdout, r.stdout
