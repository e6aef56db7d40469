"""The NVML device source, the process source and device discovery, on the fake NVML's scenario
fixtures (gpuscope.testing): through the sampler where the scenario is about what a user sees, and
source by source with a hand-moved clock where the arithmetic (energy, throttle seconds) is the point."""

import time

import pynvml
import pytest

from gpuscope._hostproc import HostProcessReader, HostProcInfo
from gpuscope._nvml import GpuLost
from gpuscope.catalog import CATALOG, CLOCK_EVENT_REASONS, split_series_key
from gpuscope.sources.nvml import NvmlSource
from gpuscope.sources.procs import ProcessSource
from gpuscope.testing import (
    FakeGPU,
    FakeNVML,
    FakeProcess,
    healthy_gpus,
    lost_gpu,
    mig_gpu,
    old_driver_no_gpm,
    unsupported_field,
    vanishing_process,
)

GIB = 1 << 30
MIB = 1 << 20


def two_ticks(s, gap=0.12):
    """A first tick, then a second one late enough for GPM (window 0.1 s) to have a value."""
    s.sample_once()
    time.sleep(gap)
    return s.sample_once()


# ---- discovery ------------------------------------------------------------------------------------


def test_identity_is_read_once_at_discovery(make_sampler):
    s = make_sampler(healthy_gpus(3))
    snap = s.sample_once()
    assert [g.identity.label for g in snap.gpus] == ["0", "1", "2"]
    assert len({g.uuid for g in snap.gpus}) == 3
    ident = snap.gpus[1].identity
    assert ident.name == "NVIDIA H200"
    assert ident.architecture == "Hopper"
    assert ident.compute_capability == "9.0"
    assert ident.driver_version == "580.159.03"
    assert ident.cuda_version == "13.0"
    assert ident.memory_total_bytes == 143771 * MIB
    assert ident.power_limit_watts == pytest.approx(700.0)
    assert ident.sm_clock_max_hertz == pytest.approx(1.98e9)
    assert ident.pci_bus_id == "00000000:28:00.0"
    assert ident.cpu_affinity == list(range(8))
    assert ident.mig_mode is False and ident.parent_index is None


def test_gpu_lost_before_discovery_is_reported_once(make_sampler):
    fake = lost_gpu()
    fake.gpus[1].lost = True
    s = make_sampler(fake)
    snaps = [s.sample_once() for _ in range(3)]
    g1 = snaps[-1].gpu(1)
    assert not g1.healthy and g1.values["gpu_healthy"] == 0.0
    assert snaps[-1].gpu(0).healthy
    lost = [e for sn in snaps for e in sn.events if e.kind == "gpu_lost"]
    assert [e.gpu for e in lost] == ["1"]


def test_gpu_lost_while_being_identified_is_reported_once(make_sampler):
    # NVML hands out the handle, then the GPU falls off the bus during the identity reads.
    fake = lost_gpu()
    fake.gpus[1].errors["nvmlDeviceGetUUID"] = pynvml.NVML_ERROR_GPU_IS_LOST
    s = make_sampler(fake)
    snaps = [s.sample_once() for _ in range(3)]
    assert not snaps[-1].gpu(1).healthy
    lost = [e for sn in snaps for e in sn.events if e.kind == "gpu_lost"]
    assert [e.gpu for e in lost] == ["1"]


# ---- scenario fixtures ------------------------------------------------------------------------------


