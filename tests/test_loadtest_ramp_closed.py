"""Closed-loop ramps: the number of requests in flight follows the intended concurrency (start -> end), across
worker processes, and a ramp down lets every request in flight finish.

The checks hold on a loaded machine: they are read from the client's own records (a request is in flight from
its intended send, the moment its slot sent it, to its end), and a slot carries one request at a time, so k
requests in flight at once need k slots open. No assertion depends on how promptly anything ran."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loadtest_servers import LoadtestServer

from gpuscope.loadtest import schedule as S
from gpuscope.loadtest.records import RequestRecord, read_records
from gpuscope.loadtest.requests import Protocol
from gpuscope.loadtest.runner import execute, summarize
from gpuscope.loadtest.worker import WorkerConfig, shard_path

HOLD_S = 0.05


@pytest.fixture()
def srv():
    with LoadtestServer() as s:   # one per test: its list of arrivals starts empty
        yield s


def _run(srv: LoadtestServer, stage: S.Stage, workers: int,
         records_dir: Path) -> tuple[dict, list[tuple[float, int]], list[RequestRecord]]:
    cfg = WorkerConfig(url=srv.url(f"/hold?s={HOLD_S}"), proto=Protocol(), plan=S.plan([stage]),
                       records_dir=str(records_dir))
    res = execute(cfg, workers)
    summary = summarize(cfg, res, url="u", protocol="http", stage_names=["ramp"])
    t0 = res.clock["mono_s"]
    recs = [r for w in range(workers) for r in read_records(shard_path(records_dir, w))]
    return summary, [(t - t0, int(n)) for t, n in srv.held()], recs


def _target(stage: S.Stage, t_s: float) -> int:
    return int(stage.concurrency_at(t_s) + 0.5)


def _in_flight_at_sends(recs: list[RequestRecord]) -> list[tuple[float, int]]:
    """(intended send, requests in flight then, itself included) for every request, in time order."""
    ends = [(r.t_end if r.t_end is not None else r.t_failed, -1) for r in recs]
    n, out = 0, []
    for t, step in sorted([(r.t_intended, 1) for r in recs] + ends):   # at one instant, an end comes first
        n += step
        if step == 1:
            out.append((t, n))
    return out


def _opened_by(stage: S.Stage, slots: range, t_s: float) -> int:
    return sum(1 for k in slots if stage.slot_span(k)[0] <= t_s)


def test_a_ramp_up_over_two_workers_never_exceeds_the_target_and_reaches_the_end(srv, tmp_path: Path) -> None:
    # Slots open at 0, 0.33, 1.0 and 1.67 s; slots 1 and 3 are worker 0's, 2 and 4 worker 1's. The last one
    # opens a third of a second before the end, so that reaching 4 needs no prompt scheduling.
    stage = S.Stage(2.0, concurrency=1, ramp_to=4, name="ramp")
    summary, seen, recs = _run(srv, stage, workers=2, records_dir=tmp_path)
    assert recs and len(seen) == len(recs) and all(r.error is None for r in recs)
    for t, n in seen:   # every request arrives at the server after its slot opened: at most the target then
        assert n <= _target(stage, t), (t, n)
    flight = _in_flight_at_sends(recs)
    for t, n in flight:   # in the client too: no slot sends before it opens
        assert n <= _opened_by(stage, range(1, 5), t), (t, n)
    for w in (0, 1):      # and each worker keeps to its own slots
        for t, n in _in_flight_at_sends([r for r in recs if r.worker == w]):
            assert n <= _opened_by(stage, range(w + 1, 5, 2), t), (w, t, n)
    first = {n: min(t for t, m in flight if m == n) for n in {m for _, m in flight}}
    assert sorted(first) == [1, 2, 3, 4]   # it reached the end value, each step no earlier than its slot
    assert all(first[k] >= stage.slot_span(k)[0] for k in first), first
    st_ = summary["stages"][0]
    assert (st_["concurrency"], st_["concurrency_end"], st_["ramp"]) == (1, 4, "linear")


def test_a_ramp_down_retires_slots_without_cancelling_a_request(srv, tmp_path: Path) -> None:
    stage = S.Stage(1.5, concurrency=6, ramp_to=2, name="down")
    summary, _, recs = _run(srv, stage, workers=1, records_dir=tmp_path)
    assert max(n for _, n in _in_flight_at_sends(recs)) == 6     # all six slots sent at the start
    for k in (6, 5, 4, 3):   # slots 6, 5, 4, 3 retire on the way down; 2 and 1 stay
        retired_s = stage.slot_span(k)[1]
        later = [r for r in recs if r.t_intended >= retired_s]
        assert max((n for _, n in _in_flight_at_sends(later)), default=0) <= k - 1, k
    assert recs and all(r.error is None and r.t_end is not None for r in recs)   # last requests answered
    assert summary["stages"][0]["concurrency_end"] == 2


@settings(max_examples=40, deadline=None)
@given(c0=st.integers(1, 40), c1=st.integers(1, 40), ramp=st.sampled_from(S.RAMPS), f=st.floats(0.001, 0.999),
       workers=st.integers(1, 5))
def test_open_slots_are_the_rounded_intended_concurrency_dealt_like_a_fixed_one(c0, c1, ramp, f, workers) -> None:
    stage = S.validate(S.Stage(10.0, concurrency=c0, ramp_to=c1, ramp=ramp))
    t = 10.0 * f
    spans = {k: stage.slot_span(k) for k in range(1, max(c0, c1) + 1)}
    open_now = [k for k, (a, b) in spans.items() if a <= t < b]
    target = _target(stage, t)
    if abs(stage.concurrency_at(t) + 0.5 - round(stage.concurrency_at(t) + 0.5)) > 1e-9:  # not on a step
        assert open_now == list(range(1, target + 1))
    # the slots open at one moment are split across workers as a fixed concurrency of that size is
    per_worker = [sum(1 for k in open_now if (k - 1) % workers == w) for w in range(workers)]
    n = len(open_now)
    assert per_worker == [n // workers + (1 if w < n % workers else 0) for w in range(workers)]


@pytest.mark.parametrize("item, says", [
    ({"duration": "2s", "concurrency": 2, "ramp_to": 2.5}, "whole number of at least 1"),
    ({"duration": "2s", "concurrency": 2, "ramp_to": 0}, "whole number of at least 1"),
    ({"requests": 10, "concurrency": 2, "ramp_to": 4}, "A ramp needs a duration"),
    ({"duration": "2s", "concurrency": 2, "ramp_to": 4, "ramp": "cubic"}, "Unknown ramp"),
])
def test_bad_closed_loop_ramps_are_one_sentence(tmp_path: Path, item: dict, says: str) -> None:
    f = tmp_path / "stages.json"
    f.write_text(json.dumps([item]))
    with pytest.raises(S.ScheduleError) as e:
        S.load_stage_file(f)
    assert says.lower() in str(e.value).lower() and str(e.value).count(". ") == 0


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())",
                           "loadtest", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_cli_closed_loop_ramp_and_stage_file_show_start_and_end(srv, tmp_path: Path) -> None:
    p = _cli(srv.url("/hold?s=0.02"), "--closed-loop", "--ramp", "exp:1:4", "--duration", "1s", "--workers", "1",
             "--no-gpu", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert p.returncode in (0, 1), p.stderr
    s = json.loads((tmp_path / "o" / "summary.json").read_text())["stages"][0]
    assert (s["concurrency"], s["concurrency_end"], s["ramp"], s["target_rate"]) == (1, 4, "exp", None)
    assert "c=1 -> 4" in p.stdout
    assert "1 -&gt; 4 conc." in (tmp_path / "o" / "report.html").read_text()
    stages = tmp_path / "stages.yaml"
    stages.write_text("- {duration: 1s, concurrency: 3, ramp_to: 1}\n")
    p = _cli(srv.url("/hold?s=0.02"), "--stage-file", str(stages), "--workers", "1", "--no-gpu", "--no-html",
             "--json", "--out", str(tmp_path / "o2"), cwd=tmp_path)
    assert p.returncode in (0, 1), p.stderr
    s = json.loads(p.stdout)["stages"][0]
    assert (s["concurrency"], s["concurrency_end"]) == (3, 1)


@pytest.mark.parametrize("args, says", [
    (["--closed-loop", "--ramp", "linear:1.5:4", "--duration", "1s"], "whole concurrencies of at least 1"),
    (["--closed-loop", "--ramp", "linear:0:4", "--duration", "1s"], "whole concurrencies of at least 1"),
    (["--concurrency", "2", "--ramp", "linear:1:4", "--duration", "1s"], "Choose one load shape"),
])
def test_cli_bad_closed_loop_ramp_is_exit_2(srv, tmp_path: Path, args: list[str], says: str) -> None:
    p = _cli(srv.url("/hold"), *args, "--no-gpu", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
