"""Closed-loop ramps: the number of requests in flight, as the server sees it, follows the intended concurrency
(start -> end), across worker processes, and a ramp down lets every request in flight finish."""

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
from gpuscope.loadtest.requests import Protocol
from gpuscope.loadtest.runner import execute, summarize
from gpuscope.loadtest.worker import WorkerConfig

HOLD_S = 0.05


@pytest.fixture()
def srv():
    with LoadtestServer() as s:   # one per test: its list of arrivals starts empty
        yield s


def _run(srv: LoadtestServer, stage: S.Stage, workers: int) -> tuple[dict, list[tuple[float, int]], list]:
    cfg = WorkerConfig(url=srv.url(f"/hold?s={HOLD_S}"), proto=Protocol(), plan=S.plan([stage]),
                       keep_records=workers == 1)
    res = execute(cfg, workers)
    summary = summarize(cfg, res, url="u", protocol="http", stage_names=["ramp"])
    t0 = res.clock["mono_s"]
    return summary, [(t - t0, int(n)) for t, n in srv.held()], res.records


def _target(stage: S.Stage, t_s: float) -> int:
    return int(stage.concurrency_at(t_s) + 0.5)


def test_a_ramp_up_over_two_workers_never_exceeds_the_target_and_reaches_the_end(srv) -> None:
    stage = S.Stage(2.0, concurrency=1, ramp_to=8, name="ramp")
    summary, seen, _ = _run(srv, stage, workers=2)
    assert len(seen) > 40
    for t, n in seen:   # every request arrives after its slot opened: at most the target then
        assert n <= _target(stage, t), (t, n)
    quarters = [max((n for t, n in seen if q * 0.5 <= t < (q + 1) * 0.5), default=0) for q in range(4)]
    assert quarters == sorted(quarters) and quarters[0] <= 3 and quarters[-1] == 8, quarters
    st_ = summary["stages"][0]
    assert (st_["concurrency"], st_["concurrency_end"], st_["ramp"]) == (1, 8, "linear")


def test_a_ramp_down_retires_slots_without_cancelling_a_request(srv) -> None:
    stage = S.Stage(1.5, concurrency=6, ramp_to=2, name="down")
    summary, seen, recs = _run(srv, stage, workers=1)
    assert max(n for t, n in seen if t < 0.1) == 6
    last_retire_s = stage.slot_span(3)[1]            # slots 6, 5, 4, 3 retire on the way down
    assert max(n for t, n in seen if t > last_retire_s + HOLD_S + 0.02) <= 2
    assert recs and all(r.error is None for r in recs)   # a retiring slot's last request was answered
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
