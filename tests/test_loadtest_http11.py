"""HTTP/1.1 as servers speak it: `Connection: close` both ways, servers that close after each answer without
saying so, close-delimited bodies (HTTP/1.0, SSE without chunking), 1xx, Expect, trailers, HEAD, and bad
answers — each against a real server on loopback, each a counted class with its own sentence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from loadtest_servers import LoadtestServer

from gpuscope.loadtest import schedule as S
from gpuscope.loadtest.records import RequestRecord
from gpuscope.loadtest.requests import Protocol
from gpuscope.loadtest.runner import execute, summarize
from gpuscope.loadtest.worker import WorkerConfig


@pytest.fixture(scope="module")
def srv():
    with LoadtestServer() as s:
        yield s


def _run(url: str, n: int = 12, rate: float = 20.0, proto: Protocol | None = None, arrival: str = "constant",
         one_by_one: bool = False, **kw: object) -> tuple[dict, list[RequestRecord]]:
    """n requests at `rate`, or one after another (closed loop, one in flight: each sent once the one before
    it has ended, so a client that keeps its connection needs exactly one, however slow the machine)."""
    stage = S.Stage(None, concurrency=1, requests=n) if one_by_one else \
        S.Stage(None, rate=rate, arrival=arrival, requests=n)
    cfg = WorkerConfig(url=url, proto=proto or Protocol(), keep_records=True, timeout_s=kw.pop("timeout_s", 10.0),
                       plan=S.plan([stage], seed=1), **kw)  # type: ignore[arg-type]
    res = execute(cfg, 1)
    return summarize(cfg, res, url=url, protocol="http", stage_names=["s"]), res.records


def _log_since(srv: LoadtestServer, start: int) -> list[dict]:
    return srv.script_log()[start:]


# -- Connection: close, both ways ------------------------------------------------------------------------
def test_the_servers_connection_close_is_honoured(srv) -> None:
    # The server says "Connection: close" but leaves the socket open: a client that sent again on it would
    # show up in the server's log as a second request on one connection.
    start = len(srv.script_log())
    summary, recs = _run(srv.script_url("/close_header"))
    log = _log_since(srv, start)
    assert summary["overall"]["errors"] == {} and [r.status for r in recs] == [200] * 12
    assert len(log) == 12 and all(len(c["requests"]) == 1 for c in log), log


def test_the_users_own_connection_close_is_sent_and_honoured(srv) -> None:
    # /keep never closes and never says close: only the client's own header can end each connection.
    start = len(srv.script_log())
    summary, recs = _run(srv.script_url("/keep"), proto=Protocol(headers={"Connection": "close"}))
    log = _log_since(srv, start)
    assert summary["overall"]["errors"] == {}
    assert len(log) == 12 and all(c["requests"] == ["/keep"] and c["asked_close"] == 1 for c in log), log


def test_keep_alive_is_kept_when_nobody_says_close(srv) -> None:
    start = len(srv.script_log())
    summary, _ = _run(srv.script_url("/keep"), one_by_one=True)
    log = _log_since(srv, start)
    assert summary["overall"]["errors"] == {} and len(log) == 1 and len(log[0]["requests"]) == 12, log


# -- a server that closes after each answer without saying so -------------------------------------------------
def test_a_get_that_crossed_the_servers_close_is_retried_once_on_a_fresh_connection(srv) -> None:
    # /close_next keeps each connection after its answer and drops (unanswered) the next request sent on it:
    # the client's request crossed the server's close. Each request after the first lands on such a
    # connection, is read and dropped by the server, and must be retried, not recorded as a disconnect.
    start = len(srv.script_log())
    summary, recs = _run(srv.script_url("/close_next"), one_by_one=True)
    log = _log_since(srv, start)
    o = summary["overall"]
    assert o["errors"] == {} and [r.status for r in recs] == [200] * 12
    retried = [r for r in recs if r.t_retried is not None]
    assert len(retried) == sum(c["dropped"] for c in log) == o["retried"] == summary["stages"][0]["stats"]["retried"]
    assert recs[1].t_retried is not None                    # the first request sent on a kept connection
    assert sum(len(c["requests"]) for c in log) == 12       # each answered once: none sent a third time
    # The same at 20/s (open loop): each request dropped is retried, none is an error.
    summary, recs = _run(srv.script_url("/close_next"))
    assert summary["overall"]["errors"] == {} and summary["overall"]["retried"] >= 1
    # The latency is from the intended send, so it holds the failed attempt and the new connection.
    assert all(r.t_intended <= r.t_sent <= r.t_retried < r.t_end for r in retried)  # type: ignore[operator]


def test_a_post_is_never_sent_twice_unless_it_says_it_is_idempotent(srv) -> None:
    start = len(srv.script_log())
    summary, recs = _run(srv.script_url("/close_next"), proto=Protocol(method="POST", body="{seq}"), one_by_one=True)
    log = _log_since(srv, start)
    served = sum(len(c["requests"]) for c in log) + sum(c["dropped"] for c in log)
    assert served == 12                                   # each request reached the server once, none twice
    # The second POST goes on the kept connection and is dropped: recorded as a disconnect, not sent again.
    # Having seen the server close a kept connection unsaid, the client sends the next requests on a fresh
    # connection rather than one that went idle a moment ago (how many still meet a dropped one depends on
    # the machine's pace: a kept connection idle for over 10 ms is taken again).
    dropped = [r for r in recs if r.error is not None]
    assert len(dropped) == sum(c["dropped"] for c in log) >= 1 and {r.error for r in dropped} == {"disconnect"}
    assert recs[1].error == "disconnect"
    assert all("not sent again" in (r.error_detail or "") for r in dropped), dropped[0].error_detail
    assert summary["overall"]["retried"] == 0
    # An Idempotency-Key says the server may be asked twice: retried like a GET.
    summary, recs = _run(srv.script_url("/close_next"), proto=Protocol(method="POST", body="{seq}",
                                                                        headers={"Idempotency-Key": "k"}), one_by_one=True)
    assert summary["overall"]["errors"] == {} and summary["overall"]["retried"] >= 1 and recs[1].t_retried


def test_a_server_that_closes_after_each_answer_costs_no_request(srv) -> None:
    # The real race: the server answers and closes at once; a request sent on the connection before its close
    # was seen fails before any byte of answer and is retried. Poisson at 200/s, 200 requests.
    summary, recs = _run(srv.script_url("/close_each"), n=200, rate=200.0, arrival="poisson")
    assert summary["overall"]["errors"] == {}, summary["overall"]["errors"]
    assert len(recs) == 200 and all(r.status == 200 for r in recs)


# -- bodies that end when the connection closes --------------------------------------------------------------
@pytest.mark.parametrize("where, path", [("script", "/eof_body"), ("h10", "/cd"), ("h10", "/file")])
def test_close_delimited_and_http10_answers_are_complete(srv, where: str, path: str) -> None:
    url = srv.script_url(path) if where == "script" else srv.h10_url(path)
    summary, recs = _run(url, n=6)
    assert summary["overall"]["errors"] == {} and summary["overall"]["completed"] == 6
    assert all(r.status == 200 and r.t_end is not None for r in recs)


@pytest.mark.parametrize("where", ["script", "h10"])
def test_sse_without_chunking_is_read_to_its_end(srv, where: str) -> None:
    url = srv.script_url("/eof_sse") if where == "script" else srv.h10_url("/sse")
    summary, recs = _run(url, n=4, proto=Protocol(kind="openai-completions"))
    assert summary["overall"]["errors"] == {}
    assert all(len(r.chunk_times or []) == 3 and r.output_tokens == 3 and r.tokens_from == "usage" for r in recs)


# -- 1xx, Expect, trailers, HEAD -----------------------------------------------------------------------------
def test_interim_answers_are_skipped(srv) -> None:
    summary, recs = _run(srv.script_url("/interim"), n=4)
    assert summary["overall"]["errors"] == {} and [r.status for r in recs] == [200] * 4


def test_expect_100_continue_gets_its_answer(srv) -> None:
    start = len(srv.script_log())
    summary, recs = _run(srv.script_url("/expect"), n=4,
                         proto=Protocol(method="POST", body="x" * 1000, headers={"Expect": "100-continue"}))
    log = _log_since(srv, start)
    assert summary["overall"]["errors"] == {} and [r.status for r in recs] == [200] * 4
    assert log and all(c["expect"] for c in log)


def test_trailers_are_read_and_the_connection_kept(srv) -> None:
    start = len(srv.script_log())
    summary, _ = _run(srv.script_url("/trailers"), n=6, one_by_one=True)
    log = _log_since(srv, start)
    assert summary["overall"]["errors"] == {} and len(log) == 1 and len(log[0]["requests"]) == 6, log


def test_a_head_answer_has_no_body_whatever_its_content_length(srv) -> None:
    start = len(srv.script_log())
    summary, recs = _run(srv.script_url("/head"), n=6, proto=Protocol(method="HEAD"), timeout_s=2.0, one_by_one=True)
    log = _log_since(srv, start)
    assert summary["overall"]["errors"] == {} and [r.status for r in recs] == [200] * 6
    assert len(log) == 1 and len(log[0]["requests"]) == 6, log


# -- bad answers: each a counted class with its own sentence, no slot stuck, no record lost --------------------
@pytest.mark.parametrize("path, error, says", [
    ("/bad_status", "malformed", "bad HTTP response"),
    ("/status_600", "malformed", "status 600, which is not an HTTP status"),
    ("/switch", "malformed", "switched protocols (101)"),
    ("/huge_head", "malformed", "headers exceed 64 KiB"),
    ("/huge_field", "malformed", "headers exceed 64 KiB"),
    ("/long_body", "malformed", "past the end of its Content-Length"),
    ("/short_body", "disconnect", "9 of its 100 bytes"),
])
def test_bad_answers_are_counted_with_their_sentence(srv, path: str, error: str, says: str) -> None:
    summary, recs = _run(srv.script_url(path), n=4)
    assert summary["overall"]["errors"] == {error: 4}
    assert len(recs) == 4 and all(says in (r.error_detail or "") for r in recs), recs[0].error_detail


def test_a_server_stalling_mid_body_times_out_and_frees_the_slot(srv) -> None:
    start = len(srv.script_log())
    cfg = WorkerConfig(url=srv.script_url("/stall_body"), proto=Protocol(method="POST", body="{seq}"),
                       keep_records=True, timeout_s=0.2, plan=S.plan([S.Stage(1.0, concurrency=2)]))
    res = execute(cfg, 1)
    summary = summarize(cfg, res, url="x", protocol="http", stage_names=["c"])
    recs = res.records
    # Each slot sends again as soon as its request times out: at least 2 slots x 1 s / 0.2 s, less the loop's lag.
    assert len(recs) >= 6 and summary["overall"]["requests"] == len(recs)
    assert {r.error for r in recs} == {"timeout"}
    # When the server began each answer (its clock is ours: CLOCK_MONOTONIC), by the request's {seq} body. A
    # server starved of CPU (stress-ng beside it) began some answers after their deadline: those got no byte
    # in time, and only those (or ones whose answer came within the client's own measured loop lag of it).
    wrote = {int(b): t - res.clock["mono_s"] for c in _log_since(srv, start) for t, b in c["answered"]}
    lag_s = res.loop_lag.pct_ms()["max"] / 1e3
    mid_body = [r for r in recs if r.t_first_byte is not None]
    for r in recs:
        if r.t_first_byte is not None:
            assert r.error_detail == "the answer stopped 9 bytes into its body: not complete within 0.2 s of its " \
                                     "intended send", r
        else:
            assert r.error_detail == "no answer within 0.2 s of its intended send", r
            assert wrote.get(r.i, float("inf")) > r.t_intended + 0.2 - lag_s - 0.002, (r, wrote.get(r.i), lag_s)
    assert mid_body, recs


# -- validity: figures that are not the server's are never called valid ------------------------------------------
def test_a_run_whose_answers_could_not_be_read_is_invalid(srv) -> None:
    summary, _ = _run(srv.script_url("/short_body"), n=4)
    assert not summary["valid"]
    assert any("got no complete answer" in r for r in summary["invalid_reasons"]), summary["invalid_reasons"]
    summary, _ = _run(srv.url("/status/500"), n=4)   # every answer a 500: the server's figures, read right
    assert not any("answer" in r for r in summary["invalid_reasons"]), summary["invalid_reasons"]


def test_the_cli_exits_1_and_never_says_valid_for_such_a_run(srv, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())",
                        "loadtest", srv.script_url("/short_body"), "--requests", "4", "--workers", "1", "--no-gpu",
                        "--quiet", "--out", str(tmp_path / "o")], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    assert p.returncode == 1, p.stderr
    assert "INVALID run" in p.stdout and "valid run" not in p.stdout and "Traceback" not in p.stderr
    assert "got no complete answer" in p.stderr
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["valid"] is False
    html = (tmp_path / "o" / "report.html").read_text()
    assert "INVALID run" in html and "got no complete answer" in html
