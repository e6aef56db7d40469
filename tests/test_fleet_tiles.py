"""The fleet report from tiles (fleet/_tiles.py): the tile group of `gpuscope fleet rules` passes `promtool check
rules` and `promtool test rules` with known input series; and over a real Prometheus and a real VictoriaMetrics
holding test_fleet_truths' simulated fleet (4 nodes x 4 GPUs, 12 h at 60 s), with 5-minute tiles recorded over its
history (`promtool tsdb create-blocks-from rules` for Prometheus, `vmalert -replay.*` for VictoriaMetrics: each
evaluates the rules over the raw history and writes what the live server would have recorded), the report
read from tiles over a range whose edges are not on tile boundaries equals the raw path's figures and the
simulation's truth over that range; a tile missing (an evaluation skipped) makes it fall back and say why.

One module fixture: the data is written once (about 10 s), the tiles recorded once per server, reports cached.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from servers import need_binary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_fleet_scale as bench  # noqa: E402
import fleet_scale_data as data  # noqa: E402
from test_fleet_rules import INPUT, gpu, k, sample  # noqa: E402
from test_fleet_truths import EXACT, STEP, World, _allowance  # noqa: E402

from gpuscope.fleet import DEFAULT_PRICES, rules_yaml  # noqa: E402
from gpuscope.fleet._compute import build  # noqa: E402
from gpuscope.fleet._tiles import MARKER, TILE_RECORDED, read_tiles, rules_group  # noqa: E402
from gpuscope.promql import Client  # noqa: E402

TILE = 300  # 5-minute tiles: 5 scrapes each, 144 over the 12 h
DELAY = 2 * STEP  # the rules' default delay: two scrape intervals
#: The range's edges, in scrape steps inside the fleet's window: 4 min after its start and before its end,
#: neither on a tile's edge (the tiles end at 3 min past every fifth minute: evaluations on the 5 min, less
#: the delay), so the report reads a head and a tail of raw series.
EDGE_STEPS = 4
#: A hole in the tiles: their evaluations are skipped for 15 minutes an hour into the data's lead-in.
HOLE = (3600, 3600 + 900)
DIMS = ("namespace", "pod", "job", "node", "model")


# -- promtool: the tile group on known input -------------------------------------------------------
def _tile_rules(tmp_path: Path, scrape_s: float = 15.0, tile_s: float = TILE) -> Path:
    path = tmp_path / "tiles.yml"
    path.write_text("\n".join(["groups:", *rules_group(scrape_s, tile_s)]) + "\n")
    return path


#: Beside test_fleet_rules' series (15 s scrapes for 10 minutes): counters, memory, a verdict, power.
COUNTERS = [
    (f"gpu_energy_joules_total{{{gpu('node-p', '0')}}}", "0+100x40"),
    # node-g's agent was not scraped from 2m to 6m; its counter kept counting (10 J a step)
    (f"gpu_energy_joules_total{{{gpu('node-g', '0')}}}", "0+10x8 _x15 240+10x16"),
    (f"gpu_throttle_seconds_total{{{gpu('node-p', '0', reason='hw_thermal_slowdown')}}}", "0+15x40"),
    (f"gpu_memory_used_bytes{{{gpu('node-p', '0')}}}", "1e9+1e8x40"),
    ("gpu_verdict{hostname=\"node-p\",gpu=\"1\",kind=\"idle\",window=\"2m\"}", "1x40"),
    (f"gpu_power_watts{{{gpu('node-p', '0')}}}", "300x40"),
]


def _expected() -> list[dict[str, Any]]:
    """What the tiles hold at the evaluation at 10m: the tile (4m30s, 9m30s], 20 scrapes of a whole series."""
    r = TILE_RECORDED

    def one(name: str, value: float, **labels: str) -> dict[str, Any]:
        return sample(r[name], value, **labels)

    at = "10m"
    return [
        {"expr": f'{r["observed"]}{{hostname="node-p"}}', "eval_time": at,
         "exp_samples": [one("observed", 20, **k("node-p", g)) for g in "012"]},
        # node-g: back at 6m, 15 scrapes in the tile
        {"expr": f'{r["observed"]}{{hostname="node-g"}}', "eval_time": at,
         "exp_samples": [one("observed", 15, **k("node-g", "0"))]},
        {"expr": f'{r["used"]}{{hostname="node-p",gpu="0"}}', "eval_time": at,
         "exp_samples": [one("used", 18, **k("node-p", "0"))]},
        {"expr": r["allocated"], "eval_time": at, "exp_samples": [
            one("allocated", 20, **k("node-k", "0", namespace="nb", pod="lab")), one("allocated", 0, **k("node-k", "1")),
            one("allocated", 20, **k("node-p", "0")), one("allocated", 20, **k("node-p", "2")),
            one("allocated", 15, **k("node-g", "0"))]},
        {"expr": r["idle_allocated"], "eval_time": at, "exp_samples": [
            one("idle_allocated", 20, **k("node-k", "0", namespace="nb", pod="lab")),
            one("idle_allocated", 0, **k("node-k", "1")), one("idle_allocated", 0, **k("node-p", "0")),
            one("idle_allocated", 20, **k("node-p", "2")), one("idle_allocated", 15, **k("node-g", "0"))]},
        # the counters: the growth between the last scrape of the tile and the last before it; node-g's
        # spans its gap (its last scrape before the tile was at 2m: 380 - 80 J)
        {"expr": r["energy"], "eval_time": at,
         "exp_samples": [one("energy", 2000, **k("node-p", "0")), one("energy", 300, **k("node-g", "0"))]},
        {"expr": r["throttle"], "eval_time": at,
         "exp_samples": [one("throttle", 300, **k("node-p", "0", reason="hw_thermal_slowdown"))]},
        {"expr": r["memory_used"], "eval_time": at, "exp_samples": [one("memory_used", 4.8e9, **k("node-p", "0"))]},
        {"expr": r["verdicts"], "eval_time": at,
         "exp_samples": [one("verdicts", 20, hostname="node-p", gpu="1", kind="idle")]},
        {"expr": r["power"], "eval_time": at, "exp_samples": [one("power", 6000, hostname="node-p")]},
        # the marker: the tile's end, and the group's tile and delay
        {"expr": MARKER, "eval_time": at,
         "exp_samples": [sample(MARKER, 570, tile_seconds="300", delay_seconds="30")]},
        {"expr": MARKER, "eval_time": "5m", "exp_samples": [sample(MARKER, 270, tile_seconds="300", delay_seconds="30")]},
        # the first evaluation after node-g's gap began: no scrape of it before the tile's (the bridge finds
        # its 2m scrape) -- and at 5m, none before 2m: its energy has no growth there, never a guess
        {"expr": f'{r["energy"]}{{hostname="node-g"}}', "eval_time": "5m", "exp_samples": []},
    ]


def test_promtool_checks_and_tests_the_tile_group(tmp_path):
    promtool = need_binary("promtool")
    rules = _tile_rules(tmp_path)
    check = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and f"SUCCESS: {len(TILE_RECORDED) + 1} rules found" in check.stdout, check.stdout
    doc = {"rule_files": [str(rules)], "evaluation_interval": "15s",
           "tests": [{"interval": "15s", "input_series": [{"series": s, "values": v} for s, v in INPUT + COUNTERS],
                      "promql_expr_test": _expected()}]}
    tests = tmp_path / "tiles_test.yml"
    tests.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr


def test_the_rule_file_holds_both_groups_and_the_tile_flag(tmp_path):
    doc = yaml.safe_load(rules_yaml(60.0, tile_s=TILE))
    assert [g["name"] for g in doc["groups"]] == ["gpuscope-fleet", "gpuscope-fleet-tiles"]
    assert doc["groups"][1]["interval"] == "300s"
    assert {r["record"] for r in doc["groups"][1]["rules"]} == {*TILE_RECORDED.values(), MARKER}
    out = tmp_path / "r.yml"
    p = subprocess.run([sys.executable, "-m", "gpuscope", "fleet", "rules", "-o", str(out), "--scrape-interval", "60s",
                        "--tile", "5m"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.returncode == 0, p.stderr
    assert out.read_text() == rules_yaml(60.0, tile_s=TILE)


# -- real servers ------------------------------------------------------------------------------------
def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class Tiled:
    """test_fleet_truths' World, with 5-minute tiles recorded over its history in both servers (but for
    HOLE, in the lead-in before the fleet's window), and the truth of the range that leaves EDGE_STEPS
    scrapes out at each end."""

    def __init__(self, work: Path) -> None:
        self.world = w = World(work)
        f = w.fleet
        self.work = work
        self.rules = _tile_rules(work, float(STEP))
        self.start, self.end = w.start + EDGE_STEPS * STEP, w.end - EDGE_STEPS * STEP
        hole = (f.t0_s + HOLE[0], f.t0_s + HOLE[1])
        spans = [(f.t0_s, hole[0]), (hole[1], w.end)]
        self._promtool(spans)
        self._vmalert(spans)
        self.truth = self._truth(f.window0 + EDGE_STEPS, f.steps - EDGE_STEPS)
        self.reports: dict[tuple[str, str, str], dict[str, Any]] = {}

    def _promtool(self, spans: list[tuple[float, float]]) -> None:
        """The tiles as Prometheus would have recorded them, into its TSDB: promtool evaluates the group over
        each span against the running server and writes blocks; then Prometheus restarts over them."""
        promtool = need_binary("promtool")
        out = self.work / "tile-blocks"
        out.mkdir()
        for a, b in spans:
            p = subprocess.run([promtool, "tsdb", "create-blocks-from", "rules", f"--start={a:.0f}", f"--end={b:.0f}",
                                f"--url={self.world.prom.url}", f"--output-dir={out}", "-q", str(self.rules)],
                               capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, p.stdout + p.stderr
        self.world.prom.stop()
        for block in out.iterdir():
            shutil.move(str(block), str(self.work / "data" / block.name))
        self.world.prom = bench.Prometheus(self.work, STEP)

    def _vmalert(self, spans: list[tuple[float, float]]) -> None:
        """The tiles as vmalert would have recorded them into VictoriaMetrics: its replay mode evaluates the group
        over each span (range queries at the group's interval) and remote-writes the results."""
        vmalert = shutil.which("vmalert")
        if vmalert is None:
            pytest.skip("vmalert is not installed (Debian: apt-get install victoria-metrics)")
        vm = self.world.vm
        for a, b in spans:
            p = subprocess.run([vmalert, f"-rule={self.rules}", f"-datasource.url={vm.url}",
                                f"-remoteWrite.url={vm.url}", f"-replay.timeFrom={_rfc3339(a)}",
                                f"-replay.timeTo={_rfc3339(b)}", "-replay.rulesDelay=0s",
                                "-replay.disableProgressBar", "-loggerLevel=ERROR"],
                               capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        vm.flush()

    def _truth(self, k_lo: int, k_hi: int) -> dict[str, dict[str, dict[str, Any]]]:
        """The simulation's truth over the steps [k_lo, k_hi): its values drawn again, block by block."""
        f = copy.copy(self.world.fleet)
        f.window0 = k_lo
        values, truth = data.Values(f), data.Truth(f)
        for k0, k1 in data.blocks(f):
            c = values.chunk(k0, k1)
            if k0 >= k_hi:
                continue
            n = min(k1, k_hi) - k0
            truth.add(dataclasses.replace(c, k1=k0 + n, sm=c.sm[:, :n], power=c.power[:, :n], mem=c.mem[:, :n],
                                          energy=c.energy[:, :n], throttle=c.throttle[:, :, :n],
                                          bits=c.bits[:, :, :n]), values.mem_total)
        return {dim: truth.groups(dim) for dim in DIMS}

    def url(self, server: str) -> str:
        return self.world.prom.url if server == "prometheus" else self.world.vm.url

    def report(self, server: str, by: str, source: str, start: float | None = None,
               end: float | None = None) -> dict[str, Any]:
        key = (server, by, source, start, end)
        if key not in self.reports:
            self.reports[key] = build(Client(self.url(server), timeout=120), start or self.start, end or self.end, by,
                                      DEFAULT_PRICES, source=source, max_tiles=72)
        return self.reports[key]

    def stop(self) -> None:
        self.world.stop()


@pytest.fixture(scope="module")
def tiled(tmp_path_factory) -> Iterator[Tiled]:
    need_binary("prometheus")
    need_binary("victoria-metrics")
    t = Tiled(tmp_path_factory.mktemp("fleet-tiles"))
    try:
        yield t
    finally:
        t.stop()


def _off(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]], dim: str, world: World,
         ) -> list[tuple[Any, ...]]:
    """The figures of `got` that differ from `want`'s: sample counts exactly (EXACT), the counters within 1 %
    and test_fleet_truths' allowance (a scrape step's growth at each of a group's segments' ends)."""
    bad: list[tuple[Any, ...]] = []
    if set(got) != {g for g, t in want.items() if t["observed_gpu_hours"] > 0}:
        bad.append(("groups", sorted(set(got) ^ {g for g, t in want.items() if t["observed_gpu_hours"] > 0})))
    for group, t in want.items():
        g = got.get(group)
        if g is None:
            continue
        for figure in ("observed_gpu_hours", "used_gpu_hours", "allocated_gpu_hours", "outside_kubernetes_gpu_hours",
                       "idle_gpu_hours"):
            if abs(g[figure] - t[figure]) > EXACT * max(1.0, t[figure]):
                bad.append((group, figure, g[figure], t[figure]))
        for figure in ("energy_kwh", "throttled_hours"):
            if abs(g[figure] - t[figure]) > 0.01 * t[figure] + _allowance(world, dim, group, figure):
                bad.append((group, figure, g[figure], t[figure]))
    return bad


