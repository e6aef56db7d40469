"""Test doubles for code built on gpuscope: a fake NVML at the function level, and scenario fixtures.

`FakeNVML` (from gpuscope.fakenvml, which the simulated node runs on) has the same function names,
arguments and return shapes as `pynvml` for every call gpuscope makes, and raises the real
`pynvml.NVMLError` subclasses. Each `FakeGPU` holds plain state a test can change between calls.

    >>> from gpuscope.testing import FakeNVML, FakeGPU, lost_gpu
    >>> nvml = FakeNVML([FakeGPU(index=0), FakeGPU(index=1)])
    >>> nvml.nvmlInit(); nvml.nvmlDeviceGetCount()
    2
    >>> nvml = lost_gpu(); nvml.gpus[1].lost = True   # the second GPU falls off the bus

Scenario fixtures: `healthy_gpus()`, `unsupported_field()`, `lost_gpu()`, `mig_gpu()`,
`old_driver_no_gpm()`, `vanishing_process()`.
"""

from __future__ import annotations

import pynvml as _real

from .fakenvml import AMPERE, HOPPER, FakeGPU, FakeMig, FakeNVML, FakeProcess, NVMLError

__all__ = ["AMPERE", "HOPPER", "FakeGPU", "FakeMig", "FakeNVML", "FakeProcess", "NVMLError", "healthy_gpus",
           "lost_gpu", "mig_gpu", "old_driver_no_gpm", "unsupported_field", "vanishing_process"]


# ---- scenario fixtures ------------------------------------------------------------------------
def healthy_gpus(n: int = 3) -> FakeNVML:
    """n busy H200s, GPM supported, one process each."""
    gpus = []
    for i in range(n):
        g = FakeGPU(index=i, util_gpu=99, util_mem=40, power_w=650.0, temperature_c=60,
                    sm_clock_mhz=1980, graphics_clock_mhz=1980, memory_used_bytes=40 << 30,
                    clock_event_reasons=0, pcie_rx_bytes=10 << 30,
                    gpm={2: 90.0, 3: 40.0, 5: 60.0, 7: 60.0, 10: 35.0, 12: 3.0, 1: 99.0, 21: 50.0, 20: 10.0},
                    processes=[FakeProcess(pid=10_000 + i, used_memory_bytes=39 << 30, sm_percent=90,
                                           mem_percent=35)])
        gpus.append(g)
    return FakeNVML(gpus)


def unsupported_field() -> FakeNVML:
    """One GPU whose memory temperature and encoder utilization are not supported."""
    nvml = healthy_gpus(1)
    g = nvml.gpus[0]
    g.unsupported_fields.add(_real.NVML_FI_DEV_MEMORY_TEMP)
    g.errors["nvmlDeviceGetEncoderUtilization"] = _real.NVML_ERROR_NOT_SUPPORTED
    return nvml


def lost_gpu() -> FakeNVML:
    """Two GPUs; set `nvml.gpus[1].lost = True` to make the second fall off the bus."""
    return healthy_gpus(2)


def mig_gpu() -> FakeNVML:
    """An H200 in MIG mode with two GPU instances, each with GPM values and one process."""
    g = FakeGPU(index=0, mig=[FakeMig(gpu_instance_id=1, memory_used_bytes=5 << 30, gpm={2: 70.0, 5: 50.0}),
                              FakeMig(gpu_instance_id=2, memory_used_bytes=1 << 30, gpm={2: 5.0, 5: 0.0})],
                processes=[FakeProcess(pid=20_001, gpu_instance_id=1), FakeProcess(pid=20_002, gpu_instance_id=2)])
    return FakeNVML([g])


def old_driver_no_gpm() -> FakeNVML:
    """An A100 on an older driver: no GPM, no PCIe byte counters, no newer calls."""
    g = FakeGPU(index=0, name="NVIDIA A100-SXM4-80GB", architecture=AMPERE, compute_capability=(8, 0),
                unsupported_fields={_real.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, _real.NVML_FI_DEV_PCIE_COUNT_RX_BYTES},
                errors={"nvmlDeviceGetCurrentClocksEventReasons": _real.NVML_ERROR_FUNCTION_NOT_FOUND},
                util_gpu=80)
    return FakeNVML([g], driver_version="470.57.02", cuda_driver_version=11040)


def vanishing_process() -> FakeNVML:
    """One GPU with a process whose pid does not exist on the host (it exited between two calls)."""
    nvml = healthy_gpus(1)
    nvml.gpus[0].processes.append(FakeProcess(pid=2**22 + 17, used_memory_bytes=1 << 20))
    return nvml
