"""The fleet report's figures: the queries of _queries sent to the server, their answers summed per group.

One GPU at a time, then summed: every answer is a row per GPU (hostname, gpu) and group, in samples or
step-sums; each host's own scrape step, read from its data (`scrape_steps`), turns samples into seconds.
docs/FLEET.md says what each figure means and how it is computed; the money is defined once, in `_money`.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from .._redact import redact_url
from ..errors import Unavailable, UsageError
from ..promql import Client, label_matcher
from . import _queries as q
from . import _tiles
from ._prices import Prices

__all__ = ["NoFleetData", "Progress", "build"]

#: Windows the range is cut into to read each host's scrape step (a gap spoils only the windows it touches).
STEP_WINDOWS = 16
#: Subqueries evaluate at most this many steps: a week at 5 minutes. Their cost is steps x series (a
#: Prometheus evaluates about a million series-steps a second on a core); the recording rules cost none.
MAX_SUBQUERY_STEPS = 2_000
#: The counters' and allocated time's subqueries evaluate at most this many tiles (a week at 42 minutes):
#: their cost is per series (one per GPU label set and reason) and tile, and neither loses anything in a
#: longer tile (allocated counts samples; a counter's growth is split by each label set's own growth).
COUNTER_TILES = 240
#: Sub-steps per plot bucket of the plots' subqueries.
PLOT_SUBSTEPS = 4
PLOT_POINTS = 240
#: The recorded series are read instead of subqueries when they cover this share of the observed time.
RECORDED_COVERAGE = 0.98
_RECORDED_COVERAGE_TEXT = f"{RECORDED_COVERAGE:.0%}"
#: Benign clock-event reasons: clocks low because the GPU is idle or as configured, not slowed down.
BENIGN_REASONS = frozenset({"gpu_idle", "applications_clocks", "sync_boost", "display_clock"})
#: The advice for clocks held down by a reason: at the power limit is expected at full load; the rest is heat
#: or hardware.
_THROTTLE_ADVICE = {"sw_power_cap": "power_capped"}
QUERY_THREADS = 4
NONE = "(none)"

Progress = Callable[[int, int, str], None]


class NoFleetData(Unavailable):
    """The server holds none of the series the report needs in the range: one sentence saying which."""


@dataclass
class Figures:
    """One GPU's figures in one group (or a group's, summed). Seconds and joules inside; hours at the edge."""

    observed_s: float = 0.0
    unobserved_s: float = 0.0
    allocated_s: float = 0.0
    outside_kubernetes_s: float = 0.0
    used_s: float = 0.0
    idle_s: float = 0.0
    energy_j: float = 0.0
    throttle_s: dict[str, float] = field(default_factory=dict)
    verdict_s: dict[str, float] = field(default_factory=dict)
    memory_used_ratio_max: float | None = None
    gpu_cost: float = 0.0
    energy_cost: float = 0.0
    wasted: float = 0.0
    unallocated_cost: float = 0.0
    co2e_kg: float = 0.0
    gpus: set[tuple[str, str]] = field(default_factory=set)

    def add(self, o: Figures) -> None:
        for name in ("observed_s", "unobserved_s", "allocated_s", "outside_kubernetes_s", "used_s", "idle_s",
                     "energy_j", "gpu_cost", "energy_cost", "wasted", "unallocated_cost", "co2e_kg"):
            setattr(self, name, getattr(self, name) + getattr(o, name))
        for mine, theirs in ((self.throttle_s, o.throttle_s), (self.verdict_s, o.verdict_s)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v
        if o.memory_used_ratio_max is not None:
            self.memory_used_ratio_max = max(self.memory_used_ratio_max or 0.0, o.memory_used_ratio_max)
        self.gpus |= o.gpus


# -- reading the answers ---------------------------------------------------------------------------
def _value(r: Mapping[str, Any]) -> float | None:
    try:
        v = float(r["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _rows(result: Iterable[Mapping[str, Any]]) -> list[tuple[dict[str, str], float]]:
    out = []
    for r in result:
        v = _value(r)
        if v is not None:
            out.append((dict(r.get("metric") or {}), v))
    return out


def group_name(labels: Mapping[str, str], by: str) -> str:
    """The group a series is in: its label (for pod, namespace/pod); '(none)' where it has none."""
    names = q.DIMENSIONS[by]
    last = labels.get(names[-1], "")
    if not last:
        return NONE
    return "/".join(labels.get(n, "") for n in names if labels.get(n, ""))


def _gpu(labels: Mapping[str, str]) -> tuple[str, str]:
    return labels.get("hostname", ""), labels.get("gpu", "")


# -- the scrape step -------------------------------------------------------------------------------
def step_of(windows: list[tuple[float, float]]) -> float | None:
    """A host's scrape step from (seconds between its last samples at a window's two edges, samples in the
    window) per window: the median of span / samples, which is the step exactly in a window without a gap
    and more in one with (so a gap in fewer than half the windows changes nothing). None without a sample.

    >>> step_of([(10.0, 10), (10.0, 10), (25.0, 10), (10.0, 10), (30.0, 5)])  # two windows with gaps
    1.0
    """
    per = sorted(span / n for span, n in windows if n >= 1 and span > 0)
    if not per:
        return None
    mid = len(per) // 2
    return per[mid] if len(per) % 2 else (per[mid - 1] + per[mid]) / 2


def scrape_steps(client: Client, metric: str, start_s: float, end_s: float) -> dict[str, float]:
    """Each host's scrape step in seconds, read from `metric`'s samples (never assumed): at the edges of
    STEP_WINDOWS windows, the timestamp of the host's last sample (timestamp()) and the samples between."""
    windows = STEP_WINDOWS
    while True:
        w = round((end_s - start_s) / windows, 3)  # whole ms: the servers' evaluation times are ms
        stamps = _by_host(client.query_range(q.stamps_expr(metric), start_s, end_s, w))
        counts = _by_host(client.query_range(q.steps_expr(metric, w), start_s + w, end_s, w))
        pairs: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for host, at in counts.items():
            ts = stamps.get(host, {})
            for t, n in at.items():
                before = ts.get(round(t - w, 3))
                if before is not None and t in ts:
                    pairs[host].append((ts[t] - before, n))
        if any(n >= 1 for p in pairs.values() for _, n in p) or windows == 1:
            break
        windows = 1  # the step is longer than a window: one window over the whole range
    out = {}
    for host, p in pairs.items():
        s = step_of(p)
        if s is not None:
            out[host] = s
    return out


