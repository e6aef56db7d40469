"""Tiles: the report's figures recorded per GPU label set and tile (an hour by default), so a week is read as
168 samples a series instead of 10,080 raw ones, and the raw series only for the two partial tiles at the
range's edges.

`gpuscope fleet rules` writes a second rule group, evaluated once a tile. Each evaluation records, per GPU
label set (KEY), what the raw series held in the tile before it: samples scraped, SM activity summed, samples
allocated and idle while allocated, the counters' growth (split among the label sets as the raw path splits
it), the memory's peak, verdict samples, power summed; and a marker whose value is the tile's end and whose
labels say the tile's length and the delay (`gpuscope:fleet_tile:end_seconds{tile_seconds, delay_seconds}`).
The tile ends `delay` before the evaluation, so a scrape answered late (stamped at its start) is in the
store before its tile is read.

The report reads the marker's samples in the range: the whole tiles inside it (their ends A..B, one every
tile, none missing) come from the recorded series with one `sum_over_time` each; the head (start, A - tile]
and the tail (B, end] are asked of the raw series as single tiles, with the same expressions. A tile whose
evaluation is missing makes the tiles unusable for that range: `gpuscope fleet report` (fleet._compute) then
reads the recorded or raw series and says why (`source_note`), or with --source tiles stops and says so.

    >>> t = q.Tile(3600, 90, offset_s=120)
    >>> print(tile_exprs(t)["used"])
    sum by (hostname, gpu, model, namespace, pod, workload) (sum_over_time(gpu_sm_active_ratio[3599999ms] offset 120s))
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..promql import Client, duration, label_matcher, regex_alternation
from . import _queries as q

__all__ = ["BRIDGE_S", "MARKER", "TILE_RECORDED", "TILE_S", "Tiles", "answers", "edge_reasons", "edges_s", "plots",
           "read_tiles", "rules_group", "rules_yaml", "tile_exprs", "tile_steps"]

#: The rules' default tile: a week is 168 of them.
TILE_S = 3600.0
#: How far back the rules look for a counter's last sample before a tile (across a gap in scraping).
BRIDGE_S = 86400.0
#: The recorded series of the tile group: figure -> series.
TILE_RECORDED = {
    "observed": "gpuscope:gpu_info:count_tile",
    "used": "gpuscope:gpu_sm_active_ratio:sum_tile",
    "outside_kubernetes": "gpuscope:gpu_outside_kubernetes:samples_tile",
    "allocated": "gpuscope:gpu_allocated:samples_tile",
    "idle_allocated": "gpuscope:gpu_idle_allocated:samples_tile",
    "energy": "gpuscope:gpu_energy_joules:increase_tile",
    "throttle": "gpuscope:gpu_throttle_seconds:increase_tile",
    "memory_used": "gpuscope:gpu_memory_used_bytes:max_tile",
    "memory_total": "gpuscope:gpu_memory_total_bytes:max_tile",
    "verdicts": "gpuscope:gpu_verdict:count_tile",
    "power": "gpuscope:gpu_power_watts:sum_tile",
}
MARKER = "gpuscope:fleet_tile:end_seconds"
#: How each recorded figure adds up over tiles, and the labels it keeps beyond KEY's.
_MAX = frozenset({"memory_used", "memory_total"})
_EXTRA = {"throttle": ("reason",)}
_PER_GPU = {"verdicts": ("hostname", "gpu", "kind"), "power": ("hostname",)}


def _key(name: str) -> tuple[str, ...]:
    return _PER_GPU.get(name) or (*q.KEY, *_EXTRA.get(name, ()))


def tile_exprs(t: q.Tile) -> dict[str, str]:
    """Per figure, its PromQL over the one tile `t` (the window before the evaluation, less t.offset_s): the
    rules' expressions, and the report's for the raw edges."""
    key = ", ".join(q.KEY)

    def over(fn: str, metric: str, by: str = key, matchers: str = "") -> str:
        return f"{'max' if fn == 'max' else 'sum'} by ({by}) ({q._in_tile(fn + '_over_time', metric, t, matchers)})"

    return {
        "observed": over("count", "gpu_info"),
        "used": over("sum", "gpu_sm_active_ratio"),
        "outside_kubernetes": over("sum", "gpu_allocation_state", matchers='state="in_use_outside_kubernetes"'),
        "allocated": q.allocated_expr(t),
        "idle_allocated": q.step_expr("idle_allocated", t),
        "energy": q.counter_expr("energy", t),
        "throttle": _moved(q.counter_expr("throttle", t)),
        "memory_used": over("max", "gpu_memory_used_bytes"),
        "memory_total": over("max", "gpu_memory_total_bytes"),
        "verdicts": over("count", "gpu_verdict", "hostname, gpu, kind", f'window="{q.VERDICT_WINDOW}"'),
        "power": over("sum", "gpu_power_watts", "hostname"),
    }


def _moved(expr: str) -> str:
    """Only the label sets whose counter grew: most clock-event reasons never move on most GPUs, and a tile of 0
    adds nothing to a sum (a week's throttle tiles were 73,000 series of mostly zeros, 2 s to read)."""
    return f"({expr} > 0)"


def rules_group(scrape_interval_s: float, tile_s: float = TILE_S, delay_s: float | None = None,
                bridge_s: float = BRIDGE_S) -> list[str]:
    """The tile group's lines of the rule file (under `groups:`). A counter's last sample before a tile is
    looked for up to `bridge_s` back (at least a tile): a GPU back from a gap (not scraped, powered off) has
    its growth after the gap counted, as the raw path's subqueries count it."""
    fresh = 1.5 * scrape_interval_s
    delay = 2 * scrape_interval_s if delay_s is None else delay_s
    t = q.Tile(tile_s, fresh, offset_s=delay, bridge_s=max(bridge_s, tile_s))
    lines = ["  - name: gpuscope-fleet-tiles", f"    interval: {duration(tile_s)}", "    rules:"]
    for name, expr in tile_exprs(t).items():
        lines += [f"      - record: {TILE_RECORDED[name]}", f"        expr: {json.dumps(expr)}"]
    lines += [f"      - record: {MARKER}", f"        expr: {json.dumps(f'vector(time() - {delay:g})')}",
              "        labels:", f'          tile_seconds: "{tile_s:g}"', f'          delay_seconds: "{delay:g}"']
    return lines


def rules_yaml(scrape_interval_s: float, interval_s: float | None = None, tile_s: float = TILE_S) -> str:
    """The rule file `gpuscope fleet rules` writes: the per-evaluation group (fleet._queries.rules_yaml) and
    the tile group, evaluated every `tile_s`.

    >>> import yaml
    >>> [g["interval"] for g in yaml.safe_load(rules_yaml(15.0, tile_s=300))["groups"]]
    ['15s', '300s']
    """
    head = [f"# Then the tiles: per GPU label set and tile of {tile_s:g} s, what the raw series held in it (the report",
            "# reads a range's whole tiles from them, and the raw series only for its two partial edges)."]
    return q.rules_yaml(scrape_interval_s, interval_s) + "\n".join(head + rules_group(scrape_interval_s, tile_s)) + "\n"


@dataclass(frozen=True)
class Tiles:
    """The recorded tiles of a range: their length and delay, the first and last tile's ends (A, B), how many
    there are, how many a complete record would hold, and the end of the first one missing (None if none)."""

    tile_s: float
    delay_s: float
    first_end_s: float
    last_end_s: float
    count: int
    expected: int
    missing_end_s: float | None = None

    @property
    def complete(self) -> bool:
        return self.count >= 1 and self.count == self.expected and self.missing_end_s is None

    @property
    def start_s(self) -> float:
        return self.first_end_s - self.tile_s


def read_tiles(client: Client, start_s: float, end_s: float) -> Tiles | None:
    """The marker's tiles whose whole span lies in (start_s, end_s]: those of the rule group (tile length,
    delay) that has the most of them; None where there are none. A tile missing between the first and the
    last (an evaluation the server skipped, a restart) makes them incomplete: `missing_end_s` says which;
    tiles missing at the range's edges only make its raw edges longer."""
    slack = 86400.0  # delays up to a day: the marker's samples are stamped tile end + delay
    data = client.api("/api/v1/query", [("query", f"{MARKER}[{duration(end_s + slack - start_s)}]"),
                                        ("time", f"{end_s + slack:.3f}")])
    raw = data.get("result") if isinstance(data, dict) and data.get("resultType") == "matrix" else None
    best: Tiles | None = None
    for series in raw if isinstance(raw, list) else []:
        if not isinstance(series, dict):
            continue
        labels = series.get("metric") or {}
        try:
            tile, delay = float(labels.get("tile_seconds", "")), float(labels.get("delay_seconds", ""))
            ends = sorted({round(float(v), 3) for _, v in series.get("values") or []})
        except (TypeError, ValueError):
            continue
        if not (tile > 0 and math.isfinite(tile) and math.isfinite(delay)):
            continue
        inside = [e for e in ends if start_s + tile - 0.0005 <= e <= end_s + 0.0005]
        if not inside:
            continue
        a, b = inside[0], inside[-1]
        missing = next((x + tile for x, y in zip(inside, inside[1:], strict=False) if abs(y - x - tile) > 0.002),
                       None)
        found = Tiles(tile, delay, a, b, len(inside), round((b - a) / tile) + 1, missing)
        if best is None or found.count > best.count:
            best = found
    return best


def tile_steps(client: Client, t: Tiles) -> dict[str, float]:
    """Each host's scrape step from its tiles: a tile's length over the samples its densest GPU (all its label
    sets together) had in it, at the count most tiles had (a tile with a gap in scraping, or the node's
    first or last, has fewer). Exact where the step divides the tile; where it does not, whole tiles hold
    either of the two counts about tile / step, and a count next to the commonest one that a quarter as many
    tiles or more had is averaged in (within a sample over all those tiles).

    >>> _step_of([5] * 8 + [4, 1], 300.0), _step_of([514] * 5 + [515] * 2 + [200], 3600.0)
    (60.0, 7.0)
    """
    span = duration(t.tile_s - 0.001)
    expr = f"max by (hostname) (sum by (hostname, gpu) (sum_over_time({TILE_RECORDED['observed']}[{span}])))"
    per: dict[str, list[float]] = {}
    for r in client.query_range(expr, t.first_end_s + t.delay_s, t.last_end_s + t.delay_s, t.tile_s):
        host = (r.get("metric") or {}).get("hostname", "")
        for _, v in r.get("values") or []:
            try:
                n = float(v)
            except (TypeError, ValueError):
                continue
            if n >= 1 and math.isfinite(n):
                per.setdefault(host, []).append(n)
    return {host: _step_of(counts, t.tile_s) for host, counts in per.items()}


def _step_of(counts: list[float], tile_s: float) -> float:
    from collections import Counter

    seen = Counter(round(n) for n in counts)
    mode, times = max(seen.items(), key=lambda kv: (kv[1], kv[0]))
    near = {n: c for n, c in seen.items() if n == mode or (abs(n - mode) == 1 and 4 * c >= times)}
    return tile_s * sum(near.values()) / sum(n * c for n, c in near.items())


def edges_s(t: Tiles, start_s: float, end_s: float) -> tuple[float, float]:
    """Seconds of the range's head (start, A - tile] and tail (B, end], read from the raw series."""
    return t.start_s - start_s, end_s - t.last_end_s


def edge_reasons(client: Client, t: Tiles, start_s: float, end_s: float) -> list[str]:
    """The clock-event reasons whose counters moved in the range's edges (or between an edge and the last
    sample before it): only those are asked of the edges, one query each (a server's cost of joining a
    counter's series grows faster than their number: one query for all reasons took 7 s an edge at 512 GPUs)."""
    parts = []
    for edge_end, length in zip((t.start_s, end_s), edges_s(t, start_s, end_s), strict=True):
        if length >= 0.002:
            off = end_s - edge_end
            sel = f"gpu_throttle_seconds_total[{duration(length + t.tile_s)}]" + (
                f" offset {duration(off)}" if off >= 0.0005 else "")
            parts.append(f"group by (reason) (changes({sel}) > 0)")
    if not parts:
        return []
    rows = client.query(" or ".join(parts), end_s)
    return sorted({r for x in rows if (r := (x.get("metric") or {}).get("reason", ""))})


#: The counters whose edges are split here (fleet._queries.split_counter), not by the server.
_SPLIT = ("energy", "throttle")


def _plan(t: Tiles, w: q.Window, start_s: float, end_s: float, by_labels: tuple[str, ...],
          reasons: list[str] | None = None) -> list[tuple[str, str, float]]:
    """(name, expr, time) of every query: the recorded tiles, then the raw head and tail. A counter's edge is
    asked as counter_parts' queries, named `<figure>~<edge>~<part>`, its throttling only for the reasons in
    `reasons` (all where None)."""
    out = []
    span = duration(t.last_end_s - t.start_s - 0.001)
    for name, series in TILE_RECORDED.items():
        if name == "power":
            continue
        labels = _PER_GPU.get(name) or (*by_labels, *_EXTRA.get(name, ()))
        fn = "max" if name in _MAX else "sum"
        out.append((name, f"{fn} by ({', '.join(labels)}) ({fn}_over_time({series}[{span}]))",
                    t.last_end_s + t.delay_s))
    head, tail = edges_s(t, start_s, end_s)
    for edge, (edge_end, length) in enumerate(((t.start_s, head), (end_s, tail))):
        if length < 0.002:  # nothing but an edge of a millisecond: at most a sample on its boundary
            continue
        # a counter's last sample before the edge looked for a tile further back, not the rules' day: that
        # would read a day of every counter's samples for two edges of an hour or less
        tile = q.Tile(length, w.fresh_s, 0.0, w.allocation, bridge_s=length + t.tile_s)
        for name, expr in tile_exprs(tile).items():
            if name in ("power", *_SPLIT):
                continue
            labels = _PER_GPU.get(name) or (*by_labels, *_EXTRA.get(name, ()))
            fn = "max" if name in _MAX else "sum"
            out.append((name, f"{fn} by ({', '.join(labels)}) ({expr})", edge_end))
        for name in _SPLIT:
            matchers = ""
            if name == "throttle" and reasons is not None:
                if not reasons:
                    continue
                matchers = label_matcher("reason", regex_alternation(reasons), "=~")
            for part, expr in q.counter_parts(name, tile, matchers).items():
                out.append((f"{name}~{edge}~{part}", expr, edge_end))
    return out


def answers(client: Client, t: Tiles, w: q.Window, start_s: float, end_s: float, by_labels: tuple[str, ...],
            run: Any) -> dict[str, list[dict[str, Any]]]:
    """The report's answers (figure -> instant-query rows, as the raw path's) from the tiles and the edges:
    the rows of a figure's queries put together (the memory's peaks: the larger of each label set's; a
    counter's edges split here and summed by the report's labels)."""
    plan = _plan(t, w, start_s, end_s, by_labels, edge_reasons(client, t, start_s, end_s))
    got = run({f"{name}#{i}": (expr, at) for i, (name, expr, at) in enumerate(plan)})
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in TILE_RECORDED if name != "power"}
    peaks: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in _MAX}
    parts: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    at_of: dict[tuple[str, str], float] = {}
    for full, rows in got.items():
        name, i = full.split("#", 1)
        at = plan[int(i)][2]
        if "~" in name:
            figure, edge, part = name.split("~")
            parts.setdefault((figure, edge), {})[part] = rows
            at_of[(figure, edge)] = at
            continue
        if name not in _MAX:
            out[name].extend(rows)
            continue
        for r in rows:
            k = json.dumps(r.get("metric") or {}, sort_keys=True)
            old = peaks[name].get(k)
            if old is None or _num(r) > _num(old):
                peaks[name][k] = r
    for name, rows_by in peaks.items():
        out[name] = list(rows_by.values())
    for (figure, edge), rows_of in parts.items():
        labels = (*by_labels, *_EXTRA.get(figure, ()))
        sums: dict[tuple[str, ...], float] = {}
        for lab, v in q.split_counter(figure, rows_of):
            if figure == "throttle" and not v > 0:  # as _moved: only the label sets whose counter grew
                continue
            k = tuple(lab.get(x, "") for x in labels)
            sums[k] = sums.get(k, 0.0) + v
        at = at_of[(figure, edge)]
        out[figure].extend({"metric": {x: v for x, v in zip(labels, k, strict=True) if v}, "value": [at, repr(v)]}
                           for k, v in sums.items())
    out["throttle:all"] = out.pop("throttle")
    return out


