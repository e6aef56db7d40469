"""The simulated node: named scenarios whose coupled metrics follow the signatures measured on an H200
(../shared/workloads/METRICS.md), for demos, CI and trying gpuscope without a GPU.

It is a `FakeNVML` whose GPUs change with time, so the real sampler, sources and every consumer run
unchanged; everything it produces is labelled simulated (Snapshot.simulated holds the scenario).

With `workload`, every process of the node is a rank of one torchrun run of that id (its environment carries
TORCHELASTIC_RUN_ID): several simulated nodes (GPUSCOPE_NODE_NAME=node-a, node-b, ...) started with the same id
are one job across nodes, and one of them with a slower scenario (throttled) is its straggler.

Two scenarios have processes of their own kinds (`ROLES`): `shared_gpu` runs a bf16 matmul loop and a
small-op loop that reads a value back every step (.item()) on one GPU, each with its own SM share, memory
and CPU, so the GPU is compute-bound while the second process waits on its syncs; `jax_eager` runs one
process that dispatches small ops eagerly from several threads (1.9 cores, none saturated) while the SMs
idle. With `processes`, a GPU's processes take the roles in turn.

With `churn_s`, the processes come and go: each one is replaced, about every `churn_s` seconds of the
node's clock, by a new process (a new pid and command line) on the same GPU, one at a time and spread
evenly over the period, so a node of N processes sees N / churn_s starts (and stops) a second while it
always runs N. That is what a shared inference or CI node looks like, and what makes per-process
series come and go in the store.

    >>> from gpuscope.sim import SimulatedNode, SCENARIOS
    >>> node = SimulatedNode("launch_bound")
    >>> sorted(SCENARIOS)[:3]
    ['compute_bound', 'gpu_lost', 'h2d_pinned']
    >>> SimulatedNode("mixed", processes=100, churn_s=60).churn_s
    60.0
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import pynvml as _nv

from ._cgroup import MAX_WORKLOAD_CHARS, attribution_from_cgroup, attribution_from_environ
from ._frameworks import FRAMEWORKS
from ._hostproc import HostProcInfo
from ._records import THREAD_BUSY_RATIO, ThreadCpu
from .catalog import series_key
from .errors import UsageError
from .fakenvml import FakeGPU, FakeNVML, FakeProcess

MIB = 1 << 20


@dataclass(frozen=True)
class Profile:
    """One steady state, in the units of METRICS.md: percents, MiB/s, watts, MiB, CPU % (100 = a core)."""

    nvml_util: float
    sm: float
    occ: float
    tensor: float
    fp32: float
    dram: float
    pcie_rx: float
    power: float
    clock_events: int
    cpu: float
    mem_mib: float
    hmma: float | None = None
    fp16: float = 0.0
    pcie_tx: float = 10.0
    temp: float = 55.0
    sm_clock: float = 1980.0
    thread_cpu: float | None = None  # busiest thread, % of a core


# Medians measured on one H200 (METRICS.md); throttled and memory_leak are built on them.
PROFILES: dict[str, Profile] = {
    "compute_bound": Profile(100, 96.4, 14.2, 93.6, 0.0, 17.4, 15, 691, 0x4, 100, 2777, temp=72, sm_clock=1755),
    "memory_bound": Profile(100, 99.6, 85.0, 0.0, 1.6, 88.3, 28, 571, 0x0, 100, 5329, temp=66),
    "transfer_bound": Profile(16, 0.4, 0.3, 0.0, 0.0, 0.5, 7579, 125, 0x0, 100, 1361, temp=36),
    "h2d_pinned": Profile(100, 0.0, 0.0, 0.0, 0.0, 0.4, 53_400, 140, 0x0, 100, 1400, temp=38),
    "launch_bound": Profile(23, 0.1, 0.0, 0.0, 0.0, 0.0, 155, 123, 0x0, 100, 1333, temp=35),
    "input_starved": Profile(5, 4.0, 2.3, 0.5, 0.2, 2.1, 131, 153, 0x0, 100, 3707, temp=40),
    "sync_bound": Profile(25, 20.5, 1.6, 0.0, 11.7, 0.0, 27, 220, 0x0, 100, 1353, temp=42),
    "idle_allocated": Profile(0, 0.0, 0.0, 0.0, 0.0, 0.0, 1, 121, 0x1, 0, 42193, temp=31, sm_clock=345),
    "healthy": Profile(100, 89.5, 39.4, 32.1, 3.4, 37.7, 51, 687, 0x0, 100, 6099, temp=70),
    "throttled": Profile(100, 95.0, 14.0, 90.0, 0.0, 16.0, 15, 560, 0x60, 100, 2777, temp=89, sm_clock=1110),
    # compute_bound's GPU with a second process beside it, each on one core (ROLES)
    "shared_gpu": Profile(100, 96.4, 14.2, 90.1, 0.3, 17.9, 18, 688, 0x4, 200, 3400, temp=72, sm_clock=1755),
    # the JAX program without jax.jit: SMs ~0 %, NVML 3 %, 75 % of the memory preallocated (JAX's default)
    "jax_eager": Profile(3, 0.1, 0.1, 0.0, 0.1, 0.1, 40, 128, 0x0, 192, 108_000, temp=36, thread_cpu=82),
}


@dataclass(frozen=True)
class Role:
    """What one process of a scenario does: its command, its weight in the GPU's SM time and memory, its CPU
    (cores) and its busy threads (name, share of a core), the busiest first."""

    cmd: str
    sm_weight: float
    mem_weight: float
    cpu: float
    threads: tuple[tuple[str, float], ...]


#: The processes of the scenarios that have several kinds; rank k of a GPU takes ROLES[scenario][k % len].
ROLES: dict[str, tuple[Role, ...]] = {
    "shared_gpu": (Role("python matmul_loop.py --dtype bf16", 0.94, 0.82, 1.0, (("python", 1.0),)),
                   Role("python small_ops.py --item-every-step", 0.06, 0.18, 1.0, (("python", 1.0),))),
    "jax_eager": (Role("python jax_eager.py --steps 100000", 1.0, 1.0, 1.92,
                       (("python", 0.82), ("dispatch-0", 0.56), ("dispatch-1", 0.54))),),
}

DESCRIPTIONS = {
    "compute_bound": "bf16 matmuls: SMs and tensor cores busy, clocks capped by the power limit",
    "memory_bound": "elementwise ops over huge tensors: DRAM bandwidth near its ceiling, tensor pipes idle",
    "transfer_bound": "host->device copies from pageable memory: SMs idle, PCIe busy, one CPU core saturated",
    "h2d_pinned": "pinned host->device copies: NVML 'utilization' 100 % with SMs 0 % busy",
    "launch_bound": "tiny kernels from a Python loop: SMs nearly idle, the launching thread at 100 % CPU",
    "input_starved": "a data loader too slow for the GPU: utilization oscillates, CPU saturated",
    "sync_bound": "frequent device->host synchronisations (.item()) stall the pipeline",
    "idle_allocated": "42 GiB held, nothing running: a reserved but wasted GPU",
    "healthy": "well-used training: no bottleneck to report",
    "throttled": "compute-bound but thermally throttled: 89 C, SM clock down to 1110 MHz",
    "memory_leak": "GPU memory grows steadily until the process runs out of memory and restarts",
    "gpu_lost": "two GPUs training; GPU 1 falls off the bus after 10 s (XID 79)",
    "xid_storm": "GPU 0 reports bursts of XID 13/31/43 errors and corrected ECC errors",
    "mixed": "an 8-GPU node with a different behaviour on each GPU",
    "shared_gpu": "two processes on one GPU: a bf16 matmul loop (compute-bound) and a small-op loop that calls "
                  ".item() every step (low SM share, its thread busy on syncs)",
    "jax_eager": "JAX-like eager dispatch (no jax.jit): SMs idle, NVML 3 %, 1.9 cores over three busy threads, "
                 "none saturated",
}
SCENARIOS = sorted(DESCRIPTIONS)
_DEFAULT_GPUS = {"gpu_lost": 2, "mixed": 8}
_DEFAULT_PROCESSES = {"shared_gpu": 2}  # per GPU
_MIXED = ["healthy", "compute_bound", "memory_bound", "launch_bound", "input_starved", "idle_allocated",
          "throttled", "transfer_bound"]

#: The frameworks a scenario's processes run on (what their maps would show), where not PyTorch: the fixes of
#: its verdicts speak them. SimulatedNode(frameworks=...) overrides it for one node.
SCENARIO_FRAMEWORKS: dict[str, tuple[str, ...]] = {"jax_eager": ("jax",)}

_BASE_PID = 4_000_000  # above Linux's default pid_max: never a real process
_CHURN_PID = _BASE_PID + 10_000 * 64  # pids of replacement processes count up from here, never reused
_MAX_CHURN_S = 7 * 86_400.0


class UnknownScenario(UsageError, ValueError):
    """A --simulate scenario that does not exist: one sentence naming the ones that do."""


@dataclass
class _SimProcess(FakeProcess):
    """A simulated process: its rank on its GPU, how many processes held that slot before it, when it
    started (unix seconds), its /proc/<pid>/cgroup text ('' when the node runs no pods) and its
    /proc/<pid>/environ bytes."""

    rank: int = 0
    generation: int = 0
    started_at: float = 0.0
    cgroup: str = ""
    environ: bytes = b""
    frameworks: tuple[str, ...] = ("torch",)


def _cgroup(gpu: int, gpus: int) -> str:
    """The cgroup of GPU `gpu`'s processes on a node that runs pods (SimulatedNode(pods=True)): one pod per
    GPU, a containerd container under the kubelet's systemd slices; on a node of several GPUs the last one's
    processes run outside Kubernetes (a login session), so that every allocation state has a GPU to show."""
    if gpus > 1 and gpu == gpus - 1:
        return "0::/user.slice/user-1000.slice/session-2.scope"
    uid = f"5171a7ed_0000_4000_8000_{gpu:012d}"
    container = (f"{gpu:02x}5171a7ed" * 7)[:64]
    return (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/"
            f"cri-containerd-{container}.scope")


def _pct(rng: random.Random, v: float, rel: float = 0.03) -> float:
    return min(100.0, max(0.0, v * (1 + rel * rng.gauss(0, 1)) + 0.05 * abs(rng.gauss(0, 1)) * (v > 0)))


class _GpuDriver:
    """Moves one FakeGPU through a profile with time; also the state its process reports to the host."""

    def __init__(self, profile_name: str, index: int, seed: int) -> None:
        self.name = profile_name
        self.base = PROFILES.get(profile_name, PROFILES["healthy"])
        self.rng = random.Random(seed)
        self.last_t: float | None = None
        self.cpu = self.base.cpu / 100.0
        self.thread_cpu = (self.base.thread_cpu if self.base.thread_cpu is not None else min(100.0, self.base.cpu)) / 100
        self.index = index
        self.leak_mib = 0.0
        self.restarts = 0

    def profile_at(self, t: float) -> Profile:
        p = self.base
        if self.name == "input_starved":
            # Bursts of real work while a batch is ready, then waiting on the loader: ~8 % duty in 2.5 s.
            busy = (t % 2.5) < 0.2
            if busy:
                return replace(p, nvml_util=100, sm=80, occ=40, tensor=30, dram=35, power=450)
            return replace(p, nvml_util=0, sm=0.2, occ=0.1, tensor=0, dram=0.1, power=130)
        return p

    def __call__(self, gpu: FakeGPU, t: float) -> None:
        dt = 0.0 if self.last_t is None else max(0.0, t - self.last_t)
        if self.last_t is not None and dt < 0.002:
            return  # one state per 2 ms is plenty; keeps the fake cheap
        self.last_t = t
        p = self.profile_at(t)
        r = self.rng
        sm = _pct(r, p.sm)
        gpu.util_gpu = int(round(_pct(r, p.nvml_util, 0.02)))
        gpu.util_mem = int(round(_pct(r, p.dram * 0.9)))
        gpu.power_w = max(60.0, p.power * (1 + 0.02 * r.gauss(0, 1)))
        gpu.temperature_c = int(round(p.temp + r.gauss(0, 0.5)))
        gpu.memory_temperature_c = gpu.temperature_c + 4
        gpu.sm_clock_mhz = gpu.graphics_clock_mhz = int(p.sm_clock)
        gpu.clock_event_reasons = p.clock_events if p.clock_events or p.nvml_util > 0 else 0x1
        if gpu.power_w > gpu.power_limit_w:
            # Never over the limit: a profile that reaches it carries sw_power_cap (compute_bound); for one
            # below it (healthy, 687 W of 700 W) the noise is folded back under the limit, as the driver's
            # 1 s average stays there, instead of flickering the power-cap reason on and off every tick.
            gpu.power_w = 2 * gpu.power_limit_w - gpu.power_w
        gpu.pstate = 0
        tensor = _pct(r, p.tensor)
        gpu.gpm = {
            1: _pct(r, max(p.nvml_util * 0.98, sm)), 2: sm, 3: _pct(r, p.occ), 4: _pct(r, p.fp32 * 0.3),
            5: tensor, 7: tensor if p.hmma is None else _pct(r, p.hmma), 9: 0.0, 6: 0.0,
            10: _pct(r, p.dram), 11: 0.0, 12: _pct(r, p.fp32), 13: _pct(r, p.fp16),
            20: max(0.0, p.pcie_tx * (1 + 0.05 * r.gauss(0, 1))), 21: max(0.0, p.pcie_rx * (1 + 0.03 * r.gauss(0, 1))),
            60: 0.0, 61: 0.0,
        }
        gpu.energy_mj += int(gpu.power_w * dt * 1000)
        gpu.pcie_rx_bytes += int(gpu.gpm[21] * MIB * dt)
        gpu.pcie_tx_bytes += int(gpu.gpm[20] * MIB * dt)
        mem = p.mem_mib
        if self.name == "memory_leak":
            self.leak_mib += 900.0 * dt  # ~0.9 GiB/s: runs out of 140 GiB in about 2.5 minutes
            if mem + self.leak_mib > gpu.memory_total_bytes / MIB - 1024:
                self.leak_mib = 0.0  # out of memory: the process dies and restarts
                self.restarts += 1
                for proc in gpu.processes:
                    proc.pid += 1
            mem += self.leak_mib
        gpu.memory_used_bytes = int((mem + 520) * MIB)
        self.cpu = max(0.0, p.cpu / 100.0 * (1 + 0.02 * r.gauss(0, 1)))
        self.thread_cpu = min(1.0, self.cpu if p.thread_cpu is None else p.thread_cpu / 100.0 * self.jitter())
        roles = [self.role(proc) for proc in gpu.processes]
        sm_total = sum(ro.sm_weight if ro else 1.0 for ro in roles) or 1.0
        mem_total = sum(ro.mem_weight if ro else 1.0 for ro in roles) or 1.0
        for proc, ro in zip(gpu.processes, roles, strict=True):
            proc.used_memory_bytes = int(mem * MIB * (ro.mem_weight if ro else 1.0) / mem_total)
            proc.sm_percent = int(round(sm * (ro.sm_weight if ro else 1.0) / sm_total))
            proc.mem_percent = int(round(gpu.util_mem))

    def jitter(self) -> float:
        """This tick's CPU noise, as a factor (1.0 = the profile's figure)."""
        return self.cpu / (self.base.cpu / 100.0) if self.base.cpu else 1.0

    def role(self, proc: FakeProcess) -> Role | None:
        """The role of a process of this GPU in a scenario with ROLES (by its rank); None elsewhere."""
        roles = ROLES.get(self.name)
        if not roles:
            return None
        rank = proc.rank if isinstance(proc, _SimProcess) else proc.pid % 10_000
        return roles[rank % len(roles)]


class _SimHostReader:
    """What the host would say about the simulated processes."""

    def __init__(self, node: SimulatedNode) -> None:
        self.node = node
        # pid -> (driver, GPU, process); rebuilt when a pid is not found or has moved on, so a lookup
        # stays one dict access however many processes the node runs and however fast they churn.
        self._index: dict[int, tuple[_GpuDriver, FakeGPU, FakeProcess]] = {}

    def _find(self, pid: int) -> tuple[_GpuDriver, FakeGPU, FakeProcess] | None:
        hit = self._index.get(pid)
        if hit is None or hit[2].pid != pid:
            self._index = {p.pid: (drv, gpu, p) for drv, gpu in zip(self.node.drivers, self.node.nvml.gpus,
                                                                     strict=False) for p in gpu.processes}
            hit = self._index.get(pid)
        return hit

    def read(self, pid: int) -> HostProcInfo | None:
        hit = self._find(pid)
        if hit is None:
            return None
        drv, gpu, proc = hit
        role = drv.role(proc)
        cmd = role.cmd if role is not None else {"idle_allocated": "jupyter-kernel --notebook analysis.ipynb",
                                                 "launch_bound": "python serve.py --batch-size 1"}.get(
            drv.name, "python train.py --batch-size 64")
        share = 1.0 / max(1, len(gpu.processes))
        sim = proc if isinstance(proc, _SimProcess) else _SimProcess(pid=proc.pid, rank=proc.pid % 10_000)
        rank, generation = sim.rank, sim.generation
        tail = (f" --rank {rank}" if len(gpu.processes) > 1 else "") + (f" --run {generation}" if generation else "")
        where = attribution_from_cgroup(sim.cgroup)  # the real parsers, as for a host process
        env = attribution_from_environ(sim.environ)
        cores, thread = drv.cpu * share, drv.thread_cpu
        busy = [ThreadCpu(pid, "python", round(thread, 4))] if thread >= THREAD_BUSY_RATIO else []
        if role is not None:  # its own CPU, with the tick's noise
            k = drv.jitter()
            cores = role.cpu * k
            busy = [ThreadCpu(pid + i, name, round(min(1.0, r * k), 4)) for i, (name, r) in enumerate(role.threads)]
            thread = busy[0].cpu_ratio
            busy = [t for t in busy if t.cpu_ratio >= THREAD_BUSY_RATIO]
        return HostProcInfo(
            pid=pid, name="python", user="sim", cmdline=f"{cmd} --gpu {drv.index}{tail}",
            cpu_cores=cores, thread_cpu_max_ratio=thread, rss_bytes=float(8 << 30),
            threads=24, threads_busy=len(busy), busy_threads=busy,
            started_at=sim.started_at or self.node.started_at, pod="", namespace="",
            container=where.container, pod_uid=where.pod_uid, slurm_job=env.slurm_job, torchrun_run=env.torchrun_run,
            frameworks=sim.frameworks,
        )

    def forget(self, alive: set[int]) -> None:
        return None


class _SimHostSource:
    name = "host"

    def __init__(self, node: SimulatedNode, cores: int = 32) -> None:
        self.node = node
        self.cores = cores
        self.t0 = time.monotonic()
        self.rng = random.Random(7)

    def collect(self) -> dict[str, float]:
        busy = sum(d.cpu for d in self.node.drivers)
        t = time.monotonic() - self.t0
        out = {
            "host_cpu_ratio": min(1.0, (busy + 0.5) / self.cores),
            "host_load1": busy + 0.4, "host_load5": busy + 0.3, "host_load15": busy + 0.2,
            "host_memory_total_bytes": float(512 << 30), "host_memory_used_bytes": float(96 << 30),
            "host_memory_available_bytes": float(416 << 30), "host_swap_used_bytes": 0.0,
            "host_disk_read_bytes_total": 50e6 * t, "host_disk_write_bytes_total": 5e6 * t,
            "host_network_receive_bytes_total": 20e6 * t, "host_network_transmit_bytes_total": 2e6 * t,
        }
        for c in range(self.cores):
            out[series_key("host_cpu_core_ratio", cpu=c)] = 1.0 if c < round(busy) else 0.02
        return out


class SimulatedNode:
    """A named scenario on `gpus` simulated H200s. `nvml`, `host_reader`, `host_source` plug into Sampler.
    With `pods`, the node is a Kubernetes node: its processes run in pods' cgroups (see _cgroup)."""

    def __init__(self, scenario: str, gpus: int | None = None, seed: int = 1,
                 processes: int | None = None, churn_s: float | None = None, pods: bool = False,
                 workload: str | None = None, frameworks: tuple[str, ...] | None = None) -> None:
        scenario = scenario.replace("-", "_")
        if scenario not in DESCRIPTIONS:
            raise UnknownScenario(
                f"Unknown scenario {scenario!r}; choose one of: {', '.join(SCENARIOS)}.")
        n = gpus if gpus is not None else _DEFAULT_GPUS.get(scenario, 1)
        if not 1 <= n <= 64:
            raise UnknownScenario(f"A simulated node has 1 to 64 GPUs, not {n}.")
        if processes is not None and not 1 <= processes <= 4096:
            raise UnknownScenario(f"A simulated node runs 1 to 4096 processes, not {processes}.")
        if churn_s is not None and (isinstance(churn_s, bool) or not isinstance(churn_s, int | float)
                                    or not 1.0 <= churn_s <= _MAX_CHURN_S):
            raise UnknownScenario(f"A simulated process lives 1 s to 7 days (churn), not {churn_s!r} s.")
        check_workload(workload)
        frameworks = tuple(frameworks) if frameworks is not None else SCENARIO_FRAMEWORKS.get(scenario, ("torch",))
        if not set(frameworks) <= set(FRAMEWORKS):
            raise UnknownScenario(f"A simulated process runs on {', '.join(FRAMEWORKS)} (any of them, or none), "
                                  f"not {', '.join(sorted(set(frameworks) - set(FRAMEWORKS)))}.")
        self.frameworks = frameworks
        environ = b"" if workload is None else (b"PATH=/usr/bin\0TORCHELASTIC_RUN_ID=" + workload.encode() + b"\0")
        self.workload = workload
        # Processes are dealt round-robin over the GPUs (at least one per GPU); one GPU's processes
        # share its memory and SM time.
        per_gpu = [_DEFAULT_PROCESSES.get(scenario, 1)] * n if processes is None else [processes // n + (1 if i < processes % n else 0) for i in range(n)]
        self.scenario = scenario
        self.started_at = time.time()
        self.drivers: list[_GpuDriver] = []
        fake_gpus = []
        for i in range(n):
            prof = _MIXED[i % len(_MIXED)] if scenario == "mixed" else scenario
            if scenario in ("gpu_lost", "xid_storm"):
                prof = "healthy"
            drv = _GpuDriver(prof, i, seed * 1000 + i)
            cgroup = _cgroup(i, n) if pods else ""
            g = FakeGPU(index=i, uuid=f"GPU-5171a7ed-0000-4000-8000-{i:012d}", name="NVIDIA H200 (simulated)",
                        processes=[_SimProcess(pid=_BASE_PID + 10_000 * i + k, rank=k, cgroup=cgroup, environ=environ,
                                               frameworks=frameworks)
                                   for k in range(per_gpu[i])],
                        dynamics=drv)
            self.drivers.append(drv)
            fake_gpus.append(g)
        self.nvml = FakeNVML(fake_gpus)
        self.host_reader = _SimHostReader(self)
        self.host_source = _SimHostSource(self)
        self._timers: list[Callable[[float], None]] = []
        if scenario == "gpu_lost":
            self._arm_gpu_lost(fake_gpus[min(1, n - 1)], after=10.0)
        if scenario == "xid_storm":
            self._arm_xid_storm(fake_gpus[0])
        self.churn_s = None if churn_s is None else float(churn_s)
        self.replaced = 0  # processes replaced so far (churn)
        self._next_pid = _CHURN_PID
        if self.churn_s is not None:
            self._arm_churn(fake_gpus, per_gpu, self.churn_s)

    def _arm_churn(self, gpus: list[FakeGPU], per_gpu: list[int], period: float) -> None:
        """Process j of the N dealt round-robin (GPU j % n, rank j // n) is first replaced at
        period * (j + 1) / N, then every period: one replacement every period / N seconds, node-wide.
        It happens on the node's clock, when NVML is read (FakeNVML calls dynamics under its lock)."""
        n, total = len(gpus), sum(per_gpu)
        for i, gpu in enumerate(gpus):
            due = [(period * (k * n + i + 1) / total, k) for k in range(per_gpu[i])]
            heapq.heapify(due)
            gpu.dynamics = self._churning(gpu.dynamics, due, period)

    def _churning(self, inner: Callable[[FakeGPU, float], None] | None, due: list[tuple[float, int]],
                  period: float) -> Callable[[FakeGPU, float], None]:
        def dyn(g: FakeGPU, t: float) -> None:
            if inner is not None:
                inner(g, t)
            while due and due[0][0] <= t:
                at, k = heapq.heappop(due)
                old = g.processes[k]
                generation = old.generation + 1 if isinstance(old, _SimProcess) else 1
                g.processes[k] = _SimProcess(
                    pid=self._next_pid, used_memory_bytes=old.used_memory_bytes, sm_percent=old.sm_percent,
                    mem_percent=old.mem_percent, rank=k, generation=generation, started_at=self.started_at + t,
                    cgroup=old.cgroup if isinstance(old, _SimProcess) else "",
                    environ=old.environ if isinstance(old, _SimProcess) else b"",
                    frameworks=old.frameworks if isinstance(old, _SimProcess) else self.frameworks)
                self._next_pid += 1
                self.replaced += 1
                # The next one is due a period later; a clock that jumped several periods replaces it once.
                heapq.heappush(due, (at + period * (math.floor((t - at) / period) + 1), k))

        return dyn

    def _arm_gpu_lost(self, gpu: FakeGPU, after: float) -> None:
        inner = gpu.dynamics
        nvml = self.nvml

        def dyn(g: FakeGPU, t: float) -> None:
            if inner is not None:
                inner(g, t)
            if t >= after and not g.lost:
                nvml.inject_event(g, _nv.nvmlEventTypeXidCriticalError, 79)
                g.lost = True

        gpu.dynamics = dyn

    def _arm_xid_storm(self, gpu: FakeGPU) -> None:
        inner = gpu.dynamics
        nvml = self.nvml
        state = {"next": 2.0}
        codes = (13, 31, 43)

        def dyn(g: FakeGPU, t: float) -> None:
            if inner is not None:
                inner(g, t)
            # A burst of 5 XIDs every 3 s, and a steady trickle of corrected ECC errors.
            while t >= state["next"]:
                k = int(state["next"])
                for j in range(5):
                    nvml.inject_event(g, _nv.nvmlEventTypeXidCriticalError, codes[(k + j) % 3])
                nvml.inject_event(g, _nv.nvmlEventTypeSingleBitEccError, 0)
                g.ecc_corrected += 3
                state["next"] += 3.0

        gpu.dynamics = dyn


def check_workload(workload: str | None) -> None:
    """A simulated workload id is 1 to MAX_WORKLOAD_CHARS printable characters, none of them '=' (it becomes
    the value of an environment variable and a label); UsageError otherwise."""
    if workload is None:
        return
    if not isinstance(workload, str) or not 1 <= len(workload) <= MAX_WORKLOAD_CHARS - len("torchrun/") \
            or not workload.isprintable() or "=" in workload or workload.strip() != workload \
            or workload.lower() == "none":
        raise UsageError(f"A simulated workload id is 1 to {MAX_WORKLOAD_CHARS - len('torchrun/')} printable "
                         f"characters without '=' or surrounding spaces, and not 'none'; {workload!r} is not one.")


def describe(scenario: str) -> str:
    return DESCRIPTIONS[scenario]


__all__ = ["PROFILES", "ROLES", "SCENARIOS", "Role", "SCENARIO_FRAMEWORKS", "SimulatedNode", "UnknownScenario", "check_workload", "describe"]
