"""gpuscope: the truth about how well NVIDIA GPUs are used."""

from ._nvml import NvmlUnavailable
from ._records import Capability, Event, GpuIdentity, GpuRecord, HostRecord, ProcessRecord, Snapshot
from ._version import __version__
from .catalog import CATALOG, Metric
from .integrations import Monitor, MonitorError, StepReport, monitor
from .sampler import ConfigError, Sampler, SamplerConfig

__all__ = [
    "CATALOG",
    "Capability",
    "ConfigError",
    "Event",
    "GpuIdentity",
    "GpuRecord",
    "HostRecord",
    "Metric",
    "Monitor",
    "MonitorError",
    "NvmlUnavailable",
    "ProcessRecord",
    "Sampler",
    "SamplerConfig",
    "Snapshot",
    "StepReport",
    "__version__",
    "monitor",
]
