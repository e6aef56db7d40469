"""The training-loop monitor: the step join, the step log, the report, and that nothing it does reaches
the user's code."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time

import pytest

import gpuscope
from gpuscope import MonitorError, Sampler, SamplerConfig
from gpuscope._records import GpuIdentity, GpuRecord, ProcessRecord, Snapshot
from gpuscope.diagnose import diagnose, windows_from_snapshots
from gpuscope.integrations._joiner import Joiner, rows
from gpuscope.integrations._steplog import FIELDS
from gpuscope.integrations._tracks import Track
from gpuscope.sim import PROFILES
from gpuscope.testing import FakeGPU, FakeNVML


def _ns(t: float) -> int:
    return round(t * 1e9)


class ScriptedSource:
    """Snapshots at given monotonic times with given values: the join's input, fully known."""

    kind = "sampler"
    simulated = None

    def __init__(self, snaps: list[tuple[float, dict[str, float]]], pid_on: str | None = None,
                 labels: tuple[str, ...] = ("0",)) -> None:
        self.config = SamplerConfig(interval=0.1, gpm_window=0.2, medium=0.2)
        self.snaps = []
        for t, values in snaps:
            gpus = [GpuRecord(GpuIdentity(int(lab), f"GPU-{lab}", "test"), 0, dict(values)) for lab in labels]
            procs = [ProcessRecord(os.getpid(), pid_on, f"GPU-{pid_on}", "compute")] if pid_on else []
            self.snaps.append((t, Snapshot(0, gpus, procs, None, [])))
        self.given = 0

    def new(self):
        out, self.given = self.snaps[self.given:], len(self.snaps)
        return out

    def recent(self, seconds):
        return []


def _windows(t0: float, windows: list[tuple[float, float]], tick: float = 0.1) -> list[tuple[float, float]]:
    """(time, SM value) the sampler would show: a GPM window's value from its end on, read again on every
    tick until the next window ends. `windows` are (end offset, value)."""
    out = []
    t, i = t0, 0
    last = None
    while i < len(windows):
        end, v = windows[i]
        if t >= t0 + end - 1e-9:
            last = v
            i += 1
        if last is not None:
            out.append((t, last))
        t = round(t + tick, 9)
    return out


def test_track_counts_a_repeat_as_a_window_only_after_the_longest_window():
    tr = Track(window=0.2, tick=0.1)
    tr.add(10.0, 0.5)
    tr.add(10.1, 0.5)  # the same window read again one tick later
    tr.add(10.2, 0.5)  # a new window with the same number, or the old one if this window runs 0.3 s
    assert tr.b == [9.8, 10.0] and tr.v == [0.5]
    tr.add(10.3, 0.5)  # by now a new window has ended (at 10.2, when a repeat could first be seen)
    assert tr.b == [9.8, 10.0, pytest.approx(10.2)] and tr.v == [0.5, 0.5]
    tr.add(10.4, 0.5)
    tr.add(10.7, 0.9)  # a change: a new window of the nominal length; the time before keeps the old value
    assert tr.b == [9.8, 10.0, pytest.approx(10.2), pytest.approx(10.5), 10.7] and tr.v == [0.5, 0.5, 0.5, 0.9]
    tr.add(10.8, None)  # the series stopped: unknown from the last window on
    tr.add(11.3, 0.1)
    assert tr.b[-3:] == [10.8, pytest.approx(11.1), 11.3] and math.isnan(tr.v[-2]) and tr.v[-1] == 0.1
    integ, known = tr.integrate([10.6], [11.3])
    assert known[0] == pytest.approx(0.3) and integ[0] == pytest.approx(0.1 * 0.9 + 0.2 * 0.1)


