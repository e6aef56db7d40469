"""GpuWatch against a real agent process and the simulated node; join_stages on readings with known energy."""

from __future__ import annotations

import time

import pytest
from test_agent import AgentProc

from gpuscope.loadtest.gpu import GpuWatch, gpu_stats, join_stages, main_throttle
from gpuscope.loadtest.records import GpuReading


def _clock() -> tuple[float, float]:
    return time.time(), time.perf_counter()


def _wait_for(watch: GpuWatch, n: int, timeout: float = 20.0) -> None:
    """Until the watch holds n ticks (a slow shared CI machine gets time; nothing here asserts a rate)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and len(watch._ticks) < n:
        time.sleep(0.05)


def test_simulated_node_readings_on_the_run_clock():
    clock = _clock()
    w = GpuWatch(simulate="compute_bound", clock=clock)
    w.start()
    _wait_for(w, 5)
    readings = w.stop()
    elapsed = time.perf_counter() - clock[1]  # after stop(): no reading can be stamped later
    assert w.source.startswith("simulated (compute_bound)")
    assert len(readings) >= 5
    ts = [r.t for r in readings]
    assert ts == sorted(ts) and 0 <= ts[0] and ts[-1] <= elapsed
    r = readings[-1]
    assert r.gpu == "0" and r.source == "simulated (compute_bound)"
    assert 0.8 < r.sm_active <= 1.0 and r.power_w > 500 and 0 < r.mem_used_frac < 0.1
    assert r.energy_j > 0 and r.throttle == "sw_power_cap"  # compute_bound is power-capped on an H200


def test_memory_is_bounded_and_covers_the_whole_run():
    w = GpuWatch(simulate="healthy", clock=_clock(), hz=50.0, max_ticks=8)
    w.start()
    _wait_for(w, 7)
    time.sleep(0.6)
    readings = w.stop()
    assert w._stride >= 2  # it filled at least once and halved
    assert len(readings) < 8
    assert readings[0].t < 0.3 and readings[-1].t - readings[0].t > 0.4


def test_nothing_to_read_says_why_and_never_raises():
    w = GpuWatch(agent_url="http://127.0.0.1:9", simulate="no_such_scenario", clock=_clock())
    w.start()
    assert w.stop() == []
    assert w.source.startswith("no GPU data")
    assert "the agent at http://127.0.0.1:9 did not answer" in w.source
    assert "Unknown scenario 'no_such_scenario'" in w.source
    w2 = GpuWatch(agent_url="not a url", simulate="healthy", clock=_clock())
    w2.start()
    _wait_for(w2, 1)
    assert w2.stop() and "read instead: simulated (healthy)" in w2.source


@pytest.fixture
def agent2(tmp_path):
    a = AgentProc(tmp_path, "--simulate", "healthy", "--gpus", "2")  # samples every 50 ms
    a.wait_ready()
    yield a
    a.stop()


def test_reads_a_running_agent_per_gpu_on_the_run_clock(agent2):
    clock = _clock()
    w = GpuWatch(agent_url=f"http://127.0.0.1:{agent2.port}/", token=agent2.token(), clock=clock, hz=10)
    w.start()
    assert w.source.startswith(f"agent http://127.0.0.1:{agent2.port} (every 50 ms")
    assert "simulated scenario healthy" in w.source
    _wait_for(w, 6)
    readings = w.stop()
    elapsed = time.perf_counter() - clock[1]  # after stop(): no snapshot read can be stamped later
    assert {r.gpu for r in readings} == {"0", "1"}
    ts = [r.t for r in readings]
    # wall time moved onto the run clock (0.5 s for the two clocks' drift, not for load)
    assert ts == sorted(ts) and -0.5 < ts[0] and ts[-1] < elapsed + 0.5
    assert len(set(ts)) == len(ts) / 2  # each agent snapshot kept once (two GPUs per snapshot)
    r = readings[-1]
    assert 0.7 < r.sm_active < 1.0 and r.power_w > 500 and r.energy_j > 0 and r.mem_used_frac > 0


def test_a_slow_agent_is_read_at_its_own_rate_and_said_so(tmp_path):
    a = AgentProc(tmp_path, "--simulate", "healthy", "--interval", "500ms")
    a.wait_ready()
    try:
        w = GpuWatch(agent_url=f"http://127.0.0.1:{a.port}", clock=_clock())
        w.start()
        assert "samples every 500 ms, slower than the 10 Hz asked" in w.source
        _wait_for(w, 2)
        readings = w.stop()
        assert len(readings) >= 2 and readings[1].t - readings[0].t > 0.3
    finally:
        a.stop()


def _steady(gpu: str = "0", watts: float = 100.0, counter: bool = True, n: int = 101) -> list[GpuReading]:
    """n readings 0.1 s apart at constant power; the energy counter starts at 5 kJ."""
    return [GpuReading(t=i * 0.1, gpu=gpu, sm_active=0.5 + (i % 2) * 0.2, power_w=watts, mem_used_frac=i / 1000,
                       energy_j=5000 + watts * i * 0.1 if counter else None,
                       throttle="sw_thermal" if i % 4 == 0 else ("sw_power_cap" if i % 10 == 1 else None))
            for i in range(n)]


def _summary() -> dict:
    return {"duration_s": 10.0,
            "stages": [{"index": 0, "name": "a", "start_s": 2.0, "end_s": 4.0,
                        "stats": {"completed": 50, "output_tokens": 400}},
                       {"index": 1, "name": "b", "start_s": 4.0, "end_s": 9.0, "stats": {"completed": 0}}],
            "overall": {"completed": 50, "output_tokens": 400}}


def test_join_stages_energy_from_counter_and_from_power():
    s = _summary()
    join_stages(s, _steady("0") + _steady("1", watts=300.0), source="test")
    g = s["stages"][0]["gpu"]
    assert g["energy_from"] == "counter"
    assert g["energy_j"] == pytest.approx(2.0 * 400.0)  # 2 s at 100 W + 300 W
    assert g["j_per_request"] == pytest.approx(800 / 50) and g["j_per_output_token"] == pytest.approx(2.0)
    assert g["power_w_mean"] == pytest.approx(400.0) and g["gpus"] == 2
    assert s["stages"][1]["gpu"]["energy_j"] == pytest.approx(5 * 400.0)
    assert s["stages"][1]["gpu"]["j_per_request"] is None  # nothing completed: no cost per request
    assert s["overall"]["gpu"]["energy_j"] == pytest.approx(7 * 400.0)
    assert s["gpu_source"] == "test"
    s2 = _summary()
    join_stages(s2, _steady("0", counter=False))
    g2 = s2["stages"][0]["gpu"]
    assert g2["energy_from"] == "power" and g2["energy_j"] == pytest.approx(200.0)


def test_gpu_stats_activity_memory_and_throttling():
    g = gpu_stats(_steady(), 0.0, 10.0)
    assert g["readings"] == 100
    assert g["sm_active_mean"] == pytest.approx(0.6) and g["sm_active_p95"] == pytest.approx(0.7)
    assert g["mem_used_frac_max"] == pytest.approx(0.099)
    # every 4th reading thermal, 1 in 10 power capped (i = 1, 11, 21, ... never a multiple of 4)
    assert g["throttled_frac"] == pytest.approx(0.35) and g["throttle_reason"] == "sw_thermal"
    empty = gpu_stats([], 0.0, 1.0)
    assert empty == {"readings": 0, "gpus": 0}
    s = _summary()
    join_stages(s, [])
    assert s["stages"][0]["gpu"]["readings"] == 0 and "gpu_source" not in s


def test_main_throttle_prefers_hardware_reasons_and_ignores_idle():
    assert main_throttle(["gpu_idle"]) is None
    assert main_throttle(["sw_power_cap", "hw_slowdown"]) == "hw_slowdown"
    assert main_throttle(["sw_power_cap", "sw_thermal"]) == "sw_thermal"


def test_watch_keeps_only_the_asked_gpus_and_names_a_wrong_one(agent2):
    url = f"http://127.0.0.1:{agent2.port}"
    w = GpuWatch(agent_url=url, token=agent2.token(), clock=_clock(), gpus=["1"])
    w.start()
    _wait_for(w, 3)
    readings = w.stop()
    assert readings and {r.gpu for r in readings} == {"1"}
    w2 = GpuWatch(agent_url=url, token=agent2.token(), clock=_clock(), gpus=["7"])
    w2.start()
    time.sleep(0.5)
    assert w2.stop() == []
    assert w2.source.startswith("no GPU data: --gpus 7 matched none of the GPUs read") and "(0, 1)" in w2.source
    w3 = GpuWatch(agent_url=url, token=agent2.token(), clock=_clock(), gpus=["0", "5"])
    w3.start()
    _wait_for(w3, 2)
    assert {r.gpu for r in w3.stop()} == {"0"} and "--gpus 5 matched no GPU (there are 0, 1)" in w3.source


def test_local_watch_says_which_gpus_it_reads():
    w = GpuWatch(simulate="healthy", clock=_clock(), gpus=["0"])
    w.start()
    _wait_for(w, 2)
    readings = w.stop()
    assert {r.gpu for r in readings} == {"0"}
    assert "(GPU 0 of " in w.source or "(1 GPU," in w.source


def _idle(gpu: str, n: int = 101) -> list[GpuReading]:
    return [GpuReading(t=i * 0.1, gpu=gpu, sm_active=0.0, nvml_util=0.0, power_w=80.0, mem_used_frac=0.0,
                       energy_j=9000 + 8.0 * i) for i in range(n)]


def test_per_gpu_figures_and_an_idle_gpu_named():
    s = _summary()
    join_stages(s, _steady("0") + _idle("1"))
    g = s["stages"][0]["gpu"]
    assert g["sm_active_mean"] == pytest.approx(0.3)  # the idle GPU halves the node's mean ...
    per = g["per_gpu"]
    assert per["0"]["sm_active_mean"] == pytest.approx(0.6) and per["1"]["sm_active_mean"] == 0.0  # ... not GPU 0's
    assert per["0"]["energy_j"] == pytest.approx(200.0) and per["1"]["energy_j"] == pytest.approx(160.0)
    assert g["energy_j"] == pytest.approx(360.0)
    assert s["gpu_note"].startswith("GPU 1 stayed idle through the run") and "--gpus 0 leaves it out" in s["gpu_note"]
    one = _summary()
    join_stages(one, _steady("0"))
    assert "per_gpu" not in one["stages"][0]["gpu"] and "gpu_note" not in one
    both_idle = _summary()
    join_stages(both_idle, _idle("0") + _idle("1"))
    assert "every GPU read stayed idle" in both_idle["gpu_note"]


def test_a_capacity_search_s_overall_gpu_figures_are_the_chosen_trial_s():
    s = _summary()
    s["overall"] = {"completed": 50, "output_tokens": 400}  # the figures of trial 0, as the search writes them
    s["overall_stage"] = 0
    join_stages(s, _steady("0"))
    assert s["overall"]["gpu"] == s["stages"][0]["gpu"]
    assert s["overall"]["gpu"]["j_per_request"] == pytest.approx(200.0 / 50)  # 2 s at 100 W, not the whole run's 700 J
