"""Cross-node stragglers: in a job whose GPUs span nodes (or several GPUs of one), the GPU that is slower than
its peers, and why: throttled, its link, its host's CPU, or its input.

    stragglers = find_stragglers(query, start_s, end_s)   # query(promql, at_s) -> [(labels, value), ...]
    for s in stragglers:
        print(s.workload, s.node, s.gpu, s.cause, s.evidence, s.fix)

A job is the agents' `workload` label (slurm/<id>, torchrun/<run id>, k8s/<namespace>/<owner>), which a GPU's
own series carry while that one job runs on it; a GPU shared by two jobs is no one job's and is left out.
Every figure is one instant query at `end_s` that aggregates over [start_s, end_s] on the server
(avg_over_time, rate, max_over_time), grouped by (workload, hostname, gpu): no raw points leave the server,
and counters (throttle seconds, bytes) count every agent tick, not only the scraped ones.

What tells the slow GPU apart. In a synchronous job (data parallel: every step ends in an all-reduce) every
GPU runs at the slowest one's pace, and the others *wait* for it, inside a collective kernel. So SM activity
points the wrong way: a GPU that computes slowly (throttled, lower clock) is the *busiest* of the job, and its
waiting peers look under-used. What the slow one has that its peers do not is checked first, each against the
median of its peers (a healthy job shares a cause, so only a difference names a straggler):

1. throttled: a slowdown reason (thermal, hardware slowdown, power brake, power cap, ...) held a share of the
   time at least `throttle_share` more than its peers' median, with its SM clock against theirs; or its SM
   clock `straggler_clock_drop` below theirs with no reason reported (a lower clock limit set on it);
2. host CPU: its process's busiest thread saturated (`thread_saturated`) or its node's CPU saturated
   (`host_cpu_saturated`) while its peers' are not;
3. input: fully idle (NVML's gpu_idle: no kernel at all) at least `gap_share` of the time while its peers'
   are not: a GPU waiting in a collective runs a kernel, one waiting for its data runs none;
4. link: its PCIe link trained at a lower generation or width than its peers' (the most it reached), PCIe
   replays where its peers have none, or its NVLink or PCIe rate under `straggler_link_ratio` of its
   peers' where theirs matters (`pcie_busy_bytes_per_s`): its traffic takes another path.

Of an even number of peers the median taken is the middle one on the side that names no one (a healthy GPU
is not "below its peers" because one of them, the straggler, is far above), so a cause that half the job or
more shares is the job's, not one straggler's (the agents' own verdicts name it on every GPU).

Only when no GPU of the job shows any of these is SM activity asked (`diagnose.rules.imbalanced`, the node's
imbalance verdict's rule, across nodes): the least busy GPU then does less work (a smaller shard, uneven
work), cause `imbalance`. In a job whose ranks do not synchronise, SM activity alone would name the slow one;
in a synchronous one it names a waiting peer, which is why it comes last.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..diagnose.rules import ADVICE, imbalanced
from ..diagnose.thresholds import DEFAULT, Thresholds
from ..errors import UsageError
from ..promql import duration, label_matcher, regex_alternation, selector

__all__ = ["CAUSES", "Query", "Straggler", "find_stragglers"]

#: query(promql, at_s) -> [(labels, value), ...]: one PromQL instant query at `at_s` (unix seconds).
Query = Callable[[str, float], list[tuple[dict[str, str], float]]]

CAUSES = ("throttled", "host_cpu", "input", "link", "imbalance")
_BY = "workload, hostname, gpu"
# Reasons that say nothing of a working GPU's speed: idle (counted as input), boost sync, the display's clock.
_NOT_SLOWDOWN = frozenset({"gpu_idle", "sync_boost", "display_clock"})
_POWER = frozenset({"sw_power_cap", "board_limit"})

_FIX = {
    "throttled": ADVICE["throttled"][0],
    "power": "Its clocks are held at its power limit while its peers' are not: compare its power limit with "
             "theirs (nvidia-smi -q -d POWER) and check its power supply and cooling.",
    "applications_clocks": "Its application clocks are set lower than its peers': reset them (nvidia-smi -rac) "
                           "or set the same on every GPU of the job.",
    "clock": "Its SM clock runs below its peers' with no throttle reason: compare its clock limits "
             "(nvidia-smi -q -d CLOCK; nvidia-smi -rgc resets locked clocks) and its power limit with theirs.",
    "host_cpu": "Its host's CPU holds the job back: give this rank more DataLoader workers or CPU cores (its CPU "
                "request, the cores of its GPU's NUMA node), move other work off the node, and keep data "
                "preparation off the process's main thread (`gpuscope diagnose` on that node says what it does).",
    "input": ADVICE["input_starved"][0] + " Compare this rank's data shard and storage path with its peers'.",
    "link": "Its link is slower than its peers': compare PCIe generation and width (nvidia-smi -q -d PCIE) and "
            "NVLink state (nvidia-smi nvlink -s) with a peer's, drain and reseat a GPU that counts replays, and "
            "see the path NCCL takes (NCCL_DEBUG=INFO).",
    "imbalance": ADVICE["imbalance"][0],
}


@dataclass(frozen=True)
class Straggler:
    """One GPU of a job slower than its peers. `values` holds the figures the evidence quotes, in base units
    (ratios 0..1, hertz, bytes per second)."""

    workload: str
    node: str  # the `hostname` label
    gpu: str
    cause: str  # one of CAUSES
    evidence: str  # one line, with the numbers
    fix: str  # one line
    values: dict[str, float] = field(default_factory=dict, compare=False)


@dataclass
class _Gpu:
    """What the server says of one GPU while it ran one job, over the range."""

    workload: str
    node: str
    gpu: str
    samples: float = 0.0
    sm_active: float | None = None
    sm_clock_hz: float | None = None
    throttle: dict[str, float] = field(default_factory=dict)  # reason -> share of the time (rate of seconds)
    pcie_bytes_per_s: float | None = None
    nvlink_bytes_per_s: float | None = None
    pcie_replays: float | None = None
    pcie_generation: float | None = None
    pcie_width: float | None = None
    thread_cpu: float | None = None  # the busiest thread of its busiest process, 0..1 of a core
    host_cpu: float | None = None  # its node's CPU, 0..1 of all cores

    @property
    def idle(self) -> float:
        return self.throttle.get("gpu_idle", 0.0)

    @property
    def name(self) -> str:
        return f"GPU {self.gpu} of {self.node or '(no hostname)'}"


def _queries(rng: str, matchers: list[str]) -> dict[str, str]:
    """Every figure's PromQL: one instant query each, aggregated over `rng` on the server."""

    def sel(metric: str, *extra: str) -> str:
        return selector(metric, [*matchers, *extra])

    return {
        "samples": f"max by ({_BY}) (count_over_time({sel('gpu_sm_clock_hertz')}[{rng}]))",
        "sm_clock_hz": f"avg by ({_BY}) (avg_over_time({sel('gpu_sm_clock_hertz')}[{rng}]))",
        "sm_active": f"avg by ({_BY}) (avg_over_time({sel('gpu_sm_active_ratio')}[{rng}]))",
        "throttle": f"sum by ({_BY}, reason) (rate({sel('gpu_throttle_seconds_total')}[{rng}]))",
        # one rate per metric, summed after: rate() drops the name, and rx and tx would then be one label set
        "pcie_bytes_per_s": _both(f"rate({sel('gpu_pcie_rx_bytes_total')}[{rng}])",
                                  f"rate({sel('gpu_pcie_tx_bytes_total')}[{rng}])"),
        "nvlink_bytes_per_s": _both(f"rate({sel('gpu_nvlink_rx_bytes_total')}[{rng}])",
                                    f"rate({sel('gpu_nvlink_tx_bytes_total')}[{rng}])"),
        "pcie_replays": f"sum by ({_BY}) (increase({sel('gpu_pcie_replay_errors_total')}[{rng}]))",
        # the most the link reached: an idle GPU's link steps down to save power, a degraded one never comes up
        "pcie_generation": f"max by ({_BY}) (max_over_time({sel('gpu_pcie_link_generation')}[{rng}]))",
        "pcie_width": f"max by ({_BY}) (max_over_time({sel('gpu_pcie_link_width')}[{rng}]))",
        "thread_cpu": f"max by ({_BY}) (avg_over_time({sel('process_thread_cpu_max_ratio')}[{rng}]))",
        # the node's own series carry no workload: joined by hostname here
        "host_cpu": f"avg by (hostname) (avg_over_time(host_cpu_ratio[{rng}]))",
    }


