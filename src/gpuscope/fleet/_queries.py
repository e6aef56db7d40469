"""Every PromQL expression the fleet report sends, and the recording rules built from the same definitions.

The report never pulls raw points. Each figure is one instant query at the range's end whose window is the
whole range (`count_over_time(gpu_info[7d])`, `sum_over_time(gpu_sm_active_ratio[7d])`, ...), aggregated on
the server by the labels of one GPU and of the group (`sum by (hostname, gpu, model, namespace) (...)`), so
the answer is a row per GPU and group whatever the range. Figures that join two series at each scrape (a
GPU idle *while* allocated; a user's share of a GPU) and the counters (energy, throttling) are per-tile
expressions (`STEP`) summed over the range by a subquery whose resolution is the tile: the same expressions
the recording rules record, so a server that runs `gpuscope fleet rules` answers them from the recorded
series with a plain `sum_over_time` instead.

A tile is the window (t - tile, t] before an evaluation. Its figures count the *samples* in it (allocated
samples, idle samples), so a pod shorter than a tile counts its own samples, never a whole tile; or they
split the GPU's counter growth across it (its last sample at t minus its last at t - tile, whatever labels
the samples carried) among the GPU's label sets in the tile by each one's own growth there, so a label set
that ends and recurs (a free GPU between pods, a StatefulSet's pod name) never counts the growth while it
was away. Presence at an instant is read through `last_over_time(m[fresh])`, `fresh` being 1.5 scrape
steps: a gap in scraping is then a gap in every figure (never the last value carried over the server's
5-minute lookback, never a zero).

    >>> print(step_expr("observed", Tile(15, 22.5)))
    last_over_time(gpu_info[22500ms])
    >>> w = Window(range_s=7 * 86400, resolution_s=15, fresh_s=22.5, step_s=2520)
    >>> print(instant_expr("used", group_labels("namespace"), w))
    sum by (hostname, gpu, model, namespace) (sum_over_time(gpu_sm_active_ratio[604799999ms]))
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..diagnose.thresholds import DEFAULT as THRESHOLDS
from ..promql import duration, quote, regex_alternation

__all__ = ["DIMENSIONS", "INSTANT", "KEY", "RECORDED", "REQUIRED_METRICS", "STEP", "Tile", "Window",
           "group_labels", "instant_expr", "plot_exprs", "stamps_expr", "recorded_expr", "rules_yaml", "step_expr",
           "steps_expr", "subquery_expr"]

#: --by: the labels that name a group. A GPU's own series carry all of them but `user`, which only the
#: per-process series carry (a GPU's time goes to its processes' users, split evenly among them).
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "namespace": ("namespace",), "pod": ("namespace", "pod"), "job": ("workload",), "user": ("user",),
    "node": ("hostname",), "model": ("model",),
}
#: What names one GPU in the fleet (gpu_verdict carries no more than these).
GPU = ("hostname", "gpu")
#: The labels a per-tile series keeps: one GPU's and every label a group (but user) is named by.
KEY = ("hostname", "gpu", "model", "namespace", "pod", "workload")
ALLOCATED_STATES = ("allocated_idle", "in_use_by_pod", "in_use_outside_kubernetes")
SM_IDLE = THRESHOLDS.sm_idle
#: Without these nothing can be reported; the rest only fill their own columns.
REQUIRED_METRICS = ("gpu_info", "gpu_sm_active_ratio")
OPTIONAL_METRICS = ("gpu_energy_joules_total", "gpu_throttle_seconds_total", "gpu_memory_used_bytes",
                    "gpu_memory_total_bytes", "gpu_verdict", "gpu_allocation_state", "gpu_process_memory_used_bytes",
                    "gpu_power_watts")
VERDICT_WINDOW = "2m"
#: The recorded series (`gpuscope fleet rules`) and the per-tile expression each one records.
RECORDED = {
    "observed": "gpuscope:gpu_observed:bool",
    "allocated": "gpuscope:gpu_allocated:samples",
    "idle_allocated": "gpuscope:gpu_idle_allocated:samples",
    "user_share": "gpuscope:gpu_user_share:ratio",
    "user_sm_active": "gpuscope:gpu_user_sm_active:ratio",
    "user_idle": "gpuscope:gpu_user_idle_allocated:ratio",
}
#: What each per-tile series' step-sum is: samples (times the node's scrape step make seconds), the
#: counter's own unit (joules, seconds), or instants (times the tile make seconds).
UNIT = {"observed": "instants", "allocated": "samples", "idle_allocated": "samples", "energy": "counter",
        "throttle": "counter", "user_share": "instants", "user_sm_active": "instants", "user_idle": "instants"}
#: The counters split by tile, and the labels they carry beside one GPU's.
COUNTERS = {"energy": ("gpu_energy_joules_total", ()), "throttle": ("gpu_throttle_seconds_total", ("reason",))}
#: A label set's weight per sample beside its growth: where no label set of a GPU grew in a tile, the
#: samples alone split it (and a tile of one sample, at the scrape step, is whole).
_PER_SAMPLE = "1e-6"


@dataclass(frozen=True)
class Tile:
    """One evaluation's window: its length (the subquery's resolution, or the rules' interval), the freshness
    window of a sample (1.5 scrape steps), an offset that puts the tiles' edges on the range's end (the
    servers evaluate subqueries at multiples of their resolution), and which series can tell who holds a GPU
    ("both" where unknown, as in the recording rules; "kubernetes" or "processes" where the other is not
    there at all); and how far back a counter's last sample before the tile is looked for (at least `fresh`:
    a longer look bridges a gap in scraping, whose growth then goes to the label sets of the tile after it)."""

    window_s: float
    fresh_s: float
    offset_s: float = 0.0
    allocation: str = "both"
    bridge_s: float = 0.0


@dataclass(frozen=True)
class Window:
    """The range (seconds, ending at the query's time), the subqueries' resolution (their tile), the freshness
    window of a sample (1.5 scrape steps), the step of the plots' range queries and the resolution of their
    subqueries, the offset of the subqueries' tiles (they are asked at the range's end + offset, a multiple
    of the resolution) and the allocation series the range holds (Tile.allocation)."""

    range_s: float
    resolution_s: float
    fresh_s: float
    step_s: float
    plot_resolution_s: float | None = None
    allocation: str = "both"
    offset_s: float = 0.0

    @property
    def window(self) -> str:
        """The range as a selector's window: 1 ms short, so that a sample exactly at the range's start (one
        scrape before the first of an N-step range) is not counted where a server's windows are closed at
        both ends (Prometheus 2)."""
        return duration(self.range_s - 0.001)

    @property
    def tiles(self) -> int:
        return max(1, round(self.range_s / self.resolution_s))

    def tile(self, resolution_s: float | None = None, offset: bool = True) -> Tile:
        return Tile(resolution_s or self.resolution_s, self.fresh_s, self.offset_s if offset else 0.0,
                    self.allocation, self.range_s)


def group_labels(by: str) -> tuple[str, ...]:
    """The labels a raw query keeps: one GPU's, its model, and the group's (except `user`: see DIMENSIONS)."""
    extra = () if by == "user" else DIMENSIONS[by]
    return tuple(dict.fromkeys(("hostname", "gpu", "model", *extra)))


def _by(labels: tuple[str, ...]) -> str:
    return ", ".join(labels)


def _range(metric: str, window_s: float, offset_s: float = 0.0, matchers: str = "") -> str:
    sel = f"{metric}{{{matchers}}}" if matchers else metric
    off = f" offset {duration(offset_s)}" if offset_s >= 0.0005 else ""
    return f"{sel}[{duration(window_s)}]{off}"


def _fresh(metric: str, t: Tile, matchers: str = "", back_s: float = 0.0, look_s: float = 0.0) -> str:
    return f"last_over_time({_range(metric, max(t.fresh_s, look_s), t.offset_s + back_s, matchers)})"


def _in_tile(fn: str, metric: str, t: Tile, matchers: str = "") -> str:
    """`fn` over the tile's samples: 1 ms short, so a sample on an edge is in one tile only."""
    return f"{fn}({_range(metric, t.window_s - 0.001, t.offset_s, matchers)})"


