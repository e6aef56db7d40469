"""The dashboard in a real headless Chromium (Debian's, driven by Playwright) against a real agent.

Screenshots land in test-artifacts/ (git-ignored) for a person to look at. Playwright's
wait_for_function evaluates strings inside the page, which the page's CSP (rightly) forbids, so the
tests poll with page.evaluate (run by the DevTools protocol, outside the CSP).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import socket
import time
import urllib.parse
from datetime import datetime
from pathlib import Path

import pytest
from test_agent import AgentProc, http

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
READABLE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{3})?(Z|[+-]\d\d:\d\d)")


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
    lens = page.js("window.gpuscope.charts.map(c => [c.data.length - c.gpuscope.refs.length, c.data[0].length])")
    assert len(lens) == 10 and all(series == 9 and points > 5 for series, points in lens), lens
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
    page.open("/ui/?start=-2m")
    page.until("window.gpuscope && window.gpuscope.renderedAt !== null")
    first = page.ranges[-1]
    assert first["start"] == "-2m" and first["step"] == "auto"
    page.until("window.gpuscope.live > 0 && window.gpuscope.loads >= 1")  # the cards are in: the layout holds still
    over = page.page.locator(".chart .u-over").first
    over.scroll_into_view_if_needed()
    page.ranges.clear()
    # Drag across the middle of the data the first chart holds (the axis is the whole range asked for,
    # of which a young agent has data for only the last part).
    d0, d1, xa, xb, y = page.js("""(() => {
        const c = window.gpuscope.charts[0], xs = c.data[0], r = c.over.getBoundingClientRect();
        const at = (f) => r.left + c.valToPos(xs[0] + f * (xs.at(-1) - xs[0]), "x");
        return [xs[0], xs.at(-1), at(0.3), at(0.9), r.top + r.height / 2]; })()""")
    assert xb - xa >= 8, (d0, d1, xa, xb)
    page.page.mouse.move(xa, y)
    page.page.mouse.down()
    page.page.mouse.move(xb, y, steps=8)
    page.page.mouse.up()
    page.until("window.gpuscope.renderedAt !== null && window.gpuscope.loads >= 2")
    zoomed = page.ranges[-1]
    # The selection is asked for, and shown in the range boxes, as a date and time one can read (RFC 3339
    # in local time, which the server reads back), not as unix seconds.
    boxes = page.js("[document.querySelector('#start').value, document.querySelector('#end').value]")
    assert boxes == [zoomed["start"], zoomed["end"]]
    for text in boxes:
        assert READABLE.fullmatch(text), text
    start, end = (datetime.fromisoformat(t).timestamp() for t in boxes)
    assert d0 - 1 < start < end < d1 + 1 and end - start < 0.8 * (d1 - d0) + 2  # about 60 % of the data
    query = urllib.parse.parse_qs(page.js("location.search")[1:])
    assert query["start"] == [boxes[0]] and query["end"] == [boxes[1]]  # shareable
    span = page.js("window.gpuscope.charts[0].data[0]")
    assert span and span[-1] - span[0] <= end - start + 1
    for lo, hi in page.js("window.gpuscope.charts.map(c => [c.scales.x.min, c.scales.x.max])"):
        assert (lo, hi) == (pytest.approx(start, abs=1e-3), pytest.approx(end, abs=1e-3))
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


# -- what the page shows, read back from Chromium ----------------------------------------------------
def lab(css: str) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of a computed CSS colour, 'rgb(r, g, b)'."""
    rgb = [int(v) / 255 for v in re.findall(r"\d+", css)[:3]]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    xyz = (sum(w * c for w, c in zip(row, lin, strict=True)) / n for row, n in (((0.4124, 0.3576, 0.1805), 0.95047),
                                                                    ((0.2126, 0.7152, 0.0722), 1.0),
                                                                    ((0.0193, 0.1192, 0.9505), 1.08883)))
    f = [t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116 for t in xyz]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def delta_e(a: str, b: str) -> float:
    """CIE76 distance: about 2 is a just-noticeable difference, 20 tells two bands apart at a glance."""
    return math.dist(lab(a), lab(b))


