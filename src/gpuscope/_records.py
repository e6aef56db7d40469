"""Typed records the sampler produces. Plain data: no NVML, no threads, cheap to copy and serialise."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class GpuIdentity:
    """What does not change while the GPU is attached (read once)."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str = ""
    architecture: str = ""
    compute_capability: str = ""
    driver_version: str = ""
    cuda_version: str = ""
    memory_total_bytes: int = 0
    power_limit_watts: float | None = None
    sm_clock_max_hertz: float | None = None
    mig_mode: bool = False
    gpm_supported: bool = False
    numa_node: int | None = None
    cpu_affinity: list[int] = field(default_factory=list)
    parent_index: int | None = None  # set for a MIG instance
    gpu_instance_id: int | None = None

    @property
    def label(self) -> str:
        """The `gpu` label: '0', or '0/mig3' for MIG GPU instance 3 of GPU 0."""
        if self.parent_index is None:
            return str(self.index)
        return f"{self.parent_index}/mig{self.gpu_instance_id}"


@dataclass(frozen=True, slots=True, order=True)
class PodRef:
    """A container of a Kubernetes pod, by name (as the kubelet's PodResources API names it)."""

    namespace: str
    pod: str
    container: str = ""


@dataclass(slots=True)
class GpuRecord:
    """One GPU at one instant. `values` maps series keys (see catalog.series_key) to floats in base
    units; a series missing from `values` was not read this tick or is not supported (see
    Sampler.capabilities for which, and why)."""

    identity: GpuIdentity
    time_ns: int
    values: dict[str, float]
    healthy: bool = True
    throttle_reasons: list[str] = field(default_factory=list)
    # The pods' containers the kubelet says hold this GPU (several when it is shared); empty outside
    # Kubernetes, where `values` has no gpu_allocation_state either.
    allocated_to: list[PodRef] = field(default_factory=list)

    @property
    def index(self) -> int:
        return self.identity.index

    @property
    def uuid(self) -> str:
        return self.identity.uuid

    def __getitem__(self, key: str) -> float:
        return self.values[key]

    def get(self, key: str, default: float | None = None) -> float | None:
        return self.values.get(key, default)

    # Shortcuts for the numbers people ask for first; each returns None where unsupported.
    @property
    def sm_active_ratio(self) -> float | None:
        """GPM SM activity 0..1 (DCGM_FI_PROF_SM_ACTIVE): the utilization that does not lie."""
        return self.values.get("gpu_sm_active_ratio")

    @property
    def utilization_ratio(self) -> float | None:
        """NVML utilization.gpu 0..1 (nvidia-smi's 'GPU-Util'): any kernel or copy running."""
        return self.values.get("gpu_utilization_ratio")

    @property
    def memory_used_bytes(self) -> float | None:
        return self.values.get("gpu_memory_used_bytes")

    @property
    def power_watts(self) -> float | None:
        return self.values.get("gpu_power_watts")


#: A thread at this share of one core (or more) is busy: on the CPU half the time at least, so its work, not
#: waiting, sets its pace. `ProcessRecord.threads_busy` counts them.
THREAD_BUSY_RATIO = 0.5


@dataclass(frozen=True, slots=True)
class ThreadCpu:
    """One busy thread of a process: its id (the kernel's tid), name (/proc/PID/task/TID/comm) and CPU share
    (0..1 of one core) since the process was read before."""

    tid: int
    name: str
    cpu_ratio: float