def allocated_expr(t: Tile) -> str:
    """Per GPU label set (KEY), its samples in the tile while someone held the GPU: on Kubernetes (the GPU has
    gpu_allocation_state), the samples in a state that holds it (allocated_idle, in_use_by_pod,
    in_use_outside_kubernetes); elsewhere, its samples while a process of its workload ran (no more than the
    process's own samples)."""
    key = _by(KEY)
    states = f'state=~"{regex_alternation(ALLOCATED_STATES)}"'
    k8s = f"sum by ({key}) ({_in_tile('sum_over_time', 'gpu_allocation_state', t, states)})"
    n = f"sum by ({key}) ({_in_tile('count_over_time', 'gpu_info', t)})"
    p = f"max by (hostname, gpu, workload) ({_in_tile('count_over_time', 'gpu_process_memory_used_bytes', t)})"
    procs = f"({n} - clamp_min({n} - on (hostname, gpu, workload) group_left () {p}, 0))"
    if t.allocation == "kubernetes":
        return f"({k8s})"
    if t.allocation == "processes":
        return procs
    has_state = f"group by (hostname, gpu) ({_in_tile('count_over_time', 'gpu_allocation_state', t)})"
    return f"({k8s} or on (hostname, gpu) ({procs} unless on (hostname, gpu) {has_state}))"


