"""Host metrics next to the GPU ones: CPU (all cores and per core), load, memory, swap, disk and network
byte counters, and the NUMA node of a GPU.

    >>> src = HostSource()
    >>> 0.0 <= src.collect().get("host_cpu_ratio", 0.0) <= 1.0
    True
"""

from __future__ import annotations

import logging
import os
from typing import Any

import psutil

from gpuscope.catalog import series_key

__all__ = ["HostSource", "numa_node_of_pci"]

log = logging.getLogger("gpuscope.host")

# Block devices that re-count I/O already counted on a physical disk below them (LVM/dm-crypt, md
# RAID, loop files, ...). /raid on a DGX is md0 over NVMe: counting both would double the bytes.
_STACKED_DISK_PREFIXES = ("dm-", "md", "loop", "ram", "zram", "nbd", "drbd", "bcache")


class _Accumulator:
    """A monotonic total over named counters that come and go (veth pairs, hot-plugged disks).

    Summing the counters of the moment would drop when an interface disappears; this adds each
    counter's increase instead, so the total only grows. A counter seen for the first time (or one
    that went back, i.e. was recreated) contributes its whole value.
    """

    __slots__ = ("_last", "total")

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self.total = 0.0

    def update(self, values: dict[str, float]) -> float:
        last = self._last
        for name, v in values.items():
            before = last.get(name)
            self.total += v - before if before is not None and v >= before else v
        self._last = dict(values)
        return self.total


def _busy_total(t: Any) -> tuple[float, float]:
    """(busy, total) CPU seconds of one psutil cpu_times entry, like psutil.cpu_percent counts them."""
    total = sum(t)
    # Linux already counts guest time inside user and nice.
    total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total


def _ratio(cur: tuple[float, float], prev: tuple[float, float]) -> float | None:
    d_total = cur[1] - prev[1]
    if d_total <= 0:
        return None
    return min(1.0, max(0.0, (cur[0] - prev[0]) / d_total))


