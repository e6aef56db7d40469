"""Which frameworks a process uses (gpuscope._frameworks): from maps lines as each framework's processes map
their libraries, from real child processes here (torch's CPU build is in the venv), from fake /proc trees
(gone, unreadable, huge, odd bytes), and through the host reader, the process records and the simulated node."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_agent import AgentProc, get, http

from gpuscope import Sampler, SamplerConfig, _frameworks
from gpuscope._frameworks import detect, from_cmdline, from_modules, read
from gpuscope._hostproc import HostProcessReader
from gpuscope.sim import SimulatedNode, UnknownScenario

SITE = "/opt/conda/envs/train/lib/python3.11/site-packages"


def maps(*paths: str, anonymous: int = 2) -> str:
    """/proc/PID/maps text mapping each path (text and data segments), with the anonymous and special
    mappings every process has."""
    lines = []
    addr = 0x7F0000000000
    for i, p in enumerate(paths):
        for perms in ("r--p", "r-xp", "rw-p"):
            lines.append(f"{addr:x}-{addr + 0x1000:x} {perms} 00000000 103:02 {100000 + i}" + " " * 19 + p)
            addr += 0x1000
    for _ in range(anonymous):
        lines.append(f"{addr:x}-{addr + 0x21000:x} rw-p 00000000 00:00 0 ")
        addr += 0x21000
    lines += ["55d0c5a4e000-55d0c5b6f000 rw-p 00000000 00:00 0                          [heap]",
              "7ffd3c1e2000-7ffd3c203000 rw-p 00000000 00:00 0                          [stack]",
              "7ffd3c3f0000-7ffd3c3f2000 r-xp 00000000 00:00 0                          [vdso]"]
    return "\n".join(lines) + "\n"


PYTHON = ("/opt/conda/envs/train/bin/python3.11", "/usr/lib/x86_64-linux-gnu/libc.so.6",
          "/usr/lib/x86_64-linux-gnu/libm.so.6", f"{SITE}/numpy/_core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so",
          f"{SITE}/numpy.libs/libscipy_openblas64_-ff651d7f.so")
DRIVER = ("/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05", "/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.580.95.05")

# What each framework's GPU process maps, as seen on real installs (pip wheels, conda, system packages).
PROCESSES = {
    "torch": (f"{SITE}/torch/lib/libtorch_cuda.so", f"{SITE}/torch/lib/libc10_cuda.so", f"{SITE}/torch/lib/libc10.so",
              f"{SITE}/torch/lib/libtorch_cpu.so", f"{SITE}/torch/_C.cpython-311-x86_64-linux-gnu.so",
              f"{SITE}/nvidia/cublas/lib/libcublas.so.12", f"{SITE}/nvidia/cuda_runtime/lib/libcudart.so.12"),
    "jax": (f"{SITE}/jaxlib/xla_extension.so", f"{SITE}/jaxlib/cpu_feature_guard.so",
            f"{SITE}/jax_plugins/xla_cuda12/xla_cuda_plugin.so", f"{SITE}/nvidia/cudnn/lib/libcudnn.so.9"),
    "tensorflow": (f"{SITE}/tensorflow/libtensorflow_framework.so.2", f"{SITE}/tensorflow/libtensorflow_cc.so.2",
                   f"{SITE}/tensorflow/python/_pywrap_tensorflow_internal.so"),
    "cupy": (f"{SITE}/cupy/_core/core.cpython-311-x86_64-linux-gnu.so",
             f"{SITE}/cupy_backends/cuda/api/runtime.cpython-311-x86_64-linux-gnu.so",
             f"{SITE}/cupy/cuda/memory.cpython-311-x86_64-linux-gnu.so",
             "/usr/local/cuda-12.8/targets/x86_64-linux/lib/libnvrtc.so.12.8.93"),
    "numba": (f"{SITE}/numba/_helperlib.cpython-311-x86_64-linux-gnu.so",
              f"{SITE}/numba/core/runtime/_nrt_python.cpython-311-x86_64-linux-gnu.so",
              f"{SITE}/llvmlite/binding/libllvmlite.so", f"{SITE}/nvidia/cuda_nvcc/nvvm/lib64/libnvvm.so"),
    "triton": (f"{SITE}/triton/_C/libtriton.so",
               "/home/ana/.triton/cache/Yl5fK3Jc8Q2ZrR6n/cuda_utils.cpython-311-x86_64-linux-gnu.so"),
    "cuda-python": (f"{SITE}/cuda/bindings/cydriver.cpython-311-x86_64-linux-gnu.so",
                    f"{SITE}/cuda/bindings/_bindings/cydriver.cpython-311-x86_64-linux-gnu.so",
                    f"{SITE}/cuda/bindings/runtime.cpython-311-x86_64-linux-gnu.so"),
    # A CUDA C++ program: the runtime (when linked shared), cuBLAS, the driver.
    "cuda": ("/opt/app/bin/solver", "/usr/local/cuda-12.8/targets/x86_64-linux/lib/libcudart.so.12.8.90",
             "/usr/local/cuda/lib64/libcublas.so.12", "/usr/local/cuda/lib64/libcublasLt.so.12"),
}


@pytest.mark.parametrize("framework", sorted(PROCESSES))
def test_each_framework_is_told_by_the_libraries_it_maps(framework):
    text = maps(*PYTHON, *PROCESSES[framework], *DRIVER)
    assert detect(text) == (framework,)


def test_a_process_with_several_frameworks_names_each_in_order():
    text = maps(*PYTHON, *PROCESSES["cupy"], *PROCESSES["torch"], *PROCESSES["triton"], *PROCESSES["numba"],
                *DRIVER)
    assert detect(text) == ("torch", "cupy", "numba", "triton")
    # cuda is "CUDA and none of the frameworks": never beside one
    assert "cuda" not in detect(maps(*PROCESSES["jax"], *PROCESSES["cuda"]))


def test_no_framework_and_no_cuda_is_nothing():
    assert detect(maps(*PYTHON)) == ()
    assert detect("") == ()
    # names that only contain a framework's letters are not it
    assert detect(maps("/home/torchuser/app/libfoo.so", "/data/cupy_results/x.bin", "/srv/jax-logs/a.so",
                       "/usr/local/cuda/lib64/libcublas.so.12", "/opt/numba_notes.txt")) == ()


def test_odd_bytes_deleted_files_spaces_and_garbage_lines():
    odd = maps(f"{SITE}/cu\ufffdpy/x.so", f"/tmp/my env/{'é' * 3}/lib/python3.11/site-packages/torch/lib/libc10.so",
               f"{SITE}/cupy/_core/core.so (deleted)")
    garbage = "\x00\xff\n" + "not a maps line\n" + "7f-80 r-xp\n" + "7f00-7f01 r-xp 0 0 0\n" + "\udcff" * 10 + "\n"
    assert detect(garbage + odd + "7f00-7f01 r-xp 00000000 08:01 4") == ("torch", "cupy")
    assert detect(garbage) == ()


def test_command_line_speaks_only_where_maps_name_nothing():
    assert from_cmdline(["/usr/bin/torchrun", "--nproc-per-node", "8", "train.py"]) == ("torch",)
    assert from_cmdline(["python3", "-m", "torch.distributed.run", "train.py"]) == ("torch",)
    assert from_cmdline(["/venv/bin/python", "/venv/bin/accelerate", "launch", "x.py"]) == ("torch",)
    assert from_cmdline(["python", "-m", "jax.tools.run"]) == ("jax",)
    assert from_cmdline(["python", "train_torch.py", "torch"]) == ()  # a script's name says nothing
    assert from_cmdline(["./solver", "torchrun"]) == ()  # an argument of another program is not its launcher
    assert from_cmdline([]) == ()
    # maps that were read win over the command line
    assert detect(maps(*PROCESSES["cupy"]), cmdline=["torchrun", "x.py"]) == ("cupy",)
    assert detect("", cmdline=["torchrun", "x.py"]) == ("torch",)


def test_modules_of_a_process_reading_itself():
    assert from_modules(["os", "cupy", "cupy._core", "cuda", "cuda.bindings.driver", "numba.cuda"]) == \
        ("cupy", "numba", "cuda-python")
    assert from_modules(["cuda", "cudatoolkit", "jaxlib.xla_client", 3, None]) == ("jax",)


def fake_proc(root: Path, pid: int, maps_text: str | bytes | None, cmdline: bytes = b"") -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    if maps_text is not None:
        (d / "maps").write_bytes(maps_text if isinstance(maps_text, bytes) else maps_text.encode())
    else:
        (d / "maps").mkdir()  # reading it fails, as for another user's process without CAP_SYS_PTRACE
    (d / "cmdline").write_bytes(cmdline)


def test_read_from_a_proc_tree_gone_unreadable_and_odd(tmp_path):
    fake_proc(tmp_path, 10, maps(*PROCESSES["jax"]))
    fake_proc(tmp_path, 11, None, b"torchrun\0--standalone\0train.py\0")
    fake_proc(tmp_path, 12, None, b"\xff\xfe\0")
    fake_proc(tmp_path, 13, maps(*PROCESSES["numba"]).encode() + b"7f00-7f01 r-xp 0 08:01 9  /x/\xff\xfe.so\n")
    assert read(10, str(tmp_path)) == ("jax",)
    assert read(11, str(tmp_path)) == ("torch",)
    assert read(12, str(tmp_path)) == ()
    assert read(13, str(tmp_path)) == ("numba",)
    assert read(99, str(tmp_path)) == ()  # gone


def test_maps_are_read_up_to_the_bound(tmp_path, monkeypatch):
    big = maps(*PYTHON, anonymous=30_000) + maps(*PROCESSES["tensorflow"])
    assert len(big) > 1 << 20
    fake_proc(tmp_path, 20, big)
    assert read(20, str(tmp_path)) == ("tensorflow",)
    monkeypatch.setattr(_frameworks, "MAX_MAPS_BYTES", 64 << 10)
    assert read(20, str(tmp_path)) == ()  # the libraries past the bound are not seen: the read stopped there


def child(code: str) -> subprocess.Popen[str]:
    """A real interpreter that runs `code`, prints 'ready' and waits for its stdin to close; what `code` printed
    is in its `said`."""
    p = subprocess.Popen([sys.executable, "-c", code + "\nprint('ready', flush=True)\nimport sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    said = []
    for line in p.stdout:
        if line.strip() == "ready":
            break
        said.append(line.strip())
    p.said = said  # type: ignore[attr-defined]
    return p


def end(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.close()
    p.wait(timeout=30)


def test_real_processes_torch_and_numpy_and_the_host_reader_reads_maps_once(monkeypatch):
    """A child that imports torch (the CPU build here: libtorch_cpu, libc10) is torch; one that imports numpy is
    nothing; a reaped one is gone. The host reader reads a process's maps once, not at every read."""
    torch_child, numpy_child = child("import torch"), child("import numpy")
    try:
        assert read(torch_child.pid) == ("torch",)
        assert read(numpy_child.pid) == ()
        calls: list[int] = []

        def counting(pid: int, proc_root: str = "/proc") -> tuple[str, ...]:
            calls.append(pid)
            return _frameworks.read(pid, proc_root)

        monkeypatch.setattr("gpuscope._hostproc.read_frameworks", counting)
        reader = HostProcessReader()
        for _ in range(5):
            info = reader.read(torch_child.pid)
            assert info is not None and info.frameworks == ("torch",)
            time.sleep(0.06)
        assert calls == [torch_child.pid]
        reader.forget(set())  # it ended, as far as this reader knows: the next read is of a new process
        assert reader.read(torch_child.pid).frameworks == ("torch",)
        assert calls == [torch_child.pid] * 2
    finally:
        end(torch_child)
        end(numpy_child)
    assert read(numpy_child.pid) == () and read(torch_child.pid) == ()  # reaped: gone