def _idle_share(t: Tile) -> str:
    """Per KEY, the share of its SM-activity samples in the tile under the idle threshold: 1 when all are, 0
    when none is, and between, the share at the low end if the samples took two values ((max - mean) /
    (max - min): exact for a GPU that bursts between idle and busy)."""
    key, th = _by(KEY), f"{SM_IDLE:g}"

    def agg(fn: str) -> str:
        return f"{fn} by ({key}) ({_in_tile(fn + '_over_time', 'gpu_sm_active_ratio', t)})"

    mx, mn, av = agg("max"), agg("min"), agg("avg")
    return (f"(({mx} < bool {th}) + ({mx} >= bool {th}) * ({mn} < bool {th}) * ({mx} - {av})"
            f" / clamp_min({mx} - {mn}, 1e-9))")


def counter_parts(name: str, t: Tile, matchers: str = "") -> dict[str, str]:
    """What counter_expr puts together, as queries of their own: per KEY (and reason), a label set's own
    samples' growth ("own"), the step before its first sample where it began in the tile and has two samples
    or more ("known"), 1 where it began with a single one ("single"); per GPU (and reason), its growth since
    its last sample within a tile before ("short") and since its last within `bridge_s` ("bridged").
    split_counter does on the rows what counter_expr does on the server."""
    metric, extra = COUNTERS[name]
    ident = _by(("hostname", "gpu", *extra))
    key = _by((*KEY, *extra))
    look = max(t.fresh_s, t.window_s - 0.001)
    a = f"max by ({ident}) ({_fresh(metric, t, matchers, look_s=look)})"
    b = f"max by ({ident}) ({_fresh(metric, t, matchers, back_s=t.window_s, look_s=look)})"

    def growth(before: str) -> str:
        d = f"({a} - {before})"
        return f"(({d} >= 0) or ({a} and ({d} < 0)))"  # reset: counted from 0

    bridged = b
    if t.bridge_s > look:
        bridged = (f"({b} or on ({ident}) max by ({ident}) "
                   f"({_fresh(metric, t, matchers, back_s=t.window_s, look_s=t.bridge_s)}))")
    inside = _range(metric, t.window_s - 0.001, t.offset_s, matchers)
    reach = _range(metric, t.window_s - 0.001 + t.fresh_s, t.offset_s, matchers)
    # a label set's last sample before the tile: the one just before, not the earliest of the freshness
    # window, which may hold two of its samples
    before = f"last_over_time({_range(metric, t.fresh_s - 0.001, t.offset_s + t.window_s - 0.001, matchers)})"
    n = f"count_over_time({inside})"
    began = f"(count_over_time({reach}) == bool {n})"
    span = f"(max_over_time({inside}) - min_over_time({inside}))"
    return {
        # the weight per sample keeps a GPU whose label sets did not grow divisible by their samples
        "own": f"sum by ({key}) (max_over_time({inside}) - ({before} or min_over_time({inside})) + "
               f"{_PER_SAMPLE} * {n})",
        "known": f"sum by ({key}) ({began} * {span} / clamp_min({n} - 1, 1))",  # 0 for a single sample
        "single": f"sum by ({key}) ({began} * ({n} == bool 1))",
        "short": f"clamp_min({a} - {b}, 0)",  # after a reset: 0, and the growth is split by the label sets' own
        "bridged": growth(bridged),
    }