def test_healthy_gpus_values_are_plausible(make_sampler):
    s = make_sampler(healthy_gpus(), gpm_window=0.1)
    snap = two_ticks(s)
    assert len(snap.gpus) == 3
    for g in snap.gpus:
        assert g.healthy and g.values["gpu_healthy"] == 1.0
        for key, v in g.values.items():
            name, _ = split_series_key(key)
            assert name in CATALOG, key
            if CATALOG[name].unit == "ratio":
                assert 0.0 <= v <= 1.0, (key, v)
            if CATALOG[name].kind.value == "counter":
                assert v >= 0.0, key
        total = g.values["gpu_memory_total_bytes"]
        used = g.values["gpu_memory_used_bytes"]
        assert total == 143771 * MIB
        assert used == 40 * GIB == g.memory_used_bytes
        assert used + g.values["gpu_memory_free_bytes"] + g.values["gpu_memory_reserved_bytes"] == total
        assert g.power_watts == pytest.approx(650.0)
        assert g.values["gpu_power_limit_watts"] == pytest.approx(700.0)
        assert g.values["gpu_temperature_celsius"] == 60.0
        assert g.values["gpu_sm_clock_hertz"] == pytest.approx(1.98e9)
        assert g.utilization_ratio == pytest.approx(0.99)
        assert g.sm_active_ratio == pytest.approx(0.90)
        assert g.values["gpu_tensor_active_ratio"] == pytest.approx(0.60)
        assert g.values["gpu_dram_active_ratio"] == pytest.approx(0.35)
        assert g.values["gpu_pcie_rx_bytes_per_second"] == pytest.approx(50 * MIB)
        assert g.values["gpu_energy_joules_total"] >= 1000.0  # the fake's counter starts at 1,000,000 mJ
        assert g.throttle_reasons == []
    assert sorted((p.gpu, p.pid) for p in snap.processes) == [("0", 10_000), ("1", 10_001), ("2", 10_002)]
    for p in snap.processes:
        assert p.sm_ratio == pytest.approx(0.90)
        assert p.memory_ratio == pytest.approx(0.35)
        assert p.gpu_memory_bytes == 39 * GIB
        assert p.type == "compute"
        assert p.gpu_uuid == snap.gpu(p.gpu).uuid


def test_unsupported_field_is_a_capability_not_an_error(make_sampler):
    s = make_sampler(unsupported_field())
    for _ in range(3):
        snap = s.sample_once()
    caps = s.capabilities()["0"]
    for metric in ("gpu_memory_temperature_celsius", "gpu_encoder_utilization_ratio"):
        assert caps[metric].supported is False
        assert "not supported" in caps[metric].reason
        assert metric not in snap.gpus[0].values
    for metric in ("gpu_temperature_celsius", "gpu_decoder_utilization_ratio", "gpu_power_watts",
                   "gpu_memory_used_bytes", "gpu_ecc_corrected_errors_total"):
        assert caps[metric].supported is True, metric
        assert metric in snap.gpus[0].values, metric


def test_unsupported_field_is_dropped_from_the_batch(make_sampler):
    fake = unsupported_field()
    seen = []
    real = fake.nvmlDeviceGetFieldValues

    def spy(h, ids):
        seen.append(list(ids))
        return real(h, ids)

    fake.nvmlDeviceGetFieldValues = spy
    s = make_sampler(fake, interval=0.01, slow=0.01)  # every group due at every tick
    for _ in range(4):
        s.sample_once()
        time.sleep(0.012)
    assert s.capabilities()["0"]["gpu_memory_temperature_celsius"].supported is False
    assert pynvml.NVML_FI_DEV_MEMORY_TEMP in seen[0]
    assert all(pynvml.NVML_FI_DEV_MEMORY_TEMP not in ids for ids in seen[1:])


def test_lost_gpu_is_marked_and_the_others_keep_going(make_sampler):
    fake = lost_gpu()
    s = make_sampler(fake)
    before = s.sample_once()
    assert before.gpu(1).healthy
    fake.gpus[1].lost = True
    snaps = []
    for gib in (41, 42, 43):
        fake.gpus[0].memory_used_bytes = gib * GIB
        snaps.append(s.sample_once())
        assert snaps[-1].gpu(0).memory_used_bytes == gib * GIB  # GPU 0: fresh values every tick
    g1 = snaps[-1].gpu(1)
    assert not g1.healthy
    assert g1.values["gpu_healthy"] == 0.0
    assert g1.power_watts is None  # gauges of a lost GPU are dropped, not frozen
    assert g1.throttle_reasons == []
    assert "gpu_energy_joules_total" in g1.values  # counters are kept
    lost = [e for sn in snaps for e in sn.events if e.kind == "gpu_lost"]
    assert len(lost) == 1
    assert lost[0].gpu == "1" and fake.gpus[1].uuid in lost[0].message
    assert snaps[-1].gpu(0).healthy


