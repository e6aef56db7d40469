"""What the GPUs did during a load test, on the run's clock, and what it cost per request.

    >>> import time
    >>> from gpuscope.loadtest.gpu import GpuWatch
    >>> w = GpuWatch(simulate="healthy", clock=(time.time(), time.perf_counter()))
    >>> w.start(); time.sleep(0.3); readings = w.stop()
    >>> w.source.startswith("simulated") and len(readings) >= 2
    True

Where the readings come from, first that works:
1. a running gpuscope agent (`agent_url`): its /api/v1/latest is polled at twice the rate of the faster
   of the agent's sampler and `hz`, and each new snapshot is kept once. An agent that samples slower than
   `hz` is read anyway, at its own rate, and `source` says so: the agent may watch another host's GPUs
   (the server's), which sampling here could not replace.
2. this host's GPUs, through gpuscope's own sampler (GPM SM activity, NVML utilisation, memory, power,
   the energy counter, clock-event reasons), a little faster than `hz` so that one late tick does not
   drop the rate below it. `simulate` names a scenario of the simulated node to use instead of this
   host's GPUs, as everywhere in gpuscope (its readings are labelled "simulated").
3. nothing, and `source` says why.

Agent readings come in wall time and are moved to the run's clock with the `clock` pair (see
records.py). The watch never raises into the load test; its memory is bounded (when full it keeps every
other reading and from then on reads at half the rate, so a long run stays covered from start to end).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .client import shown_url
from .records import GpuReading

log = logging.getLogger("gpuscope.loadtest.gpu")

MAX_TICKS = 200_000  # ticks kept (each one reading per GPU): 5.5 h at 10 Hz before halving the rate
# The clock-event reasons that slow the work, most serious first; the first one set is "the" reason.
_THROTTLE_ORDER = ("hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal", "sw_power_cap", "board_limit",
                   "reliability", "applications_clocks", "sync_boost", "display_clock")


def main_throttle(reasons: Sequence[str]) -> str | None:
    """The most serious clock-event reason that holds the clocks down, or None (an idle GPU is not throttled)."""
    for name in _THROTTLE_ORDER:
        if name in reasons:
            return name
    return None


def reading_from_values(t: float, gpu: str, values: Mapping[str, float], reasons: Sequence[str],
                        memory_total_bytes: float | None, source: str) -> GpuReading:
    """One GpuReading from a sampler record's series values (catalog names, base units)."""
    total = values.get("gpu_memory_total_bytes") or memory_total_bytes
    used = values.get("gpu_memory_used_bytes")
    return GpuReading(
        t=t, gpu=gpu, sm_active=values.get("gpu_sm_active_ratio"), nvml_util=values.get("gpu_utilization_ratio"),
        mem_used_frac=(used / total) if used is not None and total else None,
        power_w=values.get("gpu_power_watts"), energy_j=values.get("gpu_energy_joules_total"),
        throttle=main_throttle(reasons), source=source)


def _label(identity: Mapping[str, Any]) -> str:
    if identity.get("parent_index") is None:
        return str(identity.get("index", "?"))
    return f"{identity['parent_index']}/mig{identity.get('gpu_instance_id')}"


