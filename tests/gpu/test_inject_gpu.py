"""`gpuscope trace -- ./prog` of a C++ CUDA program by injection, on a real GPU (`pytest -m gpu`).

The program is written here and compiled with nvcc: STEPS steps, each a pageable cudaMemcpyAsync, KERNELS
launches of one fixed-work kernel and a cudaDeviceSynchronize followed by 2 ms of host work. Traced by
gpuscope's injection library, its kernel count must be exact, its total kernel time within 1 % of the
same kernels traced through CUPTI from Python (gpuscope's cupti-python backend, the same code built as
a shared library and called through ctypes), and the rules must find the pageable copy and the sync at
its line. A launch-bound phase measures the cost per launch, traced against untraced.

cupti-python is not on the GPU machine's image: `pip install --no-index --no-deps --target /tmp/site` the
wheels of cupti-python, cuda-bindings, cuda-pathfinder and pyelftools, and set CUDA_HOME to the toolkit
so that cupti-python finds its libcupti. The figures go to $GPUSCOPE_INJECT_RESULTS (JSON) when it is set.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

STEPS, KERNELS, LAUNCH_BOUND = 200, 10, 20000
PROG = textwrap.dedent("""
    #include <cuda_runtime.h>
    #include <cstdio>
    #include <cstdlib>
    #include <cstring>
    #include <ctime>
    #include <unistd.h>

    __global__ void gpuscope_work(float *a, int n, int rounds) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i >= n) return;
        float x = a[i];
        for (int r = 0; r < rounds; r++) x = x * 0.999f + 0.5f;
        a[i] = x;
    }

    __global__ void gpuscope_tiny(float *a) { a[threadIdx.x] += 1.0f; }

    static double now_s() {
        timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec + ts.tv_nsec / 1e9;
    }

    static void step(float *dev, const float *host, size_t n, int kernels) {
        cudaMemcpyAsync(dev, host, n * sizeof(float), cudaMemcpyHostToDevice, 0);
        for (int k = 0; k < kernels; k++) gpuscope_work<<<(int)(n / 256), 256>>>(dev, (int)n, 2000);
        cudaDeviceSynchronize();
        usleep(2000);
    }

    extern "C" int gpuscope_run(int steps, int kernels, int launches) {
        size_t n = 1 << 21;
        float *dev = nullptr;
        if (cudaMalloc(&dev, n * sizeof(float)) != cudaSuccess) return 3;
        float *host = (float *)malloc(n * sizeof(float));
        memset(host, 0, n * sizeof(float));
        cudaDeviceSynchronize();
        usleep(1000000);
        for (int s = 0; s < steps; s++) step(dev, host, n, kernels);
        if (launches > 0) {
            double t0 = now_s();
            for (int i = 0; i < launches; i++) gpuscope_tiny<<<1, 32>>>(dev);
            double t1 = now_s();
            cudaDeviceSynchronize();
            printf("launch_us %.4f\\n", (t1 - t0) / launches * 1e6);
        }
        printf("done\\n");
        fflush(stdout);
        free(host);
        cudaFree(dev);
        return 0;
    }

    #ifndef GPUSCOPE_AS_LIBRARY
    int main(int argc, char **argv) {
        return gpuscope_run(atoi(argv[1]), atoi(argv[2]), argc > 3 ? atoi(argv[3]) : 0);
    }
    #endif
""")
SYNC_LINE = PROG.splitlines().index("    cudaDeviceSynchronize();") + 1
DRIVE = textwrap.dedent("""
    import ctypes, sys
    import cuda.bindings  # gpuscope trace's trigger for its CUPTI backend
    lib = ctypes.CDLL(sys.argv[1])
    sys.exit(lib.gpuscope_run(int(sys.argv[2]), int(sys.argv[3]), 0))