def verdict_kinds() -> list[str]:
    from gpuscope.diagnose.rules import ADVICE

    return sorted(set(ADVICE) | {"anomaly", "peer_outlier"})  # diagnose.baseline's side verdicts


def test_every_verdict_and_marker_has_its_own_colour_and_none_is_no_data(page):
    """The issue: launch_or_sync_bound, input_starved, idle_allocated and transfer_bound were drawn in the
    grey of 'no data', and XID and ECC markers shared a red."""
    page.open("/ui/?start=-5m")
    page.until("window.gpuscope && window.gpuscope.timelineAt !== null")
    kinds = verdict_kinds() + ["a_kind_this_page_does_not_know"]
    shown = page.page.evaluate("""(kinds) => {
        const g = window.gpuscope, key = g.meta.gpus[0].key, [t0, t1] = g.axis, w = (t1 - t0) / (kinds.length + 8);
        const markers = ["xid", "ecc", "gpu_lost", "clock_events", "guard"];
        g.drawTimeline({
          spans: kinds.map((k, i) => ({ gpu_key: key, kind: k, severity: "info", summary: k,
                                        start_ns: (t0 + i * w) * 1e9, end_ns: (t0 + (i + 0.9) * w) * 1e9 })),
          events: markers.map((k, i) => ({ gpu_key: key, kind: k, message: k, count: 1, time_ns: (t1 - (i + 1) * w) * 1e9 })) });
        const colour = (sel) => Object.fromEntries([...document.querySelectorAll(sel)].map(
          (e) => [e.dataset.kind, getComputedStyle(e).backgroundColor]));
        return { spans: colour("#timeline .span"), events: colour("#timeline .event"),
                 nodata: getComputedStyle(document.querySelector("#timeline .track")).backgroundColor,
                 legend: [...document.querySelectorAll("#legend span")].map((e) => e.textContent) };
    }""", kinds)
    unknown = shown["spans"].pop("a_kind_this_page_does_not_know")
    assert sorted(shown["spans"]) == verdict_kinds()
    for kind, colour in shown["spans"].items():
        assert delta_e(colour, shown["nodata"]) >= 20, (kind, colour, "looks like no data")
        assert delta_e(colour, unknown) >= 20, (kind, colour, "is the colour of an unknown verdict")
    for (a, ca), (b, cb) in itertools.combinations(shown["spans"].items(), 2):
        assert delta_e(ca, cb) >= 20, (a, ca, b, cb)
    assert len(shown["events"]) == 5
    for (a, ca), (b, cb) in itertools.combinations(shown["events"].items(), 2):
        assert delta_e(ca, cb) >= 20, (a, ca, b, cb)
    assert "no data" in shown["legend"] and "launch or sync bound" in shown["legend"]
    page.shot("dashboard-verdict-colours.png")
    assert page.errors == []


def chart_geometry(page, t0: float | None = None, t1: float | None = None) -> dict:
    """Per chart, in page coordinates: where the axis's start and end (those given, else the page's own)
    and each band's ends fall, read in one evaluation (a live update cannot move the axis between reads).
    Bands are matched to the timeline's spans by their order in each GPU's lane."""
    return page.page.evaluate("""([t0, t1]) => {
        const g = window.gpuscope;
        if (t0 === null) [t0, t1] = g.axis;
        const x = (c, t) => c.over.getBoundingClientRect().left + c.valToPos(t, "x");
        const track = document.querySelector("#timeline .track").getBoundingClientRect(), spans = [];
        g.meta.gpus.forEach((gpu, i) => {
          const mine = g.timeline.spans.filter((s) => s.gpu_key === gpu.key);
          const nodes = document.querySelectorAll("#timeline .lane")[i].querySelectorAll(".span");
          mine.forEach((s, j) => {
            const a = Math.max(s.start_ns / 1e9, t0), b = Math.min(s.end_ns / 1e9, t1), r = nodes[j].getBoundingClientRect();
            if (b > a) spans.push({ left: r.left, right: r.right, a: a, b: b, charts: g.charts.map((c) => [x(c, a), x(c, b)]) });
          });
        });
        return { axis: [t0, t1], track: [track.left, track.right], scales: g.charts.map((c) => [c.scales.x.min, c.scales.x.max]),
                 ends: g.charts.map((c) => [x(c, t0), x(c, t1)]), spans: spans };
    }""", [t0, t1])


