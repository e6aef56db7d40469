"""A week of a GPU fleet's series, as gpuscope's agents would export them and Prometheus would have
scraped them, written as OpenMetrics text for `promtool tsdb create-blocks-from openmetrics`, with the
per-GPU truths the fleet report's answer is checked against (benchmarks/bench_fleet_scale.py).

Why a stand-in and not gpuscope.sim's SimulatedNode: the simulated node runs on the wall clock through
the real sampler; 64 nodes x 8 GPUs x 7 days of it would take a week. This writes what its scenarios
produce, scrape by scrape: each GPU's values come from sim.PROFILES (the medians measured on an H200,
../shared/workloads/METRICS.md) with the simulated node's noise (3 % on SM activity, 2 % on power),
input_starved's bursts (busy 8 % of the time, so a scrape catches a burst 8 % of the time), and each
profile's clock-event reasons accumulated into gpu_throttle_seconds_total, as the agent does.

The fleet (seeded, so every run writes the same data):
- node i is `gpu-node-<i>`; one node in four has H100 80GB GPUs, the rest H200s.
- three nodes in four are Kubernetes nodes (gpu_allocation_state, pods' labels on the GPU's own series);
  the rest run Slurm (no allocation state; workload `slurm/<id>`, the job's user on the process series).
- Kubernetes nodes cycle through three layouts: one 8-GPU PyTorchJob pod (nodes paired: both run the
  same job, `<job>-master-0` and `<job>-worker-0`, workload `k8s/<ns>/<job>`), two 4-GPU Job pods
  (`<job>-<5>`), or eight 1-GPU slots (Deployment pods `<deploy>-<hash>-<5>`, notebooks
  `jupyter-<user>-0` of a StatefulSet, and now and then a process outside Kubernetes).
- Pods come and go: each slot alternates between a pod (hours to days) and nothing (0 to 3 h); one pod
  in ten holds its GPUs with no process (allocated_idle). A new pod is a new set of series.
- A node with i % 16 == 1 is powered off for 6 h at 40 % of the week (no samples; its counters restart
  from 0), one with i % 16 == 2 is not scraped for 45 min at 70 % of the week (its GPUs keep working,
  its counters keep counting): gaps the report must show as unobserved, never as idle.
- Scrapes are `step` apart, each node at its own offset inside the step (as Prometheus spreads its
  targets) with a few ms of jitter.

Truths are kept per GPU segment (one GPU under one pod or job, or free) and summed per group at the
end, over the steps inside [start, end), with the report's definitions (docs/FLEET.md): observed =
scraped samples x step; used = sum of SM activity x step; allocated = samples in any state but
unallocated (Kubernetes: a pod holds it, or a process outside Kubernetes runs, counted apart as well) or
with a process (elsewhere); idle = allocated samples with SM activity < 0.05; energy and throttle
seconds = what the counters counted, scraped or not (a scrape gap of a running GPU is energy used, not
observed; no GPU changes hands inside the gap, so whose it was is known); memory headroom = 1 - the
largest used / total of a scraped sample; verdict hours = scraped samples under each verdict x step.
A --by pod group is named namespace/pod, as the report names it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from gpuscope.catalog import ALLOCATION_STATES, CLOCK_EVENT_REASONS
from gpuscope.diagnose.thresholds import Thresholds
from gpuscope.sim import PROFILES

MIB = 1 << 20
BLOCK_S = 7200  # promtool's block length: one file per block is read once (it re-reads a file per block)
LEAD_IN_S = BLOCK_S  # data before the window: the report must not count it
MODELS = {"NVIDIA H200": 143_771 * MIB, "NVIDIA H100 80GB HBM3": 81_559 * MIB}
REASONS = list(CLOCK_EVENT_REASONS.values())
_BITS = list(CLOCK_EVENT_REASONS)
SM_IDLE = Thresholds().sm_idle
DIMS = ("namespace", "pod", "job", "user", "node", "model")
#: The figures summed per group that the report, the peer and the truths are compared on (hours, kWh).
FIGURES = ("observed_gpu_hours", "allocated_gpu_hours", "outside_kubernetes_gpu_hours", "used_gpu_hours",
           "idle_gpu_hours", "energy_kwh", "throttled_hours")
NONE = "(none)"

# Pseudo-profiles beside sim.PROFILES: a GPU nothing holds or runs on, one whose pod holds it with no
# process (the same signature: 0 SM, idle clocks, ~70 W, the driver's 520 MiB).
FREE = "free"
_FREE_PROFILE = dict(sm=0.0, power=70.0, mem_mib=0.0, clock_events=0x1)
PROFILE_NAMES = [FREE, *sorted(PROFILES)]
_P = {name: i for i, name in enumerate(PROFILE_NAMES)}


def _profile_arrays() -> dict[str, np.ndarray]:
    rows = [_FREE_PROFILE] + [dict(sm=p.sm, power=p.power, mem_mib=p.mem_mib, clock_events=p.clock_events)
                              for _, p in sorted(PROFILES.items())]
    out = {k: np.array([r[k] for r in rows], dtype=np.float64) for k in ("sm", "power", "mem_mib")}
    out["mask"] = np.array([int(r["clock_events"]) for r in rows], dtype=np.int64)
    return out


PROF = _profile_arrays()
# Each profile's verdict (gpu_verdict's kind while it runs); a free GPU's is 'idle'.
VERDICTS = ["idle", *sorted(PROFILES)]
# The workloads each kind of slot runs, and how often.
MIXES = {
    "train": {"healthy": 45, "compute_bound": 25, "throttled": 10, "input_starved": 10, "sync_bound": 5,
              "memory_bound": 5},
    "job": {"healthy": 30, "compute_bound": 20, "memory_bound": 15, "input_starved": 15, "transfer_bound": 10,
            "idle_allocated": 10},
    "deploy": {"launch_bound": 30, "healthy": 20, "memory_bound": 20, "idle_allocated": 15, "sync_bound": 15},
    "notebook": {"idle_allocated": 60, "healthy": 20, "launch_bound": 20},
    "slurm": {"healthy": 35, "compute_bound": 20, "memory_bound": 10, "input_starved": 10, "idle_allocated": 10,
              "throttled": 10, "transfer_bound": 5},
}
HOURS = {"train": (12, 48), "job": (2, 12), "deploy": (6, 72), "notebook": (1, 8), "slurm": (1, 24)}
TEAMS = ["ml-research", "ml-platform", "vision", "recsys", "speech"]
USERS = ["alice", "bob", "chen", "dana", "erik", "fatima", "gopal", "hana"]
STATE = {s: i for i, s in enumerate(ALLOCATION_STATES)}
NO_STATE = -1


@dataclass
class Seg:
    """One GPU under one holder (or none) for [t0, t1) in step indices."""

    gpu: int  # fleet-wide GPU index
    t0: int
    t1: int
    profile: str = FREE
    namespace: str = ""
    pod: str = ""
    container: str = ""
    workload: str = ""
    user: str = ""
    pid: str = ""  # '' when no process runs
    slurm_job: str = ""
    state: int = NO_STATE  # index into ALLOCATION_STATES on a Kubernetes node
    series: int = 0  # index of its GPU label set (equal sets, e.g. a GPU free twice, share one)


@dataclass
class Fleet:
    nodes: int
    gpus: int
    days: float
    step_s: int
    end_s: int  # a multiple of BLOCK_S
    seed: int = 20
    segs: list[Seg] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start_s = self.end_s - int(round(self.days * 86400))
        if self.start_s % BLOCK_S or BLOCK_S % self.step_s:
            raise ValueError("the window must be whole 2 h blocks and the step divide 2 h")
        self.t0_s = self.start_s - LEAD_IN_S  # the first scrape step of the data
        self.steps = (self.end_s - self.t0_s) // self.step_s
        self.window0 = LEAD_IN_S // self.step_s  # first step inside [start, end)
        n = self.nodes * self.gpus
        self.hostname = [f"gpu-node-{i:03d}" for i in range(self.nodes)]
        self.model = ["NVIDIA H100 80GB HBM3" if i % 4 == 3 else "NVIDIA H200" for i in range(self.nodes)]
        self.k8s = [i < max(1, round(self.nodes * 0.75)) for i in range(self.nodes)]
        rng = random.Random(self.seed)
        self.offset_s = [rng.uniform(1.0, self.step_s - 1.0) for _ in range(self.nodes)]
        self.uuid = [f"GPU-{hashlib.md5(f'{g}'.encode()).hexdigest()[:8]}-"
                     f"{g:04x}-4{g % 1000:03d}-8000-{g:012x}" for g in range(n)]
        # per step: the segment each GPU is in; whether it was scraped; whether it was powered
        self.seg_of = np.zeros((n, self.steps), dtype=np.int32)
        self.scraped = np.ones((n, self.steps), dtype=bool)
        self.powered = np.ones((n, self.steps), dtype=bool)
        self.resets: list[tuple[int, int]] = []  # (gpu, step): its counters restart from 0 here
        self._plan()

    # ---- the plan: who holds which GPU when ----
    def _hours(self, rng: random.Random, lo: float, hi: float) -> int:
        return max(1, int(rng.uniform(lo, hi) * 3600 / self.step_s))

    def _plan(self) -> None:
        down = [(n, int(self.steps * 0.4), int(6 * 3600 / self.step_s)) for n in range(self.nodes) if n % 16 == 1]
        gap = [(n, int(self.steps * 0.7), int(45 * 60 / self.step_s)) for n in range(self.nodes) if n % 16 == 2]
        ki = 0
        for node in range(self.nodes):
            base = node * self.gpus
            if not self.k8s[node]:
                for s in range(self.gpus):
                    self._slot(node, [base + s], "slurm", random.Random(f"{self.seed}/{node}/{s}"))
                continue
            layout = ki % 3
            if layout == 0:
                pair = ki // 3 // 2  # two train nodes in a row run the same job, seeded alike
                self._slot(node, list(range(base, base + self.gpus)), "train",
                           random.Random(f"{self.seed}/train/{pair}"), rank=(ki // 3) % 2)
            elif layout == 1 and self.gpus >= 2:
                half = self.gpus // 2
                for s, gs in enumerate((range(base, base + half), range(base + half, base + self.gpus))):
                    self._slot(node, list(gs), "job", random.Random(f"{self.seed}/{node}/{s}"))
            else:
                for s in range(self.gpus):
                    kind = "notebook" if s % 4 == 3 else "deploy"
                    self._slot(node, [base + s], kind, random.Random(f"{self.seed}/{node}/{s}"))
            ki += 1
        for node, at, length in down:
            gs = slice(node * self.gpus, (node + 1) * self.gpus)
            self.scraped[gs, at:at + length] = False
            self.powered[gs, at:at + length] = False
            if at + length < self.steps:
                self.resets += [(g, at + length) for g in range(gs.start, gs.stop)]
        for node, at, length in gap:
            # where no GPU of the node changes hands during the gap: whose the energy counted in it was is
            # then known (the data cannot tell it otherwise: the counter's jump shows on the next scrape)
            rows = self.seg_of[node * self.gpus:(node + 1) * self.gpus]
            while at + length < self.steps and (rows[:, at - 1:at + length + 1] != rows[:, at - 1:at]).any():
                at += 1
            self.scraped[node * self.gpus:(node + 1) * self.gpus, at:at + length] = False
        self._label_sets()

    def _slot(self, node: int, gpus: list[int], kind: str, rng: random.Random, rank: int = 0) -> None:
        t = -rng.randrange(0, self._hours(rng, *HOURS[kind]))  # the first holder started before the data
        ns = rng.choice(TEAMS)
        k8s = self.k8s[node]
        while t < self.steps:
            held = self._hours(rng, *HOURS[kind])
            profile = rng.choices(list(MIXES[kind]), weights=list(MIXES[kind].values()))[0]
            noproc = k8s and rng.random() < 0.1
            tag = f"{rng.getrandbits(40):010x}"
            common: dict[str, Any] = {"profile": FREE if noproc else profile}
            if kind == "slurm":
                job = str(100_000 + rng.getrandbits(20))
                common.update(workload=f"slurm/{job}", slurm_job=job, user=rng.choice(USERS))
            elif kind == "deploy" and not noproc and rng.random() < 0.05:  # someone's process outside Kubernetes
                common.update(user="admin", state=STATE["in_use_outside_kubernetes"])
            else:
                if kind == "train":
                    owner = f"{ns}-pretrain-{tag[:5]}"
                    pod = f"{owner}-{'master' if rank == 0 else 'worker'}-0"
                elif kind == "job":
                    owner = f"{ns}-finetune-{tag[:5]}"
                    pod = f"{owner}-{tag[5:10]}"
                elif kind == "notebook":
                    who = rng.choice(USERS)
                    owner, ns = f"jupyter-{who}", "notebooks"
                    pod = f"{owner}-0"
                else:
                    owner = f"{ns}-serve-{tag[:4]}"
                    pod = f"{owner}-{tag[4:9]}f-{tag[:5]}"
                common.update(namespace=ns, pod=pod, container="main", user="root",
                              state=STATE["allocated_idle" if noproc else "in_use_by_pod"])
                if not noproc:
                    common["workload"] = f"k8s/{ns}/{owner}"
            for g in gpus:
                seg = Seg(g, max(t, 0), min(t + held, self.steps), **common)
                if seg.profile != FREE or kind == "slurm" or seg.state == STATE["in_use_outside_kubernetes"]:
                    seg.pid = "" if noproc else str(rng.randrange(1000, 4_000_000))
                if seg.t1 > seg.t0:
                    self._add(seg)
            t += held
            free = self._hours(rng, 0, 3) if rng.random() < 0.7 else 0
            if free and t < self.steps:
                for g in gpus:
                    seg = Seg(g, max(t, 0), min(t + free, self.steps), state=STATE["unallocated"] if k8s else NO_STATE)
                    if seg.t1 > seg.t0:
                        self._add(seg)
                t += free

    def _add(self, seg: Seg) -> None:
        self.seg_of[seg.gpu, seg.t0:seg.t1] = len(self.segs)
        self.segs.append(seg)

    def _label_sets(self) -> None:
        owner = np.array([s.gpu for s in self.segs])
        if (owner[self.seg_of] != np.arange(len(self.seg_of))[:, None]).any():
            raise AssertionError("a GPU step with no segment of its own")
        keys: dict[tuple[str, ...], int] = {}
        for s in self.segs:
            s.series = keys.setdefault((str(s.gpu), s.namespace, s.pod, s.container, s.workload), len(keys))
        self.series_count = len(keys)

    # ---- labels ----
    def node_of(self, g: int) -> int:
        return g // self.gpus

    def gpu_labels(self, s: Seg) -> str:
        """The GPU's own series' labels, in the agent's order (gpu, uuid, model, hostname, the pod's)."""
        node = self.node_of(s.gpu)
        out = (f'gpu="{s.gpu % self.gpus}",uuid="{self.uuid[s.gpu]}",model="{self.model[node]}",'
               f'hostname="{self.hostname[node]}"')
        if s.pod:
            out += f',namespace="{s.namespace}",pod="{s.pod}",container="{s.container}"'
        if s.workload:
            out += f',workload="{s.workload}"'
        return out

    def process_labels(self, s: Seg) -> str:
        node = self.node_of(s.gpu)
        out = (f'gpu="{s.gpu % self.gpus}",uuid="{self.uuid[s.gpu]}",model="{self.model[node]}",'
               f'hostname="{self.hostname[node]}",pid="{s.pid}",process="python",user="{s.user}"')
        if s.pod:
            out += f',pod="{s.pod}",namespace="{s.namespace}",container="{s.container}"'
        if s.slurm_job:
            out += f',slurm_job="{s.slurm_job}"'
        if s.workload:
            out += f',workload="{s.workload}"'
        return out

    def group(self, s: Seg, dim: str) -> str:
        """The group a segment's time belongs to under --by dim ('(none)' when it belongs to none)."""
        v = {"namespace": s.namespace, "pod": f"{s.namespace}/{s.pod}" if s.pod else "", "job": s.workload, "user": s.user if s.pid else "",
             "node": self.hostname[self.node_of(s.gpu)], "model": self.model[self.node_of(s.gpu)]}[dim]
        return v or NONE

    def allocated(self, s: Seg) -> bool:
        """Someone holds the GPU: a pod or a process outside Kubernetes (on Kubernetes), a process elsewhere."""
        if s.state != NO_STATE:
            return s.state != STATE["unallocated"]
        return bool(s.pid)


