"""find_capacity against synthetic services: an M/M/1 queue, an erroring one, one that cannot keep up,
one that never breaks, and a noisy queue; the search is deterministic and respects its trial budget."""

from __future__ import annotations

import math
import random

import pytest

from gpuscope.loadtest.capacity import find_capacity, judge

MU = 100.0  # service rate of the queue model, req/s
SLO_E2E_S = 0.2


def mm1(rate: float, noise: random.Random | None = None) -> dict:
    """STATS of one trial at `rate` against an M/M/1 server: response time ~ Exp(mu - rate), so the share
    within the e2e SLO is 1 - exp(-(mu - rate) * slo); past mu the queue grows and throughput caps."""
    gap = MU - rate
    att = 1 - math.exp(-gap * SLO_E2E_S) if gap > 0 else 0.0
    if noise is not None:
        att = min(1.0, max(0.0, att + noise.gauss(0, 0.01)))
    p99 = math.log(100) / gap * 1000 if gap > 0 else 60_000.0
    n = int(rate * 30)
    return {"requests": n, "completed": n, "errors": {}, "request_throughput": min(rate, MU * 0.99),
            "latency_ms": {"p99": p99}, "slo_attainment": att, "goodput": rate * att}


# The true knee: the rate where 95 % meet 200 ms, 1 - exp(-(mu - r) * 0.2) = 0.95.
KNEE = MU - math.log(20) / SLO_E2E_S  # 85.02 req/s


def test_finds_the_knee_of_a_queue_within_tolerance():
    res = find_capacity(mm1, {"e2e": SLO_E2E_S}, start_rate=5, max_rate=1000, tolerance=0.05)
    assert KNEE * 0.95 <= res["capacity_rps"] <= KNEE
    assert res["limited_by"] == "slo" and res["converged"]
    assert res["knee"]["passed"] and res["knee"]["rate"] == res["capacity_rps"]
    rates = [t["rate"] for t in res["trials"]]
    assert rates[:5] == [5, 10, 20, 40, 80] and rates[5] == 160  # doubling until the first failure
    assert len(rates) <= 12
    assert all(t["passed"] == (t["rate"] <= KNEE) for t in res["trials"])
    failed = res["first_failure"]
    assert not failed["passed"] and "met the SLOs" in failed["why"] and failed["p99_latency_ms"] > 0
    assert res == find_capacity(mm1, {"e2e": SLO_E2E_S}, start_rate=5, max_rate=1000)  # deterministic


def test_noisy_queue_still_lands_near_the_knee_and_is_repeatable():
    def noisy(seed):
        rng = random.Random(seed)
        return lambda rate: mm1(rate, rng)

    a = find_capacity(noisy(3), {"e2e": SLO_E2E_S}, start_rate=5, max_rate=1000)
    b = find_capacity(noisy(3), {"e2e": SLO_E2E_S}, start_rate=5, max_rate=1000)
    assert a == b
    for seed in range(10):
        res = find_capacity(noisy(seed), {"e2e": SLO_E2E_S}, start_rate=5, max_rate=1000)
        assert KNEE * 0.85 <= res["capacity_rps"] <= KNEE * 1.05, (seed, res["capacity_rps"])


def test_errors_limit_capacity():
    def erroring(rate):
        n = int(rate * 10)
        errs = {"http_5xx": n // 20} if rate > 50 else {"http_5xx": n // 500}  # 5 % past 50 req/s, 0.2 % below
        return {"requests": n, "errors": errs, "request_throughput": rate, "slo_attainment": 0.99,
                "latency_ms": {"p99": 20}}

    res = find_capacity(erroring, {"ttft": 0.2}, start_rate=10, max_rate=1000)
    assert res["limited_by"] == "errors" and 47.5 <= res["capacity_rps"] <= 50
    assert "5.0 % of requests failed" in res["first_failure"]["why"]


def test_throughput_limits_capacity_without_slos():
    def capped(rate):
        return {"requests": int(rate * 10), "errors": {}, "request_throughput": min(rate, 60.0),
                "latency_ms": {"p99": 10}}

    res = find_capacity(capped, None, start_rate=10, max_rate=1000)
    assert res["limited_by"] == "throughput"
    assert 60 / 0.9 * 0.95 <= res["capacity_rps"] <= 60 / 0.9
    assert res["trials"][0]["attainment"] is None  # no SLO given: not judged on it


def test_max_rate_and_trial_budget():
    easy = lambda rate: {"requests": 100, "errors": {}, "request_throughput": rate, "slo_attainment": 1.0}  # noqa: E731
    res = find_capacity(easy, {"e2e": 1}, start_rate=10, max_rate=100)
    assert res["capacity_rps"] == 100 and res["limited_by"] == "max_rate"
    assert [t["rate"] for t in res["trials"]] == [10, 20, 40, 80, 100]
    res = find_capacity(mm1, {"e2e": SLO_E2E_S}, start_rate=1, max_rate=1000, max_trials=4)
    assert len(res["trials"]) == 4 and res["limited_by"] == "max_trials" and res["capacity_rps"] == 8


def test_first_trial_failing_searches_downwards():
    res = find_capacity(mm1, {"e2e": SLO_E2E_S}, start_rate=400, max_rate=1000)
    assert not res["trials"][0]["passed"]
    assert KNEE * 0.95 <= res["capacity_rps"] <= KNEE
    hopeless = lambda rate: {"requests": 10, "errors": {"connect": 10}, "request_throughput": 0.0}  # noqa: E731
    res = find_capacity(hopeless, {}, start_rate=10, max_rate=100, max_trials=5)
    assert res["capacity_rps"] == 0.0 and res["knee"] is None and res["limited_by"] == "errors"
    assert len(res["trials"]) == 5


def test_judge_missing_attainment_and_bad_arguments():
    t = judge(10, {"requests": 100, "errors": {}, "request_throughput": 10}, {"e2e": 1.0})
    assert not t["passed"] and t["failed"] == ["slo"] and "no SLO attainment" in t["why"]
    with pytest.raises(ValueError, match="start rate"):
        find_capacity(mm1, None, start_rate=0, max_rate=10)


def test_throughput_is_judged_against_what_the_trial_actually_sent():
    # Poisson chance: 34 requests sent in a 6 s trial at 8/s, every one answered; the server kept up.
    lucky_low = {"requests": 34, "completed": 34, "errors": {}, "request_throughput": 34 / 6, "duration_s": 6.0,
                 "slo_attainment": 1.0}
    assert judge(8, lucky_low, {"e2e": 1.0})["passed"]
    # Half of what was sent completed within the trial: the server did not keep up.
    behind = dict(lucky_low, completed=17, request_throughput=17 / 6)
    t = judge(8, behind, {"e2e": 1.0})
    assert not t["passed"] and t["failed"] == ["throughput"] and "of the 5.667 sent" in t["why"]


def test_a_slow_trial_is_stretched_to_about_a_hundred_requests():
    from gpuscope.loadtest.job import trial_seconds

    assert trial_seconds(6.0, 8.0) == 12.5      # 100 requests at 8/s
    assert trial_seconds(6.0, 50.0) == 6.0      # already 300 requests
    assert trial_seconds(6.0, 0.5) == 24.0      # at most 4x --stage-duration