def _both(a: str, b: str) -> str:
    return f"sum by ({_BY}) ({a}) + sum by ({_BY}) ({b})"


def _finite(v: float) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)


#: At most this many jobs are named in the figures' selectors (more: the selectors stay as they were).
_NARROW_JOBS = 200


def _collect(query: Query, at_s: float, rng: str, matchers: list[str], min_samples: float = 0.0) -> list[_Gpu]:
    """Every GPU's figures under each job. Its samples come first: the other figures are asked only of the
    jobs with two GPUs or more of `min_samples` (none: no other query; each reads its metric's whole range)."""
    gpus: dict[tuple[str, str, str], _Gpu] = {}
    hosts: dict[str, float] = {}
    queries = _queries(rng, matchers)
    for labels, value in query(queries.pop("samples"), at_s):
        key = (labels.get("workload", ""), labels.get("hostname", ""), labels.get("gpu", ""))
        if key[0] and _finite(value):
            gpus[key] = _Gpu(*key, samples=float(value))
    per_job: dict[str, int] = {}
    for g in gpus.values():
        if g.samples >= min_samples:
            per_job[g.workload] = per_job.get(g.workload, 0) + 1
    wanted = sorted(job for job, n in per_job.items() if n >= 2)
    if not wanted:
        return list(gpus.values())
    if len(wanted) < len({k[0] for k in gpus}) and len(wanted) <= _NARROW_JOBS:
        narrowed = [m for m in matchers if not m.startswith("workload")]
        queries = _queries(rng, [*narrowed, label_matcher("workload", regex_alternation(wanted), "=~")])
        queries.pop("samples")
    # a few at once: each reads its metric's whole range on the server, which runs them side by side
    with ThreadPoolExecutor(4) as pool:
        answers = {what: pool.submit(query, promql, at_s) for what, promql in queries.items()}
    for what, fut in answers.items():
        for labels, value in fut.result():
            if not _finite(value):
                continue
            if what == "host_cpu":
                hosts[labels.get("hostname", "")] = float(value)
                continue
            key = (labels.get("workload", ""), labels.get("hostname", ""), labels.get("gpu", ""))
            g = gpus.get(key)
            if g is None:
                continue  # a GPU without samples was not observed under this job
            if what == "throttle":
                g.throttle[labels.get("reason", "")] = float(value)
            else:
                setattr(g, what, float(value))
    for g in gpus.values():
        g.host_cpu = hosts.get(g.node)
    return list(gpus.values())


