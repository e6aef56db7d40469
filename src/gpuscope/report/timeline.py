"""The whole run's key series per GPU, in bounded memory.

The sampler keeps only its last few minutes; a report needs the whole run. `GpuTimeline` keeps every
sample while it fits (`max_points`, by default 6,144: ten minutes at 10 Hz) and then halves its
resolution by merging neighbouring buckets, so a 24 h run costs the same few MiB as a 10 min one.
Each bucket keeps the mean, min and max of every series (a short spike stays visible as a max) and,
for the clock-event bitmask, the OR of the masks seen.

    >>> tl = GpuTimeline(max_points=4)
    >>> for i in range(10):
    ...     tl.add(float(i), {"gpu_power_watts": float(i)})
    >>> len(tl), tl.samples_per_bucket
    (3, 4)
    >>> tl.points()["gpu_power_watts"]["max"]
    [3.0, 7.0, 9.0]
"""

from __future__ import annotations

import math
from array import array
from typing import Any

#: The series a run report keeps, in display order.
SERIES = ("gpu_sm_active_ratio", "gpu_tensor_active_ratio", "gpu_dram_active_ratio", "gpu_utilization_ratio",
          "gpu_pcie_rx_bytes_per_second", "gpu_pcie_tx_bytes_per_second", "gpu_power_watts",
          "gpu_memory_used_bytes", "gpu_sm_clock_hertz", "gpu_temperature_celsius",
          # the math pipes the verdicts read (tensor_cores_unused, memory_access_bound), so a recorded run replays them
          "gpu_fp32_active_ratio", "gpu_fp16_active_ratio", "gpu_fp64_active_ratio")
MASK = "gpu_clock_event_reasons"

NAN = float("nan")


def gpu_order(label: str) -> tuple[int, str]:
    """Sort key for GPU labels: by index ("2" before "10"), MIG instances ("0/1") beside their GPU."""
    head = str(label).split("/")[0]
    return (int(head) if head.isdigit() else 1 << 30, str(label))


class _Column:
    """Mean, min, max and count of one series per bucket."""

    __slots__ = ("mean", "lo", "hi", "n")

    def __init__(self) -> None:
        self.mean, self.lo, self.hi, self.n = array("d"), array("d"), array("d"), array("l")

    def append(self, v: float | None) -> None:
        if v is None or not math.isfinite(v):
            self._push(self, NAN, NAN, NAN, 0)
        else:
            self._push(self, v, v, v, 1)

    @staticmethod
    def _push(c: _Column, mean: float, lo: float, hi: float, n: int) -> None:
        c.mean.append(mean)
        c.lo.append(lo)
        c.hi.append(hi)
        c.n.append(n)

    def fold(self, i: int, v: float | None) -> None:
        """Add one more value to bucket i."""
        if v is None or not math.isfinite(v):
            return
        n = self.n[i]
        if n == 0:
            self.mean[i] = self.lo[i] = self.hi[i] = v
        else:
            self.mean[i] += (v - self.mean[i]) / (n + 1)
            self.lo[i], self.hi[i] = min(self.lo[i], v), max(self.hi[i], v)
        self.n[i] = n + 1

    def halve(self) -> None:
        """Merge buckets pairwise (a lone last bucket stays as it is). Runs on the sampler thread:
        one pass over paired slices, not an index walk."""
        m, lo, hi, n = self.mean, self.lo, self.hi, self.n
        out = _Column()
        for ma, mb, la, lb, ha, hb, na, nb in zip(m[0::2], m[1::2], lo[0::2], lo[1::2], hi[0::2], hi[1::2],
                                                  n[0::2], n[1::2], strict=False):
            if not nb:  # an empty bucket holds NaN and a count of 0: the other one stands as it is
                self._push(out, ma, la, ha, na)
            elif not na:
                self._push(out, mb, lb, hb, nb)
            else:
                self._push(out, (ma * na + mb * nb) / (na + nb), min(la, lb), max(ha, hb), na + nb)
        if len(n) % 2:
            self._push(out, m[-1], lo[-1], hi[-1], n[-1])
        self.mean, self.lo, self.hi, self.n = out.mean, out.lo, out.hi, out.n


class GpuTimeline:
    """One GPU's key series over a whole run. Times are seconds (any origin, e.g. since the run began)."""

    def __init__(self, max_points: int = 6144, series: tuple[str, ...] = SERIES) -> None:
        if max_points < 2:
            raise ValueError("max_points must be at least 2")
        self.max_points = max_points
        self.series = series
        self.samples_per_bucket = 1
        self.t_start, self.t_end = array("d"), array("d")
        self.cols = {k: _Column() for k in series}
        self.masks = array("q")
        self._in_last = 0  # samples in the last bucket so far
        self.samples = 0

    def __len__(self) -> int:
        return len(self.t_start)

    def add(self, t: float, values: dict[str, float]) -> None:
        self.samples += 1
        mask = values.get(MASK)
        m = int(mask) if mask is not None and math.isfinite(mask) else 0
        if self._in_last and self._in_last < self.samples_per_bucket:
            self._fold_last(t, values, m)
            return
        if len(self.t_start) >= self.max_points:
            self._halve()
            if self._in_last < self.samples_per_bucket:  # a lone last bucket has room again
                self._fold_last(t, values, m)
                return
        self.t_start.append(t)
        self.t_end.append(t)
        self.masks.append(m)
        for k, c in self.cols.items():
            c.append(values.get(k))
        self._in_last = 1

    def _fold_last(self, t: float, values: dict[str, float], mask: int) -> None:
        i = len(self.t_start) - 1
        self.t_end[i] = t
        for k, c in self.cols.items():
            c.fold(i, values.get(k))
        self.masks[i] |= mask
        self._in_last += 1

    def _halve(self) -> None:
        n = len(self.t_start)
        # The last bucket may be a lone one (odd count): it merges with nothing and keeps its own count.
        last_alone = n % 2 == 1
        self.t_start = self.t_start[0::2]
        t_end, masks = self.t_end[1::2], array("q", (a | b for a, b in zip(self.masks[0::2], self.masks[1::2],
                                                                           strict=False)))
        if last_alone:
            t_end.append(self.t_end[-1])
            masks.append(self.masks[-1])
        self.t_end, self.masks = t_end, masks
        for c in self.cols.values():
            c.halve()
        self._in_last = self._in_last if last_alone else self.samples_per_bucket + self._in_last
        self.samples_per_bucket *= 2

    def points(self) -> dict[str, Any]:
        """Plain lists for JSON and plots: t (bucket start), t_end, and per series mean/min/max
        (None where missing), plus the clock-event masks."""
        def clean(a: array) -> list[float | None]:
            return [None if math.isnan(v) else float(f"{v:.5g}") for v in a]

        return {
            "t": [round(v, 3) for v in self.t_start], "t_end": [round(v, 3) for v in self.t_end], "samples_per_bucket": self.samples_per_bucket,
            **{k: {"mean": clean(c.mean), "min": clean(c.lo), "max": clean(c.hi)} for k, c in self.cols.items()},
            MASK: list(self.masks),
        }

    def nbytes(self) -> int:
        """Memory held by the arrays (for tests and self-accounting)."""
        arrays: list[array[Any]] = [self.t_start, self.t_end, self.masks]
        for c in self.cols.values():
            arrays += [c.mean, c.lo, c.hi, c.n]
        return sum(a.itemsize * len(a) for a in arrays)
