"""`gpuscope trace -- python prog.py` through the CUPTI backend, with a fake `cupti` (cupti-python's module
names, enum values and record attributes) and a fake `cupy` that drives it as CUDA would: real child
interpreters, the files they write, and the real loader, rules and flame graph over those files."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_trace_run import FAKE_TORCH

from gpuscope.trace import cupti_backend
from gpuscope.trace.bootstrap import sitecustomize
from gpuscope.trace.kineto import load
from gpuscope.trace.model import EventKind
from gpuscope.trace.rules import findings

# Values as in cupti-python 13.4.0 (cupti/cupti.pyi); records carry the attribute names the real ones have.
FAKE_CUPTI = textwrap.dedent("""
    import enum, os, threading, time

    class cuptiError(Exception):
        def __init__(self, status):
            super().__init__(f"{Result(status).name} ({status})")
            self.status = status

    class Result(enum.IntEnum):
        SUCCESS = 0
        ERROR_NOT_INITIALIZED = 15
        ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39

    class ActivityKind(enum.IntEnum):
        MEMCPY = 1
        MEMSET = 2
        KERNEL = 3
        DRIVER = 4
        RUNTIME = 5
        DEVICE = 8
        CONCURRENT_KERNEL = 10
        SYNCHRONIZATION = 38

    class CallbackDomain(enum.IntEnum):
        INVALID = 0
        DRIVER_API = 1
        RUNTIME_API = 2
        RESOURCE = 3

    class ApiCallbackSite(enum.IntEnum):
        API_ENTER = 0
        API_EXIT = 1

    class CallbackIdResource(enum.IntEnum):
        CONTEXT_CREATED = 1

    class ActivityThreadIdType(enum.IntEnum):
        DEFAULT = 0
        SYSTEM = 1

    class RuntimeApiTraceCbid(enum.IntEnum):
        cudaMalloc_v3020 = 20
        cudaMemcpy_v3020 = 31
        cudaMemcpyAsync_v3020 = 41
        cudaStreamSynchronize_v3020 = 131
        cudaDeviceSynchronize_v3020 = 165
        cudaLaunchKernel_v7000 = 211

    class DriverApiTraceCbid(enum.IntEnum):
        cuCtxSynchronize = 17
        cuMemAlloc_v2 = 243
        cuMemcpyHtoD_v2 = 276
        cuMemcpyHtoDAsync_v2 = 277
        cuLaunchKernel = 307

    class _Record:
        def __init__(self, **fields):
            self.__dict__.update(fields)

    OFFSET_NS = 7_000_000_000  # CUPTI's clock need not be the Unix clock; the backend measures the offset
    _sub = None
    _callbacks, _kinds, _api_records, _buffer = set(), set(), set(), []
    _handlers = None
    _corr = [0]
    _gpu_free_ns = [0]
    _lock = threading.Lock()
    calls = []  # what the backend asked, for the tests

    def get_timestamp():
        return time.time_ns() + OFFSET_NS

    def subscribe(callback, userdata):
        global _sub
        calls.append("subscribe")
        if os.environ.get("FAKE_CUPTI_HELD") or _sub is not None:
            raise cuptiError(Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)
        _sub = (callback, userdata)
        return 1

    def unsubscribe(subscriber):
        global _sub
        _sub = None

    def enable_callback(enable, subscriber, domain, cbid):
        (_callbacks.add if enable else _callbacks.discard)((int(domain), int(cbid)))

    def enable_domain(enable, subscriber, domain):
        enum_ = RuntimeApiTraceCbid if domain == CallbackDomain.RUNTIME_API else DriverApiTraceCbid
        for m in enum_:
            enable_callback(enable, subscriber, domain, m)

    def set_thread_id_type(kind):
        calls.append(f"thread_id_type {int(kind)}")

    def activity_register_callbacks(requested, completed):
        global _handlers
        size, records = requested()
        assert size >= 1 << 20 and records == 0
        _handlers = (requested, completed)

    def activity_enable(kind):
        _kinds.add(int(kind))
        if kind == ActivityKind.DEVICE:
            _buffer.append(_Record(kind=8, id=0, name="Fake H200", global_memory_size=141 << 30,
                compute_capability_major=9, compute_capability_minor=0, max_threads_per_block=1024,
                max_warps_per_multiprocessor=64, num_threads_per_warp=32, max_blocks_per_multiprocessor=32,
                max_registers_per_block=65536, max_registers_per_multiprocessor=65536,
                max_shared_memory_per_block=49152, max_shared_memory_per_multiprocessor=233472,
                num_multiprocessors=132))

    def activity_disable(kind):
        _kinds.discard(int(kind))

    def activity_enable_runtime_api(cbid, enable):
        (_api_records.add if enable else _api_records.discard)((2, int(cbid)))

    def activity_enable_driver_api(cbid, enable):
        (_api_records.add if enable else _api_records.discard)((1, int(cbid)))

    def activity_flush_all(flag):
        with _lock:
            done = list(_buffer)
            _buffer.clear()
        if _handlers and done:
            _handlers[1](done)

    # -- what the fake CUDA calls ------------------------------------------------------------------
    def _callback(domain, cbid, site, corr):
        if _sub is not None and (int(domain), int(cbid)) in _callbacks:
            _sub[0](_sub[1], domain, cbid, _Record(callback_site=site, correlation_id=corr))

    def _context_created():
        if _sub is not None and (3, 1) in _callbacks:
            _sub[0](_sub[1], CallbackDomain.RESOURCE, CallbackIdResource.CONTEXT_CREATED, _Record())

    def _api(domain, cbid, until_ns=0, spin_ns=3000):
        _corr[0] += 1
        corr = _corr[0]
        _callback(domain, cbid, ApiCallbackSite.API_ENTER, corr)
        t0 = get_timestamp()
        while get_timestamp() < max(until_ns, t0 + spin_ns):
            pass
        t1 = get_timestamp()
        kind = ActivityKind.RUNTIME if domain == CallbackDomain.RUNTIME_API else ActivityKind.DRIVER
        if int(kind) in _kinds or (int(domain), int(cbid)) in _api_records:
            _buffer.append(_Record(kind=int(kind), cbid=int(cbid), start=t0, end=t1, process_id=os.getpid(),
                                   thread_id=threading.get_native_id(), correlation_id=corr, return_value=0))
        _callback(domain, cbid, ApiCallbackSite.API_EXIT, corr)
        return corr, t0, t1

    def _gpu(kind, corr, dur_ns, **fields):
        start = max(get_timestamp(), _gpu_free_ns[0])
        _gpu_free_ns[0] = start + dur_ns
        if int(kind) in _kinds:
            _buffer.append(_Record(kind=int(kind), start=start, end=start + dur_ns, device_id=0, context_id=1,
                                   stream_id=7, correlation_id=corr, **fields))

    def _sync_record(corr, t0, t1):
        if int(ActivityKind.SYNCHRONIZATION) in _kinds:
            _buffer.append(_Record(kind=38, type=4, start=t0, end=t1, context_id=1, stream_id=0xFFFFFFFF,
                                   correlation_id=corr, cuda_event_id=0, cuda_event_sync_id=0, return_value=0))