def _by_host(result: Iterable[Mapping[str, Any]]) -> dict[str, dict[float, float]]:
    """A range query's matrix by hostname: {host: {evaluation time (ms-rounded): value}}."""
    out: dict[str, dict[float, float]] = {}
    for r in result:
        host = (r.get("metric") or {}).get("hostname", "")
        out[host] = {round(float(t), 3): _f(v) for t, v in r.get("values") or []}
    return out


def _f(v: Any) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return 0.0
    return x if math.isfinite(x) else 0.0


# -- the queries -----------------------------------------------------------------------------------
def _run_all(client: Client, exprs: dict[str, tuple[str, float | None]], progress: Progress | None,
             done0: int, total: int) -> dict[str, list[dict[str, Any]]]:
    """Instant queries (name -> (expr, time)), a few at once; progress after each."""
    out: dict[str, list[dict[str, Any]]] = {}
    done = done0
    with ThreadPoolExecutor(QUERY_THREADS) as pool:
        futures = {name: pool.submit(client.query, expr, at) for name, (expr, at) in exprs.items()}
        for name, fut in futures.items():
            out[name] = fut.result()
            done += 1
            if progress:
                progress(done, total, name)
    return out


def _check_names(client: Client, start_s: float, end_s: float) -> set[str]:
    names = set(client.label_values("__name__", start_s, end_s))
    missing = [m for m in q.REQUIRED_METRICS if m not in names]
    if missing:
        when = f"between {_iso(start_s)} and {_iso(end_s)}"
        none = " (it holds no series at all)" if not names else ""
        raise NoFleetData(f"The server at {client.shown} has no {', '.join(missing)} {when}{none}: the gpuscope "
                          "agents must be scraped by it (a scrape job for each agent's /metrics; docs/FLEET.md), or "
                          "the range is before they were.")
    return names


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _window(steps: Mapping[str, float], range_s: float, end_s: float, names: set[str],
            max_tiles: int = MAX_SUBQUERY_STEPS) -> q.Window:
    """The subqueries' tiles: as many as the finest node's scrape steps in the range, at most `max_tiles`,
    each a whole number of ms, their edges on the range's end (the servers evaluate a subquery at multiples
    of its resolution: it is asked at the next multiple after the end, its selectors offset back by as much)."""
    fine, coarse = min(steps.values()), max(steps.values())
    tiles = max(1, min(max_tiles, math.ceil(range_s / fine - 1e-6)))
    res_ms = max(1, round(range_s * 1000 / tiles))
    end_ms = round(end_s * 1000)
    offset_ms = -end_ms % res_ms
    resolution = res_ms / 1000
    plot_step = max(range_s / PLOT_POINTS, fine)
    k8s, procs = "gpu_allocation_state" in names, "gpu_process_memory_used_bytes" in names
    allocation = "both" if k8s == procs else "kubernetes" if k8s else "processes"
    return q.Window(range_s=range_s, resolution_s=resolution, fresh_s=1.5 * coarse, step_s=plot_step,
                    plot_resolution_s=max(resolution, plot_step / PLOT_SUBSTEPS), allocation=allocation,
                    offset_s=offset_ms / 1000)


