"""The training-loop monitor: mark steps, learn how busy the GPU really was during them.

    import gpuscope
    with gpuscope.monitor(log="steps.jsonl") as m:      # simulate="healthy" without a GPU
        for batch in loader:
            train_step(batch)
            m.step(samples=len(batch))
    print(m.report())

`m.step()` only appends a clock stamp to a queue; a background thread joins each step with the GPU
series of its time (SM activity, tensor and DRAM activity, NVML utilization, power, memory), writes the
step log and keeps the run's figures. Nothing here raises into the training loop once it runs: an
internal failure is logged once and the monitor goes on with less (steps are always timed). Mistakes
in the arguments (a log path that cannot be written, Parquet without pyarrow, a bad interval or
scenario) raise `MonitorError` at `monitor()` time, before training starts.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from numbers import Integral
from typing import Any

from ..errors import UsageError
from ._joiner import Joiner, SamplerSource
from ._report import StepReport
from ._steplog import LogError, StepLog, open_log

log = logging.getLogger("gpuscope.monitor")

_now = time.monotonic_ns


class MonitorError(UsageError, ValueError):
    """A monitor() argument cannot work. The message is one sentence."""


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check_devices(devices: Any) -> tuple[str, ...] | str | None:
    """None, "all", or the GPUs as labels or UUIDs (one index or UUID alone is a list of one)."""
    if devices is None or (isinstance(devices, str) and devices == "all"):
        return devices
    items = [devices] if isinstance(devices, str | Integral) else devices
    try:
        items = list(items)
    except TypeError:
        items = []
    if not items or not all(isinstance(d, str | Integral) and not isinstance(d, bool) for d in items):
        raise MonitorError(f"devices must be GPU indices or UUIDs, 'all' or None, got {devices!r}.")
    return tuple(str(d) for d in items)


# -- one sampler per process --------------------------------------------------------------------
# Two GPM readers on one GPU disturb each other, so monitors in one process share a sampler.
_shared_lock = threading.Lock()
_shared: dict[tuple[Any, ...], list[Any]] = {}  # key -> [sampler, users]


def _acquire(key: tuple[Any, ...], make: Any) -> Any:
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None:
            sampler = make()
            sampler.start()
            entry = _shared[key] = [sampler, 0]
        entry[1] += 1
        return entry[0]


def _release(key: tuple[Any, ...]) -> None:
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _shared[key]
            entry[0].stop()


_live: weakref.WeakSet[Monitor] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The threads did not come along; NVML must not be used from the child. The child's copy of a
    # monitor goes quiet: step() is a no-op, stop() has nothing to join.
    global _shared_lock
    _shared_lock = threading.Lock()  # another thread may have held it at the fork
    _shared.clear()
    for m in list(_live):
        m._active = False
        m._forked = True
        m._lock = threading.Lock()


def _stop_all_at_exit() -> None:
    for m in list(_live):
        m.stop(timeout=1.0)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_stop_all_at_exit)


class Monitor:
    """See `monitor()`. Use as a context manager, or start() ... stop()."""

    def __init__(self, *, interval: float = 0.1, log: str | os.PathLike[str] | None = None,
                 simulate: str | None = None, gpus: int | None = None, devices: Sequence[int | str] | str | None = None,
                 sampler: Any = None, warmup_steps: int = 1, slow_factor: float = 1.5,
                 print_report: bool = False, flush_interval: float = 1.0) -> None:
        if not _is_number(interval):
            raise MonitorError(f"interval must be a number of seconds, got {interval!r}.")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise MonitorError(f"warmup_steps must be a whole number, 0 or more, got {warmup_steps!r}.")
        if not (_is_number(slow_factor) and slow_factor > 1.0):
            raise MonitorError(f"slow_factor must be a number above 1, got {slow_factor!r}.")
        if not (_is_number(flush_interval) and 0.01 <= flush_interval <= 60):
            raise MonitorError(f"flush_interval must be between 0.01 and 60 seconds, got {flush_interval!r}.")
        if simulate is not None and not isinstance(simulate, str):
            raise MonitorError(f"simulate must be a scenario name, got {simulate!r}.")
        if gpus is not None:
            if simulate is None:
                raise MonitorError("gpus is the GPU count of a simulated node; pass simulate='SCENARIO' with it "
                                   "(devices picks GPUs).")
            if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= 64:
                raise MonitorError(f"gpus must be between 1 and 64, got {gpus!r}.")
        devices = _check_devices(devices)
        self._queue: deque[Any] = deque()
        self._active = False
        self._forked = False
        self._stopped = False
        self._lock = threading.Lock()
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors: set[str] = set()
        self._notes: list[str] = []
        self._joiner: Joiner | None = None
        self._report: StepReport | None = None
        self.cpu_seconds = 0.0  # the monitor thread's CPU (join, log, verdicts)
        self.stop_cpu_seconds = 0.0  # CPU of the last join at stop(), on the caller's thread
        self.teardown_cpu_seconds = 0.0  # CPU of stopping the sampler at stop(), once per run
        self.devices = devices
        self.warmup_steps = warmup_steps
        self.slow_factor = slow_factor
        self.print_report = print_report
        self.flush_interval = flush_interval
        self._sampler = sampler
        self._shared_key: tuple[Any, ...] | None = None
        self._make_sampler = None
        if sampler is None:
            from ..sampler import ConfigError, Sampler, SamplerConfig

            try:
                cfg = SamplerConfig.for_interval(interval, collect_host=False)
                cfg.validate()
            except (ConfigError, TypeError) as e:
                raise MonitorError(str(e)) from None
            if simulate is not None:
                from ..sim import SCENARIOS, UnknownScenario

                if simulate.replace("-", "_") not in SCENARIOS:
                    raise MonitorError(str(UnknownScenario(
                        f"Unknown scenario {simulate!r}; choose one of: {', '.join(SCENARIOS)}.")))
            self._shared_key = (simulate, gpus, interval)
            self._make_sampler = lambda: Sampler(cfg, simulate=simulate, gpus=gpus)
        self._log: StepLog | None = None
        if log is not None:
            try:
                self._log = open_log(log)
            except LogError as e:
                raise MonitorError(str(e)) from None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> Monitor:
        """Start the background thread (and the sampler, or share the process's). Never raises."""
        if self._active or self._forked:
            return self
        if self._stopped:
            self._warn("restart", "a monitor cannot be started again after stop(); create a new one")
            return self
        t0 = _now()
        kw: dict[str, Any] = {"log": self._log, "devices": self.devices, "warmup": self.warmup_steps,
                              "slow_factor": self.slow_factor}
        try:
            self._joiner = Joiner(t0, SamplerSource(self._open_sampler()), **kw)
        except Exception as e:  # noqa: BLE001 - no GPU data, but the steps are still timed
            from .._nvml import NvmlUnavailable

            msg = (f"{e} Steps are timed without GPU data (pass simulate='healthy' to try the simulated node)"
                   if isinstance(e, NvmlUnavailable) else f"no GPU data ({type(e).__name__}: {e}); steps are timed")
            self._warn("open", msg)
            self._notes.append(msg)
            self._joiner = Joiner(t0, None, **kw)
        self._active = True
        _live.add(self)
        self._thread = threading.Thread(target=self._run, name="gpuscope-monitor", daemon=True)
        try:
            self._thread.start()
        except RuntimeError as e:  # no thread to be had (a process at its limit): the run goes unmonitored
            self._warn("start", f"the monitor thread could not start ({e}); this run is not monitored")
            self._active, self._stopped, self._thread = False, True, None
            self._guard("stop", self._finish)
        return self

    def _open_sampler(self) -> Any:
        if self._sampler is not None:  # the caller's: started if needed, never stopped here
            self._sampler.start()
            return self._sampler
        assert self._shared_key is not None
        s = _acquire(self._shared_key, self._make_sampler)
        self._sampler = s
        return s

    def stop(self, timeout: float = 5.0) -> StepReport:
        """Join the last steps, close the log, release the sampler; returns the report. Never raises."""
        if self._forked:
            return self.report()
        with self._lock:  # report() takes the lock too: it is called after this block, never in it
            already, self._stopped = self._stopped, True
        if already:
            return self.report()
        was_active, self._active = self._active, False
        if not was_active:
            return self.report()
        try:
            self._stop_evt.set()
            if self._thread is not None:
                self._thread.join(timeout)
                if self._thread.is_alive():
                    self._warn("stop", f"the monitor thread did not finish within {timeout:g} s; leaving it")
                    return self.report()
            self._finish()
        except Exception as e:  # noqa: BLE001
            self._warn("stop", f"stopping failed: {type(e).__name__}: {e}")
        rep = self.report()
        if self.print_report:
            try:
                print(rep, file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001 - a closed stderr must not fail the program
                pass
        return rep

    def _finish(self) -> None:
        j = self._joiner
        c0 = time.thread_time()
        try:
            if j is not None:
                j.feed(self._drain())
                self._wait_for_gpu_data(j)
                if not self._guard("join", lambda: j.process(final=True)):
                    self._degrade(j, final=True)
                self._check_log(j)
                self._guard("diagnose", lambda: j.diagnose(final=True))
        finally:
            if self._log is not None:
                self._guard("log", self._log.close)
                self._log = None
            self.stop_cpu_seconds = time.thread_time() - c0
            c1 = time.thread_time()
            if self._shared_key is not None and self._sampler is not None:
                self._guard("sampler", lambda: _release(self._shared_key))  # type: ignore[arg-type]
            _live.discard(self)
            # Stopping the sampler (NVML shutdown, GPM samples freed) happens once per run: not a
            # per-step cost, so it is kept apart.
            self.teardown_cpu_seconds = time.thread_time() - c1

    def _wait_for_gpu_data(self, j: Joiner) -> None:
        """Give the sampler the one window it needs to cover the last step (at most ~0.3 s)."""
        if j.source is None or not j.pending:
            return
        want = j.pending[-1][1] / 1e9 + j.settle_s
        deadline = time.monotonic() + j.settle_s + 0.2
        while True:
            self._guard("ingest", j.ingest)
            now = time.monotonic()
            if j.last_snap_t >= want or now >= deadline:
                return
            # No snapshot can cover the step before `want`: sleep until then rather than poll (each poll
            # copies the sampler's history).
            time.sleep(min(max(want - now, 0.0) + 0.02, deadline - now))

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()  # never raises; the user's exception, if any, goes on unchanged

    # -- the caller's side: cheap, never raises ---------------------------------------------------
    def step(self, samples: float | None = None, tokens: float | None = None) -> None:
        """Mark the end of a training step (the first step starts at start()). `samples` and `tokens`,
        if given, are what this step processed (for throughput)."""
        if self._active:
            if samples is None and tokens is None:
                self._queue.append(_now())
            else:
                self._queue.append((_now(), samples, tokens))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """`with m.phase("data"):` - time spent in it is reported per step and for the run."""
        t0 = _now()
        try:
            yield
        finally:
            if self._active:
                self._queue.append(("phase", str(name), t0, _now()))

    def mark(self, name: str) -> None:
        """Note an instant (a checkpoint, an evaluation); it lands in the step it happened in."""
        if self._active:
            self._queue.append(("mark", str(name), _now()))

    # -- reading -------------------------------------------------------------------------------
    def report(self) -> StepReport:
        """The run so far (or the whole run after stop()). Never raises."""
        try:
            j = self._joiner
            if j is None:
                rep = StepReport()
            else:
                with self._lock:
                    rep = j.report()
                rep.pending_steps += len(self._queue)
            rep.notes = list(self._notes) + rep.notes
            if rep.source == "sampler" and rep.gpus and rep.gpu_busy_ratio is None and rep.steps > 0:
                rep.notes.append("no SM activity on these GPUs (GPM needs a Hopper or newer data-center GPU); "
                                 "NVML 'utilization' alone cannot say how busy the SMs were")
            if (isinstance(self.devices, tuple) and rep.source == "sampler" and not rep.gpus
                    and j is not None and j.last_snap is not None):
                rep.notes.append(f"none of devices={list(self.devices)} is a GPU on this node (indices or UUIDs); "
                                 "steps are timed without GPU data")
            self._report = rep
            return rep
        except Exception as e:  # noqa: BLE001
            self._warn("report", f"the report failed: {type(e).__name__}: {e}")
            return StepReport(notes=[f"the report failed: {type(e).__name__}: {e}"])

    def metrics(self) -> dict[str, float]:
        """The latest joined steps, averaged (step_seconds, gpu_busy_ratio, ...). Never raises."""
        try:
            j = self._joiner
            if j is None:
                return {}
            with self._lock:
                return j.metrics()
        except Exception as e:  # noqa: BLE001
            self._warn("metrics", f"{type(e).__name__}: {e}")
            return {}

    @property
    def sampler(self) -> Any:
        return self._sampler

    # -- the background thread -----------------------------------------------------------------
    def _drain(self) -> list[Any]:
        q = self._queue
        out = []
        try:
            while True:
                out.append(q.popleft())
        except IndexError:
            return out

    def _run(self) -> None:
        j = self._joiner
        assert j is not None
        c0 = time.thread_time()
        while not self._stop_evt.wait(self.flush_interval):
            items = self._drain()
            with self._lock:
                j.feed(items)
                if not self._guard("join", j.process):
                    self._degrade(j)
            self._check_log(j)
            self._guard("diagnose", j.diagnose)
            self.cpu_seconds = time.thread_time() - c0

    def _check_log(self, j: Joiner) -> None:
        if j.log_error is not None and "log" not in self._errors:
            self._warn("log", j.log_error)
            self._notes.append(j.log_error)

    def _degrade(self, j: Joiner, final: bool = False) -> None:
        """After an internal failure in the join: keep timing the steps, without GPU data."""
        if j.source is not None:
            j.source, j.tracks, j.last_snap = None, {}, None
            self._notes.append("GPU data switched off after an internal error (logged); steps are still timed")
        if not self._guard("join", lambda: j.process(final=final)):
            j.pending.clear()

    def _guard(self, where: str, fn: Any) -> bool:
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 - monitoring must never break the monitored program
            self._warn(where, f"{where} failed: {type(e).__name__}: {e}", exc=True)
            return False

    def _warn(self, where: str, msg: str, exc: bool = False) -> None:
        if where not in self._errors:
            self._errors.add(where)
            log.warning("gpuscope monitor: %s (logged once)", msg, exc_info=exc)


def monitor(interval: float = 0.1, log: str | os.PathLike[str] | None = None, *, simulate: str | None = None,
            gpus: int | None = None, devices: Sequence[int | str] | str | None = None, sampler: Any = None,
            warmup_steps: int = 1, slow_factor: float = 1.5, print_report: bool = False,
            flush_interval: float = 1.0) -> Monitor:
    """A training-loop monitor: `with gpuscope.monitor() as m: ... m.step()`.

    interval: the sampler's period in seconds. log: a step log, `.jsonl` or `.parquet` (pyarrow).
    simulate/gpus: the simulated node and its GPU count (no GPU needed). devices: which GPUs the steps
    are joined with: GPU indices or UUIDs, "all", or None for the GPUs this process uses (all GPUs
    until it appears on one). sampler: a `Sampler` of your own (started if needed, never stopped).
    warmup_steps: first steps left out of the summary. slow_factor: a step this many times the running
    median is flagged slow. print_report: print the summary to stderr at stop.
    """
    return Monitor(interval=interval, log=log, simulate=simulate, gpus=gpus, devices=devices, sampler=sampler,
                   warmup_steps=warmup_steps, slow_factor=slow_factor, print_report=print_report,
                   flush_interval=flush_interval)
