"""The monitor's background work: turn step marks into steps, join them with the GPU series, write the
step log, keep the run's figures and verdicts. Runs on the monitor's thread only; never on the caller's."""

from __future__ import annotations

import math
import os
import time
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any, Protocol

from .._records import Snapshot
from ._report import StepReport, VerdictShare
from ._steplog import FIELDS, StepLog
from ._tracks import NAN, Track

#: step field -> (series, how GPUs combine, which nominal window the series' values average over)
METRICS: dict[str, tuple[str, str, str]] = {
    "gpu_busy_ratio": ("gpu_sm_active_ratio", "mean", "gpm"),
    "tensor_active_ratio": ("gpu_tensor_active_ratio", "mean", "gpm"),
    "dram_active_ratio": ("gpu_dram_active_ratio", "mean", "gpm"),
    "nvml_utilization_ratio": ("gpu_utilization_ratio", "mean", "medium"),
    "power_watts": ("gpu_power_watts", "sum", "medium"),
    "memory_used_bytes": ("gpu_memory_used_bytes", "sum", "fast"),
}
_COVERAGE_FROM = ("gpu_busy_ratio", "nvml_utilization_ratio", "memory_used_bytes")
_WEIGHTED = ("gpu_busy_ratio", "nvml_utilization_ratio", "tensor_active_ratio", "dram_active_ratio", "power_watts")
VERDICT_WINDOW_S = 10.0
SLOW_WINDOW = 101  # steps in the running median a step is compared with


class SnapshotSource(Protocol):
    """Where GPU snapshots come from: the monitor's sampler (or one shared in the process)."""

    kind: str

    def new(self) -> list[tuple[float, Snapshot]]:
        """Snapshots not returned before, oldest first, each with its time in monotonic seconds."""
        ...

    def recent(self, seconds: float) -> list[Snapshot]:
        """The snapshots of the last `seconds` (for the diagnosis)."""
        ...


class SamplerSource:
    kind = "sampler"

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.last_ns = 0
        self.simulated: str | None = getattr(sampler, "simulated", None)
        self.config = sampler.config

    def new(self) -> list[tuple[float, Snapshot]]:
        hist = list(self.sampler.history)  # one C-level copy: safe against the sampler's appends
        off = time.time_ns() - time.monotonic_ns()  # snapshots carry wall-clock stamps
        out = []
        for s in reversed(hist):
            if s.time_ns <= self.last_ns:
                break
            out.append(((s.time_ns - off) / 1e9, s))
        out.reverse()
        if out:
            self.last_ns = out[-1][1].time_ns
        return out

    def recent(self, seconds: float) -> list[Snapshot]:
        hist = list(self.sampler.history)
        if not hist:
            return []
        since = hist[-1].time_ns - int(seconds * 1e9)
        k = len(hist)  # from the newest back: the window is ~100 of up to `history` (3000) snapshots
        while k > 0 and hist[k - 1].time_ns >= since:
            k -= 1
        return hist[k:]


@dataclass
class _Stats:
    durations: array = field(default_factory=lambda: array("d"))
    energies: array = field(default_factory=lambda: array("d"))
    seconds: float = 0.0
    weighted: dict[str, list[float]] = field(default_factory=lambda: {k: [0.0, 0.0] for k in _WEIGHTED})
    covered: float = 0.0
    energy: float = 0.0
    samples: list[float] = field(default_factory=lambda: [0.0, 0.0])  # count, seconds of steps that gave it
    tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])
    phases: Counter[str] = field(default_factory=Counter)
    slow: int = 0


