"""The dashboard's waste view (/ui/waste, /ui/api/waste) over a real Prometheus.

Three simulated agents, each its own node (GPUSCOPE_NODE_NAME), 2 GPUs each, each its own torchrun run
(--simulate-workload): node-a idle_allocated ('notebook', SM idle), node-b sync_bound ('train', SM active 20 %),
node-c compute_bound (96 %; its run id '<b>eval</b>' has markup in it, which the page must show as text), so
the ranking by money wasted is far from any tie. A real Prometheus scrapes them every second and the real
`gpuscope dashboard --prometheus URL` serves the view. The endpoint's answer is the fleet report of
gpuscope.fleet.report for the same range (same groups, same ranking, the same figures but for a scrape that
may land between the two runs), with each group's GPUs; bad parameters are a 400 sentence; pages opened
together share one report; in a real headless Chromium the table has a row per group, in the report's order,
data shown as text, no console errors, and a row's link opens that GPU's page. Over the agent's own dashboard
the view says in one sentence that it needs `gpuscope dashboard --prometheus URL`.

The agents and Prometheus start once, in one test, whatever pytest -n does with the module (as
test_fleet_stragglers.py); the deadline and the flags are tests of their own.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from servers import MetricsServer, PrometheusServer, need_binary
from test_fleet_stragglers import Agent  # a simulated agent on its own node, its processes one torchrun run
from test_web_prometheus import Dashboard  # the real `gpuscope dashboard --prometheus URL`, on a free port

from gpuscope import fleet
from gpuscope.web.backend import BackendError
from gpuscope.web.waste import NEEDS_PROMETHEUS, WasteView

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
NODES = {  # node -> (scenario, simulated workload id)
    "node-a": ("idle_allocated", "notebook"), "node-b": ("sync_bound", "train"), "node-c": ("compute_bound", "<b>eval</b>"),
}
JOBS = {"torchrun/notebook": ["node-a/0", "node-a/1"], "torchrun/train": ["node-b/0", "node-b/1"],
        "torchrun/<b>eval</b>": ["node-c/0", "node-c/1"]}
SCRAPED_S = 32  # seconds of scrapes before the view is asked
POWER_MAX_W = 700.0  # the simulated H200's power limit: what one scrape more can add to a GPU's energy
FIGURES = ("observed_gpu_hours", "allocated_gpu_hours", "used_gpu_hours", "idle_gpu_hours", "energy_kwh", "cost",
           "wasted_money")


def get(url: str, timeout: float = 60.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def waste(dash: Dashboard, **q: str) -> dict[str, Any]:
    status, doc = get(dash.url + "/ui/api/waste?" + urllib.parse.urlencode(q))
    assert status == 200, doc
    return doc


def _tolerance(g: dict[str, Any], doc: dict[str, Any], name: str) -> float:
    """How far a figure of one group may move between two runs over the same range: one scrape per GPU
    that the first run did not see yet (a sample is stamped when its scrape starts, stored when it ends)."""
    step_h = max(doc["scrape_step_s"].values()) / 3600
    hours = g["gpus"] * step_h * 1.01
    kwh = g["gpus"] * 2 * step_h * POWER_MAX_W / 1000  # increase() extrapolates: a sample moves it twice
    price = max(doc["prices"]["gpu_hour"].values())  # every GPU here is one model: its price, or the default
    return {"energy_kwh": kwh, "cost": hours * price + kwh * doc["prices"]["energy_per_kwh"],
            "wasted_money": hours * price}.get(name, hours)


def _same_report(mine: dict[str, Any], ref: dict[str, Any]) -> None:
    assert [g["group"] for g in mine["groups"]] == [g["group"] for g in ref["groups"]]
    for a, b in zip(mine["groups"], ref["groups"], strict=True):
        assert a["gpus"] == b["gpus"] and a["fix"] == b["fix"], (a, b)
        for name in FIGURES:
            assert abs(a[name] - b[name]) <= _tolerance(a, mine, name), (a["group"], name, a[name], b[name])
    assert mine["by"] == ref["by"] and mine["range"] == ref["range"] and mine["currency"] == ref["currency"]


def test_waste_view_over_a_real_prometheus(tmp_path: Path, chromium: str) -> None:
    need_binary("prometheus")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[test]' installs playwright")
    agents = {node: Agent(tmp_path / node, node, *spec) for node, spec in NODES.items()}
    prom = dash = None
    try:
        deadline = time.monotonic() + 60
        while not all(a.ready() for a in agents.values()):
            assert time.monotonic() < deadline, "the agents did not start in 60 s"
            time.sleep(0.2)
        prom = PrometheusServer(tmp_path, targets=[f"127.0.0.1:{a.port}" for a in agents.values()],
                                scrape_interval="1s")
        prom.wait_for('gpu_info{workload!=""}', lambda r: len(r) == 6, timeout=30)
        scraping = time.monotonic()
        dash = Dashboard(prom.url)
        time.sleep(max(0.0, scraping + SCRAPED_S - time.monotonic()))

        by_job = waste(dash, since="1m", by="job")
        _answer_is_the_report(prom.url, by_job)
        _bad_parameters(dash)
        by_node = _pages_share_one_report(dash)
        _over_the_agent(agents["node-a"].url)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                _in_chromium(browser, dash, by_node, agents["node-a"].url)
            finally:
                browser.close()
    finally:
        if dash is not None:
            dash.stop()
        if prom is not None:
            prom.stop()
        for a in agents.values():
            a.stop()


def _answer_is_the_report(prom_url: str, doc: dict[str, Any]) -> None:
    assert doc["by"] == "job" and doc["since"] == "1m" and doc["since_s"] == 60.0
    r = doc["report"]
    assert r["range"]["end_s"] == doc["computed_at_s"] and r["range"]["seconds"] == 60.0
    # ranked by money wasted: the idle notebook first, then the run that waits on syncs, then the busy one
    assert [g["group"] for g in r["groups"]] == list(JOBS)
    assert r["groups"][0]["wasted_money"] > r["groups"][1]["wasted_money"] > r["groups"][2]["wasted_money"]
    assert doc["gpus"] == JOBS
    assert all(len(doc["gpus"][g["group"]]) == g["gpus"] for g in r["groups"])
    ref = fleet.report(prom_url, r["range"]["start_s"], r["range"]["end_s"], by="job")
    _same_report(r, ref)


def _bad_parameters(dash: Dashboard) -> None:
    for query, said in (("by=bogus", "by must be one of namespace, pod, job, user, node, model"),
                        ('by=job"} or vector(1)', "by must be one of"),
                        ("since=abc", "is not a duration"),
                        ("since=-24h", "is not a duration"),
                        ("since=5s", "since must be at least 1m"),
                        ("since=40d", "since must be at most 31d"),
                        ("since=" + "9" * 400, "is not a duration such as 90m, 24h or 7d"),
                        ("since=1h&gpu=node-a/0", "'gpu' is not a parameter of /ui/api/waste")):
        status, body = get(dash.url + "/ui/api/waste?" + urllib.parse.quote(query, safe="=&"))
        assert status == 400, (query, body)
        assert list(body) == ["error"] and said in body["error"], (query, body)
        assert body["error"].endswith(".") and "\n" not in body["error"] and "Traceback" not in body["error"]


def _pages_share_one_report(dash: Dashboard) -> dict[str, Any]:
    """Four pages asking at once get one report (the same computation time); one asking later, the cached one."""
    with ThreadPoolExecutor(4) as pool:
        docs = list(pool.map(lambda _: waste(dash, since="1m", by="node"), range(4)))
    assert len({d["computed_at_s"] for d in docs}) == 1, [d["computed_at_s"] for d in docs]
    later = waste(dash, since="1m", by="node")
    assert later["computed_at_s"] == docs[0]["computed_at_s"] and later["age_s"] > 0
    assert [g["group"] for g in later["report"]["groups"]][0] == "node-a"
    assert later["gpus"] == {n: [f"{n}/0", f"{n}/1"] for n in NODES}
    return later


def _over_the_agent(agent_url: str) -> None:
    status, body = get(agent_url + "/ui/api/waste?since=1h&by=node")
    assert status == 404 and body == {"error": NEEDS_PROMETHEUS}
    assert "`gpuscope dashboard --prometheus URL`" in NEEDS_PROMETHEUS


class _Page:
    def __init__(self, browser: Any) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def js(self, expr: str) -> Any:
        return self.page.evaluate(expr)

    def until(self, expr: str, timeout: float = 30.0) -> Any:
        # The page's CSP forbids wait_for_function's string evaluation: poll through the DevTools protocol.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.js(expr)
            if v:
                return v
            time.sleep(0.05)
        message = self.js("document.querySelector('#message') && document.querySelector('#message').textContent")
        raise AssertionError(f"{expr} did not hold within {timeout} s; console: {self.errors}; message: {message}")


ROWS = "[...document.querySelectorAll('#waste tbody tr')].map(tr => tr.dataset.group)"


def _in_chromium(browser: Any, dash: Dashboard, by_node: dict[str, Any], agent_url: str) -> None:
    page = _Page(browser)
    page.page.goto(dash.url + "/ui/waste?since=1m&by=node")
    page.until("window.gpuscope && window.gpuscope.loads > 0 && window.gpuscope.waste !== null")
    shown = page.js("window.gpuscope.waste")
    assert page.js(ROWS) == [g["group"] for g in shown["report"]["groups"]] == ["node-a", "node-b", "node-c"]
    assert page.js("document.querySelector('#fleet-line').textContent") == shown["report"]["fleet"]["line"]
    assert page.js("document.querySelector('#by').value") == "node"
    first = page.js("[...document.querySelectorAll('#waste tbody tr:first-child td')].map(td => td.textContent)")
    assert first[1] == "node-a" and first[2] == "all 2node-a/0node-a/1", first
    assert shown["report"]["groups"][0]["why"] in first[-1] and shown["report"]["groups"][0]["fix"] in first[-1]
    ARTIFACTS.mkdir(exist_ok=True)
    page.page.screenshot(path=str(ARTIFACTS / "waste-by-node.png"), full_page=True)

    # the grouping control: by job, the run id with markup in it is text, never markup
    page.page.select_option("#by", "job")
    want = json.dumps(list(JOBS), separators=(",", ":"))  # as JSON.stringify writes it
    page.until(f"JSON.stringify({ROWS}) === {json.dumps(want)}")
    assert "by=job" in page.js("location.search")
    assert page.js("document.querySelectorAll('#waste b, #waste tbody i').length") == 0
    assert page.js("document.querySelector('#waste tbody tr:last-child td.name').textContent") == "torchrun/<b>eval</b>"

    # a row's GPU link opens that GPU's page of the dashboard, over the same range
    link = page.page.locator("#waste tbody tr:first-child a.gpu").first
    assert link.get_attribute("href") == "/ui/?start=-1m&end=now&gpu=node-a/0"
    with page.page.expect_navigation():
        link.click()
    page.until("location.pathname === '/ui/' && window.gpuscope && window.gpuscope.renderedAt !== null")
    page.until("document.querySelectorAll('.card').length === 1")
    assert page.js("window.gpuscope.state.gpus") == ["node-a/0"]
    assert page.js("document.querySelector('.card h3').textContent").startswith("node-a/0")
    assert page.errors == []
    page.page.close()

    # over the agent's own dashboard: the one sentence, the same the endpoint answers there
    page = _Page(browser)
    page.page.goto(agent_url + "/ui/waste")
    page.until("window.gpuscope && window.gpuscope.loads > 0")
    assert page.js("!document.querySelector('#needs-prometheus').hidden")
    assert page.js("document.querySelector('#needs-prometheus').textContent") == NEEDS_PROMETHEUS
    assert page.errors == []
    page.page.close()


def test_a_slow_report_is_a_504_sentence_and_goes_on_once_for_every_page() -> None:
    """A real HTTP server that holds its answer until the test lets it go: every request waits the deadline
    and gets a 504 sentence, one report runs for all of them, and once the server answers (it is not
    Prometheus) the next request has that sentence, a 503."""
    release = threading.Event()

    def body(path: str) -> bytes:
        release.wait(30)
        return b"this is not Prometheus\n"

    server = MetricsServer(body)
    try:
        view = WasteView(server.url, timeout_s=10, deadline_s=0.2)

        async def ask() -> list[BaseException | dict[str, Any]]:
            return await asyncio.gather(view.answer(3600.0, "node"), view.answer(3600.0, "node"),
                                        return_exceptions=True)

        loop = asyncio.new_event_loop()
        try:
            got = loop.run_until_complete(ask())
            assert all(isinstance(e, BackendError) and e.status == 504 for e in got), got
            assert "has not finished within 0.2 s; it goes on" in str(got[0])
            assert len(view._running) == 1  # one report for both
            release.set()
            deadline = time.monotonic() + 30
            while view._running:
                assert time.monotonic() < deadline, "the report did not end after the server answered"
                loop.run_until_complete(asyncio.sleep(0.05))
            assert server.requests == 1  # the one report's first request, answered with something else
            with pytest.raises(BackendError) as e:
                loop.run_until_complete(view.answer(3600.0, "node"))
            assert e.value.status == 503 and "is not a Prometheus HTTP API" in e.value.message
            assert view.computed == 0  # failures are not cached
        finally:
            view.close()
            loop.close()
    finally:
        release.set()
        server.stop()


def test_dashboard_prices_flag_bad_file_is_one_sentence(tmp_path: Path) -> None:
    bad = tmp_path / "prices.toml"
    bad.write_text('[gpu_hour]\n"NVIDIA H200" = -1\n')
    for path in (str(bad), str(tmp_path / "missing.toml")):
        r = subprocess.run([sys.executable, "-m", "gpuscope", "dashboard", "--prometheus", "http://127.0.0.1:9",
                            "--prices", path], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and path in r.stderr and "Traceback" not in r.stderr, r.stderr