def counter_expr(name: str, t: Tile, matchers: str = "") -> str:
    """Per KEY (and reason), the counter's growth in the tile: the GPU's growth (its last sample in the tile
    minus its last before, over all its label sets, looked for up to `bridge_s` back across a gap; after a
    reset, its value) split among its label sets in the tile.

    A label set that ran on from before the tile (a sample of its own in the freshness window before it) has
    its growth exactly: its last sample minus that one. One that began inside the tile has its growth from
    its first sample to its last, and the step before its first sample. Those steps together are the GPU's
    growth since its last sample before the tile less what the label sets' own samples account for: a label
    set with two samples or more is given its own mean rate per step of it, those with a single sample
    share what is left, and where none has a single sample those with more share it all in proportion to
    their rates (exact where one label set began, or where the others' rates held). Where the label
    sets' own growth exceeds the GPU's (one that left and came back within the tile spans the others'),
    the GPU's growth is split in proportion to their own."""
    ident = _by(("hostname", "gpu", *COUNTERS[name][1]))
    p = counter_parts(name, t, matchers)
    own, known, single = p["own"], p["known"], p["single"]

    def per(expr: str) -> str:
        return f"sum by ({ident}) ({expr})"

    # the steps before the first samples of those that began (none where the GPU has no sample a tile before)
    rest = f"clamp_min({p['short']} - on ({ident}) {per(own)}, 0)"
    # per single sample: what the known rates leave of it; to the known: the rest less that, by their rates
    each = f"(clamp_min({rest} - on ({ident}) {per(known)}, 0) / clamp_min({per(single)}, 1))"
    given = f"(({rest} - on ({ident}) {per(single)} * on ({ident}) {each}) / on ({ident}) clamp_min({per(known)}, 1e-9))"
    w = (f"(({own} + {known} * on ({ident}) group_left () {given} + {single} * on ({ident}) group_left () {each})"
         f" or {own})")
    # what the weights add up to, without asking for them twice (a server's query length is bounded: 16 KiB
    # by default on VictoriaMetrics): their own and the rest where some began, else their own
    total = (f"(({per(own)} + {rest} * on ({ident}) ({per(known)} + on ({ident}) {per(single)} > bool 0))"
             f" or {per(own)})")
    return f"({w} * on ({ident}) group_left () ({p['bridged']} / on ({ident}) {total}))"