def _retile(w: q.Window, end_s: float, tiles: int) -> q.Window:
    """`w` with at most `tiles` tiles (whole ms, their edges on the range's end)."""
    if w.tiles <= tiles:
        return w
    res_ms = max(1, round(w.range_s * 1000 / tiles))
    return replace(w, resolution_s=res_ms / 1000, offset_s=(-round(end_s * 1000) % res_ms) / 1000)


def _instant_plan(by: str, w: q.Window, names: set[str], end_s: float, source: str,
                  ) -> dict[str, tuple[str, float | None]]:
    labels = q.group_labels(by)
    plan: dict[str, tuple[str, float | None]] = {}
    for name in q.INSTANT:
        plan[name] = (q.instant_expr(name, labels, w), end_s)
    if q.RECORDED["observed"] in names and source != "raw":
        plan["recorded_observed"] = (q.recorded_expr("observed", labels, w), end_s)
    return plan


#: The per-tile figures every report asks for (--by user: and the users' shares).
TILED = ("allocated", "idle_allocated", "energy", "throttle")
USER_TILED = ("user_share", "user_sm_active", "user_idle")


def _step_plan(by: str, w: q.Window, recorded: bool, end_s: float, reasons: list[str],
               ) -> dict[str, tuple[str, float | None]]:
    """The per-tile figures' queries; throttling one query per reason that moved (`throttle:<reason>`)."""
    labels = q.group_labels(by)
    wanted = TILED + (USER_TILED if by == "user" else ())
    wc = _retile(w, end_s, COUNTER_TILES)
    plan = {}
    for name in wanted:
        if name in USER_TILED:
            make = q.recorded_expr if recorded else q.subquery_expr
            plan[name] = (make(name, ("hostname", "gpu", "model", "user"), w), end_s if recorded else end_s + w.offset_s)
            continue
        # allocated counts samples, exact at any tile: the counters' fewer tiles; idle reads SM activity's
        # samples against a threshold, truest at the finest
        wn = w if name == "idle_allocated" else wc
        from_rules = recorded and name in q.RECORDED  # the counters: always the raw series (q.STEP)
        make = q.recorded_expr if from_rules else q.subquery_expr
        at = end_s if from_rules else end_s + wn.offset_s
        if name == "throttle":
            for reason in reasons:
                plan[f"throttle:{reason}"] = (make(name, (*labels, "reason"), wn, label_matcher("reason", reason)), at)
        else:
            plan[name] = (make(name, labels, wn), at)
    return plan


SOURCES = ("auto", "raw", "recorded", "tiles")
#: The longest raw edge (head or tail) a range read from tiles may have, in tiles: an edge is asked of the raw
#: series as one tile, and a tile's idle share is its SM activity's spread (exact for two values only).
MAX_EDGE_TILES = 2