def test_steps_are_joined_time_weighted_with_the_windows_they_overlap():
    t0 = time.monotonic() - 100.0
    # SM 100 % for the first second, 25 % the next, 50 % after; GPM windows of 0.2 s read at 10 Hz.
    sm = _windows(t0, [(0.2 * j, 1.0 if j <= 5 else 0.25 if j <= 10 else 0.5) for j in range(0, 16)])
    power = dict(_windows(t0, [(0.2 * j, 100.0 if j <= 5 else 300.0) for j in range(0, 16)]))
    snaps = [(t, {"gpu_sm_active_ratio": v, "gpu_utilization_ratio": 1.0, "gpu_power_watts": power[t],
                  "gpu_memory_used_bytes": 1e9}) for t, v in sm]
    j = Joiner(_ns(t0 + 0.2), ScriptedSource(snaps), warmup=0)
    j.feed([_ns(t0 + 0.8), (_ns(t0 + 1.2), 32, 4096), _ns(t0 + 2.6), _ns(t0 + 3.6)])
    recs = rows(j.process(final=True))
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    a, b, c, d = recs
    assert a["duration_s"] == pytest.approx(0.6) and a["gpu_busy_ratio"] == pytest.approx(1.0)
    assert b["gpu_busy_ratio"] == pytest.approx((0.2 * 1.0 + 0.2 * 0.25) / 0.4)
    assert c["gpu_busy_ratio"] == pytest.approx((0.8 * 0.25 + 0.6 * 0.5) / 1.4)
    assert a["energy_joules"] == pytest.approx(0.6 * 100) and b["energy_joules"] == pytest.approx(0.2 * 100 + 0.2 * 300)
    assert a["nvml_utilization_ratio"] == pytest.approx(1.0) and a["gpu_coverage_ratio"] == pytest.approx(1.0)
    assert b["samples_per_second"] == pytest.approx(32 / 0.4) and b["tokens_per_second"] == pytest.approx(4096 / 0.4)
    # The last step runs past the data: what is known is joined, and the step says it is short of data.
    assert 0 < d["gpu_coverage_ratio"] < 0.5
    assert "no_gpu_data" in d["flags"] and d["gpu_busy_ratio"] == pytest.approx(0.5)
    rep = j.report()
    total = sum(r["duration_s"] * r["gpu_coverage_ratio"] for r in recs)
    want = sum(r["gpu_busy_ratio"] * r["duration_s"] * r["gpu_coverage_ratio"] for r in recs) / total
    assert rep.gpu_busy_ratio == pytest.approx(want) and rep.nvml_utilization_ratio == pytest.approx(1.0)
    assert rep.steps == 4 and rep.energy_joules_total == pytest.approx(sum(r["energy_joules"] for r in recs))


def test_steps_wait_for_the_window_that_covers_their_end():
    t0 = time.monotonic()
    snaps = [(t0 + 0.1 * k, {"gpu_sm_active_ratio": 0.5}) for k in range(8)]
    src = ScriptedSource(snaps)
    j = Joiner(_ns(t0), src, warmup=0)
    j.feed([_ns(t0 + 0.1), _ns(t0 + 0.65)])
    recs = rows(j.process())
    assert [r["step"] for r in recs] == [0]  # the second step's end is not covered by a settled window yet
    assert len(j.pending) == 1
    assert [r["step"] for r in rows(j.process(final=True))] == [1]


def test_the_steps_are_joined_with_the_gpus_this_process_uses():
    t0 = time.monotonic() - 10
    snaps = [(t0 + 0.1 * k, {"gpu_sm_active_ratio": 0.3}) for k in range(12)]
    src = ScriptedSource(snaps, pid_on="1", labels=("0", "1"))
    j = Joiner(_ns(t0 + 0.2), src, warmup=0)
    j.feed([_ns(t0 + 0.8)])
    assert rows(j.process(final=True))[0]["gpus"] == ["1"]
    j2 = Joiner(_ns(t0 + 0.2), ScriptedSource(snaps, pid_on="1", labels=("0", "1")), warmup=0, devices="all")
    j2.feed([_ns(t0 + 0.8)])
    assert rows(j2.process(final=True))[0]["gpus"] == ["0", "1"]


def _steps(m, n, seconds, **kw):
    """n steps, `seconds` of sleep before each; returns the longest the second and later steps can have lasted
    by this thread's clock (a step's stamp lies between the clock read just before and just after its call)."""
    before, after = [], []
    for _ in range(n):
        time.sleep(seconds)
        before.append(time.monotonic())
        m.step(**kw)
        after.append(time.monotonic())
    return max((a - b for a, b in zip(after[1:], before, strict=False)), default=0.0)