class HostSource:
    """Host-wide metrics, keyed by catalog series keys. `collect()` never raises: a psutil call that
    fails (or is not available, as disk counters in many containers) just omits its keys.

    CPU ratios cover the time since the previous `collect()` (the first call: since construction).
    """

    name = "host"

    def __init__(self, psutil_module: Any = None, sys_root: str = "/sys", slow_every: int | None = None) -> None:
        self._ps = psutil_module if psutil_module is not None else psutil
        self.slow_every = slow_every or self.SLOW_EVERY
        self._sys_root = sys_root
        self._cpu_prev: list[tuple[float, float]] | None = None
        self._physical: dict[str, bool] = {}
        self._cpu_keys: list[str] = []
        self._acc = {k: _Accumulator() for k in ("disk_read", "disk_write", "net_rx", "net_tx")}
        self._calls = 0
        self._slow_values: dict[str, float] = {}
        try:
            self._cpu_ratios({})  # baseline, so the first collect() has a window
        except Exception as e:
            log.debug("host cpu_times failed: %r", e)

    #: Swap, disk and network counters change slowly or are counters (their rate stays exact), and
    #: they are the costly part of a reading: read them every this many calls, carried in between.
    SLOW_EVERY = 5

    def collect(self) -> dict[str, float]:
        """One reading of every host metric. Ratios in 0..1, bytes, byte counters since boot."""
        out: dict[str, float] = {}
        parts: tuple = (self._cpu_ratios, self._load, self._memory)
        if self._calls % self.slow_every == 0:
            self._slow_values = {}
            for part in (self._swap, self._disk, self._network):
                try:
                    part(self._slow_values)
                except Exception as e:  # an unavailable facility omits its keys, nothing more
                    log.debug("host %s failed: %r", part.__name__, e)
        self._calls += 1
        for part in parts:
            try:
                part(out)
            except Exception as e:  # an unavailable facility omits its keys, nothing more
                log.debug("host %s failed: %r", part.__name__, e)
        out.update(self._slow_values)
        return out

    def _cpu_ratios(self, out: dict[str, float]) -> None:
        cur = [_busy_total(t) for t in self._ps.cpu_times(percpu=True)]
        prev, self._cpu_prev = self._cpu_prev, cur
        if prev is None or len(prev) != len(cur):  # first call, or CPUs went on/offline
            return
        if len(self._cpu_keys) != len(cur):
            self._cpu_keys = [series_key("host_cpu_core_ratio", cpu=i) for i in range(len(cur))]
        for key, c, p in zip(self._cpu_keys, cur, prev, strict=True):
            r = _ratio(c, p)
            if r is not None:
                out[key] = r
        r = _ratio((sum(c[0] for c in cur), sum(c[1] for c in cur)),
                   (sum(p[0] for p in prev), sum(p[1] for p in prev)))
        if r is not None:
            out["host_cpu_ratio"] = r

    def _load(self, out: dict[str, float]) -> None:
        out["host_load1"], out["host_load5"], out["host_load15"] = (
            float(x) for x in self._ps.getloadavg())

    def _memory(self, out: dict[str, float]) -> None:
        vm = self._ps.virtual_memory()
        out["host_memory_total_bytes"] = float(vm.total)
        out["host_memory_available_bytes"] = float(vm.available)
        out["host_memory_used_bytes"] = float(vm.used)

    def _swap(self, out: dict[str, float]) -> None:
        out["host_swap_used_bytes"] = float(self._ps.swap_memory().used)

    def _is_physical(self, disk: str) -> bool:
        known = self._physical.get(disk)
        if known is None:
            # Whole disks have an entry in /sys/block, partitions do not.
            known = not disk.startswith(_STACKED_DISK_PREFIXES) and os.path.exists(
                os.path.join(self._sys_root, "block", disk))
            self._physical[disk] = known
        return known

    def _disk(self, out: dict[str, float]) -> None:
        if os.path.isdir(os.path.join(self._sys_root, "block")):
            per_disk = self._ps.disk_io_counters(perdisk=True) or {}
            disks = {name: d for name, d in per_disk.items() if self._is_physical(name)}
        else:
            total = self._ps.disk_io_counters()
            disks = {"total": total} if total is not None else {}
        if not disks:
            return
        out["host_disk_read_bytes_total"] = self._acc["disk_read"].update(
            {n: float(d.read_bytes) for n, d in disks.items()})
        out["host_disk_write_bytes_total"] = self._acc["disk_write"].update(
            {n: float(d.write_bytes) for n, d in disks.items()})

    def _network(self, out: dict[str, float]) -> None:
        nics = {n: c for n, c in (self._ps.net_io_counters(pernic=True) or {}).items() if n != "lo"}
        if not nics:
            return
        out["host_network_receive_bytes_total"] = self._acc["net_rx"].update(
            {n: float(c.bytes_recv) for n, c in nics.items()})
        out["host_network_transmit_bytes_total"] = self._acc["net_tx"].update(
            {n: float(c.bytes_sent) for n, c in nics.items()})


def numa_node_of_pci(bus_id: str, sys_root: str = "/sys") -> int | None:
    """NUMA node of a PCI device, from /sys/bus/pci/devices/<bus id>/numa_node; None if unknown.

    Accepts NVML's bus id ("00000000:3B:00.0", 8-hex-digit domain) as well as the sysfs form.

    >>> numa_node_of_pci("00000000:3B:00.0", sys_root="/nonexistent") is None
    True
    """
    try:
        if isinstance(bus_id, bytes):  # old pynvml bindings return bytes
            bus_id = bus_id.decode("ascii", "replace")
        text = bus_id.strip().strip("\x00").lower()
        parts = text.split(":")
        if len(parts) == 2:  # no domain: "3b:00.0"
            parts.insert(0, "0")
        if len(parts) != 3:
            return None
        domain, bus, devfn = parts
        norm = f"{int(domain, 16):04x}:{int(bus, 16):02x}:{devfn}"
        with open(os.path.join(sys_root, "bus", "pci", "devices", norm, "numa_node")) as f:
            node = int(f.read().strip())
        return node if node >= 0 else None
    except Exception:  # unreadable sysfs or a malformed id: the node is unknown
        return None