""")

# A CuPy stand-in: what each call would make CUDA (and so CUPTI) do.
FAKE_CUPY = textwrap.dedent("""
    try:
        from cupti import cupti as _c
    except ImportError:
        _c = None
    _ready = [False]

    def _init():
        if not _ready[0]:
            _ready[0] = True
            if _c:
                _c._context_created()

    def launch(name, dur_us=200):
        _init()
        if _c:
            corr, _, _ = _c._api(_c.CallbackDomain.DRIVER_API, 307)
            _c._gpu(_c.ActivityKind.CONCURRENT_KERNEL, corr, dur_us * 1000, name=name, grid_x=4, grid_y=1,
                    grid_z=1, block_x=128, block_y=1, block_z=1, registers_per_thread=32,
                    static_shared_memory=0, dynamic_shared_memory=1024)

    def copy_pageable_async(nbytes, dur_ms):
        _init()
        if _c:
            corr, _, _ = _c._api(_c.CallbackDomain.RUNTIME_API, 41)
            _c._gpu(_c.ActivityKind.MEMCPY, corr, dur_ms * 1_000_000, copy_kind=1, src_kind=1, dst_kind=3,
                    bytes=nbytes)

    class _Device:
        def synchronize(self):
            _init()
            if _c:
                corr, t0, t1 = _c._api(_c.CallbackDomain.RUNTIME_API, 165, until_ns=_c._gpu_free_ns[0])
                _c._sync_record(corr, t0, t1)

    class cuda:
        Device = _Device

    # Until the tracer's window is open (its thread enables the kernel records), when CUPTI is traced: the
    # window opens on the tracer's own thread, which a loaded machine can leave waiting past any fixed sleep
    # (0.3 s once let 9 of the 40 steps go by first). Without a CUPTI subscriber, the old 0.3 s.
    def wait_for_window(timeout_s=60.0):
        import time
        if _c is None or _c._sub is None:
            time.sleep(0.3)
            return
        deadline = time.monotonic() + timeout_s
        while int(_c.ActivityKind.CONCURRENT_KERNEL) not in _c._kinds and time.monotonic() < deadline:
            time.sleep(0.002)