def assert_one_axis(geo: dict, start: float, end: float) -> None:
    assert geo["axis"] == [pytest.approx(start, abs=1e-3), pytest.approx(end, abs=1e-3)]
    for lo, hi in geo["scales"]:  # the range asked for, not the span of the data
        assert (lo, hi) == (pytest.approx(start, abs=1e-3), pytest.approx(end, abs=1e-3))
    for left, right in geo["ends"]:  # every chart's plot area lies exactly over the bands' tracks
        assert (left, right) == (pytest.approx(geo["track"][0], abs=1), pytest.approx(geo["track"][1], abs=1))
    assert geo["spans"], "no band to compare"
    for s in geo["spans"]:
        for left, right in s["charts"]:
            assert s["left"] == pytest.approx(left, abs=1)
            if s["b"] - s["a"] > 0.01 * (end - start):  # a shorter one is drawn at least 0.2 % wide
                assert s["right"] == pytest.approx(right, abs=1)


def test_bands_and_charts_share_one_time_axis(page, agent):
    """A past range: the charts span exactly the range asked for (not the data they hold), and a verdict
    band starts and ends at the x where its times are on every chart. Live: the same, as the axis moves."""
    deadline = time.monotonic() + 40  # the diagnosis needs ~10 s of samples
    while not json.loads(http(agent.port, "/ui/api/timeline?start=-1m")[1])["spans"]:
        assert time.monotonic() < deadline, "no verdict within 40 s"
        time.sleep(0.5)
    end = float(int(time.time()))
    start = end - 90  # longer than the agent has run when this test runs first: data fill only part
    page.open(f"/ui/?start={start:.0f}&end={end:.0f}")
    page.until("window.gpuscope && window.gpuscope.timelineAt !== null")
    page.until("window.gpuscope.live > 0")  # the cards are in: the layout holds still
    assert_one_axis(chart_geometry(page, start, end), start, end)
    page.open("/ui/?start=-1m")
    page.until("window.gpuscope && window.gpuscope.timelineAt !== null && window.gpuscope.timeline.spans.length > 0")
    first = page.js("window.gpuscope.axis[1]")
    page.until(f"window.gpuscope.axis[1] > {first}")  # a live update moved the axis
    geo = chart_geometry(page)
    assert geo["axis"][1] - geo["axis"][0] == pytest.approx(60, abs=1e-3)
    assert_one_axis(geo, *geo["axis"])
    assert page.errors == []


ROUND = (1, 2, 2.5, 5)


def tick_step(labels: list[str]) -> tuple[str, float]:
    """The one unit of an axis's labels and the step between them, which must be the same all along."""
    parsed = [re.fullmatch(r"(-?\d+(?:\.\d+)?)\u00a0(\S+)", t) for t in labels]
    assert all(parsed), labels
    units = {m.group(2) for m in parsed}
    assert len(units) == 1, labels
    values = [float(m.group(1)) for m in parsed]
    steps = {round(b - a, 9) for a, b in itertools.pairwise(values)}
    assert len(steps) == 1, labels
    return units.pop(), steps.pop()