def test_a_process_reading_itself_counts_its_imported_modules_too(tmp_path):
    """The CUPTI tracer asks from inside the program: a framework imported as pure Python, no library of its
    own loaded, is named from sys.modules; from outside only the maps speak."""
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("")
    p = child(f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import cupy\n"
              "from gpuscope._frameworks import of_this_process; print(','.join(of_this_process()), flush=True)")
    try:
        assert p.said == ["cupy"]  # type: ignore[attr-defined]
        assert read(p.pid) == ()
    finally:
        end(p)


def sampled(node: SimulatedNode, ticks: int = 3):
    s = Sampler(SamplerConfig(interval=0.1, collect_host=False), nvml=node.nvml, host_reader=node.host_reader,
                host_source=node.host_source)
    s.open()
    try:
        return [s.sample_once() for _ in range(ticks)]
    finally:
        s.stop()


def test_simulated_processes_are_torch_unless_told():
    snap = sampled(SimulatedNode("launch_bound", gpus=2))[-1]
    assert snap.processes and {p.frameworks for p in snap.processes} == {("torch",)}
    snap = sampled(SimulatedNode("launch_bound", frameworks=("jax",)))[-1]
    assert [p.frameworks for p in snap.processes] == [("jax",)]
    assert snap.to_dict()["processes"][0]["frameworks"] == ("jax",)
    with pytest.raises(UnknownScenario, match="not pytorch"):
        SimulatedNode("healthy", frameworks=("pytorch",))


