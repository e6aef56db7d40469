"""The sampler: one thread per node reading every source at a cadence that fits each field's cost.

    >>> import time
    >>> from gpuscope import Sampler
    >>> with Sampler(simulate="compute_bound") as s:   # or Sampler() on a GPU machine
    ...     first = s.sample_once()
    ...     time.sleep(s.config.gpm_window)            # GPM rates need two samples a window apart
    ...     snap = s.sample_once()
    >>> first.gpus[0].sm_active_ratio is None         # not a zero: no rate yet
    True
    >>> snap.gpus[0].sm_active_ratio > 0.5
    True

Schedule: tick k runs at t0 + k * interval (no drift); a tick that starts more than one interval late
skips ahead and counts the skipped ticks instead of bunching them. Cost groups run every
`fast` tick or at their own period; GPM at its window (never below 100 ms).
Memory is bounded: the last `history` snapshots and the last 10,000 events.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from ._node import node_name
from ._nvml import GpuLost, Nvml
from ._records import Capability, Event, GpuRecord, HostRecord, PodRecord, ProcessRecord, Snapshot
from .catalog import CATALOG, decode_clock_event_reasons
from .errors import UsageError
from .sources import DeviceSource
from .sources.device import Device, discover, mark_lost
from .sources.events import EventSource
from .sources.gpm import MIN_WINDOW_S, GpmSource
from .sources.nvml import NvmlSource
from .sources.pods import PodJoin, PodSource
from .sources.procs import CMDLINE_MODES

log = logging.getLogger("gpuscope.sampler")

MIN_INTERVAL_S = 0.005  # 200 Hz: below this the NVML calls themselves no longer fit in a tick


#: The longest wait between two ticks that sleeps rather than waits on the stop event (10 Hz's, 4 Hz's).
SLEEP_AT_MOST_S = 0.25


def _no_clock() -> float:
    return 0.0


class ConfigError(UsageError, ValueError):
    """A sampler setting a user gave is out of range. The message is one sentence."""


@dataclass
class SamplerConfig:
    """Periods in seconds. `interval` is the base rate (fast fields); the others are their own."""

    interval: float = 0.1
    medium: float = 0.2  # at most this often; every tick when the interval is longer
    gpm_window: float = 0.2
    slow: float = 1.0
    energy: float = 10.0
    rare: float = 30.0
    processes: float = 1.0
    process_utilization: float = 5.0  # NVML's per-process call costs ~2.5 ms of CPU on an H200
    host: float = 1.0
    history: int = 3000  # snapshots kept in memory
    gpm: bool = True
    gpm_graphics: bool = False  # GPM GRAPHICS_UTIL: ~1.4 ms of CPU per read on an H200
    collect_processes: bool = True
    collect_host: bool = True
    cmdline: str = "redacted"  # what process records show of a command line: redacted | name-only | hidden
    events: bool = True
    # eBPF probes on libcuda counting each process's launches, copies and syncs (sources.cudaprobe): None is on
    # where the real driver is read (not the simulated node, not an injected NVML) and the kernel allows it.
    cuda_probe: bool | None = None

    @classmethod
    def for_interval(cls, interval: float, **kw: Any) -> SamplerConfig:
        """Defaults for a base interval: periods that would be shorter than it are raised to it, so
        `--interval 2s` just works (the user did not choose those periods; explicit `kw` are kept)."""
        cfg = cls(interval=interval, **kw)
        for name in ("slow", "energy", "rare", "processes", "process_utilization", "host"):
            if name not in kw and getattr(cfg, name) < interval:
                setattr(cfg, name, interval)
        return cfg

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float | int) and not isinstance(v, bool) and not math.isfinite(v):
                raise ConfigError(f"{f.name} must be a finite number, got {v!r}.")
        if self.interval <= 0:
            raise ConfigError(f"The sampling interval must be positive, got {self.interval:g} s.")
        if self.interval < MIN_INTERVAL_S:
            raise ConfigError(
                f"The sampling interval {self.interval * 1000:g} ms is below the {MIN_INTERVAL_S * 1000:g} ms "
                "the NVML calls of one tick need; use a longer interval.")
        if self.medium <= 0:
            raise ConfigError(f"The medium period must be positive, got {self.medium:g} s.")
        if self.cmdline not in CMDLINE_MODES:
            raise ConfigError(f"cmdline must be one of {', '.join(CMDLINE_MODES)}, not {self.cmdline!r}.")
        if self.gpm and self.gpm_window < MIN_WINDOW_S:
            raise ConfigError(
                f"The GPM window {self.gpm_window * 1000:g} ms is below the {MIN_WINDOW_S * 1000:g} ms NVML "
                "needs between two GPM samples.")
        for name in ("slow", "energy", "rare", "processes", "process_utilization", "host"):
            if getattr(self, name) < self.interval:
                raise ConfigError(f"The {name} period ({getattr(self, name):g} s) must not be shorter than the "
                                  f"sampling interval ({self.interval:g} s).")
        if self.history < 1:
            raise ConfigError(f"history must keep at least one snapshot, got {self.history}.")


class Sampler:
    def __init__(
        self,
        config: SamplerConfig | None = None,
        *,
        nvml: Any = None,
        host_reader: Any = None,
        host_source: Any = None,
        simulate: str | None = None,
        gpus: int | None = None,
        processes: int | None = None,
        churn_s: float | None = None,
        pods: PodSource | None = None,
        workload: str | None = None,
    ) -> None:
        self.config = config or SamplerConfig()
        self.config.validate()
        self.simulated: str | None = None
        # Where the node's pods come from (the kubelet, sources.podresources): process records get their pod,
        # GPU records their holders and allocation state. A simulated node then runs its processes in pods.
        self.pods = pods
        self._pod_join = PodJoin(pods) if pods is not None else None
        if simulate is not None:
            from .sim import SimulatedNode

            node = SimulatedNode(simulate, gpus=gpus, processes=processes, churn_s=churn_s, pods=pods is not None,
                                 workload=workload)
            nvml, host_reader = node.nvml, node.host_reader
            host_source = host_source or node.host_source
            self.simulated = node.scenario
        self.nvml = nvml if isinstance(nvml, Nvml) else Nvml(nvml)
        self._host_reader = host_reader
        self._host_source = host_source
        self.hostname = node_name()
        self.devices: list[Device] = []
        # The newest events, for `doctor`'s short run; the agent keeps events in its store. (10,000 of them were
        # ~12 MB that a churning node filled in 50 minutes, of process starts and stops nobody read from here.)
        self.events_history: deque[Event] = deque(maxlen=1_000)
        self.history: deque[Snapshot] = deque(maxlen=self.config.history)
        self._pending_events: list[Event] = []
        self._latest: Snapshot | None = None
        self._processes: list[ProcessRecord] = []
        self._pods: list[PodRecord] = []
        self._host: HostRecord | None = None
        self._subscribers: list[Callable[[Snapshot], None]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one tick at a time
        self._opened = False
        self._next_due: dict[str, float] = {}
        self._last_now = 0.0
        self._gpm_source: GpmSource | None = None
        self._group_sources: dict[str, DeviceSource] = {}
        self._proc_source: Any = None
        self._event_source: EventSource | None = None
        self._cuda_probe: Any = None
        #: Whether the CUDA driver probes run, or why not (doctor shows it).
        self.cuda_probe_capability = Capability(False, "not opened")
        self._real_nvml = nvml is None and simulate is None
        self._errors_logged: set[str] = set()
        self.cpu_seconds = 0.0
        self.ticks = 0
        self.missed_ticks = 0
        self.tick_seconds: deque[float] = deque(maxlen=1000)
        self.group_cpu_seconds: dict[str, float] = {}  # CPU per cadence group, this thread, when measured
        #: Measure each cadence group's CPU (group_cpu_seconds): two reads of the thread's CPU clock per group and
        #: tick, a system call each, so off unless a benchmark asks; the tick's own CPU is always measured.
        self.measure_groups = False

    # -- lifecycle -----------------------------------------------------------------------------
    def open(self) -> None:
        """Start NVML, find the GPUs, start the event thread. Raises NvmlUnavailable with a sentence."""
        if self._opened:
            return
        self.nvml.init()
        self.devices = discover(self.nvml, self._pending_events)
        if self.pods is not None:
            self.pods.start({d.identity.uuid: d.label for d in self.devices})
        self._nvml_source = NvmlSource(self.nvml, self._pending_events)
        self._gpm_source = GpmSource(self.nvml, self.config.gpm_window, self.config.gpm_graphics) if self.config.gpm else None
        sources: list[DeviceSource] = [self._nvml_source] + ([self._gpm_source] if self._gpm_source else [])
        self._group_sources = {g: src for src in sources for g in src.groups}
        self._proc_source = None
        if self.config.collect_processes:
            from .sources.procs import ProcessSource

            self._proc_source = ProcessSource(self.nvml, self._host_reader, cmdline=self.config.cmdline)
            if self._pod_join is not None:
                self._proc_source.attribute = self._pod_join.attribute
        if self.config.collect_processes and self._cuda_probe is None:
            self._open_cuda_probe()
        if self.config.collect_host and self._host_source is None:
            from .sources.host import HostSource

            self._host_source = HostSource()
        self._event_source = None
        if self.config.events:
            self._event_source = EventSource(self.nvml, self.devices)
            self._event_source.start()
        self._opened = True

    @property
    def cuda_probe_libraries(self) -> int:
        """How many libcuda files the CUDA driver probes are on now (0 where they are off)."""
        return self._cuda_probe.libraries_probed if self._cuda_probe is not None else 0

    def _open_cuda_probe(self) -> None:
        want = self.config.cuda_probe
        from .sources.cudaprobe import CudaProbe

        probe = CudaProbe(enabled=False if want is False or (want is None and not self._real_nvml) else None)
        try:
            self.cuda_probe_capability = probe.open()
        except Exception as e:  # noqa: BLE001 - the probes are a bonus; sampling goes on without them
            self.cuda_probe_capability = Capability(False, f"the probes failed to start: {e}")
            self._log_once("cuda probes", e)
        if self.cuda_probe_capability.supported:
            self._cuda_probe = probe
        elif want is None and not self._real_nvml:
            self.cuda_probe_capability = Capability(False, "off on the simulated node and with an injected NVML")

    def start(self) -> Sampler:
        """Open and sample in a background thread until stop()."""
        self.open()
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gpuscope-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.pods is not None:
            self.pods.stop()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            if self._thread.is_alive():
                # Stuck inside NVML (a sick GPU): shutting NVML down under it could crash the process;
                # keep the reference so start() cannot start a second thread.
                log.warning("the sampler thread did not stop within 5 s (an NVML call hangs); leaving NVML open")
                return
            self._thread = None
        if self._event_source is not None:
            self._event_source.stop()
            self._event_source = None
        if self._opened:
            with self._lock:
                if self._cuda_probe is not None:
                    self._cuda_probe.close()
                    self._cuda_probe = None
                if self._gpm_source is not None:
                    self._gpm_source.close(self.devices)
                self.nvml.shutdown()
                self._opened = False

    def __enter__(self) -> Sampler:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- reading -------------------------------------------------------------------------------
    def latest(self) -> Snapshot | None:
        return self._latest

    def add_events(self, events: list[Event]) -> None:
        """Queue events from outside the sampler (the agent's POST /api/v1/events) for its next tick, as its own
        sources do: from there they reach the snapshot, the event history and the store. Under the tick lock,
        so none falls between two ticks."""
        with self._lock:
            self._pending_events.extend(events)

    def subscribe(self, fn: Callable[[Snapshot], None]) -> None:
        """Call fn(snapshot) after every tick, on the sampler thread. Keep it quick; it must not raise."""
        self._subscribers.append(fn)

    def capabilities(self) -> dict[str, dict[str, Capability]]:
        """For every GPU label and catalog metric it could have: supported or not, and why."""
        out: dict[str, dict[str, Capability]] = {}
        for dev in self.devices:
            caps: dict[str, Capability] = {}
            for name, m in CATALOG.items():
                if m.source not in ("nvml", "gpm", "events") and not name.startswith("gpu_process_"):
                    continue
                c = dev.caps.get(name)
                if c is None:
                    if dev.is_mig and m.source == "nvml" and name not in dev.values:
                        c = Capability(False, "not available per MIG instance (read on the parent GPU)")
                    elif not dev.healthy:
                        c = Capability(False, "the GPU is lost")
                    elif name.startswith("gpu_process_"):
                        c = Capability(False, "no process has used this GPU yet")
                    else:
                        c = Capability(False, "not read yet")
                caps[name] = c
            out[dev.label] = caps
        return out

    def overhead(self, calls: bool = True) -> dict[str, Any]:
        """The sampler's own cost: CPU seconds, ticks, missed ticks, tick time, per-call NVML latency
        (`calls=False` leaves that table out)."""
        ts = sorted(list(self.tick_seconds))
        out = {
            "cpu_seconds": self.cpu_seconds,
            "ticks": self.ticks,
            "missed_ticks": self.missed_ticks,
            "tick_median_us": ts[len(ts) // 2] * 1e6 if ts else 0.0,
            "tick_max_us": ts[-1] * 1e6 if ts else 0.0,
            "group_cpu_seconds": dict(self.group_cpu_seconds),
            "event_thread_cpu_seconds": self._event_source.cpu_seconds if self._event_source else 0.0,
        }
        if calls:
            out["nvml_calls"] = self.nvml.latency_table()
        return out

    def self_metrics(self) -> dict[str, float]:
        return {
            "gpuscope_sampler_cpu_seconds_total": self.cpu_seconds,
            "gpuscope_sampler_ticks_total": float(self.ticks),
            "gpuscope_sampler_missed_ticks_total": float(self.missed_ticks),
        }

    # -- sampling ------------------------------------------------------------------------------
    def sample_once(self) -> Snapshot:
        """Run one tick now (opening the sampler if needed) and return its snapshot."""
        self.open()
        return self._tick(time.monotonic())

    def _due(self, group: str, period: float, now: float) -> bool:
        nxt = self._next_due.get(group)
        if nxt is None or now >= nxt - 1e-4:
            # Stay on the grid of the period; skip whole periods if we fell behind.
            base = now if nxt is None or now - nxt > period else nxt
            self._next_due[group] = base + period
            return True
        return False

    def _tick(self, now: float) -> Snapshot:
        with self._lock:
            # A caller's sample_once() and the thread can race for the lock: time never goes back.
            now = max(now, self._last_now)
            self._last_now = now
            c0 = time.thread_time()
            t0 = time.perf_counter()
            cfg = self.config
            events = self._pending_events
            # 'slow' before 'fast' (its memory read, with the reserved part, stands for the tick's);
            # 'medium' before 'energy' (power is integrated before a hardware read re-anchors it).
            groups = ["slow"] if self._due("slow", cfg.slow, now) else []
            groups.append("fast")
            for g, p in (("medium", cfg.medium), ("energy", cfg.energy), ("rare", cfg.rare)):
                if self._due(g, p, now):
                    groups.append(g)
            if self._gpm_source is not None:
                groups.append("gpm")  # the source keeps its own window
            cpu, measure = self.group_cpu_seconds, self.measure_groups
            clock = time.thread_time if measure else _no_clock
            for g in groups:
                c = clock()
                collect = self._group_sources[g].collect
                for dev in self.devices:
                    if dev.healthy:
                        try:
                            self._guard(collect, g, dev, now)
                        except GpuLost:
                            mark_lost(dev, events)
                if measure:
                    cpu[g] = cpu.get(g, 0.0) + clock() - c
            if self._proc_source is not None and self._due("processes", cfg.processes, now):
                c = clock()
                util_due = self._due("process_utilization", cfg.process_utilization, now)
                try:
                    self._processes = self._proc_source.collect(self.devices, events, util_due)
                    self._pods = self._proc_source.pods
                    if self._cuda_probe is not None:  # one read of the probes' counters per processes tick
                        self._cuda_probe.annotate(self._processes)
                except Exception as e:  # noqa: BLE001 - never stop sampling
                    self._log_once("processes", e)
                if measure:
                    cpu["processes"] = cpu.get("processes", 0.0) + clock() - c
            if self._host_source is not None and self._due("host", cfg.host, now):
                c = clock()
                try:
                    self._host = HostRecord(time.time_ns(), self._host_source.collect())
                except Exception as e:  # noqa: BLE001
                    self._log_once("host", e)
                if measure:
                    cpu["host"] = cpu.get("host", 0.0) + clock() - c
            if self._event_source is not None:
                self._event_source.drain(self.devices, events)
            snap = self._snapshot(events)
            self._pending_events = []
            self._nvml_source.events = self._pending_events
            self.ticks += 1
            self.tick_seconds.append(time.perf_counter() - t0)
            self.cpu_seconds += time.thread_time() - c0
        for fn in self._subscribers:
            try:
                fn(snap)
            except Exception as e:  # noqa: BLE001 - a consumer's bug must not stop the sampler
                self._log_once(f"subscriber {fn!r}", e)
        return snap

    def _guard(self, fn: Callable[[str, Device, float], None], group: str, dev: Device, now: float) -> None:
        try:
            fn(group, dev, now)
        except GpuLost:
            raise
        except Exception as e:  # noqa: BLE001 - a source bug must not stop the others
            self._log_once(f"{group} on GPU {dev.label}", e)

    def _log_once(self, where: str, e: BaseException) -> None:
        if where not in self._errors_logged:
            self._errors_logged.add(where)
            log.warning("sampling %s failed: %s: %s (logged once)", where, type(e).__name__, e, exc_info=True)

    def _snapshot(self, events: list[Event]) -> Snapshot:
        now_ns = time.time_ns()
        gpus = []
        for dev in self.devices:
            mask = dev.values.get("gpu_clock_event_reasons")
            reasons = decode_clock_event_reasons(int(mask)) if mask is not None and dev.healthy else []
            gpus.append(GpuRecord(dev.identity, now_ns, dict(dev.values), dev.healthy, reasons))
        if self._pod_join is not None:
            self._pod_join.annotate(gpus, self._processes)
        snap = Snapshot(now_ns, gpus, list(self._processes), self._host, list(events), self.simulated, self.hostname,
                        list(self._pods))
        self.events_history.extend(events)
        self.history.append(snap)
        self._latest = snap
        return snap

    def _run(self) -> None:
        interval = self.config.interval
        t0 = time.monotonic()
        k = 0
        while not self._stop.is_set():
            due = t0 + k * interval
            now = time.monotonic()
            if now < due:
                # A short wait sleeps: Event.wait's condition and timed lock cost about twice sleep's CPU per
                # wake-up (75 against 40 us on the dev machine), at 10 Hz a large part of a sample's cost
                # outside NVML; stop() then waits for at most one such sleep. A long one waits on the event.
                if due - now <= SLEEP_AT_MOST_S:
                    time.sleep(due - now)
                    if self._stop.is_set():
                        break
                elif self._stop.wait(due - now):
                    break
                now = time.monotonic()
            late = now - due
            if late > interval:
                skipped = int(late // interval)
                self.missed_ticks += skipped
                k += skipped
            try:
                self._tick(now)
            except Exception as e:  # noqa: BLE001 - the sampler thread must never die
                self._log_once("tick", e)
            k += 1