def test_lost_gpu_capabilities_say_lost(make_sampler):
    fake = lost_gpu()
    s = make_sampler(fake)
    s.sample_once()
    fake.gpus[1].lost = True
    s.sample_once()
    caps = s.capabilities()["1"]
    values = s.latest().gpu(1).values
    present = {split_series_key(k)[0] for k in values}
    # the lost GPU's gauges were dropped from its values; capabilities must not still call them
    # supported (counters keep their last value and may stay)
    device_series = {n for n, m in CATALOG.items() if m.source in ("nvml", "gpm", "events")}
    claimed_without_value = sorted(m for m, c in caps.items()
                                   if c.supported and m in device_series and m not in present)
    assert claimed_without_value == []
    assert caps["gpu_power_watts"].supported is False
    assert "lost" in caps["gpu_power_watts"].reason
    assert s.capabilities()["0"]["gpu_power_watts"].supported


def test_mig_instances_are_devices_with_their_own_gpm(make_sampler):
    fake = mig_gpu()
    s = make_sampler(fake, gpm_window=0.1)
    snap = two_ticks(s)
    assert [g.identity.label for g in snap.gpus] == ["0", "0/mig1", "0/mig2"]
    m1, m2 = snap.gpu("0/mig1"), snap.gpu("0/mig2")
    assert m1.identity.parent_index == 0 and m1.identity.gpu_instance_id == 1
    assert m2.identity.gpu_instance_id == 2
    assert snap.gpu("0").identity.mig_mode and m1.identity.mig_mode
    assert m1.uuid.startswith("MIG-") and m1.uuid != m2.uuid
    assert m1.sm_active_ratio == pytest.approx(0.70)
    assert m2.sm_active_ratio == pytest.approx(0.05)
    assert m1.values["gpu_tensor_active_ratio"] == pytest.approx(0.50)
    assert m2.values["gpu_tensor_active_ratio"] == pytest.approx(0.0)
    assert fake.calls.get("nvmlGpmMigSampleGet", 0) >= 4  # two instances, two ticks
    assert m1.memory_used_bytes == 5 * GIB and m2.memory_used_bytes == 1 * GIB
    assert m1.utilization_ratio is None  # NVML has no utilization per MIG instance
    by_pid = {p.pid: p for p in snap.processes}
    assert by_pid[20_001].gpu == "0/mig1" and by_pid[20_001].gpu_uuid == m1.uuid
    assert by_pid[20_002].gpu == "0/mig2" and by_pid[20_002].gpu_uuid == m2.uuid
    for p in snap.processes:
        assert p.sm_ratio is None and p.memory_ratio is None


def test_mig_capabilities_explain_missing_per_process_utilization(make_sampler):
    s = make_sampler(mig_gpu(), gpm_window=0.1)
    two_ticks(s)
    caps = s.capabilities()
    assert caps["0/mig1"]["gpu_utilization_ratio"].supported is False
    assert "MIG" in caps["0/mig1"]["gpu_utilization_ratio"].reason
    for label in ("0", "0/mig1"):
        c = caps[label]["gpu_process_sm_active_ratio"]
        assert c.supported is False
        assert "MIG" in c.reason, (label, c.reason)


