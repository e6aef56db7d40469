"""Cross-node stragglers (gpuscope.fleet._stragglers) over a real Prometheus.

Known answers: six simulated agents, each its own node (GPUSCOPE_NODE_NAME), 2 GPUs each, scraped every second
by a real Prometheus on 127.0.0.1. Job `pretrain` spans node-a, node-b (healthy) and node-c (scenario
`throttled`: thermal reasons held all the time, SM clock 1110 MHz against 1980); job `finetune` spans node-e
(healthy) and node-f (`input_starved`: idle between bursts, NVML's gpu_idle most of the time); job `solo` runs on
node-d alone (healthy, 2 GPUs). The stragglers are node-c's GPUs, throttled, and node-f's, input; no other GPU
is named. Then the order of the checks on figures a synchronous job would show (the waiting peers look idle),
and link, host CPU and SM-imbalance causes, on figures built here: the simulator has no such node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from servers import PrometheusServer, free_port, http_get, need_binary

from gpuscope.diagnose.thresholds import DEFAULT
from gpuscope.errors import UsageError
from gpuscope.fleet._stragglers import CAUSES, Straggler, _Gpu, _job_stragglers, find_stragglers

NODES = {  # node -> (scenario, simulated workload id)
    "node-a": ("healthy", "pretrain"), "node-b": ("healthy", "pretrain"), "node-c": ("throttled", "pretrain"),
    "node-d": ("healthy", "solo"),
    "node-e": ("healthy", "finetune"), "node-f": ("input_starved", "finetune"),
}
SCRAPED_S = 40  # seconds of scrapes the answers are computed over


class Agent:
    def __init__(self, workdir: Path, node: str, scenario: str, workload: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "agent.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuscope", "agent", "--simulate", scenario, "--gpus", "2",
             "--simulate-workload", workload, "--port", str(self.port), "--data-dir", str(workdir / "data")],
            env={**os.environ, "GPUSCOPE_NODE_NAME": node}, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()
        try:
            return b"gpu_process_memory_used_bytes{" in http_get(self.url + "/metrics", 2.0)[1]
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


class PromQuery:
    """find_stragglers' `query`: a real Prometheus's /api/v1/query through urllib; keeps what it was asked
    and what kind of answer came back."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.asked: list[str] = []
        self.kinds: set[str] = set()
        self.rows = 0

    def __call__(self, promql: str, at_s: float) -> list[tuple[dict[str, str], float]]:
        self.asked.append(promql)
        qs = urllib.parse.urlencode({"query": promql, "time": f"{at_s:.3f}"})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{qs}", timeout=10) as r:
                doc = json.load(r)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{promql}: HTTP {e.code}: {e.read()[:500]!r}") from None
        assert doc["status"] == "success", doc
        self.kinds.add(doc["data"]["resultType"])
        self.rows += len(doc["data"]["result"])
        return [(x["metric"], float(x["value"][1])) for x in doc["data"]["result"]]


def test_over_a_real_prometheus_the_throttled_and_the_starved_node_are_named_with_their_cause(tmp_path: Path) -> None:
    """One test, so that the agents and Prometheus start once whatever pytest -n does with the module."""
    need_binary("prometheus")
    agents = {node: Agent(tmp_path / node, node, *spec) for node, spec in NODES.items()}
    prom = None
    try:
        deadline = time.monotonic() + 60
        while not all(a.ready() for a in agents.values()):
            assert time.monotonic() < deadline, "the agents did not start in 60 s"
            time.sleep(0.2)
        prom = PrometheusServer(tmp_path, targets=[f"127.0.0.1:{a.port}" for a in agents.values()],
                                scrape_interval="1s")
        prom.wait_for('count by (hostname) (gpu_sm_clock_hertz{workload!=""})',
                      lambda r: len(r) == len(NODES), timeout=30)
        start = time.time()
        time.sleep(SCRAPED_S)
        end = time.time()
        _known_answers(prom.url, start, end)
    finally:
        if prom is not None:
            prom.stop()
        for a in agents.values():
            a.stop()