@dataclass
class Chunk:
    """The values of every GPU over one block's steps [k0, k1)."""

    k0: int
    k1: int
    sm: np.ndarray
    power: np.ndarray
    mem: np.ndarray  # bytes
    energy: np.ndarray  # counter, joules
    throttle: np.ndarray  # (gpu, reason, step) counter, seconds
    bits: np.ndarray  # (gpu, reason, step) the reason held during the step


class Values:
    """Draws each GPU's values block by block, carrying its counters across blocks."""

    def __init__(self, fleet: Fleet) -> None:
        self.f = fleet
        n = fleet.nodes * fleet.gpus
        rng = np.random.default_rng(fleet.seed)
        self.energy = rng.uniform(1e8, 1e10, n).round(1)  # joules since the driver loaded
        self.throttle = np.zeros((n, len(REASONS)))
        self.prof_of_seg = np.array([_P[s.profile] for s in fleet.segs], dtype=np.int32)
        self.mem_total = np.array([MODELS[fleet.model[fleet.node_of(g)]] for g in range(n)], dtype=np.float64)

    def chunk(self, k0: int, k1: int) -> Chunk:
        f, st = self.f, float(self.f.step_s)
        rng = np.random.default_rng([f.seed, k0])
        prof = self.prof_of_seg[f.seg_of[:, k0:k1]]
        shape = prof.shape
        sm = PROF["sm"][prof] / 100 * (1 + 0.03 * rng.standard_normal(shape))
        power = PROF["power"][prof] * (1 + 0.02 * rng.standard_normal(shape))
        starved = prof == _P["input_starved"]
        burst = starved & (rng.random(shape) < 0.08)
        sm = np.where(starved, np.where(burst, 0.80, 0.002), sm)
        power = np.where(starved, np.where(burst, 450.0, 130.0), power)
        sm = np.clip(sm, 0.0, 1.0).round(4)
        power = np.clip(power, 60.0, 700.0).round(1)
        mem = ((PROF["mem_mib"][prof] + 520) * MIB).round(0)
        on = f.powered[:, k0:k1]
        mask = np.where(starved, 0, PROF["mask"][prof])
        bits = np.stack([(mask & b) != 0 for b in _BITS], axis=1) & on[:, None, :]
        energy = self.energy[:, None] + np.cumsum(power * st * on, axis=1)
        throttle = self.throttle[:, :, None] + np.cumsum(bits * st, axis=2)
        for g, k in f.resets:  # the node came back: the driver and the agent start counting from 0
            if k0 <= k < k1:
                j = k - k0
                energy[g, j:] -= energy[g, j] - power[g, j] * st
                throttle[g, :, j:] -= (throttle[g, :, j] - bits[g, :, j] * st)[:, None]
        energy = energy.round(1)
        self.energy = energy[:, -1].copy()
        self.throttle = throttle[:, :, -1].copy()
        return Chunk(k0, k1, sm, power, mem, energy, throttle, bits)


