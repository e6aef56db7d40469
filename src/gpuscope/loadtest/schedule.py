"""Load shapes as stages, and the intended send time of every open-loop request.

A stage is either open-loop (a request rate, possibly ramping, with an arrival process) or closed-loop (a
number of requests in flight, possibly ramping: see `Stage.slot_span`). Open-loop arrivals are drawn in "operational time" with unit rate
(constant gaps of 1, exponential gaps for Poisson, Gamma(shape=b, scale=1/b) gaps for bursty traffic, as
vLLM's `--burstiness` defines it) and mapped to real time through the stage's integrated rate, so a ramp
keeps its arrival process's shape while its rate changes.

    >>> stages = ladder([10, 20], duration_s=2.0)
    >>> times = intended_times(stages, seed=1)
    >>> len(times[0]) > 0
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import timeparse
from .._files import load_json, load_yaml
from ..errors import UsageError

ARRIVALS = ("constant", "poisson", "gamma")
RAMPS = ("linear", "exp")


class ScheduleError(UsageError, ValueError):
    """A stage or stage file that cannot be run; the message is one sentence for the user."""


@dataclass(frozen=True, slots=True)
class Stage:
    duration_s: float | None           # None: ends after `requests` requests
    rate: float | None = None          # open loop: requests per second at the stage's start
    ramp_to: float | None = None       # rate (open loop) or concurrency (closed loop) at the stage's end
    ramp: str = "linear"               # "linear" or "exp" (exponential)
    concurrency: int | None = None     # closed loop: requests in flight (at the stage's start, if it ramps)
    arrival: str = "poisson"
    burstiness: float = 1.0            # gamma shape b: 1 = Poisson, large = constant, < 1 = burstier
    requests: int | None = None        # a request count instead of (or as well as) a duration
    name: str = ""
    warmup: bool = False

    @property
    def open_loop(self) -> bool:
        return self.concurrency is None

    def peak_rate(self) -> float:
        return max(self.rate or 0.0, self.ramp_to or 0.0)

    def concurrency_end(self) -> int | None:
        """Closed loop: the concurrency at the stage's end (its concurrency when it does not ramp)."""
        if self.open_loop:
            return None
        return int(self.ramp_to) if self.ramp_to is not None else self.concurrency

    def concurrency_at(self, t_s: float) -> float:
        """Closed loop: the intended concurrency `t_s` seconds into the stage, before rounding."""
        c0 = float(self.concurrency or 0)
        if self.ramp_to is None or not self.duration_s:
            return c0
        f = min(max(t_s / self.duration_s, 0.0), 1.0)
        if self.ramp == "exp":
            return c0 * (self.ramp_to / c0) ** f
        return c0 + (self.ramp_to - c0) * f

    def slot_span(self, k: int) -> tuple[float, float]:
        """Closed loop: when slot `k` (1-based) of the stage may send, as (from, until) seconds into the stage.

        At any moment the slots that may send are the first round(concurrency_at(t)) ones, so a ramp
        adds a slot each time the intended concurrency passes k - 0.5 (and a ramp down retires one there:
        it sends nothing new, its request in flight finishes). A stage without a ramp: (0, inf).

        >>> [Stage(10.0, concurrency=1, ramp_to=3).slot_span(k) for k in (1, 2, 3)]
        [(0.0, inf), (2.5, inf), (7.5, inf)]
        >>> Stage(10.0, concurrency=3, ramp_to=1).slot_span(3)
        (0.0, 2.5)
        """
        c0, c1 = int(self.concurrency or 0), self.concurrency_end() or 0
        if k <= min(c0, c1) or c0 == c1 or not self.duration_s:
            return 0.0, math.inf
        if self.ramp == "exp":
            f = math.log((k - 0.5) / c0) / math.log(c1 / c0)
        else:
            f = (k - 0.5 - c0) / (c1 - c0)
        at = self.duration_s * f
        return (at, math.inf) if c1 > c0 else (0.0, at)

    def rate_at(self, t_s: float) -> float:
        """The intended rate (req/s) `t_s` seconds into the stage."""
        r0 = self.rate or 0.0
        if self.ramp_to is None or not self.duration_s:
            return r0
        f = min(max(t_s / self.duration_s, 0.0), 1.0)
        if self.ramp == "exp":
            return r0 * (self.ramp_to / r0) ** f
        return r0 + (self.ramp_to - r0) * f