@pytest.mark.parametrize("server", ["prometheus", "victoria-metrics"])
def test_the_report_reads_the_tiles_and_the_raw_edges(tiled, server):
    r = tiled.report(server, "node", "auto")
    assert r["source"] == "tiles", r.get("source_note")
    t = r["tiles"]
    assert t["tile_s"] == TILE and t["delay_s"] == DELAY
    # both edges partial: neither the range's start nor its end is on a tile's edge
    assert 0 < t["raw_head_s"] < TILE and 0 < t["raw_tail_s"] < TILE, t
    assert t["count"] == round((tiled.end - tiled.start - t["raw_head_s"] - t["raw_tail_s"]) / TILE)
    assert r["scrape_step_s"] == {h: STEP for h in tiled.world.fleet.hostname}  # read from the tiles
    assert r["subquery_resolution_s"] is None
    # a week's worth of figures in a handful of queries, every plot bucket a tile
    p = r["plots"]
    assert len(p["t_s"]) == t["count"] and all(v is not None for v in p["observed"])


#: Every dimension on Prometheus; on VictoriaMetrics the two finest (its semantics differ per function, not
#: per grouping: the rest would repeat them).
TRUTH_RUNS = [*(("prometheus", d) for d in DIMS), ("victoria-metrics", "pod"), ("victoria-metrics", "job")]