class Truth:
    """Per segment sums over the steps inside [start, end), grouped per --by dimension at the end."""

    def __init__(self, fleet: Fleet) -> None:
        self.f = fleet
        m = len(fleet.segs)
        self.observed = np.zeros(m)
        self.used = np.zeros(m)
        self.allocated = np.zeros(m)
        self.outside = np.zeros(m)
        self.idle = np.zeros(m)
        self.energy = np.zeros(m)
        self.throttle = np.zeros((len(REASONS), m))
        self.verdict = np.zeros((len(VERDICTS), m))
        self.mem_ratio_max = np.zeros(m)
        self.alloc_seg = np.array([fleet.allocated(s) for s in fleet.segs])
        self.outside_seg = np.array([s.state == STATE["in_use_outside_kubernetes"] for s in fleet.segs])
        self.verdict_of_seg = np.array([VERDICTS.index(s.profile) if s.profile != FREE else 0
                                        for s in fleet.segs], dtype=np.int64)

    def add(self, c: Chunk, mem_total: np.ndarray) -> None:
        f, st = self.f, float(self.f.step_s)
        lo = max(c.k0, f.window0)
        if lo >= c.k1:
            return
        j = lo - c.k0
        seg = f.seg_of[:, lo:c.k1].ravel()
        obs = f.scraped[:, lo:c.k1].ravel()
        sm = c.sm[:, j:].ravel()
        m = len(f.segs)
        alloc = self.alloc_seg[seg] & obs

        def bc(w: np.ndarray) -> np.ndarray:
            return np.bincount(seg, weights=w, minlength=m)

        self.observed += bc(obs * st)
        self.used += bc(obs * sm * st)
        self.allocated += bc(alloc * st)
        self.outside += bc((self.outside_seg[seg] & obs) * st)
        self.idle += bc((alloc & (sm < SM_IDLE)) * st)
        self.energy += bc((c.power[:, j:] * f.powered[:, lo:c.k1]).ravel() * st)
        for r in range(len(REASONS)):
            self.throttle[r] += bc(c.bits[:, r, j:].ravel() * st)
        v = self.verdict_of_seg[seg]
        for i in range(len(VERDICTS)):
            self.verdict[i] += bc(((v == i) & obs) * st)
        ratio = np.where(obs, (c.mem / mem_total[:, None])[:, j:].ravel(), 0.0)
        np.maximum.at(self.mem_ratio_max, seg, ratio)

    def groups(self, dim: str) -> dict[str, dict[str, Any]]:
        """Per group of `dim`: hours observed/allocated/used/idle, kWh, throttled hours by reason."""
        out: dict[str, dict[str, Any]] = {}
        for i, s in enumerate(self.f.segs):
            if not self.observed[i] and not self.energy[i]:
                continue
            g = out.setdefault(self.f.group(s, dim), _empty())
            g["observed_gpu_hours"] += self.observed[i] / 3600
            g["allocated_gpu_hours"] += self.allocated[i] / 3600
            g["outside_kubernetes_gpu_hours"] += self.outside[i] / 3600
            g["used_gpu_hours"] += self.used[i] / 3600
            g["idle_gpu_hours"] += self.idle[i] / 3600
            g["energy_kwh"] += self.energy[i] / 3.6e6
            for r, name in enumerate(REASONS):
                g["throttled_hours_by_reason"][name] += self.throttle[r, i] / 3600
            g["throttled_hours"] += self.throttle[:, i].sum() / 3600
            for v, name in enumerate(VERDICTS):
                g["verdict_hours"][name] += self.verdict[v, i] / 3600
            g["memory_used_ratio_max"] = max(g["memory_used_ratio_max"], self.mem_ratio_max[i])
        return out