def parse_duration(text: str | float | int) -> float:
    """'30s', '2m', '500ms', '1h', '1d' or a number of seconds -> seconds: the grammar of every verb
    (gpuscope.timeparse); 0 is allowed here, and a stage then refuses it with its own sentence."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    try:
        return timeparse.parse_duration(str(text), allow_zero=True)
    except timeparse.TimeError:
        raise ScheduleError(f"'{text}' is not a duration (examples: 30s, 2m, 500ms, 1h, 1d).") from None


def ladder(values: list[float], duration_s: float, *, closed_loop: bool = False, arrival: str = "poisson",
           burstiness: float = 1.0) -> list[Stage]:
    """A step ladder: one stage per value, each `duration_s` long (rates, or concurrencies if closed_loop)."""
    if closed_loop:
        return [Stage(duration_s, concurrency=int(v), name=f"c={int(v)}") for v in values]
    return [Stage(duration_s, rate=float(v), arrival=arrival, burstiness=burstiness, name=f"{v:g}/s")
            for v in values]


def spike(base: float, peak: float, at_s: float, length_s: float, total_s: float, **kw: Any) -> list[Stage]:
    """A constant base rate with one spike to `peak` at `at_s` for `length_s` seconds."""
    if at_s + length_s > total_s:
        raise ScheduleError("The spike must end before the run does (--spike AT + LENGTH <= --duration).")
    out = [Stage(at_s, rate=base, name="base", **kw)] if at_s > 0 else []
    out.append(Stage(length_s, rate=peak, name="spike", **kw))
    if total_s - at_s - length_s > 0:
        out.append(Stage(total_s - at_s - length_s, rate=base, name="after", **kw))
    return out


def validate(stage: Stage) -> Stage:
    if stage.arrival not in ARRIVALS:
        raise ScheduleError(f"Unknown arrival '{stage.arrival}'; use one of {', '.join(ARRIVALS)}.")
    if stage.ramp not in RAMPS:
        raise ScheduleError(f"Unknown ramp '{stage.ramp}'; use linear or exp.")
    if stage.duration_s is None and stage.requests is None:
        raise ScheduleError("Every stage needs a duration or a request count.")
    if stage.duration_s is not None and not stage.duration_s > 0:
        raise ScheduleError("A stage's duration must be more than 0 seconds.")
    if stage.requests is not None and stage.requests < 1:
        raise ScheduleError("A stage's request count must be at least 1.")
    if stage.open_loop:
        if stage.rate is None or not stage.rate > 0 or not math.isfinite(stage.rate):
            raise ScheduleError("An open-loop stage needs a rate above 0 requests per second.")
        if stage.ramp_to is not None and not (stage.ramp_to > 0 and math.isfinite(stage.ramp_to)):
            raise ScheduleError("A ramp's target rate must be above 0 requests per second.")
        if stage.ramp_to is not None and stage.duration_s is None:
            raise ScheduleError("A ramp needs a duration.")
        if stage.arrival == "gamma" and not stage.burstiness > 0:
            raise ScheduleError("Burstiness must be above 0 (1 is Poisson).")
    else:
        if stage.concurrency is None or stage.concurrency < 1:
            raise ScheduleError("A closed-loop stage needs a concurrency of at least 1.")
        if stage.ramp_to is not None and not (math.isfinite(stage.ramp_to) and stage.ramp_to >= 1
                                              and float(stage.ramp_to).is_integer()):
            raise ScheduleError("A closed-loop ramp's target concurrency must be a whole number of at least 1.")
        if stage.ramp_to is not None and stage.duration_s is None:
            raise ScheduleError("A ramp needs a duration.")
        if stage.duration_s is None and stage.requests is None:
            raise ScheduleError("A closed-loop stage needs a duration or a request count.")
    return stage


def load_stage_file(path: str | Path, *, default_arrival: str = "poisson", burstiness: float = 1.0) -> list[Stage]:
    """Read a YAML or JSON list of {duration, rate | concurrency, arrival, ramp_to, ramp, requests, name}."""
    what = f"the stage file {path}"
    if str(path).endswith(".json"):
        data = load_json(path, what, error=ScheduleError)
    else:
        data = load_yaml(path, what, error=ScheduleError)
    if isinstance(data, dict) and "stages" in data:
        data = data["stages"]
    if not isinstance(data, list) or not data:
        raise ScheduleError(f"The stage file {path} must hold a non-empty list of stages.")
    stages = []
    known = {"duration", "rate", "concurrency", "arrival", "ramp_to", "ramp", "requests", "name", "burstiness"}
    for n, item in enumerate(data, 1):
        if not isinstance(item, dict):
            raise ScheduleError(f"Stage {n} in {path} is not a mapping of duration, rate/concurrency, ...")
        extra = set(item) - known
        if extra:
            raise ScheduleError(f"Stage {n} in {path} has unknown keys: {', '.join(sorted(extra))}.")
        if ("rate" in item) == ("concurrency" in item):
            raise ScheduleError(f"Stage {n} in {path} needs exactly one of rate or concurrency.")
        try:
            stage = Stage(
                duration_s=parse_duration(item["duration"]) if "duration" in item else None,
                rate=float(item["rate"]) if "rate" in item else None,
                ramp_to=float(item["ramp_to"]) if item.get("ramp_to") is not None else None,
                ramp=str(item.get("ramp", "linear")),
                concurrency=int(item["concurrency"]) if "concurrency" in item else None,
                arrival=str(item.get("arrival", default_arrival)),
                burstiness=float(item.get("burstiness", burstiness)),
                requests=int(item["requests"]) if "requests" in item else None,
                name=str(item.get("name", f"stage {n}")))
        except (TypeError, ValueError) as e:
            raise ScheduleError(f"Stage {n} in {path} has a bad value ({e}).") from None
        try:
            stages.append(validate(stage))
        except ScheduleError as e:
            raise ScheduleError(f"Stage {n} in {path}: {str(e)[0].lower()}{str(e)[1:]}") from None
    return stages


def unit_gaps(stage: Stage, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` inter-arrival gaps of a unit-rate process (mean 1) of the stage's arrival kind."""
    if stage.arrival == "constant":
        return np.ones(n)
    if stage.arrival == "gamma":
        return rng.gamma(shape=stage.burstiness, scale=1.0 / stage.burstiness, size=n)
    return rng.exponential(1.0, size=n)


