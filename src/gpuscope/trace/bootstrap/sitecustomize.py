"""Traces a CUDA program from inside it, with no change to the program (`gpuscope trace -- CMD`).

`gpuscope trace` puts this file's directory first on PYTHONPATH, so every Python interpreter the
command starts imports it at start-up. Until the program imports `torch` (or, for the CUPTI backend,
cupy, numba.cuda, jax or cuda-python) it costs one finder on sys.meta_path that answers None for every
other module. When `torch` has been imported, a daemon thread waits for CUDA to be initialised, then
runs the PyTorch profiler (Kineto: CPU ops, CUDA kernels and copies, optionally Python stacks) for the
window(s) the parent asked for, and writes

    <dir>/<host>.<pid>[.rank<N>][.w<k>].pt.trace.json.gz   the Kineto trace, plus a top-level
                                                            "gpuscope" key (clock pair, host, pid, rank)
    <dir>/<host>.<pid>[.rank<N>].gpuscope.json              what happened in this process (status)

Why a helper thread can run the profiler: with `_ExperimentalConfig(profile_all_threads=True)`
Kineto registers its RecordFunction callbacks globally (`ProfilerConfig::pushGlobalCallbacks()` in
torch/csrc/profiler/orchestration/observer.cpp), so the main thread's ops are recorded too; without
that option (older torch) the callbacks are thread-local and only kernels and Python stacks of other
threads are seen, which the status file says. Start and stop happen on that one thread because a
thread-local profiler state can only be popped by the thread that pushed it.

On demand (`gpuscope trace --on-demand`, or GPUSCOPE_TRACE_ON_DEMAND=<request dir> with
GPUSCOPE_TRACE_DIR=<trace dir> set by hand) there is no window of its own: the thread registers the
process in the request directory, looks there once a second (one stat()) for a request addressed to
its pid or to all, and traces for as long as asked within its duty budget (../ondemand.py, loaded by
path, holds the protocol and the budget; GPUSCOPE_TRACE_MAX_DUTY, default 0.01).

Opted in with one variable (PYTHONPATH=<the agent's DATA_DIR>/bootstrap, in a pod spec or a Slurm script):
the agent publishes a copy of this file there (agent/autotrace.py says how and why), beside agent.json
and the two modules it loads by path (_gpuscope_trace/). Loaded from such a directory, with no
GPUSCOPE_TRACE_DIR set, it takes requests as --on-demand does, from ../trace-requests into ../traces
(its own directory's siblings), and names itself with the agent's host name (plus its PID namespace
when that is not the agent's: a container's pids are its own). Only if every one of those files and
directories is safe: owned by root or this user, writable by no one else (a world-writable
request or trace directory must be sticky, as /tmp is); else one line on stderr, the directory comes
off sys.path (nothing planted there can be imported) and the program runs untraced.

Backends (GPUSCOPE_TRACE_BACKEND=auto|torch|cupti, `gpuscope trace --backend`): in auto a program that
imports cupy, numba.cuda, jax or cuda-python, and not torch, is traced through CUPTI instead
(../cupti_backend.py, loaded by path; it needs NVIDIA's cupti-python in the program's environment):
the subscriber is taken at that import, so that the creation of the first CUDA context starts the
--delay clock, and the windows write the same Kineto-compatible files (GPU kernels, copies, memsets,
syncs, the runtime/driver calls the rules read with their Python stacks; every API call only with
GPUSCOPE_TRACE_API=all). torch keeps the PyTorch profiler; a torch imported after CUPTI started is not
profiled (one CUPTI subscriber per process), which the status file says. With cupti-python missing,
or CUPTI held by another profiler, one line goes to stderr, the status file says why, and the program
runs on untraced; a program that never creates a CUDA context writes a status of "no_cuda".

Quiet: what the profiler's C++ writes to fd 2 never reaches the program's stderr. Kineto prints
"ERROR: External init callback must run in same thread as registerClient" at its first start on any
thread but the one that loaded torch (libkineto's LibkinetoApi::initClientIfRegistered: PyTorch
registers its client while torch loads, and the profiler thread here is another thread; PyTorch's
client has nothing to initialise, so the message is harmless), and Kineto and CUPTI log warnings the
same way. So while the profiler starts, stops and exports, fd 2 goes through a pipe: the lines in the
profiler's formats go to <stem>.profiler.log (the status file names it; `gpuscope trace --verbose`
shows it), every other byte to the program's stderr, in order: the program's own output is never held
back or hidden, even when its threads write meanwhile.

It must never break the program: every failure is swallowed (one line on stderr when the profiler
cannot start, such as when another profiler holds CUPTI), nothing is printed to stdout, and the
program's own sitecustomize (next on sys.path) still runs. Only the standard library is used: the
traced interpreter need not have gpuscope installed.
"""