def _low(values: Iterable[float | None]) -> float | None:
    """The peers' median for a check that names a GPU *below* its peers: of an even count the lower middle one,
    so that one peer far above the rest (the straggler itself, among a healthy GPU's peers) does not make a
    healthy GPU look low."""
    xs = [v for v in values if v is not None]
    return statistics.median_low(xs) if xs else None


def _high(values: Iterable[float | None]) -> float | None:
    """The peers' median for a check that names a GPU *above* its peers: of an even count the upper middle one."""
    xs = [v for v in values if v is not None]
    return statistics.median_high(xs) if xs else None


def _pct(x: float) -> str:
    return f"{x * 100:.0f} %"


def _mhz(hz: float | None) -> str:
    return "?" if hz is None else f"{hz / 1e6:.0f} MHz"


def _gbs(bps: float) -> str:
    return f"{bps / 1e9:.2f} GB/s"


def _clock_note(g: _Gpu, peers: list[_Gpu]) -> tuple[str, dict[str, float]]:
    peer = _low(p.sm_clock_hz for p in peers)
    if g.sm_clock_hz is None or not peer:
        return "", {}
    drop = 1 - g.sm_clock_hz / peer
    return (f"; SM clock {_mhz(g.sm_clock_hz)}, {_pct(drop)} below its peers' median {_mhz(peer)}" if drop > 0
            else f"; SM clock {_mhz(g.sm_clock_hz)} (its peers' median {_mhz(peer)})",
            {"sm_clock_hz": g.sm_clock_hz, "peer_sm_clock_hz": peer, "clock_drop": drop})