class GpuWatch:
    """Reads the GPUs in a thread from start() to stop(); `source` says from where, or why nothing."""

    def __init__(self, agent_url: str | None = None, token: str | None = None, hz: float = 10.0,
                 simulate: str | None = None, clock: tuple[float, float] | None = None, *,
                 gpus: Sequence[str] | None = None, max_ticks: int = MAX_TICKS, nvml: Any = None) -> None:
        self.agent_url = agent_url.rstrip("/") if agent_url else None
        self.agent_shown = shown_url(self.agent_url) if self.agent_url else ""  # what is written: no password
        self.token = token
        self.hz = hz if hz and hz > 0 else 10.0
        self.simulate = simulate
        self.clock = clock or (time.time(), time.perf_counter())
        self.max_ticks = max(2, max_ticks)
        # Only these GPU labels ("0", "1", "0/mig1"): a service on GPU 0 of an 8-GPU node would otherwise
        # have its SM activity averaged with seven idle GPUs and their power added to its joules per token.
        self.gpus = frozenset(gpus) if gpus else None
        self.labels_seen: set[str] = set()
        self._nvml = nvml  # a FakeNVML for tests; None: the real one
        self.source = "not started"
        self._ticks: list[list[GpuReading]] = []
        self._stride = 1  # keep every stride-th tick (doubles each time memory fills)
        self._seen = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampler: Any = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Find a source and start reading it. Never raises: on failure `source` says why."""
        try:
            self._start()
        except Exception as e:  # noqa: BLE001 - the load test goes on without GPU data
            log.warning("GPU readings failed to start: %s", e)
            self.source = f"no GPU data: reading the GPUs failed ({e})"

    def stop(self) -> list[GpuReading]:
        """Stop reading; the readings, oldest first, times in seconds since the run's start."""
        self._stop.set()
        try:
            self._say_unmatched()
        except Exception:  # noqa: BLE001 - a note only
            pass
        try:
            if self._thread is not None:
                self._thread.join(timeout=5.0)
            if self._sampler is not None:
                self._sampler.stop()
        except Exception as e:  # noqa: BLE001
            log.warning("stopping the GPU readings failed: %s", e)
        with self._lock:
            return [r for tick in self._ticks for r in tick]

    def _start(self) -> None:
        why: list[str] = []
        if self.agent_url:
            try:
                status = self._get("/api/v1/status", timeout=3.0)
                interval = float(status.get("sampler", {}).get("interval_s") or 0.1)
            except Exception as e:  # noqa: BLE001 - any failure: say it and fall back
                why.append(f"the agent at {self.agent_shown} did not answer ({_short(e)})")
            else:
                sim = f", simulated scenario {status['simulated']}" if status.get("simulated") else ""
                self.source = f"agent {self.agent_shown} (every {interval * 1000:g} ms{sim})"
                if interval > 1.0 / self.hz * 1.01:
                    self.source = (f"agent {self.agent_shown} (it samples every {interval * 1000:g} ms, slower than "
                                   f"the {self.hz:g} Hz asked; read at its own rate{sim})")
                poll = max(0.02, min(interval, 1.0 / self.hz) / 2)
                self._thread = threading.Thread(target=self._poll_agent, args=(poll,), daemon=True,
                                                name="gpuscope-loadtest-gpu")
                self._thread.start()
                return
        from ..sampler import Sampler, SamplerConfig
        from ..sources.gpm import MIN_WINDOW_S

        interval = 0.95 / self.hz
        cfg = SamplerConfig.for_interval(interval, gpm_window=max(MIN_WINDOW_S, interval), collect_processes=False,
                                         collect_host=False, events=False, history=2)
        try:
            if self.simulate:
                sampler = Sampler(cfg, simulate=self.simulate)
                label = f"simulated ({sampler.simulated})"
            else:
                sampler = Sampler(cfg, nvml=self._nvml)
                label = "nvml"
            sampler.open()
            if not sampler.devices:
                sampler.stop()
                raise RuntimeError("no GPU was found")
        except Exception as e:  # noqa: BLE001 - NvmlUnavailable, UnknownScenario, ...
            why.append(f"this host's GPUs could not be read ({_short(e)})" if not self.simulate
                       else f"the simulated node could not start ({_short(e)})")
            self.source = "no GPU data: " + "; ".join(why)
            return
        total = {d.label: d.identity.memory_total_bytes for d in sampler.devices}
        mono0 = self.clock[1]

        def on_tick(snap: Any) -> None:
            t = time.perf_counter() - mono0
            self._add([reading_from_values(t, g.identity.label, g.values, g.throttle_reasons,
                                           total.get(g.identity.label), label) for g in snap.gpus if g.healthy])

        sampler.subscribe(on_tick)
        self._sampler = sampler
        prefix = "; ".join(why) + "; read instead: " if why else ""
        n = len(sampler.devices)
        which = f"{n} GPU{'s' if n != 1 else ''}"
        if self.gpus is not None:
            which = f"GPU {', '.join(sorted(self.gpus & set(total)))} of {n}" if self.gpus & set(total) else which
        self.source = f"{prefix}{label} ({which}, every {interval * 1000:.0f} ms)"
        sampler.start()

    def _say_unmatched(self) -> None:
        """With --gpus, name the asked GPUs that were never read (a typo, or a GPU of another host)."""
        if self.gpus is None or not self.labels_seen:
            return
        missing = sorted(self.gpus - self.labels_seen)
        if not missing:
            return
        have = ", ".join(sorted(self.labels_seen))
        if len(missing) == len(self.gpus):
            self.source = (f"no GPU data: --gpus {','.join(missing)} matched none of the GPUs read from "
                           f"{self.source.split(' (')[0]} ({have})")
        else:
            self.source += f"; --gpus {','.join(missing)} matched no GPU (there are {have})"

    # -- reading -------------------------------------------------------------------------------
    def _add(self, tick: list[GpuReading]) -> None:
        if not tick:
            return
        if self.gpus is not None:
            self.labels_seen.update(r.gpu for r in tick)
            tick = [r for r in tick if r.gpu in self.gpus]
            if not tick:
                return
        with self._lock:
            self._seen += 1
            if self._seen % self._stride:
                return
            self._ticks.append(tick)
            if len(self._ticks) >= self.max_ticks:
                self._ticks = self._ticks[::2]
                self._stride *= 2

    def _get(self, path: str, timeout: float) -> Any:
        assert self.agent_url is not None
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        req = urllib.request.Request(self.agent_url + path, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def _poll_agent(self, poll_s: float) -> None:
        wall0 = self.clock[0]
        last_ns = 0
        failures = 0
        src = f"agent {self.agent_shown}"
        while not self._stop.wait(poll_s):
            try:
                snap = self._get("/api/v1/latest", timeout=2.0)
                failures = 0
            except Exception as e:  # noqa: BLE001 - a busy agent: try again next poll
                failures += 1
                if failures == 1:
                    log.warning("reading the agent at %s failed: %s", self.agent_shown, _short(e))
                continue
            try:
                ns = int(snap.get("time_ns", 0))
                if ns <= last_ns:
                    continue
                last_ns = ns
                t = ns / 1e9 - wall0
                if snap.get("simulated"):
                    src = f"agent {self.agent_shown} (simulated)"
                tick = []
                for g in snap.get("gpus", []):
                    if not g.get("healthy", True):
                        continue
                    ident = g.get("identity", {})
                    tick.append(reading_from_values(t, _label(ident), g.get("values", {}), g.get("throttle_reasons", []),
                                                    ident.get("memory_total_bytes"), src))
                self._add(tick)
            except Exception as e:  # noqa: BLE001 - a snapshot we cannot read: skip it
                log.debug("an agent snapshot could not be read: %s", e)


def _short(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return str(e) or type(e).__name__


# -- joining readings to stages ------------------------------------------------------------------
def _by_gpu(readings: Sequence[GpuReading]) -> dict[str, list[GpuReading]]:
    out: dict[str, list[GpuReading]] = {}
    for r in readings:
        out.setdefault(r.gpu, []).append(r)
    for rs in out.values():
        rs.sort(key=lambda r: r.t)
    return out


def _series(rs: Sequence[GpuReading], get: Callable[[GpuReading], float | None]) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r.t, v) for r in rs if (v := get(r)) is not None]
    if not pts:
        return np.empty(0), np.empty(0)
    a = np.asarray(pts, dtype=float)
    return a[:, 0], a[:, 1]


