"""The dashboard over a real Prometheus: a real `gpuscope agent --simulate mixed` scraped by a real
Prometheus under two jobs whose metric_relabel_configs rename its hostname to node-a and node-b (one
machine cannot have two hostnames), so the backend sees a fleet of two nodes with 2 GPUs each.

The overview matches the agent's own for slow gauges, verdicts and processes come through, ranges
and the timeline have one series / span per GPU, label values cannot inject PromQL, and a Prometheus
that is down, slow or not Prometheus at all is one 502/503 sentence, never a traceback. The CLI
checks its URL and Prometheus before it listens; the page renders the fleet in a real Chromium.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from servers import MetricsServer, PrometheusServer, free_port, http_get, need_binary

from gpuscope.viewmodel import from_snapshot
from gpuscope.web.backend import BackendError, RangeQuery
from gpuscope.web.promql_backend import PrometheusBackend, quote

KEYS = {"node-a/0", "node-a/1", "node-b/0", "node-b/1"}
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (OSError, AssertionError, BackendError) as e:
            last = e
        time.sleep(0.25)
    raise AssertionError(f"{what} did not happen in {timeout:g} s; last: {last!r}"[:2000])


class Agent:
    """`gpuscope agent --simulate mixed --gpus 2 --processes 6` on a loopback port; its alerts evaluate
    every second so gpu_verdict is exported soon, and only 2 processes per GPU get their own series."""

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = workdir / "agent.toml"
        cfg.write_text(f'[agent]\ndata_dir = "{workdir / "data"}"\n[prometheus]\ntop_processes = 2\n'
                       '[alerts]\nevaluation_interval = "1s"\n')
        self.log = open(workdir / "agent.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuscope.cli", "agent", "--config", str(cfg),
                                      "--simulate", "mixed", "--gpus", "2", "--processes", "6",
                                      "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait(lambda: http_get(self.url + "/api/v1/status", 1.0)[0] == 200, 30, "the agent starting")

    def latest(self) -> dict[str, Any]:
        status, body = http_get(self.url + "/api/v1/latest")
        assert status == 200, body[:300]
        return json.loads(body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    need_binary("prometheus")
    tmp = tmp_path_factory.mktemp("fleet")
    agent = Agent(tmp / "agent")
    # honor_labels is false, so a metric_relabel_config is what rewrites the target's own hostname label.
    jobs = {name: {"static_configs": [{"targets": [f"127.0.0.1:{agent.port}"]}],
                   "metric_relabel_configs": [{"target_label": "hostname", "replacement": host}]}
            for name, host in (("node-a", "node-a"), ("node-b", "node-b"))}
    rules = tmp / "rules.yml"  # one alert pending for its whole `for` (the dashboard tells how long of it)
    rules.write_text(json.dumps({"groups": [{"name": "t", "rules": [
        {"alert": "GpuscopeTestPending", "expr": "vector(1)", "for": "30m", "labels": {"severity": "info"},
         "annotations": {"summary": "always true, pending for 30 min before it would fire"}}]}]}))
    try:
        prom = PrometheusServer(tmp, jobs=jobs, scrape_interval="1s", rule_files=[rules])
    except BaseException:
        agent.stop()
        raise
    try:
        # The agent's verdicts need 5 s of history and an evaluation; then both nodes export them.
        prom.wait_for('gpu_verdict{window="30s"}',
                      lambda r: {f"{x['metric']['hostname']}/{x['metric']['gpu']}" for x in r} == KEYS, timeout=60)
        # and ranges need some history: 8 s of scrapes on both jobs
        prom.wait_for("count_over_time(gpu_power_watts[8s])",
                      lambda r: len(r) == 4 and all(float(x["value"][1]) >= 7 for x in r), timeout=30)
        yield agent, prom
    finally:
        prom.stop()
        agent.stop()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _with_backend(url: str, fn: Any, **kw: Any) -> Any:
    b = PrometheusBackend(url, **kw)
    try:
        return await fn(b)
    finally:
        await b.close()


def test_overview_is_the_fleet_with_the_agents_values_verdicts_and_processes(fleet):
    agent, prom = fleet
    ov = run(_with_backend(prom.url, lambda b: b.overview()))
    assert ov["source"] == "prometheus" and ov["simulated"] == "mixed" and ov["errors"] == []
    assert [g["key"] for g in ov["gpus"]] == sorted(KEYS)
    mine = from_snapshot(agent.latest(), source="agent", with_ppid=False)
    theirs = {g["gpu"]: g for g in mine["gpus"]}
    for g in ov["gpus"]:
        ref = theirs[g["gpu"]]
        assert g["uuid"] == ref["uuid"] and g["name"] == ref["name"] and g["healthy"] is True
        assert g["simulated"] == "mixed"
        for m in ("gpu_memory_total_bytes", "gpu_power_limit_watts", "gpu_sm_clock_max_hertz"):
            assert g["values"][m] == pytest.approx(ref["values"][m], rel=1e-6), (g["key"], m)
        assert 0.0 <= g["values"]["gpu_sm_active_ratio"] <= 1.0
        assert g["verdict"] is not None and g["verdict"]["kind"] and 0 < g["verdict"]["confidence"] <= 1
        assert "gpu_verdict" in g["verdict"]["summary"]
        assert all(s["kind"] for s in g["side"])
    # 3 processes per GPU; the agent exports 2 with their own series and sums the third as pid="other".
    by_gpu: dict[str, list[dict[str, Any]]] = {}
    for p in ov["processes"]:
        by_gpu.setdefault(p["gpu_key"], []).append(p)
    assert set(by_gpu) == KEYS
    agent_pids = {p["pid"] for p in mine["processes"]}
    for key, procs in by_gpu.items():
        named = [p for p in procs if p["name"] != "other"]
        assert len(named) == 2 and {p["pid"] for p in named} <= agent_pids, key
        assert all(p["user"] == "sim" and p["command"] == "python" and p["gpu_memory_bytes"] > 0 for p in named)
        assert [p["pid"] for p in procs if p["name"] == "other"] == [0]
    # Node b is node a relabelled: the same numbers under two keys.
    a = {g["gpu"]: g["values"]["gpu_memory_total_bytes"] for g in ov["gpus"] if g["host"] == "node-a"}
    b = {g["gpu"]: g["values"]["gpu_memory_total_bytes"] for g in ov["gpus"] if g["host"] == "node-b"}
    assert a == b


def test_meta_range_of_a_gauge_and_a_counter_per_gpu(fleet):
    _, prom = fleet

    async def go(b: PrometheusBackend) -> Any:
        meta = await b.meta()
        now = time.time_ns()
        q = {"start_ns": now - 20 * 10**9, "end_ns": now, "step_s": 1.0}
        return (meta, await b.range(RangeQuery("gpu_power_watts", **q)),
                await b.range(RangeQuery("gpu_energy_joules_total", **q)),
                await b.range(RangeQuery("gpu_power_watts", **q, agg="max", gpus=("node-b/1",))),
                await b.range(RangeQuery("gpu_process_memory_used_bytes", **q, labels={"pid": "other"})))

    meta, power, energy, one, other = run(_with_backend(prom.url, go))
    assert {g["key"] for g in meta["gpus"]} == KEYS and meta["resolution_s"] == 1.0
    assert {"gpu_power_watts", "gpu_energy_joules_total", "process_cpu_cores", "host_cpu_ratio"} <= set(meta["metrics"])
    assert "gpu_info" not in meta["metrics"] and meta["simulated"] == "mixed" and meta["source"] == "prometheus"
    for r in (power, energy):
        assert {s["gpu_key"] for s in r["series"]} == KEYS and r["simulated"] == "mixed", r
        for s in r["series"]:
            assert len(s["timestamps_ns"]) == len(s["values"]) == 21
            assert "uuid" not in s["labels"] and "job" not in s["labels"]
    watts = {s["gpu_key"]: [v for v in s["values"] if v is not None] for s in power["series"]}
    joules = {s["gpu_key"]: [v for v in s["values"] if v is not None] for s in energy["series"]}
    for key in KEYS:
        assert watts[key] and joules[key]
        # the counter is charted as its rate: joules per second are watts
        assert joules[key][-1] == pytest.approx(sum(watts[key]) / len(watts[key]), rel=0.35), key
    assert [s["gpu_key"] for s in one["series"]] == ["node-b/1"]
    assert {s["labels"]["pid"] for s in other["series"]} == {"other"} and len(other["series"]) == 4


def test_label_values_cannot_inject_promql(fleet):
    _, prom = fleet
    hostile = ['"} or vector(1) or up{x="', '\\"} or vector(1) #', 'a\\', "line\nbreak", '.*', "0|1"]

    async def go(b: PrometheusBackend) -> Any:
        now = time.time_ns()
        q = {"start_ns": now - 10 * 10**9, "end_ns": now, "step_s": 1.0}
        out = [await b.range(RangeQuery("gpu_power_watts", **q, labels={"gpu": v})) for v in hostile]
        out.append(await b.range(RangeQuery("gpu_power_watts", **q, gpus=("node-a/.*",))))
        out.append(await b.range(RangeQuery("gpu_power_watts", **q, gpus=("node-a/0|1",))))
        with pytest.raises(BackendError) as bad:
            await b.range(RangeQuery("gpu_power_watts", **q, labels={'gpu="0"} or vector(1) #': "x"}))
        with pytest.raises(BackendError) as bad_metric:
            await b.range(RangeQuery("vector(1) or gpu_power_watts", **q))
        return out, bad.value, bad_metric.value

    answers, bad, bad_metric = run(_with_backend(prom.url, go))
    assert all(a["series"] == [] for a in answers), [a["series"][:1] for a in answers]
    assert bad.status == 400 and bad_metric.status == 400
    # Each quoted value is exactly itself to Prometheus: it selects nothing and breaks nothing.
    for v in hostile:
        assert prom.query(f"gpu_info{{hostname={quote(v)}}}") == []
    assert len(prom.query(f'gpu_info{{hostname={quote("node-a")}}}')) == 2


def test_timeline_has_verdict_spans_per_gpu(fleet):
    _, prom = fleet
    now = time.time_ns()
    tl = run(_with_backend(prom.url, lambda b: b.timeline(now - 60 * 10**9, now)))
    assert {s["gpu_key"] for s in tl["spans"]} == KEYS
    for s in tl["spans"]:
        assert s["kind"] and s["severity"] in ("info", "warning", "critical") and s["start_ns"] < s["end_ns"] <= now
    for e in tl["events"]:
        assert e["kind"] in ("xid", "ecc", "clock_events", "gpu_lost", "process_start", "process_stop")
        assert e["gpu_key"] in KEYS and e["count"] >= 1
    only = run(_with_backend(prom.url, lambda b: b.timeline(now - 60 * 10**9, now, ("node-a/1",))))
    assert {s["gpu_key"] for s in only["spans"]} == {"node-a/1"}


def _one_sentence(message: str) -> None:
    assert "\n" not in message and "Traceback" not in message and message.endswith(".")


def test_upstream_down_slow_or_not_prometheus_is_one_502_or_503_sentence(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BackendError) as down:
        run(_with_backend(dead, lambda b: b.overview()))
    assert down.value.status == 503 and dead in down.value.message
    _one_sentence(down.value.message)

    with MetricsServer(lambda path: b"<html>a login page</html>") as html:
        with pytest.raises(BackendError) as not_prom:
            run(_with_backend(html.url, lambda b: b.meta()))
    assert not_prom.value.status == 502 and html.url in not_prom.value.message
    _one_sentence(not_prom.value.message)

    with MetricsServer(lambda path: time.sleep(2) or b"{}") as slow:
        with pytest.raises(BackendError) as timed_out:
            run(_with_backend(slow.url, lambda b: b.alerts(), timeout=0.5))
    assert timed_out.value.status == 503 and "0.5 s" in timed_out.value.message
    _one_sentence(timed_out.value.message)

    # Through the dashboard's HTTP API: the page gets the status and the sentence as JSON.
    from aiohttp.test_utils import TestClient, TestServer

    from gpuscope.web.api import make_ui_app

    async def through_api() -> tuple[int, Any]:
        app = make_ui_app(PrometheusBackend(dead), token=None, loopback_only=True, token_path="")
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            r = await client.get("/ui/api/overview")
            return r.status, await r.json()

    status, body = run(through_api())
    assert status == 503 and dead in json.dumps(body)


def test_prometheus_rejecting_a_query_is_a_502_sentence(fleet):
    _, prom = fleet
    with pytest.raises(BackendError) as e:
        run(_with_backend(prom.url, lambda b: b.query("rate(gpu_power_watts)")))
    assert e.value.status == 502 and "/api/v1/query" in e.value.message
    _one_sentence(e.value.message)


def _gpuscope(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuscope.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("url", ["ftp://prometheus:9090", "prometheus:9090", "http://[::1", "http://host:99999",
                                 "http://a b", "http://prom:9090/?x=1"])
def test_cli_bad_url_is_one_sentence_and_exit_2(url):
    r = _gpuscope("dashboard", "--prometheus", url)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("gpuscope: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_cli_unreachable_prometheus_is_one_sentence_and_exit_1():
    url = f"http://127.0.0.1:{free_port()}"
    r = _gpuscope("dashboard", "--prometheus", url, "--port", "0")
    assert r.returncode == 1 and url in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_a_mig_gpu_filter_selects_its_gpu_label():
    """A MIG GPU's key is 'host/0/mig3' and its gpu label '0/mig3': the selector must match that label."""
    backend = PrometheusBackend("http://prometheus.invalid:9090")
    sent: list[str] = []

    async def resolution() -> float:
        return 15.0

    async def query_range(promql: str, start_s: float, end_s: float, step_s: float) -> Any:
        sent.append(promql)
        pattern = re.search(r'gpu=~"((?:[^"\\]|\\.)*)"', promql).group(1).replace("\\\\", "\\")
        series = [{"metric": {"hostname": "h", "gpu": g}, "values": [[start_s, "0.5"]]} for g in ("0/mig3", "mig3")]
        return [r for r in series if re.fullmatch(pattern, r["metric"]["gpu"])]

    backend._resolution = resolution  # type: ignore[method-assign]
    backend.query_range = query_range  # type: ignore[method-assign]
    q = RangeQuery("gpu_sm_active_ratio", 1_700_000_000 * 10**9, 1_700_000_060 * 10**9, 15.0, gpus=("h/0/mig3",))
    r = asyncio.run(backend.range(q))
    assert [s["gpu_key"] for s in r["series"]] == ["h/0/mig3"], sent