@pytest.mark.parametrize(("server", "dim"), TRUTH_RUNS)
def test_figures_from_tiles_equal_the_truth(tiled, server, dim):
    got = bench.report_groups(tiled.report(server, dim, "tiles"))
    bad = _off(got, tiled.truth[dim], dim, tiled.world)
    assert not bad, json.dumps(bad, indent=1)


@pytest.mark.parametrize("dim", ["namespace"])  # a dimension whose groups span nodes and pods
def test_figures_from_tiles_equal_the_raw_paths(tiled, dim):
    """The same range from the raw series (subqueries) and from the tiles: every figure of every group, and
    the verdict shares and memory headroom the raw path spreads the same way."""
    raw, tiles = (bench.report_groups(tiled.report("prometheus", dim, s)) for s in ("raw", "tiles"))
    bad = _off(tiles, raw, dim, tiled.world)
    assert not bad, json.dumps(bad, indent=1)
    for group, g in tiles.items():
        assert g["memory_used_ratio_max"] == pytest.approx(raw[group]["memory_used_ratio_max"], rel=1e-9)
        assert g["verdict_share"].keys() == raw[group]["verdict_share"].keys(), group
        for kind, share in g["verdict_share"].items():
            assert share == pytest.approx(raw[group]["verdict_share"][kind], rel=1e-6), (group, kind)
    a, b = (tiled.report("prometheus", dim, s) for s in ("raw", "tiles"))
    assert [g["group"] for g in a["groups"]] == [g["group"] for g in b["groups"]]  # ranked alike
    assert a["fleet"]["line"] == b["fleet"]["line"]


def test_a_missing_tile_falls_back_to_the_raw_series(tiled):
    f = tiled.world.fleet
    start, end = f.t0_s + HOLE[0] - 1800, f.t0_s + HOLE[1] + 1800  # an hour around the hole
    t = read_tiles(Client(tiled.url("prometheus")), start, end)
    assert t is not None and not t.complete and t.missing_end_s is not None
    for server in ("prometheus", "victoria-metrics"):
        r = tiled.report(server, "node", "auto", start, end)
        assert r["source"] == "raw" and "is missing" in r["source_note"], r["source_note"]
    # insisting on the tiles: one sentence, exit 1
    p = subprocess.run([sys.executable, "-m", "gpuscope", "fleet", "report", "--prometheus", tiled.url("prometheus"),
                        "--since", f"{start:.0f}", "--until", f"{end:.0f}", "--source", "tiles"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "cannot answer from tiles: the tile ending" in p.stderr and p.stderr.count("\n") == 1, p.stderr


def test_by_user_stays_on_the_raw_path(tiled):
    from gpuscope.errors import UsageError

    with pytest.raises(UsageError, match="--by user"):
        build(Client(tiled.url("prometheus")), tiled.start, tiled.end, "user", DEFAULT_PRICES, source="tiles")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
