"""The adaptive limit against an upstream of fixed capacity, as a deterministic simulation on virtual time.

The issue-18 scenario: the upstream serves 8 requests at a time, 50 ms each (160 req/s) and queues the rest
inside itself (FIFO: priority cannot act there); 480 req/s are offered (3x), 20 % of them high priority.
Everything runs on tests/guard_sim.py's virtual clock, so the figures are the same on any machine, however
loaded, and each run takes about a second of CPU. Gradient2 (the controller before) let the limit climb to
max_limit (200) here, and the queue moved inside the upstream: high priority's p50 was 1.34 s.
"""

from __future__ import annotations

import pytest
from guard_sim import default_config, run

C, S = 8, 0.05  # the upstream's concurrency and service time
LO, HI = C / 2, 2 * C  # 'within 2x of the upstream's real concurrency'


def _check_converged(res, after: float = 0.0) -> None:
    settled = res.settled_s(LO, HI, after)
    assert settled is not None and settled - after <= 10.0, res.trajectory
    # the limit stayed near the capacity once settled, and the upstream's own queue stayed short
    assert max(lim for t, lim, probing in res.trajectory if t > settled and not probing) <= HI
    assert res.upstream_max_in_service == C


@pytest.mark.parametrize("jitter", [0.0, 0.5])
def test_at_3x_overload_the_limit_settles_near_the_capacity_and_high_priority_stays_fast(jitter):
    res = run(default_config(), capacity=C, service_s=S, rate=480, seconds=15, jitter=jitter)
    _check_converged(res)
    assert res.limit_at(15) == pytest.approx(1.25 * C, rel=0.25)  # rtt_tolerance x capacity
    # Gradient2 left hundreds queued inside the upstream; now the shares never take the total in flight past the
    # limit (settled within HI), so at most HI - C wait there
    assert res.max_waiting_after(res.settled_s(LO, HI) + 0.5) <= HI - C
    late = res.high.between(5, 15)
    assert late.success == 1.0  # high priority is never shed...
    assert late.p50() <= 2 * S  # ...and waits little: p50 within 2x its unloaded latency (the service time)
    assert late.p99() <= 0.25  # the benchmark's SLO
    low = res.low.between(5, 15)
    assert low.success < 0.5  # the overload lands on low priority
    assert sum(res.high.shed.values()) == 0
    assert res.probing_share() < 0.1  # probes for the no-load latency cost little time


def test_the_adaptive_limit_delivers_what_the_oracle_fixed_limit_does():
    adaptive = run(default_config(), capacity=C, service_s=S, rate=480, seconds=15)
    oracle = run(default_config() | {"controller": {"mode": "fixed", "initial_limit": C, "min_limit": 1,
                                                    "max_limit": C}},
                 capacity=C, service_s=S, rate=480, seconds=15)
    served = adaptive.high.ok + adaptive.low.ok
    assert served >= 0.95 * (oracle.high.ok + oracle.low.ok)  # the capacity found is used, within 5 %
    assert adaptive.high.between(5, 15).p50() <= 1.5 * oracle.high.between(5, 15).p50()


def test_gradient2s_runaway_is_gone_even_from_the_maximum():
    # the guard taken over at max_limit (as a long run under Gradient2 left it): it comes down within 10 s
    cfg = default_config(initial_limit=200)
    res = run(cfg, capacity=C, service_s=S, rate=480, seconds=15)
    _check_converged(res)


def test_a_backlog_left_by_an_earlier_run_never_locks_high_priority_out():
    drain_s = 3.0  # 480 jobs of 50 ms, 8 at a time
    res = run(default_config(), capacity=C, service_s=S, rate=480, seconds=15, backlog_jobs=int(drain_s * C / S))
    _check_converged(res, after=drain_s)
    assert res.guard.breaker.state == "closed"
    assert res.high.between(drain_s, 15).success == 1.0  # from the moment it drains, every high request is served
    # the high-priority queue built while the backlog held the upstream is served within 5 s; then it is fast
    assert res.high.between(drain_s + 5.0, 15).p50() <= 2 * S
    assert res.stuck_at_end == 0


def test_a_slow_drain_keeps_high_priority_served_and_the_limit_recovers():
    # the upstream slows 4x for 5 s (less than high priority's own rate gets through), then recovers
    res = run(default_config(), capacity=C, service_s=S, rate=480, seconds=20, service_at=[(5, 4 * S), (10, S)])
    slow = res.high.between(5, 10)
    assert slow.ok > 0.3 * slow.sent  # served first while the upstream crawls: no lockout
    assert res.low.between(6, 10).success < 0.1  # what little gets through goes to high priority
    _check_converged(res, after=10.0)
    assert res.high.between(12, 20).success == 1.0
    assert res.guard.breaker.state == "closed"


def test_requests_stuck_in_flight_are_released_by_their_deadline():
    # 2 % of requests are lost on the way (no answer for an hour): without a deadline each one keeps its
    # slot, and high priority is locked out once they hold the limit; with one, slots come back
    stuck = run(default_config(), capacity=C, service_s=S, rate=480, seconds=15, hang_ratio=0.02)
    assert stuck.high.between(10, 15).success < 0.5  # the failure a deadline exists for
    cfg = default_config()
    for c in cfg["classes"]:
        c["deadline_s"] = 1.0
    res = run(cfg, capacity=C, service_s=S, rate=480, seconds=15, hang_ratio=0.02)
    hung = [t for k in ("high", "low") for t, ok, lat in res.classes[k].events if not ok and lat >= 3000]
    # each lost request's slot came back once, and only those (the last second's: once traffic has stopped,
    # nothing looks until their hour is up)
    assert len(hung) >= sum(res.guard.expired_total) >= sum(1 for t in hung if t < 14) > 0
    late = res.high.between(5, 15)
    lost = sum(1 for _, ok, lat in late.events if not ok and lat >= 3000)
    assert late.ok == late.sent - lost  # every high-priority request but the lost ones was served
    assert res.stuck_at_end == 0 and res.guard.inflight == [0, 0]  # the late releases did not count twice
    assert res.guard.breaker.state == "closed"  # slowness is the limiter's to handle, not a failure
    from prometheus_client.parser import text_string_to_metric_families

    from gpuscope.guard._metrics import render
    fams = {f.name: f for f in text_string_to_metric_families(render(res.guard).decode())}
    shown = {x.labels["class"]: x.value for x in fams["gpuscope_guard_expired"].samples}
    assert sum(shown.values()) == sum(res.guard.expired_total) > 0  # an operator sees the slots taken back


def test_a_bad_deadline_or_tolerance_is_one_sentence():
    from gpuscope.guard import GuardConfigError, parse_config

    for cfg, words in (({"classes": [{"name": "a", "deadline_s": 0}]}, "classes[0].deadline_s must be a positive"),
                       ({"classes": [{"name": "a", "deadline_s": -1}]}, "classes[0].deadline_s must be a positive"),
                       ({"classes": [{"name": "a"}], "controller": {"rtt_tolerance": 0.8}},
                        "controller.rtt_tolerance must be at least 1")):
        with pytest.raises(GuardConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_config(cfg)
    assert parse_config({"classes": [{"name": "a", "deadline_s": 2.5}]}).classes[0].deadline_s == 2.5
