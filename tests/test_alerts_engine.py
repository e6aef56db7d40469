"""The alert state machine driven by explicit times, the windowed aggregates on hand-made snapshots, and
the built-in rules on the simulated scenarios (each fires what it should and nothing else)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from gpuscope import Sampler, SamplerConfig
from gpuscope._records import GpuIdentity, GpuRecord, HostRecord, Snapshot
from gpuscope.alerts import Engine, Observation, Rule, load_rules
from gpuscope.alerts.engine import evaluate_metric, fingerprint, render_template

HOT = Rule("GpuHot", metric="gpu_temperature_celsius", agg="last", op=">", threshold=85.0, resolve_threshold=80.0,
           for_s=60.0, summary="GPU {gpu} at {value:.0f} C")


def obs(value: float, gpu: str = "0") -> Observation:
    return Observation({"gpu": gpu, "hostname": "n1"}, value, context={"gpu": gpu})


def statuses(notes):
    return [(n.status, n.labels["gpu"], n.repeat) for n in notes]


def test_for_pending_then_firing_and_a_pending_that_stops_is_silent():
    e = Engine([HOT])
    assert e.step(HOT, [obs(90)], 0.0) == []
    assert [a.state for a in e.active()] == ["pending"]
    assert e.step(HOT, [obs(90)], 30.0) == []
    assert e.step(HOT, [obs(70)], 40.0) == []  # back to inactive before `for` ran out: nobody hears of it
    assert e.active() == [] and list(e.resolved) == []
    assert e.step(HOT, [obs(90)], 50.0) == []  # a new pending period starts now
    assert e.step(HOT, [obs(90)], 109.0) == []
    notes = e.step(HOT, [obs(91)], 110.0)
    assert statuses(notes) == [("firing", "0", False)]
    n = notes[0]
    assert n.starts_at == 50.0 and n.ends_at is None and n.value == 91
    assert n.labels == {"gpu": "0", "hostname": "n1", "alertname": "GpuHot", "severity": "warning"}
    assert n.annotations["summary"] == "GPU 0 at 91 C" and n.annotations["value"] == "91"


def test_hysteresis_holds_between_the_thresholds_and_resolves_once():
    e = Engine([HOT])
    rule = replace(HOT, for_s=0.0)
    assert statuses(e.step(rule, [obs(90)], 0.0)) == [("firing", "0", False)]
    for t, v in ((5, 84), (10, 81), (15, 80.5)):  # below the threshold, above the resolve threshold
        assert e.step(rule, [obs(v)], float(t)) == []
        assert [a.state for a in e.active()] == ["firing"]
    notes = e.step(rule, [obs(80)], 20.0)
    assert statuses(notes) == [("resolved", "0", False)] and notes[0].ends_at == 20.0 and notes[0].starts_at == 0.0
    assert e.active() == [] and [a.state for a in e.resolved] == ["resolved"]
    assert e.step(rule, [obs(84)], 25.0) == []  # not firing any more: 84 is below the firing threshold
    assert e.active() == []


def test_keep_firing_for_and_a_vanished_series():
    rule = Rule("Xid", metric="gpu_xid_events_total", agg="increase", op=">", threshold=0.0, keep_firing_for_s=60.0)
    e = Engine([rule])
    assert statuses(e.step(rule, [obs(3)], 0.0)) == [("firing", "0", False)]
    assert e.step(rule, [obs(0)], 30.0) == []  # condition gone, kept firing
    assert e.step(rule, [], 59.0) == []  # series gone too, still within keep_firing_for
    assert statuses(e.step(rule, [], 60.0)) == [("resolved", "0", False)]


def test_dedup_one_notification_per_transition_and_repeats_for_long_firing():
    rule = Rule("Lost", metric="gpu_healthy", agg="last", op="<", threshold=1.0, repeat_interval_s=3600.0)
    e = Engine([rule])
    sent = []
    for t in range(0, 7300, 5):  # two hours of evaluations every 5 s
        sent += e.step(rule, [obs(0.0), obs(1.0, gpu="1")], float(t))
    assert [(n.status, n.labels["gpu"], n.repeat, n.starts_at) for n in sent] == [
        ("firing", "0", False, 0.0), ("firing", "0", True, 0.0), ("firing", "0", True, 0.0)]
    assert len({n.fingerprint for n in sent}) == 1 and len(e.active()) == 1


def test_label_sets_are_separate_alerts_and_fingerprints_are_stable():
    rule = Rule("Hot", metric="gpu_temperature_celsius", agg="last", op=">", threshold=85.0, labels=(("team", "ml"),))
    e = Engine([rule])
    notes = e.step(rule, [obs(90, "0"), obs(70, "1"), obs(95, "2")], 0.0)
    assert sorted(n.labels["gpu"] for n in notes) == ["0", "2"]
    assert all(n.labels["team"] == "ml" for n in notes)
    assert notes[0].fingerprint == fingerprint(dict(notes[0].labels)) != notes[1].fingerprint
    assert statuses(e.step(rule, [obs(90, "0"), obs(70, "1"), obs(80, "2")], 5.0)) == [("resolved", "2", False)]
    again = e.step(rule, [obs(90, "0"), obs(90, "2")], 10.0)
    assert statuses(again) == [("firing", "2", False)] and again[0].starts_at == 10.0


def test_removed_rule_resolves_its_alerts():
    rule = Rule("Lost", metric="gpu_healthy", agg="last", op="<", threshold=1.0)
    e = Engine([rule])
    e.step(rule, [obs(0.0)], 0.0)
    e.set_rules([])
    assert statuses(e.evaluate([], now=5.0)) == [("resolved", "0", False)]


def test_templates_never_raise():
    assert render_template("GPU {gpu} {value:.1f}", {"gpu": "3", "value": 2.25}) == "GPU 3 2.2"
    assert render_template("GPU {gpu:.1f}", {"gpu": "3"}) == "GPU {gpu:.1f}"  # wrong spec: left as written
    assert render_template("{unknown}", {}) == ""


# -- windowed aggregates on hand-made snapshots ---------------------------------------------------------

IDENT = GpuIdentity(0, "GPU-aaaa", "H200")


def snaps(series: dict[str, list[float | None]], dt: float = 1.0, t0: float = 1_000_000.0) -> list[Snapshot]:
    n = max(len(v) for v in series.values())
    out = []
    for i in range(n):
        t = int((t0 + i * dt) * 1e9)
        vals = {k: v[i] for k, v in series.items() if i < len(v) and v[i] is not None}
        host = HostRecord(t, {"host_load1": float(i)})
        out.append(Snapshot(t, [GpuRecord(IDENT, t, vals)], [], host, [], None, "n1"))
    return out


def one(rule: Rule, s) -> float | None:
    got = evaluate_metric(rule, s)
    return got[0].value if got else None


@pytest.mark.parametrize("agg,expected", [("avg", 25.0), ("max", 40.0), ("min", 10.0), ("last", 40.0)])
def test_gauge_aggregates_cover_only_the_window(agg, expected):
    s = snaps({"gpu_power_watts": [500, 500, 500, 10, 20, 30, 40]})  # t = 0..6 s; window 3 s holds t = 3..6
    r = Rule("P", metric="gpu_power_watts", agg=agg, window_s=3.0)
    assert one(r, s) == expected


def test_counter_increase_rate_reset_and_born_in_window():
    key = 'gpu_xid_events_total{xid="79"}'
    s = snaps({"gpu_ecc_uncorrected_errors_total": [5, 5, 7, 8, 1, 2],  # a reset after 8 (driver reload)
               key: [None, None, None, 1, 1, 3]})  # created by the first event, inside the window
    inc = Rule("E", metric="gpu_ecc_uncorrected_errors_total", agg="increase", window_s=10.0)
    assert one(inc, s) == (7 - 5) + (8 - 7) + 1 + (2 - 1)
    rate = Rule("E", metric="gpu_ecc_uncorrected_errors_total", agg="rate", window_s=10.0)
    assert one(rate, s) == pytest.approx(5 / 5.0)
    xid = Rule("X", metric="gpu_xid_events_total", agg="increase", window_s=10.0, match=(("xid", "79"),))
    got = evaluate_metric(xid, s)
    assert [(o.labels["xid"], o.labels["gpu"], o.labels["uuid"], o.value) for o in got] == [("79", "0", "GPU-aaaa", 3.0)]
    assert evaluate_metric(Rule("X", metric="gpu_xid_events_total", match=(("xid", "13"),)), s) == []
    assert evaluate_metric(Rule("X", metric="gpu_xid_events_total", match=(("gpu", "1"),)), s) == []
    # a counter present from the window's start counts only what it gained
    assert one(Rule("X", metric="gpu_xid_events_total", agg="increase", window_s=2.0), s) == 2.0


def test_host_metrics_and_missing_series():
    s = snaps({"gpu_power_watts": [1, 2, 3]})
    got = evaluate_metric(Rule("L", metric="host_load1", agg="max", window_s=60.0), s)
    assert [(o.labels, o.value) for o in got] == [({"hostname": "n1"}, 2.0)]
    assert evaluate_metric(Rule("T", metric="gpu_temperature_celsius"), s) == []  # not read: no value, not 0
    assert evaluate_metric(Rule("T", metric="gpu_temperature_celsius"), []) == []


# -- the built-in rules on the simulated node ------------------------------------------------------------

SCENARIOS = ("healthy", "throttled", "xid_storm", "idle_allocated", "memory_leak", "gpu_lost")


@pytest.fixture(scope="module")
def histories():
    """About 11 s of every scenario, sampled at once (gpu_lost loses GPU 1 after 10 s)."""
    samplers = {sc: Sampler(SamplerConfig(interval=0.1), simulate=sc) for sc in SCENARIOS}
    threads = [threading.Thread(target=s.start) for s in samplers.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(11.5)
    for s in samplers.values():
        s.stop()
    return {sc: list(s.history) for sc, s in samplers.items()}


def fired(engine: Engine, snaps, times) -> list[tuple[str, str, str]]:
    out = []
    for t in times:
        out += [(n.status, n.labels["alertname"], n.labels["gpu"]) for n in engine.evaluate(snaps, t)]
    return out


def test_builtins_on_a_healthy_node_fire_nothing(histories):
    e = Engine(load_rules())
    assert fired(e, histories["healthy"], [0, 61, 122, 4000]) == []
    assert e.active() == []


def test_builtins_throttled_fires_after_its_minute_with_the_verdict(histories):
    e = Engine(load_rules())
    snaps = histories["throttled"]
    assert fired(e, snaps, [0, 30]) == []
    assert [(a.rule, a.state) for a in e.active()] == [("GpuThrottled", "pending")]
    assert fired(e, snaps, [60]) == [("firing", "GpuThrottled", "0")]
    a = e.active()[0]
    assert a.labels["simulated"] == "throttled" and a.labels["severity"] == "warning"
    assert "throttled by" in a.annotations["verdict"] and a.annotations["recommendation"]


def test_builtins_xid_storm_fires_per_code_at_once(histories):
    e = Engine(load_rules())
    got = e.evaluate(histories["xid_storm"], 0)
    assert {(n.labels["alertname"], n.labels["xid"]) for n in got} == {("GpuXidErrors", "13"), ("GpuXidErrors", "31"),
                                                                      ("GpuXidErrors", "43")}
    assert all(n.labels["severity"] == "critical" and float(n.annotations["value"]) >= 1 for n in got)


def test_builtins_gpu_lost_only_on_the_lost_gpu(histories):
    e = Engine(load_rules())
    got = {(n.labels["alertname"], n.labels["gpu"]) for n in e.evaluate(histories["gpu_lost"], 0)}
    assert ("GpuLost", "1") in got and ("GpuLost", "0") not in got
    assert ("GpuXidErrors", "1") in got  # XID 79 came with it


def test_builtins_idle_allocated_waits_30_minutes(histories):
    e = Engine(load_rules())
    snaps = histories["idle_allocated"]
    assert fired(e, snaps, [0, 1799]) == []
    assert fired(e, snaps, [1800]) == [("firing", "GpuIdleAllocated", "0")]


def test_builtins_memory_leak_fires_memory_growth(histories):
    e = Engine(load_rules())
    assert fired(e, histories["memory_leak"], [0, 60]) == [("firing", "GpuMemoryGrowth", "0")]


def test_a_verdict_rule_with_the_shortest_window_fires(histories):
    """A 5 s window must span 5 s of samples, the least the diagnosis accepts."""
    rule = Rule("ThrottledNow", verdict="throttled", window_s=5.0)
    e = Engine([rule])
    assert [(n.status, n.labels["gpu"]) for n in e.evaluate(histories["throttled"], 0)] == [("firing", "0")]
    assert sorted(e.verdicts) == [5.0, 30.0]