@pytest.mark.parametrize("timeout", ["inf", "nan", "0", "-1"])
def test_cli_bad_timeout_is_one_sentence_and_exit_2(timeout):
    r = _gpuscope("dashboard", "--prometheus", f"http://127.0.0.1:{free_port()}", "--port", "0", "--timeout", timeout)
    assert r.returncode == 2 and "--timeout" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cli_token_file_that_is_a_directory_is_refused_and_left_alone(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    r = _gpuscope("dashboard", "--prometheus", f"http://127.0.0.1:{free_port()}", "--port", "0", "--bind", "0.0.0.0",
                  "--token-file", str(d))
    assert r.returncode == 1 and "not a regular file" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert d.stat().st_mode & 0o777 == 0o777  # the token check once chmod-ed the directory (e.g. /tmp) to 0600


class Dashboard:
    """`gpuscope dashboard --prometheus URL` on a free port (read from what it prints)."""

    def __init__(self, prom_url: str, *extra: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "gpuscope.cli", "dashboard", "--prometheus",
                                      prom_url, "--port", "0", *extra], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        assert self.proc.stdout is not None
        lines = []
        for line in self.proc.stdout:
            lines.append(line)
            m = re.search(r"dashboard: (http://\S+?:\d+)/ui/", line)
            if m:
                self.url = m.group(1).replace("0.0.0.0", "127.0.0.1")
                break
        else:
            raise AssertionError("the dashboard did not start: " + "".join(lines))
        self.banner = "".join(lines)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def test_cli_serves_the_fleet_and_needs_a_token_beyond_loopback(fleet, tmp_path):
    _, prom = fleet
    d = Dashboard(prom.url)
    try:
        assert "4 GPU(s)" in d.banner
        status, body = http_get(d.url + "/ui/api/overview")
        assert status == 200 and {g["key"] for g in json.loads(body)["gpus"]} == KEYS
    finally:
        assert d.stop() == 0
    token_file = tmp_path / "dashboard-token"
    d = Dashboard(prom.url, "--bind", "0.0.0.0", "--token-file", str(token_file))
    try:
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        assert http_get(d.url + "/ui/api/meta")[0] == 401
        req = urllib.request.Request(d.url + "/ui/api/meta", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200 and {g["key"] for g in json.load(r)["gpus"]} == KEYS
    finally:
        assert d.stop() == 0


def test_chromium_renders_the_fleet_from_prometheus(fleet, chromium):
    _, prom = fleet
    sync_api = pytest.importorskip("playwright.sync_api")
    d = Dashboard(prom.url)
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1800})
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(d.url + "/ui/?start=-2m")
                page.wait_for_function("() => window.gpuscope && window.gpuscope.overview && window.gpuscope.live > 0"
                                       " && window.gpuscope.renderedAt !== null && window.gpuscope.loads > 0",
                                       timeout=30000)
                got = page.evaluate("""() => ({
                    source: document.querySelector('#source').textContent,
                    cards: document.querySelectorAll('#cards .card').length,
                    verdicts: [...document.querySelectorAll('#cards .verdict b')].map(b => b.textContent),
                    charts: window.gpuscope.charts.length,
                    spans: window.gpuscope.timeline.spans.length,
                    timeline: document.querySelector('#timeline').children.length,
                    procs: document.querySelectorAll('#procs tbody tr').length,
                    sim: !document.querySelector('#sim-banner').hidden,
                })""")
                os.makedirs(ARTIFACTS, exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "web-prometheus-fleet.png"), full_page=True)
            finally:
                browser.close()
    finally:
        d.stop()
    assert errors == []
    assert got["cards"] == 4 and len(got["verdicts"]) == 4 and got["sim"]
    assert got["charts"] > 0 and got["spans"] >= 4 and got["timeline"] > 0
    assert got["procs"] == 12  # 2 named + 'other' per GPU, 4 GPUs