def _energy_j(rs: Sequence[GpuReading], t0: float, t1: float) -> tuple[float | None, str]:
    """Joules one GPU used in [t0, t1]: the counter interpolated at both ends, else power integrated
    (trapezoid) over the readings; clipped to the time the readings cover."""
    t, e = _series(rs, lambda r: r.energy_j)
    if len(t) >= 2 and e[-1] > e[0]:
        a, b = max(t0, t[0]), min(t1, t[-1])
        if b > a:
            return float(np.interp(b, t, e) - np.interp(a, t, e)), "counter"
    t, p = _series(rs, lambda r: r.power_w)
    if len(t) >= 2:
        a, b = max(t0, t[0]), min(t1, t[-1])
        if b > a:
            inside = (t > a) & (t < b)
            tt = np.concatenate(([a], t[inside], [b]))
            pp = np.concatenate(([np.interp(a, t, p)], p[inside], [np.interp(b, t, p)]))
            return float(np.sum((pp[1:] + pp[:-1]) / 2 * np.diff(tt))), "power"
    return None, ""


def gpu_stats(readings: Sequence[GpuReading], t0: float, t1: float, stats: Mapping[str, Any] | None = None
              ) -> dict[str, Any]:
    """The GPUs over [t0, t1): SM activity mean/p95, memory max, power, throttling, energy and its cost."""
    groups = _by_gpu(readings)
    inside = {g: [r for r in rs if t0 <= r.t < t1] for g, rs in groups.items()}
    every = [r for rs in inside.values() for r in rs]
    out: dict[str, Any] = {"readings": len(every), "gpus": len([g for g, rs in inside.items() if rs])}
    if not every:
        return out
    sm = [r.sm_active for r in every if r.sm_active is not None]
    util = [r.nvml_util for r in every if r.nvml_util is not None]
    mem = [r.mem_used_frac for r in every if r.mem_used_frac is not None]
    out["sm_active_mean"] = float(np.mean(sm)) if sm else None
    out["sm_active_p95"] = float(np.percentile(sm, 95)) if sm else None
    out["nvml_util_mean"] = float(np.mean(util)) if util else None
    out["mem_used_frac_max"] = float(max(mem)) if mem else None
    # Node power: the sum of each GPU's mean (GPUs may have different numbers of readings).
    per_gpu_power = [float(np.mean(p)) for rs in inside.values() if (p := [r.power_w for r in rs if r.power_w is not None])]
    out["power_w_mean"] = float(sum(per_gpu_power)) if per_gpu_power else None
    reasons = [r.throttle for r in every]
    throttled = [x for x in reasons if x]
    out["throttled_frac"] = len(throttled) / len(reasons)
    out["throttle_reason"] = max(set(throttled), key=throttled.count) if throttled else None
    energy, how = 0.0, set()
    for rs in groups.values():
        e, h = _energy_j(rs, t0, t1)
        if e is not None:
            energy += e
            how.add(h)
    out["energy_j"] = energy if how else None
    out["energy_from"] = "counter" if how == {"counter"} else ("power" if how == {"power"} else
                                                                ("counter+power" if how else None))
    if out["gpus"] > 1:
        out["per_gpu"] = {g: _one_gpu(rs, groups[g], t0, t1) for g, rs in sorted(inside.items()) if rs}
    if stats and out["energy_j"] is not None:
        done = stats.get("completed") or 0
        tokens = stats.get("output_tokens") or 0
        out["j_per_request"] = out["energy_j"] / done if done else None
        out["j_per_output_token"] = out["energy_j"] / tokens if tokens else None
    return out