def _known_answers(url: str, start: float, end: float) -> None:
    query = PromQuery(url)
    found = find_stragglers(query, start, end)
    got = {(s.workload, s.node, s.gpu, s.cause) for s in found}
    assert got == {("torchrun/pretrain", "node-c", "0", "throttled"), ("torchrun/pretrain", "node-c", "1", "throttled"),
                   ("torchrun/finetune", "node-f", "0", "input"), ("torchrun/finetune", "node-f", "1", "input")}, \
        "\n".join(s.evidence for s in found)
    for s in found:  # shown with pytest -s
        print(f"{s.workload} {s.node}/{s.gpu} {s.cause}: {s.evidence}")
    by = {(s.node, s.gpu): s for s in found}
    hot = by[("node-c", "0")]
    # the scenario's own figures: sw_thermal + hw_thermal set on every tick, SM clock 1110 MHz, peers' 1980 MHz
    assert "hw_thermal, sw_thermal" in hot.evidence and "1110 MHz" in hot.evidence and "1980 MHz" in hot.evidence
    assert hot.values["throttle_share"] > 0.9 and hot.values["peer_throttle_share"] == 0.0
    assert hot.values["sm_clock_hz"] == pytest.approx(1110e6) and hot.values["peer_sm_clock_hz"] == pytest.approx(1980e6)
    assert "cooling" in hot.fix
    starved = by[("node-f", "1")]
    # input_starved: ~8 % of each 2.5 s cycle busy, idle (gpu_idle) the rest; its healthy peer never idle
    assert 0.5 < starved.values["idle_share"] <= 1.0 and starved.values["peer_idle_share"] < DEFAULT.gap_share
    assert "DataLoader" in starved.fix
    assert all(s.evidence.count("\n") == 0 and s.fix.count("\n") == 0 for s in found)
    # server-side aggregation: a few instant queries, each answered with a vector of a few rows per GPU
    assert query.kinds == {"vector"} and len(query.asked) <= 12
    assert query.rows <= len(query.asked) * len(NODES) * 2 * 11

    # a job on one healthy node (2 GPUs) has no straggler; asking for one job answers for that job alone
    assert find_stragglers(PromQuery(url), start, end, workloads=["torchrun/solo"]) == []
    only = find_stragglers(PromQuery(url), start, end, workloads=["torchrun/pretrain"])
    assert {(s.node, s.cause) for s in only} == {("node-c", "throttled")}
    # 5 s of 1 s scrapes: fewer than min_samples per GPU, so nothing is compared
    assert find_stragglers(PromQuery(url), end - 5, end) == []


@pytest.mark.parametrize("start, end", [(100.0, 100.0), (200.0, 100.0), (float("nan"), 100.0)])
def test_an_empty_range_is_one_sentence(start: float, end: float) -> None:
    def never(promql: str, at_s: float) -> list[tuple[dict[str, str], float]]:
        raise AssertionError("no query for an empty range")

    with pytest.raises(UsageError, match=r"^The range to look for stragglers in is empty: .*\.$"):
        find_stragglers(never, start, end)


# -- the checks on figures a simulated node cannot produce ----------------------------------------------------
def _gpu(node: str, gpu: str = "0", **kw: Any) -> _Gpu:
    base: dict[str, Any] = {"samples": 60.0, "sm_active": 0.9, "sm_clock_hz": 1980e6, "throttle": {},
                            "pcie_bytes_per_s": 5e9, "nvlink_bytes_per_s": 100e9, "pcie_replays": 0.0,
                            "pcie_generation": 5.0, "pcie_width": 16.0, "thread_cpu": 0.5, "host_cpu": 0.3}
    base.update(kw)
    return _Gpu("torchrun/job", node, gpu, **base)


def _named(gpus: list[_Gpu]) -> set[tuple[str, str]]:
    return {(s.node, s.cause) for s in _job_stragglers(gpus, DEFAULT)}


def test_in_a_synchronous_job_the_throttled_rank_is_named_not_its_waiting_peers() -> None:
    # The throttled rank computes the longest: it is the busiest; its peers wait in the all-reduce (SM activity
    # low, a collective kernel running: not idle). SM activity alone (the imbalance rule) would name a peer.
    waiting = {"sm_active": 0.25, "throttle": {"sw_power_cap": 0.0}}
    gpus = [_gpu("a", **waiting), _gpu("b", **waiting), _gpu("c", sm_active=0.95, sm_clock_hz=1300e6,
                                                            throttle={"hw_slowdown": 0.6})]
    assert _named(gpus) == {("c", "throttled")}
    # without the throttling, no direct cause: the imbalance rule is asked, and names the least busy
    calm = [_gpu("a", sm_active=0.25), _gpu("b", sm_active=0.9), _gpu("c", sm_active=0.95)]
    assert _named(calm) == {("a", "imbalance")}


def test_a_cause_all_peers_share_names_no_one() -> None:
    hot = {"throttle": {"sw_thermal": 0.8}, "sm_clock_hz": 1400e6, "thread_cpu": 1.0, "host_cpu": 0.95}
    assert _named([_gpu("a", **hot), _gpu("b", **hot), _gpu("c", **hot)]) == set()
    assert _named([_gpu("a"), _gpu("b")]) == set()


