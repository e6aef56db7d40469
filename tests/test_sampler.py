"""The sampler: a drift-free schedule, cost-aware cadence, bounded memory, and a loop that no consumer,
source or config mistake can break."""

import json
import logging
import math
import threading
import time

import pytest

from gpuscope import ConfigError, NvmlUnavailable, Sampler, SamplerConfig
from gpuscope.catalog import CATALOG
from gpuscope.testing import FakeNVML, healthy_gpus


def sampler_threads():
    return [t for t in threading.enumerate() if t.name == "gpuscope-sampler" and t.is_alive()]


# ---- schedule ---------------------------------------------------------------------------------------


def test_schedule_does_not_drift(make_sampler):
    interval = 0.02
    s = make_sampler(healthy_gpus(1), interval=interval)
    starts = []

    def costly_consumer(snap):
        # a quarter of the interval per tick: a loop that sleeps `interval` after each tick would run
        # 40 ticks a second, not 50
        starts.append(time.monotonic())
        time.sleep(interval / 4)

    s.subscribe(costly_consumer)
    before_start = time.monotonic()
    s.start()
    time.sleep(1.0)
    s.stop()
    after_stop = time.monotonic()
    assert s.ticks >= 10, s.ticks
    # Tick k is due at t0 + k*interval whatever each tick cost: ticks run plus ticks skipped account for the
    # whole run (a sleep(interval) loop would lose the tick cost every time: 40 slots of 50). The schedule began
    # between start() and the first tick and ended inside stop(), whatever a loaded machine made them cost; the
    # slots from the first tick to the last one are all accounted for (a thread starved at the end, whose
    # last tick came well before stop(), has not yet counted the slots it slept through).
    fewest, most = (starts[-1] - starts[0]) / interval, (after_stop - before_start) / interval
    assert fewest - 2 <= s.ticks + s.missed_ticks <= most + 1, (s.ticks, s.missed_ticks, fewest, most)


def test_a_late_tick_skips_instead_of_bunching(make_sampler):
    interval = 0.02
    s = make_sampler(healthy_gpus(1), interval=interval)
    stamps = []

    def slow_once(snap):
        stamps.append(time.monotonic())
        if len(stamps) == 5:
            time.sleep(0.1)  # five intervals

    s.subscribe(slow_once)
    s.start()
    deadline = time.monotonic() + 30
    while len(stamps) < 10 and time.monotonic() < deadline:  # a loaded machine ticks later, never sooner
        time.sleep(0.05)
    s.stop()
    assert s.missed_ticks >= 3
    after = [b - a for a, b in zip(stamps[4:], stamps[5:], strict=False)]
    # right after the stall: not five back to back. A short gap follows a tick run late in its slot (the
    # stall's catch-up, or a loaded machine's wake-up), and two in a row would need a tick over a slot late.
    assert len(after) >= 4 and sum(1 for gap in after[:4] if gap < interval / 4) <= 2


def test_expensive_groups_run_at_their_own_period(make_sampler):
    # 50 ticks 10 ms apart on the sampler's own clock (the ticks' times are given, so a loaded machine that
    # runs the thread late cannot change what is asserted; the thread's pacing has tests of its own)
    fake = healthy_gpus(1)
    s = make_sampler(fake, interval=0.01, slow=0.1, energy=60.0, rare=60.0)
    s.open()
    base = fake.calls.copy()
    t0 = time.monotonic()
    for i in range(50):
        s._tick(t0 + i * 0.01)
    calls = {k: v - base.get(k, 0) for k, v in fake.calls.items()}
    assert s.ticks == 50
    assert calls["nvmlDeviceGetCurrentClocksEventReasons"] == 50  # fast: every tick
    assert calls["nvmlDeviceGetEncoderUtilization"] == 5  # slow: every 0.1 s (0, 0.1, ..., 0.4)
    assert calls["nvmlDeviceGetTotalEnergyConsumption"] == 1  # ~2.4 ms per read on an H200
    assert calls["nvmlDeviceGetRemappedRows"] == 1


# ---- memory -----------------------------------------------------------------------------------------


def test_history_is_bounded(make_sampler):
    s = make_sampler(healthy_gpus(1), history=5)
    snaps = [s.sample_once() for _ in range(12)]
    assert len(s.history) == 5
    assert list(s.history) == snaps[-5:]
    assert s.latest() is snaps[-1]


def test_events_history_is_bounded(make_sampler):
    s = make_sampler(healthy_gpus(1))
    cap = s.events_history.maxlen
    assert cap is not None and cap <= 1_000  # memory bounded however many events a churning node makes
    s.events_history.extend(range(5 * cap))
    assert len(s.events_history) == cap and s.events_history[-1] == 5 * cap - 1


# ---- robustness -------------------------------------------------------------------------------------