@pytest.mark.parametrize("scenario", ["compute_bound", "h2d_pinned"])
def test_simulated_scenarios_give_their_sm_activity_not_nvml_utilization(scenario, tmp_path):
    prof = PROFILES[scenario]
    path = tmp_path / "steps.jsonl"
    with gpuscope.monitor(interval=0.05, log=path, simulate=scenario) as m:
        longest = _steps(m, 12, 0.08, samples=16)
    rep = m.report()
    assert rep.steps == 12 and rep.warmup_steps == 1 and rep.pending_steps == 0
    assert rep.simulated == scenario and rep.gpus == ["0"] and rep.source == "sampler"
    assert rep.gpu_busy_ratio == pytest.approx(prof.sm / 100, abs=0.05)
    assert rep.nvml_utilization_ratio == pytest.approx(prof.nvml_util / 100, abs=0.05)
    assert rep.power_watts == pytest.approx(prof.power, rel=0.1)
    assert 0.08 <= rep.step_seconds_median <= longest  # a sleep is never shorter; a loaded machine's is longer
    assert rep.samples_per_second == pytest.approx(16 / rep.step_seconds_mean, rel=0.01)
    assert rep.energy_joules_per_step_median == pytest.approx(prof.power * rep.step_seconds_median, rel=0.35)
    text = str(rep)
    assert f"SIMULATED node '{scenario}'" in text and "NVML 'utilization' said" in text
    lines = path.read_text().splitlines()
    assert len(lines) == 12
    recs = [json.loads(x) for x in lines]
    assert list(recs[0]) == list(FIELDS)
    assert [r["step"] for r in recs] == list(range(12)) and recs[0]["flags"][0] == "warmup"  # GPM needs a first window
    assert all(r["gpus"] == ["0"] and r["samples"] == 16 for r in recs)
    assert sum(r["duration_s"] for r in recs[1:]) == pytest.approx(rep.step_seconds_total)
    # A step no sampler window covered has no figure (absent, never 0): that happens on a starved machine.
    measured = [r for r in recs if r["gpu_busy_ratio"] is not None]
    assert len(measured) >= len(recs) // 2, recs
    assert all(abs(r["gpu_busy_ratio"] - prof.sm / 100) < 0.08 for r in measured)


def test_sm_activity_that_changes_with_the_steps_is_attributed_to_them(tmp_path):
    gpu = FakeGPU(index=0)
    gpu.gpm = {2: 0.0}
    s = Sampler(SamplerConfig(interval=0.05, gpm_window=0.1, medium=0.05, collect_host=False, events=False),
                nvml=FakeNVML([gpu]))
    try:
        with gpuscope.monitor(sampler=s, warmup_steps=0, log=tmp_path / "s.jsonl") as m:
            for i in range(6):
                gpu.gpm[2] = 100.0 if i % 2 == 0 else 0.0
                if i == 3:
                    m.mark("checkpoint")
                time.sleep(0.5)
                m.step()
        assert s._thread is not None  # the monitor never stops a sampler it was given
    finally:
        s.stop()
    recs = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    busy = [r["gpu_busy_ratio"] for r in recs]
    rep = m.report()
    assert rep.steps == 6 and [r["marks"] for r in recs] == [[]] * 3 + [["checkpoint"]] + [[]] * 2
    # The fake's GPM window that straddles a change reads half-busy: each boundary blurs by ~one window.
    assert all(b > 0.6 for b in busy[0::2]) and all(b < 0.4 for b in busy[1::2]), busy
    assert min(busy[0::2]) - max(busy[1::2]) > 0.35, busy
    assert rep.gpu_busy_ratio == pytest.approx(0.5, abs=0.12)


