"""Sources of samples. Each reads one kind of fact about a `Device` (or the host) into a values dict.

A source is any object with a `name` and `collect(group, device, now)`; the sampler decides when
each group is due. A new GPU vendor or data source is one new module implementing that.
"""

from __future__ import annotations

from typing import Protocol

from .device import Device


class DeviceSource(Protocol):
    name: str
    groups: tuple[str, ...]  # cadence groups this source reads, e.g. ('fast', 'slow')

    def collect(self, group: str, dev: Device, now: float) -> None:
        """Read `group`'s fields of `dev` into dev.values. May raise GpuLost; nothing else."""


__all__ = ["Device", "DeviceSource"]