def _one_gpu(inside: Sequence[GpuReading], every: Sequence[GpuReading], t0: float, t1: float) -> dict[str, Any]:
    """One GPU's figures over [t0, t1) (`inside`: its readings there; `every`: all of its readings)."""
    def mean(get: Callable[[GpuReading], float | None]) -> float | None:
        v = [x for r in inside if (x := get(r)) is not None]
        return float(np.mean(v)) if v else None

    mem = [r.mem_used_frac for r in inside if r.mem_used_frac is not None]
    return {"sm_active_mean": mean(lambda r: r.sm_active), "nvml_util_mean": mean(lambda r: r.nvml_util),
            "mem_used_frac_max": float(max(mem)) if mem else None, "power_w_mean": mean(lambda r: r.power_w),
            "energy_j": _energy_j(every, t0, t1)[0]}


IDLE = 0.01  # a GPU whose SM activity (else NVML utilisation) never rose above this did no work for the run


def idle_gpus(readings: Sequence[GpuReading], t0: float, t1: float) -> list[str]:
    """The GPUs that stayed idle over [t0, t1]: most likely not the service's."""
    out = []
    for g, rs in _by_gpu(readings).items():
        inside = [r for r in rs if t0 <= r.t <= t1]
        busy = [r.sm_active if r.sm_active is not None else r.nvml_util for r in inside]
        busy = [b for b in busy if b is not None]
        if busy and max(busy) <= IDLE:
            out.append(g)
    return sorted(out)


def join_stages(summary: dict[str, Any], readings: Sequence[GpuReading], source: str | None = None) -> None:
    """Add a "gpu" dict to every stage of `summary` and to its "overall", in place. `source` (the watch's)
    is kept as summary["gpu_source"] so that a report without readings can say why."""
    if source is not None:
        summary["gpu_source"] = source
    elif readings and "gpu_source" not in summary:
        summary["gpu_source"] = readings[0].source
    stages = summary.get("stages") or []
    for st in stages:
        st["gpu"] = gpu_stats(readings, float(st["start_s"]), float(st["end_s"]), st.get("stats"))
    if stages:
        t0 = min(float(st["start_s"]) for st in stages)
        t1 = max(float(st["end_s"]) for st in stages)
    else:
        t0, t1 = 0.0, float(summary.get("duration_s") or 0.0)
    overall = summary.get("overall")
    if isinstance(overall, dict):
        k = summary.get("overall_stage")  # a capacity search: "overall" is the trial at the capacity found
        if isinstance(k, int) and 0 <= k < len(stages):
            overall["gpu"] = stages[k]["gpu"]
        else:
            overall["gpu"] = gpu_stats(readings, t0, t1 + 1e-9, overall)
    summary.pop("gpu_note", None)
    idle, every = idle_gpus(readings, t0, t1), sorted({r.gpu for r in readings})
    if idle and len(idle) == len(every):
        summary["gpu_note"] = ("every GPU read stayed idle through the run: is the service on another host, or "
                               "on GPUs the reader cannot see?")
    elif idle:
        busy = ",".join(g for g in every if g not in idle)
        summary["gpu_note"] = (f"GPU {', '.join(idle)} stayed idle through the run; the GPU figures include "
                               f"{'it' if len(idle) == 1 else 'them'} (SM activity averaged, power and energy added): "
                               f"--gpus {busy} leaves {'it' if len(idle) == 1 else 'them'} out (also with --report-from)")
