"""The dashboard in a real headless Chromium (Debian's, driven by Playwright) against a real agent.

Screenshots land in test-artifacts/ (git-ignored) for a person to look at. Playwright's
wait_for_function evaluates strings inside the page, which the page's CSP (rightly) forbids, so the
tests poll with page.evaluate (run by the DevTools protocol, outside the CSP).
"""

from __future__ import annotations

import socket
import time
import urllib.parse
from pathlib import Path

import pytest
from test_agent import AgentProc

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture(scope="module")
def browser(chromium):
    exe = chromium
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[test]' installs playwright")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = AgentProc(tmp_path_factory.mktemp("ui"), "--simulate", "mixed", "--gpus", "8", "--processes", "100")
    a.wait_ready()
    time.sleep(3.0)
    yield a
    a.stop()


class Page:
    """A page with its console errors and the /ui/api/range requests it made."""

    def __init__(self, browser, base: str) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.base = base
        self.errors: list[str] = []
        self.ranges: list[dict[str, str]] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", self._request)

    def _request(self, req) -> None:
        u = urllib.parse.urlsplit(req.url)
        if u.path == "/ui/api/range":
            self.ranges.append(dict(urllib.parse.parse_qsl(u.query)))

    def open(self, path: str) -> Page:
        self.page.goto(self.base + path)
        return self

    def js(self, expr: str):
        return self.page.evaluate(expr)

    def until(self, expr: str, timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.js(expr)
            if v:
                return v
            time.sleep(0.05)
        raise AssertionError(f"{expr} did not become true within {timeout} s; console: {self.errors}; "
                             f"state: {self.js('JSON.stringify([window.gpuscope.loads, window.gpuscope.renderedAt, location.search])')}; ranges: {self.ranges[-2:]}")

    def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / name), full_page=True)

    def close(self) -> None:
        self.page.close()


@pytest.fixture
def page(browser, agent):
    p = Page(browser, f"http://127.0.0.1:{agent.port}")
    yield p
    p.close()


def test_page_loads_charts_have_data_and_live_updates_arrive(page):
    page.open("/ui/?start=-5m")
    page.until("window.gpuscope && window.gpuscope.renderedAt !== null")
    lens = page.js("window.gpuscope.charts.map(c => [c.data.length, c.data[0].length])")
    assert len(lens) == 9 and all(series == 9 and points > 5 for series, points in lens), lens
    # the cards and rows come from the live stream, which may trail the charts' first render on a loaded machine
    page.until("document.querySelectorAll('.card').length === 8")
    page.until("document.querySelectorAll('#procs tbody tr').length === 100")
    assert "NVML util (any kernel running)" in page.js("document.body.innerText")
    assert page.js("!document.querySelector('#sim-banner').hidden")
    assert "SIMULATED" in page.js("document.querySelector('#sim-banner').innerText")
    before, seen_ns = page.js("[window.gpuscope.live, window.gpuscope.overview ? window.gpuscope.overview.time_ns : 0]")
    # a live update arrives with newer data (waited for: a loaded machine's Chromium is slow, not wrong)
    page.until(f"window.gpuscope.live > {before} && window.gpuscope.overview.time_ns > {seen_ns}")
    page.until("document.querySelector('#conn').textContent === 'live'")
    page.shot("dashboard-8gpus.png")
    assert page.errors == []


def test_drag_selection_queries_the_selected_range(page):
    page.open("/ui/?start=-15m")
    page.until("window.gpuscope && window.gpuscope.renderedAt !== null")
    first = page.ranges[-1]
    assert first["start"] == "-15m" and first["step"] == "auto"
    page.ranges.clear()
    page.until("window.gpuscope.live > 0 && window.gpuscope.loads >= 1")  # the cards are in: the layout holds still
    over = page.page.locator(".chart .u-over").first
    over.scroll_into_view_if_needed()
    box = over.bounding_box()
    y = box["y"] + box["height"] / 2
    page.page.mouse.move(box["x"] + box["width"] * 0.70, y)
    page.page.mouse.down()
    page.page.mouse.move(box["x"] + box["width"] * 0.85, y, steps=8)
    page.page.mouse.up()
    page.until("window.gpuscope.renderedAt !== null && window.gpuscope.loads >= 2")
    zoomed = page.ranges[-1]
    start, end = float(zoomed["start"]), float(zoomed["end"])
    assert 0 < end - start < 15 * 60 * 0.3  # about 15 % of the quarter hour
    assert "start=" in page.js("location.search") and str(int(start)) in page.js("location.search")  # shareable
    span = page.js("window.gpuscope.charts[0].data[0]")
    assert span and span[-1] - span[0] <= end - start + 1
    assert page.errors == []


