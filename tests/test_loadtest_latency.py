"""The load tester against a server with a known injected latency: percentiles and coordinated omission."""

from __future__ import annotations

import numpy as np
import pytest
from loadtest_servers import LoadtestServer

from gpuscope.loadtest import schedule as S
from gpuscope.loadtest.requests import Protocol
from gpuscope.loadtest.runner import execute, summarize
from gpuscope.loadtest.worker import WorkerConfig


def _run(url: str, stages: list[S.Stage], **kw: object) -> tuple[dict, list, float]:
    """(summary, records, the run's start on perf_counter); each request's body is its sequence number, so the
    server's record of it (LoadtestServer.applied) is paired with the client's."""
    cfg = WorkerConfig(url=url, proto=Protocol(method="POST", body="{seq}"), plan=S.plan(stages, seed=3),
                       keep_records=True, **kw)  # type: ignore[arg-type]
    res = execute(cfg, 1)
    summary = summarize(cfg, res, url=url, protocol="http", stage_names=[s.name for s in stages])
    return summary, res.records, res.clock["mono_s"]


def _served(srv: LoadtestServer, t0: float) -> dict[int, tuple[float, float]]:
    """Request number -> (the server's handler start, the start of its answer), on the run's clock."""
    return {int(body): (start - t0, answer - t0) for start, answer, body in srv.applied()}


def _between_order_stats(value: float, values: list[float], q: float) -> bool:
    """`value` (an HDR percentile, 0.1 % precision) lies between the order statistics around quantile q."""
    v = sorted(values)
    k = q * len(v)
    lo, hi = v[max(int(k - 0.5), 0)], v[min(int(k + 0.5), len(v) - 1)]
    return lo * (1 - 1e-3) <= value <= hi * (1 + 1e-3)


def test_percentiles_match_the_delays_the_server_applied() -> None:
    """Checked on what the client and the server recorded on one clock (perf_counter is CLOCK_MONOTONIC in both
    processes), not on a tolerance in ms: each request was sent before the server saw it and its answer read
    after the server wrote it, so its latency is at least the delay the server applied to it; the summary's
    percentiles are those of the records."""
    with LoadtestServer("--seed", "7") as srv:
        summary, records, t0 = _run(srv.url("/latency"), [S.Stage(8.0, rate=50, arrival="poisson", name="p")])
        served = _served(srv, t0)
    o = summary["overall"]
    assert o["errors"] == {} and o["completed"] == len(served) == len(records) > 300
    assert sorted(served) == sorted(r.i for r in records)
    # the server drew 50 ms ± 5 ms and waited at least that (a sleep is never shorter)
    applied = {i: answer - start for i, (start, answer) in served.items()}
    assert min(applied.values()) >= 0.045 - 1e-6
    for r in records:
        start, answer = served[r.i]
        assert r.t_intended <= r.t_sent <= start and r.t_end >= answer, (r, served[r.i])
        assert r.service_latency >= applied[r.i] and r.latency >= r.service_latency
    service_ms = [r.service_latency * 1e3 for r in records]
    latency_ms = [r.latency * 1e3 for r in records]
    for key, q in (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)):
        assert _between_order_stats(o["service_latency_ms"][key], service_ms, q), key
        assert _between_order_stats(o["latency_ms"][key], latency_ms, q), key
        # so no percentile comes out below the server's own (order statistics of larger values are larger)
        assert o["service_latency_ms"][key] >= np.quantile(sorted(applied.values()), q, method="lower") * 1e3 * (1 - 1e-3)
    assert o["service_latency_ms"]["max"] == pytest.approx(max(service_ms), rel=1e-9)