""")
TRACE = [sys.executable, "-m", "gpuscope.cli", "trace", "--delay", "0", "--duration", "120"]
RESULTS: dict = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    nvcc = shutil.which("nvcc") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)
    if nvcc is None or shutil.which("nvidia-smi") is None:
        pytest.skip("no nvcc or no NVIDIA driver here")
    d = tmp_path_factory.mktemp("inject")
    (d / "prog.cu").write_text(PROG)
    for argv in ([nvcc, "-g", "-O2", "-o", "prog", "prog.cu"],
                 [nvcc, "-g", "-O2", "-shared", "-Xcompiler", "-fPIC", "-DGPUSCOPE_AS_LIBRARY", "-o",
                  "libprog.so", "prog.cu"]):
        p = subprocess.run(argv, cwd=d, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
    (d / "drive.py").write_text(DRIVE)
    yield d
    out = os.environ.get("GPUSCOPE_INJECT_RESULTS")
    if out:
        Path(out).write_text(json.dumps(RESULTS, indent=2))


def _trace(d: Path, name: str, cmd: list[str], *opts: str) -> tuple[subprocess.CompletedProcess[str], dict, Path]:
    out = d / name
    p = subprocess.run([*TRACE, "--out", str(out), *opts, "--", *cmd], capture_output=True, text=True,
                       timeout=300, cwd=d)
    print(p.stderr[-4000:])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "done" in p.stdout
    [path] = sorted(out.glob("*.pt.trace.json.gz"))
    return p, json.loads(gzip.decompress(path.read_bytes())), path


def _kernels(doc: dict, name: str) -> list[dict]:
    """The kernels of that name (CUPTI's names are the mangled ones, _Z13gpuscope_workPfii, in both backends)."""
    return [e for e in doc["traceEvents"] if e.get("cat") == "kernel" and name in e["name"]]


def test_injection_traces_a_cpp_program_exactly(built):
    p, doc, path = _trace(built, "inject", ["./prog", str(STEPS), str(KERNELS)])
    assert doc["gpuscope"]["backend"] == "inject" and doc["deviceProperties"], doc["gpuscope"]
    work = _kernels(doc, "gpuscope_work")
    copies = [e for e in doc["traceEvents"] if e.get("cat") == "gpu_memcpy"]
    syncs = [e for e in doc["traceEvents"] if e.get("cat") == "cuda_sync"]
    a = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "analyze", "--json", str(path)],
                       capture_output=True, text=True, timeout=300, cwd=built)
    found = {f["rule"]: f for f in json.loads(a.stdout)["traces"][0]["findings"]} if a.returncode == 0 else {}
    RESULTS.update(inject_kernels=len(work), inject_kernel_us=sum(e["dur"] for e in work),
                   gpuscope_cupti=doc["gpuscope_cupti"], copies=sorted({e["name"] for e in copies}),
                   pageable_copies=sum(e["name"] == "Memcpy HtoD (Pageable -> Device)" for e in copies),
                   cuda_sync_events=len(syncs), analyze_stderr=a.stderr[-2000:],
                   findings={k: {"summary": f["summary"], "locations": f["locations"][:1]} for k, f in found.items()})
    out = os.environ.get("GPUSCOPE_INJECT_TRACES")
    if out:
        shutil.copy(path, Path(out) / "inject.pt.trace.json.gz")
    assert len(work) == STEPS * KERNELS
    assert RESULTS["pageable_copies"] == STEPS, RESULTS["copies"]
    assert a.returncode == 0, a.stderr
    assert found["pageable_memcpy"]["evidence"]["count"] == STEPS, found.get("pageable_memcpy")
    sync = found["sync_in_loop"]
    assert sync["evidence"]["count"] >= STEPS
    where = sync["locations"][0]
    # The line is the sync's own. The function is the inlined step() where the compiler's DWARF puts the call
    # inside step's inlined range, else its caller: on the H200 (nvcc 13.0, -O2) the copy came back as step()
    # and the sync, step's last call but one, as gpuscope_run() at step's line.
    assert (Path(where["file"]).name, where["line"]) == ("prog.cu", SYNC_LINE), where
    assert where["function"].split("(")[0] in ("step", "gpuscope_run"), where


def test_kernel_time_matches_cupti_through_python(built):
    if importlib.util.find_spec("cupti") is None or importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("cupti-python or cuda-bindings is not installed (see this file's docstring)")
    _, py_doc, _ = _trace(built, "python", [sys.executable, "drive.py", str(built / "libprog.so"), str(STEPS),
                                            str(KERNELS)], "--backend", "cupti")
    _, in_doc, _ = _trace(built, "inject2", ["./prog", str(STEPS), str(KERNELS)])
    py_work, in_work = _kernels(py_doc, "gpuscope_work"), _kernels(in_doc, "gpuscope_work")
    py_us, in_us = sum(e["dur"] for e in py_work), sum(e["dur"] for e in in_work)
    RESULTS.update(python_kernels=len(py_work), python_kernel_us=py_us, inject2_kernels=len(in_work),
                   inject2_kernel_us=in_us, ratio=in_us / py_us if py_us else None)
    assert len(py_work) == len(in_work) == STEPS * KERNELS
    assert abs(in_us / py_us - 1) <= 0.01, (in_us, py_us)


def test_launch_overhead(built):
    plain = subprocess.run(["./prog", "0", "0", str(LAUNCH_BOUND)], cwd=built, capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0, plain.stderr
    traced, doc, _ = _trace(built, "launch", ["./prog", "0", "0", str(LAUNCH_BOUND)])
    us = [float(line.split()[1]) for line in (plain.stdout + traced.stdout).splitlines() if line.startswith("launch_us")]
    RESULTS.update(launch_us_plain=us[0], launch_us_traced=us[1], overhead_us_per_launch=us[1] - us[0],
                   launch_bound_kernels=len(_kernels(doc, "gpuscope_tiny")),
                   launches_sampled=doc["gpuscope_cupti"].get("launches_sampled"))
    assert len(_kernels(doc, "gpuscope_tiny")) == LAUNCH_BOUND
