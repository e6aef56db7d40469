"""GPM (Hopper+): the 100 ms rule, values from two samples, dropped metrics, and PCIe byte counters."""

import time

import pynvml
import pytest

from gpuscope import ConfigError, SamplerConfig
from gpuscope._nvml import Nvml
from gpuscope.sources.gpm import GPM_SERIES, MIN_WINDOW_S, GpmSource
from gpuscope.testing import AMPERE, FakeGPU, FakeNVML, healthy_gpus

MIB = 1024 * 1024
PCIE_FIELDS = {pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES}


def spy_windows(fake):
    """Record the distance between the two samples of every GPM metrics read, as the fake saw it."""
    windows = []
    real = fake.nvmlGpmMetricsGet

    def spy(q):
        windows.append(q.sample2.mono - q.sample1.mono)
        return real(q)

    fake.nvmlGpmMetricsGet = spy
    return windows


@pytest.mark.parametrize("gpm_window", [0.2, 0.1])
def test_gpm_never_reads_over_less_than_100ms(make_sampler, gpm_window):
    fake = healthy_gpus(3)
    windows = spy_windows(fake)
    real_energy = fake.nvmlDeviceGetTotalEnergyConsumption

    def energy_like_an_h200(h):
        time.sleep(0.003)  # the total-energy read costs ~2.4-17 ms on an H200 (DESIGN.md)
        return real_energy(h)

    fake.nvmlDeviceGetTotalEnergyConsumption = energy_like_an_h200
    s = make_sampler(fake, interval=0.01, gpm_window=gpm_window)
    s.start()
    _wait_until(lambda: s.ticks >= 40 and len(windows) >= 3 * 2)
    s.stop()
    assert s.ticks >= 40
    assert len(windows) >= 3 * 2  # every GPU had GPM values computed more than once
    assert fake.gpm_short_intervals == 0, f"GPM windows seen by NVML: {sorted(windows)[:5]}"
    for g in s.latest().gpus:
        assert g.sm_active_ratio == pytest.approx(0.90)
        assert g.values["gpu_tensor_active_ratio"] == pytest.approx(0.60)