def _empty() -> dict[str, Any]:
    return {"observed_gpu_hours": 0.0, "allocated_gpu_hours": 0.0, "outside_kubernetes_gpu_hours": 0.0,
            "used_gpu_hours": 0.0, "idle_gpu_hours": 0.0, "energy_kwh": 0.0, "throttled_hours": 0.0,
            "throttled_hours_by_reason": dict.fromkeys(REASONS, 0.0),
            "verdict_hours": dict.fromkeys(VERDICTS, 0.0), "memory_used_ratio_max": 0.0}


# ---- OpenMetrics text ----
def _ts(fleet: Fleet, k0: int, k1: int, rng: np.random.Generator) -> list[list[str]]:
    """Per node, the scrape time stamps of steps k0..k1 (seconds, ms resolution) as text."""
    base = fleet.t0_s + np.arange(k0, k1) * fleet.step_s
    out = []
    for node in range(fleet.nodes):
        t = base + fleet.offset_s[node] + rng.uniform(-0.003, 0.003, k1 - k0)
        out.append([f"{x:.3f}" for x in t])
    return out


def write_block(fleet: Fleet, c: Chunk, mem_total: np.ndarray, out: TextIO, families: set[str]) -> int:
    """One block's samples as OpenMetrics text (each family's samples together, as the format asks);
    returns the number of samples written."""
    f = fleet
    ts = _ts(f, c.k0, c.k1, np.random.default_rng([f.seed, c.k0, 1]))
    seg_of, scraped = f.seg_of[:, c.k0:c.k1], f.scraped[:, c.k0:c.k1]
    n = f.nodes * f.gpus
    # per GPU: (segment, its step positions inside the block) for each GPU label set seen in this block
    # and each segment's own positions (a free GPU and one running a process outside Kubernetes share a set)
    runs: list[list[tuple[Seg, np.ndarray]]] = []
    parts: list[list[tuple[Seg, np.ndarray]]] = []
    for g in range(n):
        by_series: dict[int, tuple[Seg, list[np.ndarray]]] = {}
        row = seg_of[g]
        parts.append([])
        for si in np.unique(row):
            s = f.segs[si]
            pos = np.flatnonzero((row == si) & scraped[g])
            if len(pos):
                by_series.setdefault(s.series, (s, []))[1].append(pos)
                parts[g].append((s, pos))
        runs.append([(s, np.sort(np.concatenate(ps))) for s, ps in by_series.values()])
    written = 0
    write = out.write

    def emit(prefix: str, node: int, pos: np.ndarray, vals: Any) -> None:
        nonlocal written
        t = ts[node]
        vl = vals.tolist() if isinstance(vals, np.ndarray) else [vals] * len(pos)
        write("".join([f"{prefix}{v} {t[p]}\n" for p, v in zip(pos.tolist(), vl, strict=True)]))
        written += len(pos)

    def gauge(name: str, arr: np.ndarray | None, const: np.ndarray | None = None, kind: str = "gauge") -> None:
        if name not in families:
            return
        fam = name[:-6] if kind == "counter" else name
        write(f"# TYPE {fam} {kind}\n")
        for g in range(n):
            node = f.node_of(g)
            for s, pos in runs[g]:
                vals = arr[g, pos] if arr is not None else float(const[g])  # type: ignore[index]
                emit(f"{name}{{{f.gpu_labels(s)}}} ", node, pos, vals)

    gauge("gpu_sm_active_ratio", c.sm)
    gauge("gpu_power_watts", c.power)
    gauge("gpu_memory_used_bytes", c.mem)
    gauge("gpu_memory_total_bytes", None, mem_total)
    gauge("gpu_energy_joules_total", c.energy, kind="counter")
    if "gpu_throttle_seconds_total" in families:
        write("# TYPE gpu_throttle_seconds counter\n")
        for g in range(n):
            node = f.node_of(g)
            for s, pos in runs[g]:
                labels = f.gpu_labels(s)
                for r, reason in enumerate(REASONS):
                    emit(f'gpu_throttle_seconds_total{{{labels},reason="{reason}"}} ', node, pos, c.throttle[g, r, pos])
    if "gpu_allocation_state" in families:
        write("# TYPE gpu_allocation_state gauge\n")
        for g in range(n):
            node = f.node_of(g)
            if not f.k8s[node]:
                continue
            for s, pos in runs[g]:
                labels = f.gpu_labels(s)
                states = np.array([f.segs[k].state for k in seg_of[g, pos]])
                for i, state in enumerate(ALLOCATION_STATES):
                    emit(f'gpu_allocation_state{{{labels},state="{state}"}} ', node, pos, (states == i) * 1)
    if "gpu_info" in families:
        write("# TYPE gpu_info gauge\n")
        for g in range(n):
            for s, pos in runs[g]:
                info = (f',driver="570.124.06",cuda="12.8",pci_bus_id="00000000:{0x18 + 0x10 * (g % f.gpus):02X}:00.0",'
                        f'architecture="hopper",compute_capability="9.0",mig="false"')
                emit(f"gpu_info{{{f.gpu_labels(s)}{info}}} ", f.node_of(g), pos, 1)
    if "gpu_verdict" in families:
        write("# TYPE gpu_verdict gauge\n")
        for g in range(n):
            node = f.node_of(g)
            kinds: dict[str, list[np.ndarray]] = {}
            for s, pos in parts[g]:
                kinds.setdefault(VERDICTS[VERDICTS.index(s.profile) if s.profile != FREE else 0], []).append(pos)
            for kind, ps in sorted(kinds.items()):
                pos = np.sort(np.concatenate(ps))
                for w in ("30s", "2m"):
                    emit(f'gpu_verdict{{gpu="{g % f.gpus}",kind="{kind}",window="{w}",hostname="{f.hostname[node]}"}} ',
                         node, pos, 0.9)
    proc = [("gpu_process_memory_used_bytes", lambda g, pos: c.mem[g, pos] - 520 * MIB)]
    for name, value in proc:
        if name not in families:
            continue
        write(f"# TYPE {name} gauge\n")
        for g in range(n):
            node = f.node_of(g)
            for s, pos in parts[g]:
                if s.pid:
                    emit(f"{name}{{{f.process_labels(s)}}} ", node, pos, value(g, pos))
    return written


#: What the fleet report reads (src/gpuscope/fleet/_queries.py: REQUIRED_METRICS, OPTIONAL_METRICS).
ALL_FAMILIES = frozenset({"gpu_sm_active_ratio", "gpu_power_watts", "gpu_memory_used_bytes", "gpu_memory_total_bytes",
                          "gpu_energy_joules_total", "gpu_throttle_seconds_total", "gpu_allocation_state",
                          "gpu_info", "gpu_verdict", "gpu_process_memory_used_bytes"})


def blocks(fleet: Fleet) -> Iterator[tuple[int, int]]:
    """Step ranges [k0, k1) of each 2 h block of the data, oldest first."""
    per = BLOCK_S // fleet.step_s
    for k0 in range(0, fleet.steps, per):
        yield k0, min(k0 + per, fleet.steps)
