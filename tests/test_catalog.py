import re

import pynvml
import pytest

from gpuscope import catalog
from gpuscope.catalog import (
    CATALOG,
    CLOCK_EVENT_REASONS,
    Cost,
    Kind,
    decode_clock_event_reasons,
    series_key,
    split_series_key,
)
from gpuscope.sources import gpm
from gpuscope.sources.gpm import GPM_METRICS

ALL = list(CATALOG.values())
SOURCES = {"nvml", "gpm", "events", "processes", "host", "sampler", "kubelet", "cudaprobe"}
# unit -> the suffix the name must carry (before `_total` for counters)
UNIT_SUFFIX = {
    "bytes": "_bytes",
    "seconds": "_seconds",
    "joules": "_joules",
    "watts": "_watts",
    "celsius": "_celsius",
    "hertz": "_hertz",
    "ratio": "_ratio",
    "bytes/s": "_bytes_per_second",
    "cores": "_cores",
}
DEVICE_LABELS = {"gpu", "uuid", "model", "hostname"}


def _ids(metrics):
    return [m.name for m in metrics]


def test_names_are_unique():
    # CATALOG is built from a list by a dict comprehension: a duplicate would silently replace an entry.
    names = [m.name for m in catalog._METRICS]
    dups = sorted({n for n in names if names.count(n) > 1})
    assert dups == []
    assert len(CATALOG) == len(names)
    assert all(key == m.name for key, m in CATALOG.items())


@pytest.mark.parametrize("m", ALL, ids=_ids(ALL))
def test_name_is_prometheus_snake_case(m):
    assert re.fullmatch(r"[a-z][a-z0-9_]*[a-z0-9]", m.name), m.name
    assert "__" not in m.name


@pytest.mark.parametrize("m", ALL, ids=_ids(ALL))
def test_counters_end_in_total_and_gauges_do_not(m):
    if m.kind is Kind.COUNTER:
        assert m.name.endswith("_total"), f"counter {m.name} must end in _total"
    else:
        assert m.kind is Kind.GAUGE
        assert not m.name.endswith("_total"), f"gauge {m.name} must not end in _total"


@pytest.mark.parametrize("m", ALL, ids=_ids(ALL))
def test_unit_is_in_the_name(m):
    if not m.unit:
        return
    assert m.unit in UNIT_SUFFIX, f"{m.name}: unknown unit {m.unit!r}"
    stem = m.name[: -len("_total")] if m.kind is Kind.COUNTER else m.name
    assert stem.endswith(UNIT_SUFFIX[m.unit]), f"{m.name} ({m.unit}) must end in {UNIT_SUFFIX[m.unit]}"


@pytest.mark.parametrize("m", ALL, ids=_ids(ALL))
def test_unit_suffix_implies_the_unit(m):
    # The reverse direction: a name that says `_ratio` or `_bytes` must carry that unit.
    stem = m.name[: -len("_total")] if m.name.endswith("_total") else m.name
    if stem.endswith("_ratio"):
        assert m.unit == "ratio"
    if stem.endswith("_bytes_per_second"):
        assert m.unit == "bytes/s"
    elif stem.endswith("_bytes"):
        assert m.unit == "bytes"
    for unit in ("seconds", "watts", "joules", "celsius", "hertz"):
        if stem.endswith("_" + unit):
            assert m.unit == unit


def test_no_non_base_units():
    # base units only: no milli/kilo/mega/percent spellings anywhere in a name
    for m in ALL:
        assert not re.search(r"_(percent|pct|mb|mib|gb|kb|kib|ms|us|mhz|mw|mj)(_|$)", m.name), m.name


@pytest.mark.parametrize("m", ALL, ids=_ids(ALL))
def test_fields_are_well_formed(m):
    assert m.source in SOURCES
    assert isinstance(m.kind, Kind)
    assert isinstance(m.cost, Cost)
    assert m.help.strip().endswith((".", ")")), "help is a sentence"
    assert m.dcgm_scale > 0
    assert not set(m.labels) & DEVICE_LABELS, "device labels are implied, not listed"
    if m.dcgm:
        assert m.dcgm.startswith("DCGM_FI_")
    if m.cost is Cost.GPM:
        assert m.source == "gpm"
    if m.cost is Cost.EVENT:
        assert m.source == "events" and m.kind is Kind.COUNTER


def test_dcgm_aliases_are_unique():
    # DCGM-compatible mode emits the alias as the series name: two metrics with one alias would
    # collide (a dashboard's sum(DCGM_FI_DEV_FB_USED) would count device and process memory together).
    by_alias: dict[str, list[str]] = {}
    for m in ALL:
        if m.dcgm:
            by_alias.setdefault(m.dcgm, []).append(m.name)
    assert {a: ns for a, ns in by_alias.items() if len(ns) > 1} == {}


def test_dcgm_scales_match_dcgm_units():
    for m in ALL:
        if not m.dcgm:
            continue
        if m.dcgm.startswith("DCGM_FI_DEV_FB_"):
            assert m.dcgm_scale == pytest.approx(1 / 2**20), m.name  # DCGM reports MiB
        if m.unit == "hertz":
            assert m.dcgm_scale == pytest.approx(1e-6), m.name  # MHz
        if m.dcgm.startswith("DCGM_FI_PROF_"):
            assert m.dcgm_scale == 1.0, m.name  # profiling fields are ratios / bytes per second
        if m.dcgm.endswith("_UTIL"):
            assert m.unit == "ratio" and m.dcgm_scale == 100.0, m.name  # DCGM utilisation is percent
    assert CATALOG["gpu_energy_joules_total"].dcgm_scale == 1000.0  # DCGM energy is mJ