def build(client: Client, start_s: float, end_s: float, by: str, prices: Prices,
          progress: Progress | None = None, source: str = "auto", max_tiles: int = MAX_SUBQUERY_STEPS,
          ) -> dict[str, Any]:
    """The report (a plain dict, what --json writes) for [start_s, end_s) grouped by `by`. `source`: read the
    hourly tiles where a complete record of them covers the range, else the recorded series where they
    cover it, else the raw ones (auto); never anything but the raw (raw); insist on the recorded (recorded)
    or on the tiles (tiles); `max_tiles`: the most evaluations of a subquery over raw series."""
    if source not in SOURCES:
        raise UsageError(f"--source must be one of {', '.join(SOURCES)}, not {source!r}.")
    if by not in q.DIMENSIONS:
        raise UsageError(f"--by must be one of {', '.join(q.DIMENSIONS)}, not {by!r}.")
    if not end_s > start_s:
        raise UsageError("The range is empty: its end must come after its start.")
    if source == "tiles" and by == "user":
        raise UsageError("--source tiles cannot answer --by user: the tiles do not record each GPU's users (its "
                         "processes'); use --source auto, recorded or raw.")
    t0 = time.monotonic()
    tiled = len(TILED) - 1 + (len(USER_TILED) if by == "user" else 0)
    total = 3 + len(q.INSTANT) + 1 + tiled + len(q.plot_exprs(q.Window(1, 1, 1, 1), False)) + 1
    if progress:
        progress(0, total, "metric names")
    names = _check_names(client, start_s, end_s)
    note = ""
    if source in ("auto", "tiles"):
        found, note = _complete_tiles(client, start_s, end_s, by)
        if found is not None:
            return _from_tiles(client, found, start_s, end_s, by, prices, names, progress, t0)
        if source == "tiles":
            raise NoFleetData(f"The server at {client.shown} cannot answer from tiles: {note}; use --source auto.")
    steps = scrape_steps(client, "gpu_info", start_s, end_s)
    if not steps:
        raise NoFleetData(f"The server at {client.shown} holds too few gpu_info samples between {_iso(start_s)} "
                          f"and {_iso(end_s)} to tell the scrape step: choose a longer range.")
    if progress:
        progress(2, total, "scrape steps")
    w = _window(steps, end_s - start_s, end_s, names, max_tiles)
    answers = _run_all(client, _instant_plan(by, w, names, end_s, source), progress, 2, total)
    rule_steps: dict[str, float] = {}
    if "recorded_observed" in answers:
        rule_steps = scrape_steps(client, q.RECORDED["observed"], start_s, end_s)
    recorded = _recorded_cover(answers, steps, rule_steps) and all(n in names for n in q.RECORDED.values())
    if source == "recorded" and not recorded:
        raise NoFleetData(f"The server at {client.shown} does not hold the recorded series of `gpuscope fleet rules` "
                          f"({q.RECORDED['observed']}, ...) over {_RECORDED_COVERAGE_TEXT} of the range: load the rules "
                          "(rule_files) and wait, or use --source auto.")
    done = 3 + len(answers)
    reasons = sorted({r for lab, _ in _rows(answers["throttle_reasons"]) if (r := lab.get("reason", ""))})
    total += len(reasons)
    answers.update(_run_all(client, _step_plan(by, w, recorded, end_s, reasons), progress, done, total))
    done += tiled + len(reasons)
    plots = _plots(client, w, recorded, start_s, end_s, steps, rule_steps, progress, done, total)
    stragglers = _stragglers(client, start_s, end_s)
    if progress:
        progress(total, total, "stragglers")
    per_step = rule_steps if recorded else None
    rows = _gpu_rows(answers, by, steps, per_step, w)
    report = _assemble(rows, answers, by, prices, steps, w)
    report.update({
        "server": redact_url(client.url, keep_path=True), "by": by,
        "range": {"start": _iso(start_s), "end": _iso(end_s), "start_s": start_s, "end_s": end_s,
                  "seconds": end_s - start_s},
        "source": "recorded" if recorded else "raw",
        "source_note": f"Not from tiles: {note}." if note else "",
        "scrape_step_s": dict(sorted(steps.items())),
        "metrics_not_found": [m for m in q.OPTIONAL_METRICS if m not in names],
        "subquery_resolution_s": None if recorded else w.resolution_s,
        "subquery_offset_s": None if recorded else w.offset_s,
        "rule_interval_s": dict(sorted(rule_steps.items())) if recorded else None,
        "plots": plots, "stragglers": stragglers, "queries": client.requests,
        "query_seconds": round(time.monotonic() - t0, 3),
    })
    return report


def _complete_tiles(client: Client, start_s: float, end_s: float, by: str) -> tuple[_tiles.Tiles | None, str]:
    """The tiles that answer the range, or None and why not (what the report says)."""
    if by == "user":
        return None, ("--by user splits each GPU's time among its processes' users, which the tiles do not record "
                      "(the recorded or raw series answer it)")
    t = _tiles.read_tiles(client, start_s, end_s)
    if t is None:
        return None, (f"no tile of `gpuscope fleet rules` ({_tiles.MARKER}) lies whole in the range: the tile group "
                      "is not loaded, or the range is shorter than a tile or before the rules were")
    if not t.complete:
        at = t.missing_end_s if t.missing_end_s is not None else t.first_end_s
        return None, (f"the tile ending {_iso(at)} is missing ({t.count} of {t.expected} tiles of "
                      f"{t.tile_s:g} s recorded between {_iso(t.start_s)} and {_iso(t.last_end_s)}: an evaluation "
                      "was skipped)")
    head, tail = _tiles.edges_s(t, start_s, end_s)
    longest = MAX_EDGE_TILES * t.tile_s + t.delay_s
    if max(head, tail) > longest:
        which = "begin" if head > longest else "end"
        gap = head if head > longest else tail
        return None, (f"the tiles {which} {gap / 3600:.3g} h inside the range (tiles of {t.tile_s:g} s from "
                      f"{_iso(t.start_s)} to {_iso(t.last_end_s)}): more than {MAX_EDGE_TILES} tiles of it would be "
                      "read from the raw series as one")
    return t, ""