def test_axis_ticks_are_round_numbers_in_one_unit_and_labels_do_not_collide(page):
    """The issue: 0, 9.3, 19, 28, 37 GiB; GB/s in a verdict but GiB/s on the chart; a date label that ran
    into the first tick."""
    page.open("/ui/?start=-5m")
    page.until("window.gpuscope && window.gpuscope.renderedAt !== null && window.gpuscope.live > 0")
    charts = page.js("window.gpuscope.charts.map(c => [c.gpuscope.def.title, c.gpuscope.def.unit, c.gpuscope.ticks.y.labels])")
    for title, unit, labels in charts:
        assert len(labels) >= 3, (title, labels)
        shown, step = tick_step(labels)
        mantissa = step / 10 ** math.floor(math.log10(step))
        if unit == "bytes":  # binary steps: 0, 8, 16 GiB or 0, 0.5, 1 GiB
            assert math.log2(step) == int(math.log2(step)) and shown in ("B", "KiB", "MiB", "GiB", "TiB"), (title, labels)
        else:
            assert any(mantissa == pytest.approx(r) for r in ROUND), (title, labels)
        if unit == "rate":  # flows in decimal units, as the verdicts write them
            assert shown in ("B/s", "kB/s", "MB/s", "GB/s", "TB/s"), (title, labels)
    text = page.js("document.body.innerText")
    assert "iB/s" not in text  # no binary flow anywhere on the page (verdicts say GB/s)
    # Time ticks: one line each, and no two (nor the first and the y axis) overlap, measured in the axis font.
    rows = page.js("""(() => {
        const g = window.gpuscope, ctx = document.createElement("canvas").getContext("2d");
        ctx.font = g.axisFont;
        return g.charts.map((c) => { const t = c.gpuscope.ticks.x, root = c.root.getBoundingClientRect(),
                                            over = c.over.getBoundingClientRect();
          return { labels: t.labels, rootLeft: root.left, rootRight: root.right, plotLeft: over.left,
                   at: t.splits.map((s) => over.left + c.valToPos(s, "x")), widths: t.labels.map((l) => ctx.measureText(l).width) }; });
    })()""")
    for r in rows:
        assert len(r["labels"]) >= 3 and all("\n" not in t for t in r["labels"]), r["labels"]
        boxes = [(x - w / 2, x + w / 2) for x, w in zip(r["at"], r["widths"], strict=True)]
        for (_, right), (left, _) in itertools.pairwise(boxes):
            assert left - right >= 4, r
        assert boxes[0][0] >= r["plotLeft"] - 30 and boxes[-1][1] <= r["rootRight"], r  # nothing under the y labels
    assert page.errors == []


def test_units_cpu_column_and_degrees_never_wrap_alone(browser, agent):
    """Every number on a card stays on the line of its unit at 1280-1600 px (the issue: '°C' alone on the
    next line); the process table's CPU column says its unit."""
    p = Page(browser, f"http://127.0.0.1:{agent.port}")
    try:
        p.open("/ui/?start=-5m")
        p.until("window.gpuscope && window.gpuscope.renderedAt !== null && document.querySelectorAll('.card').length === 8")
        head = p.js("document.querySelector('#procs th[data-key=cpu_cores]').textContent")
        assert "%" in head
        cells = p.js("[...document.querySelectorAll('#procs tbody tr td:nth-child(7)')].map(td => td.textContent)")
        assert cells and all(c.endswith("\u00a0%") or c == "—" for c in cells), cells[:5]
        for width in range(1280, 1601, 20):
            p.page.set_viewport_size({"width": width, "height": 1000})
            broken = p.js("""[...document.querySelectorAll('.card .row > span:last-child')].filter((s) => {
                const r = document.createRange(); r.selectNodeContents(s);
                return new Set([...r.getClientRects()].map((x) => Math.round(x.top))).size > 1; }).map((s) => s.textContent)""")
            assert broken == [], (width, broken)
            assert "°C" in p.js("document.querySelector('.card').innerText")
    finally:
        p.close()


def test_sm_clock_chart_and_power_limit_line(page):
    page.open("/ui/?start=-5m")
    page.until("window.gpuscope && window.gpuscope.renderedAt !== null && window.gpuscope.overview !== null")
    charts = page.js("""Object.fromEntries(window.gpuscope.charts.map((c) => [c.gpuscope.def.title, {
        labels: c.series.slice(1).map((s) => s.label), last: c.data.slice(1).map((col) => col.filter((v) => v !== null).at(-1)),
        ymax: c.scales.y.max, ticks: c.gpuscope.ticks.y.labels }]))""")
    ov = page.js("window.gpuscope.overview.gpus.map(g => g.values)")
    clock, power = charts["SM clock"], charts["Power"]
    assert clock["labels"][-1] == "max SM clock" and clock["ticks"][-1].endswith("MHz")
    assert clock["last"][-1] == max(v["gpu_sm_clock_max_hertz"] for v in ov)  # 8 simulated H200s: one max clock
    assert all(0 < v <= clock["last"][-1] for v in clock["last"][:-1])
    assert power["labels"][-1] == "power limit"
    assert power["last"][-1] == ov[0]["gpu_power_limit_watts"] > 0
    assert power["ymax"] >= power["last"][-1]  # the limit is in view
    assert page.errors == []


