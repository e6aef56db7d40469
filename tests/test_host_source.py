import time
from collections import namedtuple
from types import SimpleNamespace

import psutil
import pytest

from gpuscope.catalog import series_key
from gpuscope.sources.host import HostSource, numa_node_of_pci

COUNTERS = [
    "host_disk_read_bytes_total", "host_disk_write_bytes_total",
    "host_network_receive_bytes_total", "host_network_transmit_bytes_total",
]


def _spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_collect_real_host():
    src = HostSource()
    assert src.name == "host"
    _spin(0.15)
    first = src.collect()
    _spin(0.15)
    second = src.collect()

    ncpu = len(psutil.cpu_times(percpu=True))
    cores = [series_key("host_cpu_core_ratio", cpu=i) for i in range(ncpu)]
    for sample in (first, second):
        assert all(isinstance(v, float) for v in sample.values())
        for key in ["host_cpu_ratio", *cores]:
            assert 0.0 <= sample[key] <= 1.0, key
        # this process kept one core busy
        assert sample["host_cpu_ratio"] >= 0.9 / ncpu - 0.05
        assert sum(sample[k] for k in cores) > 0.8  # the scheduler may move us between cores
        assert {"host_load1", "host_load5", "host_load15", "host_swap_used_bytes"} <= sample.keys()
        assert 0 < sample["host_memory_available_bytes"] <= sample["host_memory_total_bytes"]
        assert 0 < sample["host_memory_used_bytes"] <= sample["host_memory_total_bytes"]
    for key in COUNTERS:
        if key in first:
            assert second[key] >= first[key] >= 0, key
    if set(psutil.net_io_counters(pernic=True)) - {"lo"}:
        assert "host_network_receive_bytes_total" in second


def _fake_psutil(**overrides):
    cpu = namedtuple("scputimes", "user nice system idle iowait irq softirq steal guest guest_nice")
    disk = namedtuple("sdiskio", "read_bytes write_bytes")
    nic = namedtuple("snetio", "bytes_sent bytes_recv")
    state = {"n": 0}

    def cpu_times(percpu=False):
        state["n"] += 1
        n = state["n"]
        # core 0: all busy since the last call; core 1: all idle; core 2: half iowait, half system
        return [cpu(100 * n, 0, 0, 0, 0, 0, 0, 0, 0, 0), cpu(0, 0, 0, 100 * n, 0, 0, 0, 0, 0, 0),
                cpu(0, 0, 50 * n, 0, 50 * n, 0, 0, 0, 0, 0)]

    ns = SimpleNamespace(
        cpu_times=cpu_times,
        getloadavg=lambda: (1.5, 1.0, 0.5),
        virtual_memory=lambda: SimpleNamespace(total=1000, available=600, used=300),
        swap_memory=lambda: SimpleNamespace(used=7),
        disk_io_counters=lambda perdisk=False: ({"nvme0n1": disk(100, 200), "nvme0n1p1": disk(90, 190),
                                                 "md0": disk(100, 200), "loop0": disk(5, 5)}
                                                if perdisk else disk(999, 999)),
        net_io_counters=lambda pernic=False: {"lo": nic(1000, 1000), "eth0": nic(10, 20), "ib0": nic(1, 2)},
    )
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns


@pytest.fixture
def sys_root(tmp_path):
    for d in ("nvme0n1", "md0", "loop0"):
        (tmp_path / "block" / d).mkdir(parents=True)
    return str(tmp_path)


def test_cpu_ratios_from_time_deltas(sys_root):
    out = HostSource(_fake_psutil(), sys_root=sys_root).collect()
    assert out[series_key("host_cpu_core_ratio", cpu=0)] == 1.0
    assert out[series_key("host_cpu_core_ratio", cpu=1)] == 0.0
    assert out[series_key("host_cpu_core_ratio", cpu=2)] == 0.5  # iowait counts as idle
    assert out["host_cpu_ratio"] == pytest.approx(1.5 / 3)


def test_values_from_psutil(sys_root):
    out = HostSource(_fake_psutil(), sys_root=sys_root).collect()
    assert (out["host_load1"], out["host_load5"], out["host_load15"]) == (1.5, 1.0, 0.5)
    assert (out["host_memory_total_bytes"], out["host_memory_available_bytes"],
            out["host_memory_used_bytes"], out["host_swap_used_bytes"]) == (1000, 600, 300, 7)
    # only whole physical disks: not partitions (nvme0n1p1), md RAID or loop devices on top of them
    assert (out["host_disk_read_bytes_total"], out["host_disk_write_bytes_total"]) == (100, 200)
    # all interfaces but loopback
    assert (out["host_network_receive_bytes_total"], out["host_network_transmit_bytes_total"]) == (22, 11)