def _from_tiles(client: Client, t: _tiles.Tiles, start_s: float, end_s: float, by: str, prices: Prices,
                names: set[str], progress: Progress | None, t0: float) -> dict[str, Any]:
    """The report from the tiles (fleet._tiles): the whole tiles from their recorded series, the range's two
    partial edges from the raw series; the scrape steps read from the tiles. The stragglers read the raw
    series as always (whole-range aggregates, one query each)."""
    total = 4 + len(_tiles.TILE_RECORDED) * 3 + len(_tiles.plot_exprs(t.tile_s))
    if progress:
        progress(2, total, "tiles")
    steps = _tiles.tile_steps(client, t)
    if not steps:
        raise NoFleetData(f"The server at {client.shown} holds tiles between {_iso(t.start_s)} and "
                          f"{_iso(t.last_end_s)} but no GPU observed in them: use --source raw.")
    w = _window(steps, end_s - start_s, end_s, names)
    answers = _tiles.answers(client, t, w, start_s, end_s, q.group_labels(by),
                             lambda plan: _run_all(client, plan, progress, 3, total))
    hosts = {lab.get("hostname", "") for lab, _ in _rows(answers["observed"])}
    if hosts - set(steps):  # a node seen only in an edge: its step from the raw series
        raw = scrape_steps(client, "gpu_info", start_s, end_s)
        steps.update({h: s for h, s in raw.items() if h not in steps})
    plots = _tiles.plots(client, t, start_s, steps, PLOT_POINTS, client.query_range)
    stragglers = _stragglers(client, start_s, end_s)
    if progress:
        progress(total, total, "stragglers")
    rows = _gpu_rows(answers, by, steps, None, w)
    report = _assemble(rows, answers, by, prices, steps, w)
    head, tail = _tiles.edges_s(t, start_s, end_s)
    report.update({
        "server": redact_url(client.url, keep_path=True), "by": by,
        "range": {"start": _iso(start_s), "end": _iso(end_s), "start_s": start_s, "end_s": end_s,
                  "seconds": end_s - start_s},
        "source": "tiles", "source_note": "",
        "tiles": {"tile_s": t.tile_s, "delay_s": t.delay_s, "count": t.count, "first_end_s": t.first_end_s,
                  "last_end_s": t.last_end_s, "raw_head_s": round(head, 3), "raw_tail_s": round(tail, 3)},
        "scrape_step_s": dict(sorted(steps.items())),
        "metrics_not_found": [m for m in q.OPTIONAL_METRICS if m not in names],
        "subquery_resolution_s": None, "subquery_offset_s": None, "rule_interval_s": None,
        "plots": plots, "stragglers": stragglers, "queries": client.requests,
        "query_seconds": round(time.monotonic() - t0, 3),
    })
    return report


def _stragglers(client: Client, start_s: float, end_s: float) -> dict[str, Any]:
    """The Stragglers section: per job (the agents' workload label) spanning two GPUs or more, the GPU slower
    than its peers and why (fleet._stragglers). Asked only where the range holds a workload label at all."""
    from ._stragglers import find_stragglers

    if not client.label_values("workload", start_s, end_s):
        return {"stragglers": [], "jobs": False,
                "note": "No series carries a workload label in the range (the agents label a job's GPUs with it: "
                        "Slurm, torchrun or a pod's owner), so no job's GPUs can be compared."}

    def query(expr: str, at_s: float) -> list[tuple[dict[str, str], float]]:
        return _rows(client.query(expr, at_s))

    found = find_stragglers(query, start_s, end_s)
    return {"jobs": True, "note": "" if found else "No job has a GPU slower than its peers.",
            "stragglers": [{"workload": x.workload, "node": x.node, "gpu": x.gpu, "cause": x.cause,
                            "evidence": x.evidence, "fix": x.fix, "values": x.values} for x in found]}


def _recorded_cover(answers: Mapping[str, list[dict[str, Any]]], steps: Mapping[str, float],
                    rule_steps: Mapping[str, float]) -> bool:
    """True when the recorded series cover (nearly) all the observed time of the range."""
    if "recorded_observed" not in answers or not rule_steps:
        return False
    raw = sum(v * steps.get(lab.get("hostname", ""), 0.0) for lab, v in _rows(answers["observed"]))
    rec = sum(v * rule_steps.get(lab.get("hostname", ""), 0.0) for lab, v in _rows(answers["recorded_observed"]))
    return raw > 0 and rec >= RECORDED_COVERAGE * raw


def _plots(client: Client, w: q.Window, recorded: bool, start_s: float, end_s: float, steps: Mapping[str, float],
           rule_steps: Mapping[str, float], progress: Progress | None, done: int, total: int) -> dict[str, Any]:
    """Per bucket of w.step_s: GPUs observed, allocated, idle and used (GPU-seconds / bucket), power (W)."""
    exprs = q.plot_exprs(w, recorded)
    first = start_s + w.step_s
    t = [first + i * w.step_s for i in range(max(0, int((end_s - first) / w.step_s + 1e-9)) + 1)]
    out: dict[str, Any] = {"t_s": [round(x - start_s, 3) for x in t]}

    def one(name: str, expr: str) -> list[float | None]:
        sums: list[float | None] = [None] * len(t)  # every plot's sums are samples: times the node's step
        for r in client.query_range(expr, first, end_s, w.step_s):
            host = r.get("metric", {}).get("hostname", "")
            s = steps.get(host)
            if s is None:
                continue
            for ts, v in r.get("values") or []:
                i = round((float(ts) - first) / w.step_s)
                if 0 <= i < len(t):
                    sums[i] = (sums[i] or 0.0) + _f(v) * s / w.step_s
        return sums

    with ThreadPoolExecutor(QUERY_THREADS) as pool:
        futures = {name: pool.submit(one, name, expr) for name, expr in exprs.items()}
        for name, fut in futures.items():
            out[name] = fut.result()
            done += 1
            if progress:
                progress(done, total, f"plot {name}")
    return out