import atexit
import fcntl
import gzip
import importlib.machinery
import importlib.util
import json
import os
import re
import select
import shutil
import signal
import socket
import stat
import sys
import tempfile
import termios
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ENV = "GPUSCOPE_TRACE_DIR"
_EXIT_WAIT_S = 300.0  # an exporting trace of a long window can take minutes; never hang the exit longer


def _number(name, default):
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return float(default)


# Lines the profiler's own C++ writes to fd 2: Kineto's fprintf about its client's thread, Kineto's log
# lines ("WARNING:2026-11-29 12:00:00 123:456 CuptiActivityApi.cpp:89] ..."), c10's warnings from the
# profiler's files ("[W1129 12:00:00.123 kineto_shim.cpp:339] ..."), CUPTI's error names, and a Python
# warning raised inside torch.profiler (its next, indented line is the source line it quotes).
_PROFILER_LINE = re.compile(
    rb"^(ERROR: External init callback must run in same thread as registerClient"
    rb"|(INFO|WARNING|ERROR|STAGE|VERBOSE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\]"
    rb"|\[[WEIF][^\]]*?[ /](\w*(kineto|profil|cupti|activity|collection|observer)\w*)\.(cpp|h|cc):\d+\]"
    rb"|.*\bCUPTI_ERROR_\w+|.*\blibkineto\b"
    rb"|\S*/torch/(autograd/)?profiler[\w/]*\.py:\d+: \w*Warning: )", re.IGNORECASE)
_PROFILER_WARNING = re.compile(rb"^\S*/torch/(autograd/)?profiler[\w/]*\.py:\d+: \w*Warning: ")
_IDLE_S = 0.05  # a partial line (a progress bar) waits no longer than this before it is passed on
_DRAIN_S = 1.0  # how long the end of a capture waits for the pump to pass on what the pipe holds


class _Capture:
    """fd 2 through a pipe for the duration of a `with`: the profiler's lines into a log, the rest on.

    The pump thread reads until every copy of the pipe's write end is closed (a child started meanwhile
    keeps its copy, and its output keeps flowing through to the real stderr). A fork inside the window
    gets the real fd 2 back (`after_fork_in_child`). Any failure leaves fd 2 as it was."""

    active = None  # the capture in force, for a child forked meanwhile

    def __init__(self, log_path, logged):
        self.log_path, self.logged = log_path, logged  # logged(path, lines) once the window's lines are in
        self.saved = self.out = self.peek = None
        self.pump = None
        self.lines = 0
        self.idle = False  # the pump waits with nothing read and not passed on

    def __enter__(self):
        try:
            _flush_stderr()
            r, w = os.pipe()
        except Exception:
            return self
        try:
            try:
                fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: room for a burst while the pump waits for the GIL
            except OSError:
                pass
            self.saved, self.out, self.peek = os.dup(2), os.dup(2), os.dup(r)
            self.pump = threading.Thread(target=self._pump, args=(r,), name="gpuscope-trace-stderr", daemon=True)
            self.pump.start()  # from here the pump owns r and self.out
            os.dup2(w, 2)
            _Capture.active = self
        except Exception:
            for fd in ((r, self.out) if self.pump is None else ()) + (self.saved, self.peek):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self.saved = self.peek = None
        finally:
            os.close(w)  # fd 2 holds the write end now; without the dup2, the pump sees EOF and ends
        return self

    def __exit__(self, *exc):
        if self.saved is None:
            return False
        try:
            _flush_stderr()
            self._drain()
            os.dup2(self.saved, 2)  # the last write end of the program's own goes: the pump sees EOF
        finally:
            _Capture.active = None
            os.close(self.saved)
            self.saved = None
            if self.peek is not None:
                os.close(self.peek)
                self.peek = None
            self.pump.join(2.0)
            if self.lines:
                self.logged(self.log_path, self.lines)
        return False

    def _drain(self):
        """Wait (at most _DRAIN_S) until the pump has passed on all the pipe holds, so that the program's lines
        written before fd 2 is restored come out before those it writes after (a loaded machine can keep the
        pump from running for a while): the program's stderr stays in order."""
        deadline = time.monotonic() + _DRAIN_S
        buf = bytearray(4)
        while time.monotonic() < deadline and self.pump is not None and self.pump.is_alive():
            try:
                fcntl.ioctl(self.peek, termios.FIONREAD, buf)
            except OSError:
                return
            if self.idle and int.from_bytes(buf, sys.byteorder) == 0:
                return
            time.sleep(0.0005)

    def _pump(self, r):
        pending, log, quoted = b"", None, False
        try:
            while True:
                self.idle = not pending
                ready, _, _ = select.select([r], [], [], _IDLE_S if pending else None)
                self.idle = False
                if not ready:  # a partial line, and nothing more for a while: it is the program's
                    self._send(pending)
                    pending = b""
                    continue
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    line += b"\n"
                    if _PROFILER_LINE.match(line) or (quoted and line[:1] in (b" ", b"\t")):
                        quoted = bool(_PROFILER_WARNING.match(line))
                        if log is None:
                            log = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                                          0o644)
                        os.write(log, line)
                        self.lines += 1
                    else:
                        quoted = False
                        self._send(line)
            self._send(pending)
        except Exception:
            pass
        finally:
            for fd in (r, self.out, log):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass

    def _send(self, data):
        while data:
            try:
                data = data[os.write(self.out, data):]
            except InterruptedError:
                continue
            except OSError:  # the program's stderr is gone: nothing to keep
                return

    @staticmethod
    def after_fork_in_child():
        capture = _Capture.active
        _Capture.active = None
        if capture is not None and capture.saved is not None:
            try:
                os.dup2(capture.saved, 2)
            except OSError:
                pass


