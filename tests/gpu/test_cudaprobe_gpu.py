"""The eBPF probes on the CUDA driver API (gpuscope.sources.cudaprobe) on the real driver (`pytest -m gpu`).

A C++ CUDA program written here (nvcc) runs STEPS steps, each a pageable cudaMemcpy host to device of
COPY_BYTES, KERNELS launches of one kernel and a cudaStreamSynchronize, then a launch-bound phase of
LAUNCH_BOUND tiny kernels timed by the program itself; a PyTorch program runs TORCH_OPS in-place adds (one
kernel each) and times them. Under the probes: launch counts within 1 % of the known count, the copies'
bytes host to device, one sync per step with its time inside the run; the cost per launch is the program's
own launch time with the probes against the same phase with them detached (goal: 2 us or less). The
sampler's process record carries the same counters (the agent's series).

Needs root (bpf()), libbpf.so.1 (the system's, or GPUSCOPE_LIBBPF naming one unpacked from a distribution
package) and nvcc for the C++ part. The figures go to $GPUSCOPE_CUDAPROBE_RESULTS (JSON) when it is set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpuscope.sources.cudaprobe import CudaProbe

pytestmark = pytest.mark.gpu

STEPS, KERNELS, LAUNCH_BOUND, TORCH_OPS = 200, 10, 20000, 20000
COPY_BYTES = (1 << 21) * 4
PROG = textwrap.dedent("""
    #include <cuda_runtime.h>
    #include <cstdio>
    #include <cstdlib>
    #include <cstring>
    #include <ctime>

    __global__ void probe_work(float *a, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) a[i] = a[i] * 0.5f + 1.0f;
    }
    __global__ void probe_tiny(float *a) { a[threadIdx.x] += 1.0f; }

    static double now_s() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
    static void wait_line() { char b[16]; if (!fgets(b, sizeof b, stdin)) exit(3); }

    int main(int argc, char **argv) {
        int steps = atoi(argv[1]), kernels = atoi(argv[2]), launches = atoi(argv[3]);
        size_t n = 1 << 21;
        float *dev = nullptr;
        if (cudaMalloc(&dev, n * sizeof(float)) != cudaSuccess) return 4;
        float *host = (float *)malloc(n * sizeof(float));
        memset(host, 0, n * sizeof(float));
        cudaDeviceSynchronize();
        printf("ready\\n"); fflush(stdout);
        wait_line();
        double t0 = now_s();
        for (int s = 0; s < steps; s++) {
            cudaMemcpy(dev, host, n * sizeof(float), cudaMemcpyHostToDevice);  // pageable
            for (int k = 0; k < kernels; k++) probe_work<<<(int)(n / 256), 256>>>(dev, (int)n);
            cudaStreamSynchronize(0);
        }
        double t1 = now_s();
        for (int i = 0; i < launches; i++) probe_tiny<<<1, 32>>>(dev);
        double t2 = now_s();
        cudaStreamSynchronize(0);
        printf("{\\"steps_s\\": %.6f, \\"launch_us\\": %.4f}\\n", t1 - t0, launches ? (t2 - t1) / launches * 1e6 : 0.0);
        fflush(stdout);
        wait_line();
        return 0;
    }
""")
TORCH = textwrap.dedent("""
    import json, sys, time
    import torch
    x = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.readline()
    n = int(sys.argv[1])
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(json.dumps({"launch_us": (t1 - t0) / n * 1e6, "value": float(x[0])}), flush=True)
    sys.stdin.readline()