def split_counter(name: str, rows: Mapping[str, Iterable[Mapping[str, Any]]]) -> list[tuple[dict[str, str], float]]:
    """counter_expr's split done here, on the rows of counter_parts' queries (part -> instant-query rows):
    (labels, growth) per KEY (and reason). A server joins a counter's series at a cost that grows faster than
    their number; apart, each part is a plain aggregation.

    >>> g = {"hostname": "n", "gpu": "0"}
    >>> def row(v, **kw): return {"metric": {**g, **kw}, "value": [0, str(v)]}
    >>> parts = {"own": [row(50, pod="a"), row(20, pod="b")], "known": [row(0, pod="a"), row(10, pod="b")],
    ...          "single": [row(0, pod="a"), row(0, pod="b")], "short": [row(80)], "bridged": [row(80)]}
    >>> sorted((lab["pod"], round(v, 6)) for lab, v in split_counter("energy", parts))
    [('a', 50.0), ('b', 30.0)]
    """
    extra = COUNTERS[name][1]
    ident_of = ("hostname", "gpu", *extra)
    key_of = (*KEY, *extra)

    def table(part: str, labels: tuple[str, ...]) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {}
        for r in rows.get(part) or ():
            try:
                v = float(r["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            if math.isfinite(v):
                m = r.get("metric") or {}
                out[tuple(m.get(x, "") for x in labels)] = v
        return out

    own, known, single = table("own", key_of), table("known", key_of), table("single", key_of)
    short, bridged = table("short", ident_of), table("bridged", ident_of)
    sums: dict[tuple[str, ...], list[float]] = {}  # ident -> [own, known, single]
    idents = {k: tuple(k[key_of.index(x)] for x in ident_of) for k in own}
    for k, i in idents.items():
        acc = sums.setdefault(i, [0.0, 0.0, 0.0])
        acc[0] += own[k]
        acc[1] += known.get(k, 0.0)
        acc[2] += single.get(k, 0.0)
    weights: dict[tuple[str, ...], float] = {}
    for k, i in idents.items():
        s_own, s_known, s_single = sums[i]
        rest = max(short[i] - s_own, 0.0) if i in short else 0.0
        each = max(rest - s_known, 0.0) / max(s_single, 1.0)
        given = (rest - s_single * each) / max(s_known, 1e-9)
        weights[k] = own[k] + known.get(k, 0.0) * given + single.get(k, 0.0) * each
    total: dict[tuple[str, ...], float] = {}
    for k, i in idents.items():
        total[i] = total.get(i, 0.0) + weights[k]
    out = []
    for k, i in idents.items():
        if i in bridged and total[i] != 0:
            out.append(({x: v for x, v in zip(key_of, k, strict=True) if v}, weights[k] / total[i] * bridged[i]))
    return out


def _user_share(t: Tile) -> str:
    procs = (f"count by (hostname, gpu, model, user) "
             f"({_fresh('gpu_process_memory_used_bytes', t, 'pid!=' + quote('other'))})")
    return f"(({procs} > bool 0) / on (hostname, gpu) group_left () count by (hostname, gpu) ({procs}))"


def _idle_now(t: Tile) -> str:
    """1 per GPU held and idle at the instant (what --by user splits among the GPU's users)."""
    sm = _fresh("gpu_sm_active_ratio", t)
    states = f'state=~"{regex_alternation(ALLOCATED_STATES)}"'
    k8s = f"max by (hostname, gpu) ({_fresh('gpu_allocation_state', t, states)}) == 1"
    procs = f"group by (hostname, gpu) ({_fresh('gpu_process_memory_used_bytes', t)})"
    held = (f"(({k8s}) or on (hostname, gpu) ({procs} unless on (hostname, gpu) "
            f"{_fresh('gpu_allocation_state', t)}))")
    return f"max by (hostname, gpu) ((({sm} < bool {SM_IDLE:g}) == 1) and on (hostname, gpu) {held})"


def step_expr(name: str, t: Tile, matchers: str = "") -> str:
    """The per-tile expression `name` (a key of STEP): a series per GPU label set (KEY), or per GPU and user,
    whose step-sum over a range is samples, the counter's unit, or instants (UNIT)."""
    if name == "observed":  # gpu_info is 1 while the GPU is scraped
        return _fresh("gpu_info", t)
    if name == "allocated":
        return allocated_expr(t)
    if name == "idle_allocated":
        return f"({allocated_expr(t)} * on ({_by(KEY)}) {_idle_share(t)})"
    if name in COUNTERS:
        return counter_expr(name, t, matchers)
    if name == "user_share":
        return _user_share(t)
    if name == "user_sm_active":
        sm = f"max by (hostname, gpu) ({_fresh('gpu_sm_active_ratio', t)})"
        return f"({_user_share(t)} * on (hostname, gpu) group_left () {sm})"
    if name == "user_idle":
        return f"({_user_share(t)} * on (hostname, gpu) group_left () {_idle_now(t)})"
    raise KeyError(name)


#: The per-tile expressions the rules record. The counters' are asked of the raw series always: a recorded
#: growth per interval loses an interval whenever an evaluation is missed (a loaded server skips them) or
#: a sample arrives after its instant was evaluated (a scrape answered late is stamped at its start).
STEP = tuple(RECORDED)


def subquery_expr(name: str, labels: tuple[str, ...], w: Window, matchers: str = "") -> str:
    """Step-sum of `name` over the range, by `labels` (raw series: a subquery, one evaluation per tile; ask it
    at the range's end + w.offset_s); `matchers` narrow a counter's series (one reason: a server's cost of
    joining series grows faster than their number)."""
    span = w.tiles * w.resolution_s
    return (f"sum by ({_by(labels)}) (sum_over_time({step_expr(name, w.tile(), matchers)}"
            f"[{duration(span - 0.001)}:{duration(w.resolution_s)}]))")


def recorded_expr(name: str, labels: tuple[str, ...], w: Window, matchers: str = "") -> str:
    """Step-sum of `name` over the range, by `labels`, from its recorded series (no subquery)."""
    sel = f"{RECORDED[name]}{{{matchers}}}" if matchers else RECORDED[name]
    return f"sum by ({_by(labels)}) (sum_over_time({sel}[{w.window}]))"


#: The instant queries at the range's end, each over the whole range: name -> (template, extra labels).
#: {R} is the range, {by} the group's labels.
INSTANT: dict[str, tuple[str, tuple[str, ...]]] = {
    "observed": ("sum by ({by}) (count_over_time(gpu_info[{R}]))", ()),
    "used": ("sum by ({by}) (sum_over_time(gpu_sm_active_ratio[{R}]))", ()),
    "outside_kubernetes": ('sum by ({by}) (sum_over_time(gpu_allocation_state{{state="in_use_outside_kubernetes"}}'
                           "[{R}]))", ()),
    "memory_used": ("max by ({by}) (max_over_time(gpu_memory_used_bytes[{R}]))", ()),
    "memory_total": ("max by ({by}) (max_over_time(gpu_memory_total_bytes[{R}]))", ()),
    "verdicts": ('sum by (hostname, gpu, kind) (count_over_time(gpu_verdict{{window="' + VERDICT_WINDOW
                 + '"}}[{R}]))', ("kind",)),
    # the clock-event reasons whose counters moved at all: only those are split by tile
    "throttle_reasons": ("group by (reason) (changes(gpu_throttle_seconds_total[{R}]) > 0)", ("reason",)),
}


def instant_expr(name: str, labels: tuple[str, ...], w: Window) -> str:
    template, _ = INSTANT[name]
    return template.format(by=_by(labels), R=w.window)


def steps_expr(metric: str, window_s: float) -> str:
    """Samples per host in each window: its GPUs' samples, each GPU's summed over its label sets (a GPU whose
    pod changes in the window has its samples in two series; on a node whose GPUs change pods together no
    single series is whole), the densest GPU's."""
    return f"max by (hostname) (sum by (hostname, gpu) (count_over_time({metric}[{duration(window_s - 0.001)}])))"


def stamps_expr(metric: str) -> str:
    """Per host, the timestamp of its last sample at the query's time (every series of a target is scraped
    at once; the newest wins over a series whose labels changed)."""
    return f"max by (hostname) (timestamp({metric}))"


def plot_exprs(w: Window, recorded: bool) -> dict[str, str]:
    """The range queries of the plots, at w.step_s: per host sums of samples in each bucket (times each
    host's own step make seconds), so a bucket's figure is GPU-seconds."""
    step = duration(w.step_s - 0.001)
    if recorded:
        alloc = f"sum by (hostname) (sum_over_time({RECORDED['allocated']}[{step}]))"
        idle = f"sum by (hostname) (sum_over_time({RECORDED['idle_allocated']}[{step}]))"
    else:  # the bucket is the tile: the range query evaluates the per-tile expression once per bucket
        t = w.tile(w.step_s, offset=False)
        alloc = f"sum by (hostname) ({step_expr('allocated', t)})"
        idle = f"sum by (hostname) ({step_expr('idle_allocated', t)})"
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
    (default: the scrape interval), which is also each evaluation's tile."""
    import json

    fresh = 1.5 * scrape_interval_s
    every = interval_s or scrape_interval_s
    lines = ["# gpuscope fleet recording rules (gpuscope fleet rules): per-tile series that `gpuscope fleet report`",
             "# reads instead of subqueries over the raw ones. Each is a series per GPU label set (or per GPU and",
             "# user) holding, per evaluation, the samples or the counter growth of the interval before it, or a",
             "# value at the instant. docs/FLEET.md.",
             f"# Made for a scrape interval of {scrape_interval_s:g} s: a sample counts while at most "
             f"{fresh:g} s old; evaluated every {every:g} s (the rules' tile).",
             "groups:", "  - name: gpuscope-fleet", f"    interval: {duration(every)}", "    rules:"]
    for name in STEP:
        lines += [f"      - record: {RECORDED[name]}", f"        expr: {json.dumps(step_expr(name, Tile(every, fresh)))}"]
    return "\n".join(lines) + "\n"