def _flush_stderr():
    try:
        sys.stderr.flush()
    except Exception:
        pass


class _Tracer:
    """The per-process state: windows, the profiler thread, the exit flush."""

    def __init__(self, out_dir, requests_dir=None, protocol_host=None, pid_ns=None):
        self.out_dir = out_dir
        self.protocol_host = protocol_host  # the name requests address this process by (default: the host name)
        self.pid_ns = pid_ns
        self.delay_s = _number("GPUSCOPE_TRACE_DELAY_S", 5)
        self.duration_s = _number("GPUSCOPE_TRACE_DURATION_S", 10)
        self.every_s = _number("GPUSCOPE_TRACE_EVERY_S", 0)
        self.with_stack = os.environ.get("GPUSCOPE_TRACE_STACK", "1") == "1"
        self.requests_dir = requests_dir or os.environ.get("GPUSCOPE_TRACE_ON_DEMAND", "")
        self.backend_mode = os.environ.get("GPUSCOPE_TRACE_BACKEND", "auto")
        self.api_all = os.environ.get("GPUSCOPE_TRACE_API", "rules") == "all"
        self.backend = None  # "torch" or "cupti" once one has started
        self.session = None  # the CUPTI backend's Session
        self.trigger = None  # the import that started the CUPTI backend
        self.pid = os.getpid()
        self.exiting = threading.Event()
        self.done = threading.Event()
        self.status = {}
        self.thread = None

    # -- names ------------------------------------------------------------------------------------
    def _rank(self):
        for var in ("RANK", "LOCAL_RANK"):
            value = os.environ.get(var, "")
            if value.isdigit():
                return int(value)
        return None

    def _stem(self):
        rank = self._rank()
        tag = "" if rank is None else f".rank{rank}"
        return os.path.join(self.out_dir, f"{socket.gethostname()}.{self.pid}{tag}")

    def _write_status(self, **fields):
        self.status.update(fields)
        path = self._stem() + ".gpuscope.json"
        # A fresh file of a random name (O_EXCL, no symlink followed): the trace directory may be
        # shared, and a link planted at a predictable name would make this program write through it.
        fd, tmp = tempfile.mkstemp(dir=self.out_dir, prefix=".tmp-", suffix=".json")
        try:
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump(self.status, f)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    # -- which backend -------------------------------------------------------------------------------
    def watched(self):
        """The module names whose import may start tracing, for this backend mode."""
        if self.backend_mode == "torch":
            return ("torch",)
        return ("torch",) + _CUPTI_TRIGGERS

    def on_imported(self, name):
        if name == "torch" and self.backend_mode != "cupti":
            if self.backend == "cupti":
                self.status["torch_after_cupti"] = (
                    "torch was imported after CUPTI tracing started: the PyTorch profiler cannot run in this "
                    "process (one CUPTI subscriber per process), so torch's CPU ops are not traced")
                if "run" in self.status:  # else the status written when CUDA starts carries it
                    self._write_status()
                return
            if self.backend is None:
                self.on_torch_imported()
            return
        if self.backend is not None or (self.backend_mode == "auto" and "torch" in sys.modules):
            return  # torch keeps the PyTorch profiler
        self._start_cupti(name)

    def _base_status(self):
        return {"run": os.environ.get("GPUSCOPE_TRACE_RUN"), "host": socket.gethostname(), "pid": self.pid,
                "rank": self._rank(), "argv": _redacted(sys.argv), "traces": []}

    def _start_cupti(self, trigger):
        self.backend = "cupti"
        try:
            module = _load_private("cupti_backend.py", "_gpuscope_trace_cupti")
            if self.api_all:
                sys.stderr.write("gpuscope trace: GPUSCOPE_TRACE_API=all records every CUDA runtime and driver "
                                 "call through cupti-python (tens of µs of Python each): a launch-bound program "
                                 "runs several times slower while a window is open.\n")
            self.session = module.Session(api_all=self.api_all, with_stack=self.with_stack)
        except Exception as e:
            status = getattr(e, "status", "cupti_failed")
            self.status = dict(self._base_status(), backend="cupti", trigger=trigger)
            try:
                self._write_status(status=status, error=str(e) or type(e).__name__)
            except Exception:
                pass
            sys.stderr.write(f"gpuscope trace: CUPTI tracing could not start in process {self.pid} ({e}); "
                             "not tracing it, the program goes on.\n")
            sys.stderr.flush()
            return
        self.trigger = trigger
        self._start_thread()

    # -- the profiler thread -------------------------------------------------------------------------
    def on_torch_imported(self):
        if self.thread is not None:
            return
        self.backend = "torch"
        # The profiler's start imports torch packages that torch itself loads lazily (torch._dynamo,
        # torch._inductor). Imported by the profiler thread while the program's thread imports them too
        # (an optimizer's first step does), they deadlock or come out half-initialised: seen on the H200
        # as "_DeadlockError: deadlock detected by _ModuleLock('torch._dynamo')". So they are imported
        # here, on the thread that imported torch, before the profiler thread exists.
        for name in ("torch.profiler", "torch._dynamo"):
            try:
                __import__(name)
            except Exception:
                pass
        self._start_thread()

    def _start_thread(self):
        self.thread = threading.Thread(target=self._guarded, name="gpuscope-trace", daemon=True)
        self.thread.start()
        atexit.register(self.flush)
        if threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                    signal.signal(signal.SIGTERM, self._on_sigterm)
            except (ValueError, OSError):
                pass

    def _guarded(self):
        try:
            self._run()
        except BaseException as e:  # never into the program; say it in the status file
            try:
                self._write_status(status="failed", error=f"{type(e).__name__}: {e}")
            except Exception:
                pass
        finally:
            self.done.set()

    def _run(self):
        if self.backend == "cupti":
            while not self.session.cuda_seen.wait(0.05):  # the window's clock starts at the context
                if self.exiting.is_set():
                    self.status = dict(self._base_status(), backend="cupti", trigger=self.trigger)
                    self._write_status(status="no_cuda")  # it imported a CUDA library but never created a context
                    return
            versions = {"backend": "cupti", "trigger": self.trigger, "api": "all" if self.api_all else "rules"}
        else:
            import torch

            while not torch.cuda.is_initialized():
                if self.exiting.wait(0.1):
                    return  # never used CUDA (a DataLoader worker, a CPU-only run): nothing to write
            versions = {"backend": "torch", "torch": getattr(torch, "__version__", "?")}
        cuda_at = time.monotonic()
        self.status = dict(self._base_status(), **versions, cuda_initialised_unix_ns=time.time_ns(),
                           **{k: v for k, v in self.status.items() if k == "torch_after_cupti"})
        self._write_status(status="on_demand" if self.requests_dir else "waiting")
        if self.requests_dir:
            return self._on_demand()
        # Repeated windows keep to the same hard budget as windows on demand: each window is charged its
        # whole measured cost, and the next starts no sooner than the budget allows, even when --every
        # asks for more (the status says when it did).
        budget = _ondemand().Budget(_number("GPUSCOPE_TRACE_MAX_DUTY", _ondemand().DEFAULT_MAX_DUTY))
        window, start_at = 0, cuda_at + self.delay_s
        while True:
            if self.exiting.wait(max(0.0, start_at - time.monotonic())):
                if not self.status["traces"]:
                    self._write_status(status="exited_before_window")
                return
            began = time.monotonic()
            # Stamped before the profiler starts: its first records (CUPTI enables one kind after another,
            # the program running meanwhile) are then never before the window's stated start.
            started = {"unix_ns": time.time_ns(), "monotonic_ns": time.monotonic_ns()}
            prof, all_threads, error = self._start()
            opened = time.monotonic()
            if prof is None:
                what = "CUPTI tracing" if self.backend == "cupti" else "the PyTorch profiler"
                sys.stderr.write(f"gpuscope trace: {what} could not start in process {self.pid} "
                                 f"({error}); not tracing it, the program goes on.\n")
                sys.stderr.flush()
                self._write_status(status="profiler_failed", error=error)
                return
            self.exiting.wait(self.duration_s)
            try:
                self._stop_and_write(prof, window, started, all_threads, phases={"start": opened - began})
            finally:
                cost_s = time.monotonic() - began
                budget.spend(began, cost_s, duration_s=self.duration_s)
            self._charge(cost_s, budget)
            if self.every_s <= 0 or self.exiting.is_set():
                return
            window += 1
            start_at = max(began + self.every_s, budget.next_allowed)
            if start_at > began + self.every_s + 0.5:
                note = (f"windows are {start_at - began:.0f} s apart, not the {self.every_s:g} s asked: each cost "
                        f"{cost_s:.1f} s (start, window, stop, export) and the budget is {budget.max_duty * 100:g} % "
                        f"of wall time (GPUSCOPE_TRACE_MAX_DUTY)")
                if "budget_note" not in self.status:  # said once on stderr; the status file keeps the latest
                    try:  # a closed or broken stderr must not end the windows
                        sys.stderr.write(f"gpuscope trace: process {self.pid}: {note}.\n")
                        sys.stderr.flush()
                    except Exception:
                        pass
                self._write_status(budget_note=note)

    def _charge(self, cost_s, budget):
        """Note the last window's measured cost in its status entry."""
        if self.status.get("traces"):
            self.status["traces"][-1].update(cost_s=round(cost_s, 3), max_duty=budget.max_duty)
            self._write_status()

    def _on_demand(self):
        od = _ondemand()
        host, since = self.protocol_host or socket.gethostname(), time.time()
        budget = od.Budget(_number("GPUSCOPE_TRACE_MAX_DUTY", od.DEFAULT_MAX_DUTY))
        watcher = od.Watcher(self.requests_dir)
        me = {"host": host, "pid": self.pid, "rank": self._rank(), "since_unix": since,
              "trace_dir": self.out_dir, "max_duty": budget.max_duty, "next_allowed_unix": None,
              "pid_ns": self.pid_ns, "horizon_s": budget.horizon_s, "spent_s": 0.0, "windows": []}
        od.register(self.requests_dir, me)
        try:
            while not self.exiting.wait(1.0):
                if not watcher.changed():
                    continue
                for req in od.pending_for(self.requests_dir, self.pid, host, since):
                    try:
                        self._answer(od, req, budget, host)
                    except Exception as e:  # this request failed; the next one may not
                        od.mark_done(self.requests_dir, req["id"], host, self.pid, status="failed",
                                     reason=f"{type(e).__name__}: {e}", duration_s=req["duration_s"])
                    # what this process spent, in its own words: the agent reads it to stop asking
                    od.register(self.requests_dir, dict(me, next_allowed_unix=budget.next_allowed_unix(),
                                                        spent_s=round(budget.spent_s(), 3),
                                                        windows=budget.windows_unix()))
                    if self.exiting.is_set():
                        return
        finally:
            od.unregister(self.requests_dir, host, self.pid)

    def _answer(self, od, req, budget, host):
        """One request: refused (and why), or traced and written, with its answer beside it."""
        answer = {"duration_s": req["duration_s"], "rank": self._rank()}
        if isinstance(req.get("trigger"), str):  # why the agent asked (its own windows), for the listing
            answer["trigger"] = req["trigger"][:200]
        if req.get("start_unix") is not None:
            answer["start_unix"] = req["start_unix"]
        if "trigger" in answer:
            # the agent's own window: its estimated cost must fit the budget's 10 minutes on its own
            # (shortened where a shorter one does); a window asked by hand may instead stand alone
            duration, why = budget.fit(req["duration_s"])
            if not why and duration < req["duration_s"]:
                answer.update(asked_duration_s=req["duration_s"], duration_s=duration)
                req = dict(req, duration_s=duration)
        else:
            why = budget.refuse(req["duration_s"])
        if why:
            od.mark_done(self.requests_dir, req["id"], host, self.pid, status="refused", reason=why, **answer)
            return
        # Every rank of a job asked for the same moment (gpuscope trace fleet): wait for it on this host's wall
        # clock; the wait itself runs on the monotonic clock, which a slewed or stepped wall clock may leave
        # behind, so until the wall clock reads it
        while (delay := od.start_delay_s(req)) > 0:
            if self.exiting.wait(delay):
                od.mark_done(self.requests_dir, req["id"], host, self.pid, status="refused",
                             reason="the process exited before the window's start", **answer)
                return
        began = time.monotonic()
        started = {"unix_ns": time.time_ns(), "monotonic_ns": time.monotonic_ns()}  # before it starts: see _run
        prof, all_threads, error = self._start()
        if prof is None:
            od.mark_done(self.requests_dir, req["id"], host, self.pid, status="profiler_failed", reason=error, **answer)
            return
        opened = time.monotonic()
        self.exiting.wait(req["duration_s"])
        try:
            meta = self._stop_and_write(prof, 0, started, all_threads, suffix="." + req["id"],
                                        phases={"start": opened - began})
        finally:  # charged its whole measured cost, also when the export failed
            cost_s = time.monotonic() - began
            budget.spend(began, cost_s, duration_s=req["duration_s"])
        self._charge(cost_s, budget)
        answer["cost_s"] = round(cost_s, 3)
        answer["cost_phases_s"] = meta.get("cost_phases_s")
        kept = ("file", "profiler_start_unix_ns", "profiler_stop_unix_ns", "cpu_ops_all_threads", "with_stack",
                "raw_bytes")
        od.mark_done(self.requests_dir, req["id"], host, self.pid, status="written", reason="",
                     cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                     **answer, **{k: meta[k] for k in kept})

    def _start(self):
        if self.backend == "cupti":
            window = self.session.window()
            try:
                with self._quiet():
                    window.start()
            except Exception as e:  # CUPTI taken meanwhile, a CUPTI error
                return None, False, f"{type(e).__name__}: {e}"
            return window, True, ""
        from torch.profiler import ProfilerActivity, profile

        kwargs = {"activities": [ProfilerActivity.CPU, ProfilerActivity.CUDA],
                  "with_stack": self.with_stack, "record_shapes": False}
        all_threads = False
        try:
            from torch.profiler import _ExperimentalConfig

            kwargs["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
            all_threads = True
        except (ImportError, TypeError):
            pass
        try:
            with self._quiet():  # Kineto's first start prints about its client's thread, among others
                prof = profile(**kwargs)
                prof.start()
        except Exception as e:  # CUPTI held by another profiler, a profiler the program runs itself, ...
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return None, False, f"{type(e).__name__}: {first}"
        return prof, all_threads, ""

    def _quiet(self):
        """fd 2 into this process's profiler log while the profiler runs C++ that may print."""
        return _Capture(self._stem() + ".profiler.log", self._logged)

    def _logged(self, path, lines):
        self.status["profiler_log"] = os.path.basename(path)
        self.status["profiler_log_lines"] = self.status.get("profiler_log_lines", 0) + lines

    def _stop_and_write(self, prof, window, started, all_threads, suffix=None, phases=None):
        """Stop the window, export, compress and publish it; its status entry says what each phase took
        (cost_phases_s: start, window, stop, export, compress), so a costly window tells where it went."""
        stopped_ns = time.time_ns()
        phases = dict(phases or {})
        t = time.monotonic()
        phases["window"] = (time.monotonic_ns() - started["monotonic_ns"]) / 1e9 - phases.get("start", 0.0)
        with self._quiet():
            prof.stop()
        phases["stop"], t = time.monotonic() - t, time.monotonic()
        if suffix is None:
            suffix = f".w{window}" if self.every_s > 0 else ""
        path = self._stem() + suffix + ".pt.trace.json.gz"
        # The raw export and the compressed copy go to a directory only this user can enter (a shared
        # trace directory must not let anyone plant a link where they are written), then one rename.
        private = tempfile.mkdtemp(dir=self.out_dir, prefix=".tmp-")
        raw = os.path.join(private, "raw.pt.trace.json")
        packed = os.path.join(private, "packed.pt.trace.json.gz")
        meta = {"host": socket.gethostname(), "pid": self.pid, "rank": self._rank(), "window": window,
                "profiler_start_unix_ns": started["unix_ns"], "profiler_start_monotonic_ns": started["monotonic_ns"],
                "profiler_stop_unix_ns": stopped_ns, "cpu_ops_all_threads": all_threads,
                "with_stack": self.with_stack, "backend": self.backend}
        try:
            with self._quiet():
                prof.export_chrome_trace(raw)
            if self.backend == "cupti":  # how its launchers were recorded (sampled: how many)
                try:
                    meta.update(prof.summary())
                except Exception:
                    pass
            phases["export"], t = time.monotonic() - t, time.monotonic()
            meta["raw_bytes"] = os.path.getsize(raw)
            _gzip_with_key(raw, packed, "gpuscope", meta)
            phases["compress"] = time.monotonic() - t
            os.chmod(packed, 0o644)
            os.replace(packed, path)
        finally:
            shutil.rmtree(private, ignore_errors=True)
        self.status["traces"].append(dict(meta, file=os.path.basename(path),
                                          cost_phases_s={k: round(v, 3) for k, v in phases.items()}))
        self._write_status(status="written")
        return self.status["traces"][-1]

    # -- exit ------------------------------------------------------------------------------------------
    def flush(self):
        """At exit (or SIGTERM): end the window early and wait for its file."""
        if os.getpid() != self.pid or self.thread is None:
            return  # a forked child inherited the handler, not the thread
        self.exiting.set()
        self.done.wait(_EXIT_WAIT_S)

    def _on_sigterm(self, signum, _frame):
        try:
            self.flush()
        finally:
            # Die of the signal as the program would have, so the exit status still says SIGTERM.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def after_fork_in_child(self):
        self.pid = os.getpid()
        self.thread = None  # threads do not survive fork; the child traces only if it imports torch itself


# Flags whose value is a secret (--api-key, --hf-token, --password, ...): the status file is readable by
# whoever reads the trace directory, so a program's credentials must not be copied into it.
_SECRET_FLAG = re.compile(r"--?([\w-]*[-_])?(api-?key|key|token|secret|password|passwd|pwd|auth|authorization"
                          r"|credentials?|cookie)$", re.IGNORECASE)
_SECRET_TEXT = re.compile(r"(?i)\b(bearer|basic|token)\s+\S+|^(authorization|x-api-key|api-key|cookie)\s*:.*")
_URL_PASSWORD = re.compile(r"(\w[\w+.-]*://[^/\s:@]*:)[^/\s@]+@")


def _redacted(argv):
    """The command line with secret values replaced by ***."""
    out, hide_next = [], False
    for arg in argv:
        arg = str(arg)
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if _SECRET_FLAG.fullmatch(flag):
            if eq:
                out.append(flag + "=***")
            else:
                out.append(arg)
                hide_next = True
            continue
        if _SECRET_TEXT.search(arg):
            out.append("***")
            continue
        out.append(_URL_PASSWORD.sub(r"\1***@", arg))
    return out


def _ondemand():
    return _load_private("ondemand.py", "_gpuscope_trace_ondemand")


def _load_private(filename, name):
    """A module of gpuscope/trace by its path, as a private module: importing gpuscope here would run the
    package's __init__ (numpy and more) inside the traced program, which may not even have it."""
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(_PRIVATE_DIR, filename)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


# Kept equal to cupti_backend.TRIGGERS (tests check): that module is loaded only when one is imported.
_CUPTI_TRIGGERS = ("cupy", "numba.cuda", "numba_cuda", "jax", "cuda.bindings", "cuda.cudart", "cuda.core")


def _gzip_with_key(src, dst, key, value):
    """Compress Kineto's JSON object into dst with `"key": value` added before its closing brace,
    streaming, so a trace of hundreds of MB is never held in memory."""
    size = os.path.getsize(src)
    with open(src, "rb") as f:
        f.seek(max(0, size - 4096))
        tail = f.read()
    end = size - len(tail) + tail.rindex(b"}")
    with open(src, "rb") as f, gzip.open(dst, "wb", compresslevel=3) as out:
        left = end
        while left > 0:
            chunk = f.read(min(left, 1 << 22))
            if not chunk:
                break
            out.write(chunk)
            left -= len(chunk)
        out.write(f',\n  "{key}": {json.dumps(value)}\n}}\n'.encode())


class _Loader:
    """Wraps a watched module's own loader for its one exec, then steps out of the way."""

    def __init__(self, loader, tracer, name):
        self._loader = loader
        self._tracer = tracer
        self._name = name

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        finally:
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
        try:
            self._tracer.on_imported(self._name)
        except Exception:
            pass


class _Finder:
    """On sys.meta_path until every watched module (torch, the CUPTI triggers) has been imported once;
    answers None for everything else."""

    def __init__(self, tracer, names):
        self._tracer = tracer
        self._names = set(names)

    def find_spec(self, name, path=None, target=None):
        if name not in self._names:
            return None
        self._names.discard(name)  # also keeps the find_spec below from coming back here
        if not self._names:
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
        try:
            spec = importlib.util.find_spec(name)
        except Exception:
            return None
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, self._tracer, name)
        return spec

    def invalidate_caches(self):
        pass


