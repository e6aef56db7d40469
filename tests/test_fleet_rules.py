"""`gpuscope fleet rules`: the recording rules pass `promtool check rules`, and `promtool test rules` with input
series and expected samples: allocation on and off Kubernetes, idle while allocated, a GPU shared by two users,
a gap in scraping (a series stops: it is absent once its last sample is older than 1.5 scrape steps, where
a bare selector would carry the last value for the 5-minute lookback). The rules and the report's subqueries are built
from the same per-tile expressions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from servers import need_binary

from gpuscope.fleet import RECORDED, rules_yaml
from gpuscope.fleet._queries import STEP, Tile, Window, group_labels, step_expr, subquery_expr
from gpuscope.fleet._tiles import TILE_RECORDED

ROOT = Path(__file__).resolve().parents[1]


def fleet_rules(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuscope", "fleet", "rules", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def gpu(host: str, g: str, **extra: str) -> str:
    labels = {"hostname": host, "gpu": g, "model": "NVIDIA H200", **extra}
    return ",".join(f'{k}="{v}"' for k, v in labels.items())


# Every 15 s for 10 minutes (41 samples), except where a series says otherwise.
N = "1x40"
INPUT = [
    # node-k GPU 0: a pod holds it and it is idle (allocated_idle); GPU 1: nobody holds it (unallocated).
    (f"gpu_info{{{gpu('node-k', '0', namespace='nb', pod='lab')}}}", N),
    (f"gpu_sm_active_ratio{{{gpu('node-k', '0', namespace='nb', pod='lab')}}}", "0x40"),
    # (a held GPU's own series carry its pod's labels, the state series too)
    (f"gpu_allocation_state{{{gpu('node-k', '0', namespace='nb', pod='lab', state='allocated_idle')}}}", N),
    (f"gpu_allocation_state{{{gpu('node-k', '0', namespace='nb', pod='lab', state='unallocated')}}}", "0x40"),
    (f"gpu_allocation_state{{{gpu('node-k', '0', namespace='nb', pod='lab', state='in_use_by_pod')}}}", "0x40"),
    (f"gpu_info{{{gpu('node-k', '1')}}}", N),
    (f"gpu_sm_active_ratio{{{gpu('node-k', '1')}}}", "0x40"),
    (f"gpu_allocation_state{{{gpu('node-k', '1', state='unallocated')}}}", N),
    (f"gpu_allocation_state{{{gpu('node-k', '1', state='allocated_idle')}}}", "0x40"),
    # ... a process of a login session on GPU 1 of node-k is in_use_outside_kubernetes from 5m on
    # (not modelled here: the state series say it, and they are above).
    # node-p (no Kubernetes) GPU 0: alice's job, busy. GPU 1: nothing runs. GPU 2: alice and bob, nearly idle.
    (f"gpu_info{{{gpu('node-p', '0')}}}", N),
    (f"gpu_sm_active_ratio{{{gpu('node-p', '0')}}}", "0.9x40"),
    (f"gpu_process_memory_used_bytes{{{gpu('node-p', '0', pid='11', user='alice')}}}", "1e9x40"),
    (f"gpu_info{{{gpu('node-p', '1')}}}", N),
    (f"gpu_sm_active_ratio{{{gpu('node-p', '1')}}}", "0x40"),
    (f"gpu_info{{{gpu('node-p', '2')}}}", N),
    (f"gpu_sm_active_ratio{{{gpu('node-p', '2')}}}", "0.02x40"),
    (f"gpu_process_memory_used_bytes{{{gpu('node-p', '2', pid='21', user='alice')}}}", "1e9x40"),
    (f"gpu_process_memory_used_bytes{{{gpu('node-p', '2', pid='22', user='bob')}}}", "1e9x40"),
    (f"gpu_process_memory_used_bytes{{{gpu('node-p', '2', pid='23', user='bob')}}}", "1e9x40"),
    (f"gpu_process_memory_used_bytes{{{gpu('node-p', '2', pid='other', process='other')}}}", "1e9x40"),
    # node-g: scraped until 2m, then nothing (its agent stopped) until 6m, then again.
    (f"gpu_info{{{gpu('node-g', '0')}}}", "1x8 _x15 1x16"),
    (f"gpu_sm_active_ratio{{{gpu('node-g', '0')}}}", "0x8 _x15 0x16"),
    (f"gpu_process_memory_used_bytes{{{gpu('node-g', '0', pid='31', user='carol')}}}", "1e9x8 _x15 1e9x16"),
]


def sample(name: str, value: float, **labels: str) -> dict[str, object]:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"labels": f"{name}{{{inner}}}", "value": value}


def k(host: str, g: str, **extra: str) -> dict[str, str]:
    return {"hostname": host, "gpu": g, "model": "NVIDIA H200", **extra}


def expected_at_4m() -> list[dict[str, object]]:
    """What each recorded series holds at 4m (node-g inside its gap)."""
    alloc = RECORDED["allocated"]
    idle = RECORDED["idle_allocated"]
    share = RECORDED["user_share"]
    sm = RECORDED["user_sm_active"]
    uidle = RECORDED["user_idle"]
    return [
        {"expr": RECORDED["observed"], "eval_time": "4m", "exp_samples": [
            sample(RECORDED["observed"], 1, **k("node-k", "0", namespace="nb", pod="lab")),
            sample(RECORDED["observed"], 1, **k("node-k", "1")),
            *(sample(RECORDED["observed"], 1, **k("node-p", g)) for g in "012")]},
        # samples in the interval before 4m (one scrape) while held; node-k GPU 1's state says nobody
        {"expr": alloc, "eval_time": "4m", "exp_samples": [
            sample(alloc, 1, **k("node-k", "0", namespace="nb", pod="lab")), sample(alloc, 0, **k("node-k", "1")),
            sample(alloc, 1, **k("node-p", "0")), sample(alloc, 1, **k("node-p", "2"))]},
        {"expr": idle, "eval_time": "4m", "exp_samples": [
            sample(idle, 1, **k("node-k", "0", namespace="nb", pod="lab")), sample(idle, 0, **k("node-k", "1")),
            sample(idle, 0, **k("node-p", "0")), sample(idle, 1, **k("node-p", "2"))]},
        {"expr": share, "eval_time": "4m", "exp_samples": [
            sample(share, 1, **k("node-p", "0", user="alice")), sample(share, 0.5, **k("node-p", "2", user="alice")),
            sample(share, 0.5, **k("node-p", "2", user="bob"))]},
        {"expr": sm, "eval_time": "4m", "exp_samples": [
            sample(sm, 0.9, **k("node-p", "0", user="alice")), sample(sm, 0.01, **k("node-p", "2", user="alice")),
            sample(sm, 0.01, **k("node-p", "2", user="bob"))]},
        {"expr": uidle, "eval_time": "4m", "exp_samples": [
            sample(uidle, 0.5, **k("node-p", "2", user="alice")), sample(uidle, 0.5, **k("node-p", "2", user="bob"))]},
    ]


def _tests_file(tmp_path: Path) -> Path:
    rules = tmp_path / "rules.yml"
    p = fleet_rules("-o", str(rules), "--scrape-interval", "15s")
    assert p.returncode == 0, p.stderr
    gap = [
        # node-g's last sample before the gap is at 2m: at 2m15s it is 15 s old (fresh), at 2m30s 30 s old
        # (more than 1.5 steps): gone, and back at 6m.
        {"expr": f'{RECORDED["observed"]}{{hostname="node-g"}}', "eval_time": "2m15s",
         "exp_samples": [sample(RECORDED["observed"], 1, **k("node-g", "0"))]},
        {"expr": f'{RECORDED["observed"]}{{hostname="node-g"}}', "eval_time": "2m30s", "exp_samples": []},
        {"expr": f'{RECORDED["idle_allocated"]}{{hostname="node-g"}}', "eval_time": "4m", "exp_samples": []},
        {"expr": f'{RECORDED["user_share"]}{{hostname="node-g"}}', "eval_time": "4m", "exp_samples": []},
        {"expr": f'{RECORDED["idle_allocated"]}{{hostname="node-g"}}', "eval_time": "7m",
         "exp_samples": [sample(RECORDED["idle_allocated"], 1, **k("node-g", "0"))]},
        # the contrast: the bare selector carries the last value over the gap
        {"expr": 'gpu_info{hostname="node-g"}', "eval_time": "4m",
         "exp_samples": [sample("gpu_info", 1, **k("node-g", "0"))]},
        # step-sums over the range, as the report asks for them: of the 41 evaluations in [0, 10m], node-g
        # is observed at the 9 up to 2m, at 2m15s (its last sample still fresh) and at the 17 from 6m on
        {"expr": f'sum_over_time({RECORDED["observed"]}{{hostname="node-g"}}[10m])', "eval_time": "10m",
         "exp_samples": [{"labels": '{gpu="0",hostname="node-g",model="NVIDIA H200"}', "value": 27}]},
    ]
    doc = {"rule_files": [str(rules)], "evaluation_interval": "15s",
           "tests": [{"interval": "15s", "input_series": [{"series": s, "values": v} for s, v in INPUT],
                      "promql_expr_test": expected_at_4m() + gap}]}
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_promtool_checks_and_tests_the_rules(tmp_path):
    promtool = need_binary("promtool")
    tests = _tests_file(tmp_path)
    check = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True,
                           timeout=60)
    rules = len(RECORDED) + len(TILE_RECORDED) + 1  # the tile group too (tests/test_fleet_tiles.py), its marker
    assert check.returncode == 0 and f"SUCCESS: {rules} rules found" in check.stdout, check.stdout + check.stderr
    run = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_promtool_test_fails_on_a_wrong_expectation(tmp_path):
    """The unit test above can fail: one expected value changed, and promtool says so."""
    promtool = need_binary("promtool")
    tests = _tests_file(tmp_path)
    doc = yaml.safe_load(tests.read_text())
    doc["tests"][0]["promql_expr_test"][3]["exp_samples"][1]["value"] = 1  # alice's share of a GPU she shares
    tests.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "FAILED" in (run.stdout + run.stderr)


def test_rules_and_subqueries_share_their_definitions():
    doc = yaml.safe_load(rules_yaml(15.0))
    rules = {r["record"]: r["expr"] for r in doc["groups"][0]["rules"]}
    assert doc["groups"][0]["interval"] == "15s"
    assert set(rules) == set(RECORDED.values())
    w = Window(range_s=7 * 86400, resolution_s=15.0, fresh_s=22.5, step_s=2520.0)
    for name in STEP:
        tile = Tile(15.0, 22.5)
        assert rules[RECORDED[name]] == step_expr(name, tile)
        # a subquery's tile is the rules' interval
        assert step_expr(name, tile) in subquery_expr(name, group_labels("namespace"), replace(w, range_s=15.0))
    assert yaml.safe_load(rules_yaml(30.0, 60.0))["groups"][0]["interval"] == "60s"


def test_rules_to_stdout_and_to_a_file(tmp_path):
    p = fleet_rules()
    assert p.returncode == 0 and p.stderr == ""
    assert yaml.safe_load(p.stdout) == yaml.safe_load(rules_yaml(15.0))
    out = tmp_path / "r.yml"
    p = fleet_rules("--output", str(out), "--scrape-interval", "30s", "--interval", "1m")
    assert p.returncode == 0 and "wrote" in p.stderr and p.stdout == ""
    assert out.read_text() == rules_yaml(30.0, 60.0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