def test_old_driver_without_gpm(make_sampler):
    s = make_sampler(old_driver_no_gpm(), gpm_window=0.1)
    snap = two_ticks(s)  # no exception on the way
    g = snap.gpus[0]
    assert g.identity.architecture == "Ampere"
    assert g.identity.driver_version == "470.57.02" and g.identity.cuda_version == "11.4"
    caps = s.capabilities()["0"]
    for series in [m.name for m in CATALOG.values() if m.source == "gpm"]:
        assert caps[series].supported is False, series
        assert "Hopper" in caps[series].reason, series
        assert series not in g.values
    assert g.sm_active_ratio is None
    for metric in ("gpu_clock_event_reasons", "gpu_throttle_seconds_total"):
        assert caps[metric].supported is False
        assert "driver" in caps[metric].reason and "too old" in caps[metric].reason
    assert not any(k.startswith("gpu_throttle_seconds_total") for k in g.values)
    assert g.throttle_reasons == []
    for metric in ("gpu_pcie_tx_bytes_total", "gpu_pcie_rx_bytes_total"):
        assert caps[metric].supported is False and metric not in g.values
    assert g.utilization_ratio == pytest.approx(0.80)  # the rest is still read
    assert g.power_watts == pytest.approx(120.0)


def test_vanishing_process_is_reported_not_visible(make_sampler):
    s = make_sampler(vanishing_process(), host_reader=HostProcessReader())
    snap = s.sample_once()
    ghost = [p for p in snap.processes if p.pid == 2**22 + 17]
    assert len(ghost) == 1
    p = ghost[0]
    assert p.host_visible is False
    assert p.name == "" and p.cpu_cores is None
    assert p.gpu == "0" and p.gpu_memory_bytes == 1 * MIB
    assert len(snap.processes) == 2


# ---- energy ---------------------------------------------------------------------------------------


def per_tick(src, dev, t):
    """What the sampler reads at every tick of a fast enough schedule: the cheap groups, power included."""
    for group in ("fast", "medium"):
        if group in src.groups:
            src.collect(group, dev, t)


@pytest.fixture
def energy_rig(open_devices):
    fake = FakeNVML([FakeGPU(index=0, power_w=500.0, energy_mj=1_000_000)])
    nv, devs = open_devices(fake)
    return fake, NvmlSource(nv, []), devs[0]


def test_energy_integrates_power_between_hardware_reads(energy_rig):
    fake, src, dev = energy_rig
    per_tick(src, dev, 0.0)
    src.collect("energy", dev, 0.0)
    assert dev.values["gpu_energy_joules_total"] == pytest.approx(1000.0)
    seen = []
    for k in range(1, 11):
        per_tick(src, dev, k * 0.1)
        seen.append(dev.values["gpu_energy_joules_total"])
    assert seen == sorted(seen)
    assert seen[-1] == pytest.approx(1000.0 + 500.0 * 1.0)
    # the energy read happened once; power was read every tick
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1


def test_energy_integration_is_trapezoidal(energy_rig):
    fake, src, dev = energy_rig
    fake.gpus[0].power_w = 100.0
    per_tick(src, dev, 0.0)
    src.collect("energy", dev, 0.0)
    for k in range(1, 11):
        fake.gpus[0].power_w = 100.0 + 50.0 * k  # ramps 150 -> 600 W
        per_tick(src, dev, k * 0.1)
    # trapezoid over the 11 reads: 0.1 * (100/2 + 150 + ... + 550 + 600/2)
    expected = 0.1 * (100.0 / 2 + sum(100.0 + 50.0 * k for k in range(1, 10)) + 600.0 / 2)
    assert dev.values["gpu_energy_joules_total"] == pytest.approx(1000.0 + expected)


def test_energy_reanchors_on_a_hardware_read(energy_rig):
    fake, src, dev = energy_rig
    per_tick(src, dev, 0.0)
    src.collect("energy", dev, 0.0)
    for k in range(1, 6):
        per_tick(src, dev, k * 0.1)
    assert dev.values["gpu_energy_joules_total"] == pytest.approx(1250.0)
    fake.gpus[0].energy_mj = 2_000_000
    src.collect("energy", dev, 0.5)
    assert dev.values["gpu_energy_joules_total"] == pytest.approx(2000.0)
    per_tick(src, dev, 0.6)
    assert dev.values["gpu_energy_joules_total"] == pytest.approx(2050.0)


