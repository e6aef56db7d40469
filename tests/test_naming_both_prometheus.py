"""`/metrics?naming=canonical,dcgm`: the DCGM series and gpuscope's own in one exposition, each series once.

The Prometheus job is the README's own block (read out of README.md, so the two cannot drift): promtool checks
it as written, and a real Prometheus runs it against a real agent (`gpuscope agent --simulate mixed`, 8 GPUs)
on 127.0.0.1, with only the target's address and the scrape interval changed for the test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from servers import PrometheusServer, free_port, http_get, need_binary

from gpuscope import Sampler
from gpuscope.agent import config as agent_config
from gpuscope.export.exposition import render

ROOT = Path(__file__).resolve().parents[1]
README_TARGET = "localhost:9471"
# what Prometheus adds to every target: not the agent's
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_samples_post_metric_relabeling",
             "scrape_series_added"}


def readme_scrape_config() -> str:
    """The one ```yaml block of README.md that asks for naming canonical,dcgm."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    mine = [b for b in blocks if 'naming: ["canonical,dcgm"]' in b]
    assert len(mine) == 1, f"README.md should hold one such scrape config, found {len(mine)}"
    return mine[0]


def series(text: str) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """(name, labels) of every sample, in order, repeats kept."""
    return [(s.name, tuple(sorted(s.labels.items())))
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def names(text: str) -> Counter[str]:
    """How many series of each name an exposition holds, as Prometheus names them (prometheus_client's parser
    adds _total to a counter named without it, as DCGM's are)."""
    return Counter(re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines()
                   if line and not line.startswith("#"))


def test_both_namings_render_as_the_union_of_each_with_the_agents_own_series_once() -> None:
    with Sampler(simulate="mixed") as s:
        s.sample_once()
        snap = s.sample_once()
        extra = s.self_metrics()
        canonical = series(render(snap, mode="canonical", extra=extra).decode())
        dcgm = series(render(snap, mode="dcgm", extra=extra).decode())
        both = series(render(snap, mode="canonical,dcgm", extra=extra).decode())
    assert len(both) == len(set(both))  # no series twice
    own = set(extra)
    assert {n for n, _ in canonical} & {n for n, _ in dcgm} == own  # only the agent's own names are in both
    assert all(n.startswith("DCGM_FI_") for n, _ in dcgm if n not in own)
    assert not any(n.startswith("DCGM_FI_") for n, _ in canonical)
    # the canonical exposition whole, and DCGM's without its copy of the agent's own series (labelled Hostname)
    assert set(both) == set(canonical) | {x for x in dcgm if x[0] not in own}
    assert len(both) == len(canonical) + len(dcgm) - len(own)
    assert {dict(labels).get("hostname") for n, labels in both if n in own} == {snap.hostname}


def test_the_naming_is_one_of_three_in_the_config_too() -> None:
    assert agent_config.from_dict({"prometheus": {"naming": "canonical,dcgm"}}).prometheus.naming == "canonical,dcgm"
    with pytest.raises(agent_config.ConfigError, match="naming"):
        agent_config.from_dict({"prometheus": {"naming": "dcgm,canonical"}})


class Agent:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / "agent.log", "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuscope", "agent", "--simulate", "mixed",
                                      "--port", str(self.port), "--data-dir", str(tmp / "data")],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (tmp / "agent.log").read_text()
            try:
                if http_get(self.url + "/metrics", 2.0)[1]:  # once the first snapshot is in
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("the agent did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def test_one_scrape_job_from_the_readme_brings_dcgm_and_gpuscope_series_without_duplicates(tmp_path: Path) -> None:
    promtool = need_binary("promtool")
    need_binary("prometheus")
    snippet = readme_scrape_config()
    (tmp_path / "readme-prometheus.yml").write_text(snippet)
    check = subprocess.run([promtool, "check", "config", str(tmp_path / "readme-prometheus.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    [job] = yaml.safe_load(snippet)["scrape_configs"]
    assert job["static_configs"] == [{"targets": [README_TARGET]}]

    agent = Agent(tmp_path)
    try:
        status, body = http_get(agent.url + "/metrics?naming=dcgm,canonical")
        assert status == 400 and "naming must be canonical, dcgm or canonical,dcgm" in json.loads(body)["error"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{agent.port}"]}]  # the only change to the README's job
        with PrometheusServer(tmp_path, scrape_interval="1s", jobs={job["job_name"]: job}) as prom:
            sel = f'{{job="{job["job_name"]}"}}'
            dcgm = prom.wait_for(f"DCGM_FI_DEV_GPU_UTIL{sel}", lambda r: len(r) == 8)
            assert {"UUID", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION"} <= set(dcgm[0]["metric"])
            procs = prom.wait_for(f"gpu_process_memory_used_bytes{sel}", lambda r: len(r) >= 8)
            assert all({"pid", "process", "user"} <= set(r["metric"]) for r in procs)
            assert prom.wait_for(f"host_cpu_ratio{sel}", lambda r: len(r) == 1)
            ticks = prom.wait_for(f"gpuscope_sampler_ticks_total{sel}", lambda r: len(r) == 1)
            assert "hostname" in ticks[0]["metric"] and "Hostname" not in ticks[0]["metric"]

            # every name as often in Prometheus as in one exposition of the agent, and each exposition the
            # union of the two namings (processes come and go between two reads: compare until they agree)
            def agrees() -> bool:
                stored = {r["metric"]["__name__"]: int(r["value"][1])
                          for r in prom.query(f"count by (__name__) ({sel})")}
                text = {m: http_get(f"{agent.url}/metrics?naming={m}")[1].decode()
                        for m in ("canonical,dcgm", "canonical", "dcgm")}
                both = [ln.rsplit(" ", 1)[0] for ln in text["canonical,dcgm"].splitlines() if not ln.startswith("#")]
                served = names(text["canonical,dcgm"])
                return (len(both) == len(set(both)) and set(served) == set(names(text["canonical"])) | set(
                    names(text["dcgm"])) and {n: c for n, c in stored.items() if n not in SYNTHETIC} == dict(served))

            deadline = time.monotonic() + 30
            while not agrees():
                assert time.monotonic() < deadline, "Prometheus and the exposition never agreed on the series"
                time.sleep(0.5)
            _, own = http_get(prom.url + "/metrics")
            dup = re.search(rb"^prometheus_target_scrapes_sample_duplicate_timestamp_total (\S+)$", own, re.M)
            assert dup is not None and float(dup.group(1)) == 0
            [target] = prom.get_json("/api/v1/targets")["data"]["activeTargets"]
            assert target["health"] == "up" and "naming=canonical%2Cdcgm" in target["scrapeUrl"], target
    finally:
        agent.stop()
