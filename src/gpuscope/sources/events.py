"""NVML event sets in their own thread: XID errors, ECC errors, clock changes — pushed, not polled.

Every event is time-stamped when it arrives and counted (`gpu_xid_events_total{xid}`,
`gpu_ecc_events_total{type}`); repeats are counted again, nothing is sticky. The sampler drains the
queue at each tick, so events reach consumers within one tick.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from .._nvml import ERROR_TIMEOUT, GpuLost, Nvml, Unavailable
from .._records import Event
from ..catalog import series_key
from .device import Device

log = logging.getLogger("gpuscope.events")

# A few XIDs a user should recognise by name (NVIDIA's XID catalog).
XID_MEANING = {
    13: "graphics engine exception (often an illegal memory access in a kernel)",
    31: "GPU memory page fault (illegal address in a kernel)",
    43: "GPU stopped processing (a kernel was killed or hung)",
    45: "preemptive cleanup after a process was killed",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failure",
    68: "video processor exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error (the application was stopped)",
    95: "uncontained ECC error (reset the GPU)",
    119: "GSP RPC timeout",
    120: "GSP error",
}

_MAX_QUEUE = 10_000


class EventSource:
    """Owns the NVML event set and its waiting thread."""

    name = "events"

    def __init__(self, nvml: Nvml, devices: list[Device], wait_ms: int = 500) -> None:
        self.nvml = nvml
        self.lib = nvml.lib
        self.wait_ms = wait_ms
        self.queue: deque[Event] = deque(maxlen=_MAX_QUEUE)
        self.dropped = 0
        self.counts: dict[tuple[str, str], float] = {}  # (gpu label, series key) -> count
        self._by_handle: dict[int, Device] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set: Any = None
        self._lock = threading.Lock()
        self.registered: dict[str, int] = {}  # gpu label -> mask registered
        self._devices = [d for d in devices if not d.is_mig and d.healthy]
        self.cpu_seconds = 0.0  # this thread's own CPU, for the sampler's self-accounting
        self._logged: set[str] = set()

    def start(self) -> None:
        lib = self.lib
        es = self.nvml.call("nvmlEventSetCreate")
        if isinstance(es, Unavailable):
            log.info("NVML event sets unavailable: %s", es.reason)
            return
        self._set = es
        # Not nvmlEventTypeClock: an idle GPU changes clocks many times a second (each a wake-up here),
        # and throttle-reason changes are already seen by the sampler's cheap poll.
        want = (lib.nvmlEventTypeXidCriticalError | lib.nvmlEventTypeSingleBitEccError
                | lib.nvmlEventTypeDoubleBitEccError)
        for dev in self._devices:
            try:
                sup = self.nvml.call("nvmlDeviceGetSupportedEventTypes", dev.handle)
                if isinstance(sup, Unavailable):
                    dev.unsupported("gpu_xid_events_total", f"NVML events: {sup.reason}")
                    continue
                mask = int(sup) & want
                if not mask:
                    continue
                r = self.nvml.call("nvmlDeviceRegisterEvents", dev.handle, mask, es)
                if isinstance(r, Unavailable):
                    dev.unsupported("gpu_xid_events_total", f"NVML events: {r.reason}")
                    continue
            except GpuLost:
                continue
            self.registered[dev.label] = mask
            self._by_handle[_handle_key(dev.handle)] = dev
            if mask & lib.nvmlEventTypeXidCriticalError:
                dev.supported("gpu_xid_events_total")
            if mask & (lib.nvmlEventTypeSingleBitEccError | lib.nvmlEventTypeDoubleBitEccError):
                dev.supported("gpu_ecc_events_total")
        if not self.registered:
            return
        self._thread = threading.Thread(target=self._run, name="gpuscope-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.wait_ms / 1000 + 1.0)
        if self._set is not None:
            self.nvml.call("nvmlEventSetFree", self._set)
            self._set = None

    def _run(self) -> None:
        lib = self.lib
        wait = getattr(lib, "nvmlEventSetWait_v2", None) or lib.nvmlEventSetWait
        err = self.nvml._nvml_error
        c0 = time.thread_time()
        backoff = 1.0
        while not self._stop.is_set():
            self.cpu_seconds = time.thread_time() - c0
            try:
                data = wait(self._set, self.wait_ms)
            except err as e:
                code = getattr(e, "value", None)
                if code == ERROR_TIMEOUT:
                    backoff = 1.0
                    continue
                backoff = self._failed(f"NVML error {code}", e, backoff)
                continue
            except Exception as e:  # noqa: BLE001 - the event thread must survive
                backoff = self._failed(type(e).__name__, e, backoff)
                continue
            backoff = 1.0
            self._handle(data)

    def _failed(self, key: str, e: BaseException, backoff: float) -> float:
        """Log each kind of failure once (a lost GPU makes every wait fail), wait, back off to 30 s."""
        if key not in self._logged:
            self._logged.add(key)
            log.warning("NVML event wait failed: %s; retrying with back-off (logged once)", e)
        self._stop.wait(backoff)
        return min(backoff * 2, 30.0)

    def _handle(self, data: Any) -> None:
        lib = self.lib
        dev = self._by_handle.get(_handle_key(data.device))
        label = dev.label if dev is not None else None
        etype, edata = int(data.eventType), int(data.eventData)
        now = time.time_ns()
        if etype & lib.nvmlEventTypeXidCriticalError:
            meaning = XID_MEANING.get(edata, "see NVIDIA's XID catalog")
            ev = Event(now, "xid", label, f"XID {edata} on GPU {label}: {meaning}", {"xid": edata})
            self._count(label, series_key("gpu_xid_events_total", xid=edata))
        elif etype & (lib.nvmlEventTypeSingleBitEccError | lib.nvmlEventTypeDoubleBitEccError):
            kind = "uncorrected" if etype & lib.nvmlEventTypeDoubleBitEccError else "corrected"
            ev = Event(now, "ecc", label, f"{kind} ECC error on GPU {label}", {"type": kind})
            self._count(label, series_key("gpu_ecc_events_total", type=kind))
        else:
            ev = Event(now, "nvml_event", label, f"NVML event 0x{etype:x} on GPU {label}",
                       {"type": etype, "data": edata})
        with self._lock:
            if len(self.queue) == self.queue.maxlen:
                self.dropped += 1
            self.queue.append(ev)

    def _count(self, label: str | None, key: str) -> None:
        k = (label or "", key)
        with self._lock:
            self.counts[k] = self.counts.get(k, 0.0) + 1

    def drain(self, devices: list[Device], out: list[Event]) -> None:
        """Move queued events into `out` (folding identical ones) and counts into device values."""
        with self._lock:
            pending = list(self.queue)
            self.queue.clear()
            counts = dict(self.counts)
        folded: dict[tuple[str, str | None, str], Event] = {}
        for ev in pending:
            key = (ev.kind, ev.gpu, ev.message)
            if key in folded:
                folded[key].count += 1
            else:
                folded[key] = ev
        out.extend(folded.values())
        if counts:
            by_label = {d.label: d for d in devices}
            for (label, series), n in counts.items():
                dev = by_label.get(label)
                if dev is not None:
                    dev.values[series] = n


def _handle_key(h: Any) -> int:
    """NVML device handles are ctypes pointers; compare them by address (the fake uses objects)."""
    try:
        import ctypes

        return ctypes.cast(h, ctypes.c_void_p).value or id(h)
    except Exception:  # noqa: BLE001
        return id(h)