class Joiner:
    def __init__(self, start_ns: int, source: SnapshotSource | None, *, log: StepLog | None = None,
                 devices: Any = None, warmup: int = 1, slow_factor: float = 1.5, pid: int | None = None) -> None:
        self.source = source
        self.log = log
        self.devices = devices
        self.warmup = warmup
        self.slow_factor = slow_factor
        self.pid = os.getpid() if pid is None else pid
        self.prev_end = start_ns
        self.pending: list[list[Any]] = []  # [start_ns, end_ns, samples, tokens, marks]
        self.phases: list[tuple[str, int, int]] = []
        self.loose_marks: list[tuple[int, str]] = []
        self.index = 0
        self.tracks: dict[str, dict[str, Track]] = {}
        self.last_snap: Snapshot | None = None
        self.last_snap_t = -math.inf
        self.recent: deque[float] = deque(maxlen=SLOW_WINDOW)
        self.stats = _Stats()
        self.verdict_counts: Counter[tuple[str, str]] = Counter()
        self.verdict_last: dict[tuple[str, str], Any] = {}
        self.next_verdict_t: float | None = None
        self.gpus_seen: list[str] = []
        self.latest: dict[str, Any] | None = None  # the latest joined batch (for metrics())
        self.log_error: str | None = None
        windows = {"fast": 0.1, "medium": 0.2, "gpm": 0.2}
        if source is not None:
            cfg = source.config  # type: ignore[attr-defined]
            windows = {"fast": cfg.interval, "medium": max(cfg.medium, cfg.interval), "gpm": cfg.gpm_window}
        self.windows = windows
        # A step is joined once every series has shown a window that ends after it.
        self.settle_s = max(windows.values()) + 2 * windows["fast"] + 0.02
        self.timeout_s = max(2.0, 4 * self.settle_s)

    # -- input ---------------------------------------------------------------------------------
    def feed(self, items: list[Any]) -> None:
        """Items from the caller's queue: an int (a step's end, ns), (end_ns, samples, tokens), or
        ('phase', name, t0, t1) / ('mark', name, t)."""
        for it in items:
            if isinstance(it, int):
                self.pending.append([self.prev_end, it, None, None, None])
                self.prev_end = it
            elif isinstance(it[0], int):
                self.pending.append([self.prev_end, it[0], it[1], it[2], None])
                self.prev_end = it[0]
            elif it[0] == "phase":
                self.phases.append((it[1], it[2], it[3]))
            elif it[0] == "mark":
                self.loose_marks.append((it[2], it[1]))

    def ingest(self) -> None:
        if self.source is None:
            return
        w = self.windows
        for t, snap in self.source.new():
            for g in snap.gpus:
                label = g.identity.label
                tracks = self.tracks.get(label)
                if tracks is None:
                    tracks = self.tracks[label] = {f: Track(w[win], w["fast"]) for f, (_, _, win) in METRICS.items()}
                vals = g.values if g.healthy else {}
                for f, (series, _, _) in METRICS.items():
                    tracks[f].add(t, vals.get(series))
            self.last_snap, self.last_snap_t = snap, t

    # -- joining -------------------------------------------------------------------------------
    def selected(self) -> list[str]:
        snap = self.last_snap
        if snap is None:
            return []
        labels = [g.identity.label for g in snap.gpus]
        d = self.devices
        if d == "all":
            return labels
        if d is not None:
            want = {str(x) for x in d}
            return [g.identity.label for g in snap.gpus if g.identity.label in want or g.identity.uuid in want]
        own = {p.gpu for p in snap.processes if p.pid == self.pid}
        return [lab for lab in labels if lab in own] or labels

    def process(self, final: bool = False) -> dict[str, Any] | None:
        """Join the steps whose GPU data is complete (all of them when `final`). Returns the batch as
        columns (lists; NaN where a number is unknown; `rows()` makes records)."""
        self.ingest()
        if not self.pending:
            return None
        now = time.monotonic()
        horizon = self.last_snap_t - self.settle_s
        n = 0
        for st in self.pending:
            end_s = st[1] / 1e9
            if not (final or self.source is None or end_s <= horizon or now - end_s > self.timeout_s):
                break
            n += 1
        if n == 0:
            return None
        batch = self.pending[:n]
        cols = self._join(batch)  # a failure here leaves the steps pending (joined again without GPU data)
        self.pending = self.pending[n:]
        self._account(cols)
        self._prune(batch[-1][1] / 1e9)
        if self.log is not None:
            try:
                self.log.write(cols)
            except Exception as e:  # noqa: BLE001 - a full disk loses the log, not the run
                self.log_error = f"writing the step log failed ({type(e).__name__}: {e}); it stops here"
                self.log = None
        self.latest = cols
        return cols

    def _join(self, batch: list[list[Any]]) -> dict[str, Any]:
        n = len(batch)
        starts = [b[0] / 1e9 for b in batch]
        ends = [b[1] / 1e9 for b in batch]
        dur = [max(e - s, 1e-12) for s, e in zip(starts, ends, strict=True)]
        labels = [lab for lab in self.selected() if lab in self.tracks]
        if labels:
            self.gpus_seen = labels
        off = (time.time_ns() - time.monotonic_ns()) / 1e9
        cols: dict[str, Any] = {"step": list(range(self.index, self.index + n)),
                                "start_time": [s + off for s in starts], "duration_s": dur}
        cov: list[float] | None = None
        for f, (_, agg, _) in METRICS.items():
            per_gpu = [self.tracks[lab][f].integrate(starts, ends) for lab in labels]
            means = [[i / k if k > 0 else NAN for i, k in zip(integ, known, strict=True)] for integ, known in per_gpu]
            if len(means) == 1:  # the usual case: one GPU's mean is the column, whether GPUs add or average
                col = means[0]
            elif means:
                col = [_combine(vals, agg == "mean") for vals in zip(*means, strict=True)]
            else:
                col = [NAN] * n
            cols[f] = col
            if cov is None and per_gpu and f in _COVERAGE_FROM and any(x == x for x in col):
                g = len(per_gpu)
                known = per_gpu[0][1] if g == 1 else [sum(ks) for ks in zip(*(k for _, k in per_gpu), strict=True)]
                cov = [min(1.0, k / g / d) for k, d in zip(known, dur, strict=True)]
        cols["energy_joules"] = [p * d for p, d in zip(cols["power_watts"], dur, strict=True)]
        cols["gpu_coverage_ratio"] = cov = cov if cov is not None else [0.0] * n
        samples = [b[2] if b[2] is None else _count(b[2]) for b in batch]
        tokens = [b[3] if b[3] is None else _count(b[3]) for b in batch]
        cols["samples"], cols["tokens"] = samples, tokens
        cols["samples_per_second"] = [NAN if x is None else x / d for x, d in zip(samples, dur, strict=True)]
        cols["tokens_per_second"] = [NAN if x is None else x / d for x, d in zip(tokens, dur, strict=True)]
        cols["phases"] = self._phase_seconds(batch)
        cols["marks"] = self._marks(batch)
        # Flags: warm-up, slow against the running median before this batch, short of GPU data.
        warm = max(0, min(n, self.warmup - self.index))
        med = sorted(self.recent)[len(self.recent) // 2] if len(self.recent) >= 5 else None
        slow_above = self.slow_factor * med if med is not None else math.inf
        check_cov = self.source is not None
        flags: list[list[str]] = []
        for i in range(n):
            fl = ["warmup"] if i < warm else (["slow"] if dur[i] > slow_above else [])
            if check_cov and cov[i] < 0.5:
                fl.append("no_gpu_data")
            flags.append(fl)
        cols["flags"] = flags
        cols["gpus"] = labels
        cols["warmup"] = warm
        self.recent.extend(dur[warm:])
        self.index += n
        return cols

    def _phase_seconds(self, batch: list[list[Any]]) -> list[dict[str, float]]:
        out: list[dict[str, float]] = [{} for _ in batch]
        if not self.phases:
            return out
        for name, p0, p1 in self.phases:
            for i, b in enumerate(batch):
                o = min(p1, b[1]) - max(p0, b[0])
                if o > 0:
                    out[i][name] = out[i].get(name, 0.0) + o / 1e9
        last_end = batch[-1][1]
        self.phases = [p for p in self.phases if p[2] > last_end]
        return out

    def _marks(self, batch: list[list[Any]]) -> list[list[str]]:
        out: list[list[str]] = [[] for _ in batch]
        if not self.loose_marks:
            return out
        keep = []
        for t, name in self.loose_marks:
            for i, b in enumerate(batch):
                if b[0] < t <= b[1]:
                    out[i].append(name)
                    break
            else:
                keep.append((t, name))
        self.loose_marks = [m for m in keep if m[0] > batch[-1][1]]
        return out

    def _account(self, cols: dict[str, Any]) -> None:
        s = self.stats
        w = cols["warmup"]
        d = cols["duration_s"][w:]
        if not d:
            return
        s.durations.extend(d)
        s.seconds += sum(d)
        c = [r * x for r, x in zip(cols["gpu_coverage_ratio"][w:], d, strict=True)]
        s.covered += sum(c)
        for k in _WEIGHTED:
            acc = s.weighted[k]
            for v, ci in zip(cols[k][w:], c, strict=True):
                if v == v and ci > 0:
                    acc[0] += v * ci
                    acc[1] += ci
        for e in cols["energy_joules"][w:]:
            if e == e:
                s.energies.append(e)
                s.energy += e
        for key, acc in (("samples", s.samples), ("tokens", s.tokens)):
            vals = cols[key][w:]
            if any(x is not None for x in vals):
                for x, sec in zip(vals, d, strict=True):
                    if x is not None:
                        acc[0] += x
                        acc[1] += sec
        for ph in cols["phases"][w:]:
            for name, sec in ph.items():
                s.phases[name] += sec
        s.slow += sum("slow" in f for f in cols["flags"][w:])

    def _prune(self, before: float) -> None:
        keep = before - 2 * self.settle_s
        if self.pending:
            keep = min(keep, self.pending[0][0] / 1e9)
        for tracks in self.tracks.values():
            for tr in tracks.values():
                tr.prune(keep)

    # -- diagnosis -----------------------------------------------------------------------------
    def diagnose(self, final: bool = False) -> None:
        """Every VERDICT_WINDOW_S of the run, the verdict over that window (what `gpuscope run` does)."""
        src = self.source
        if src is None or self.last_snap is None:
            return
        now = self.last_snap_t
        if self.next_verdict_t is None:
            self.next_verdict_t = now + VERDICT_WINDOW_S
        if not final and now < self.next_verdict_t:
            return
        from ..diagnose import diagnose, windows_from_snapshots
        from ..diagnose.thresholds import DEFAULT

        span = VERDICT_WINDOW_S if not final else VERDICT_WINDOW_S - (self.next_verdict_t - now)
        self.next_verdict_t = now + VERDICT_WINDOW_S
        snaps = src.recent(max(span, 0.0))
        if len(snaps) < 2 or (snaps[-1].time_ns - snaps[0].time_ns) / 1e9 < DEFAULT.min_window_s:
            return
        # Only this run's GPUs: a primary verdict is each GPU's own (the node-level ones are side verdicts).
        mine = set(self.selected())
        for v in diagnose([w for w in windows_from_snapshots(snaps) if w.gpu in mine]):
            if v.primary:
                self.verdict_counts[(v.gpu, v.kind)] += 1
                self.verdict_last[(v.gpu, v.kind)] = v

    # -- summary -------------------------------------------------------------------------------
    def report(self) -> StepReport:
        s = self.stats
        r = StepReport(steps=self.index, warmup_steps=min(self.index, self.warmup), pending_steps=len(self.pending))
        r.step_seconds_total = s.seconds
        if s.durations:
            d = sorted(s.durations)
            r.step_seconds_median = d[len(d) // 2]
            r.step_seconds_p90 = d[min(len(d) - 1, int(0.9 * len(d)))]
            r.step_seconds_mean = s.seconds / len(d)
        r.slow_steps = s.slow
        for k in _WEIGHTED:
            tot, w = s.weighted[k]
            if w > 0:
                setattr(r, k, tot / w)
        if s.seconds > 0 and self.source is not None:
            r.gpu_coverage_ratio = s.covered / s.seconds
        if s.energies:
            e = sorted(s.energies)
            r.energy_joules_per_step_median = e[len(e) // 2]
            r.energy_joules_total = s.energy
        if s.samples[1] > 0:
            r.samples_per_second = s.samples[0] / s.samples[1]
        if s.tokens[1] > 0:
            r.tokens_per_second = s.tokens[0] / s.tokens[1]
        if s.seconds > 0:
            r.phase_ratio = {k: v / s.seconds for k, v in s.phases.items()}
        per_gpu: dict[str, int] = Counter()
        for (gpu, _), n in self.verdict_counts.items():
            per_gpu[gpu] += n
        for (gpu, kind), n in sorted(self.verdict_counts.items(), key=lambda kv: (kv[0][0], -kv[1])):
            v = self.verdict_last[(gpu, kind)]
            r.verdicts.append(VerdictShare(gpu, kind, n / per_gpu[gpu], v.summary,
                                           v.recommendations[0] if v.recommendations else ""))
        r.gpus = list(self.gpus_seen)
        r.simulated = getattr(self.source, "simulated", None)
        r.source = self.source.kind if self.source is not None else "none"
        r.log_path = getattr(self.log, "path", None)
        return r

    def metrics(self) -> dict[str, float]:
        """The latest joined batch, averaged: what the callbacks log."""
        cols = self.latest
        if not cols or not cols["duration_s"]:
            return {}
        w = cols["warmup"] if cols["warmup"] < len(cols["duration_s"]) else 0
        d = cols["duration_s"][w:]
        out = {"step_seconds": sum(d) / len(d)}
        for k in ("gpu_busy_ratio", "nvml_utilization_ratio", "tensor_active_ratio", "power_watts"):
            pairs = [(v, x) for v, x in zip(cols[k][w:], d, strict=True) if v == v]
            if pairs:
                out[k] = sum(v * x for v, x in pairs) / sum(x for _, x in pairs)
        e = [x for x in cols["energy_joules"][w:] if x == x]
        if e:
            out["energy_joules_per_step"] = sum(e) / len(e)
        return out


def _count(x: Any) -> float | int | None:
    """samples/tokens as the user gave them to step(): a whole number stays an int, anything number-like
    (a 0-d tensor, a numpy float) a float, anything else None."""
    if isinstance(x, Integral) and not isinstance(x, bool):
        return int(x)
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _combine(vals: tuple[float, ...], mean: bool) -> float:
    """GPUs' values for one step: their mean or their sum, over the GPUs that had data (NaN if none)."""
    known = [v for v in vals if v == v]
    if not known:
        return NAN
    return sum(known) / len(known) if mean else sum(known)


def rows(cols: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A joined batch as one record per step (None where unknown), in the step log's field order."""
    if not cols:
        return []
    out = []
    for i in range(len(cols["step"])):
        r: dict[str, Any] = {}
        for k in FIELDS:
            v = cols[k] if k == "gpus" else cols[k][i]
            r[k] = None if isinstance(v, float) and math.isnan(v) else v
        out.append(r)
    return out