def test_timeline_events_xid_ecc_and_a_lost_gpu(tmp_path):
    """Two in-process simulated nodes scraped by a real Prometheus: XID and ECC bursts on one, a GPU
    that falls off the bus after 10 s on the other; the timeline has their events, the overview the loss."""
    need_binary("prometheus")
    from gpuscope import Sampler, SamplerConfig
    from gpuscope.export.exposition import Exposition

    samplers = {"storm": Sampler(SamplerConfig(interval=0.1), simulate="xid_storm", gpus=1),
                "lost": Sampler(SamplerConfig(interval=0.1), simulate="gpu_lost", gpus=2)}
    renderers = {name: Exposition() for name in samplers}
    for s in samplers.values():
        s.start()

    def body(name: str) -> Any:
        return lambda path: renderers[name].render(samplers[name].latest(), hostname=name)

    try:
        with MetricsServer(body("storm")) as storm, MetricsServer(body("lost")) as lost, \
                PrometheusServer(tmp_path, [storm.address, lost.address], scrape_interval="1s") as prom:
            start = time.time_ns()
            prom.wait_for("gpu_healthy == 0", lambda r: len(r) == 1, timeout=40)
            prom.wait_for("gpu_xid_events_total", lambda r: len(r) >= 2, timeout=20)
            time.sleep(2)  # a scrape after the first XIDs, so their counters grew inside the range
            now = time.time_ns()

            async def go(b: PrometheusBackend) -> Any:
                return await b.timeline(start - 5 * 10**9, now), await b.overview()

            tl, ov = run(_with_backend(prom.url, go))
    finally:
        for s in samplers.values():
            s.stop()
    kinds: dict[str, set[str]] = {}
    for e in tl["events"]:
        kinds.setdefault(e["kind"], set()).add(e["gpu_key"])
        assert start - 5 * 10**9 <= e["time_ns"] <= now and e["count"] >= 1
    # the lost GPU says XID 79 as it falls off the bus
    assert kinds.get("xid") == {"storm/0", "lost/1"} and kinds.get("ecc") == {"storm/0"}, kinds
    assert kinds.get("gpu_lost") == {"lost/1"}, kinds
    assert any(e["kind"] == "xid" and e["message"].startswith("XID 79 on GPU 1: ") for e in tl["events"])
    assert any(e["kind"] == "process_stop" and e["gpu_key"] == "lost/1" for e in tl["events"])
    healthy = {g["key"]: g["healthy"] for g in ov["gpus"]}
    assert healthy == {"storm/0": True, "lost/0": True, "lost/1": False}


def test_a_pending_alert_carries_its_rules_for_from_the_rules_api(fleet):
    """The dashboard tells a pending alert as 'for 2 min of the 30 min it must hold': over Prometheus, the
    rule's `for` comes from /api/v1/rules (its 'duration')."""
    _, prom = fleet
    prom.wait_for('ALERTS{alertname="GpuscopeTestPending",alertstate="pending"}', lambda r: len(r) == 1, timeout=30)

    async def go(b: PrometheusBackend) -> Any:
        return await b.alerts(), await b.overview()

    alerts, ov = run(_with_backend(prom.url, go))
    for where in (alerts["pending"], ov["alerts"]["pending"]):
        mine = [a for a in where if a["rule"] == "GpuscopeTestPending"]
        assert len(mine) == 1 and mine[0]["for_s"] == 1800.0 and mine[0]["active_at"] is not None, where