def test_a_pending_alert_says_how_long_it_has_held_against_its_for(page):
    """The issue: an alert pending for 2 minutes read 'has held memory with nothing running for 30 min'."""
    page.open("/ui/?start=-5m")
    page.until("window.gpuscope && window.gpuscope.overview !== null")
    # The simulated node's GPU 5 holds memory idle: GpuIdleAllocated (for: 30 min) goes pending for real.
    text = page.until("[...document.querySelectorAll('#alerts li')].map(li => li.textContent).find(t => t.startsWith('pending GpuIdleAllocated'))",
                      timeout=60)
    assert " of the 30\u00a0min it must hold to fire: " in text and "for 30 min" not in text, text
    fed = page.page.evaluate("""() => {
        const g = window.gpuscope, ov = structuredClone(g.overview), t = ov.time_ns / 1e9 + 3600;
        ov.time_ns = t * 1e9;
        ov.alerts = { firing: [], pending: [{ rule: "GpuIdleAllocated", state: "pending", active_at: t - 125, for_s: 1800,
          labels: { alertname: "GpuIdleAllocated", severity: "warning", gpu: "5" },
          annotations: { summary: "GPU 5 on vm has held memory with nothing running for 30 min",
                         verdict: "GPU 5 holds 41.7 GiB with nothing running (SMs 0.0 %)." } }] };
        g.feed(ov);
        const li = document.querySelector("#alerts li");
        return [li.textContent, li.title];
    }""")
    assert fed[0] == ("pending GpuIdleAllocated for 2\u00a0min of the 30\u00a0min it must hold to fire: "
                      "GPU 5 holds 41.7 GiB with nothing running (SMs 0.0 %).")
    assert fed[1] == "When it fires: GPU 5 on vm has held memory with nothing running for 30 min"
    assert page.errors == []


def test_a_screenshot_of_the_simulated_mixed_node(page):
    """The whole page over the simulated 8-GPU node, once the charts' minute is full of data and every
    GPU has its band: says SIMULATED, and shows the eight GPUs' verdicts in eight colours. Set
    GPUSCOPE_RECORD_DIR to keep it (docs/img/dashboard-simulated-mixed.png is one)."""
    page.open("/ui/?start=-1m")
    page.until("window.gpuscope && window.gpuscope.timelineAt !== null && window.gpuscope.live > 0")
    # The agent may be younger than the minute: wait for the data to fill it, then for a fresh diagnosis.
    page.until("window.gpuscope.charts[0].data[0][0] <= window.gpuscope.axis[0] + 5", timeout=90)
    page.open("/ui/?start=-1m")
    page.until("window.gpuscope && window.gpuscope.timelineAt !== null && window.gpuscope.live > 0"
               " && document.querySelectorAll('.card').length === 8")
    colours = page.js("[...new Set([...document.querySelectorAll('#timeline .span')].map(e => getComputedStyle(e).backgroundColor))]")
    assert len(colours) >= 7, colours  # mixed: healthy, compute, memory, launch, input, idle_allocated, transfer
    assert "SIMULATED" in page.js("document.querySelector('#sim-banner').innerText")
    page.shot("dashboard-simulated-mixed.png")
    if os.environ.get("GPUSCOPE_RECORD_DIR"):
        page.page.screenshot(path=os.path.join(os.environ["GPUSCOPE_RECORD_DIR"], "dashboard-simulated-mixed.png"),
                             full_page=True)
    assert page.errors == []