# Beside this file in a directory the agent published (agent/autotrace.py): the modules it loads by path
# live in _gpuscope_trace/ there; in the package, one directory up (gpuscope/trace/).
_PUBLISHED = os.path.isfile(os.path.join(_HERE, "agent.json"))
_PRIVATE_DIR = os.path.join(_HERE, "_gpuscope_trace") if _PUBLISHED else os.path.dirname(_HERE)
_INSTALLED = "_gpuscope_trace_installed"  # in sys.modules once one copy of this bootstrap took the process


def _unsafe(path, directory, trusted):
    """Why `path` could let someone else put code or requests in this program, or "" when it cannot."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path} cannot be read ({e.strerror})"
    if stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode) != directory or not (directory or stat.S_ISREG(st.st_mode)):
        return f"{path} is not a plain {'directory' if directory else 'file'}"
    if st.st_uid not in trusted:
        return f"{path} belongs to uid {st.st_uid}, neither root nor this user"
    if st.st_mode & 0o022 and not (directory and st.st_mode & stat.S_ISVTX and st.st_mode & 0o002):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def _published():
    """(requests dir, traces dir, protocol host, pid namespace) for a bootstrap the agent published, None
    when this is not one; raises ValueError with why when it is one that is not safe to use."""
    if not _PUBLISHED:
        return None
    trusted = {0, os.getuid()}
    base = os.path.dirname(_HERE)
    requests_dir, traces_dir = os.path.join(base, "trace-requests"), os.path.join(base, "traces")
    files = [os.path.join(_HERE, n) for n in ("sitecustomize.py", "agent.json")]
    files += [os.path.join(_PRIVATE_DIR, n) for n in ("ondemand.py", "cupti_backend.py")]
    for path, directory in [(_HERE, True), (_PRIVATE_DIR, True)] + [(f, False) for f in files]:
        why = _unsafe(path, directory, trusted)
        if why:
            raise ValueError(why)
    for path in (requests_dir, traces_dir):  # shared with other users' programs: sticky when world-writable
        try:
            st = os.lstat(path)
        except OSError as e:
            raise ValueError(f"{path} cannot be read ({e.strerror})") from None
        if not stat.S_ISDIR(st.st_mode) or (st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX) \
                or (st.st_uid not in trusted and st.st_mode & 0o020):
            raise ValueError(f"{path} is not a directory only its owner can change (sticky when world-writable)")
    with open(os.path.join(_HERE, "agent.json")) as f:
        agent = json.loads(f.read(1 << 16))
    host = agent.get("host") if isinstance(agent, dict) else None
    if not isinstance(host, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}", host):
        raise ValueError(f"{os.path.join(_HERE, 'agent.json')} names no host")
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = None
    if pid_ns is not None and pid_ns != agent.get("pid_ns"):
        host = f"{host}+pidns{pid_ns}"  # the agent maps this namespace's pids to its own (autotrace.py)
    return requests_dir, traces_dir, host, pid_ns


def _install():
    if _INSTALLED in sys.modules:  # `gpuscope trace` put its own copy first, and it chained to this one
        return
    out_dir = os.environ.get(_ENV)
    requests_dir = host = pid_ns = None
    if not out_dir:
        try:
            found = _published()
        except Exception as e:  # noqa: BLE001 - unsafe or unreadable: never trace, never import from here
            sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
            sys.stderr.write(f"gpuscope: not profiling process {os.getpid()}: {e}; the program goes on.\n")
            sys.stderr.flush()
            return
        if found is None:
            return
        requests_dir, out_dir, host, pid_ns = found
    sys.modules[_INSTALLED] = sys  # any module object: a marker
    tracer = _Tracer(out_dir, requests_dir=requests_dir, protocol_host=host, pid_ns=pid_ns)
    names = tracer.watched()
    for name in names:
        if name in sys.modules:
            tracer.on_imported(name)
    sys.meta_path.insert(0, _Finder(tracer, [n for n in names if n not in sys.modules]))
    os.register_at_fork(after_in_child=tracer.after_fork_in_child)
    os.register_at_fork(after_in_child=_Capture.after_fork_in_child)


def _chain_user_sitecustomize():
    """Run the sitecustomize this one shadows, as Python would have without us."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)  # its errors are reported by site.py, as without gpuscope


try:
    _install()
except Exception:
    pass
_chain_user_sitecustomize()