def test_energy_never_goes_backwards(energy_rig):
    fake, src, dev = energy_rig
    per_tick(src, dev, 0.0)
    src.collect("energy", dev, 0.0)
    for k in range(1, 11):
        per_tick(src, dev, k * 0.1)
    assert dev.values["gpu_energy_joules_total"] == pytest.approx(1500.0)
    fake.gpus[0].energy_mj = 1_200_000  # the hardware says less than we integrated
    src.collect("energy", dev, 1.0)
    seen = [dev.values["gpu_energy_joules_total"]]
    for k in range(11, 21):
        per_tick(src, dev, k * 0.1)
        seen.append(dev.values["gpu_energy_joules_total"])
    assert seen[0] == pytest.approx(1500.0)
    assert all(b >= a for a, b in zip(seen, seen[1:], strict=False))
    assert seen[-1] == pytest.approx(1200.0 + 500.0)  # catches up from the new anchor


def test_energy_without_the_hardware_counter_is_integrated(energy_rig):
    fake, src, dev = energy_rig
    fake.gpus[0].errors["nvmlDeviceGetTotalEnergyConsumption"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    per_tick(src, dev, 0.0)
    src.collect("energy", dev, 0.0)
    for k in range(1, 5):
        per_tick(src, dev, k * 0.5)
    assert dev.values["gpu_energy_joules_total"] == pytest.approx(500.0 * 2.0)
    cap = dev.caps["gpu_energy_joules_total"]
    assert cap.supported and "integrated from power" in cap.reason


def _wait_for(ok, timeout: float = 30.0) -> None:
    """Poll until ok() holds: a sampler thread on a loaded machine takes longer, never less."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_energy_through_the_sampler_follows_power(make_sampler):
    fake = healthy_gpus(1)
    fake.gpus[0].power_w = 500.0
    power_reads = []
    real = fake.nvmlDeviceGetPowerUsage

    def spy(h):
        power_reads.append(time.monotonic())
        return real(h)

    fake.nvmlDeviceGetPowerUsage = spy
    s = make_sampler(fake, interval=0.01, energy=60.0)
    s.start()
    _wait_for(lambda: len(s.history) > 20 and power_reads[-1] - power_reads[0] > 0.3)  # slower when loaded
    s.stop()
    snaps = list(s.history)
    assert len(snaps) > 20 and len(power_reads) >= 3
    energies = [sn.gpus[0].values["gpu_energy_joules_total"] for sn in snaps]
    assert energies == sorted(energies)
    # one hardware read (1,000 J, in the first tick), then power integrated from read to read
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1  # the costly read is not on every tick
    gained = energies[-1] - 1000.0
    elapsed = power_reads[-1] - power_reads[0]
    assert elapsed > 0.3
    assert gained == pytest.approx(500.0 * elapsed, rel=0.10)


# ---- throttle seconds and clock events --------------------------------------------------------------

SW_POWER = 'gpu_throttle_seconds_total{reason="sw_power_cap"}'
IDLE = 'gpu_throttle_seconds_total{reason="gpu_idle"}'


@pytest.fixture
def throttle_rig(open_devices):
    fake = FakeNVML([FakeGPU(index=0, clock_event_reasons=0x0)])
    nv, devs = open_devices(fake)
    events = []
    return fake, NvmlSource(nv, events), devs[0], events


def test_throttle_seconds_accumulate_per_reason(throttle_rig):
    fake, src, dev, events = throttle_rig
    fake.gpus[0].clock_event_reasons = 0x4
    for k in range(51):  # 0 .. 0.5 s
        src.collect("fast", dev, k * 0.01)
    assert dev.values[SW_POWER] == pytest.approx(0.5)
    others = {k: v for k, v in dev.values.items() if k.startswith("gpu_throttle_seconds_total") and k != SW_POWER}
    assert len(others) == len(CLOCK_EVENT_REASONS) - 1 and set(others.values()) == {0.0}
    fake.gpus[0].clock_event_reasons = 0x60
    for k in range(51, 61):
        src.collect("fast", dev, k * 0.01)
    # the interval is charged to the reasons that were active at its start
    assert dev.values[SW_POWER] == pytest.approx(0.51)
    assert dev.values['gpu_throttle_seconds_total{reason="sw_thermal"}'] == pytest.approx(0.09)
    assert dev.values['gpu_throttle_seconds_total{reason="hw_thermal"}'] == pytest.approx(0.09)


def test_a_change_of_throttle_reasons_emits_one_event(throttle_rig):
    fake, src, dev, events = throttle_rig
    src.collect("fast", dev, 0.0)
    fake.gpus[0].clock_event_reasons = 0x4
    for k in range(1, 20):
        src.collect("fast", dev, k * 0.01)
    assert [e.kind for e in events] == ["clock_events"]
    ev = events[0]
    assert ev.gpu == "0"
    assert ev.data["reasons"] == ["sw_power_cap"] and ev.data["previous"] == []
    assert "sw_power_cap" in ev.message
    fake.gpus[0].clock_event_reasons = 0x0
    src.collect("fast", dev, 0.3)
    assert len(events) == 2
    assert events[1].data["reasons"] == [] and events[1].data["previous"] == ["sw_power_cap"]
    assert "no longer limited" in events[1].message


def test_idle_toggling_emits_no_event(throttle_rig):
    fake, src, dev, events = throttle_rig
    for k in range(20):
        fake.gpus[0].clock_event_reasons = 0x1 if k % 2 else 0x0
        src.collect("fast", dev, k * 0.1)
    assert events == []
    # an interval is charged to the reasons active at its start: idle at 0.1, 0.3, ... 1.7 s
    assert dev.values[IDLE] == pytest.approx(0.9)
    # idle added on top of a real reason is not a change either
    fake.gpus[0].clock_event_reasons = 0x4
    src.collect("fast", dev, 2.0)
    fake.gpus[0].clock_event_reasons = 0x5
    src.collect("fast", dev, 2.1)
    assert len(events) == 1


def test_first_read_sets_a_baseline(throttle_rig):
    fake, src, dev, events = throttle_rig
    fake.gpus[0].clock_event_reasons = 0x4
    src.collect("fast", dev, 5.0)
    assert dev.values[SW_POWER] == 0.0
    assert events == []


def test_throttle_seconds_through_the_sampler(make_sampler):
    fake = healthy_gpus(1)
    fake.gpus[0].clock_event_reasons = 0x4
    s = make_sampler(fake, interval=0.01)
    s.start()
    t0 = time.monotonic()
    _wait_for(lambda: len(s.history) > 21 and time.monotonic() - t0 >= 0.5)  # slower when loaded
    fake.gpus[0].clock_event_reasons = 0x0
    n = len(s.history)
    _wait_for(lambda: len(s.history) >= n + 3)
    s.stop()
    snaps = list(s.history)
    throttled = [sn for sn in snaps if sn.gpus[0].throttle_reasons == ["sw_power_cap"]]
    assert len(throttled) > 20
    elapsed = (throttled[-1].time_ns - snaps[0].time_ns) / 1e9
    assert throttled[-1].gpus[0].values[SW_POWER] == pytest.approx(elapsed, rel=0.10)
    # an interval is charged to the reasons at its start: throttled until the first tick that saw none
    first_clear = next(sn for sn in snaps if sn.time_ns > throttled[-1].time_ns)
    final = snaps[-1].gpus[0].values[SW_POWER]
    assert final == pytest.approx((first_clear.time_ns - snaps[0].time_ns) / 1e9, rel=0.10)
    events = [e for sn in snaps for e in sn.events if e.kind == "clock_events"]
    assert len(events) == 1 and events[0].data["reasons"] == []


# ---- processes --------------------------------------------------------------------------------------


def _info(pid, **kw):
    base = dict(pid=pid, name="python", user="alice", cmdline="python train.py", cpu_cores=1.5,
                thread_cpu_max_ratio=0.98, rss_bytes=float(8 * GIB), threads=24, started_at=1.7e9,
                container="abc123", pod_uid="uid", pod="trainer-0", namespace="ml", slurm_job="")
    base.update(kw)
    return HostProcInfo(**base)


@pytest.fixture
def proc_rig(open_devices, host_reader):
    fake = healthy_gpus(2)
    nv, devs = open_devices(fake)
    return fake, ProcessSource(nv, host_reader), devs


def test_process_start_and_stop_events(proc_rig):
    fake, src, devs = proc_rig
    events = []
    first = src.collect(devs, events)
    assert sorted(p.pid for p in first) == [10_000, 10_001]
    assert events == []  # the first read is a baseline
    fake.gpus[0].processes.append(FakeProcess(pid=31_337, sm_percent=10))
    src.collect(devs, events)
    assert [(e.kind, e.gpu, e.data["pid"]) for e in events] == [("process_start", "0", 31_337)]
    events.clear()
    src.collect(devs, events)
    assert events == []  # nothing changed
    fake.gpus[0].processes = [p for p in fake.gpus[0].processes if p.pid != 31_337]
    src.collect(devs, events)
    assert [(e.kind, e.gpu, e.data["pid"]) for e in events] == [("process_stop", "0", 31_337)]


def test_process_utilization_from_nvml(proc_rig):
    fake, src, devs = proc_rig
    fake.gpus[1].processes[0].sm_percent = 42
    fake.gpus[1].processes[0].mem_percent = 7
    recs = {p.pid: p for p in src.collect(devs, [])}
    assert recs[10_000].sm_ratio == pytest.approx(0.90)
    assert recs[10_000].memory_ratio == pytest.approx(0.35)
    assert recs[10_001].sm_ratio == pytest.approx(0.42)
    assert recs[10_001].memory_ratio == pytest.approx(0.07)
    assert devs[0].caps["gpu_process_sm_active_ratio"].supported


def test_process_utilization_not_found_means_idle(proc_rig):
    fake, src, devs = proc_rig
    fake.gpus[0].errors["nvmlDeviceGetProcessUtilization"] = pynvml.NVML_ERROR_NOT_FOUND
    recs = {p.pid: p for p in src.collect(devs, [])}
    assert recs[10_000].sm_ratio == 0.0 and recs[10_000].sm_ratio is not None
    assert recs[10_000].memory_ratio == 0.0
    assert recs[10_001].sm_ratio == pytest.approx(0.90)  # the other GPU had samples


def test_process_utilization_not_found_keeps_both_capabilities(proc_rig):
    # NOT_FOUND means 'every process idle': both per-process series get 0.0, so both are supported
    fake, src, devs = proc_rig
    fake.gpus[0].errors["nvmlDeviceGetProcessUtilization"] = pynvml.NVML_ERROR_NOT_FOUND
    src.collect(devs, [])
    for metric in ("gpu_process_sm_active_ratio", "gpu_process_memory_utilization_ratio"):
        cap = devs[0].caps.get(metric)
        assert cap is not None and cap.supported, (metric, cap)


def test_an_idle_process_gets_zero_not_none(proc_rig):
    fake, src, devs = proc_rig
    fake.gpus[0].processes.append(FakeProcess(pid=555, sm_percent=0, mem_percent=0))
    recs = {p.pid: p for p in src.collect(devs, [])}
    assert recs[555].sm_ratio == 0.0 and recs[555].memory_ratio == 0.0


def test_process_utilization_unsupported_is_none_with_a_reason(proc_rig):
    fake, src, devs = proc_rig
    fake.gpus[0].errors["nvmlDeviceGetProcessUtilization"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    recs = {p.pid: p for p in src.collect(devs, [])}
    assert recs[10_000].sm_ratio is None and recs[10_000].memory_ratio is None
    cap = devs[0].caps["gpu_process_sm_active_ratio"]
    assert not cap.supported and "not supported" in cap.reason
    assert recs[10_001].sm_ratio == pytest.approx(0.90)  # the other GPU is unaffected


def test_process_utilization_last_seen_advances(open_devices, host_reader):
    fake = healthy_gpus(1)
    asked = []
    real = fake.nvmlDeviceGetProcessUtilization

    def spy(h, last_seen_us):
        asked.append(last_seen_us)
        return real(h, last_seen_us)

    fake.nvmlDeviceGetProcessUtilization = spy
    nv, devs = open_devices(fake)
    wall = [1_700_000_000_000_000]
    src = ProcessSource(nv, host_reader, wall_clock_us=lambda: wall[0])
    src.collect(devs, [])
    assert asked[0] == wall[0] - 1_000_000  # first ask: the last second
    for _ in range(3):
        time.sleep(0.002)
        src.collect(devs, [])
    assert len(asked) == 4
    assert asked[1] > asked[0]
    assert all(b > a for a, b in zip(asked[1:], asked[2:], strict=False))
    assert asked[-1] <= int(time.time() * 1e6)


def test_process_records_join_host_facts(open_devices, host_reader):
    fake = healthy_gpus(1)
    fake.gpus[0].processes.append(FakeProcess(pid=777, used_memory_bytes=2 * GIB, graphics=True))
    fake.gpus[0].processes.append(FakeProcess(pid=10_000, used_memory_bytes=39 * GIB, graphics=True))
    reader = host_reader
    reader.infos[10_000] = _info(10_000)
    nv, devs = open_devices(fake)
    recs = {p.pid: p for p in ProcessSource(nv, reader).collect(devs, [])}
    r = recs[10_000]
    assert r.type == "compute+graphics"
    assert r.host_visible
    assert (r.name, r.user, r.cmdline) == ("python", "alice", "python train.py")
    assert r.cpu_cores == 1.5 and r.thread_cpu_max_ratio == 0.98
    assert r.rss_bytes == float(8 * GIB) and r.threads == 24 and r.started_at == 1.7e9
    assert (r.container, r.pod, r.namespace, r.pod_uid) == ("abc123", "trainer-0", "ml", "uid")
    assert recs[777].type == "graphics" and recs[777].host_visible is False
    assert reader.reads.count(10_000) == 1  # one host read per pid per collect
    assert reader.forgotten[-1] == {10_000, 777}


def test_process_memory_not_available(proc_rig):
    fake, src, devs = proc_rig
    fake.gpus[0].processes[0].used_memory_bytes = None  # NVML gives N/A (e.g. under MIG, Windows WDDM)
    recs = {p.pid: p for p in src.collect(devs, [])}
    assert recs[10_000].gpu_memory_bytes is None
    assert recs[10_001].gpu_memory_bytes == 39 * GIB


def test_gpu_lost_while_listing_processes(proc_rig):
    fake, src, devs = proc_rig
    src.collect(devs, [])
    fake.gpus[1].lost = True
    events = []
    recs = src.collect(devs, events)
    assert [p.gpu for p in recs] == ["0"]
    assert [e.kind for e in events] == ["gpu_lost"]
    assert not devs[1].healthy


def test_process_listing_unavailable(proc_rig):
    fake, src, devs = proc_rig
    fake.gpus[0].errors["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_NO_PERMISSION
    fake.gpus[0].errors["nvmlDeviceGetGraphicsRunningProcesses"] = pynvml.NVML_ERROR_NO_PERMISSION
    recs = src.collect(devs, [])
    assert [p.gpu for p in recs] == ["1"]
    assert not devs[0].caps["gpu_process_memory_used_bytes"].supported


def test_gpu_lost_is_raised_by_the_wrapper_not_swallowed(open_devices):
    # the process source relies on Nvml.call raising GpuLost (and nothing else) for a lost GPU
    fake = healthy_gpus(1)
    nv, devs = open_devices(fake)
    fake.gpus[0].lost = True
    with pytest.raises(GpuLost):
        nv.call("nvmlDeviceGetComputeRunningProcesses", devs[0].handle)


def test_a_failed_process_listing_is_not_a_stop_and_start(proc_rig):
    fake, src, devs = proc_rig
    events: list = []
    src.collect(devs, events)
    for call in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        fake.gpus[0].errors[call] = pynvml.NVML_ERROR_TIMEOUT
    src.collect(devs, events)
    fake.gpus[0].errors.clear()
    src.collect(devs, events)
    assert [e for e in events if e.kind in ("process_stop", "process_start")] == []
