"""The injection library (trace/inject/) without a GPU: its build against NVIDIA's CUPTI wheel, its status
when CUPTI cannot start, the converter from its records to a trace the analyses read, native frames, and
`gpuscope trace -- ./binary` on a machine without a driver. tests/gpu/test_inject_gpu.py traces a C++
program with it on a GPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuscope.trace import inject
from gpuscope.trace.inject import convert

CC = shutil.which("cc") or shutil.which("gcc")


def _cupti_or_skip() -> inject.Cupti:
    try:
        return inject.find_cupti()
    except inject.InjectUnavailable as e:
        pytest.skip(f"{e} (pip install gpuscope[inject])")


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> str:
    if CC is None:
        pytest.skip("no C compiler")
    return inject.build(_cupti_or_skip(), CC, into=tmp_path_factory.mktemp("inject-cache"))


def test_the_library_builds_against_the_wheels_headers_and_exports_the_hook(library):
    syms = subprocess.run(["nm", "-D", "--defined-only", library], capture_output=True, text=True).stdout
    assert [line.split()[-1] for line in syms.splitlines()] == ["InitializeInjection"]  # nothing else exported
    again = inject.build(inject.find_cupti(), CC, into=Path(library).parent.parent)
    assert again == library  # cached by the hash of source, CUPTI and compiler


def test_struct_names_are_the_newest_of_the_headers(tmp_path):
    cupti = _cupti_or_skip()
    names = inject.struct_names(cupti.include)
    assert names["GS_KERNEL_T"].startswith("CUpti_ActivityKernel") and names["GS_KERNEL_T"] != "CUpti_ActivityKernel"
    (tmp_path / "cupti_activity.h").write_text("} CUpti_ActivityKernel9;\n} CUpti_ActivityKernel13;\n"
                                               "} CUpti_ActivityMemcpy;\n} CUpti_ActivityMemset4;\n"
                                               "} CUpti_ActivitySynchronization2;\n} CUpti_ActivityDevice6;\n")
    assert inject.struct_names(str(tmp_path)) == {
        "GS_KERNEL_T": "CUpti_ActivityKernel13", "GS_MEMCPY_T": "CUpti_ActivityMemcpy",
        "GS_MEMSET_T": "CUpti_ActivityMemset4", "GS_SYNC_T": "CUpti_ActivitySynchronization2",
        "GS_DEVICE_T": "CUpti_ActivityDevice6"}
    (tmp_path / "cupti_activity.h").write_text("nothing here\n")
    with pytest.raises(inject.InjectUnavailable, match="defines no CUpti_ActivityKernel record"):
        inject.struct_names(str(tmp_path))


def test_no_compiler_and_no_cupti_are_one_sentence_each(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(inject.InjectUnavailable, match="no C compiler"):
        inject.compiler()
    monkeypatch.setattr(inject, "_candidates", lambda: [(str(tmp_path), "nowhere")])
    with pytest.raises(inject.InjectUnavailable, match="no CUPTI headers and library were found"):
        inject.find_cupti()
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cupti.h").write_text("")
    with pytest.raises(inject.InjectUnavailable, match="nowhere has CUPTI's headers but no libcupti.so"):
        inject.find_cupti()
    got = inject.availability()
    assert not got["works"] and "no C compiler" in got["reason"] and "libcupti" in got["reason"]


def test_a_process_where_cupti_cannot_start_says_so_and_goes_on(library, tmp_path):
    """InitializeInjection in a process without a driver: cuptiSubscribe fails, the status file says why,
    the process carries on; gpuscope turns the status into the bootstrap's status file."""
    prog = "import ctypes, sys; r = ctypes.CDLL(sys.argv[1]).InitializeInjection(); print('carried on', r)"
    env = dict(os.environ, GPUSCOPE_TRACE_DIR=str(tmp_path), GPUSCOPE_TRACE_RUN="run1")
    p = subprocess.run([sys.executable, "-c", prog, library], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "carried on 1\n" and p.stderr == ""
    [status] = tmp_path.glob("*.inject-status.json")
    doc = json.loads(status.read_text())
    assert doc["status"] in ("cupti_failed", "cupti_held") and doc["error"] and doc["run"] == "run1"
    assert convert.convert_run(str(tmp_path), "run1") == []
    [written] = tmp_path.glob("*.gpuscope.json")
    final = json.loads(written.read_text())
    assert final["status"] == doc["status"] and final["traces"] == [] and final["backend"] == "inject"

    from gpuscope.trace.run import collect, render

    report = collect(str(tmp_path), "run1")
    report.update(exit_code=0, duration_s=1.0, out_dir=str(tmp_path), backend="inject")
    said = render(report)
    assert f"no trace from pid {final['pid']}: " in said and doc["error"].rstrip(".") in said


def test_without_the_trace_dir_the_hook_does_nothing(library, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GPUSCOPE_TRACE_DIR"}
    prog = "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).InitializeInjection())"
    p = subprocess.run([sys.executable, "-c", prog, library], env=env, capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert p.stdout == "1\n" and list(tmp_path.iterdir()) == []


# -- the converter, fed records shaped like CUPTI's ---------------------------------------------------------

T0 = 1_760_000_000_000_000_000
EXE = "/opt/app/prog"
ADDR_STEP, ADDR_MAIN, ADDR_CUDA, ADDR_RT = 0x401234, 0x401500, 0x7F0000001000, 0x402000


def _window(steps: int = 100) -> list:
    """A C++ loop as CUPTI reports it: per step a kernel, a pageable cudaMemcpyAsync, a cudaDeviceSynchronize,
    then 2 ms of host work with the GPU idle."""
    lines: list = [{"gpuscope_inject": 1, "run": "r", "host": "h", "pid": 7, "rank": None, "exe": EXE, "window": 0,
                    "api": "rules", "with_stack": True, "launch_budget": 2000, "cuda_initialised_unix_ns": T0,
                    "start": {"unix_ns": T0, "cupti_ns": T0, "monotonic_ns": 1000}}]
    stack = [ADDR_CUDA, ADDR_RT, ADDR_STEP, ADDR_MAIN]
    t, corr = T0 + 1_000_000, 1
    for _ in range(steps):
        lines.append(["runtime", t, t + 5_000, 7, 8, corr, 211, stack])  # the launch (sampled)
        lines.append(["kernel", t + 10_000, t + 510_000, 0, 1, 7, corr, "gpuscope_work(float*, int)",
                      [8192, 1, 1], [256, 1, 1], 16, 0])
        lines.append(["runtime", t + 6_000, t + 9_000, 7, 8, corr + 1, 41, stack])
        lines.append(["memcpy", t + 510_000, t + 1_010_000, 0, 1, 7, corr + 1, 1, 1, 3, 8 << 20])
        lines.append(["runtime", t + 10_000, t + 1_020_000, 7, 8, corr + 2, 165, stack])
        lines.append(["sync", t + 10_000, t + 1_020_000, 1, 0xFFFFFFFF, corr + 2, 4])
        t, corr = t + 3_100_000, corr + 3
    lines += [["frame", ADDR_CUDA, "/usr/lib/x86_64-linux-gnu/libcuda.so.1", 0x7F0000000000, None, 0],
              ["frame", ADDR_RT, EXE, 0x400000, "cudaDeviceSynchronize", ADDR_RT - 8],
              ["frame", ADDR_STEP, "./prog", 0x400000, "step", ADDR_STEP - 0x20],  # dladdr's name for it
              ["frame", ADDR_MAIN, EXE, 0x400000, "main", ADDR_MAIN - 0x10],
              ["cbid", 2, 211, "cudaLaunchKernel_v7000"], ["cbid", 2, 41, "cudaMemcpyAsync_v3020"],
              ["cbid", 2, 165, "cudaDeviceSynchronize_v3020"],
              ["device", 0, {"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150 << 30, "computeMajor": 9,
                             "computeMinor": 0, "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048,
                             "maxBlocksPerMultiprocessor": 32, "regsPerBlock": 65536,
                             "regsPerMultiprocessor": 65536, "warpSize": 32, "sharedMemPerBlock": 49152,
                             "sharedMemPerMultiprocessor": 233472, "numSms": 132}],
              {"stop": {"unix_ns": t + 1000, "cupti_ns": t + 1000, "monotonic_ns": 2000}, "records_dropped": 0,
               "refused_callback_ids": 0, "launches_sampled": steps, "launch_slices": [steps]}]
    return lines


def _write(path: Path, lines: list) -> None:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("converted")
    _write(d / "h.7.inject.jsonl", _window())
    (d / "h.7.inject-status.json").write_text(json.dumps({"run": "r", "host": "h", "pid": 7, "rank": None,
                                                          "status": "written", "error": "", "windows": 1,
                                                          "cuda_initialised_unix_ns": T0, "api": "rules"}))
    problems = convert.convert_run(str(d), "r", argv=["./prog"])
    return d, problems


def test_the_converter_writes_a_trace_every_analysis_reads(converted):
    from gpuscope.trace.analyze import kernel_stats
    from gpuscope.trace.kineto import load

    d, problems = converted
    assert problems == [] and not list(d.glob("*.inject*"))  # the raw files are gone once converted
    trace = load(d / "h.7.pt.trace.json.gz")
    [k] = kernel_stats(trace)
    assert (k.name, k.count, k.total_ns) == ("gpuscope_work(float*, int)", 100, 100 * 500_000)
    assert trace.meta["gpuscope"]["backend"] == "inject" and trace.meta["gpuscope"]["pid"] == 7
    assert trace.meta["gpuscope_cupti"]["launchers"] == "sampled"
    assert trace.meta["gpuscope_cupti"]["launches_sampled"] == 100
    assert trace.meta["deviceProperties"][0]["numSms"] == 132
    status = json.loads((d / "h.7.gpuscope.json").read_text())
    assert status["status"] == "written" and status["traces"][0]["file"] == "h.7.pt.trace.json.gz"
    assert status["argv"] == ["./prog"]


def test_the_rules_find_the_pageable_copy_and_the_sync_at_the_native_frame(converted):
    from gpuscope.trace import rules
    from gpuscope.trace.kineto import load

    d, _ = converted
    found = {f.rule: f for f in rules.findings(load(d / "h.7.pt.trace.json.gz"))}
    assert found["pageable_memcpy"].evidence["count"] == 100
    assert found["pageable_memcpy"].evidence["kinds"] == {"Memcpy HtoD (Pageable -> Device)": 100}
    sync = found["sync_in_loop"]
    assert sync.evidence["count"] == 100
    loc = sync.locations[0][0]
    # No addr2line for a program that is not there: dladdr's symbol, the runtime's own frame left out.
    assert (loc.file, loc.function) == (EXE, "step")


def test_the_flame_graph_charges_kernels_to_native_stacks(converted):
    from gpuscope.trace.flame import gpu_flame
    from gpuscope.trace.kineto import load

    d, _ = converted
    flame = gpu_flame(load(d / "h.7.pt.trace.json.gz"))
    assert flame.unattributed_ratio == 0.0 and flame.attributed_ns == 100 * (500_000 + 500_000)
    names = {f.name for stack in flame.stacks for f in stack}
    assert any("step" in n for n in names) and "gpuscope_work(float*, int)" in names, names


def test_native_stacks_leave_out_cupti_driver_and_the_static_runtime():
    frames = {1: ("/usr/lib/libcupti.so.12", 0, None, 0), 2: ("/usr/lib/libcuda.so.1", 0, None, 0),
              3: (EXE, 0, "cudaMemcpy", 0), 4: (EXE, 0, "cudart::driverHelper::memcpy", 0), 5: (EXE, 0, "step", 0),
              6: (EXE, 0, "main", 0), 7: ("/lib/x86_64-linux-gnu/libc.so.6", 0, "__libc_start_main", 0)}
    symbols = convert.Symbols(addr2line="")
    symbols.resolve(frames, frames)
    assert symbols[5] == [(EXE, "step", 0)]
    assert convert.native_stack([1, 2, 3, 4, 5, 6, 7], frames, symbols, EXE) == [(EXE, 0, "step", 0), (EXE, 0, "main", 0)]
    # nvcc's launch stub and the kernel's host wrapper are not the launching line; _start is nobody's line.
    launch = {1: ("/usr/lib/libcuda.so.1", 0, None, 0), 8: (EXE, 0, "__device_stub__Z4workPf(float*)", 0),
              9: (EXE, 0, "work(float*)", 0), 10: (EXE, 0, "step", 0), 11: (EXE, 0, "_start", 0)}
    symbols.resolve(launch, launch)
    assert convert.native_stack([1, 8, 9, 10, 11], launch, symbols, EXE) == [(EXE, 0, "step", 0)]
    assert convert.native_stack([1, 8, 10, 11], launch, symbols, EXE) == [(EXE, 0, "step", 0)]  # no wrapper
    # Unwinding that stopped in the driver: the program's call, its line unknown, said as such.
    assert convert.native_stack([1, 2], frames, symbols, EXE) == [(EXE, 0, "(native stack not unwound)", 0)]


@pytest.mark.skipif(CC is None or shutil.which("addr2line") is None or shutil.which("objdump") is None,
                    reason="needs cc and binutils (addr2line, objdump)")
@pytest.mark.parametrize("opt", ["-O0", "-O2"])
def test_addr2line_gives_the_calling_line_and_the_inlined_function(tmp_path, opt):
    """On the H200 a static step() of the C++ test program was inlined at -O2: the sync's frame must still
    be step() at the sync's line, with the function it was inlined into as the next frame."""
    src = textwrap.dedent("""\
        __attribute__((noinline)) int work(int x) { __asm__ volatile(""); return x * 3; }
        static int step(int x) {
            int y = x + 1;
            return work(y) + 1;
        }
        int main(int argc, char **argv) { (void)argv; return step(argc) + step(argc + 2); }
        """)
    (tmp_path / "p.c").write_text(src)
    subprocess.run([CC, "-g", opt, "-o", "p", "p.c"], cwd=tmp_path, check=True)
    exe = str(tmp_path / "p")
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", exe], capture_output=True, text=True).stdout
    # The return address of a call of work(): the instruction after it, in step() or where step() was inlined.
    lines = dis.splitlines()
    i = next(n for n, line in enumerate(lines) if "call" in line and "<work>" in line)
    ret = int(lines[i + 1].split(":")[0].strip(), 16)
    base = 0x5555_0000_0000
    frames = {base + ret: (exe, base, None, 0)}
    symbols = convert.Symbols()
    symbols.resolve(frames, frames)
    chain = symbols[base + ret]
    assert (os.path.basename(chain[0][0]), chain[0][1], chain[0][2]) == ("p.c", "step", 4), chain
    if opt == "-O2":
        assert [f[1] for f in chain] == ["step", "main"], chain
    stack = convert.native_stack([base + ret], frames, symbols, exe)
    assert stack[0][2:] == ("step", 4)


def test_raw_files_that_are_not_ours_are_a_sentence(tmp_path):
    (tmp_path / "x.inject.jsonl").write_text('{"something": 1}\n')
    (tmp_path / "y.inject.jsonl").write_text('{"gpuscope_inject": 1, "run": "r"}\n["kernel", 1, 2\n')
    problems = convert.convert_run(str(tmp_path), "r")
    assert len(problems) == 2 and "is not a window of gpuscope's injection library" in problems[0]
    assert "line 2 is not JSON" in problems[1]


# -- which programs, and a program on a machine without a driver ----------------------------------------


def test_the_environment_of_each_way(tmp_path):
    from gpuscope.trace.bootstrap import DIR
    from gpuscope.trace.run import environment

    args = (str(tmp_path), 0.0, 5.0, 0.0, True, "run")
    auto = environment(*args, base={}, inject_library="/x/libgpuscope_inject.so")
    assert auto["CUDA_INJECTION64_PATH"] == "/x/libgpuscope_inject.so"
    assert auto["GPUSCOPE_TRACE_INJECT_SKIP_PYTHON"] == "1" and auto["PYTHONPATH"] == DIR
    forced = environment(*args, base={"PYTHONPATH": "/mine"}, backend="inject", inject_library="/x/lib.so")
    assert forced["PYTHONPATH"] == "/mine" and "GPUSCOPE_TRACE_INJECT_SKIP_PYTHON" not in forced
    plain = environment(*args, base={})
    assert "CUDA_INJECTION64_PATH" not in plain and plain["PYTHONPATH"] == DIR


def test_another_injection_library_wins_and_gpuscope_says_so(hello):
    env = dict(os.environ, CUDA_INJECTION64_PATH="/opt/nsight/libToolsInjection64.so")
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "--out", str(hello / "t2"), "--backend",
                        "inject", "--", "./hello"], cwd=hello, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and p.stdout == "hello from C\n"
    assert ("gpuscope trace: CUDA_INJECTION64_PATH is already set (/opt/nsight/libToolsInjection64.so: another "
            "profiler's injection), so hello runs untraced by gpuscope.") in p.stderr.splitlines(), p.stderr


def test_is_native(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    assert inject.is_native("/bin/true") and inject.is_native("true")
    assert not inject.is_native(sys.executable) and not inject.is_native("python3")
    assert not inject.is_native(str(script)) and not inject.is_native("sh") and not inject.is_native("env")
    assert not inject.is_native(str(tmp_path / "missing"))


@pytest.fixture(scope="module")
def hello(tmp_path_factory) -> Path:
    if CC is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("hello")
    (d / "hello.c").write_text('#include <stdio.h>\nint main(void) { puts("hello from C"); return 3; }\n')
    subprocess.run([CC, "-o", "hello", "hello.c"], cwd=d, check=True)
    return d


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has an NVIDIA driver")
def test_a_native_program_without_a_driver_runs_untraced_with_one_sentence(hello):
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "--out", str(hello / "t"), "--", "./hello"],
                       cwd=hello, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and p.stdout == "hello from C\n"
    said = [line for line in p.stderr.splitlines() if "untraced" in line]
    assert said == ["gpuscope trace: hello runs untraced: no NVIDIA driver here (libcuda.so.1 cannot be loaded: "
                    "No such file or directory)."], p.stderr
    assert "Traceback" not in p.stderr and not list((hello / "t").glob("*.pt.trace.json.gz"))


def test_on_demand_by_injection_is_refused_in_one_sentence(hello, tmp_path):
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "--on-demand", "--agent-dir", str(tmp_path),
                        "--backend", "inject", "--", "./hello"], cwd=hello, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and "--on-demand is not available for programs traced by injection" in p.stderr


def test_doctor_says_whether_injection_works(hello):
    p = subprocess.run([sys.executable, "-m", "gpuscope", "doctor", "--simulate", "healthy"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0
    [line] = [x for x in p.stdout.splitlines() if x.startswith("trace injection")]
    works = inject.availability()
    assert line.startswith("trace injection (native CUDA programs): " + ("yes" if works["works"] else "no — "))
    if not os.path.exists("/dev/nvidiactl"):
        assert "no NVIDIA driver here" in line
    j = subprocess.run([sys.executable, "-m", "gpuscope", "doctor", "--json", "--simulate", "healthy"],
                       capture_output=True, text=True, timeout=120)
    assert json.loads(j.stdout)["tracing"]["injection"]["works"] == works["works"]
