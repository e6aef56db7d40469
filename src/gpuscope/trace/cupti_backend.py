"""The CUPTI backend of `gpuscope trace`: CUDA programs without PyTorch (CuPy, Numba, JAX, cuda-python).

The bootstrap (bootstrap/sitecustomize.py) loads this file by its path when the program imports one of
`TRIGGERS` and not torch, and drives a `Window` as it drives the PyTorch profiler: start(), stop(),
export_chrome_trace(path). The file written is Kineto-compatible JSON (the cat names, args and
pid/tid conventions of trace/kineto.py), so the loader, the rules and `trace flame` read it unchanged.

Which records, and why (docs/trace-cupti.md has the figures): cupti-python makes a Python object of
every record (tens of µs each), so only the GPU's own work is recorded by default (kernels, copies with
their memory kinds, memsets, CUPTI's synchronization records) plus the few runtime/driver calls the
rules read (memcpy, memset, synchronize, malloc/free), timed by a callback on those ids only, which
also takes the call's Python stack. Kernel launches are sampled: a callback on the launch ids only, on
for the first launches of a window and for short slices after, at most GPUSCOPE_TRACE_LAUNCH_SAMPLES
(default 2,000) launches a window, each recorded like the rules' calls; `trace flame` charges the kernels
not sampled to the stacks sampled for the same kernel name. `api_all` (the opt-in GPUSCOPE_TRACE_API=all)
records every runtime and driver call instead, and slows a launch-bound loop many times. Records wait in
256 MiB buffers and are flushed when the window ends.

Only the standard library and `cupti` are imported: this runs inside the traced program.
"""

import ast
import bisect
import functools
import json
import os
import re
import sys
import threading
import time

#: Modules whose import starts CUPTI tracing in --backend auto (torch keeps the PyTorch profiler).
TRIGGERS = ("cupy", "numba.cuda", "numba_cuda", "jax", "cuda.bindings", "cuda.cudart", "cuda.core")

def _buffer_bytes():
    try:
        return max(1, int(os.environ.get("GPUSCOPE_TRACE_CUPTI_BUFFER_MB", "256"))) << 20
    except ValueError:
        return 256 << 20


#: Large buffers: CUPTI hands a buffer back when it is full or flushed, and cupti-python then makes an
#: object of each record on CUPTI's thread, holding the GIL; the fewer buffers fill during a window, the
#: more of that work waits for its end. GPUSCOPE_TRACE_CUPTI_BUFFER_MB, default 256 (about a million
#: kernel records): on an H200 a launch-bound CuPy loop ran 42 % slower traced with 32 MiB, 22 % with 256.
BUFFER_BYTES = _buffer_bytes()
HELD = ("another profiler holds CUPTI (Nsight Systems, the PyTorch profiler, DCGM profiling ...); "
        "only one CUPTI subscriber can exist per process")
# The API calls the rules read (sync_memcpy, sync_memset, sync_in_loop, pageable_memcpy's launcher).
_RULE_CALLS = re.compile(r"^(cuda|cu)(Memcpy|Memset|Malloc|MemAlloc|Free|MemFree|MemHostAlloc|DeviceSynchronize|"
                         r"ThreadSynchronize|CtxSynchronize|StreamSynchronize|EventSynchronize)")
# The kernel launch calls, sampled (Session.launch_budget): a CUDA graph's kernels carry their graph
# launch's correlation id, so the graph launches are launchers too.
_LAUNCH_CALLS = re.compile(r"^(cudaLaunchKernel|cudaLaunchCooperativeKernel|cudaGraphLaunch|cuLaunchKernel|"
                           r"cuLaunchCooperativeKernel|cuGraphLaunch)(Ex|ExC|MultiDevice)?(_|$)")
_VERSION_SUFFIX = re.compile(r"_(v\d+|ptsz|ptds)$")
_STACK_DEPTH = 24
_COPY = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD", 9: "HtoH",
         10: "PtoP"}
