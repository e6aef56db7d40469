"""Timeouts fire at their deadline (the intended send plus the timeout), not at the next sweep of a timer."""

from __future__ import annotations

import pytest
from loadtest_servers import LoadtestServer

from gpuscope.loadtest import schedule as S
from gpuscope.loadtest.requests import Protocol
from gpuscope.loadtest.runner import execute
from gpuscope.loadtest.worker import WorkerConfig

TIMEOUT_S = 0.2
# Generous for a loaded 2-core CI machine; a 50 ms sweep (the former design) is late by 0-50 ms, spread
# evenly, so 12 requests at spread-out intended times would almost surely show one later than this.
MAX_LATE_S = 0.025


@pytest.fixture(scope="module")
def srv():
    with LoadtestServer() as s:
        yield s


def _records(url: str, gap_s: float = 0.017, **kw: object) -> list:
    # By default 12 requests at 17 ms gaps: their deadlines fall at every phase of a 50 ms period.
    cfg = WorkerConfig(url=url, proto=Protocol(), keep_records=True, timeout_s=TIMEOUT_S,
                       plan=S.plan([S.Stage(None, rate=1 / gap_s, arrival="constant", requests=12)]),
                       **kw)  # type: ignore[arg-type]
    return execute(cfg, 1).records


def test_a_timeout_is_recorded_at_its_deadline(srv) -> None:
    recs = _records(srv.url("/sleep?s=10"))   # answers after 10 s: never, for a 200 ms timeout
    assert len(recs) == 12 and {r.error for r in recs} == {"timeout"}
    waited = sorted(r.t_failed - r.t_intended for r in recs)
    assert all(r.t_end is None for r in recs)
    assert waited[0] >= TIMEOUT_S                     # never early
    assert waited[-1] < TIMEOUT_S + MAX_LATE_S, waited


def test_a_request_that_waited_past_its_deadline_is_not_sent(srv) -> None:
    # One connection, 50 ms answers, 12 requests meant for (nearly) the same instant: about four are answered
    # within 200 ms; the rest wait in the client past their deadline and are never sent.
    recs = _records(srv.url("/latency"), gap_s=1e-5, max_connections=1)
    assert len(recs) == 12 and {r.error for r in recs} <= {None, "timeout"}
    unsent = [r for r in recs if r.bytes_out == 0]
    assert len(unsent) >= 8 and all(r.error == "timeout" for r in unsent)
    assert all(r.t_failed - r.t_intended >= TIMEOUT_S for r in unsent)
    assert [r.error for r in recs[:3]] == [None] * 3


def test_answers_before_the_deadline_are_not_timed_out(srv) -> None:
    recs = _records(srv.url("/latency"))             # 50 ms answers, well inside 200 ms
    assert [r.error for r in recs] == [None] * 12 and all(r.t_failed is None for r in recs)


def test_back_to_back_timeouts_each_fire_at_their_own_deadline(srv) -> None:
    # Closed loop on a server that never answers in time: every slot sends again the moment its request times
    # out, so new deadlines keep arriving while earlier ones are being fired.
    cfg = WorkerConfig(url=srv.url("/sleep?s=10"), proto=Protocol(), keep_records=True, timeout_s=TIMEOUT_S,
                       plan=S.plan([S.Stage(1.0, concurrency=6)]))
    recs = execute(cfg, 1).records
    assert len(recs) >= 6 * 4 and {r.error for r in recs} == {"timeout"}
    waited = sorted(r.t_failed - r.t_intended for r in recs)
    assert waited[0] >= TIMEOUT_S and waited[-1] < TIMEOUT_S + MAX_LATE_S, waited