def test_failing_or_missing_facilities_omit_their_keys(tmp_path):
    def boom(*a, **k):
        raise OSError("nope")

    fake = _fake_psutil(disk_io_counters=lambda perdisk=False: None, net_io_counters=boom, swap_memory=boom,
                        getloadavg=boom)
    out = HostSource(fake, sys_root=str(tmp_path)).collect()  # no /sys/block: the total is asked for
    assert not set(COUNTERS) & out.keys()
    assert not {"host_swap_used_bytes", "host_load1", "host_load5", "host_load15"} & out.keys()
    assert out["host_memory_total_bytes"] == 1000 and "host_cpu_ratio" in out


def test_cpu_failure_at_start_does_not_raise(sys_root):
    def boom(*a, **k):
        raise RuntimeError("no /proc/stat")

    src = HostSource(_fake_psutil(cpu_times=boom), sys_root=sys_root)
    out = src.collect()
    assert "host_cpu_ratio" not in out and out["host_load1"] == 1.5


def test_counters_stay_monotonic_when_interfaces_come_and_go(sys_root):
    nic = namedtuple("snetio", "bytes_sent bytes_recv")
    readings = iter([
        {"eth0": nic(100, 1000), "veth1": nic(50, 500)},
        {"eth0": nic(110, 1100)},  # veth1 gone with its container
        {"eth0": nic(120, 1200), "veth2": nic(5, 7)},  # a new one
        {"eth0": nic(3, 4)},  # eth0 recreated (driver reload): its counter restarted
    ])
    src = HostSource(_fake_psutil(net_io_counters=lambda pernic=False: next(readings)), sys_root=sys_root,
                     slow_every=1)
    rx = [src.collect()["host_network_receive_bytes_total"] for _ in range(4)]
    assert rx == [1500, 1600, 1707, 1711]


@pytest.mark.parametrize(
    "bus_id, content, expected",
    [
        ("00000000:3B:00.0", "1\n", 1),  # NVML form, 8-digit domain, upper case
        ("0000:3b:00.0", "0\n", 0),  # sysfs form
        ("3B:00.0", "1\n", 1),  # no domain
        ("00000000:3B:00.0", "-1\n", None),  # no NUMA information
        ("00000000:3B:00.0", "garbage", None),
        ("00000000:3B:00.0", None, None),  # no such device
        ("not a bus id", "1", None),
    ],
)
def test_numa_node_of_pci(tmp_path, bus_id, content, expected):
    dev = tmp_path / "bus" / "pci" / "devices" / "0000:3b:00.0"
    dev.mkdir(parents=True)
    if content is not None:
        (dev / "numa_node").write_text(content)
    assert numa_node_of_pci(bus_id, sys_root=str(tmp_path)) == expected


def test_numa_node_of_pci_wide_domain(tmp_path):
    # VMD domains are wider than 4 digits; sysfs prints them in full.
    dev = tmp_path / "bus" / "pci" / "devices" / "10000:e1:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("3\n")
    assert numa_node_of_pci("00010000:E1:00.0", sys_root=str(tmp_path)) == 3
    assert numa_node_of_pci(b"00010000:E1:00.0", sys_root=str(tmp_path)) == 3  # type: ignore[arg-type]
    assert numa_node_of_pci(None, sys_root=str(tmp_path)) is None  # type: ignore[arg-type]


def test_slow_host_parts_are_read_every_nth_call_and_carried_between(sys_root):
    calls = []

    def net(pernic=False):
        calls.append(1)
        nic = namedtuple("snetio", "bytes_sent bytes_recv")
        return {"eth0": nic(10, 1000 * len(calls))}

    src = HostSource(_fake_psutil(net_io_counters=net), sys_root=sys_root, slow_every=3)
    outs = [src.collect() for _ in range(7)]
    assert len(calls) == 3  # calls 0, 3 and 6
    assert all("host_network_receive_bytes_total" in o for o in outs)
    assert outs[1]["host_network_receive_bytes_total"] == outs[0]["host_network_receive_bytes_total"]
    assert outs[3]["host_network_receive_bytes_total"] > outs[2]["host_network_receive_bytes_total"]
    assert all("host_cpu_ratio" in o for o in outs[1:])