def _wait_until(ok, timeout: float = 30.0) -> None:
    """Poll until ok() holds: a sampler thread on a loaded machine ticks later, never sooner."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_gpm_is_read_at_its_window_not_every_tick(make_sampler):
    fake = healthy_gpus(1)
    s = make_sampler(fake, interval=0.01, gpm_window=0.2)
    t0 = time.monotonic()
    s.start()
    _wait_until(lambda: s.ticks >= 40 and time.monotonic() - t0 >= 0.6)
    s.stop()
    elapsed = time.monotonic() - t0
    samples = fake.calls.get("nvmlGpmSampleGet", 0)
    assert s.ticks >= 40
    assert 2 <= samples <= 2 + elapsed / 0.2  # the first, then one per 0.2 s window, not one per tick


def test_gpm_window_below_100ms_is_a_config_error():
    with pytest.raises(ConfigError, match="GPM window"):
        SamplerConfig(gpm_window=0.05).validate()
    SamplerConfig(gpm_window=MIN_WINDOW_S).validate()
    SamplerConfig(gpm_window=0.05, gpm=False).validate()  # no GPM, no constraint


def test_gpm_source_refuses_a_short_window():
    nv = Nvml(healthy_gpus(1))
    with pytest.raises(ValueError, match="100 ms"):
        GpmSource(nv, 0.05)


def test_gpm_needs_two_samples(make_sampler):
    s = make_sampler(healthy_gpus(1), gpm_window=0.1)
    snap = s.sample_once()
    assert snap.gpus[0].sm_active_ratio is None
    assert s.capabilities()["0"]["gpu_sm_active_ratio"].reason == "not read yet"
    time.sleep(0.12)
    snap = s.sample_once()
    assert snap.gpus[0].sm_active_ratio == pytest.approx(0.90)
    assert s.capabilities()["0"]["gpu_sm_active_ratio"].supported


def test_gpm_values_follow_the_gpu(make_sampler):
    fake = healthy_gpus(1)
    s = make_sampler(fake, gpm_window=0.1)
    s.sample_once()
    time.sleep(0.12)
    assert s.sample_once().gpus[0].sm_active_ratio == pytest.approx(0.90)
    fake.gpus[0].gpm[2] = 10.0
    time.sleep(0.12)
    s.sample_once()  # window spans the change: the fake averages its two samples
    time.sleep(0.12)
    assert s.sample_once().gpus[0].sm_active_ratio == pytest.approx(0.10)


def test_unsupported_gpm_metrics_are_dropped_from_the_query(make_sampler):
    fake = healthy_gpus(1)
    asked = []
    real = fake.nvmlGpmMetricsGet

    def spy(q):
        asked.append([q.metrics[i].metricId for i in range(q.numMetrics)])
        return real(q)

    fake.nvmlGpmMetricsGet = spy
    s = make_sampler(fake, gpm_window=0.1)
    for _ in range(3):
        s.sample_once()
        time.sleep(0.12)
    s.sample_once()
    assert len(asked) >= 2
    assert 4 in asked[0] and 60 in asked[0]  # integer pipe, NVLink rx: not in this GPU's set
    assert 4 not in asked[-1] and 60 not in asked[-1]
    assert 2 in asked[-1] and set(asked[-1]) <= set(fake.gpus[0].gpm)
    caps = s.capabilities()["0"]
    assert not caps["gpu_integer_active_ratio"].supported
    assert "not supported" in caps["gpu_integer_active_ratio"].reason
    assert caps["gpu_sm_active_ratio"].supported


def test_gpm_sampling_failure_is_reported_per_series(make_sampler):
    fake = healthy_gpus(1)
    s = make_sampler(fake, gpm_window=0.1)
    s.sample_once()
    time.sleep(0.12)
    assert s.sample_once().gpus[0].sm_active_ratio is not None
    fake.gpus[0].errors["nvmlGpmSampleGet"] = pynvml.NVML_ERROR_NO_PERMISSION
    time.sleep(0.12)
    snap = s.sample_once()
    assert snap.gpus[0].sm_active_ratio is None
    cap = s.capabilities()["0"]["gpu_sm_active_ratio"]
    assert not cap.supported and "privileges" in cap.reason
    assert snap.gpus[0].power_watts is not None  # the NVML fields are unaffected


def test_gpm_off_makes_no_gpm_calls(make_sampler):
    fake = healthy_gpus(1)
    s = make_sampler(fake, gpm=False)
    for _ in range(3):
        snap = s.sample_once()
    sampling = {"nvmlGpmSampleGet", "nvmlGpmMigSampleGet", "nvmlGpmMetricsGet"}
    assert not sampling & set(fake.calls)
    assert not any(series in snap.gpus[0].values for series in GPM_SERIES)


def test_pcie_bytes_integrate_the_gpm_rate_without_the_nvml_counter(make_sampler):
    fake = healthy_gpus(1)
    fake.gpus[0].unsupported_fields |= PCIE_FIELDS
    fake.gpus[0].pcie_rx_bytes = 123  # must not show up: the NVML counter is unsupported
    windows = spy_windows(fake)
    s = make_sampler(fake, gpm_window=0.1)
    snap = s.sample_once()
    assert "gpu_pcie_rx_bytes_total" not in snap.gpus[0].values
    for _ in range(2):
        time.sleep(0.25)
        snap = s.sample_once()
    g = snap.gpus[0]
    assert len(windows) == 2
    rx_rate, tx_rate = 50 * MIB, 10 * MIB  # the fixture's GPM ids 21 and 20, MiB/s
    assert g.values["gpu_pcie_rx_bytes_per_second"] == pytest.approx(rx_rate)
    assert g.values["gpu_pcie_rx_bytes_total"] == pytest.approx(rx_rate * sum(windows), rel=0.05)
    assert g.values["gpu_pcie_tx_bytes_total"] == pytest.approx(tx_rate * sum(windows), rel=0.05)
    caps = s.capabilities()["0"]
    assert caps["gpu_pcie_rx_bytes_total"].supported and caps["gpu_pcie_tx_bytes_total"].supported
    # a counter: never decreases from one tick to the next
    rx = [sn.gpus[0].values.get("gpu_pcie_rx_bytes_total", 0.0) for sn in s.history]
    assert rx == sorted(rx)


def test_pcie_bytes_use_the_nvml_counter_without_gpm(make_sampler):
    # An A100: no GPM, but NVML's own PCIe byte counters are there.
    fake = FakeNVML([FakeGPU(index=0, name="NVIDIA A100-SXM4-80GB", architecture=AMPERE,
                             compute_capability=(8, 0), pcie_rx_bytes=10 * 2**30, pcie_tx_bytes=3 * 2**30)])
    s = make_sampler(fake, interval=0.01, slow=0.01)
    g = s.sample_once().gpus[0]
    assert g.values["gpu_pcie_rx_bytes_total"] == 10 * 2**30
    assert g.values["gpu_pcie_tx_bytes_total"] == 3 * 2**30
    fake.gpus[0].pcie_rx_bytes = 11 * 2**30
    time.sleep(0.012)
    g = s.sample_once().gpus[0]
    assert g.values["gpu_pcie_rx_bytes_total"] == 11 * 2**30  # the counter itself, read again
    assert s.capabilities()["0"]["gpu_pcie_rx_bytes_total"].supported


def test_gpm_source_itself_enforces_the_window(open_devices):
    # Whoever calls it and however often, the source never has NVML compute over < 100 ms.
    fake = healthy_gpus(1)
    nv, devs = open_devices(fake)
    src = GpmSource(nv)
    dev = devs[0]
    t0 = time.monotonic()
    for _ in range(18):  # a read every ~20 ms (longer on a loaded machine, never shorter)
        src.collect("gpm", dev, time.monotonic())
        time.sleep(0.02)
    elapsed = time.monotonic() - t0
    assert fake.gpm_short_intervals == 0
    assert 1 <= fake.calls.get("nvmlGpmMetricsGet", 0) <= elapsed / 0.1  # at most one per 100 ms window
    assert dev.values["gpu_sm_active_ratio"] == pytest.approx(0.90)
