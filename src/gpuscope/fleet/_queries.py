"""Every PromQL expression the fleet report sends, and the recording rules built from the same definitions.

The report never pulls raw points. Each figure is one instant query at the range's end whose window is the
whole range (`count_over_time(gpu_info[7d])`, `increase(gpu_energy_joules_total[7d])`, ...), aggregated on
the server by the labels of one GPU and of the group (`sum by (hostname, gpu, model, namespace) (...)`), so
the answer is a row per GPU and group whatever the range. Figures that join two series at each scrape (a
GPU idle *while* allocated; a user's share of a GPU) are subqueries over per-step expressions (`STEP`): the
same expressions the recording rules record, so a server that runs `gpuscope fleet rules` answers them from
the recorded series with a plain `sum_over_time` instead.

Per-step expressions read each series through `last_over_time(m[fresh])`, where `fresh` is 1.5 scrape steps:
a sample counts at an instant only when it is at most that old. A gap in scraping is then a gap in every
figure (never the last value carried over the server's 5-minute lookback, never a zero).

    >>> print(step_expr("observed", 22.5))
    last_over_time(gpu_info[22500ms])
    >>> w = Window(range_s=7 * 86400, resolution_s=15, fresh_s=22.5, step_s=2520)
    >>> print(instant_expr("energy", group_labels("namespace"), w))
    sum by (hostname, gpu, model, namespace) (increase(gpu_energy_joules_total[604799999ms]))
"""

from __future__ import annotations

from dataclasses import dataclass

from ..diagnose.thresholds import DEFAULT as THRESHOLDS
from ..promql import duration, quote, regex_alternation

__all__ = ["DIMENSIONS", "INSTANT", "RECORDED", "REQUIRED_METRICS", "STEP", "Window", "group_labels",
           "instant_expr", "plot_exprs", "stamps_expr", "recorded_expr", "rules_yaml", "step_expr", "steps_expr", "subquery_expr"]

#: --by: the labels that name a group. A GPU's own series carry all of them but `user`, which only the
#: per-process series carry (a GPU's time goes to its processes' users, split evenly among them).
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "namespace": ("namespace",), "pod": ("namespace", "pod"), "job": ("workload",), "user": ("user",),
    "node": ("hostname",), "model": ("model",),
}
#: What names one GPU in the fleet (gpu_verdict carries no more than these).
GPU = ("hostname", "gpu")
ALLOCATED_STATES = ("allocated_idle", "in_use_by_pod", "in_use_outside_kubernetes")
SM_IDLE = THRESHOLDS.sm_idle
#: Without these nothing can be reported; the rest only fill their own columns.
REQUIRED_METRICS = ("gpu_info", "gpu_sm_active_ratio")
OPTIONAL_METRICS = ("gpu_energy_joules_total", "gpu_throttle_seconds_total", "gpu_memory_used_bytes",
                    "gpu_memory_total_bytes", "gpu_verdict", "gpu_allocation_state", "gpu_process_memory_used_bytes",
                    "gpu_power_watts")
VERDICT_WINDOW = "2m"
#: The recorded series (`gpuscope fleet rules`) and the per-step expression each one records.
RECORDED = {
    "observed": "gpuscope:gpu_observed:bool",
    "allocated": "gpuscope:gpu_allocated:bool",
    "idle_allocated": "gpuscope:gpu_idle_allocated:bool",
    "user_share": "gpuscope:gpu_user_share:ratio",
    "user_sm_active": "gpuscope:gpu_user_sm_active:ratio",
    "user_idle": "gpuscope:gpu_user_idle_allocated:ratio",
}


@dataclass(frozen=True)
class Window:
    """The range (seconds, ending at the query's time), the subqueries' resolution, the freshness window of
    a sample (1.5 scrape steps), the step of the plots' range queries and the resolution of their
    subqueries; `allocation` says which series can tell who holds a GPU in this range ("both" where unknown,
    as in the recording rules; "kubernetes" or "processes" where the other is not there at all)."""

    range_s: float
    resolution_s: float
    fresh_s: float
    step_s: float
    plot_resolution_s: float | None = None
    allocation: str = "both"

    @property
    def window(self) -> str:
        """The range as a selector's window: 1 ms short, so that a sample exactly at the range's start (one
        scrape before the first of an N-step range) is not counted where a server's windows are closed at
        both ends (Prometheus 2)."""
        return duration(self.range_s - 0.001)