""")

PROG = textwrap.dedent("""
    import os, sys, time
    mode = sys.argv[1]
    if mode == "torch-first":
        import torch
        torch.cuda.init()
    if mode == "numba":
        from numba import cuda
    else:
        import cupy
    if mode == "cupy-then-torch":
        cupy.launch("warmup")
        import torch

    def step():
        cupy.launch("tiny_step_kernel")
        cupy.cuda.Device().synchronize()
        time.sleep(0.002)

    if mode == "ondemand":  # launches until the test says stop
        t0 = time.time()
        while not os.path.exists(os.environ["STOP_FILE"]) and time.time() - t0 < 60:
            step()
    elif mode not in ("never", "numba"):
        cupy.launch("warmup")
        cupy.wait_for_window()
        for _ in range(40):
            step()
        for _ in range(3):
            cupy.copy_pageable_async(64 << 20, dur_ms=5)
        cupy.cuda.Device().synchronize()
    print("done", flush=True)
    sys.exit(int(os.environ.get("PROG_EXIT", "0")))
""")
SYNC_LINE = PROG.splitlines().index("    cupy.cuda.Device().synchronize()") + 1
LAUNCH_LINE = PROG.splitlines().index('    cupy.launch("tiny_step_kernel")') + 1


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """Libraries under a site-packages folder (as installed ones are), the program beside it."""
    root = tmp_path_factory.mktemp("fake")
    site = root / "site-packages"
    for pkg, files in (("cupti", {"__init__.py": "from . import cupti\n", "cupti.py": FAKE_CUPTI}),
                       ("cupy", {"__init__.py": FAKE_CUPY}), ("torch", FAKE_TORCH),
                       ("numba", {"__init__.py": ""}),
                       ("numba/cuda", {"__init__.py": "import cupy\ncupy.launch('numba_kernel')\n"})):
        (site / pkg).mkdir(parents=True)
        for name, text in files.items():
            (site / pkg / name).write_text(text)
    missing = root / "no-cupti" / "cupti"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError(\"No module named 'cupti'\")\n")
    (root / "prog.py").write_text(PROG)
    return root


def trace(fake: Path, out: Path, mode: str, *opts: str, env: dict[str, str] | None = None,
          missing_cupti: bool = False) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "PYTHONPATH")}
    e["PYTHONPATH"] = os.pathsep.join(([str(fake / "no-cupti")] if missing_cupti else []) + [str(fake / "site-packages")])
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "--out", str(out), "--delay", "0",
                           "--duration", "30", *opts, "--", sys.executable, str(fake / "prog.py"), mode],
                          capture_output=True, text=True, env=e, timeout=120, cwd=fake)


def status_of(out: Path) -> dict:
    [path] = out.glob("*.gpuscope.json")
    return json.loads(path.read_text())


def test_the_trigger_lists_agree():
    assert sitecustomize._CUPTI_TRIGGERS == cupti_backend.TRIGGERS


def test_base_names_drop_the_version_and_stream_suffixes():
    assert cupti_backend.base_name("cudaMemcpyAsync_ptsz_v7000") == "cudaMemcpyAsync"
    assert cupti_backend.base_name("cuMemcpyHtoD_v2_ptds") == "cuMemcpyHtoD"
    assert cupti_backend.base_name("cuCtxSynchronize") == "cuCtxSynchronize"


def test_a_cupy_program_is_traced_through_cupti_and_the_rules_read_it(fake, tmp_path):
    p = trace(fake, tmp_path, "cupy")
    assert p.returncode == 0, p.stderr
    assert "done" in p.stdout
    [path] = list(tmp_path.glob("*.pt.trace.json.gz"))
    status = status_of(tmp_path)
    assert status["backend"] == "cupti" and status["trigger"] == "cupy" and status["status"] == "written"
    doc = json.loads(gzip.decompress(path.read_bytes()))
    meta = doc["gpuscope"]
    assert meta["backend"] == "cupti" and meta["pid"] == status["pid"]
    cats = {e["cat"] for e in doc["traceEvents"]}
    assert {"kernel", "gpu_memcpy", "cuda_sync", "cuda_runtime", "python_function"} <= cats
    # Kernel launches are sampled by default: the window's 40 are within the first half of the budget.
    launches = [e for e in doc["traceEvents"] if e["cat"] == "cuda_driver"]
    assert [e["name"] for e in launches] == ["cuLaunchKernel"] * 40
    sampling = doc["gpuscope_cupti"]
    assert (sampling["launchers"], sampling["launch_budget"], sampling["launches_sampled"]) == ("sampled", 2000, 40)
    assert sampling["launch_slices"] == [40]
    [entry] = status["traces"]  # the window's status entry says it too
    assert (entry["launchers"], entry["launches_sampled"]) == ("sampled", 40)

    t = load(path)
    names = [t.name_of(i) for i in range(len(t))]
    kinds = t.events["kind"]
    assert sum(1 for i, n in enumerate(names) if n == "tiny_step_kernel" and kinds[i] == EventKind.KERNEL) == 40
    assert names.count("Memcpy HtoD (Pageable -> Device)") == 3
    assert names.count("cudaDeviceSynchronize") == 41
    # CUPTI's clock was 7 s ahead of the Unix clock: the events land inside the window on the Unix clock.
    lo, hi = meta["profiler_start_unix_ns"], meta["profiler_stop_unix_ns"]
    assert lo <= int(t.events["ts_ns"].min()) and int((t.events["ts_ns"] + t.events["dur_ns"]).max()) <= hi
    kernel = next(i for i, n in enumerate(names) if n == "tiny_step_kernel")
    assert t.args[kernel]["grid"] == [4, 1, 1] and t.args[kernel]["shared memory"] == 1024
    assert 0 < t.args[kernel]["est. achieved occupancy %"] <= 100
    assert doc["deviceProperties"][0]["numSms"] == 132

    # Every kernel of the window has its exact launcher, at the launching line.
    from gpuscope.trace.flame import SAMPLED_LAUNCHER, gpu_flame
    from gpuscope.trace.stacks import Stacks

    stacks = Stacks(t, [str(fake)])
    launched = {stacks.location(stacks.launcher(i)) for i, n in enumerate(names)
                if n == "tiny_step_kernel" and kinds[i] == EventKind.KERNEL}
    assert {(Path(loc.file).name, loc.line, loc.function) for loc in launched} == {("prog.py", LAUNCH_LINE, "step")}
    flame = gpu_flame(t)
    assert flame.inferred_ops == 0 and not any(f.name == SAMPLED_LAUNCHER for s in flame.stacks for f in s)
    assert sum(ns for s, ns in flame.stacks.items() if s[-1].name == "tiny_step_kernel"
               and any(_at_launch_line(f) for f in s)) == _kernel_ns(t, "tiny_step_kernel")

    found = {f.rule: f for f in findings(t, source_roots=[str(fake)])}
    assert found["pageable_memcpy"].evidence["count"] == 3
    sync = found["sync_in_loop"]
    assert sync.evidence["count"] >= 40
    loc = sync.locations[0][0]
    # The call's own line: the frame under step() names `synchronize`, which step() calls once.
    assert (Path(loc.file).name, loc.line, loc.function) == ("prog.py", SYNC_LINE, "step")

    a = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "analyze", "--json", str(path)],
                       capture_output=True, text=True, cwd=fake, timeout=120)
    assert a.returncode == 0, a.stderr
    rules = {f["rule"] for f in json.loads(a.stdout)["traces"][0]["findings"]}
    assert {"pageable_memcpy", "sync_in_loop"} <= rules
    svg = tmp_path / "flame.svg"
    f = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "flame", str(path), "--out", str(svg)],
                       capture_output=True, text=True, cwd=fake, timeout=120)
    assert f.returncode == 0, f.stderr
    assert "<svg" in svg.read_text()[:500] and "Memcpy HtoD (Pageable -&gt; Device)" in svg.read_text()


def _at_launch_line(frame) -> bool:
    return Path(frame.file).name == "prog.py" and frame.line == LAUNCH_LINE and frame.name.startswith("step (")


def _kernel_ns(t, name: str) -> int:
    ev = t.events
    return sum(int(ev["dur_ns"][i]) for i in range(len(t)) if ev["kind"][i] == EventKind.KERNEL and t.name_of(i) == name)


def test_api_all_records_every_call_and_warns(fake, tmp_path):
    p = trace(fake, tmp_path, "cupy", "--api", "all", env={"GPUSCOPE_TRACE_LAUNCH_SAMPLES": "5"})
    assert p.returncode == 0, p.stderr
    assert "GPUSCOPE_TRACE_API=all records every CUDA runtime and driver call" in p.stderr
    [path] = list(tmp_path.glob("*.pt.trace.json.gz"))
    t = load(path)
    assert t.meta["gpuscope_cupti"]["launchers"] == "all"  # no sampling, whatever the budget says
    names = [t.name_of(i) for i in range(len(t))]
    assert names.count("cuLaunchKernel") == 40  # the warm-up's launch made the context, before the window
    # Each launch now has its stack too: the flame graph charges the kernels to the program's lines.
    from gpuscope.trace.stacks import Stacks

    stacks = Stacks(t, [str(fake)])
    kernel = next(i for i, n in enumerate(names) if n == "tiny_step_kernel")
    loc = stacks.location(stacks.launcher(kernel))
    assert loc is not None and Path(loc.file).name == "prog.py"


def test_launch_samples_past_the_budget_charge_kernels_by_name_and_say_so(fake, tmp_path):
    p = trace(fake, tmp_path, "cupy", env={"GPUSCOPE_TRACE_LAUNCH_SAMPLES": "10"})
    assert p.returncode == 0, p.stderr
    [path] = list(tmp_path.glob("*.pt.trace.json.gz"))
    doc = json.loads(gzip.decompress(path.read_bytes()))
    sampling = doc["gpuscope_cupti"]
    # Half the budget for the window's first launches; the rest only in short slices a second apart.
    assert sampling["launch_slices"][0] == 5 and sampling["launches_sampled"] == sum(sampling["launch_slices"]) <= 10
    launches = sorted((e for e in doc["traceEvents"] if e["cat"] == "cuda_driver"), key=lambda e: e["ts"])
    assert len(launches) == sampling["launches_sampled"]
    kernels = sorted((e for e in doc["traceEvents"] if e["cat"] == "kernel"), key=lambda e: e["ts"])
    assert len(kernels) == 40
    # The first slice sampled the window's first five launches, each joined to its kernel.
    assert [e["args"]["correlation"] for e in launches[:5]] == [e["args"]["correlation"] for e in kernels[:5]]

    from gpuscope.trace.flame import SAMPLED_LAUNCHER, gpu_flame, speedscope

    t = load(path)
    flame = gpu_flame(t)
    total = _kernel_ns(t, "tiny_step_kernel")
    assert flame.unattributed_ops == 0 and flame.inferred_ops == 40 - len(launches)
    at_line = {s: ns for s, ns in flame.stacks.items()
               if s[-1].name == "tiny_step_kernel" and any(_at_launch_line(f) for f in s)}
    assert sum(at_line.values()) == total  # one launching line: all its time lands there
    inferred = sum(ns for s, ns in at_line.items() if s[-2].name == SAMPLED_LAUNCHER)
    assert inferred == flame.inferred_ns > 0 and total - inferred > 0
    assert "charged by sampled launchers" in speedscope(t)["profiles"][0]["name"]


def test_no_launch_samples_leaves_kernels_unattributed(fake, tmp_path):
    p = trace(fake, tmp_path, "cupy", env={"GPUSCOPE_TRACE_LAUNCH_SAMPLES": "0"})
    assert p.returncode == 0, p.stderr
    [path] = list(tmp_path.glob("*.pt.trace.json.gz"))
    doc = json.loads(gzip.decompress(path.read_bytes()))
    assert doc["gpuscope_cupti"]["launchers"] == "none"
    assert not [e for e in doc["traceEvents"] if e["cat"] == "cuda_driver"]
    from gpuscope.trace.flame import gpu_flame

    t = load(path)
    flame = gpu_flame(t)
    assert flame.unattributed_ops == 40 and flame.inferred_ops == 0
    assert flame.unattributed_ns == _kernel_ns(t, "tiny_step_kernel")


def test_a_numba_cuda_import_starts_it(fake, tmp_path):
    p = trace(fake, tmp_path, "numba")
    assert p.returncode == 0, p.stderr
    status = status_of(tmp_path)
    # numba.cuda's import made the context before it finished importing: the trigger comes after, and the
    # window can only start then; the status still says which import started CUPTI.
    assert status["backend"] == "cupti" and status["trigger"] in ("numba.cuda", "cupy")


def test_cupti_python_missing_is_one_line_and_a_status(fake, tmp_path):
    p = trace(fake, tmp_path, "cupy", env={"PROG_EXIT": "3"}, missing_cupti=True)
    assert p.returncode == 3
    assert "done" in p.stdout
    lines = [line for line in p.stderr.splitlines() if "CUPTI tracing could not start" in line]
    assert len(lines) == 1 and "cupti-python is not installed" in lines[0]
    assert "Traceback" not in p.stderr
    status = status_of(tmp_path)
    assert status["status"] == "cupti_missing" and not list(tmp_path.glob("*.pt.trace.json.gz"))
    assert "cupti-python is not installed" in p.stderr.splitlines()[-1]


def test_cupti_held_by_another_profiler_steps_aside(fake, tmp_path):
    p = trace(fake, tmp_path, "cupy", env={"FAKE_CUPTI_HELD": "1"})
    assert p.returncode == 0 and "done" in p.stdout
    lines = [line for line in p.stderr.splitlines() if "could not start" in line]
    assert len(lines) == 1 and "another profiler holds CUPTI (Nsight Systems, the PyTorch profiler" in lines[0]
    assert "Traceback" not in p.stderr
    assert status_of(tmp_path)["status"] == "cupti_held"
    assert not list(tmp_path.glob("*.pt.trace.json.gz"))


def test_a_program_that_never_uses_cuda_writes_no_trace(fake, tmp_path):
    p = trace(fake, tmp_path, "never", env={"PROG_EXIT": "4"})
    assert p.returncode == 4 and "done" in p.stdout
    assert status_of(tmp_path)["status"] == "no_cuda"
    assert not list(tmp_path.glob("*.pt.trace.json.gz"))
    assert "never created a CUDA context" in p.stderr


def test_torch_first_keeps_the_pytorch_profiler(fake, tmp_path):
    p = trace(fake, tmp_path, "torch-first")
    assert p.returncode == 0, p.stderr
    status = status_of(tmp_path)
    assert status["backend"] == "torch"
    [path] = list(tmp_path.glob("*.pt.trace.json.gz"))
    names = {e["name"] for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]}
    assert "aten::mm" in names and "tiny_step_kernel" not in names


def test_torch_after_cupti_is_not_fought_but_said(fake, tmp_path):
    p = trace(fake, tmp_path, "cupy-then-torch")
    assert p.returncode == 0, p.stderr
    status = status_of(tmp_path)
    assert status["backend"] == "cupti" and "torch was imported after CUPTI tracing started" in status["torch_after_cupti"]
    [path] = list(tmp_path.glob("*.pt.trace.json.gz"))
    names = {e["name"] for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]}
    assert "tiny_step_kernel" in names and "aten::mm" not in names
    assert "torch was imported after CUPTI tracing started" in p.stderr


def test_backend_torch_leaves_cupy_programs_alone(fake, tmp_path):
    p = trace(fake, tmp_path, "cupy", "--backend", "torch")
    assert p.returncode == 0 and "done" in p.stdout
    assert not list(tmp_path.glob("*.gpuscope.json"))


@pytest.mark.parametrize("opts, message", [
    (("--backend", "nvtx"), "invalid choice"),
    (("--backend", "torch", "--api", "all"), "--api all applies to the CUPTI backend"),
])
def test_bad_backend_options_are_usage_errors(fake, tmp_path, opts, message):
    p = trace(fake, tmp_path, "cupy", *opts)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr


def test_on_demand_requests_are_answered_through_cupti(fake, tmp_path):
    from gpuscope.trace import ondemand as od

    agent = tmp_path / "agent"
    agent.mkdir()  # the agent's data dir, which the agent makes (a missing one is a usage error)
    stop = tmp_path / "stop"
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "PYTHONPATH")}
    e.update(PYTHONPATH=str(fake / "site-packages"), STOP_FILE=str(stop), GPUSCOPE_TRACE_MAX_DUTY="0.5")
    proc = subprocess.Popen([sys.executable, "-m", "gpuscope.cli", "trace", "--on-demand", "--agent-dir", str(agent),
                             "--", sys.executable, str(fake / "prog.py"), "ondemand"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, cwd=fake)
    try:
        req_dir = str(agent / "trace-requests")
        for _ in range(300):
            if os.path.isdir(req_dir) and od.opted_in(req_dir):
                break
            time.sleep(0.05)
        [me] = od.opted_in(req_dir)
        req = od.write_request(req_dir, 1.0, [me["pid"]])
        for _ in range(300):
            done = [t for t in od.list_traces(req_dir) if t["id"] == req["id"]]
            if done:
                break
            time.sleep(0.05)
    finally:
        stop.write_text("")
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    [answer] = done
    assert answer["status"] == "written", answer
    t = load(agent / "traces" / answer["file"])
    names = [t.name_of(i) for i in range(len(t))]
    assert names.count("tiny_step_kernel") > 0 and "cudaDeviceSynchronize" in names


# -- launch sampling, in this process: the fake cupti as a module, the launches made here -----------------


@pytest.fixture
def fake_cupti():
    import types

    mod = types.ModuleType("cupti.cupti")  # its frames are CUPTI's, not the program's (as in the wheel)
    exec(compile(FAKE_CUPTI, "<fake cupti>", "exec"), mod.__dict__)
    return mod


def _launch(c, name, dur_ns=100_000):
    corr, _, _ = c._api(c.CallbackDomain.DRIVER_API, 307, spin_ns=0)
    c._gpu(c.ActivityKind.CONCURRENT_KERNEL, corr, dur_ns, name=name, grid_x=1, grid_y=1, grid_z=1, block_x=32,
           block_y=1, block_z=1, registers_per_thread=16, static_shared_memory=0, dynamic_shared_memory=0)


def launch_from_a(c, name):
    _launch(c, name)


def launch_from_b(c, name):
    _launch(c, name)


LAUNCH_IDS = {(1, 307), (2, 211)}  # cuLaunchKernel and cudaLaunchKernel_v7000 in the fake's enums


def _wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_launch_callbacks_are_on_at_window_start_and_off_after_the_budget(fake_cupti):
    c = fake_cupti
    s = cupti_backend.Session(cupti=c, launch_samples=4, launch_slice_every_s=3600)
    assert s.launch_keys == LAUNCH_IDS
    w = s.window()
    assert not LAUNCH_IDS & c._callbacks
    w.start()
    try:
        assert LAUNCH_IDS <= c._callbacks and (2, 165) in c._callbacks  # with the rules' calls
        launch_from_a(c, "k")
        assert LAUNCH_IDS <= c._callbacks
        launch_from_a(c, "k")  # the first slice's half of the budget: the sampler turns them off
        _wait_for(lambda: not LAUNCH_IDS & c._callbacks)
        assert (2, 165) in c._callbacks
        for _ in range(5):
            launch_from_a(c, "k")
    finally:
        w.stop()
    assert not LAUNCH_IDS & c._callbacks
    assert w.summary() == {"launchers": "sampled", "launch_budget": 4, "launches_sampled": 2, "launch_slices": [2]}


def test_exactly_the_budget_is_recorded_even_while_the_callbacks_stay_on(fake_cupti):
    c = fake_cupti
    real = c.enable_callback
    c.enable_callback = lambda on, sub, domain, cbid: real(1, sub, domain, cbid)  # never turns one off
    s = cupti_backend.Session(cupti=c, launch_samples=10, launch_slice_every_s=0.02, launch_slice_s=0.05)
    w = s.window()
    w.start()
    try:
        deadline = time.monotonic() + 20
        while s.launch_taken < 10 and time.monotonic() < deadline:
            launch_from_a(c, "k")
            time.sleep(0.001)
        for _ in range(200):
            launch_from_a(c, "k")
    finally:
        w.stop()
    summary = w.summary()
    # 5 for the window's first launches, then slices of a twentieth of the budget (at least 1) each.
    assert summary["launches_sampled"] == 10 and summary["launch_slices"] == [5, 1, 1, 1, 1, 1]
    assert len([r for r in s.api_calls if r[0] == "driver"]) == 10


def test_a_runtime_launch_and_the_driver_launch_inside_it_are_one_sample(fake_cupti):
    c = fake_cupti
    s = cupti_backend.Session(cupti=c, launch_samples=100, launch_slice_every_s=3600)
    w = s.window()
    w.start()
    try:
        c._corr[0] += 1
        outer = c._corr[0]
        c._callback(c.CallbackDomain.RUNTIME_API, 211, c.ApiCallbackSite.API_ENTER, outer)
        c._api(c.CallbackDomain.DRIVER_API, 307)
        c._callback(c.CallbackDomain.RUNTIME_API, 211, c.ApiCallbackSite.API_EXIT, outer)
        launch_from_b(c, "k")  # a driver launch of its own, after: sampled
    finally:
        w.stop()
    assert [(r[0], r[5]) for r in s.api_calls] == [("runtime", outer), ("driver", outer + 2)]
    assert w.summary()["launches_sampled"] == 2


def test_a_runtime_launch_cut_by_the_slice_s_end_does_not_block_its_thread_s_driver_launches(fake_cupti):
    # The sampler switches the launch callbacks off between a runtime launch's entry and its exit: the exit
    # never comes. The next slice must still sample this thread's own driver launches.
    c = fake_cupti
    s = cupti_backend.Session(cupti=c, launch_samples=100, launch_slice_every_s=3600)
    w = s.window()
    w.start()
    try:
        c._corr[0] += 1
        c._callback(c.CallbackDomain.RUNTIME_API, 211, c.ApiCallbackSite.API_ENTER, c._corr[0])
        w._switch_launches(False)  # the slice ends here; the exit is lost
        w._switch_launches(True)   # the next slice
        for _ in range(3):
            launch_from_b(c, "k")
    finally:
        w.stop()
    assert len([r for r in s.api_calls if r[0] == "driver"]) == 3


def test_unsampled_kernels_are_charged_to_the_sampled_stacks_of_their_name(fake_cupti, tmp_path):
    from gpuscope.trace.flame import SAMPLED_LAUNCHER, gpu_flame

    c = fake_cupti
    s = cupti_backend.Session(cupti=c, launch_samples=8, launch_slice_every_s=3600)
    w = s.window()
    w.start()
    try:
        for f in (launch_from_a, launch_from_a, launch_from_a, launch_from_b):  # the first slice: 4 samples
            f(c, "k")
        _wait_for(lambda: not LAUNCH_IDS & c._callbacks)
        for _ in range(4):
            launch_from_b(c, "k")  # not sampled: charged 3:1 by the samples, wherever they came from
        launch_from_a(c, "never_sampled")
        launch_from_a(c, "never_sampled")
    finally:
        w.stop()
    path = tmp_path / "t.pt.trace.json"
    w.export_chrome_trace(str(path))
    t = load(path)
    flame = gpu_flame(t)
    assert flame.unattributed_ops == 2 and flame.unattributed_ns == _kernel_ns(t, "never_sampled")
    assert flame.inferred_ops == 4 and flame.inferred_ns == 4 * 100_000
    assert flame.attributed_ns == _kernel_ns(t, "k") == sum(flame.stacks.values())

    def where(stack):
        funcs = {f.name.split(" (")[0] for f in stack}
        return "a" if "launch_from_a" in funcs else "b" if "launch_from_b" in funcs else "?"

    exact: dict[str, int] = {}
    inferred: dict[str, int] = {}
    for stack, ns in flame.stacks.items():
        assert stack[-1].name == "k"
        into = inferred if stack[-2].name == SAMPLED_LAUNCHER else exact
        into[where(stack)] = into.get(where(stack), 0) + ns
    assert exact == {"a": 300_000, "b": 100_000}
    assert inferred == {"a": 300_000, "b": 100_000}


@pytest.mark.parametrize("budget", [100, 0])
def test_the_tiny_kernel_rule_takes_its_launch_median_from_the_samples(fake_cupti, tmp_path, budget):
    import dataclasses
    import math

    from gpuscope.trace.rule_thresholds import DEFAULT

    c = fake_cupti
    s = cupti_backend.Session(cupti=c, launch_samples=budget, launch_slice_every_s=3600)
    w = s.window()
    w.start()
    try:
        for _ in range(600):
            _launch(c, "tiny", dur_ns=2_000)
    finally:
        w.stop()
    path = tmp_path / "t.pt.trace.json"
    w.export_chrome_trace(str(path))
    th = dataclasses.replace(DEFAULT, tiny_min_per_s=0.0)  # a rate, on a machine of any speed
    [storm] = [f for f in findings(load(path), thresholds=th) if f.rule == "tiny_kernel_storm"]
    assert storm.evidence["tiny_kernels"] == 600
    median = storm.evidence["median_launch_us"]
    if budget:
        sampled = sorted(r[2] - r[1] for r in s.api_calls if r[0] == "driver")
        assert len(sampled) == 50 and median == pytest.approx((sampled[24] + sampled[25]) / 2e3, abs=0.01)
        assert storm.locations and storm.locations[0][0].function == "_launch"
    else:
        assert math.isnan(median) and not storm.locations