def _num(r: Mapping[str, Any]) -> float:
    try:
        return float(r["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return -math.inf


def plot_exprs(bucket_s: float) -> dict[str, str]:
    """The plots' range queries over the recorded tiles, a bucket being a whole number of tiles."""
    span = duration(bucket_s - 0.001)
    return {
        "observed": f"sum by (hostname) (sum_over_time({TILE_RECORDED['observed']}[{span}]))",
        "used": f"sum by (hostname) (sum_over_time({TILE_RECORDED['used']}[{span}]))",
        "allocated": f"sum by (hostname) (sum_over_time({TILE_RECORDED['allocated']}[{span}]))",
        "idle_allocated": f"sum by (hostname) (sum_over_time({TILE_RECORDED['idle_allocated']}[{span}]))",
        "power": f"sum by (hostname) (sum_over_time({TILE_RECORDED['power']}[{span}]))",
    }


def plots(client: Client, t: Tiles, start_s: float, steps: Mapping[str, float], points: int,
          range_query: Any) -> dict[str, Any]:
    """Per bucket (a whole number of tiles, at most `points` buckets over the tiles): GPU-seconds observed,
    allocated, idle and used per second of the bucket, and power (W); the edges are not plotted."""
    n = t.count
    per = max(1, math.ceil(n / points))
    bucket = per * t.tile_s
    buckets = n // per
    last = t.last_end_s
    first = last - (buckets - 1) * bucket
    out: dict[str, Any] = {"t_s": [round(first + i * bucket - start_s, 3) for i in range(buckets)]}

    def one(expr: str) -> list[float | None]:
        sums: list[float | None] = [None] * buckets
        for r in range_query(expr, first + t.delay_s, last + t.delay_s, bucket):
            s = steps.get((r.get("metric") or {}).get("hostname", ""))
            if s is None:
                continue
            for ts, v in r.get("values") or []:
                i = round((float(ts) - t.delay_s - first) / bucket)
                try:
                    x = float(v)
                except (TypeError, ValueError):
                    continue
                if 0 <= i < buckets and math.isfinite(x):
                    sums[i] = (sums[i] or 0.0) + x * s / bucket
        return sums

    from concurrent.futures import ThreadPoolExecutor

    exprs = plot_exprs(bucket)
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(one, expr) for name, expr in exprs.items()}
        for name, fut in futures.items():
            out[name] = fut.result()
    return out