def group_labels(by: str) -> tuple[str, ...]:
    """The labels a raw query keeps: one GPU's, its model, and the group's (except `user`: see DIMENSIONS)."""
    extra = () if by == "user" else DIMENSIONS[by]
    return tuple(dict.fromkeys(("hostname", "gpu", "model", *extra)))


def _by(labels: tuple[str, ...]) -> str:
    return ", ".join(labels)


def _fresh(metric: str, fresh_s: float, matchers: str = "") -> str:
    return f"last_over_time({metric}{{{matchers}}}[{duration(fresh_s)}])" if matchers else \
        f"last_over_time({metric}[{duration(fresh_s)}])"


def allocated_expr(fresh_s: float, allocation: str = "both") -> str:
    """1 for each GPU (hostname, gpu) that someone holds now: on Kubernetes, a pod (allocated_idle,
    in_use_by_pod) or a process outside Kubernetes (in_use_outside_kubernetes); elsewhere (no
    gpu_allocation_state for the GPU), any process on it. `allocation`: "kubernetes" or "processes" drops
    the part whose series the range does not hold at all (the same answer, cheaper)."""
    states = f'state=~"{regex_alternation(ALLOCATED_STATES)}"'
    k8s = f"max by (hostname, gpu) ({_fresh('gpu_allocation_state', fresh_s, states)}) == 1"
    procs = f"group by (hostname, gpu) ({_fresh('gpu_process_memory_used_bytes', fresh_s)})"
    if allocation == "kubernetes":
        return f"({k8s})"
    if allocation == "processes":
        return f"({procs})"
    return f"(({k8s}) or on (hostname, gpu) ({procs} unless on (hostname, gpu) {_fresh('gpu_allocation_state', fresh_s)}))"


def _idle_expr(fresh_s: float, allocation: str = "both") -> str:
    sm = _fresh("gpu_sm_active_ratio", fresh_s)
    return f"((({sm} < bool {SM_IDLE:g}) == 1) and on (hostname, gpu) {allocated_expr(fresh_s, allocation)})"


def _user_share(fresh_s: float) -> str:
    procs = f"count by (hostname, gpu, model, user) ({_fresh('gpu_process_memory_used_bytes', fresh_s, 'pid!=' + quote('other'))})"
    return f"(({procs} > bool 0) / on (hostname, gpu) group_left () count by (hostname, gpu) ({procs}))"


def step_expr(name: str, fresh_s: float, allocation: str = "both") -> str:
    """The per-step expression `name` (a key of STEP): a series per GPU (or per GPU and user) whose value,
    summed over the steps of a range and multiplied by the step, is seconds."""
    if name == "observed":  # gpu_info is 1 while the GPU is scraped
        return _fresh("gpu_info", fresh_s)
    if name == "allocated":
        return f"({_fresh('gpu_info', fresh_s)} and on (hostname, gpu) {allocated_expr(fresh_s, allocation)})"
    if name == "idle_allocated":
        return _idle_expr(fresh_s, allocation)
    if name == "user_share":
        return _user_share(fresh_s)
    if name == "user_sm_active":
        sm = f"max by (hostname, gpu) ({_fresh('gpu_sm_active_ratio', fresh_s)})"
        return f"({_user_share(fresh_s)} * on (hostname, gpu) group_left () {sm})"
    if name == "user_idle":
        idle = f"max by (hostname, gpu) ({_idle_expr(fresh_s, allocation)})"
        return f"({_user_share(fresh_s)} * on (hostname, gpu) group_left () {idle})"
    raise KeyError(name)


STEP = tuple(RECORDED)


def subquery_expr(name: str, labels: tuple[str, ...], w: Window) -> str:
    """Step-sum of `name` over the range, by `labels` (raw series: a subquery at the resolution)."""
    return (f"sum by ({_by(labels)}) (sum_over_time({step_expr(name, w.fresh_s, w.allocation)}"
            f"[{w.window}:{duration(w.resolution_s)}]))")


def recorded_expr(name: str, labels: tuple[str, ...], w: Window) -> str:
    """Step-sum of `name` over the range, by `labels`, from its recorded series (no subquery)."""
    return f"sum by ({_by(labels)}) (sum_over_time({RECORDED[name]}[{w.window}]))"


