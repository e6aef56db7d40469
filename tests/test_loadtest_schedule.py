"""Schedules: arrival processes' rates and burstiness, ramps, stage boundaries, reproducibility, templates."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuscope.loadtest import schedule as S
from gpuscope.loadtest.templates import Template


@settings(max_examples=25, deadline=None)
@given(rate=st.floats(5, 2000), seed=st.integers(0, 2**31))
def test_poisson_mean_rate(rate: float, seed: int) -> None:
    duration = 4000 / rate                       # ~4000 arrivals: the count's sd is ~63 (1.6 %)
    times = S.plan([S.Stage(duration, rate=rate)], seed=seed).times[0]
    assert abs(len(times) / duration - rate) < 5 * math.sqrt(rate * duration) / duration
    assert np.all(np.diff(times) >= 0) and times[0] >= 0 and times[-1] < duration


@settings(max_examples=25, deadline=None)
@given(b=st.floats(0.2, 20), seed=st.integers(0, 2**31))
def test_gamma_gaps_have_cv_one_over_sqrt_b(b: float, seed: int) -> None:
    times = S.plan([S.Stage(None, rate=100, arrival="gamma", burstiness=b, requests=20000)], seed=seed).times[0]
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(b), rel=0.08)
    assert gaps.mean() == pytest.approx(0.01, rel=0.05)


def test_constant_arrivals_are_evenly_spaced() -> None:
    times = S.plan([S.Stage(2.0, rate=10, arrival="constant")]).times[0]
    assert np.allclose(times, np.arange(20) / 10)


@settings(max_examples=20, deadline=None)
@given(r0=st.floats(5, 200), r1=st.floats(5, 200), ramp=st.sampled_from(["linear", "exp"]), seed=st.integers(0, 99))
def test_ramps_follow_their_rate(r0: float, r1: float, ramp: str, seed: int) -> None:
    stage = S.Stage(60.0, rate=r0, ramp_to=r1, ramp=ramp, arrival="constant")
    times = S.plan([stage], seed=seed).times[0]
    # with constant (unit) gaps in operational time, the count up to t is the integrated rate, to within 1
    for t in (10.0, 30.0, 59.0):
        ts = np.linspace(0, t, 2001)
        expected = np.trapezoid([stage.rate_at(x) for x in ts], ts)
        assert abs(np.searchsorted(times, t) - expected) <= 1.5 + 1e-6 * expected
    assert times[-1] < 60.0


@settings(max_examples=20, deadline=None)
@given(rates=st.lists(st.floats(1, 300), min_size=1, max_size=5), d=st.floats(0.5, 5), seed=st.integers(0, 99))
def test_stage_boundaries(rates: list[float], d: float, seed: int) -> None:
    plan = S.plan(S.ladder(rates, d), seed=seed)
    assert plan.starts_s == pytest.approx([k * d for k in range(len(rates))])
    assert plan.ends_s == pytest.approx([(k + 1) * d for k in range(len(rates))])
    for times, start, end in zip(plan.times, plan.starts_s, plan.ends_s, strict=True):
        assert np.all((times >= start) & (times < end))


def test_seed_makes_schedules_reproducible() -> None:
    stages = [S.Stage(5.0, rate=50, arrival="gamma", burstiness=0.5)]
    assert np.array_equal(S.plan(stages, seed=4).times[0], S.plan(stages, seed=4).times[0])
    assert not np.array_equal(S.plan(stages, seed=4).times[0], S.plan(stages, seed=5).times[0])


def test_spike_and_closed_loop_and_request_caps() -> None:
    plan = S.plan(S.spike(10, 100, at_s=2, length_s=1, total_s=5, arrival="constant"))
    assert [s.rate for s in plan.stages] == [10, 100, 10] and plan.ends_s == [2, 3, 5]
    assert [len(t) for t in plan.times] == [20, 100, 20]
    plan = S.plan([S.Stage(1.0, concurrency=4), S.Stage(1.0, rate=5, arrival="constant")])
    assert plan.total_requests() is None and len(plan.times[0]) == 0 and plan.starts_s == [0, 1.0]
    assert len(S.plan([S.Stage(10.0, rate=100)], max_requests=7).times[0]) == 7


def test_stage_file_and_its_errors(tmp_path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("- {duration: 10s, rate: 5, ramp_to: 50, ramp: exp}\n- {duration: 1m, concurrency: 8, name: hold}\n")
    a, b = S.load_stage_file(f)
    assert (a.rate, a.ramp_to, a.ramp, a.duration_s) == (5, 50, "exp", 10.0)
    assert (b.concurrency, b.duration_s, b.name) == (8, 60.0, "hold")
    for text, says in (("[]", "non-empty list"), ("- {rate: 5}", "duration or a request count"),
                       ("- {duration: 1s, rate: 5, color: red}", "unknown keys"),
                       ("- {duration: 1s, rate: 5, arrival: lumpy}", "unknown arrival")):
        f.write_text(text)
        with pytest.raises(S.ScheduleError, match=says):
            S.load_stage_file(f)


def test_body_templates() -> None:
    rng = random.Random(1)
    t = Template('{"id": {seq}, "n": {rand_int:1:3}, "c": "{choice:a|b}", "keep": {"x": 1}}')
    out = [t.render(i, rng) for i in range(50)]
    assert out[7].startswith('{"id": 7, "n": ') and out[7].endswith(', "keep": {"x": 1}}')
    assert {o.split('"n": ')[1][0] for o in out} == {"1", "2", "3"}
    assert {o.split('"c": "')[1][0] for o in out} == {"a", "b"}
