"""Pods on GPUs: the kubelet's answer (which pod's container holds which GPU) joined with the processes'
cgroups (which process runs in a pod), and each GPU's allocation state.

Process -> pod. A process is a pod's when its cgroup path names a pod (kubepods…pod<uid>); the kubelet
does not give pod UIDs, so the pod is found among the GPU's holders: by the name the process's
environment gives (POD_NAME, or HOSTNAME inside a pod) where it can be read, else the GPU's one holding
pod, else a pod UID learnt on another GPU. A pod process the answer does not account for asks the
kubelet again (`PodSource.hint`). Where a pod runs on a GPU without asking for it (NVIDIA_VISIBLE_DEVICES=all)
and one other pod holds that GPU, a process that gives no name is counted as the holder's: nothing on
the node tells the two apart.

GPU -> state (gpu_allocation_state{state}), from the last answer and the processes:
  in_use_outside_kubernetes  a process in no pod's cgroup runs on it
  in_use_by_pod              a pod holds it (or a pod's process runs on it) and it was busy in the last
                             `hold_s` (SM activity or NVML utilization at the idle thresholds of the
                             diagnosis), or its activity is not measured and a process runs on it
  allocated_idle             a pod holds it and it has been idle for `hold_s`
  unallocated                no pod holds it and nothing runs on it
No state before the kubelet's first answer, for a lost GPU, or for a MIG-enabled GPU (its instances
have theirs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Protocol

from .._records import GpuRecord, PodRef, ProcessRecord
from ..catalog import ALLOCATION_STATES, series_key
from .podresources import Allocations

STATE_KEYS = {s: series_key("gpu_allocation_state", state=s) for s in ALLOCATION_STATES}
#: Below both, a GPU is idle: the diagnosis's own thresholds (diagnose.thresholds: sm_idle, util_active).
SM_IDLE, UTIL_ACTIVE = 0.05, 0.05


class PodSource(Protocol):
    """Where the allocations come from (sources.podresources.KubeletPods, or a test double)."""

    def start(self, devices: Mapping[str, str]) -> None: ...  # the node's GPUs, UUID -> gpu label
    def allocations(self) -> Allocations | None: ...  # the last answer, at once; None before the first
    def hint(self, key: str, namespace: str = "", pod: str = "") -> None: ...
    def stop(self) -> None: ...


def state_of(values: Mapping[str, float]) -> str | None:
    """The state a GPU record's values say, or None where they say none."""
    for s, key in STATE_KEYS.items():
        if values.get(key) == 1.0:
            return s
    return None


class PodJoin:
    """Applies the last answer of a PodSource to process records and GPU records. Used from the sampler's
    thread only (no lock): `attribute` as each process record is made, `annotate` as each snapshot is."""

    def __init__(self, source: PodSource, hold_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.hold_s = hold_s
        self.clock = clock
        self._uid_pod: dict[str, tuple[str, str]] = {}  # pod UID -> (namespace, pod), learnt
        self._active_at: dict[str, float] = {}  # gpu label -> when it was last seen busy

    def attribute(self, rec: ProcessRecord) -> None:
        """Give a pod's process its namespace, pod and container as the kubelet names them."""
        if not rec.pod_uid:
            return
        answer = self.source.allocations()
        if answer is None:
            return
        holders = answer.by_gpu.get(rec.gpu, ())
        known = self._uid_pod.get(rec.pod_uid)
        if rec.pod:
            mine = [h for h in holders if h.pod == rec.pod and (not rec.namespace or h.namespace == rec.namespace)]
        elif known is not None:
            mine = [h for h in holders if (h.namespace, h.pod) == known]
        else:
            mine = list(holders)
        pods = {(h.namespace, h.pod) for h in mine}
        if len(pods) != 1:
            if not pods:
                self.source.hint(rec.pod_uid, rec.namespace, rec.pod)
            return
        (namespace, pod), = pods
        containers = {h.container for h in mine}
        rec.namespace, rec.pod = namespace, pod
        # The container's name where one container of the pod holds the GPU; else its runtime id stays.
        if len(containers) == 1:
            rec.container = next(iter(containers))
        if len(self._uid_pod) > 10_000:
            self._uid_pod.clear()
        self._uid_pod[rec.pod_uid] = (namespace, pod)

    def annotate(self, gpus: list[GpuRecord], processes: list[ProcessRecord]) -> None:
        """Each GPU record's holders (allocated_to) and allocation state (in values)."""
        answer = self.source.allocations()
        if answer is None:
            return
        now = self.clock()
        on: dict[str, list[ProcessRecord]] = {}
        for p in processes:
            on.setdefault(p.gpu, []).append(p)
        for g in gpus:
            label = g.identity.label
            holders = answer.by_gpu.get(label, ())
            g.allocated_to = list(holders)
            if not g.healthy or (g.identity.mig_mode and g.identity.parent_index is None):
                continue
            state = self._state(label, g.values, holders, on.get(label, ()), now)
            for s, key in STATE_KEYS.items():
                g.values[key] = 1.0 if s == state else 0.0

    def _state(self, label: str, values: Mapping[str, float], holders: tuple[PodRef, ...],
               procs: list[ProcessRecord] | tuple[()], now: float) -> str:
        # A pid the agent cannot see (no hostPID) has no cgroup to read: it is not counted as outside.
        if any(p.host_visible and not p.pod_uid for p in procs):
            return "in_use_outside_kubernetes"
        if not holders and not any(p.pod_uid for p in procs):
            return "in_use_outside_kubernetes" if procs else "unallocated"
        sm, util = values.get("gpu_sm_active_ratio"), values.get("gpu_utilization_ratio")
        if sm is None and util is None:
            busy = bool(procs)  # activity not measured here (a MIG instance before GPM answers)
        else:
            busy = (sm is not None and sm >= SM_IDLE) or (util is not None and util >= UTIL_ACTIVE)
        if busy:
            self._active_at[label] = now
        last = self._active_at.get(label)
        return "in_use_by_pod" if last is not None and now - last < self.hold_s else "allocated_idle"
