"""A GPU (or MIG GPU instance) as the sources see it: handle, identity, latest values, capabilities.

`discover()` enumerates the GPUs once, reading their identity; everything that changes is read by
the sources into `Device.values` (latest value per series, carried forward between reads).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from .._nvml import GpuLost, Nvml, Unavailable, decode
from .._records import Capability, Event, GpuIdentity
from ..catalog import CATALOG

log = logging.getLogger("gpuscope.device")

ARCHITECTURES = {2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere", 8: "Ada",
                 9: "Hopper", 10: "Blackwell", 13: "Rubin"}


@dataclass
class Device:
    identity: GpuIdentity
    handle: Any
    parent_handle: Any = None  # for a MIG instance: the physical GPU's handle
    healthy: bool = True
    values: dict[str, float] = field(default_factory=dict)
    caps: dict[str, Capability] = field(default_factory=dict)
    # per-source state lives here so that sources themselves stay stateless across devices
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def is_mig(self) -> bool:
        return self.identity.parent_index is not None

    @property
    def label(self) -> str:
        return self.identity.label

    def supported(self, metric: str) -> None:
        if metric not in self.caps or not self.caps[metric].supported:
            self.caps[metric] = Capability(True)

    def unsupported(self, metric: str, reason: str) -> None:
        self.caps[metric] = Capability(False, reason)
        self.values.pop(metric, None)


def _int(v: Any) -> int | None:
    return None if isinstance(v, Unavailable) else int(v)


def discover(nvml: Nvml, events: list[Event] | None = None) -> list[Device]:
    """All GPUs NVML sees, each followed by its MIG GPU instances when MIG is on."""
    driver = nvml.call("nvmlSystemGetDriverVersion")
    cuda = nvml.call("nvmlSystemGetCudaDriverVersion")
    driver_s = decode(driver) if driver else ""
    cuda_s = f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if cuda else ""
    count = nvml.call("nvmlDeviceGetCount") or 0
    devices: list[Device] = []
    ncpu_words = max(1, ((os.cpu_count() or 64) + 63) // 64)
    for i in range(int(count)):
        try:
            h = nvml.call("nvmlDeviceGetHandleByIndex", i)
            if isinstance(h, Unavailable):
                log.warning("GPU %d: no handle (%s); skipped", i, h.reason)
                continue
            dev = _identify(nvml, h, i, driver_s, cuda_s, ncpu_words)
        except GpuLost:
            ident = GpuIdentity(index=i, uuid="", name="(lost)", driver_version=driver_s, cuda_version=cuda_s)
            dev = Device(ident, None, healthy=False)
            dev.values["gpu_healthy"] = 0.0
            devices.append(dev)
            if events is not None:
                events.append(Event(time.time_ns(), "gpu_lost", str(i), f"GPU {i} is lost (NVML cannot reach it)"))
            continue
        devices.append(dev)
        if dev.identity.mig_mode:
            devices.extend(_mig_instances(nvml, dev))
    return devices


def _identify(nvml: Nvml, h: Any, i: int, driver: str, cuda: str, ncpu_words: int) -> Device:
    lib = nvml.lib
    uuid = nvml.call("nvmlDeviceGetUUID", h)
    name = nvml.call("nvmlDeviceGetName", h)
    pci = nvml.call("nvmlDeviceGetPciInfo_v3", h)
    arch = nvml.call("nvmlDeviceGetArchitecture", h)
    cc = nvml.call("nvmlDeviceGetCudaComputeCapability", h)
    mem = nvml.call("nvmlDeviceGetMemoryInfo", h)
    plim = nvml.call("nvmlDeviceGetEnforcedPowerLimit", h)
    smax = nvml.call("nvmlDeviceGetMaxClockInfo", h, lib.NVML_CLOCK_SM)
    mig = nvml.call("nvmlDeviceGetMigMode", h)
    aff = nvml.call("nvmlDeviceGetCpuAffinity", h, ncpu_words)
    gpm = nvml.call("nvmlGpmQueryDeviceSupport", h)
    cpus = []
    if not isinstance(aff, Unavailable):
        for w, word in enumerate(aff):
            cpus.extend(w * 64 + b for b in range(64) if int(word) >> b & 1)
    bus = decode(pci.busId) if not isinstance(pci, Unavailable) else ""
    from .host import numa_node_of_pci  # late: host.py imports psutil

    ident = GpuIdentity(
        index=i,
        uuid=decode(uuid) if uuid else "",
        name=decode(name) if name else "",
        pci_bus_id=bus,
        architecture=ARCHITECTURES.get(_int(arch) or -1, "unknown") if not isinstance(arch, Unavailable) else "",
        compute_capability=f"{cc[0]}.{cc[1]}" if not isinstance(cc, Unavailable) else "",
        driver_version=driver,
        cuda_version=cuda,
        memory_total_bytes=int(mem.total) if not isinstance(mem, Unavailable) else 0,
        power_limit_watts=plim / 1000 if not isinstance(plim, Unavailable) else None,
        sm_clock_max_hertz=smax * 1e6 if not isinstance(smax, Unavailable) else None,
        mig_mode=bool(not isinstance(mig, Unavailable) and mig[0]),
        gpm_supported=bool(not isinstance(gpm, Unavailable) and gpm.isSupportedDevice),
        numa_node=numa_node_of_pci(bus) if bus else None,
        cpu_affinity=cpus,
    )
    dev = Device(ident, h)
    dev.values["gpu_healthy"] = 1.0
    dev.supported("gpu_healthy")
    return dev


def _mig_instances(nvml: Nvml, parent: Device) -> list[Device]:
    out = []
    n = nvml.call("nvmlDeviceGetMaxMigDeviceCount", parent.handle) or 0
    for j in range(int(n)):
        mh = nvml.call("nvmlDeviceGetMigDeviceHandleByIndex", parent.handle, j)
        if isinstance(mh, Unavailable):
            continue  # slots without an instance answer NOT_FOUND
        gi = nvml.call("nvmlDeviceGetGPUInstanceId", mh)
        uuid = nvml.call("nvmlDeviceGetUUID", mh)
        mem = nvml.call("nvmlDeviceGetMemoryInfo", mh)
        p = parent.identity
        ident = GpuIdentity(
            index=p.index, uuid=decode(uuid) if uuid else "", name=f"{p.name} MIG", pci_bus_id=p.pci_bus_id,
            architecture=p.architecture, compute_capability=p.compute_capability,
            driver_version=p.driver_version, cuda_version=p.cuda_version,
            memory_total_bytes=int(mem.total) if not isinstance(mem, Unavailable) else 0,
            mig_mode=True, gpm_supported=p.gpm_supported, numa_node=p.numa_node, cpu_affinity=p.cpu_affinity,
            parent_index=p.index, gpu_instance_id=_int(gi),
        )
        dev = Device(ident, mh, parent_handle=parent.handle)
        dev.values["gpu_healthy"] = 1.0
        out.append(dev)
    return out


def mark_lost(dev: Device, events: list[Event]) -> None:
    """NVML said GPU is lost: stop reading it, say so once."""
    if not dev.healthy:
        return
    dev.healthy = False
    for k in list(dev.values):
        base = k.split("{", 1)[0]
        m = CATALOG.get(base)
        if m is not None and m.kind.value == "gauge" and base != "gpu_healthy":
            dev.values.pop(k)
            dev.caps[base] = Capability(False, "the GPU is lost")
    dev.values["gpu_healthy"] = 0.0
    events.append(Event(time.time_ns(), "gpu_lost", dev.label,
                        f"GPU {dev.label} ({dev.identity.uuid}) fell off the bus: NVML says the GPU is lost. "
                        "Its processes are likely dead; the GPU needs a reset or the node a reboot.",
                        {"uuid": dev.identity.uuid, "pci_bus_id": dev.identity.pci_bus_id}))