# -- rows per GPU and group ------------------------------------------------------------------------
def _gpu_rows(answers: Mapping[str, list[dict[str, Any]]], by: str, steps: Mapping[str, float],
              rule_steps: Mapping[str, float] | None, w: q.Window) -> dict[tuple[str, str, str], tuple[str, Figures]]:
    """(hostname, gpu, group) -> (model, figures)."""
    rows: dict[tuple[str, str, str], tuple[str, Figures]] = {}
    group_of = (lambda lab: "") if by == "user" else (lambda lab: group_name(lab, by))

    def row(lab: Mapping[str, str]) -> Figures:
        key = (*_gpu(lab), group_of(lab))
        if key not in rows:
            rows[key] = (lab.get("model", ""), Figures(gpus={_gpu(lab)}))
        return rows[key][1]

    def secs(lab: Mapping[str, str], v: float, per: Mapping[str, float]) -> float:
        return v * per.get(lab.get("hostname", ""), 0.0)

    for lab, v in _rows(answers["observed"]):
        row(lab).observed_s += secs(lab, v, steps)
    for lab, v in _rows(answers["used"]):
        row(lab).used_s += secs(lab, v, steps)
    for lab, v in _rows(answers["outside_kubernetes"]):
        row(lab).outside_kubernetes_s += secs(lab, v, steps)
    for lab, v in _rows(answers["allocated"]):  # samples, raw or recorded
        row(lab).allocated_s += secs(lab, v, steps)
    for lab, v in _rows(answers["idle_allocated"]):
        row(lab).idle_s += secs(lab, v, steps)
    for lab, v in _rows(answers["energy"]):
        row(lab).energy_j += max(0.0, v)
    for lab, v in (r for name in answers if name.startswith("throttle:") for r in _rows(answers[name])):
        f = row(lab)
        reason = lab.get("reason", "")
        f.throttle_s[reason] = f.throttle_s.get(reason, 0.0) + max(0.0, v)
    used_b = {(*_gpu(lab), group_of(lab)): v for lab, v in _rows(answers["memory_used"])}
    for lab, v in _rows(answers["memory_total"]):
        key = (*_gpu(lab), group_of(lab))
        if v > 0 and key in used_b:
            row(lab).memory_used_ratio_max = min(1.0, used_b[key] / v)
    if by == "user":
        rows = _split_by_user(rows, answers, rule_steps, w)
    _spread_per_gpu(rows, answers, steps, w.range_s)
    for _, f in rows.values():  # clamp what the resolution can leave over the observed time
        f.allocated_s = min(f.allocated_s, f.observed_s)
        f.idle_s = min(f.idle_s, f.allocated_s)
        f.outside_kubernetes_s = min(f.outside_kubernetes_s, f.allocated_s)
    return rows


def _split_by_user(rows: dict[tuple[str, str, str], tuple[str, Figures]], answers: Mapping[str, list[dict[str, Any]]],
                   rule_steps: Mapping[str, float] | None, w: q.Window,
                   ) -> dict[tuple[str, str, str], tuple[str, Figures]]:
    """--by user: each GPU's time goes to the users of its processes (split evenly among them at each step);
    what no user's process held stays with '(none)'. Energy, throttling and verdicts follow the time."""
    def secs(lab: Mapping[str, str], v: float) -> float:
        return v * (w.resolution_s if rule_steps is None else rule_steps.get(lab.get("hostname", ""), 0.0))

    share: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
    for i, name in enumerate(("user_share", "user_sm_active", "user_idle")):
        for lab, v in _rows(answers[name]):
            share[_gpu(lab)][lab.get("user") or NONE][i] += secs(lab, v)
    out: dict[tuple[str, str, str], tuple[str, Figures]] = {}
    for (host, gpu, _), (model, g) in rows.items():
        rest = Figures(observed_s=g.observed_s, allocated_s=g.allocated_s, used_s=g.used_s, idle_s=g.idle_s,
                       gpus={(host, gpu)}, memory_used_ratio_max=g.memory_used_ratio_max)
        for user, (held, sm, idle) in sorted(share.get((host, gpu), {}).items()):
            held = min(held, rest.observed_s)
            f = Figures(observed_s=held, allocated_s=held, used_s=min(sm, held), idle_s=min(idle, held),
                        gpus={(host, gpu)}, memory_used_ratio_max=g.memory_used_ratio_max)
            rest.observed_s -= f.observed_s
            rest.allocated_s = max(0.0, rest.allocated_s - f.allocated_s)
            rest.used_s = max(0.0, rest.used_s - f.used_s)
            rest.idle_s = max(0.0, rest.idle_s - f.idle_s)
            out[(host, gpu, user)] = (model, f)
        out[(host, gpu, NONE)] = (model, rest)
        part = g.observed_s or 1.0
        for key in [k for k in out if k[:2] == (host, gpu)]:
            f = out[key][1]
            k = f.observed_s / part
            f.energy_j = g.energy_j * k
            f.outside_kubernetes_s = g.outside_kubernetes_s * k
            f.throttle_s = {r: v * k for r, v in g.throttle_s.items()}
    return {k: v for k, v in out.items() if v[1].observed_s > 0 or k[2] != NONE}