def test_power_cap_on_one_gpu_is_throttled_with_the_power_fix() -> None:
    found = _job_stragglers([_gpu("a"), _gpu("b", throttle={"sw_power_cap": 0.7}, sm_clock_hz=1600e6)], DEFAULT)
    assert [(s.node, s.cause) for s in found] == [("b", "throttled")]
    assert "power limit" in found[0].fix and "sw_power_cap 70 %" in found[0].evidence


def test_a_lower_clock_without_a_reason_is_throttled_but_an_idle_clock_is_not() -> None:
    assert _named([_gpu("a"), _gpu("b"), _gpu("c", sm_clock_hz=1500e6)]) == {("c", "throttled")}
    assert _named([_gpu("a"), _gpu("b"), _gpu("c", sm_clock_hz=1900e6)]) == set()  # within 10 %
    # an idle GPU's clock drops: that is its input, not a clock limit
    assert _named([_gpu("a"), _gpu("b"), _gpu("c", sm_clock_hz=400e6, sm_active=0.1,
                                              throttle={"gpu_idle": 0.7})]) == {("c", "input")}


def test_host_cpu_a_saturated_thread_or_node() -> None:
    assert _named([_gpu("a"), _gpu("b"), _gpu("c", thread_cpu=0.99)]) == {("c", "host_cpu")}
    assert _named([_gpu("a"), _gpu("b"), _gpu("c", host_cpu=0.97)]) == {("c", "host_cpu")}
    # a waiting peer busy-polling its stream at 100 % is no straggler when every rank does it
    assert _named([_gpu(n, thread_cpu=1.0) for n in "abc"]) == set()


@pytest.mark.parametrize("slow, words", [
    ({"pcie_width": 8.0}, "x8 at most, its peers' at x16"),
    ({"pcie_generation": 4.0}, "Gen4 at most, its peers' at Gen5"),
    ({"pcie_replays": 120.0}, "120 PCIe replays"),
    ({"nvlink_bytes_per_s": 10e9, "pcie_bytes_per_s": 30e9}, "over NVLink"),
    ({"pcie_bytes_per_s": 1e9}, "over PCIe"),
])
def test_a_slower_link(slow: dict[str, float], words: str) -> None:
    found = _job_stragglers([_gpu("a"), _gpu("b"), _gpu("c", **slow)], DEFAULT)
    assert [(s.node, s.cause) for s in found] == [("c", "link")], [s.evidence for s in found]
    assert words in found[0].evidence and "NCCL_DEBUG" in found[0].fix


def test_one_peer_far_off_does_not_make_a_healthy_gpu_look_slow() -> None:
    # a's peers are b and c; c moves far more over PCIe (its NVLink is down): a is not "below its peers"
    gpus = [_gpu("a"), _gpu("b"), _gpu("c", nvlink_bytes_per_s=10e9, pcie_bytes_per_s=30e9)]
    assert _named(gpus) == {("c", "link")}
    # a and b at 90 % of a core, c at 10 %: a's peers' median is not the mean of 90 and 10
    assert _named([_gpu("a", thread_cpu=0.9), _gpu("b", thread_cpu=0.9), _gpu("c", thread_cpu=0.1)]) == set()
    # two ranks throttled, two not: the throttled ones are named, each against its peers
    two = [_gpu("a"), _gpu("b"), _gpu("c", throttle={"hw_slowdown": 1.0}), _gpu("d", throttle={"hw_slowdown": 1.0})]
    assert _named(two) == {("c", "throttled"), ("d", "throttled")}


def test_link_rates_that_do_not_matter_name_no_one() -> None:
    # the peers move 1 GB/s over PCIe: below pcie_busy_bytes_per_s, a GPU moving less is not held back by it
    gpus = [_gpu("a", pcie_bytes_per_s=1e9), _gpu("b", pcie_bytes_per_s=1e9), _gpu("c", pcie_bytes_per_s=1e8)]
    assert _named(gpus) == set()


def test_missing_figures_are_not_read_as_zero() -> None:
    # a GPU without GPM, throttle counters or host series: nothing to compare, no straggler
    bare = {"sm_active": None, "sm_clock_hz": None, "pcie_bytes_per_s": None, "nvlink_bytes_per_s": None,
            "pcie_replays": None, "pcie_generation": None, "pcie_width": None, "thread_cpu": None, "host_cpu": None}
    assert _named([_gpu("a", **bare), _gpu("b", **bare), _gpu("c")]) == set()
    assert _named([_gpu("a"), _gpu("b"), _gpu("c", **bare)]) == set()


def test_causes_and_fields() -> None:
    s = _job_stragglers([_gpu("a"), _gpu("b", throttle={"hw_thermal": 1.0})], DEFAULT)[0]
    assert isinstance(s, Straggler) and s.cause in CAUSES
    assert (s.workload, s.node, s.gpu) == ("torchrun/job", "b", "0") and s.evidence and s.fix