_MEMORY = {1: "Pageable", 2: "Pinned", 3: "Device", 4: "Array", 5: "Managed", 6: "Device Static",
           7: "Managed Static"}
_SYNC = {1: "Event Sync", 2: "Stream Wait Event", 3: "Stream Sync", 4: "Context Sync"}


class Unavailable(Exception):
    """CUPTI cannot trace this process; `status` is the status file's word, str() the sentence."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def _launch_budget():
    try:
        return max(0, int(os.environ.get("GPUSCOPE_TRACE_LAUNCH_SAMPLES", "2000")))
    except ValueError:
        return 2000


#: Launch sampling: the first half of a window's budget goes to its first launches; the rest to slices of
#: at most LAUNCH_SLICE_S every LAUNCH_SLICE_EVERY_S (a twentieth of the budget each), so that kernels
#: first launched late in a window are sampled too, for at most 1 % of its time.
LAUNCH_SLICE_EVERY_S = 1.0
LAUNCH_SLICE_S = 0.01


def base_name(cbid_name):
    """'cudaMemcpyAsync_ptsz_v7000' -> 'cudaMemcpyAsync', as Kineto names API events."""
    while True:
        short = _VERSION_SUFFIX.sub("", cbid_name)
        if short == cbid_name:
            return short
        cbid_name = short


def load_cupti():
    try:
        from cupti import cupti
    except ImportError as e:
        raise Unavailable("cupti_missing", f"cupti-python is not installed ({e}); pip install cupti-python") from None
    return cupti


class Session:
    """The process's one CUPTI subscriber, held from the trigger to the exit."""

    def __init__(self, api_all=False, with_stack=True, cupti=None, launch_samples=None,
                 launch_slice_every_s=LAUNCH_SLICE_EVERY_S, launch_slice_s=LAUNCH_SLICE_S):
        c = self.cupti = cupti or load_cupti()
        self.api_all = api_all
        self.with_stack = with_stack
        # --api all records every launch already; else at most this many launches a window (0: none).
        self.launch_budget = 0 if api_all else (_launch_budget() if launch_samples is None
                                                else max(0, int(launch_samples)))
        self.launch_slice_every_s = launch_slice_every_s
        self.launch_slice_s = launch_slice_s
        self.launch_lock = threading.Lock()
        self.launch_taken = 0  # launches sampled in this window (tickets: counted at entry)
        self.launch_cap = 0  # launch_taken may grow to this: the current slice's end
        self.launch_full = threading.Event()  # set when launch_taken reaches launch_cap
        self.launch_threads = set()  # threads inside a sampled runtime launch (its driver launch is not another)
        # CUPTI's docs: "a subscriber must serialize access to cuptiGetCallbackState, cuptiEnableCallback,
        # cuptiEnableDomain, and cuptiEnableAllDomains"; the window's thread and its sampler both switch.
        self.switch_lock = threading.Lock()
        self.cuda_seen = threading.Event()
        self.lock = threading.Lock()
        self.records = []
        self.stacks = {}
        self.api_calls = []  # the rules' API calls, from the callbacks: (kind, start, end, pid, tid, corr, cbid)
        self.open_calls = {}  # correlation -> (entered at, stack)
        self.devices = {}  # device id -> Kineto's deviceProperties entry
        self.dropped_buffers = 0
        self.window_open = False
        try:
            self.subscriber = c.subscribe(self._on_callback, None)
        except c.cuptiError as e:
            if getattr(e, "status", None) == int(c.Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED):
                raise Unavailable("cupti_held", HELD) from None
            raise Unavailable("cupti_failed", f"cuptiSubscribe failed: {e}") from None
        try:
            c.enable_callback(1, self.subscriber, c.CallbackDomain.RESOURCE, c.CallbackIdResource.CONTEXT_CREATED)
            # API records then carry the OS thread id (gettid), as Kineto's CPU events do.
            c.set_thread_id_type(c.ActivityThreadIdType.SYSTEM)
            c.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
        except c.cuptiError as e:
            self.close()
            if getattr(e, "status", None) == int(c.Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED):
                raise Unavailable("cupti_held", HELD) from None
            raise Unavailable("cupti_failed", f"CUPTI setup failed: {e}") from None
        self.api_cbids = {}  # CallbackDomain -> [cbid] of the calls the rules read
        for domain, enum in ((c.CallbackDomain.RUNTIME_API, c.RuntimeApiTraceCbid),
                             (c.CallbackDomain.DRIVER_API, c.DriverApiTraceCbid)):
            self.api_cbids[domain] = [int(m) for m in enum if _RULE_CALLS.match(m.name)]
        self.launch_cbids = {}  # CallbackDomain -> [cbid] of the kernel launch calls
        for domain, enum in ((c.CallbackDomain.RUNTIME_API, c.RuntimeApiTraceCbid),
                             (c.CallbackDomain.DRIVER_API, c.DriverApiTraceCbid)):
            self.launch_cbids[domain] = [int(m) for m in enum if _LAUNCH_CALLS.match(m.name)]
        # Empty when not sampling: --api all takes every launch (and its stack) through the whole domains.
        self.launch_keys = frozenset((int(d), cbid) for d, cbids in self.launch_cbids.items() for cbid in cbids
                                     if self.launch_budget)
        self.runtime_domain, self.driver_domain = int(c.CallbackDomain.RUNTIME_API), int(c.CallbackDomain.DRIVER_API)
        self.launch_runtime = frozenset(self.launch_cbids[c.CallbackDomain.RUNTIME_API])
        self.api_names = {}
        for domain, enum in ((c.CallbackDomain.RUNTIME_API, c.RuntimeApiTraceCbid),
                             (c.CallbackDomain.DRIVER_API, c.DriverApiTraceCbid)):
            self.api_names[int(domain)] = {int(m): base_name(m.name) for m in enum}
        _KIND_NAMES.update(_kind_names(c))
        try:  # one record per GPU, as the devices come up: kept for every window
            c.activity_enable(c.ActivityKind.DEVICE)
        except c.cuptiError:
            pass

    def close(self):
        try:
            self.cupti.unsubscribe(self.subscriber)
        except Exception:
            pass

    # -- CUPTI's callbacks (any thread; never raise into CUDA) ------------------------------------------
    def _on_callback(self, userdata, domain, cbid, cbdata):
        try:
            c = self.cupti
            if domain == c.CallbackDomain.RESOURCE:
                self.cuda_seen.set()
            elif not self.window_open:
                pass
            elif cbdata.callback_site == c.ApiCallbackSite.API_ENTER:
                key = (int(domain), int(cbid))
                launch = key in self.launch_keys
                if launch and not self._take_launch(key[0]):
                    return  # past the budget, or the driver launch inside a sampled runtime launch
                stack = None
                if self.with_stack:
                    try:
                        stack = _stack(sys._getframe(1))
                    except ValueError:  # no Python frame on this thread (XLA launches from its own threads)
                        if not launch:
                            return
                self.open_calls[cbdata.correlation_id] = (c.get_timestamp(), stack)  # after the stack: not its cost
            else:
                end = c.get_timestamp()
                corr = cbdata.correlation_id
                if self.launch_threads and int(domain) == self.runtime_domain and int(cbid) in self.launch_runtime:
                    self.launch_threads.discard(threading.get_native_id())
                entered = self.open_calls.pop(corr, None)
                if entered is None:
                    return
                if not self.api_all:  # with --api all the activity records have every call
                    what = "runtime" if domain == c.CallbackDomain.RUNTIME_API else "driver"
                    self.api_calls.append((what, entered[0], end, os.getpid(), threading.get_native_id(), corr,
                                           int(cbid)))
                if entered[1]:
                    self.stacks[corr] = entered[1]
        except Exception:
            pass

    def _take_launch(self, domain):
        """Whether to record this launch: within the slice's budget, and not the driver call a sampled
        runtime launch makes (one launch, one sample). A lock, not a bare counter: threads may launch at once."""
        tid = threading.get_native_id()
        if domain != self.runtime_domain and tid in self.launch_threads:
            return False
        with self.launch_lock:
            if self.launch_taken >= self.launch_cap:
                return False
            self.launch_taken += 1
            if self.launch_taken == self.launch_cap:
                self.launch_full.set()  # the sampler turns the callbacks off; never from in here
        if domain == self.runtime_domain:
            self.launch_threads.add(tid)
        return True

    def _buffer_requested(self):
        return BUFFER_BYTES, 0

    def _buffer_completed(self, activities):
        try:
            rows = [_plain(a) for a in activities]
            with self.lock:
                for r in rows:
                    if r is None:
                        continue
                    if r[0] == "device":
                        self.devices[r[1]] = r[2]
                    else:
                        self.records.append(r)
        except Exception:
            self.dropped_buffers += 1

    # -- windows ---------------------------------------------------------------------------------------
    def window(self):
        return Window(self)