def test_bad_range_and_unknown_gpu_show_a_message(page):
    page.open("/ui/?start=-1h&end=-2h")
    msg = page.until("!document.querySelector('#message').hidden && document.querySelector('#message').textContent")
    assert "end must be after start" in msg
    page.shot("dashboard-bad-range.png")
    page.open("/ui/?start=-1h&gpu=elsewhere/9")
    msg = page.until("!document.querySelector('#message').hidden && document.querySelector('#message').textContent")
    assert "elsewhere/9" in msg
    # The page itself is alive: the cards still come from the live stream.
    page.until("document.querySelectorAll('.card').length > 0 || document.querySelector('#cards').textContent.length > 0")
    # The 4xx answers are the only console errors (Chromium logs every failed fetch).
    assert all("status of 4" in e for e in page.errors), page.errors


def test_agent_gone_shows_disconnected(browser, tmp_path):
    a = AgentProc(tmp_path, "--simulate", "gpu_lost", "--gpus", "2")
    a.wait_ready()
    p = Page(browser, f"http://127.0.0.1:{a.port}")
    try:
        p.open("/ui/?start=-15m")
        p.until("window.gpuscope && window.gpuscope.renderedAt !== null")
        p.until("document.querySelector('#conn').textContent === 'live'")
        a.stop()
        p.until("document.querySelector('#conn').textContent.startsWith('disconnected')", timeout=10)
        p.shot("dashboard-disconnected.png")
    finally:
        p.close()
        a.stop()


def test_a_refused_stream_says_why_and_comes_back(browser, tmp_path):
    """A stream answered 503 (too many dashboards) or 401 (the token changed) is closed for good by the
    browser: the page says why and opens it again later."""
    a = AgentProc(tmp_path, "--simulate", "healthy")
    a.wait_ready()
    socks = []
    p = Page(browser, f"http://127.0.0.1:{a.port}")
    try:
        for i in range(32):  # every stream slot taken, by 8 clients (127.0.0.2-9) holding the most each may
            s = socket.create_connection(("127.0.0.1", a.port), source_address=(f"127.0.0.{2 + i // 8}", 0))
            s.sendall(b"GET /ui/api/stream?interval=1s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            socks.append(s)
        p.open("/ui/?start=-5m")
        p.until("document.querySelector('#message').textContent.includes('Too many live dashboards')")
        for s in socks:
            s.close()
        p.until("document.querySelector('#conn').textContent === 'live'", timeout=15)
        assert p.js("document.querySelector('#message').hidden")
    finally:
        for s in socks:
            s.close()
        p.close()
        a.stop()


def test_a_tab_left_open_for_days_stays_bounded(page):
    """Two days of live updates (one a minute, fed straight to the stream's handler) into a page
    showing the last 6 hours: every chart keeps only the range's window (and never more than its live
    trim), and the cards and process rows are replaced, not piled up."""
    page.open("/ui/?start=-6h")
    page.until("window.gpuscope && window.gpuscope.renderedAt !== null && window.gpuscope.overview !== null")
    nodes_before = page.js("document.getElementsByTagName('*').length")
    last = page.js("""(() => {
        const g = window.gpuscope, base = structuredClone(g.overview);
        let t = Math.max(base.time_ns, ...g.charts.map(c => (c.data[0].at(-1) || 0) * 1e9));
        for (let i = 0; i < 2 * 24 * 60; i++) { t += 60e9; g.feed(Object.assign({}, base, { time_ns: t })); }
        return t / 1e9; })()""")
    charts = page.js("window.gpuscope.charts.map(c => [c.data[0].length, c.data[0][0], c.data[0].at(-1)])")
    for n, first, end in charts:
        assert end == last  # the charts took the updates
        assert n <= 4000 and last - first <= 6 * 3600, (n, last - first)  # app.js LIVE_TRIM, the range
    assert page.js("document.querySelectorAll('#procs tbody tr').length") == 100
    assert page.js("document.querySelectorAll('.card').length") == 8
    assert page.js("document.getElementsByTagName('*').length") < nodes_before * 1.5
    assert page.errors == []
