"""Adaptive concurrency limits: a capacity estimate on latency (default) and AIMD, the GPU/queue signal on top,
the simple step mode.

Gradient (default): the limit is what the upstream holds without queueing (its capacity), times
`rtt_tolerance` (1.25: a queue of a quarter of the capacity inside the upstream keeps it busy; the rest waits
in the guard's priority queue, where priority acts). Per short window (`window_samples` completions spanning
at least 4 latencies, or `window_s`; a window does not span an idle spell) the mean latency `R` and the mean
concurrency `N` the upstream held (Little's law: the window's slot-seconds over its length; with TTFT as the
signal, the in-flight count at the releases), then `N / R` and `R` as the medians of the last three loaded
windows, so that one window a stall of this process bunched up moves nothing. Against the upstream's no-load latency `base`, `capacity = N * base / R` (at saturation
`R = N / C * base`, so this is the upstream's own concurrency C whatever the limit) and
`target = rtt_tolerance * capacity`; while R <= rtt_tolerance x base with the limit full, at least
`rtt_tolerance * L`; after a probe that left the capacity above its own limit unknown (no queue found, or an
estimate under the probe's own limit, as a foreign backlog's latency gives), `2 * L` while the completed
requests fill the limit (N >= 0.8 L) and no window shows a queue (R <= 1.1 x base) or drops (slow start,
once per window admitted wholly at the doubled limit; it ends at the first window that does). Growth with
no queue is taken at once (at most x2 a window); otherwise
`L <- L*(1-s) + target*s` (s = smoothing, at least 0.5 on the way down); a target under L/2 starts a probe
instead. Drops (timeouts,
deadlines, 429/503 from upstream) are no latency samples; a tenth of a window or more caps the target at
L x backoff_ratio, and a window of nothing but drops backs off by it. No change while fewer than L/2 are in
flight (the limit is not being tested); such a window confirms `base` when within 10 % of it.
`base` (no window under load is free of our own queue) comes from *probes*: at the start, after
`long_window` samples and 10 s under load without a confirmation, after a probe that may itself have queued,
and when the target falls under L/2 (congestion, or a no-load latency grown since it was measured), the
limit drops to 0.5 x the capacity estimate and the mean latency of the next `window_samples` requests that
found at most that many in flight when admitted (nothing of ours queued ahead of them) becomes `base`. If it
fell with the concurrency (under 0.9 R), there was a queue: `capacity = N * base / R` and the limit is set to
`rtt_tolerance x capacity` at once, and a probe whose own limit was 0.8 x that or more is repeated (lower);
if not, the upstream showed no queue at N and the limit goes to `rtt_tolerance x N` (never up), to grow
from there while nothing queues. A probe lasts at most
max(window_s, 4 latencies); one that gets no clean sample keeps its lower limit and is repeated. A lower
window mean under load is adopted as `base` at once (a queue only adds to it), and an app-limited window at
two in flight or fewer gives the first `base` as a probe would. The first window needs only one latency: it
just starts the first probe. Why not Gradient2's long-run average: it follows
the latency it causes, so under sustained overload the limit climbed to max_limit and the queue moved inside
the upstream, where priority cannot act; single-sample minima over-shed on noisy inference latency, so means
over windows are compared. `history` keeps the last 4096 updates (time, limit, base, capacity, event).

AIMD: a drop (rejected upstream, timeout, or latency over `timeout_s`) multiplies the limit by
`backoff_ratio`; otherwise +1 when at least half the limit is in flight.

With a service queue signal (`signals.queue_metric`, fresh), the service's own count of waiting requests says
whether there is a queue, not latency: an engine that batches shows latency rising with concurrency before
anything waits. Then a loaded window grows the limit x rtt_tolerance (at least +1) while nothing waits there and
the limit is full, holds it while fewer than queue_high wait, and starts no probe; queue_high backs it off as
below; drops (a tenth of a window) take the latency path.

GPU and queue signal (`GpuSignal`), applied at every signal update, whichever latency controller runs:
- memory free ratio <= memory_free_low, power/thermal throttling, service queue >= queue_high, or (with
  `tpot_slo_s`) the service's time per output token over it: overloaded -> limit x backoff_ratio, and no
  growth until it clears;
- SM activity >= sm_active_high, or the time per output token over tpot_hold x tpot_slo_s: saturated -> no
  growth (latency decides when to back off). An engine that batches takes every request into its batch while
  it has room, so nothing waits and TTFT stays low while each step of the batch, and so every streaming
  answer, slows down: on the H200 the limit that followed the service's queue held 64 in flight where the
  TPOT SLO wanted fewer. TPOT is the signal that says so.
SM activity alone never lowers the limit: an LLM server is 'busy' with one request in flight.

Stale signal: no update for `stale_hold_s` + 2 intervals -> the limit is held (no growth, no GPU backoff)
for `stale_hold_s`, then the GPU signal is ignored and the latency controller runs alone. It never
means 'admit everything'. `gpu_signal_state()` says which ('fresh', 'stale_hold', 'stale_ignored', 'none').

Simple mode (the seed design): a rate factor of 1.0 / 0.7 / 0.4 / 0.0 when GPU saturation (SM activity,
else NVML utilization) is at or over 0.85 / 0.90 / 0.95 for `consecutive` readings in a row; it goes back
up one level after that many readings below the level's threshold, and one more level after as many again. With a
stale signal it holds, then falls back to the gradient controller.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass

from ._config import ControllerConfig, SignalsConfig

__all__ = ["AdaptiveLimit", "GpuSignal"]

log = logging.getLogger("gpuscope.guard")

_PROBE_RATIO = 0.5  # a probe's limit, as a fraction of the capacity estimate: well below it, so no queue forms
_REPROBE_AT = 0.8  # a probe whose limit was at least this fraction of the capacity it found is repeated
_PROBE_EVERY_S = 10.0
_WINDOW_LATENCIES = 4  # a window spans this many latencies (up to window_s): fewer, and a batch finishing together
# inside or just outside it moves the concurrency seen by a whole batch  # re-measure the no-load latency this often (and long_window samples) under sustained load


@dataclass(slots=True)
class GpuSignal:
    """One reading of the GPU (from the agent) and the service (its /metrics); None = not known."""

    time_s: float  # monotonic seconds when read
    sm_active_ratio: float | None = None  # SM activity 0..1 (GPM), else NVML utilization
    memory_free_ratio: float | None = None
    throttled: bool = False  # power or thermal clock limiting
    queue_waiting: float | None = None  # the service's waiting requests (vllm:num_requests_waiting)
    tpot_s: float | None = None  # the service's time per output token (from its token counter, _signals.TpotMeter)


class AdaptiveLimit:
    """The concurrency limit and (simple mode) the rate factor, fed by latency samples and GPU signals."""

    def __init__(self, ctl: ControllerConfig, sig: SignalsConfig, now: float) -> None:
        self.c = ctl
        self.s = sig
        self.limit = float(ctl.initial_limit) if ctl.mode != "fixed" else float(ctl.max_limit)
        self.rate_factor = 1.0
        # gradient: the current short window
        self._win_sum = 0.0
        self._win_n = 0
        self._win_start = now
        self._win_inflight_max = 0
        self._win_inflight_sum = 0
        self._win_drops = 0
        self._win_first = now  # the earliest admission among the window's samples
        self._win_idle_at = math.inf  # when the last release left nothing in flight (inf: not since)
        self._doubled_at = -math.inf
        self._slow_start = False  # the last probe left the capacity above its limit unknown
        self._recent: deque[tuple[float, float]] = deque(maxlen=3)  # (N / R, R) of the latest windows
        self._win_n_closed = 0
        # gradient: the upstream's no-load latency (0: not measured yet), when a window last confirmed it, and
        # the samples since; the latest window's mean latency
        self.base_s = 0.0
        self._base_at_n = 0
        self._base_at_s = now
        self._samples = 0
        self._reprobe = True
        self.latency_s = 0.0
        self.capacity = 0.0  # the latest estimate of what the upstream holds without queueing
        # gradient: the probe under way ('' none, 'measure') and what it needs
        self.probing = ""
        self._probe_limit = 0.0
        self._probe_from = 0.0
        self._probe_start = 0.0
        self._probe_end = 0.0
        self._probe_sum = 0.0
        self._probe_n = 0
        self._pre = (0.0, 0.0, 0.0)  # (limit, mean in flight, mean latency) of the window that started it
        self.probes = 0
        # (monotonic s, limit, base_s, capacity, event) per update: 'window', 'probe', 'probed', 'probe_aborted',
        # 'drop', 'signal', 'service_queue'
        self.history: deque[tuple[float, float, float, float, str]] = deque(maxlen=4096)
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

    @property
    def last_signal(self) -> GpuSignal | None:
        """The latest GPU/service reading (None before the first)."""
        return self._last_signal

    def gpu_signal_age_s(self, now: float) -> float:
        return math.inf if self._last_signal is None else max(0.0, now - self._last_signal.time_s)

    def observe_signal(self, sig: GpuSignal) -> None:
        if self._stale_logged:
            log.warning("gpuscope guard: the GPU signal is fresh again")
            self._stale_logged = False
        self._last_signal = sig
        s = self.s
        tpot = sig.tpot_s if s.tpot_slo_s > 0 else None
        self._overloaded = bool(
            (sig.memory_free_ratio is not None and sig.memory_free_ratio <= s.memory_free_low)
            or sig.throttled
            or (sig.queue_waiting is not None and sig.queue_waiting >= s.queue_high)
            or (tpot is not None and tpot > s.tpot_slo_s))
        self._saturated = bool((sig.sm_active_ratio is not None and sig.sm_active_ratio >= s.sm_active_high)
                               or (tpot is not None and tpot > s.tpot_hold * s.tpot_slo_s))
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
    def observe(self, latency_s: float, inflight: int, dropped: bool, now: float,
                admitted_with: int | None = None) -> None:
        """One finished request: its latency (or TTFT), how many were in flight (before its release), whether it
        was a drop, and how many were in flight when it was admitted (None: not known)."""
        mode = self.c.mode
        if mode == "fixed":
            return
        if mode == "aimd":
            self._aimd(latency_s, inflight, dropped, now)
            return
        if mode == "simple" and self.gpu_signal_state(now) != "stale_ignored":
            return  # simple mode acts on the rate factor; the concurrency limit stays where it is
        self._gradient(latency_s, inflight, dropped, now, admitted_with)

    def _aimd(self, latency_s: float, inflight: int, dropped: bool, now: float) -> None:
        c = self.c
        if dropped or latency_s > c.timeout_s:
            self.limit = max(c.min_limit, self.limit * c.backoff_ratio)
        elif inflight * 2 >= self.limit and not self._signal_blocks_growth(now):
            self.limit = min(c.max_limit, self.limit + 1.0)

    def typical_latency_s(self) -> float:
        """The latency a slot is held for, as the gradient controller last saw it (0 before any window)."""
        return self.latency_s or self.base_s

    def _gradient(self, latency_s: float, inflight: int, dropped: bool, now: float, admitted_with: int | None
                  ) -> None:
        c = self.c
        self._samples += 1
        if self.probing:
            self._probe_sample(latency_s, inflight, dropped, now, admitted_with)
            return
        if self._win_n and now - latency_s > self._win_idle_at + self._win_sum / self._win_n:
            # this one started over a latency after the guard had nothing in flight: the window so far is from
            # before that idle spell, and its span would count time in which the upstream held nothing; afresh
            self._win_sum, self._win_n, self._win_start, self._win_inflight_max = 0.0, 0, now - latency_s, 0
            self._win_inflight_sum = self._win_drops = 0
        self._win_idle_at = now if inflight <= 1 else math.inf
        if inflight > self._win_inflight_max:
            self._win_inflight_max = inflight
        if dropped:
            # a timeout, a deadline or an overload answer: its latency is no measure of the upstream's (a
            # deadline's is a floor, a quick 503's says nothing), so it only counts as a drop
            self._win_drops += 1
        else:
            if self._win_n == 0 or now - latency_s < self._win_first:
                self._win_first = now - latency_s
            self._win_sum += latency_s
            self._win_n += 1
            self._win_inflight_sum += inflight
        # from the window's start, or from its first sample's admission when that came later (after a pause)
        elapsed = now - max(self._win_start, self._win_first) if self._win_n else now - self._win_start
        # the first window only has to start the first probe (whose errors later probes correct): one latency
        span_latencies = _WINDOW_LATENCIES if self.base_s else 1
        if elapsed < c.window_s and (self._win_n < c.window_samples or elapsed < span_latencies * (
                self.base_s or self._win_sum / self._win_n)):
            return
        if self._win_n == 0:  # nothing but drops for window_s: back off
            self._win_start, self._win_inflight_max, self._win_drops = now, 0, 0
            self.limit = max(c.min_limit, self.limit * c.backoff_ratio)
            self.history.append((now, self.limit, self.base_s, self.capacity, "drop"))
            return
        self._close_window(now)

    def _close_window(self, now: float) -> None:
        """The window is complete: what it says of the upstream, and what the limit does about it."""
        c = self.c
        r = self._win_sum / self._win_n
        first = self._win_first
        self._win_n_closed = self._win_n
        span = now - max(self._win_start, self._win_first)
        # the mean concurrency the upstream held: Little's law on what completed (its slot-seconds over the
        # window), or with TTFT as the signal (the slot outlives the sample) the in-flight count at releases
        n_mean = (self._win_sum / span if span > 0 else 0.0) if c.signal == "latency" else \
            self._win_inflight_sum / self._win_n
        inflight_max, drops = self._win_inflight_max, self._win_drops
        self._win_sum, self._win_n, self._win_start, self._win_inflight_max = 0.0, 0, now, 0
        self._win_inflight_sum = self._win_drops = 0
        if r <= 0 or n_mean <= 0:
            return
        self.latency_s = r
        if not drops and self.base_s and r < self.base_s:
            self.base_s = r  # the no-load latency is at most this: adopted (a queue inside only adds to it)
        if inflight_max < self.limit / 2:
            # app-limited: the limit is not being tested, so latency says nothing about it; but nothing of ours
            # queued inside the upstream either, so this latency is the no-load latency: confirmed, or (at two
            # in flight or fewer, as good as a probe) the first measure of it
            if not drops and self.base_s and r <= self.base_s * 1.1:
                self._base_at_n = self._samples
                self._base_at_s = now
            elif not drops and not self.base_s and inflight_max <= 2:
                self.base_s = r
                self._base_at_n = self._samples
                self._base_at_s = now
            self._recent.clear()
            return
        if self._service_queue_fresh(now) and drops < 0.1 * (drops + self._win_n_closed):
            self._follow_service_queue(inflight_max, now)
            return
        # the estimates below come from the median of the last three loaded windows' rate (N / R, completions
        # per second with the latency signal) and latency: a window that a stall of this process bunched up or
        # thinned out (a loaded machine) moves nothing on its own
        r_win, n_win = r, n_mean
        self._recent.append((n_mean / r, r))
        x = statistics.median(v[0] for v in self._recent)
        r = statistics.median(v[1] for v in self._recent)
        n_mean = x * r
        if self._reprobe or not self.base_s or (self._samples - self._base_at_n > c.long_window
                                                 and now - self._base_at_s >= _PROBE_EVERY_S):
            self._start_probe(n_mean, r, now)
            return
        self.capacity = n_mean * self.base_s / r
        target = c.rtt_tolerance * self.capacity
        if r <= c.rtt_tolerance * self.base_s and inflight_max >= 0.9 * self.limit:
            # the limit is full and latency is still within what rtt_tolerance allows: more is allowed, whatever
            # the estimate says (latency the upstream adds whatever the concurrency, such as a busy event loop's,
            # lowers the estimate; slots held by requests that are not in the upstream, lost or stuck until their
            # deadline, count for the limit but not for it)
            target = max(target, c.rtt_tolerance * self.limit)
        if drops or max(r, r_win) > 1.1 * self.base_s:
            self._slow_start = False  # a queue (or drops): the capacity is in sight
        elif self._slow_start and n_win >= 0.8 * self.limit and first >= self._doubled_at:
            # slow start, after a probe that left the capacity unknown above its limit (it found no queue, or an
            # estimate under what it held itself, as after a foreign backlog drained): the requests that
            # completed filled the limit (Little's law: slots held by requests lost on the way or stuck until
            # their deadline are not in it) and neither this window nor the last three show a queue inside the
            # upstream, so its capacity is above the limit by an unknown amount: double, until the first window
            # that shows a queue. Once per window admitted wholly at the doubled limit, so a queue the doubling
            # built is seen before the next one (+25 % a window took 6 windows from 2 to 8 after a drain, while
            # high priority's queue waited)
            target = max(target, 2.0 * self.limit)
            self._doubled_at = now
        if target < 0.5 * self.limit:
            # halve the limit or worse: real congestion, or a no-load latency that has grown since it was
            # measured (longer requests); a probe tells them apart and lands on the right limit at once
            self._start_probe(n_mean, r, now)
            return
        if drops >= 0.1 * (drops + self._win_n_closed):
            # drops are a tenth of the window or more: overload the latency may not show (the upstream refuses
            # or stalls); a few lost requests are not
            target = min(target, self.limit * c.backoff_ratio)
        target = min(self.limit * 2.0, target)
        if target > self.limit and self._signal_blocks_growth(now):
            target = self.limit
        if target > self.limit and r <= 1.1 * self.base_s:
            new = target  # no queue at all: grow at once (up to x2 a window), as after a backlog or a slow spell
        elif target < self.limit:
            # a queue over the target: come down at least halfway a window (what is over it waits in the upstream,
            # where priority cannot act)
            s = max(c.smoothing, 0.5)
            new = self.limit * (1 - s) + target * s
        else:
            new = self.limit * (1 - c.smoothing) + target * c.smoothing
        self.limit = max(c.min_limit, min(c.max_limit, new))
        self.history.append((now, self.limit, self.base_s, self.capacity, "drop" if drops else "window"))

    def _service_queue_fresh(self, now: float) -> bool:
        sig = self._last_signal
        return sig is not None and sig.queue_waiting is not None and self.gpu_signal_state(now) == "fresh"

    def _follow_service_queue(self, inflight_max: int, now: float) -> None:
        """The service says how many wait in it (its queue signal, fresh): that, not latency, says whether there is
        a queue. An engine that batches (vLLM, TGI) shows latency, and TTFT most, rising with every request it
        takes into its batch while its throughput rises too: on the example service TTFT went 17 -> 25 -> 57 ->
        121 -> 211 ms from 1 to 16 in flight with nothing waiting, so Little's law on latency put its capacity
        at 1.1-1.4 and held the limit at 2 of its 16. So while nothing waits there the limit grows, x rtt_tolerance
        (at least +1) a window while it is full; while some wait but fewer than queue_high it holds; at queue_high
        observe_signal backs it off (x backoff_ratio a reading). No probe: the no-load latency is not needed."""
        c = self.c
        sig = self._last_signal
        assert sig is not None and sig.queue_waiting is not None
        if sig.queue_waiting < 1 and inflight_max >= 0.9 * self.limit and not self._signal_blocks_growth(now):
            self.limit = max(c.min_limit, min(c.max_limit, max(self.limit + 1.0, c.rtt_tolerance * self.limit)))
        self._slow_start = False
        self._recent.clear()
        self.history.append((now, self.limit, self.base_s, self.capacity, "service_queue"))

    def _start_probe(self, n_mean: float, r: float, now: float) -> None:
        """Lower the limit until the upstream holds no queue, to measure its no-load latency."""
        c = self.c
        capacity = n_mean * self.base_s / r if self.base_s and self.base_s < r else n_mean
        probe = max(c.min_limit, min(self.limit, _PROBE_RATIO * capacity))
        self._pre = (self.limit, n_mean, r)
        self._probe_limit = probe
        self._probe_start = now
        self._probe_from = now + r
        self._probe_end = now + max(c.window_s, 4 * r)
        self._probe_sum, self._probe_n = 0.0, 0
        self.probing = "measure"
        self.probes += 1
        self.limit = probe
        self.history.append((now, self.limit, self.base_s, capacity, "probe"))

    def _probe_sample(self, latency_s: float, inflight: int, dropped: bool, now: float, admitted_with: int | None
                      ) -> None:
        # a probe sample is a request that found at most the probe's limit in flight when admitted (one over
        # tolerated), so nothing of ours queued ahead of it inside the upstream;
        # without that count, one admitted a latency after the probe began, when what was in flight has left
        if not dropped and now - latency_s >= self._probe_start and (
                admitted_with <= self._probe_limit + 1 if admitted_with is not None
                else now - latency_s >= self._probe_from):
            self._probe_sum += latency_s
            self._probe_n += 1
        if self._probe_n >= self.c.window_samples or now >= self._probe_end:
            self._end_probe(now)

    def _end_probe(self, now: float) -> None:
        c = self.c
        pre_limit, n_mean, r = self._pre
        self.probing = ""
        self._recent.clear()  # windows at the old limit say nothing of the new one
        self._win_sum, self._win_n, self._win_start, self._win_inflight_max = 0.0, 0, now, 0
        self._win_inflight_sum = self._win_drops = 0
        self._base_at_n = self._samples
        self._base_at_s = now
        self._reprobe = False
        if self._probe_n < min(3, c.window_samples):
            # nothing came back unqueued in time (what was in flight has not drained: a backlog ahead of us, a
            # stalled upstream): the probe's lower limit stays, and the next loaded window probes again
            self._reprobe = True
            self.history.append((now, self.limit, self.base_s, self.capacity, "probe_aborted"))
            return
        base = self._probe_sum / self._probe_n
        self.base_s = base
        if base < 0.9 * r:
            # the latency fell with the concurrency, as a queue's does: there was a queue at n_mean, and the
            # upstream holds n_mean * base / r without one
            self.capacity = n_mean * base / r
            # the probe itself held its limit without a queue, so the upstream holds at least that: an estimate
            # under it came from a latency that was not our queue's (a foreign backlog ahead of us), and slow
            # start finds the capacity instead
            self._slow_start = self.capacity < self._probe_limit
            # a probe whose limit was near that may have queued too: measure again, lower
            self._reprobe = self._probe_limit >= _REPROBE_AT * self.capacity and self._probe_limit > c.min_limit
            target = c.rtt_tolerance * self.capacity
        else:
            # no queue at n_mean (or a transient): the upstream holds at least that; from rtt_tolerance x that
            # (never above where it was) the windows grow while nothing queues
            self.capacity = n_mean
            self._slow_start = True
            target = min(pre_limit, max(self._probe_limit, c.rtt_tolerance * n_mean))
        if target > pre_limit and self._signal_blocks_growth(now):
            target = pre_limit
        self.limit = max(c.min_limit, min(c.max_limit, min(target, 2.0 * pre_limit)))
        self.history.append((now, self.limit, self.base_s, self.capacity, "probed"))