def test_parquet_step_log(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "steps.parquet"
    spans: list[float] = []
    with gpuscope.monitor(interval=0.05, log=path, simulate="healthy") as m:
        for _ in range(6):
            t = time.monotonic()
            with m.phase("data"):
                time.sleep(0.02)
            spans.append(time.monotonic() - t)
            time.sleep(0.04)
            m.step(tokens=100)
    t = pq.read_table(path)
    assert t.num_rows == 6 and t.column_names == list(FIELDS)
    rows = t.to_pylist()
    assert rows[0]["flags"][0] == "warmup" and all(r["tokens"] == 100 for r in rows)
    # each phase as long as its sleep at least, and no longer than this thread saw it last
    assert all(0.02 <= dict(r["phases"])["data"] <= span for r, span in zip(rows, spans, strict=True)), (rows, spans)
    assert all(r["gpu_busy_ratio"] is not None for r in rows)
    after_warmup = rows[1:]
    assert m.report().phase_ratio["data"] == pytest.approx(
        sum(dict(r["phases"])["data"] for r in after_warmup) / sum(r["duration_s"] for r in after_warmup))


@pytest.mark.parametrize("log, words", [
    ("{tmp}/no/such/dir/steps.jsonl", "does not exist"),
    ("{tmp}/steps.csv", "must end in .jsonl or .parquet"),
    ("{tmp}", "must end in"),
])
def test_a_bad_log_path_is_one_sentence_at_monitor_time(tmp_path, log, words):
    with pytest.raises(MonitorError) as ei:
        gpuscope.monitor(log=log.format(tmp=tmp_path), simulate="healthy")
    msg = str(ei.value)
    assert words in msg and msg.endswith(".") and "\n" not in msg


def test_parquet_without_pyarrow_is_refused_at_monitor_time(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(MonitorError, match="needs pyarrow"):
        gpuscope.monitor(log=tmp_path / "steps.parquet", simulate="healthy")
    assert not (tmp_path / "steps.parquet").exists()


@pytest.mark.parametrize("kw, words", [
    ({"interval": 0}, "interval must be positive"),
    ({"simulate": "nope"}, "Unknown scenario"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"warmup_steps": 1.5}, "warmup_steps must be a whole number"),
    ({"interval": "0.1"}, "interval must be a number"),
    ({"slow_factor": "2"}, "slow_factor must be a number above 1"),
    ({"flush_interval": None}, "flush_interval"),
    ({"simulate": True}, "simulate must be a scenario name"),
    ({"simulate": "healthy", "gpus": 0}, "gpus must be between 1 and 64"),
    ({"gpus": 2}, "simulated node"),
    ({"simulate": "healthy", "devices": [0.5]}, "devices must be GPU indices or UUIDs"),
    ({"log": 5}, "must be a file path"),
])
def test_bad_arguments_are_refused_at_monitor_time(kw, words):
    with pytest.raises(MonitorError, match=words) as ei:
        gpuscope.monitor(**kw)
    assert str(ei.value).endswith(".") and "\n" not in str(ei.value)


def test_devices_take_one_gpu_alone_and_say_when_none_is_on_the_node():
    with gpuscope.monitor(interval=0.05, simulate="healthy", devices=0) as m:
        _steps(m, 3, 0.05)
    assert m.report().gpus == ["0"]
    with gpuscope.monitor(interval=0.05, simulate="healthy", devices="GPU-not-here") as m:
        _steps(m, 3, 0.05)
    rep = m.report()
    assert rep.steps == 3 and rep.gpus == [] and any("none of devices" in n for n in rep.notes)


def test_the_users_exception_propagates_unchanged_and_the_monitor_stops(tmp_path):
    path = tmp_path / "steps.jsonl"
    err = KeyError("from the training loop")
    with pytest.raises(KeyError) as ei:
        with gpuscope.monitor(interval=0.05, log=path, simulate="healthy") as m:
            _steps(m, 3, 0.02)
            raise err
    assert ei.value is err
    assert m._thread is not None and not m._thread.is_alive()
    assert len(path.read_text().splitlines()) == 3 and m.report().steps == 3
    m.step()  # after stop: ignored, no error
    assert m.report().steps == 3


class BrokenHistory:
    """A sampler that starts fine but whose history cannot be read: a bug inside gpuscope."""

    config = SamplerConfig(interval=0.05)
    simulated = None

    def start(self):
        return self

    @property
    def history(self):
        raise RuntimeError("injected failure")


class CannotOpen(BrokenHistory):
    def start(self):
        raise RuntimeError("injected open failure")


@pytest.mark.parametrize("sampler", [BrokenHistory(), CannotOpen()])
def test_internal_failures_never_reach_the_users_code(sampler, tmp_path, caplog):
    path = tmp_path / "steps.jsonl"
    with caplog.at_level(logging.WARNING, logger="gpuscope.monitor"):
        with gpuscope.monitor(log=path, sampler=sampler, flush_interval=0.02) as m:
            longest = _steps(m, 5, 0.03)
            time.sleep(0.1)  # several background passes over the failure
        rep = m.report()
    assert rep.steps == 5 and 0.03 <= rep.step_seconds_median <= longest
    assert rep.gpu_busy_ratio is None and rep.notes
    assert len(path.read_text().splitlines()) == 5
    warnings = [r for r in caplog.records if r.name == "gpuscope.monitor"]
    assert 1 <= len(warnings) <= 2 and all("logged once" in r.getMessage() for r in warnings)


def test_start_never_raises_without_a_thread_or_with_an_odd_sampler(monkeypatch):
    class OddSampler:
        config = object()  # no interval, no windows

        def start(self):
            return self

    with gpuscope.monitor(sampler=OddSampler()) as m:
        _steps(m, 2, 0.01)
    assert m.report().steps == 2 and m.report().source == "none"
    import threading

    start = threading.Thread.start

    def no_monitor_thread(self):
        if self.name == "gpuscope-monitor":
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", no_monitor_thread)
    with gpuscope.monitor(interval=0.05, simulate="healthy") as m:
        m.step()
    assert m.report().steps == 0 and not sys.modules["gpuscope.integrations.monitor"]._shared


def test_odd_sample_counts_are_left_out_not_the_run(tmp_path, caplog):
    path = tmp_path / "steps.jsonl"
    with caplog.at_level(logging.WARNING, logger="gpuscope.monitor"):
        with gpuscope.monitor(interval=0.05, simulate="healthy", log=path) as m:
            for x in ("a batch", 8, 2.5):
                time.sleep(0.03)
                m.step(samples=x)
    rep = m.report()
    assert rep.steps == 3 and rep.gpu_busy_ratio is not None and rep.samples_per_second > 0
    assert [json.loads(x)["samples"] for x in path.read_text().splitlines()] == [None, 8, 2.5]
    assert not [r for r in caplog.records if r.name == "gpuscope.monitor"]


def test_no_gpu_warns_once_and_still_times_the_steps(caplog):
    s = Sampler(SamplerConfig(interval=0.05), nvml=FakeNVML(available=False))
    with caplog.at_level(logging.WARNING, logger="gpuscope.monitor"):
        with gpuscope.monitor(sampler=s) as m:
            _steps(m, 4, 0.02)
    rep = m.report()
    assert rep.steps == 4 and rep.source == "none" and rep.gpu_coverage_ratio is None
    assert any("simulate='healthy'" in n for n in rep.notes)
    assert sum("logged once" in r.getMessage() for r in caplog.records) == 1


def test_a_failing_log_write_loses_the_log_not_the_run(tmp_path, caplog):
    path = tmp_path / "steps.jsonl"
    with gpuscope.monitor(log=path, simulate="healthy", interval=0.05) as m:
        def full_disk(records):
            raise OSError(28, "No space left on device")

        m._joiner.log.write = full_disk
        _steps(m, 3, 0.02)
    rep = m.report()
    assert rep.steps == 3 and any("No space left" in n for n in rep.notes)


def test_monitors_in_one_process_share_one_sampler():
    a = gpuscope.monitor(interval=0.05, simulate="healthy").start()
    b = gpuscope.monitor(interval=0.05, simulate="healthy").start()
    try:
        assert a.sampler is b.sampler and a.sampler._thread is not None
        _steps(a, 2, 0.02)
        _steps(b, 3, 0.02)
    finally:
        a.stop()
        assert b.sampler._thread is not None  # still in use by b
        b.stop()
    assert a.sampler._thread is None and a.report().steps == 2 and b.report().steps == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_cannot_use_or_block_on_the_parents_monitor():
    with gpuscope.monitor(interval=0.05, simulate="healthy") as m:
        m.step()
        pid = os.fork()
        if pid == 0:  # the child: threads did not come along; step and stop must be no-ops
            code = 1
            try:
                n = len(m._queue)  # what the parent had marked but not handed over at the fork
                t = time.monotonic()
                m.step()
                m.stop()
                code = 0 if len(m._queue) == n and time.monotonic() - t < 0.5 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        m.step()
    assert os.waitstatus_to_exitcode(status) == 0
    assert m.report().steps == 2


def test_the_verdict_over_the_run_is_the_diagnosis_of_its_windows():
    s = Sampler(SamplerConfig(interval=0.1, collect_host=False), simulate="launch_bound")
    try:
        with gpuscope.monitor(sampler=s, print_report=False) as m:
            _steps(m, 12, 0.5)
        expected = {v.kind for v in diagnose(windows_from_snapshots(list(s.history))) if v.primary}
    finally:
        s.stop()
    rep = m.report()
    assert rep.verdicts and rep.verdicts[0].gpu == "0" and rep.verdicts[0].kind in expected
    assert sum(v.share for v in rep.verdicts) == pytest.approx(1.0)
    assert rep.verdicts[0].kind in str(rep)


def test_metrics_and_printed_report(capsys):
    with gpuscope.monitor(interval=0.05, simulate="compute_bound", print_report=True, flush_interval=0.2) as m:
        longest = _steps(m, 4, 0.05)
        time.sleep(0.6)
        live = m.metrics()
    assert live["gpu_busy_ratio"] == pytest.approx(PROFILES["compute_bound"].sm / 100, abs=0.05)
    assert 0.05 <= live["step_seconds"] <= longest and live["energy_joules_per_step"] > 0
    err = capsys.readouterr().err
    assert "gpuscope: 4 steps" in err and "GPU busy" in err


def test_stop_inside_the_with_block_then_leaving_it_returns_the_same_report():
    with gpuscope.monitor(interval=0.05, simulate="healthy") as m:
        _steps(m, 2, 0.02)
        first = m.stop()
        m.step()  # after stop: ignored
    assert first.steps == 2 and m.stop().steps == 2


def test_step_costs_nothing_before_start_and_after_stop():
    m = gpuscope.monitor(simulate="healthy")
    m.step()
    with m.phase("x"):
        pass
    m.mark("y")
    assert len(m._queue) == 0 and m.report().steps == 0
    assert m.stop().steps == 0  # stop without start: a report, no error


def test_import_gpuscope_does_not_import_the_frameworks():
    import subprocess

    code = ("import sys, gpuscope; bad = [m for m in ('torch', 'lightning', 'transformers', 'numpy') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_shared_state_is_clean_after_the_tests():
    assert not sys.modules["gpuscope.integrations.monitor"]._shared


def test_the_jsonl_encoder_writes_what_json_would(tmp_path):
    from gpuscope.integrations._steplog import JsonlLog

    t0 = time.monotonic() - 10
    src = ScriptedSource([(t0 + 0.1 * k, {"gpu_sm_active_ratio": 0.25 + 0.01 * k, "gpu_power_watts": 200.0})
                          for k in range(12)])
    j = Joiner(_ns(t0 + 0.2), src, warmup=1)
    j.feed([("phase", "data", _ns(t0 + 0.25), _ns(t0 + 0.3)), ("mark", "eval \"1\"", _ns(t0 + 0.5)),
            _ns(t0 + 0.4), (_ns(t0 + 0.6), 3, 2.5), _ns(t0 + 1.6)])
    cols = j.process(final=True)
    log = JsonlLog(str(tmp_path / "s.jsonl"))
    log.write(cols)
    log.close()
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == json.loads(json.dumps(rows(cols)))
    assert [json.loads(x)["flags"] for x in lines][:1] == [["warmup"]]
