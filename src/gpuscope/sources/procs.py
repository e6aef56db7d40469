"""Processes on each GPU, their GPU memory and per-process SM / memory utilization, joined with what the
host knows (user, redacted command line, CPU, busiest-thread CPU and busy threads, RSS, threads, container /
pod / Slurm job, and the workload: the job, possibly across nodes, it is one rank of).

Per-process utilization: NVML keeps a buffer of samples, one per process with non-zero use in each of
its sample periods. We ask for samples newer than the last time stamp we saw on that GPU; their mean
is NVML's own figure (`utilization_ratio`), their sum each process's part of the GPU's busy time,
which scales the GPU's GPM SM activity and energy over the same window into per-process shares
(`sm_ratio`, `energy_joules`; the model and its error: gpuscope.shares). A process with no new sample
was idle (NVML_ERROR_NOT_FOUND means none at all). NVML gives host PIDs even inside a container; a pid
we cannot see is reported as such. The processes of each pod are summed per GPU (`pods`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from .._cgroup import workload_of
from .._nvml import ERROR_NO_DATA, ERROR_NOT_FOUND, GpuLost, Nvml, Unavailable
from .._records import Capability, Event, PodRecord, ProcessRecord, ThreadCpu
from .._text import valid_text
from ..shares import Owner, fractions, owner, roll_up
from .device import Device, mark_lost


class HostProcessInfo(Protocol):
    pid: int
    name: str
    user: str
    cmdline: str
    cpu_cores: float | None
    thread_cpu_max_ratio: float | None
    rss_bytes: float | None
    threads: int | None
    threads_busy: int | None
    busy_threads: list[ThreadCpu] | None
    started_at: float | None
    container: str
    pod_uid: str
    pod: str
    namespace: str
    slurm_job: str
    torchrun_run: str
    frameworks: tuple[str, ...]  # read once per process (gpuscope._frameworks)


class HostReader(Protocol):
    def read(self, pid: int) -> HostProcessInfo | None: ...
    def forget(self, alive: set[int]) -> None: ...


#: What a process record shows of its command line: the redacted command line, the process name alone,
#: or nothing ([processes] cmdline in the agent's config). Applied here, where records are made, so
#: that no consumer (API, /metrics, dashboard, store, top) can see more.
CMDLINE_MODES = ("redacted", "name-only", "hidden")


_UTIL_METRICS = ("gpu_process_sm_active_ratio", "gpu_process_memory_utilization_ratio",
                 "gpu_process_utilization_ratio", "gpu_process_energy_joules_total")
_IDLE = (0.0, 0.0, 0.0)  # a process with no sample in the window: it ran no kernel
_UNSCALED = ("NVML's per-process utilization, not scaled to SM activity: this GPU has no GPM (or GPM is off "
             "in the sampler), so the shares of its processes need not sum to anything")


_NOT_YET = "NVML's per-process utilization, not yet scaled: GPM has no SM activity for the first window yet"


def _gpm_on(dev: Device) -> bool:
    """GPM is sampled on this GPU (the GPM source keeps its state there; False where it gave up)."""
    return bool(dev.state.get("gpm"))


def _window(dev: Device) -> tuple[float | None, float]:
    """The GPU's mean GPM SM activity and the energy it used since the last per-process read; starts the
    next window. The SM activity is None where GPM has no value yet; the energy 0 on the first read."""
    st = dev.state
    now = (st.get("sm_active_s", 0.0), st.get("gpm_s", 0.0), dev.values.get("gpu_energy_joules_total"))
    mark = st.get("share_mark")
    st["share_mark"] = now
    sm: float | None = None
    joules = 0.0
    if mark is not None:
        if now[1] > mark[1]:
            sm = (now[0] - mark[0]) / (now[1] - mark[1])
        if now[2] is not None and mark[2] is not None:
            joules = max(0.0, now[2] - mark[2])
    if sm is None and _gpm_on(dev):
        sm = dev.values.get("gpu_sm_active_ratio")  # no full GPM window since the last read yet
    return sm, joules


def _supported(dev: Device, scaled: bool) -> None:
    for m in _UTIL_METRICS[1:]:
        dev.supported(m)
    if not _gpm_on(dev):
        dev.caps["gpu_process_sm_active_ratio"] = Capability(True, _UNSCALED)
    elif scaled:
        dev.caps["gpu_process_sm_active_ratio"] = Capability(True)
    else:
        dev.caps["gpu_process_sm_active_ratio"] = Capability(True, _NOT_YET)


def _mark(dev: Device) -> None:
    """Start the next window now (no process was there to share this one)."""
    if "share_mark" in dev.state:
        _window(dev)


class ProcessSource:
    name = "processes"

    def __init__(self, nvml: Nvml, host: HostReader | None = None,
                 wall_clock_us: Callable[[], int] = lambda: int(time.time() * 1e6), cmdline: str = "redacted") -> None:
        if cmdline not in CMDLINE_MODES:
            raise ValueError(f"cmdline must be one of {', '.join(CMDLINE_MODES)}, not {cmdline!r}")
        self.cmdline = cmdline
        self.nvml = nvml
        if host is None:
            from .._hostproc import HostProcessReader

            host = HostProcessReader()
        self.host = host
        self.wall_clock_us = wall_clock_us
        self._seen: dict[str, set[int]] = {}  # gpu label -> pids at the last read
        # Called with each record once the host has filled it, before anything reads its pod: the kubelet's
        # names for a pod's process (sources.pods.PodJoin.attribute). Must not raise.
        self.attribute: Callable[[ProcessRecord], None] | None = None
        self._energy: dict[tuple[str, int], float] = {}  # (gpu label, pid) -> joules shared out to it
        self._pod_energy: dict[tuple[str, Owner], float] = {}
        self._owners: dict[tuple[str, int], Owner | None] = {}  # at the last read, for processes that end
        self.pods: list[PodRecord] = []

    def collect(self, devices: list[Device], events: list[Event], utilization: bool = True) -> list[ProcessRecord]:
        """All GPU processes now. Per-process utilization is read only when `utilization` is true
        (it is NVML's costliest call) and only on GPUs with processes; between reads each process
        keeps its last value."""
        records: list[ProcessRecord] = []
        owners: dict[tuple[str, int], Owner | None] = {}
        failed: set[str] = set()
        infos: dict[int, HostProcessInfo | None] = {}
        mig_children: dict[int, dict[int, Device]] = {}
        for d in devices:
            if d.is_mig and d.identity.parent_index is not None and d.identity.gpu_instance_id is not None:
                mig_children.setdefault(d.identity.parent_index, {})[d.identity.gpu_instance_id] = d
        for dev in devices:
            if dev.is_mig or not dev.healthy:
                continue
            try:
                found = self._device_processes(dev)
            except GpuLost:
                mark_lost(dev, events)
                continue
            if found is None:
                # Unknown, not empty: no stop/start events for it or its MIG instances.
                failed.add(dev.label)
                failed.update(d.label for d in mig_children.get(dev.identity.index, {}).values())
                continue
            energy_due: dict[int, float] = {}
            util: dict[int, tuple[float | None, float, float]] | None
            if dev.identity.mig_mode:
                util = None
                for d in (dev, *mig_children.get(dev.identity.index, {}).values()):
                    for m in _UTIL_METRICS:
                        d.unsupported(m, "NVML has no per-process utilization with MIG enabled")
            elif not found:
                util = {}
                _mark(dev)  # an idle GPU's energy is no one's: the next window starts when a process does
            elif utilization or "proc_util" not in dev.state:
                util, energy_due = self._utilization(dev)
                if dev.state.pop("proc_util_unscaled", False):
                    dev.state.pop("proc_util", None)  # read again at the next processes tick, scaled
                else:
                    dev.state["proc_util"] = util
            else:
                util = dev.state["proc_util"]
            children = mig_children.get(dev.identity.index, {})
            for pid, (kinds, mem, gi) in found.items():
                target = children.get(gi, dev) if children else dev
                if pid not in infos:
                    infos[pid] = self.host.read(pid)
                info = infos[pid]
                if util is None:
                    sm = mu = raw = energy = None
                else:
                    sm, mu, raw = util.get(pid, _IDLE)
                    key = (dev.label, pid)
                    energy = self._energy[key] = self._energy.get(key, 0.0) + energy_due.get(pid, 0.0)
                rec = ProcessRecord(
                    pid=pid, gpu=target.label, gpu_uuid=target.identity.uuid, type="+".join(sorted(kinds)),
                    gpu_memory_bytes=mem, sm_ratio=sm, memory_ratio=mu, utilization_ratio=raw,
                    energy_joules=energy, host_visible=info is not None,
                )
                if info is not None:
                    # Text from the host is made valid UTF-8 here, whatever reader produced it: from this
                    # record on, the store, /metrics, the API and the views can encode it.
                    rec.name, rec.user = valid_text(info.name), valid_text(info.user)
                    rec.cmdline = (valid_text(info.cmdline) if self.cmdline == "redacted"
                                   else rec.name if self.cmdline == "name-only" else "")
                    rec.cpu_cores, rec.thread_cpu_max_ratio = info.cpu_cores, info.thread_cpu_max_ratio
                    rec.rss_bytes, rec.threads, rec.started_at = info.rss_bytes, info.threads, info.started_at
                    rec.threads_busy = info.threads_busy
                    rec.busy_threads = [replace(t, name=valid_text(t.name)) for t in info.busy_threads or []]
                    rec.container, rec.pod_uid, rec.pod = valid_text(info.container), valid_text(info.pod_uid), \
                        valid_text(info.pod)
                    rec.namespace, rec.slurm_job = valid_text(info.namespace), valid_text(info.slurm_job)
                    if self.attribute is not None:
                        self.attribute(rec)
                    # after the kubelet's names: a pod's owner is one way to name the job
                    rec.workload = workload_of(rec.slurm_job, valid_text(info.torchrun_run), rec.namespace, rec.pod)
                    rec.frameworks = tuple(info.frameworks)
                records.append(rec)
                owners[(dev.label, pid)] = owner(rec)
            for pid, joules in energy_due.items():
                # A process that ended within the window is charged to the pod it was in.
                who = owners.get((dev.label, pid)) or self._owners.get((dev.label, pid))
                if who is not None and joules:
                    pkey = (dev.label, who)
                    self._pod_energy[pkey] = self._pod_energy.get(pkey, 0.0) + joules
        self._diff(records, devices, events, failed)
        self.host.forget(set(infos))
        self._forget(records, owners, failed)
        return records

    def _forget(self, records: list[ProcessRecord], owners: dict[tuple[str, int], Owner | None],
                failed: set[str]) -> None:
        """Keep energy counters of the processes and pods still on a GPU (and of GPUs not read this time)."""
        self._energy = {k: v for k, v in self._energy.items() if k in owners or k[0] in failed}
        live = {(k[0], who) for k, who in owners.items() if who is not None}
        self._pod_energy = {k: v for k, v in self._pod_energy.items() if k in live or k[0] in failed}
        self._owners = {**{k: v for k, v in self._owners.items() if k[0] in failed}, **owners}
        self.pods = roll_up(records, self._pod_energy)

    def _device_processes(self, dev: Device) -> dict[int, tuple[set[str], float | None, int]] | None:
        """pid -> (kinds, GPU memory bytes or None, GPU instance id)."""
        out: dict[int, tuple[set[str], float | None, int]] = {}
        ok = False
        for call, kind in (("nvmlDeviceGetComputeRunningProcesses", "compute"),
                           ("nvmlDeviceGetGraphicsRunningProcesses", "graphics")):
            procs = self.nvml.call(call, dev.handle)
            if isinstance(procs, Unavailable):
                continue
            ok = True
            for p in procs:
                mem = getattr(p, "usedGpuMemory", None)
                mem_f = float(mem) if isinstance(mem, int) and mem < (1 << 62) else None  # N/A on MIG
                gi = int(getattr(p, "gpuInstanceId", 0xFFFFFFFF))
                prev = out.get(p.pid)
                if prev is None:
                    out[p.pid] = ({kind}, mem_f, gi)
                else:
                    prev[0].add(kind)
        if not ok:
            dev.unsupported("gpu_process_memory_used_bytes", "NVML cannot list this GPU's processes")
            return None
        dev.supported("gpu_process_memory_used_bytes")
        return out

    def _utilization(self, dev: Device) -> tuple[dict[int, tuple[float | None, float, float]] | None, dict[int, float]]:
        """pid -> (SM share, memory utilization, NVML's smUtil mean) for the processes with samples since
        the last read, and pid -> joules shared out to it over that window (gpuscope.shares)."""
        last = dev.state.get("proc_util_ts")
        if last is None:
            last = self.wall_clock_us() - 1_000_000
        samples = self.nvml.call("nvmlDeviceGetProcessUtilization", dev.handle, last)
        if isinstance(samples, Unavailable):
            # Nothing new: every process was idle. (pynvml raises NVMLError(0) when the driver's
            # first call reports no samples without asking for a buffer.)
            if samples.code in (ERROR_NOT_FOUND, ERROR_NO_DATA, 0):
                dev.state["proc_util_ts"] = last
                _window(dev)  # no process ran: this window's energy is no one's
                _supported(dev, True)
                return {}, {}
            for m in _UTIL_METRICS:
                dev.unsupported(m, samples.reason)
            return None, {}
        acc: dict[int, list[float]] = {}
        newest = last
        for s in samples:
            ts = int(s.timeStamp)
            if ts <= last:
                continue
            newest = max(newest, ts)
            a = acc.setdefault(int(s.pid), [0.0, 0.0, 0.0])
            a[0] += s.smUtil
            a[1] += s.memUtil
            a[2] += 1
        dev.state["proc_util_ts"] = newest
        sm_active, joules = _window(dev)
        # Until GPM has a value (the sampler's first GPM window), NVML's own figure stands in.
        scaled = sm_active is not None
        _supported(dev, scaled)
        if not scaled and _gpm_on(dev):
            dev.state["proc_util_unscaled"] = True
        frac = fractions({pid: a[0] for pid, a in acc.items()})
        out: dict[int, tuple[float | None, float, float]] = {}
        for pid, a in acc.items():
            raw = a[0] / a[2] / 100.0
            out[pid] = (frac[pid] * sm_active if sm_active is not None else raw, a[1] / a[2] / 100.0, raw)
        return out, {pid: f * joules for pid, f in frac.items() if f > 0 and joules > 0}

    def _diff(self, records: list[ProcessRecord], devices: list[Device], events: list[Event],
              failed: set[str]) -> None:
        now = time.time_ns()
        current: dict[str, dict[int, ProcessRecord]] = {}
        for r in records:
            current.setdefault(r.gpu, {})[r.pid] = r
        for dev in devices:
            label = dev.label
            if not dev.healthy or label in failed:
                continue
            cur = current.get(label, {})
            before = self._seen.get(label)
            if before is not None:
                for pid in cur.keys() - before:
                    r = cur[pid]
                    events.append(Event(now, "process_start", label,
                                        f"process {pid} ({r.name or '?'}) started using GPU {label}",
                                        {"pid": pid, "name": r.name, "user": r.user}))
                for pid in before - cur.keys():
                    events.append(Event(now, "process_stop", label, f"process {pid} stopped using GPU {label}",
                                        {"pid": pid}))
            self._seen[label] = set(cur)