def _throttled(g: _Gpu, peers: list[_Gpu], th: Thresholds) -> tuple[str, str, dict[str, float]] | None:
    """Slowdown reasons it holds `throttle_share` more of the time than its peers' median."""
    reasons = {r for r in g.throttle if r and r not in _NOT_SLOWDOWN}
    more = {}
    for r in reasons:
        peer = _high(p.throttle.get(r, 0.0) for p in peers) or 0.0
        share = min(1.0, g.throttle[r])
        if share >= th.throttle_share and share - peer >= th.throttle_share:
            more[r] = (share, peer)
    if more:
        top = max(more, key=lambda r: (more[r][0] - more[r][1], r))
        share, peer = more[top]
        names = ", ".join(sorted(more))
        note, values = _clock_note(g, peers)
        fix = (_FIX["power"] if top in _POWER else _FIX["applications_clocks"] if top == "applications_clocks"
               else _FIX["throttled"])
        return (f"{g.name} is throttled by {names} {_pct(share)} of the time (its peers' median {_pct(peer)})"
                f"{note}.", fix, {"throttle_share": share, "peer_throttle_share": peer, **values})
    peer_clock = _low(p.sm_clock_hz for p in peers)
    if (g.sm_clock_hz is not None and peer_clock and g.idle < th.gap_share
            and g.sm_clock_hz <= (1 - th.straggler_clock_drop) * peer_clock):
        note, values = _clock_note(g, peers)
        return (f"{g.name} runs at a lower clock than its peers with no throttle reason reported{note}.",
                _FIX["clock"], values)
    return None


def _host_cpu(g: _Gpu, peers: list[_Gpu], th: Thresholds) -> tuple[str, str, dict[str, float]] | None:
    peer_thread = _high(p.thread_cpu for p in peers)
    if (g.thread_cpu is not None and g.thread_cpu >= th.thread_saturated and peer_thread is not None
            and peer_thread < th.thread_saturated):
        return (f"{g.name}: its process's busiest thread runs at {_pct(g.thread_cpu)} of a core (its peers' "
                f"median {_pct(peer_thread)}): the host side (data loading, launches) sets the pace.",
                _FIX["host_cpu"], {"thread_cpu": g.thread_cpu, "peer_thread_cpu": peer_thread})
    peer_host = _high(p.host_cpu for p in peers)
    if (g.host_cpu is not None and g.host_cpu >= th.host_cpu_saturated and peer_host is not None
            and peer_host < th.host_cpu_saturated):
        return (f"{g.name}: its node's CPU is {_pct(g.host_cpu)} busy (its peers' nodes' median "
                f"{_pct(peer_host)}).", _FIX["host_cpu"], {"host_cpu": g.host_cpu, "peer_host_cpu": peer_host})
    return None


def _input(g: _Gpu, peers: list[_Gpu], th: Thresholds) -> tuple[str, str, dict[str, float]] | None:
    peer = _high(p.idle for p in peers) or 0.0
    if g.idle >= th.gap_share and peer < th.gap_share:
        sm = f", SMs {_pct(g.sm_active)} busy overall" if g.sm_active is not None else ""
        peer_sm = _high(p.sm_active for p in peers)
        peer_sm_s = f", SMs {_pct(peer_sm)} busy" if peer_sm is not None else ""
        return (f"{g.name} runs no kernel at all {_pct(g.idle)} of the time{sm} (its peers' median: "
                f"{_pct(peer)} idle{peer_sm_s}): it waits for its input while they run.", _FIX["input"],
                {"idle_share": g.idle, "peer_idle_share": peer,
                 **({"sm_active": g.sm_active} if g.sm_active is not None else {}),
                 **({"peer_sm_active": peer_sm} if peer_sm is not None else {})})
    return None