def test_subscriber_exceptions_do_not_stop_sampling(make_sampler, caplog):
    s = make_sampler(healthy_gpus(1), interval=0.01)
    received = []

    def broken(snap):
        raise RuntimeError("consumer bug")

    s.subscribe(broken)
    s.subscribe(received.append)
    with caplog.at_level(logging.WARNING, logger="gpuscope.sampler"):
        s.start()
        deadline = time.monotonic() + 30  # ten ticks, however slowly a loaded machine runs them
        while s.ticks < 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        s.stop()
    assert s.ticks >= 10
    assert len(received) == s.ticks  # the next subscriber still gets every snapshot
    logged = [r for r in caplog.records if "consumer bug" in r.getMessage()]
    assert len(logged) == 1


class _BrokenHost:
    name = "host"

    def __init__(self):
        self.calls = 0

    def collect(self):
        self.calls += 1
        raise RuntimeError("psutil exploded")


def test_a_failing_source_is_logged_once_and_sampling_goes_on(make_sampler, caplog):
    fake = healthy_gpus(1)
    host = _BrokenHost()
    s = make_sampler(fake, interval=0.01, host=0.01, collect_host=True, host_source=host)
    with caplog.at_level(logging.WARNING, logger="gpuscope.sampler"):
        snaps = []
        for gib in (1, 2, 3, 4):
            fake.gpus[0].memory_used_bytes = gib << 30
            snaps.append(s.sample_once())
            time.sleep(0.011)
    assert host.calls >= 3
    assert [sn.gpus[0].memory_used_bytes for sn in snaps] == [1 << 30, 2 << 30, 3 << 30, 4 << 30]
    assert all(sn.host is None for sn in snaps)
    logged = [r for r in caplog.records if "psutil exploded" in r.getMessage()]
    assert len(logged) == 1


def test_a_binding_that_returns_garbage_for_one_gpu_spares_the_others(make_sampler, caplog):
    fake = healthy_gpus(2)
    real = fake.nvmlDeviceGetCurrentClocksEventReasons

    def garbage_on_gpu1(h):
        return "garbage" if h is fake.gpus[1] else real(h)

    fake.nvmlDeviceGetCurrentClocksEventReasons = garbage_on_gpu1
    s = make_sampler(fake)
    with caplog.at_level(logging.WARNING, logger="gpuscope.sampler"):
        for gib in (5, 6, 7):
            fake.gpus[0].memory_used_bytes = gib << 30
            snap = s.sample_once()
            assert snap.gpu(0).memory_used_bytes == gib << 30
    assert s.ticks == 3
    assert snap.gpu(1).healthy  # a bug in our code is not a lost GPU
    logged = [r for r in caplog.records if r.name == "gpuscope.sampler"]
    assert len(logged) == 1 and "GPU 1" in logged[0].getMessage()


def test_a_failing_host_reader_does_not_stop_sampling(make_sampler, caplog):
    class Boom:
        def read(self, pid):
            raise OSError("proc is gone")

        def forget(self, alive):
            pass

    s = make_sampler(healthy_gpus(1), host_reader=Boom(), processes=0.01)
    with caplog.at_level(logging.WARNING, logger="gpuscope.sampler"):
        for _ in range(3):
            snap = s.sample_once()
            time.sleep(0.011)
    assert s.ticks == 3 and snap.gpus[0].healthy
    assert len([r for r in caplog.records if "proc is gone" in r.getMessage()]) == 1


# ---- lifecycle --------------------------------------------------------------------------------------


def test_stop_joins_the_thread_and_shuts_nvml_down(make_sampler):
    fake = healthy_gpus(1)
    s = make_sampler(fake, interval=0.01)
    assert s.start() is s
    time.sleep(0.05)
    assert sampler_threads()
    s.stop()
    assert sampler_threads() == []
    assert not fake.initialized
    ticks = s.ticks
    time.sleep(0.05)
    assert s.ticks == ticks


def test_start_twice_runs_one_thread(make_sampler):
    s = make_sampler(healthy_gpus(1), interval=0.01)
    s.start()
    s.start()
    assert len(sampler_threads()) == 1
    s.stop()


def test_context_manager(make_sampler):
    fake = healthy_gpus(2)
    with make_sampler(fake) as s:
        assert fake.initialized
        snap = s.sample_once()
        assert len(snap.gpus) == 2
    assert not fake.initialized


def test_no_driver_is_one_sentence(make_sampler):
    s = make_sampler(FakeNVML(available=False))
    with pytest.raises(NvmlUnavailable, match="--simulate"):
        s.sample_once()


