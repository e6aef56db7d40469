"""Baselines and anomalies: is this GPU doing what it usually does, and what its peers do?

Two comparisons, both robust (median and MAD, so one bad hour or one broken GPU does not move the
reference):

- **against its own history**: per GPU x metric x workload (the job's command line without rank
  numbers, or the process name), the medians of past windows form the baseline. A window whose
  median lies more than `z` scaled MADs away (and more than the metric's smallest meaningful
  difference) is unusual; `sustain` unusual windows in a row in the same direction are a change;
- **against its peers**: GPUs doing the same work at the same time should look alike. Peers run the
  same job (the command line without rank numbers) and have the same workload signature (the same
  primary verdict: compute-bound, memory-bound, ...; a node running different work on each GPU has
  no peers to compare). A GPU that does *worse* than its peers, by more than `z` MADs from their
  median (and the metric's smallest difference), is an outlier: less work, a slower clock, less
  power, a hotter die, more memory held. A GPU doing more than its peers is not a problem.

Each finding is a side verdict (`anomaly`, `peer_outlier`) whose summary says it in words:
"GPU 3's SM clock (1.41 GHz) is 29 % below its usual 1.98 GHz for this job (median of 212 windows)";
differences of ratios are in percentage points ("28.0 pp below the 90.0 %").
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The metrics compared, how to say them, and the smallest difference that matters (MAD floor):
#: below it, a change is noise however many MADs it is (a constant series has MAD 0).
METRICS: dict[str, tuple[str, str, float]] = {
    "gpu_sm_active_ratio": ("SM activity", "ratio", 0.05),
    "gpu_tensor_active_ratio": ("tensor-pipe activity", "ratio", 0.05),
    "gpu_dram_active_ratio": ("DRAM bandwidth use", "ratio", 0.05),
    "gpu_power_watts": ("power", "W", 15.0),
    "gpu_sm_clock_hertz": ("SM clock", "Hz", 50e6),
    "gpu_temperature_celsius": ("temperature", "°C", 3.0),
    "gpu_pcie_rx_bytes_per_second": ("PCIe receive rate", "B/s", 500e6),
    "gpu_memory_used_bytes": ("memory used", "B", 1 << 30),
}
#: Which way a GPU is worse than its peers on one job: -1 below them (less work done, a slower clock,
#: less power drawn, less data received), +1 above them (hotter, nearer running out of memory).
WORSE: dict[str, int] = {
    "gpu_sm_active_ratio": -1, "gpu_tensor_active_ratio": -1, "gpu_dram_active_ratio": -1, "gpu_power_watts": -1,
    "gpu_sm_clock_hertz": -1, "gpu_temperature_celsius": 1, "gpu_pcie_rx_bytes_per_second": -1,
    "gpu_memory_used_bytes": 1,
}
MAD_SCALE = 1.4826  # MAD x this estimates the standard deviation of normal data


def fmt(value: float, unit: str) -> str:
    if unit == "ratio":
        return f"{value * 100:.1f} %"
    if unit == "Hz":
        return f"{value / 1e9:.2f} GHz"
    if unit == "B/s":
        return f"{value / 1e9:.2f} GB/s"
    if unit == "B":
        return f"{value / 2**30:.1f} GiB"
    return f"{value:.0f} {unit}"


def robust(xs: list[float]) -> tuple[float, float]:
    """Median and scaled MAD."""
    med = statistics.median(xs)
    return med, MAD_SCALE * statistics.median(abs(x - med) for x in xs)


def workload_key(processes: Iterable[Any]) -> str:
    """What a GPU runs: its largest process's command line without digits (ranks, ports, pids), or
    its name; '' when nothing runs (idle is a workload of its own)."""
    procs = sorted(processes, key=lambda p: -(getattr(p, "gpu_memory_bytes", None) or 0.0))
    if not procs:
        return ""
    p = procs[0]
    text = (getattr(p, "cmdline", "") or getattr(p, "name", "") or "")
    return " ".join("".join(c for c in text if not c.isdigit()).split())[:200]


@dataclass
class Finding:
    gpu: str
    kind: str  # 'anomaly' or 'peer_outlier'
    metric: str
    value: float
    reference: float  # the baseline's or the peers' median
    score: float  # signed robust z-score
    count: int  # windows in the baseline, or peers
    summary: str
    sustained: int = 1  # unusual windows in a row (anomaly)


def _diff_words(value: float, ref: float, unit: str) -> str:
    if unit == "ratio":  # a difference of two shares is in points: 62 % against 90 % is 28 pp, not 31 %
        return f"{abs(value - ref) * 100:.1f} pp {'above' if value > ref else 'below'}"
    if ref and unit != "°C":
        pct = (value - ref) / abs(ref) * 100
        return f"{abs(pct):.0f} % {'above' if pct > 0 else 'below'}"
    return f"{fmt(abs(value - ref), unit)} {'above' if value > ref else 'below'}"


def _window_medians(w: Any) -> dict[str, float]:
    out = {}
    for m in METRICS:
        vals = [v for v in w.series.get(m, []) if v is not None and math.isfinite(v)]
        if vals:
            out[m] = statistics.median(vals)
    return out


class Baselines:
    """Per GPU x metric x workload, the medians of the last `keep` windows; persisted as JSON.

    At most `max_jobs` workloads per GPU are remembered: past it, the one seen longest ago is forgotten,
    so a node whose jobs all differ (a run id in every command line) keeps a bounded memory and file."""

    def __init__(self, keep: int = 500, min_windows: int = 20, z: float = 4.0, sustain: int = 3,
                 max_jobs: int = 64) -> None:
        self.keep, self.min_windows, self.z, self.sustain = keep, min_windows, z, sustain
        self.max_jobs = max_jobs
        self.forgotten = 0  # workloads forgotten to keep the bound
        self._hist: dict[tuple[str, str, str], deque[float]] = {}
        self._streak: dict[tuple[str, str, str], int] = {}
        self._jobs: dict[str, OrderedDict[str, None]] = {}  # per GPU, its workloads, the one seen last at the end

    def _seen(self, gpu: str, job: str) -> None:
        jobs = self._jobs.setdefault(gpu, OrderedDict())
        jobs[job] = None
        jobs.move_to_end(job)
        while len(jobs) > self.max_jobs:
            old, _ = jobs.popitem(last=False)
            self.forgotten += 1
            for m in METRICS:
                self._hist.pop((gpu, m, old), None)
                self._streak.pop((gpu, m, old), None)

    def observe(self, windows: Iterable[Any], learn: bool = True) -> list[Finding]:
        """Compare each window with its baseline, then (with `learn`) add it to the baseline.

        A window found unusual is not learnt until the change has lasted `keep // 10` windows,
        so a fault does not become normal within minutes, while a lasting change (a new model,
        a new batch size) becomes the new normal in time."""
        found = []
        for w in windows:
            if not getattr(w, "healthy", True):
                continue
            job = workload_key(w.processes)
            self._seen(w.gpu, job)
            for m, value in _window_medians(w).items():
                key = (w.gpu, m, job)
                hist = self._hist.setdefault(key, deque(maxlen=self.keep))
                name, unit, floor = METRICS[m]
                unusual = 0
                if len(hist) >= self.min_windows:
                    med, mad = robust(list(hist))
                    score = (value - med) / max(mad, floor / self.z)
                    if abs(score) >= self.z and abs(value - med) >= floor:
                        unusual = 1 if score > 0 else -1
                        prev = self._streak.get(key, 0)
                        streak = prev + unusual if prev * unusual > 0 else unusual
                        self._streak[key] = streak
                        if abs(streak) >= self.sustain:
                            found.append(Finding(
                                w.gpu, "anomaly", m, value, med, score, len(hist),
                                f"GPU {w.gpu}'s {name} ({fmt(value, unit)}) is {_diff_words(value, med, unit)} its "
                                f"usual {fmt(med, unit)}" + (" for this job" if job else " when idle")
                                + f" (median of {len(hist)} windows; {abs(streak)} windows in a row).",
                                abs(streak)))
                    else:
                        self._streak[key] = 0
                if learn and (not unusual or abs(self._streak.get(key, 0)) >= max(self.sustain, self.keep // 10)):
                    hist.append(value)
        return found

    # -- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "series": [{"gpu": g, "metric": m, "job": j, "medians": list(h)}
                                         for (g, m, j), h in self._hist.items()]}

    def save(self, path: str | Path) -> None:
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".baselines-")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, **kw: Any) -> Baselines:
        """The baselines saved at `path`; empty ones when there is no file. A damaged file is
        reported (ValueError with one sentence), never half-read."""
        b = cls(**kw)
        path = Path(path)
        if not path.exists():
            return b
        try:
            data = json.loads(path.read_text())
            for s in data["series"]:
                if s["metric"] in METRICS:
                    b._hist[(str(s["gpu"]), s["metric"], str(s["job"]))] = deque(
                        (float(x) for x in s["medians"]), maxlen=b.keep)
                    b._seen(str(s["gpu"]), str(s["job"]))
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise ValueError(f"The baselines file {path} is damaged ({e.__class__.__name__}); "
                             "move it away to start new baselines.") from None
        return b


def peer_outliers(windows: Iterable[Any], z: float = 4.0, min_peers: int = 3,
                  signatures: dict[str, str] | None = None) -> list[Finding]:
    """GPUs that do worse than the others doing the same work right now.

    Peers run the same job (workload_key) with the same signature: `signatures` maps a GPU to its
    primary verdict kind (diagnose() passes the ones it found; None classifies the windows here)."""
    ws = [w for w in windows if getattr(w, "healthy", True) and w.processes]
    if signatures is None:
        signatures = _primary_kinds(ws)
    jobs: dict[tuple[str, str], list[Any]] = {}
    for w in ws:
        jobs.setdefault((workload_key(w.processes), signatures.get(w.gpu, "")), []).append(w)
    found = []
    for peers in jobs.values():
        if len(peers) < min_peers:
            continue
        meds = {w.gpu: _window_medians(w) for w in peers}
        for m, (name, unit, floor) in METRICS.items():
            vals = {g: d[m] for g, d in meds.items() if m in d}
            if len(vals) < min_peers:
                continue
            for g, v in vals.items():
                others = [x for h, x in vals.items() if h != g]
                med, mad = robust(others)
                score = (v - med) / max(mad, floor / z)
                if score * WORSE[m] >= z and abs(v - med) >= floor:
                    found.append(Finding(
                        g, "peer_outlier", m, v, med, score, len(others),
                        f"GPU {g}'s {name} ({fmt(v, unit)}) is {_diff_words(v, med, unit)} the "
                        f"{fmt(med, unit)} of the {len(others)} other GPUs running the same job."))
    return found


def _primary_kinds(windows: list[Any]) -> dict[str, str]:
    """Each GPU's primary verdict kind, its workload signature."""
    from .rules import classify
    from .thresholds import DEFAULT
    from .windows import Verdict

    return {w.gpu: next((v.kind for v in classify(w, DEFAULT, Verdict) if v.primary), "") for w in windows}