class Window:
    """One traced window, with the PyTorch profiler's start/stop/export_chrome_trace."""

    def __init__(self, session):
        self.s = session
        self.clock = {}
        self.kinds = []
        self.skipped = 0  # callback ids CUPTI refused
        self.launch_slices = []  # launches sampled in each slice: the window's first, then the short ones
        self.sampler = None
        self.stopping = threading.Event()
        self.launch_on = False

    def _switch(self, on):
        s, c = self.s, self.s.cupti
        with s.switch_lock:
            self._switch_locked(s, c, on)

    def _switch_locked(self, s, c, on):
        flag = 1 if on else 0
        # The rules' calls are recorded by a callback on their ids, enter and exit: on an H200 (CUPTI 13.5,
        # driver 580) cuptiActivityEnableRuntimeApi/DriverApi per id gave no records at all.
        if s.with_stack and s.api_all:  # every call's stack, so `trace flame` can charge kernels to lines
            for domain in s.api_cbids:
                c.enable_domain(flag, s.subscriber, domain)
        elif not s.api_all:
            for domain, cbids in s.api_cbids.items():
                for cbid in cbids:
                    self._each(c.enable_callback, flag, s.subscriber, domain, cbid)
        for kind in self.kinds:
            (c.activity_enable if on else c.activity_disable)(kind)

    def _switch_launches(self, on):
        """The launch callbacks on or off. Called from the window's threads only: CUPTI's docs do not say
        that cuptiEnableCallback may be called from inside a callback, and ask for the calls to be serialised."""
        s, c = self.s, self.s.cupti
        with s.switch_lock:
            if on == self.launch_on or (on and self.stopping.is_set()):
                return
            self.launch_on = on
            for domain, cbids in s.launch_cbids.items():
                for cbid in cbids:
                    self._each(c.enable_callback, 1 if on else 0, s.subscriber, domain, cbid)
            if not on:
                # A runtime launch entered before the switch may never see its exit callback: its thread
                # must not stay marked "inside a sampled launch" (its driver launches would be refused).
                s.launch_threads = set()

    def _sample_launches(self):
        """The sampler thread: the first slice until its half of the budget is taken, then a short slice
        every launch_slice_every_s until the budget is spent or the window ends."""
        s = self.s
        try:
            s.launch_full.wait()
            self._switch_launches(False)
            self.launch_slices.append(s.launch_taken)
            slice_cap = max(1, s.launch_budget // 20)
            while s.launch_taken < s.launch_budget and not self.stopping.wait(s.launch_slice_every_s):
                with s.launch_lock:
                    before = s.launch_taken
                    s.launch_cap = min(s.launch_budget, before + slice_cap)
                    s.launch_full.clear()
                self._switch_launches(True)
                s.launch_full.wait(s.launch_slice_s)
                self._switch_launches(False)
                if s.launch_taken > before:
                    self.launch_slices.append(s.launch_taken - before)
        except Exception:
            pass  # never into the program; the window ends with what was sampled
        finally:
            with s.launch_lock:
                s.launch_cap = s.launch_taken  # no more, whatever is still enabled

    def _each(self, call, *args):
        """One callback id of many: an id this CUDA version does not know is skipped, not fatal; losing
        the subscriber is (the caller reports it)."""
        c = self.s.cupti
        try:
            call(*args)
        except c.cuptiError as e:
            if getattr(e, "status", None) == int(c.Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED):
                raise
            self.skipped += 1

    def start(self):
        s, c = self.s, self.s.cupti
        old = getattr(s, "sampler_thread", None)
        if old is not None and old.is_alive():  # the last window's sampler outlived its stop(): let it end
            old.join(5.0)
        sample = s.launch_budget > 0 and not (old is not None and old.is_alive())  # else it would reset our counts
        with s.lock:
            s.records = []
        s.stacks, s.api_calls, s.open_calls = {}, [], {}
        s.launch_threads = set()
        with s.launch_lock:
            s.launch_taken = 0
            s.launch_cap = s.launch_budget - s.launch_budget // 2
            s.launch_full.clear()
        k = c.ActivityKind
        self.kinds = [k.CONCURRENT_KERNEL, k.MEMCPY, k.MEMSET, k.SYNCHRONIZATION]
        if s.api_all:
            self.kinds += [k.RUNTIME, k.DRIVER]
        self.clock["start"] = _clock_pair(c)
        s.window_open = True
        try:
            self._switch(True)
            if sample:
                self._switch_launches(True)
        except c.cuptiError as e:
            s.window_open = False
            self.stopping.set()
            try:
                self._switch_launches(False)
                self._switch(False)
            except Exception:
                pass
            if getattr(e, "status", None) == int(c.Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED):
                raise Unavailable("cupti_held", HELD) from None
            raise
        if sample:
            self.sampler = threading.Thread(target=self._sample_launches, name="gpuscope-launch-sampler",
                                            daemon=True)
            s.sampler_thread = self.sampler
            self.sampler.start()

    def stop(self):
        s, c = self.s, self.s.cupti
        s.window_open = False
        self.stopping.set()
        s.launch_full.set()  # wakes the sampler
        try:
            if self.sampler is not None:
                self.sampler.join(5.0)
            self._switch_launches(False)
            self._switch(False)
        finally:
            c.activity_flush_all(1)  # forced: hand back partly filled buffers too
            self.clock["stop"] = _clock_pair(c)

    def export_chrome_trace(self, path):
        with self.s.lock:
            records, self.s.records = self.s.records + self.s.api_calls, []
            devices = dict(self.s.devices)
        doc = to_kineto(records, self.s.stacks, self.clock, self.s.api_names, devices)
        doc["gpuscope_cupti"] = {"api": "all" if self.s.api_all else "rules", "records": len(records),
                                 "stacks": len(self.s.stacks), "dropped_buffers": self.s.dropped_buffers,
                                 "refused_callback_ids": self.skipped, "frameworks": frameworks(),
                                 **self.summary(records)}
        with open(path, "w") as f:
            json.dump(doc, f, separators=(",", ":"))


    def summary(self, records=None):
        """How the window's launchers were recorded, for the trace's `gpuscope_cupti` key (and for the
        bootstrap's status entry of the window): `launchers` is "sampled" (trace flame then charges
        unsampled kernels by kernel name), "all" or "none"."""
        s = self.s
        if s.api_all:
            return {"launchers": "all"}
        if s.launch_budget <= 0:
            return {"launchers": "none"}
        if records is None:
            with s.lock:
                records = list(s.api_calls)
        keys = s.launch_keys
        sampled = sum(1 for r in records if r[0] in ("runtime", "driver")
                      and ((s.runtime_domain if r[0] == "runtime" else s.driver_domain), r[6]) in keys)
        return {"launchers": "sampled", "launch_budget": s.launch_budget, "launches_sampled": sampled,
                "launch_slices": list(self.launch_slices)}


def frameworks():
    """The traced process's GPU frameworks, from its own maps and modules, for the fixes of the trace's findings
    (gpuscope/_frameworks.py, loaded by its path like this file); [] when that fails."""
    try:
        module = sys.modules.get("_gpuscope_frameworks")
        if module is None:
            import importlib.util

            path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_frameworks.py")
            spec = importlib.util.spec_from_file_location("_gpuscope_frameworks", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules["_gpuscope_frameworks"] = module
        return list(module.of_this_process())
    except Exception:  # inside the traced program: never raise
        return []


def _clock_pair(c):
    return {"unix_ns": time.time_ns(), "cupti_ns": int(c.get_timestamp()), "monotonic_ns": time.monotonic_ns()}


def _stack(frame):
    """(file, first line, function, line) of the Python frames under a CUDA call, innermost first."""
    out = []
    while frame is not None and len(out) < _STACK_DEPTH:
        code = frame.f_code
        if not frame.f_globals.get("__name__", "").startswith("cupti"):
            out.append((code.co_filename, code.co_firstlineno, code.co_name, frame.f_lineno))
        frame = frame.f_back
    return out


def _plain(a):
    """An activity object -> a tuple of plain values (the object may point into CUPTI's buffer)."""
    kind = int(a.kind)
    name = _KIND_NAMES.get(kind)
    if name == "kernel":
        return ("kernel", a.start, a.end, a.device_id, a.context_id, a.stream_id, a.correlation_id, a.name,
                (a.grid_x, a.grid_y, a.grid_z), (a.block_x, a.block_y, a.block_z), a.registers_per_thread,
                a.static_shared_memory + a.dynamic_shared_memory)
    if name == "memcpy":
        return ("memcpy", a.start, a.end, a.device_id, a.context_id, a.stream_id, a.correlation_id,
                a.copy_kind, a.src_kind, a.dst_kind, a.bytes)
    if name == "memset":
        return ("memset", a.start, a.end, a.device_id, a.context_id, a.stream_id, a.correlation_id,
                getattr(a, "memory_kind", 0), a.bytes)
    if name == "sync":
        return ("sync", a.start, a.end, a.context_id, a.stream_id, a.correlation_id, a.type)
    if name in ("runtime", "driver"):
        return (name, a.start, a.end, a.process_id, a.thread_id, a.correlation_id, a.cbid)
    if name == "device":
        return ("device", a.id, {
            "id": a.id, "name": a.name, "totalGlobalMem": a.global_memory_size,
            "computeMajor": a.compute_capability_major, "computeMinor": a.compute_capability_minor,
            "maxThreadsPerBlock": a.max_threads_per_block,
            "maxThreadsPerMultiprocessor": a.max_warps_per_multiprocessor * a.num_threads_per_warp,
            "maxBlocksPerMultiprocessor": a.max_blocks_per_multiprocessor,
            "regsPerBlock": a.max_registers_per_block, "regsPerMultiprocessor": a.max_registers_per_multiprocessor,
            "warpSize": a.num_threads_per_warp, "sharedMemPerBlock": a.max_shared_memory_per_block,
            "sharedMemPerMultiprocessor": a.max_shared_memory_per_multiprocessor, "numSms": a.num_multiprocessors})
    return None


_KIND_NAMES: dict = {}  # ActivityKind value -> the short name _plain uses; filled by Session


def _kind_names(c):
    k = c.ActivityKind
    return {int(k.CONCURRENT_KERNEL): "kernel", int(k.KERNEL): "kernel", int(k.MEMCPY): "memcpy",
            int(k.MEMSET): "memset", int(k.SYNCHRONIZATION): "sync", int(k.RUNTIME): "runtime",
            int(k.DRIVER): "driver", int(k.DEVICE): "device"}


# -- to Kineto JSON (after the window) ------------------------------------------------------------------


def to_kineto(records, stacks, clock, api_names, devices):
    """Plain records -> a Kineto-compatible document (times: µs after baseTimeNanoseconds, Unix clock)."""
    start, stop = clock["start"], clock.get("stop", clock["start"])
    # CUPTI's clock is Unix ns on Linux; the offset measured at both ends keeps any other source honest.
    offset_ns = ((start["unix_ns"] - start["cupti_ns"]) + (stop["unix_ns"] - stop["cupti_ns"])) // 2
    base_ns = start["unix_ns"] // 1_000_000 * 1_000_000
    shift = offset_ns - base_ns

    def us(ns):
        return round((ns + shift) / 1000.0, 3)

    context_device = {r[4]: r[3] for r in records if r[0] in ("kernel", "memcpy", "memset")}
    events = []
    for r in records:
        what = r[0]
        if what == "kernel":
            _, t0, t1, dev, ctx, stream, corr, name, grid, block, regs, smem = r
            args = {"device": dev, "context": ctx, "stream": stream, "correlation": corr,
                    "registers per thread": regs, "shared memory": smem, "grid": list(grid), "block": list(block)}
            args.update(_occupancy(devices.get(dev), grid, block, regs, smem))
            events.append({"ph": "X", "cat": "kernel", "name": name, "pid": dev, "tid": stream, "ts": us(t0),
                           "dur": us(t1) - us(t0), "args": args})
        elif what == "memcpy":
            _, t0, t1, dev, ctx, stream, corr, copy, src, dst, nbytes = r
            name = f"Memcpy {_COPY.get(copy, 'Unknown')} ({_MEMORY.get(src, 'Unknown')} -> {_MEMORY.get(dst, 'Unknown')})"
            events.append({"ph": "X", "cat": "gpu_memcpy", "name": name, "pid": dev, "tid": stream, "ts": us(t0),
                           "dur": us(t1) - us(t0),
                           "args": {"device": dev, "context": ctx, "stream": stream, "correlation": corr,
                                    "bytes": nbytes, "memory bandwidth (GB/s)": _gbps(nbytes, t1 - t0)}})
        elif what == "memset":
            _, t0, t1, dev, ctx, stream, corr, mem, nbytes = r
            events.append({"ph": "X", "cat": "gpu_memset", "name": f"Memset ({_MEMORY.get(mem, 'Unknown')})",
                           "pid": dev, "tid": stream, "ts": us(t0), "dur": us(t1) - us(t0),
                           "args": {"device": dev, "context": ctx, "stream": stream, "correlation": corr,
                                    "bytes": nbytes, "memory bandwidth (GB/s)": _gbps(nbytes, t1 - t0)}})
        elif what == "sync":
            _, t0, t1, ctx, stream, corr, kind = r
            dev = context_device.get(ctx, 0)
            stream = stream if stream < 0xFFFFFFFF else -1  # a context sync names no stream
            events.append({"ph": "X", "cat": "cuda_sync", "name": _SYNC.get(kind, "Sync"), "pid": dev,
                           "tid": stream, "ts": us(t0), "dur": us(t1) - us(t0),
                           "args": {"device": dev, "context": ctx, "stream": stream, "correlation": corr}})
    events.extend(_api_events(records, stacks, us, api_names))
    return {"schemaVersion": 1, "deviceProperties": [devices[d] for d in sorted(devices)],
            "displayTimeUnit": "ms", "baseTimeNanoseconds": base_ns, "traceName": "", "traceEvents": events}


def _api_events(records, stacks, us, api_names):
    """API calls, each with its Python stack as python_function events enclosing it (how Kineto nests)."""
    calls = [r for r in records if r[0] in ("runtime", "driver")]
    # The runtime makes driver calls of its own (cudaMemcpy -> cuMemcpy...): a driver call inside a
    # runtime call on the same thread is that runtime call, and would count every sync twice.
    runtime = {}
    for r in calls:
        if r[0] == "runtime":
            runtime.setdefault(r[4], []).append((r[1], r[2]))
    for spans in runtime.values():
        spans.sort()
    events, py_id = [], 0
    for what, t0, t1, pid, tid, corr, cbid in calls:
        if what == "driver" and _inside(runtime.get(tid, ()), t0, t1):
            continue
        domain = 2 if what == "runtime" else 1
        name = api_names.get(domain, {}).get(cbid, f"cbid {cbid}")
        events.append({"ph": "X", "cat": "cuda_" + what, "name": name, "pid": pid, "tid": tid, "ts": us(t0),
                       "dur": us(t1) - us(t0), "args": {"cbid": cbid, "correlation": corr}})
        frames = stacks.get(corr)
        if not frames:
            continue
        leaf = _callee_at(frames[0][0], frames[0][3])
        # Kineto's frame names carry the function's first line; the calling line is recovered from the
        # callee's name (trace/stacks.py). "line" keeps the exact one for readers that look.
        chain = [(f"{file}({first}): {func}", line) for file, first, func, line in reversed(frames)]
        if leaf:
            chain.append((f"<built-in method {leaf} of object>", None))
        parent = -1
        n = len(chain)
        for depth, (label, line) in enumerate(chain):
            pad_ns = n - depth  # each frame 1 ns outside the next, so they nest by time as Kineto's do
            py_id += 1
            args = {"Python id": py_id, "Python parent id": parent}
            if line is not None:
                args["line"] = line
            events.append({"ph": "X", "cat": "python_function", "name": label, "pid": pid, "tid": tid,
                           "ts": us(t0 - pad_ns), "dur": us(t1 + pad_ns) - us(t0 - pad_ns), "args": args})
            parent = py_id
    return events


def _inside(spans, t0, t1):
    i = bisect.bisect_right(spans, (t0, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= t0 and t1 <= spans[i][1]


@functools.lru_cache(maxsize=256)
def _callee_at(path, line):
    """The name of the outermost call on a source line (`cupy.cuda.Device().synchronize()` -> 'synchronize'):
    a frame of that name under the caller's lets trace/stacks.py recover the calling line, as it does
    for PyTorch's `<built-in method item ...>`. None when the source cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno == line]
    inner = {id(c) for n in calls for c in ast.walk(n) if c is not n and isinstance(c, ast.Call)}
    for n in calls:
        if id(n) not in inner:
            f = n.func
            return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return None


def _gbps(nbytes, ns):
    return round(nbytes / ns, 3) if ns > 0 else 0.0


def _occupancy(props, grid, block, regs, smem):
    """Kineto's 'blocks per SM', 'warps per SM' and 'est. achieved occupancy %', from the device's limits
    (theoretical blocks per SM by threads, registers and shared memory; no allocation granularity)."""
    if not props or not props.get("numSms"):
        return {}
    warp = props.get("warpSize") or 32
    threads = block[0] * block[1] * block[2]
    blocks = grid[0] * grid[1] * grid[2]
    if threads <= 0 or blocks <= 0:
        return {}
    warps_per_block = -(-threads // warp)
    max_warps = props["maxThreadsPerMultiprocessor"] // warp
    fit = [props.get("maxBlocksPerMultiprocessor") or 32, props["maxThreadsPerMultiprocessor"] // threads]
    if regs:
        fit.append(props["regsPerMultiprocessor"] // (regs * warps_per_block * warp))
    if smem:
        fit.append(props["sharedMemPerMultiprocessor"] // smem)
    resident_blocks = max(0, min(fit))
    blocks_per_sm = blocks / props["numSms"]
    warps = min(resident_blocks, blocks_per_sm) * warps_per_block
    return {"blocks per SM": round(blocks_per_sm, 2), "warps per SM": round(blocks_per_sm * warps_per_block, 2),
            "est. achieved occupancy %": round(min(100.0, 100.0 * warps / max_warps), 2) if max_warps else 0}