#: The instant queries at the range's end, each over the whole range: name -> (template, extra labels).
#: {R} is the range, {by} the group's labels.
INSTANT: dict[str, tuple[str, tuple[str, ...]]] = {
    "observed": ("sum by ({by}) (count_over_time(gpu_info[{R}]))", ()),
    "used": ("sum by ({by}) (sum_over_time(gpu_sm_active_ratio[{R}]))", ()),
    "outside_kubernetes": ('sum by ({by}) (sum_over_time(gpu_allocation_state{{state="in_use_outside_kubernetes"}}'
                           "[{R}]))", ()),
    "energy": ("sum by ({by}) (increase(gpu_energy_joules_total[{R}]))", ()),
    "throttle": ("sum by ({by}, reason) (increase(gpu_throttle_seconds_total[{R}]))", ("reason",)),
    "memory_used": ("max by ({by}) (max_over_time(gpu_memory_used_bytes[{R}]))", ()),
    "memory_total": ("max by ({by}) (max_over_time(gpu_memory_total_bytes[{R}]))", ()),
    "verdicts": ('sum by (hostname, gpu, kind) (count_over_time(gpu_verdict{{window="' + VERDICT_WINDOW
                 + '"}}[{R}]))', ("kind",)),
}


def instant_expr(name: str, labels: tuple[str, ...], w: Window) -> str:
    template, _ = INSTANT[name]
    return template.format(by=_by(labels), R=w.window)


def steps_expr(metric: str, window_s: float) -> str:
    """Samples per host in each window: the densest of its GPUs' series (a series split by a pod's label
    change counts less in the window it changes in; another GPU's does not)."""
    return f"max by (hostname) (count_over_time({metric}[{duration(window_s - 0.001)}]))"


def stamps_expr(metric: str) -> str:
    """Per host, the timestamp of its last sample at the query's time (every series of a target is scraped
    at once; the newest wins over a series whose labels changed)."""
    return f"max by (hostname) (timestamp({metric}))"


def plot_exprs(w: Window, recorded: bool) -> dict[str, str]:
    """The range queries of the plots, at w.step_s: per host sums of samples (times each host's own step
    make seconds), so a bucket's figure is GPU-seconds."""
    step = duration(w.step_s - 0.001)
    if recorded:
        alloc = f"sum by (hostname) (sum_over_time({RECORDED['allocated']}[{step}]))"
        idle = f"sum by (hostname) (sum_over_time({RECORDED['idle_allocated']}[{step}]))"
    else:
        sub = f"[{step}:{duration(w.plot_resolution_s or w.resolution_s)}]"
        alloc = f"sum by (hostname) (sum_over_time({step_expr('allocated', w.fresh_s, w.allocation)}{sub}))"
        idle = f"sum by (hostname) (sum_over_time({step_expr('idle_allocated', w.fresh_s, w.allocation)}{sub}))"
    return {
        "observed": f"sum by (hostname) (count_over_time(gpu_info[{step}]))",
        "used": f"sum by (hostname) (sum_over_time(gpu_sm_active_ratio[{step}]))",
        "allocated": alloc,
        "idle_allocated": idle,
        "power": f"sum by (hostname) (sum_over_time(gpu_power_watts[{step}]))",
    }


def rules_yaml(scrape_interval_s: float, interval_s: float | None = None) -> str:
    """The recording rules as a Prometheus rule file (YAML; every expression a double-quoted string).
    `scrape_interval_s` sets the freshness window (1.5 of it); the group is evaluated every `interval_s`
    (default: the scrape interval)."""
    import json

    fresh = 1.5 * scrape_interval_s
    every = interval_s or scrape_interval_s
    lines = ["# gpuscope fleet recording rules (gpuscope fleet rules): per-step series that `gpuscope fleet report`",
             "# reads instead of subqueries over the raw ones. Each is a series per GPU (or per GPU and user) whose",
             "# value summed over a range and multiplied by the evaluation interval is seconds. docs/FLEET.md.",
             f"# Made for a scrape interval of {scrape_interval_s:g} s: a sample counts while at most "
             f"{fresh:g} s old.",
             "groups:", "  - name: gpuscope-fleet", f"    interval: {duration(every)}", "    rules:"]
    for name in STEP:
        lines += [f"      - record: {RECORDED[name]}", f"        expr: {json.dumps(step_expr(name, fresh))}"]
    return "\n".join(lines) + "\n"