""")
RESULTS: dict = {}


@pytest.fixture(scope="module")
def probe():
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA driver here")
    p = CudaProbe(enabled=True)
    cap = p.open()
    assert cap.supported, f"the probes do not load here: {cap.reason}"
    RESULTS["libraries_probed_at_open"] = p.libraries_probed
    yield p
    p.close()
    out = os.environ.get("GPUSCOPE_CUDAPROBE_RESULTS")
    print(json.dumps(RESULTS, indent=2))
    if out:
        Path(out).write_text(json.dumps(RESULTS, indent=2))


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    nvcc = shutil.which("nvcc") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)
    if nvcc is None or shutil.which("nvidia-smi") is None:
        pytest.skip("no nvcc or no NVIDIA driver here")
    d = tmp_path_factory.mktemp("cudaprobe")
    (d / "prog.cu").write_text(PROG)
    r = subprocess.run([nvcc, "-O2", "-o", "prog", "prog.cu"], cwd=d, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return d / "prog"


def _run(argv: list[str], probe: CudaProbe | None) -> tuple[dict, object]:
    """Start a program, probe its libcuda once it is loaded, release it, and read its counters before it exits."""
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        if probe is not None:
            probe.watch(p.pid)
            before = probe.read().get(p.pid)
        p.stdin.write("go\n")
        p.stdin.flush()
        did = json.loads(p.stdout.readline())
        got = probe.read().get(p.pid) if probe is not None else None
        p.stdin.write("exit\n")
        p.stdin.flush()
        assert p.wait(timeout=120) == 0
    finally:
        p.kill()
        p.wait()
    if probe is not None:
        assert got is not None, "the probes saw no call of this process (is its libcuda another file?)"
        did["before"] = before
    return did, got


def test_cpp_program_counts(prog, probe):
    did, got = _run([str(prog), str(STEPS), str(KERNELS), "0"], probe)
    b = did["before"]
    launches = got.launches - (b.launches if b else 0)
    syncs = got.syncs - (b.syncs if b else 0)
    h2d = got.copy_bytes[0] - (b.copy_bytes[0] if b else 0)
    RESULTS["cpp"] = {"launches": launches, "expected_launches": STEPS * KERNELS, "syncs": syncs,
                      "sync_seconds": got.sync_seconds, "h2d_bytes": h2d, "copies": list(got.copies),
                      "copy_bytes": list(got.copy_bytes), "steps_s": did["steps_s"]}
    assert abs(launches - STEPS * KERNELS) <= 0.01 * STEPS * KERNELS, RESULTS["cpp"]
    # cudaMemcpyHostToDevice may reach the driver as cuMemcpyHtoD (h2d) or as cuMemcpy (other, the direction
    # left to unified addressing): either, but never the other way round
    other = got.copy_bytes[3] - (b.copy_bytes[3] if b else 0)
    assert abs(h2d + other - STEPS * COPY_BYTES) <= 0.01 * STEPS * COPY_BYTES, RESULTS["cpp"]
    assert got.copy_bytes[1] == got.copy_bytes[2] == 0, RESULTS["cpp"]
    assert STEPS <= syncs <= 3 * STEPS, RESULTS["cpp"]
    assert 0 < got.sync_seconds <= did["steps_s"] + 0.01, RESULTS["cpp"]


def _overhead(argv: list[str], probe: CudaProbe, name: str, expected: int) -> None:
    probe.close()  # detached from every libcuda: the same run without probes
    plain, _ = _run(argv, None)
    assert probe.open().supported
    probed, got = _run(argv, probe)
    b = probed["before"]
    launches = got.launches - (b.launches if b else 0)
    RESULTS[name] = {"launch_us_plain": plain["launch_us"], "launch_us_probed": probed["launch_us"],
                     "overhead_us_per_launch": probed["launch_us"] - plain["launch_us"], "launches": launches,
                     "expected_launches": expected}
    assert abs(launches - expected) <= 0.01 * expected, RESULTS[name]
    assert probed["launch_us"] - plain["launch_us"] <= 2.0, RESULTS[name]


def test_cpp_launch_overhead(prog, probe):
    _overhead([str(prog), "0", "0", str(LAUNCH_BOUND)], probe, "cpp_launch_bound", LAUNCH_BOUND)


def test_pytorch_launch_counts_and_overhead(probe, tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "torch_adds.py"
    script.write_text(TORCH)
    _overhead([sys.executable, str(script), str(TORCH_OPS)], probe, "torch_adds", TORCH_OPS)


def test_the_sampler_records_carry_the_counters(prog):
    """The agent's path: the sampler's own probes fill the process record of a GPU process NVML lists."""
    from gpuscope import Sampler, SamplerConfig

    s = Sampler(SamplerConfig(interval=0.1, processes=0.2))
    try:
        s.open()
        assert s.cuda_probe_capability.supported, s.cuda_probe_capability.reason
        p = subprocess.Popen([str(prog), str(STEPS), str(KERNELS), "0"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(r.pid == p.pid for r in s.sample_once().processes):
                time.sleep(0.2)  # until NVML lists it and its libcuda is probed
            p.stdin.write("go\n")
            p.stdin.flush()
            p.stdout.readline()
            time.sleep(0.3)
            rec = next(r for r in s.sample_once().processes if r.pid == p.pid)
            p.stdin.write("exit\n")
            p.stdin.flush()
            p.wait(timeout=120)
        finally:
            p.kill()
            p.wait()
    finally:
        s.stop()
    RESULTS["sampler_record"] = {"cuda_launches": rec.cuda_launches, "cuda_syncs": rec.cuda_syncs,
                                 "cuda_h2d_bytes": rec.cuda_h2d_bytes, "cuda_sync_seconds": rec.cuda_sync_seconds}
    assert rec.cuda_launches is not None and rec.cuda_launches >= 0.99 * STEPS * KERNELS, RESULTS["sampler_record"]