def _to_real_time(stage: Stage, lam: np.ndarray) -> np.ndarray:
    """Invert the integrated rate Λ(t) = ∫0^t λ(u) du of the stage (closed forms for the ramps)."""
    r0 = float(stage.rate or 0.0)
    if stage.ramp_to is None or stage.ramp_to == r0 or not stage.duration_s:
        return lam / r0
    r1, d = float(stage.ramp_to), float(stage.duration_s)
    if stage.ramp == "exp":
        k = math.log(r1 / r0)
        return d * np.log1p(lam * k / (r0 * d)) / k
    a = (r1 - r0) / (2 * d)  # Λ(t) = r0 t + a t², solved for t (stable form of the quadratic root)
    return 2 * lam / (r0 + np.sqrt(np.maximum(r0 * r0 + 4 * a * lam, 0.0)))


def stage_arrivals(stage: Stage, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """Intended send times (seconds from the stage's start) of an open-loop stage, and its length."""
    if stage.duration_s is not None:
        if stage.ramp_to is not None and stage.ramp_to != stage.rate:
            r0, r1, d = float(stage.rate or 0), float(stage.ramp_to), stage.duration_s
            total = d * (r1 - r0) / math.log(r1 / r0) if stage.ramp == "exp" else d * (r0 + r1) / 2
        else:
            total = float(stage.rate or 0) * stage.duration_s
        # Draw a few more than expected, then cut at the stage's end: the count is part of the randomness.
        n = int(total + 6 * math.sqrt(total / min(stage.burstiness, 1.0) + 1) + 16)
        lam = np.cumsum(unit_gaps(stage, n, rng)) - (1.0 if stage.arrival == "constant" else 0.0)
        times = _to_real_time(stage, lam[lam < total])
        times = times[times < stage.duration_s]
        if stage.requests is not None:
            times = times[: stage.requests]
        return times, stage.duration_s
    n = int(stage.requests or 0)
    lam = np.cumsum(unit_gaps(stage, n, rng)) - (1.0 if stage.arrival == "constant" else 0.0)
    times = _to_real_time(stage, lam)
    # A stage bounded by a count ends one mean gap after its last request.
    return times, float(times[-1] + 1.0 / float(stage.rate or 1.0)) if n else 0.0


@dataclass(frozen=True, slots=True)
class Plan:
    """Every stage's start and end (seconds since the run's start) and its open-loop send times."""

    stages: list[Stage]
    starts_s: list[float]
    ends_s: list[float]
    times: list[np.ndarray]            # per stage, absolute intended times (empty for closed loop)

    @property
    def end_s(self) -> float:
        return self.ends_s[-1] if self.ends_s else 0.0

    def total_requests(self) -> int | None:
        """Open-loop requests in the plan, or None when a closed-loop stage makes it unknowable."""
        if any(not s.open_loop for s in self.stages):
            return None
        return int(sum(len(t) for t in self.times))


def plan(stages: list[Stage], *, seed: int | None = None, max_requests: int | None = None) -> Plan:
    """Lay stages end to end and draw every open-loop send time (reproducible for a given seed).

    Closed-loop stages bounded only by a request count get no fixed end; they are given the end
    `inf` and the runner closes them when their count is reached (later stages are then not planned).
    """
    rng = np.random.default_rng(seed)
    starts, ends, times = [], [], []
    t = 0.0
    left = max_requests
    for stage in stages:
        validate(stage)
        starts.append(t)
        if stage.open_loop:
            rel, length = stage_arrivals(stage, rng)
            if left is not None:
                rel = rel[:left]
                left -= len(rel)
                if left == 0 and len(rel):
                    length = float(rel[-1]) + 1.0 / float(stage.rate or 1.0)
            times.append(rel + t)
            t += length
        else:
            times.append(np.empty(0))
            t += stage.duration_s if stage.duration_s is not None else math.inf
        ends.append(t)
        if left == 0 or math.isinf(t):
            break
    return Plan(stages[: len(ends)], starts, ends, times)


def intended_times(stages: list[Stage], seed: int | None = None) -> list[np.ndarray]:
    return plan(stages, seed=seed).times