def test_a_stall_shows_in_the_open_loop_tail_not_in_the_from_sent_latency() -> None:
    # A client with 4 connections cannot keep sending while the server stalls for 1 s: requests queue in
    # the client. Measured from when they were sent (what closed-loop tools report) the stall nearly
    # vanishes; measured from when they were meant to be sent, it is the tail.
    with LoadtestServer("--stall-every", "4", "--stall-s", "1") as srv:
        summary, records, t0 = _run(srv.url("/latency"), [S.Stage(8.0, rate=20, arrival="constant", name="c")],
                                    max_connections=4)
        served = _served(srv, t0)
    o = summary["overall"]
    assert o["errors"] == {}
    # the server held past 0.5 s only what was on the 4 connections when a stall began (by its own clock): the
    # answers it held go out together at the stall's end, at most 4 at each (how many stalls the run met
    # depends on how long a loaded machine made it last)
    held = [i for i, (start, answer) in served.items() if answer - start > 0.5]
    ends: list[list[float]] = []
    for answer in sorted(served[i][1] for i in held):
        if ends and answer - ends[-1][-1] < 0.25:
            ends[-1].append(answer)
        else:
            ends.append([answer])
    assert held and all(len(e) <= 4 for e in ends), ends
    stalled_from_intended = sum(1 for r in records if r.latency > 0.5)
    stalled_from_sent = {r.i for r in records if r.service_latency > 0.5}
    assert set(held) <= stalled_from_sent       # what the server held shows from the send too
    assert stalled_from_intended >= 15 > 2 * 4  # ~20 req/s queued behind each 1 s stall, far more than it held
    assert o["latency_ms"]["p95"] > 300 and o["latency_ms"]["max"] > 800
    assert o["late"] >= 15 and summary["client"]["late"] == o["late"]   # counted, not hidden
    assert o["late"] == sum(1 for r in records if r.t_sent - r.t_intended > 0.005)


def test_open_loop_with_unbounded_connections_sends_on_time_through_a_stall() -> None:
    with LoadtestServer("--stall-every", "3", "--stall-s", "1") as srv:
        summary, records, t0 = _run(srv.url("/latency"), [S.Stage(6.0, rate=30, arrival="constant", name="c")])
        served = _served(srv, t0)
    # no request waited for a connection through the stall (one that did would wait until it ended): each left
    # as soon as the client's own timer fired, however late a loaded machine ran it
    loop_lag_s = summary["client"]["loop_lag_ms"]["max"] / 1e3
    assert max(r.t_sent - r.t_intended for r in records) < 0.5 + loop_lag_s
    # so both latencies see the stall alike: the requests the server held past 0.5 s, by its own clock
    held = {i for i, (start, answer) in served.items() if answer - start > 0.5}
    assert len(held) > 15
    assert held <= {r.i for r in records if r.service_latency > 0.5} <= {r.i for r in records if r.latency > 0.5}


@pytest.mark.parametrize("workers", [2])
def test_workers_split_the_schedule_and_merge_histograms(workers: int, tmp_path) -> None:
    from gpuscope.loadtest.records import read_records
    from gpuscope.loadtest.runner import collect_records

    with LoadtestServer() as srv:
        stages = [S.Stage(2.0, rate=40, arrival="constant", name="a"), S.Stage(2.0, rate=80, arrival="constant", name="b")]
        cfg = WorkerConfig(url=srv.url("/latency"), proto=Protocol(), plan=S.plan(stages, seed=1),
                           records_dir=str(tmp_path))
        res = execute(cfg, workers)
        summary = summarize(cfg, res, url="u", protocol="http", stage_names=["a", "b"])
        assert collect_records(tmp_path, workers) == 240
        recs = list(read_records(tmp_path / "records.jsonl"))
    a, b = summary["stages"]
    assert (a["stats"]["requests"], b["stats"]["requests"]) == (80, 160)
    assert {r.worker for r in recs} == {0, 1} and [r.i for r in recs] == list(range(240))
    assert a["start_s"] == 0.0 and a["end_s"] == b["start_s"] == 2.0
    assert all(0.0 <= r.t_intended < 2.0 for r in recs if r.stage == 0)
    # the merged histograms are the records' (the server waits at least 45 ms: no figure below that)
    service_ms = [r.service_latency * 1e3 for r in recs]
    assert min(service_ms) >= 45 - 1e-3
    assert _between_order_stats(summary["overall"]["service_latency_ms"]["p50"], service_ms, 0.5)
    assert summary["overall"]["service_latency_ms"]["max"] == pytest.approx(max(service_ms), rel=1e-9)
    assert len(summary["client"]["cpu_percent_per_worker"]) == workers