def _link(g: _Gpu, peers: list[_Gpu], th: Thresholds) -> tuple[str, str, dict[str, float]] | None:
    for what, unit in (("pcie_generation", "generation"), ("pcie_width", "width")):
        mine, peer = getattr(g, what), _low(getattr(p, what) for p in peers)
        if mine is not None and peer is not None and mine < peer:
            shown = f"Gen{mine:.0f}" if unit == "generation" else f"x{mine:.0f}"
            peer_shown = f"Gen{peer:.0f}" if unit == "generation" else f"x{peer:.0f}"
            return (f"{g.name}: its PCIe link came up at {shown} at most, its peers' at {peer_shown}.",
                    _FIX["link"], {what: mine, f"peer_{what}": peer})
    peer_replays = _high(p.pcie_replays for p in peers)
    if g.pcie_replays and g.pcie_replays > 0 and peer_replays == 0:
        return (f"{g.name} counted {g.pcie_replays:.0f} PCIe replays (its peers none): its link retransmits.",
                _FIX["link"], {"pcie_replays": g.pcie_replays})
    for what, name in (("nvlink_bytes_per_s", "NVLink"), ("pcie_bytes_per_s", "PCIe")):
        mine, peer = getattr(g, what), _low(getattr(p, what) for p in peers)
        if (mine is not None and peer is not None and peer >= th.pcie_busy_bytes_per_s
                and mine < th.straggler_link_ratio * peer):
            return (f"{g.name} moves {_gbs(mine)} over {name}, its peers' median {_gbs(peer)}: its traffic does "
                    "not take their path.", _FIX["link"], {what: mine, f"peer_{what}": peer})
    return None


_CHECKS = (("throttled", _throttled), ("host_cpu", _host_cpu), ("input", _input), ("link", _link))


def _job_stragglers(gpus: list[_Gpu], th: Thresholds) -> list[Straggler]:
    out = []
    for g in gpus:
        peers = [p for p in gpus if p is not g]
        for cause, check in _CHECKS:
            found = check(g, peers, th)
            if found is not None:
                evidence, fix, values = found
                out.append(Straggler(g.workload, g.node, g.gpu, cause, evidence, fix, values))
                break
    if out:
        return out
    # Nothing slows one GPU directly: the least busy one does less work (see the module's docstring).
    busy = {i: g.sm_active for i, g in enumerate(gpus) if g.sm_active is not None}
    pair = imbalanced(busy, th)
    if pair is None:
        return []
    (low, low_sm), (top, top_sm) = ((gpus[i], busy[i]) for i in pair)
    return [Straggler(low.workload, low.node, low.gpu, "imbalance",
                      f"{low.name} is {_pct(low_sm)} busy while {top.name} is {_pct(top_sm)}, with no throttling, "
                      "host CPU, idle-gap or link difference: it gets less work (a smaller shard, uneven batches).",
                      _FIX["imbalance"], {"sm_active": low_sm, "peer_sm_active": top_sm})]


def find_stragglers(query: Query, start_s: float, end_s: float, *, workloads: Iterable[str] | None = None,
                    thresholds: Thresholds = DEFAULT) -> list[Straggler]:
    """The GPUs slower than their job's other GPUs over [start_s, end_s] (unix seconds), with the cause, its
    evidence and the fix; [] when no job spans two GPUs or none of them is slower. `workloads` limits the
    answer to those jobs. A GPU needs `thresholds.min_samples` scrapes under its job to be compared.
    Sorted by workload, node, GPU. Raises UsageError for an empty range; whatever `query` raises passes."""
    if not (_finite(start_s) and _finite(end_s)) or end_s <= start_s:
        raise UsageError(f"The range to look for stragglers in is empty: it ends ({end_s:g}) where or before "
                         f"it starts ({start_s:g}).")
    matchers = [label_matcher("workload", "", "!=")]
    if workloads is not None:
        wanted = sorted(set(workloads))
        if not wanted:
            return []
        matchers = [label_matcher("workload", regex_alternation(wanted), "=~")]
    gpus = _collect(query, end_s, duration(end_s - start_s), matchers, thresholds.min_samples)
    jobs: dict[str, list[_Gpu]] = {}
    for g in gpus:
        if g.samples >= thresholds.min_samples:
            jobs.setdefault(g.workload, []).append(g)
    out: list[Straggler] = []
    for name in sorted(jobs):
        if len(jobs[name]) >= 2:
            out.extend(_job_stragglers(sorted(jobs[name], key=lambda g: (g.node, _gpu_order(g.gpu))), thresholds))
    return sorted(out, key=lambda s: (s.workload, s.node, _gpu_order(s.gpu)))


def _gpu_order(label: str) -> tuple[int, str]:
    head = label.split("/", 1)[0]
    return (int(head) if head.isdigit() else 1 << 30, label)