def test_churned_processes_keep_their_node_s_frameworks():
    node = SimulatedNode("healthy", processes=2, churn_s=1.0, frameworks=("cupy",))
    first = {p.pid for g in node.nvml.gpus for p in g.processes}
    node.nvml.gpus[0].dynamics(node.nvml.gpus[0], 5.0)  # 5 s of the node's clock: each process replaced
    now = node.nvml.gpus[0].processes
    assert {p.pid for p in now} != first and node.replaced > 0
    assert all(node.host_reader.read(p.pid).frameworks == ("cupy",) for p in now)


def test_the_agent_gives_frameworks_in_latest_and_no_label_on_metrics(tmp_path):
    agent = AgentProc(tmp_path, "--simulate", "launch_bound")
    try:
        agent.wait_ready()
        procs: list[dict] = []
        for _ in range(100):
            code, latest = get(agent, "/api/v1/latest")
            procs = latest.get("processes") or [] if code == 200 else []
            if procs:
                break
            time.sleep(0.1)
        assert procs and all(p["frameworks"] == ["torch"] for p in procs), procs
        code, body = http(agent.port, "/metrics")
        assert code == 200
        text = body.decode()
        assert 'pid="4000000"' in text  # the process has its series, with their labels
        assert "framework" not in text and "torch" not in text
    finally:
        agent.stop()
