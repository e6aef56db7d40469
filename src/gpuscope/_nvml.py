"""The one door to NVML. Every call goes through `Nvml.call`, which

- turns 'not supported', 'no permission', 'driver too old' into an `Unavailable` value carrying the
  reason (falsy, never an exception on the hot path),
- raises `GpuLost` only for NVML_ERROR_GPU_IS_LOST, so the sampler can mark that GPU and go on,
- logs an unknown failure once per call name,
- accounts the latency of every call by name (the sampler's self-accounting and `doctor` read it).

The library is injected: the real `pynvml` module by default, `gpuscope.testing.FakeNVML` in tests
and in the simulated node.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .errors import Unavailable as _UserUnavailable

log = logging.getLogger("gpuscope.nvml")

# NVML return codes (stable C ABI values; named here so the fake and the real module agree).
ERROR_NOT_SUPPORTED = 3
ERROR_NO_PERMISSION = 4
ERROR_NOT_FOUND = 6
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_LIBRARY_NOT_FOUND = 12
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_GPU_IS_LOST = 15
ERROR_NO_DATA = 21
ERROR_UNKNOWN = 999


class Unavailable:
    """A value NVML could not give, with the reason. Falsy, so `if v:` reads naturally."""

    __slots__ = ("code", "reason")

    def __init__(self, code: int, reason: str) -> None:
        self.code = code
        self.reason = reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Unavailable({self.reason!r})"


_REASONS = {
    0: "no data yet",  # pynvml raises NVMLError(SUCCESS) when a sized call finds nothing to return
    ERROR_NOT_SUPPORTED: "not supported by this GPU or driver",
    ERROR_NO_PERMISSION: "needs more privileges (root, or a driver that allows profiling for all users)",
    ERROR_FUNCTION_NOT_FOUND: "the installed NVIDIA driver is too old for this call",
    ERROR_NOT_FOUND: "no data yet",
    ERROR_NO_DATA: "no data yet",
    ERROR_TIMEOUT: "timed out",
}
_CACHED = {code: Unavailable(code, reason) for code, reason in _REASONS.items()}
MISSING_IN_BINDING = Unavailable(-1, "the installed nvidia-ml-py is too old for this call")


class NvmlUnavailable(_UserUnavailable, RuntimeError):
    """NVML cannot be used on this machine at all. The message is one sentence for the user."""


class GpuLost(RuntimeError):
    """NVML says the GPU fell off the bus."""


@dataclass
class CallStats:
    count: int = 0
    errors: int = 0
    total_ns: int = 0
    max_ns: int = 0
    recent_ns: deque[int] = field(default_factory=lambda: deque(maxlen=256))

    def add(self, ns: int) -> None:
        self.count += 1
        self.total_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns
        self.recent_ns.append(ns)

    def median_ns(self) -> float:
        r = sorted(list(self.recent_ns))
        return float(r[len(r) // 2]) if r else 0.0


def error_code(exc: BaseException) -> int:
    return int(getattr(exc, "value", ERROR_UNKNOWN))


class Nvml:
    def __init__(self, lib: Any = None) -> None:
        if lib is None:
            try:
                import pynvml as lib  # type: ignore[no-redef]
            except ImportError as e:  # pragma: no cover - a dependency, present after install
                raise NvmlUnavailable("The nvidia-ml-py package is not installed (pip install nvidia-ml-py).") from e
        self.lib = lib
        self.stats: dict[str, CallStats] = {}
        self._fns: dict[str, Any] = {}
        self._logged: set[tuple[str, int]] = set()
        self._nvml_error = getattr(lib, "NVMLError", Exception)
        self.initialized = False

    # -- lifecycle -----------------------------------------------------------------------------
    def init(self) -> None:
        try:
            self.lib.nvmlInit()
        except self._nvml_error as e:
            code = error_code(e)
            if code in (ERROR_LIBRARY_NOT_FOUND, ERROR_DRIVER_NOT_LOADED):
                raise NvmlUnavailable(
                    "No NVIDIA driver was found on this machine (NVML could not be loaded); to try gpuscope on "
                    "a simulated 8-GPU node, add --simulate mixed (gpuscope scenarios lists the others)."
                ) from e
            if code == ERROR_NO_PERMISSION:
                raise NvmlUnavailable("NVML refused access: this user may not open /dev/nvidia*.") from e
            raise NvmlUnavailable(f"NVML failed to start: {e}.") from e
        except OSError as e:
            raise NvmlUnavailable(f"NVML could not be loaded: {e}.") from e
        self.initialized = True

    def shutdown(self) -> None:
        if self.initialized:
            self.initialized = False
            try:
                self.lib.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down; nothing useful to do
                pass

    # -- the hot path --------------------------------------------------------------------------
    def call(self, name: str, *args: Any) -> Any:
        """Call NVML function `name`; return its value, or an `Unavailable` with the reason.

        Raises GpuLost when NVML says the GPU is lost; never raises anything else.
        """
        fn = self._fns.get(name)
        if fn is None:
            fn = getattr(self.lib, name, None)
            if fn is None:
                return MISSING_IN_BINDING
            self._fns[name] = fn
        st = self.stats.get(name)
        if st is None:
            st = self.stats[name] = CallStats()
        t0 = time.perf_counter_ns()
        try:
            value = fn(*args)
        except self._nvml_error as e:
            st.add(time.perf_counter_ns() - t0)
            st.errors += 1
            code = error_code(e)
            if code == ERROR_GPU_IS_LOST:
                raise GpuLost(f"{name}: GPU is lost") from None
            cached = _CACHED.get(code)
            if cached is not None:
                return cached
            return self._unexpected(name, code, f"NVML error: {e}")
        except Exception as e:  # noqa: BLE001 - a binding bug must not stop the sampler
            st.add(time.perf_counter_ns() - t0)
            st.errors += 1
            return self._unexpected(name, ERROR_UNKNOWN, f"{type(e).__name__}: {e}")
        st.add(time.perf_counter_ns() - t0)
        return value

    def _unexpected(self, name: str, code: int, reason: str) -> Unavailable:
        if (name, code) not in self._logged:
            self._logged.add((name, code))
            log.warning("%s failed: %s (logged once)", name, reason)
        return Unavailable(code, reason)

    def latency_table(self) -> list[dict[str, Any]]:
        """Per-call latency as measured by our own accounting, slowest median first."""
        rows = [
            {
                "call": name,
                "count": st.count,
                "errors": st.errors,
                "median_us": st.median_ns() / 1e3,
                "mean_us": st.total_ns / st.count / 1e3 if st.count else 0.0,
                "max_us": st.max_ns / 1e3,
            }
            for name, st in list(self.stats.items())  # the sampler thread may add calls meanwhile
        ]
        rows.sort(key=lambda r: -r["median_us"])
        return rows


def decode(s: Any) -> str:
    """NVML strings arrive as bytes from older bindings and str from newer ones."""
    if isinstance(s, bytes):
        return s.decode(errors="replace")
    return str(s)