def test_every_gpm_series_is_in_the_catalog_with_source_gpm():
    for series, mid, _scale in GPM_METRICS + getattr(gpm, "EXPENSIVE_METRICS", []):
        assert series in CATALOG, series
        m = CATALOG[series]
        assert m.source == "gpm" and m.cost is Cost.GPM and m.needs == "hopper"
        # the catalog names the NVML constant; it must be the id the GPM source asks for
        assert getattr(pynvml, m.nvml) == mid, f"{series}: {m.nvml} is not GPM metric {mid}"


def test_every_catalog_gpm_metric_is_read_by_the_gpm_source():
    # (some may be opt-in because of their cost; they are still the GPM source's to read)
    read = {s for s, _, _ in GPM_METRICS + getattr(gpm, "EXPENSIVE_METRICS", [])}
    assert {m.name for m in ALL if m.source == "gpm"} == read
    ids = [mid for _, mid, _ in GPM_METRICS + getattr(gpm, "EXPENSIVE_METRICS", [])]
    assert len(ids) == len(set(ids))


def test_nvml_field_ids_named_in_the_catalog_exist():
    for m in ALL:
        for const in re.findall(r"NVML_FI_[A-Z0-9_]+", m.nvml):
            assert hasattr(pynvml, const), f"{m.name}: pynvml has no {const}"


def test_documented_example():
    assert CATALOG["gpu_sm_active_ratio"].dcgm == "DCGM_FI_PROF_SM_ACTIVE"
    assert CATALOG["gpu_utilization_ratio"].needs == "no-mig"
    assert CATALOG["gpu_throttle_seconds_total"].labels == ("reason",)
    assert CATALOG["gpu_xid_events_total"].labels == ("xid",)


# ---- series keys ----------------------------------------------------------------------------------


def test_series_key_without_labels_is_the_name():
    assert series_key("gpu_power_watts") == "gpu_power_watts"
    assert split_series_key("gpu_power_watts") == ("gpu_power_watts", {})


def test_series_key_format():
    assert series_key("gpu_throttle_seconds_total", reason="sw_power_cap") == (
        'gpu_throttle_seconds_total{reason="sw_power_cap"}')
    assert series_key("gpu_xid_events_total", xid=13) == 'gpu_xid_events_total{xid="13"}'


@pytest.mark.parametrize(
    "name, labels",
    [
        ("gpu_throttle_seconds_total", {"reason": "sw_power_cap"}),
        ("gpu_xid_events_total", {"xid": "79"}),
        ("host_cpu_core_ratio", {"cpu": "63"}),
        ("gpu_process_sm_active_ratio", {"pid": "4242", "process": "python", "user": "alice"}),
        ("gpu_retired_pages", {"cause": ""}),
    ],
)
def test_series_key_round_trips(name, labels):
    key = series_key(name, **labels)
    assert split_series_key(key) == (name, labels)
    assert list(split_series_key(key)[1]) == list(labels)  # label order kept


@pytest.mark.parametrize("value", ["a,b", 'say "hi"', "k=v", "back\\slash", "python train.py --lr=0.1,0.2"])
def test_series_key_round_trips_awkward_label_values(value):
    # split_series_key is documented as the inverse of series_key: it must hold for any label value
    # (process names and users are free text).
    key = series_key("gpu_process_sm_active_ratio", process=value, pid="7")
    assert split_series_key(key) == ("gpu_process_sm_active_ratio", {"process": value, "pid": "7"})


# ---- clock-event reasons -------------------------------------------------------------------------


def test_decode_clock_event_reasons():
    assert decode_clock_event_reasons(0) == []
    assert decode_clock_event_reasons(0x1) == ["gpu_idle"]
    assert decode_clock_event_reasons(0x4) == ["sw_power_cap"]
    assert decode_clock_event_reasons(0x60) == ["sw_thermal", "hw_thermal"]
    assert decode_clock_event_reasons(0x40 | 0x4 | 0x1) == ["gpu_idle", "sw_power_cap", "hw_thermal"]


def test_decode_all_bits_lowest_first_and_unknown_bits_ignored():
    everything = decode_clock_event_reasons(0x7FF)
    assert everything == [CLOCK_EVENT_REASONS[b] for b in sorted(CLOCK_EVENT_REASONS)]
    assert len(everything) == 11  # pynvml's nine reasons plus BoardLimit (0x200) and Reliability (0x400)
    assert decode_clock_event_reasons(0x1000 | 0x8) == ["hw_slowdown"]


@pytest.mark.parametrize(
    "const, name",
    [
        ("nvmlClocksEventReasonGpuIdle", "gpu_idle"),
        ("nvmlClocksEventReasonApplicationsClocksSetting", "applications_clocks"),
        ("nvmlClocksEventReasonSwPowerCap", "sw_power_cap"),
        ("nvmlClocksEventReasonHwSlowdown", "hw_slowdown"),
        ("nvmlClocksEventReasonSyncBoost", "sync_boost"),
        ("nvmlClocksEventReasonSwThermalSlowdown", "sw_thermal"),
        ("nvmlClocksEventReasonHwThermalSlowdown", "hw_thermal"),
        ("nvmlClocksEventReasonHwPowerBrakeSlowdown", "hw_power_brake"),
        ("nvmlClocksEventReasonDisplayClockSetting", "display_clock"),
    ],
)
def test_reason_bits_match_nvml(const, name):
    assert decode_clock_event_reasons(getattr(pynvml, const)) == [name]


def test_every_nvml_reason_bit_has_a_name():
    mask = pynvml.nvmlClocksEventReasonAll
    named = 0
    for bit in CLOCK_EVENT_REASONS:
        named |= bit
    assert mask & ~named == 0