# ---- configuration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"interval": 0}, "positive"),
        ({"interval": -0.1}, "positive"),
        ({"interval": math.nan}, "finite"),
        ({"interval": math.inf}, "finite"),
        ({"interval": 0.004}, "below"),
        ({"slow": 0.05, "interval": 0.1}, "slow"),
        ({"energy": 0.05, "interval": 0.1}, "energy"),
        ({"rare": 0.01, "interval": 0.1}, "rare"),
        ({"processes": 0.01, "interval": 0.1}, "processes"),
        ({"gpm_window": 0.05}, "GPM window"),
        ({"gpm_window": math.nan}, "finite"),
        ({"history": 0}, "history"),
    ],
)
def test_config_errors(kw, needle):
    cfg = SamplerConfig(**kw)
    with pytest.raises(ConfigError, match=needle) as exc:
        cfg.validate()
    msg = str(exc.value)
    assert "\n" not in msg and msg.endswith(".")
    assert isinstance(exc.value, ValueError)


def test_the_constructor_validates_before_touching_nvml():
    fake = healthy_gpus(1)
    with pytest.raises(ConfigError):
        Sampler(SamplerConfig(interval=0.001), nvml=fake)
    assert fake.calls == {}


def test_smallest_interval_is_accepted():
    SamplerConfig(interval=0.005, slow=0.005, energy=0.005, rare=0.005, processes=0.005, host=0.005).validate()


# ---- what it reports about itself ---------------------------------------------------------------------


def test_overhead_reports_per_call_latency(make_sampler):
    fake = healthy_gpus(2)
    s = make_sampler(fake)
    for _ in range(4):
        s.sample_once()
    o = s.overhead()
    assert o["ticks"] == 4 and o["missed_ticks"] == 0
    assert o["cpu_seconds"] > 0
    assert 0 < o["tick_median_us"] <= o["tick_max_us"]
    rows = {r["call"]: r for r in o["nvml_calls"]}
    assert rows["nvmlDeviceGetCurrentClocksEventReasons"]["count"] == 4 * 2  # every tick, both GPUs
    for r in rows.values():
        assert r["count"] >= 1
        assert 0 <= r["median_us"] <= r["max_us"]
    medians = [r["median_us"] for r in o["nvml_calls"]]
    assert medians == sorted(medians, reverse=True)


def test_self_metrics_are_catalogued(make_sampler):
    s = make_sampler(healthy_gpus(1))
    s.sample_once()
    s.sample_once()
    m = s.self_metrics()
    assert set(m) <= set(CATALOG)
    assert m["gpuscope_sampler_ticks_total"] == 2.0


def test_capabilities_cover_every_device_metric(make_sampler):
    s = make_sampler(healthy_gpus(2))
    s.sample_once()
    caps = s.capabilities()
    assert set(caps) == {"0", "1"}
    expected = {n for n, m in CATALOG.items() if m.source in ("nvml", "gpm", "events")}
    assert expected <= set(caps["0"])
    assert caps["0"]["gpu_memory_used_bytes"].supported
    assert all(c.supported or c.reason for c in caps["0"].values())  # every 'no' says why


def test_snapshot_lookup_and_serialisation(make_sampler):
    s = make_sampler(healthy_gpus(2))
    snap = s.sample_once()
    assert snap.gpu(1) is snap.gpus[1] and snap.gpu("1") is snap.gpus[1]
    with pytest.raises(KeyError):
        snap.gpu(7)
    assert snap.hostname and snap.simulated is None
    d = snap.to_dict()
    json.dumps(d)  # plain data all the way down
    assert d["gpus"][0]["identity"]["uuid"] == snap.gpus[0].uuid


def test_gpm_samples_are_freed_on_stop():
    nvml = healthy_gpus(2)
    for _ in range(3):
        s = Sampler(SamplerConfig(interval=0.05, events=False, collect_host=False), nvml=nvml)
        s.open()
        for _ in range(4):
            s.sample_once()
            time.sleep(0.06)
        s.stop()
    assert nvml.calls["nvmlGpmSampleAlloc"] == nvml.calls["nvmlGpmSampleFree"] == 3 * 2 * 2


def test_a_long_interval_raises_the_periods_it_did_not_choose():
    cfg = SamplerConfig.for_interval(2.0)
    cfg.validate()
    assert cfg.slow == cfg.processes == cfg.host == 2.0 and cfg.energy == 10.0
    with pytest.raises(ConfigError, match="slow period"):
        SamplerConfig.for_interval(2.0, slow=1.0).validate()


def test_time_never_goes_back_between_racing_ticks():
    nvml = healthy_gpus(1)
    nvml.gpus[0].clock_event_reasons = 0x4
    s = Sampler(SamplerConfig(interval=0.05, events=False, collect_host=False), nvml=nvml)
    s.open()
    now = time.monotonic()
    s._tick(now + 1.0)
    s._tick(now + 2.0)
    before = s.devices[0].values['gpu_throttle_seconds_total{reason="sw_power_cap"}']
    s._tick(now + 1.5)  # a caller's tick that lost the race for the lock
    assert s.devices[0].values['gpu_throttle_seconds_total{reason="sw_power_cap"}'] >= before
    s.stop()