def as_verdicts(findings: Iterable[Finding], verdict: Any, t0: float = 0.0, t1: float = 0.0) -> list[Any]:
    """Findings as side verdicts (warning), with their numbers as evidence."""
    advice = {
        "anomaly": "Something changed on this GPU or in the job: compare its clocks, throttle reasons, "
                   "temperature and the job's configuration with an earlier run.",
        "peer_outlier": "One GPU does worse than its peers on the same work: check its clocks and throttle "
                        "reasons, cooling, PCIe/NVLink link state and its share of the data.",
    }
    return [verdict(f.gpu, f.kind, "warning", round(min(1.0, abs(f.score) / 10), 2), f.summary,
                    {"metric": f.metric, "value": f.value, "reference": f.reference, "robust_z": round(f.score, 2),
                     "compared_with": f.count, **({"windows_in_a_row": f.sustained} if f.kind == "anomaly" else {})},
                    [advice[f.kind]], t0, t1, False) for f in findings]


class Tracker:
    """Feeds a running sampler's windows into Baselines every `every_s` on its own thread, keeps the
    latest findings for readers, and saves the baselines to `path` now and then and at stop.
    Never raises into the sampler; a failure is logged once per kind."""

    def __init__(self, sampler: Any, path: str | Path | None, every_s: float = 30.0, save_every_s: float = 600.0,
                 baselines: Baselines | None = None) -> None:
        self.sampler, self.path, self.every_s, self.save_every_s = sampler, path, every_s, save_every_s
        self.baselines = baselines if baselines is not None else (
            Baselines.load(path) if path is not None else Baselines())
        self.findings: list[Finding] = []
        self.windows = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpuscope-baselines", daemon=True)
        self._log = logging.getLogger("gpuscope.baselines")
        self._logged: set[str] = set()

    def start(self) -> Tracker:
        self._thread.start()
        return self

    def step(self) -> list[Finding]:
        """One window: the last `every_s` of the sampler's history."""
        from .windows import windows_from_snapshots

        cutoff = time.time_ns() - int(self.every_s * 1e9)
        snaps = [s for s in list(self.sampler.history) if s.time_ns >= cutoff]
        if len(snaps) < 3:
            return self.findings
        self.findings = self.baselines.observe(windows_from_snapshots(snaps))
        self.windows += 1
        return self.findings

    def _loop(self) -> None:
        last_save = time.monotonic()
        while not self._stop.wait(self.every_s):
            try:
                self.step()
                if self.path is not None and time.monotonic() - last_save >= self.save_every_s:
                    self.baselines.save(self.path)
                    last_save = time.monotonic()
            except Exception as e:  # noqa: BLE001 - a baseline is never worth the agent
                if type(e).__name__ not in self._logged:
                    self._logged.add(type(e).__name__)
                    self._log.warning("baselines: %s", e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.path is not None:
            try:
                self.baselines.save(self.path)
            except OSError as e:
                self._log.warning("baselines not saved: %s", e)