def _spread_per_gpu(rows: dict[tuple[str, str, str], tuple[str, Figures]], answers: Mapping[str, list[dict[str, Any]]],
                    steps: Mapping[str, float], range_s: float) -> None:
    """What is known per GPU only (its verdicts, its unobserved time) goes to its groups by their share of
    its observed time (all of it to its one group when it stayed in one)."""
    observed: dict[tuple[str, str], float] = defaultdict(float)
    for (host, gpu, _), (_, f) in rows.items():
        observed[(host, gpu)] += f.observed_s
    verdicts: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for lab, v in _rows(answers["verdicts"]):
        s = steps.get(lab.get("hostname", ""))
        if s is not None:
            kinds = verdicts[_gpu(lab)]
            kinds[lab.get("kind", "")] = kinds.get(lab.get("kind", ""), 0.0) + v * s
    for (host, gpu, _), (_, f) in rows.items():
        seen = observed[(host, gpu)]
        k = f.observed_s / seen if seen > 0 else 0.0
        f.unobserved_s = max(0.0, range_s - seen) * k
        f.verdict_s = {kind: min(v, seen) * k for kind, v in verdicts.get((host, gpu), {}).items()}


# -- money, groups, ranking ------------------------------------------------------------------------
def _money(f: Figures, model: str, prices: Prices) -> None:
    """The one definition of the money (docs/FLEET.md): what the observed GPU-hours and their energy cost,
    what went to allocated GPU-hours the SMs did not use, and what unallocated GPU-hours cost."""
    price = prices.gpu_hour(model)
    kwh = f.energy_j / 3.6e6
    f.gpu_cost = f.observed_s / 3600 * price
    f.energy_cost = kwh * prices.energy_per_kwh
    f.wasted = max(0.0, f.allocated_s - f.used_s) / 3600 * price
    f.unallocated_cost = max(0.0, f.observed_s - f.allocated_s) / 3600 * price
    f.co2e_kg = kwh * prices.grid_kg_co2e_per_kwh


def _assemble(rows: dict[tuple[str, str, str], tuple[str, Figures]], answers: Mapping[str, list[dict[str, Any]]],
              by: str, prices: Prices, steps: Mapping[str, float], w: q.Window) -> dict[str, Any]:
    groups: dict[str, Figures] = defaultdict(Figures)
    per_gpu: dict[tuple[str, str], tuple[str, Figures]] = {}
    for (host, gpu, group), (model, f) in rows.items():
        _money(f, model, prices)
        groups[group].add(f)
        per_gpu.setdefault((host, gpu), (model, Figures()))[1].add(f)
    # The fleet's money is each GPU's, whatever the grouping: a GPU's waste is its allocated time the SMs did
    # not use, not the sum of its groups' (clamped at 0 each, they can differ where a GPU worked unallocated).
    fleet = Figures()
    for model, f in per_gpu.values():
        _money(f, model, prices)
        fleet.add(f)
    ranked = sorted(groups.items(), key=lambda kv: (-kv[1].wasted, -kv[1].unallocated_cost, kv[0]))
    out_groups = []
    for name, f in ranked:
        why, fix = explain(f)
        out_groups.append({"group": name, **figures_dict(f), "gpu_keys": sorted(f"{h}/{g}" for h, g in f.gpus),
                           "why": why, "fix": fix})
    return {"fleet": {**figures_dict(fleet), "line": fleet_line(fleet, prices, w.range_s)},
            "groups": out_groups, "prices": prices.as_dict(), "currency": prices.currency}


def figures_dict(f: Figures) -> dict[str, Any]:
    """The figures as --json writes them: hours, kWh, money, shares of observed time."""
    h = 1 / 3600
    seen = f.observed_s
    return {
        "gpus": len(f.gpus),
        "observed_gpu_hours": f.observed_s * h, "unobserved_gpu_hours": f.unobserved_s * h,
        "allocated_gpu_hours": f.allocated_s * h,
        "unallocated_gpu_hours": max(0.0, f.observed_s - f.allocated_s) * h,
        "outside_kubernetes_gpu_hours": f.outside_kubernetes_s * h,
        "used_gpu_hours": f.used_s * h, "idle_gpu_hours": f.idle_s * h,
        "throttled_hours_by_reason": {r: v * h for r, v in sorted(f.throttle_s.items()) if v > 0},
        "energy_kwh": f.energy_j / 3.6e6,
        "cost": f.gpu_cost + f.energy_cost, "gpu_cost": f.gpu_cost, "energy_cost": f.energy_cost,
        "wasted_money": f.wasted, "unallocated_money": f.unallocated_cost,
        "co2e_kg": f.co2e_kg,
        "verdict_share": {k: v / seen for k, v in sorted(f.verdict_s.items(), key=lambda kv: -kv[1])
                          if seen > 0 and v > 0},
        "memory_headroom_ratio": None if f.memory_used_ratio_max is None else 1.0 - f.memory_used_ratio_max,
    }


