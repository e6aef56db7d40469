"""Who used a shared GPU: each process's share of the GPU's SM activity and energy, and the same per pod.

What NVML gives per process. `nvmlDeviceGetProcessUtilization` returns samples `(pid, timeStamp,
smUtil, memUtil, ...)`: for each driver sample period (about 1/6 s to 1 s, by product) and each process
with non-zero use in it, `smUtil` is the percent of that period during which a kernel of the process
ran. It is the per-process form of `utilization.gpu`: time, not SMs. A process that keeps one small
kernel running shows 100 % while it fills a few of the 132 SMs. Idle periods give no sample at all.

The model. Over one window (from one per-process read to the next, 5 s by default):

    u_i      = sum of process i's smUtil samples in the window   (a missing sample counts 0)
    f_i      = u_i / sum_j u_j                                    (its fraction of the GPU's busy time)
    sm_i     = f_i * A,   A = the GPU's GPM SM activity (gpu_sm_active_ratio) averaged over the window
    energy_i = f_i * E,   E = the GPU's energy counter's increase over the window

so the shares of one GPU sum to its SM activity and its energy while any process ran, exactly, by
construction. Summing samples rather than averaging them makes f_i independent of how many sample
periods fit in the window and of which periods were idle.

Why it is an estimate. f_i is a share of *time*; A is a share of *SMs busy*. Scaling assumes that
every process fills the SMs equally while its kernels run. Under time-slicing a process of small
kernels gets a share of SM activity in proportion to its time although it filled fewer SMs, so its
share is too high and its neighbours' too low, by up to the ratio of their SM fill; with MPS, kernels
of several processes run at once and each process's smUtil counts the overlap in full, which f_i
shares out in proportion. The energy split has the same error plus one of its own: it charges the
GPU's idle power, while any process ran, in proportion to time too. A window where no process had a
sample leaves its energy unattributed (the GPU idled). The share of a process that ended within a
window goes to no record (the others' shares keep their sizes), and its pod's energy counter is
charged with it while the pod has another process on the GPU.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._records import PodRecord, ProcessRecord

#: What makes a pod: the labels kept per roll-up row.
Owner = tuple[str, str, str]  # (namespace, pod, container)


def fractions(util_sums: dict[int, float]) -> dict[int, float]:
    """Each pid's fraction of the GPU's busy time in the window: u_i / sum u_j (0 for all when none ran).

    >>> fractions({1: 300.0, 2: 100.0, 3: 0.0})
    {1: 0.75, 2: 0.25, 3: 0.0}
    """
    total = sum(v for v in util_sums.values() if v > 0)
    if total <= 0:
        return {pid: 0.0 for pid in util_sums}
    return {pid: (v / total if v > 0 else 0.0) for pid, v in util_sums.items()}


def owner(p: ProcessRecord) -> Owner | None:
    """The pod a process is rolled up under: its namespace and pod where attribution found them, else its
    container (a pod whose name is not known yet); None for a process in no container."""
    if p.pod or p.pod_uid:
        return (p.namespace, p.pod or p.pod_uid, "")
    return ("", "", p.container) if p.container else None


def roll_up(records: Iterable[ProcessRecord], energy: dict[tuple[str, Owner], float] | None = None) -> list[PodRecord]:
    """One PodRecord per (GPU, pod): processes counted, GPU memory and SM share summed (None where no process
    of the pod has a value). `energy` holds the pods' energy counters, kept by the caller across windows.

    >>> a = ProcessRecord(1, "0", "GPU-a", "compute", pod="p", namespace="ns", gpu_memory_bytes=2.0, sm_ratio=0.25)
    >>> b = ProcessRecord(2, "0", "GPU-a", "compute", pod="p", namespace="ns", gpu_memory_bytes=1.0, sm_ratio=0.5)
    >>> [(r.pod, r.processes, r.gpu_memory_bytes, r.sm_ratio) for r in roll_up([a, b])]
    [('p', 2, 3.0, 0.75)]
    """
    out: dict[tuple[str, Owner], PodRecord] = {}
    for p in records:
        who = owner(p)
        if who is None:
            continue
        key = (p.gpu, who)
        r = out.get(key)
        if r is None:
            r = out[key] = PodRecord(gpu=p.gpu, gpu_uuid=p.gpu_uuid, namespace=who[0], pod=who[1], container=who[2])
            if energy is not None and key in energy:
                r.energy_joules = energy[key]
        r.processes += 1
        if p.gpu_memory_bytes is not None:
            r.gpu_memory_bytes = (r.gpu_memory_bytes or 0.0) + p.gpu_memory_bytes
        if p.sm_ratio is not None:
            r.sm_ratio = (r.sm_ratio or 0.0) + p.sm_ratio
    return list(out.values())