@dataclass(slots=True)
class ProcessRecord:
    """A process using a GPU, joined with what the host knows about it."""

    pid: int
    gpu: str  # the GPU's label
    gpu_uuid: str
    type: str  # 'compute', 'graphics' or 'compute+graphics'
    name: str = ""
    user: str = ""
    cmdline: str = ""  # secrets redacted
    gpu_memory_bytes: float | None = None
    # The process's share of the GPU's SM activity (GPM): NVML's per-process utilization scaled so that
    # the processes of one GPU sum to gpu_sm_active_ratio (gpuscope.shares); NVML's own figure,
    # unscaled, where the GPU has no GPM.
    sm_ratio: float | None = None
    memory_ratio: float | None = None
    utilization_ratio: float | None = None  # NVML's per-process smUtil, 0..1: time a kernel of it ran
    energy_joules: float | None = None  # GPU energy shared out to it by SM share, since first seen
    cpu_cores: float | None = None  # cores: 1.0 = one core saturated
    thread_cpu_max_ratio: float | None = None
    rss_bytes: float | None = None
    threads: int | None = None
    # Threads at THREAD_BUSY_RATIO of a core or more since the last read, and the busiest of them (at most
    # eight): a dispatcher that keeps 1.9 cores busy over three threads, none saturated, shows here.
    threads_busy: int | None = None
    busy_threads: list[ThreadCpu] = field(default_factory=list)
    started_at: float | None = None  # epoch seconds
    container: str = ""
    pod_uid: str = ""
    pod: str = ""
    namespace: str = ""
    slurm_job: str = ""
    # The job this process is one rank of, which may span nodes: slurm/<id>, torchrun/<run id> or
    # k8s/<namespace>/<owner> (gpuscope._cgroup.workload_of); '' when none is known.
    workload: str = ""
    host_visible: bool = True  # False when the pid lives outside our pid namespace
    # The GPU frameworks it loaded (gpuscope._frameworks: torch, jax, cupy, ...), read once when it was first
    # seen; () when not known. In the API's and recordings' records, never a label of a series.
    frameworks: tuple[str, ...] = ()
    # Its CUDA driver API calls since the eBPF probes first saw it (sources.cudaprobe), counters; None where
    # the probes are off or it made no probed call. Copy bytes by direction; 'other' is cuMemcpy(Async),
    # whose direction the driver infers from unified addresses. Sync seconds sum over its threads.
    cuda_launches: float | None = None
    cuda_graph_launches: float | None = None
    cuda_copies: float | None = None
    cuda_h2d_bytes: float | None = None
    cuda_d2h_bytes: float | None = None
    cuda_d2d_bytes: float | None = None
    cuda_other_copy_bytes: float | None = None
    cuda_syncs: float | None = None
    cuda_sync_seconds: float | None = None


@dataclass(slots=True)
class PodRecord:
    """The processes of one pod (or, outside a known pod, one container) on one GPU, summed
    (gpuscope.shares.roll_up)."""

    gpu: str
    gpu_uuid: str
    namespace: str = ""
    pod: str = ""
    container: str = ""  # set only when the pod is unknown and the roll-up is per container
    processes: int = 0
    gpu_memory_bytes: float | None = None
    sm_ratio: float | None = None
    energy_joules: float | None = None  # a counter: kept across the pod's process starts and stops


@dataclass(slots=True)
class HostRecord:
    time_ns: int
    values: dict[str, float]


@dataclass(slots=True)
class Event:
    """Something that happened at an instant: an XID, an ECC error, a throttle change, a lost GPU,
    a process start or stop."""

    time_ns: int
    kind: str  # 'xid', 'ecc', 'clock_events', 'gpu_lost', 'process_start', 'process_stop', ...
    gpu: str | None
    message: str
    data: dict[str, Any] = field(default_factory=dict)
    count: int = 1  # identical events within one tick are folded; count says how many


@dataclass(slots=True)
class Snapshot:
    """Everything the sampler knows at one tick."""

    time_ns: int
    gpus: list[GpuRecord]
    processes: list[ProcessRecord]
    host: HostRecord | None
    events: list[Event]  # events that arrived since the previous snapshot
    simulated: str | None = None  # the scenario name when this is the simulated node
    hostname: str = ""
    pods: list[PodRecord] = field(default_factory=list)  # per pod and GPU (gpuscope.shares.roll_up)

    def gpu(self, label: str | int) -> GpuRecord:
        label = str(label)
        for g in self.gpus:
            if g.identity.label == label:
                return g
        raise KeyError(f"no GPU {label!r} in this snapshot")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Capability:
    supported: bool
    reason: str = ""  # why not, in words a user can act on