# -- why, and the fix ------------------------------------------------------------------------------
#: Verdicts that name no problem: they explain no waste.
_FINE = frozenset({"healthy", "compute_bound", "power_capped", "memory_bound"})


def _hours(s: float) -> str:
    h = s / 3600
    return f"{h:.3g} GPU-hours" if h < 10 else f"{h:,.0f} GPU-hours"


def _top_problem(f: Figures) -> tuple[str, float] | None:
    """The verdict (not a fine one) that held longest, with its share of the observed time."""
    kinds = [(k, v) for k, v in f.verdict_s.items() if k not in _FINE and v > 0]
    if not kinds or f.observed_s <= 0:
        return None
    kind, v = max(kinds, key=lambda kv: kv[1])
    return kind, v / f.observed_s


def _top_throttle(f: Figures) -> tuple[str, float] | None:
    reasons = [(r, v) for r, v in f.throttle_s.items() if r not in BENIGN_REASONS and v > 0]
    return max(reasons, key=lambda kv: kv[1]) if reasons else None


def explain(f: Figures) -> tuple[str, str]:
    """One line of why the group's money went where it went, and one of the fix (from the verdicts' advice)."""
    from ..diagnose.rules import ADVICE

    def advice(kind: str) -> str:
        return (ADVICE.get(kind) or [""])[0]

    if f.observed_s <= 0:
        return "never observed in the range (no samples scraped)", "Check that Prometheus scrapes its agents."
    throttle = _top_throttle(f)
    slowed = f"; clocks held down by {throttle[0]} {throttle[1] / f.observed_s:.0%} of the time" \
        if throttle and throttle[1] >= 0.05 * f.observed_s else ""
    if f.allocated_s <= 0:
        return (f"nobody held its GPUs: {_hours(f.observed_s)} unallocated, paid all the same",
                "Give these GPUs work or take them out of the fleet (scale the node pool down).")
    idle, use = f.idle_s / f.allocated_s, f.used_s / f.allocated_s
    problem = _top_problem(f)
    verdict = f"; verdict {problem[0]} {problem[1]:.0%} of the time" if problem else ""
    if idle >= 0.5:
        why = f"idle {idle:.0%} of its {_hours(f.allocated_s)} allocated (SM activity under 5 %){verdict}"
        # Work too small for the SMs (launch- or sync-bound, starved) is not a held GPU nobody uses.
        if problem and problem[0] not in ("idle_allocated", "idle") and advice(problem[0]):
            return why, advice(problem[0])
        return why, advice("idle_allocated")
    why = f"SM activity {use:.0%} of its {_hours(f.allocated_s)} allocated, idle {idle:.0%}{verdict}{slowed}"
    if problem and advice(problem[0]):
        return why, advice(problem[0])
    if slowed and throttle:
        return why, advice(_THROTTLE_ADVICE.get(throttle[0], "throttled"))
    if use >= 0.8:
        return why, "Nothing to fix: its GPUs are busy while it holds them."
    return why, advice("underutilized")


def _money_text(v: float, currency: str) -> str:
    sign = {"USD": "$", "EUR": "€", "GBP": "£"}.get(currency)
    return f"{sign}{v:,.2f}" if sign else f"{v:,.2f} {currency}"


def _span(range_s: float) -> str:
    for name, s in (("week", 7 * 86400), ("day", 86400), ("hour", 3600), ("minute", 60)):
        if abs(range_s - s) < 0.01 * s:
            return f"this {name}"
    if range_s >= 2 * 86400:
        return f"in these {range_s / 86400:.3g} days"
    if range_s >= 2 * 3600:
        return f"in these {range_s / 3600:.3g} hours"
    return f"in these {range_s / 60:.3g} minutes"


def fleet_line(f: Figures, prices: Prices, range_s: float) -> str:
    """"$X of $Y went to GPUs that were idle or starved this week": X is the money wasted (allocated, SMs
    not used) plus what unallocated GPUs cost; Y the whole cost (GPU-hours and energy)."""
    x = f.wasted + f.unallocated_cost
    y = f.gpu_cost + f.energy_cost
    share = f" ({x / y:.0%})" if y > 0 else ""
    return (f"{_money_text(x, prices.currency)} of {_money_text(y, prices.currency)}{share} went to GPUs that were "
            f"idle or starved {_span(range_s)}.")
