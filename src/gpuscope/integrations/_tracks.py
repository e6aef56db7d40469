"""A GPU series as piecewise-constant segments in time, and the step join over them.

What a sampled value means: GPM metrics are averages over the window between two GPM samples, NVML
utilization and power averages over the driver's own period. The sampler reads them on its ticks and
keeps the last value in between, so a value first seen at tick t covers (the previous window's end,
t]; the same value seen again on the next ticks is the same window read again. A `Track` turns that
into segments. At a change, the new value covers the nominal window before it (the time between the
last boundary and that window keeps the previous value). A repeat counts only once more than the
longest window has passed (a window is the nominal one or one tick longer: GPM drops a sample that
comes a hair early), and then the same-valued window is taken to have ended one tick earlier, when a
repeat can first be seen. With windows of exactly the nominal length this is exact; otherwise a
boundary is off by at most one tick.

Joining is exact for piecewise-constant values: a step's value is the overlap-weighted mean of the
segments it spans.
"""

from __future__ import annotations

import bisect
import math

NAN = float("nan")


class Track:
    """One series of one GPU. `b` are boundaries (monotonic seconds), `v[i]` the value on (b[i], b[i+1]]
    (NaN: unknown there)."""

    __slots__ = ("window", "tick", "repeat_after", "b", "v", "last")

    def __init__(self, window: float, tick: float) -> None:
        self.window = window  # the nominal period this series' values average over, seconds
        self.tick = tick  # the sampler's interval
        self.repeat_after = window + 0.75 * tick  # a repeat this late shows a new window
        self.b: list[float] = []
        self.v: list[float] = []
        self.last: float | None = None

    def add(self, t: float, value: float | None) -> None:
        b, v = self.b, self.v
        if b and t <= b[-1]:
            return
        if value is None or math.isnan(value):
            if self.last is not None:  # the series stopped (unsupported now, GPU lost): unknown since
                b.append(t)
                v.append(NAN)
            self.last = None
            return
        if self.last is None:
            start = t - self.window
            if not b:
                b.append(start)
            elif start > b[-1]:
                b.append(start)
                v.append(NAN)
            b.append(t)
            v.append(value)
            self.last = value
            return
        if value != self.last:
            start = t - self.window
            if start > b[-1]:
                b.append(start)
                v.append(self.last)
            b.append(t)
            v.append(value)
            self.last = value
        elif t - b[-1] >= self.repeat_after:
            b.append(max(t - self.tick, b[-1] + 0.5 * self.tick))
            v.append(value)

    @property
    def known_until(self) -> float:
        return self.b[-1] if self.b else -math.inf

    def prune(self, before: float) -> None:
        """Forget segments that end before `before`."""
        k = bisect.bisect_left(self.b, before) - 1
        if k > 0:
            del self.b[:k]
            del self.v[:k]

    def integrate(self, starts: list[float], ends: list[float]) -> tuple[list[float], list[float]]:
        """For steps [start, end] (sorted, not overlapping): (∫ v dt over the known part, the known seconds).

        A merge walk in plain Python: steps are usually shorter than a window, so most take one segment;
        for the few dozen steps of one pass this beats numpy's per-call cost."""
        b, v = self.b, self.v
        nb = len(b)
        if nb < 2 or not starts:
            z = [0.0] * len(starts)
            return z, list(z)
        integ_out, known_out = [], []
        j = max(0, bisect.bisect_right(b, starts[0]) - 1)
        last = nb - 1
        for s, e in zip(starts, ends, strict=True):
            while j < last - 1 and b[j + 1] <= s:
                j += 1
            if j < last and b[j] <= s and e <= b[j + 1]:  # within one segment: most steps
                val = v[j]
                if val == val and e > s:
                    integ_out.append(val * (e - s))
                    known_out.append(e - s)
                else:
                    integ_out.append(0.0)
                    known_out.append(0.0)
                continue
            integ = known = 0.0
            k = j
            while k < last and b[k] < e:
                lo = b[k] if b[k] > s else s
                hi = b[k + 1] if b[k + 1] < e else e
                if hi > lo:
                    val = v[k]
                    if val == val:  # not NaN
                        integ += val * (hi - lo)
                        known += hi - lo
                k += 1
            integ_out.append(integ)
            known_out.append(known)
        return integ_out, known_out
