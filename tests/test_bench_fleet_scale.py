"""benchmarks/bench_fleet_scale.py end to end in its quick mode (4 nodes x 8 GPUs x 1 day at 60 s): the
fleet's day written as OpenMetrics, backfilled by a real promtool into a real Prometheus, the fleet report
and the query_range peer run against it, their figures checked against the data's own truths.

One test, one run of the script (~20 s): a module fixture would run once per xdist worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from servers import need_binary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fleet_scale_data as data  # noqa: E402

NODES, GPUS, DAYS, STEP = 4, 8, 1, 60


def test_quick_mode_end_to_end(tmp_path: Path) -> None:
    need_binary("prometheus")
    need_binary("promtool")
    out = tmp_path / "result.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fleet_scale.py"), "--nodes", str(NODES),
                        "--gpus", str(GPUS), "--days", str(DAYS), "--step", str(STEP), "--settle", "0",
                        "--by", "namespace", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    # exit 1 says some figure of the report disagrees with the truths (what is asserted on is below)
    assert p.returncode in (0, 1), p.stdout[-3000:] + p.stderr[-3000:]
    run = json.loads(out.read_text())

    # generator -> OpenMetrics -> promtool -> Prometheus -> query_range -> client-side sums: nothing lost
    for dim in data.DIMS:
        check = run["checks"][f"peer vs truth --by {dim}"]
        assert check["disagreements"] == 0, (dim, check)
        assert check["largest"] < 1e-6, (dim, check)  # the peer keeps SM activity as float32

    # the truths follow the plan: node 1 is powered off for 6 h, node 2 not scraped for 45 min
    t = run["truth_fleet"]
    assert t["observed_gpu_hours"] == pytest.approx(NODES * GPUS * DAYS * 24 - GPUS * 6 - GPUS * 0.75)
    assert 0 < t["idle_gpu_hours"] < t["allocated_gpu_hours"] < t["observed_gpu_hours"]
    assert 0 < t["used_gpu_hours"] < t["observed_gpu_hours"]
    assert t["outside_kubernetes_gpu_hours"] > 0  # every kind of allocation has some time
    assert run["fleet"]["backfill"]["samples"] > NODES * GPUS * DAYS * 1440 * 10

    # the report ran, was measured, and its Prometheus query log was read
    rep = run["report"]["namespace"]
    assert rep["rc"] == 0, rep.get("output")
    assert rep["source"] == "raw"
    assert rep["queries"] >= 10 and rep["server_s"] > 0
    assert rep["wall_s"] > 0 and rep["peak_rss_mb"] > 20
    assert run["peer"]["queries"] == NODES * 7 and run["peer"]["wall_s"] > 0

    # its observed and used hours are the truths, and it has every group the truths have
    by_figure = run["checks"]["report vs truth --by namespace"]["by_figure"]
    assert "observed_gpu_hours" not in by_figure and "used_gpu_hours" not in by_figure, by_figure
    assert "(group)" not in by_figure, by_figure
