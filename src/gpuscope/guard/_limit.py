"""Adaptive concurrency limits: Gradient2 and AIMD on latency, the GPU/queue signal on top, the simple step mode.

Gradient2 (after Netflix concurrency-limits' Gradient2Limit): per short window (10 samples or 1 s) the mean
latency `short`; a long-run exponential average `long` over 600 samples; `gradient = clamp(tol*long/short,
0.5, 1)`; `L' = L*gradient + queue` with `queue = sqrt(L)`; `L <- L*(1-s) + L'*s`. No growth while fewer
than L/2 requests are in flight (the limit is not what holds traffic back). When `long/short > 2` the
baseline decays (x0.95) so a lasting latency improvement is adopted. Averages, not minima: a minimum
over-sheds on noisy inference latency.

AIMD: a drop (rejected upstream, timeout, or latency over `timeout_s`) multiplies the limit by
`backoff_ratio`; otherwise +1 when at least half the limit is in flight.

GPU and queue signal (`GpuSignal`), applied at every signal update, whichever latency controller runs:
- memory free ratio <= memory_free_low, power/thermal throttling, or service queue >= queue_high:
  overloaded -> limit x backoff_ratio, and no growth until it clears;
- SM activity >= sm_active_high: saturated -> no growth (latency decides when to back off).
SM activity alone never lowers the limit: an LLM server is 'busy' with one request in flight.

Stale signal: no update for `stale_hold_s` + 2 intervals -> the limit is held (no growth, no GPU backoff)
for `stale_hold_s`, then the GPU signal is ignored and the latency controller runs alone. It never
means 'admit everything'. `gpu_signal_state()` says which ('fresh', 'stale_hold', 'stale_ignored', 'none').

Simple mode (the seed design): a rate factor of 1.0 / 0.7 / 0.4 / 0.0 when GPU saturation (SM activity,
else NVML utilization) is at or over 0.85 / 0.90 / 0.95 for `consecutive` readings in a row; it goes back
up one level after that many readings below the level's threshold, and one more level after as many again. With a stale signal it holds, then falls back to Gradient2.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ._config import ControllerConfig, SignalsConfig

__all__ = ["AdaptiveLimit", "GpuSignal"]

log = logging.getLogger("gpuscope.guard")


@dataclass(slots=True)
class GpuSignal:
    """One reading of the GPU (from the agent) and the service (its /metrics); None = not known."""

    time_s: float  # monotonic seconds when read
    sm_active_ratio: float | None = None  # SM activity 0..1 (GPM), else NVML utilization
    memory_free_ratio: float | None = None
    throttled: bool = False  # power or thermal clock limiting
    queue_waiting: float | None = None  # the service's waiting requests (vllm:num_requests_waiting)


class AdaptiveLimit:
    """The concurrency limit and (simple mode) the rate factor, fed by latency samples and GPU signals."""

    def __init__(self, ctl: ControllerConfig, sig: SignalsConfig, now: float) -> None:
        self.c = ctl
        self.s = sig
        self.limit = float(ctl.initial_limit) if ctl.mode != "fixed" else float(ctl.max_limit)
        self.rate_factor = 1.0
        self._long_s = 0.0
        self._long_n = 0
        self._win_sum = 0.0
        self._win_n = 0
        self._win_start = now
        self._win_inflight_max = 0
        self._last_signal: GpuSignal | None = None
        self._overloaded = False
        self._saturated = False
        self._steps = sorted((float(k), f) for k, f in ctl.steps.items())
        self._over = [0] * len(self._steps)  # consecutive readings over each threshold
        self._under = [0] * len(self._steps)
        self._level = -1  # index of the step in force (-1: none)
        self._stale_logged = False

    # -- signal ------------------------------------------------------------------------------
    def gpu_signal_state(self, now: float) -> str:
        sig = self._last_signal
        if sig is None:
            return "none"
        age = now - sig.time_s
        grace = 2 * self.s.interval_s
        if age <= grace:
            return "fresh"
        if age <= grace + self.s.stale_hold_s:
            return "stale_hold"
        return "stale_ignored"

    def gpu_signal_age_s(self, now: float) -> float:
        return math.inf if self._last_signal is None else max(0.0, now - self._last_signal.time_s)

    def observe_signal(self, sig: GpuSignal) -> None:
        if self._stale_logged:
            log.warning("gpuscope guard: the GPU signal is fresh again")
            self._stale_logged = False
        self._last_signal = sig
        s = self.s
        self._overloaded = bool(
            (sig.memory_free_ratio is not None and sig.memory_free_ratio <= s.memory_free_low)
            or sig.throttled
            or (sig.queue_waiting is not None and sig.queue_waiting >= s.queue_high))
        self._saturated = sig.sm_active_ratio is not None and sig.sm_active_ratio >= s.sm_active_high
        if self.c.mode == "fixed":
            return
        if self._overloaded:
            self.limit = max(self.c.min_limit, self.limit * s.backoff_ratio)
        if self.c.mode == "simple" and sig.sm_active_ratio is not None:
            self._step(sig.sm_active_ratio)

    def refresh(self, now: float) -> None:
        """Apply the staleness rules; the guard calls this a few times a second."""
        state = self.gpu_signal_state(now)
        if state in ("stale_hold", "stale_ignored"):
            self._note_stale()
            if state == "stale_ignored" and self.c.mode == "simple":
                self.rate_factor = 1.0  # the step mode needs the signal; the gradient limit takes over

    def _step(self, sat: float) -> None:
        n = self.c.consecutive
        for i, (threshold, _) in enumerate(self._steps):
            if sat >= threshold:
                self._over[i] += 1
                self._under[i] = 0
            else:
                self._under[i] += 1
                self._over[i] = 0
        level = self._level
        for i in range(len(self._steps) - 1, level, -1):  # step down: the highest threshold held n readings
            if self._over[i] >= n:
                level = i
                break
        if level == self._level and level >= 0 and self._under[level] >= n:
            level -= 1  # up one level after n readings below it; the next level needs n more
            self._under = [0] * len(self._steps)
        self._level = level
        self.rate_factor = 1.0 if level < 0 else self._steps[level][1]

    def _signal_blocks_growth(self, now: float) -> bool:
        state = self.gpu_signal_state(now)
        if state == "fresh":
            return self._overloaded or self._saturated
        if state == "stale_hold":
            self._note_stale()
            return True
        return False

    def _note_stale(self) -> None:
        if not self._stale_logged:
            log.warning("gpuscope guard: the GPU signal is stale; holding the limit for %.0f s, then the latency "
                        "controller runs alone", self.s.stale_hold_s)
            self._stale_logged = True

    # -- latency -----------------------------------------------------------------------------
    def observe(self, latency_s: float, inflight: int, dropped: bool, now: float) -> None:
        """One finished request: its latency (or TTFT), how many were in flight, whether it was a drop."""
        mode = self.c.mode
        if mode == "fixed":
            return
        if mode == "aimd":
            self._aimd(latency_s, inflight, dropped, now)
            return
        if mode == "simple" and self.gpu_signal_state(now) != "stale_ignored":
            return  # simple mode acts on the rate factor; the concurrency limit stays where it is
        self._gradient(latency_s, inflight, dropped, now)

    def _aimd(self, latency_s: float, inflight: int, dropped: bool, now: float) -> None:
        c = self.c
        if dropped or latency_s > c.timeout_s:
            self.limit = max(c.min_limit, self.limit * c.backoff_ratio)
        elif inflight * 2 >= self.limit and not self._signal_blocks_growth(now):
            self.limit = min(c.max_limit, self.limit + 1.0)

    def _gradient(self, latency_s: float, inflight: int, dropped: bool, now: float) -> None:
        c = self.c
        if dropped:
            latency_s = max(latency_s, c.timeout_s)  # a drop is a very slow sample, not a missing one
        self._win_sum += latency_s
        self._win_n += 1
        if inflight > self._win_inflight_max:
            self._win_inflight_max = inflight
        if self._win_n < c.window_samples and now - self._win_start < c.window_s:
            return
        short = self._win_sum / self._win_n
        inflight_max = self._win_inflight_max
        self._win_sum, self._win_n, self._win_start, self._win_inflight_max = 0.0, 0, now, 0
        if short <= 0:
            return
        if self._long_n == 0:
            self._long_s = short
        else:
            k = 2.0 / (min(self._long_n, c.long_window) + 1)  # EMA that warms up over the first samples
            self._long_s = self._long_s * (1 - k) + short * k
        self._long_n += 1
        if self._long_s / short > 2.0:
            self._long_s *= 0.95
        if inflight_max < self.limit / 2:
            return  # app-limited: the limit is not being tested, so latency says nothing about it
        gradient = max(0.5, min(1.0, c.rtt_tolerance * self._long_s / short))
        queue = math.sqrt(self.limit)
        if gradient >= 1.0 and self._signal_blocks_growth(now):
            queue = 0.0
            gradient = 1.0
        new = self.limit * gradient + queue
        new = self.limit * (1 - c.smoothing) + new * c.smoothing
        if self._signal_blocks_growth(now) and new > self.limit:
            new = self.limit
        self.limit = max(c.min_limit, min(c.max_limit, new))
