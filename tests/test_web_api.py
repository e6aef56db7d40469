"""The dashboard's /ui/api/* as a browser uses it: a real agent process on loopback, real HTTP."""

from __future__ import annotations

import http.client as httpc
import json
import socket
import time
import urllib.parse

import pytest
from test_agent import AgentProc, http

HTML = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = AgentProc(tmp_path_factory.mktemp("web"), "--simulate", "mixed", "--gpus", "3", "--processes", "12")
    a.wait_ready()
    time.sleep(2.0)  # a couple of seconds of history
    yield a
    assert a.stop() == 0


def get(agent: AgentProc, path: str) -> tuple[int, dict]:
    code, body = http(agent.port, path)
    return code, json.loads(body)


def raw(port: int, path: str, headers: dict[str, str] | None = None, host: str = "127.0.0.1") -> httpc.HTTPResponse:
    conn = httpc.HTTPConnection(host, port, timeout=10)
    conn.request("GET", path, headers=headers or {})
    return conn.getresponse()


def key0(agent: AgentProc) -> str:
    return get(agent, "/ui/api/meta")[1]["gpus"][0]["key"]


def test_meta_overview_alerts(agent):
    code, meta = get(agent, "/ui/api/meta")
    assert code == 200 and meta["source"] == "agent" and meta["simulated"] == "mixed"
    assert [g["gpu"] for g in meta["gpus"]] == ["0", "1", "2"]
    assert "gpu_sm_active_ratio" in meta["metrics"] and meta["resolution_s"] == pytest.approx(0.05)
    code, ov = get(agent, "/ui/api/overview")
    assert code == 200 and len(ov["gpus"]) == 3 and len(ov["processes"]) == 12
    assert ov["gpus"][0]["key"] == meta["gpus"][0]["key"] and ov["gpus"][0]["values"]["gpu_sm_active_ratio"] is not None
    code, al = get(agent, "/ui/api/alerts")
    assert code == 200 and {"firing", "pending", "resolved"} <= set(al)


def test_range_auto_step_gpu_filter_and_timeline(agent):
    k = key0(agent)
    code, r = get(agent, "/ui/api/range?metric=gpu_sm_active_ratio&start=-30s&end=now&step=auto")
    assert code == 200 and r["step_s"] == 0.1  # 30 s / 1000 points is finer than the 50 ms samples: the next nice step
    assert len(r["series"]) == 3 and all(len(s["timestamps_ns"]) == len(s["values"]) > 5 for s in r["series"])
    code, r = get(agent, "/ui/api/range?" + urllib.parse.urlencode({"metric": "gpu_power_watts", "start": "-24h",
                                                                      "gpu": k, "agg": "max"}))
    assert code == 200 and r["step_s"] == 120 and [s["gpu_key"] for s in r["series"]] == [k]
    code, r = get(agent, "/ui/api/range?metric=gpu_power_watts&start=-10s&step=1s")
    assert code == 200 and r["step_s"] == 1.0
    deadline = time.monotonic() + 20  # a verdict needs ~10 s of samples
    while True:
        code, tl = get(agent, "/ui/api/timeline?start=-1m")
        if tl.get("spans") or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert code == 200 and tl["spans"] and {s["gpu_key"] for s in tl["spans"]} <= {g["key"] for g in get(agent, "/ui/api/meta")[1]["gpus"]}
    assert all(e["kind"] in ("xid", "ecc", "clock_events", "gpu_lost", "process_start", "process_stop") for e in tl["events"])


def test_alerts_carry_their_rules_for(tmp_path):
    """A pending alert comes with its rule's `for` (seconds) and when its condition began to hold, so that
    the page can say 'pending for 2 min of the 30 min it must hold' instead of the summary written for
    when it fires ('... for 30 min')."""
    (tmp_path / "rules.toml").write_text('builtins = false\n\n[[rules]]\nname = "GpuDrawsPower"\n'
                                         'metric = "gpu_power_watts"\nagg = "max"\nwindow = "1s"\n'
                                         'condition = "> 0"\nfor = "30m"\n'
                                         'summary = "GPU {gpu} has drawn power for 30 min"\n')
    (tmp_path / "agent.toml").write_text('[alerts]\nrule_files = ["rules.toml"]\nevaluation_interval = "500ms"\n')
    started = time.time()
    a = AgentProc(tmp_path, "--simulate", "healthy", "--config", str(tmp_path / "agent.toml"))
    a.wait_ready()
    try:
        deadline = time.monotonic() + 20
        while True:
            code, ov = get(a, "/ui/api/overview")
            pending = ov.get("alerts", {}).get("pending", [])
            if pending or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert code == 200 and pending, ov
        assert pending[0]["rule"] == "GpuDrawsPower" and pending[0]["for_s"] == 1800.0
        assert started <= pending[0]["active_at"] <= time.time()  # when it began to hold: since this agent runs
        code, al = get(a, "/ui/api/alerts")
        assert code == 200 and [(x["rule"], x["for_s"]) for x in al["pending"]] == [("GpuDrawsPower", 1800.0)]
    finally:
        a.stop()


@pytest.mark.parametrize("path,status,words", [
    ("/ui/api/range", 400, "metric is required"),
    ("/ui/api/range?metric=no_such_metric", 400, "not a metric"),
    ("/ui/api/range?metric=gpu_power_watts&start=-1h&end=-2h", 400, "end must be after start"),
    ("/ui/api/range?metric=gpu_power_watts&start=yesterday", 400, "not a time"),
    ("/ui/api/range?metric=gpu_power_watts&start=-500d", 400, "400 days"),
    ("/ui/api/range?metric=gpu_power_watts&step=banana", 400, "not a duration"),
    ("/ui/api/range?metric=gpu_power_watts&start=-1d&step=1ms", 400, "points per series"),
    ("/ui/api/range?metric=gpu_power_watts&agg=p99", 400, "agg must be"),
    ("/ui/api/range?metric=gpu_power_watts&bad-label=1", 400, "not a label name"),
    ("/ui/api/range?metric=gpu_power_watts&gpu=elsewhere/9", 404, "elsewhere/9"),
    ("/ui/api/timeline?gpu=elsewhere/9", 404, "elsewhere/9"),
    ("/ui/api/timeline?start=now&end=-1h", 400, "end must be after start"),
    ("/ui/api/stream?interval=1ms", 400, "interval"),
    ("/ui/api/stream?interval=forever", 400, "not a duration"),
    ("/ui/api/nothing", 404, "No such"),
    ("/ui/vendor/../../token", 404, ""),
    ("/ui/static/secret.py", 404, ""),
])
def test_bad_requests_are_4xx_sentences(agent, path, status, words):
    code, body = http(agent.port, path)
    assert code == status, body
    msg = json.loads(body)["error"]
    assert words in msg and msg.endswith(".") and "\n" not in msg


def test_page_assets_and_root_content_negotiation(agent):
    r = raw(agent.port, "/ui/")
    body = r.read().decode()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/html")
    assert "default-src 'self'" in r.getheader("Content-Security-Policy")
    assert "http://" not in body and "https://" not in body  # nothing from the internet
    for asset in ("/ui/static/app.js", "/ui/static/app.css", "/ui/vendor/uPlot.iife.min.js", "/ui/vendor/uPlot.min.css"):
        r = raw(agent.port, asset)
        assert r.status == 200 and len(r.read()) > 1000, asset
    r = raw(agent.port, "/", {"Accept": HTML})
    assert r.status == 302 and r.getheader("Location") == "/ui/"
    code, index = get(agent, "/")  # tools and the existing tests keep the JSON index
    assert code == 200 and "/ui/" in index["endpoints"]
    r = raw(agent.port, "/", {"Accept": "application/json"})
    assert r.status == 200


def sse_events(port: int, path: str, want: int, timeout: float = 10.0, headers: dict[str, str] | None = None):
    conn = httpc.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events, head, buf = [], b"", b""
    deadline = time.monotonic() + timeout
    while len(events) < want and time.monotonic() < deadline:
        buf += resp.read1(65536)
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            lines = block.decode().split("\n")
            if not head:
                head = block
            kind = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
            if kind:
                events.append((kind, json.loads("".join(ln[6:] for ln in lines if ln.startswith("data: ")))))
    conn.close()
    return head, events


def test_stream_delivers_overviews(agent):
    t0 = time.monotonic()
    head, events = sse_events(agent.port, "/ui/api/stream?interval=250ms", want=3)
    assert head.startswith(b"retry: ")
    assert [k for k, _ in events] == ["overview"] * 3 and time.monotonic() - t0 < 5
    assert len(events[0][1]["gpus"]) == 3 and events[-1][1]["time_ns"] > events[0][1]["time_ns"]


def test_stream_limit_and_stop_with_open_streams(tmp_path):
    a = AgentProc(tmp_path, "--simulate", "healthy")
    a.wait_ready()
    socks = []
    try:
        for i in range(32):  # 8 clients (127.0.0.2-9: all of 127/8 is loopback) with the most each may hold
            s = socket.create_connection(("127.0.0.1", a.port), source_address=(f"127.0.0.{2 + i // 8}", 0))
            s.sendall(b"GET /ui/api/stream?interval=5s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200"), "stream did not open"
            socks.append(s)
        code, body = http(a.port, "/ui/api/stream")
        assert code == 503 and "Too many" in json.loads(body)["error"]
        t0 = time.monotonic()
        assert a.stop() == 0 and time.monotonic() - t0 < 10  # open dashboards do not hold the agent up
    finally:
        for s in socks:
            s.close()
        a.stop()


def test_token_cookie_flow_beyond_loopback(tmp_path):
    a = AgentProc(tmp_path, "--simulate", "healthy", "--bind", "0.0.0.0")
    a.wait_ready()
    try:
        token = a.token()
        r = raw(a.port, "/ui/")
        assert r.status == 401 and "/ui/?token=" in json.loads(r.read())["error"]
        assert raw(a.port, "/ui/api/overview").status == 401
        assert raw(a.port, "/ui/?token=not-the-token-at-all").status == 401
        r = raw(a.port, "/ui/?start=-6h&token=" + urllib.parse.quote(token))
        assert r.status == 303 and r.getheader("Location") == "/ui/?start=-6h"  # the token leaves the URL
        cookie = r.getheader("Set-Cookie")
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and token not in cookie
        jar = {"Cookie": cookie.split(";", 1)[0]}
        r = raw(a.port, "/ui/", jar)
        page = r.read().decode()
        assert r.status == 200 and token not in page
        r = raw(a.port, "/ui/api/overview", jar)
        assert r.status == 200 and json.loads(r.read())["gpus"]
        head, events = sse_events(a.port, "/ui/api/stream?interval=250ms", want=1, headers=jar)
        assert events and events[0][0] == "overview"
        assert raw(a.port, "/ui/api/overview", {"Cookie": "gpuscope_ui=forged"}).status == 401
        assert raw(a.port, "/ui/api/overview", {"Authorization": f"Bearer {token}"}).status == 200
    finally:
        a.stop()


def test_loopback_agent_refuses_other_host_names(agent):
    r = raw(agent.port, "/ui/api/overview", {"Host": "evil.example:80"})
    assert r.status == 403


def test_no_data_yet(tmp_path):
    """Right after start: the page's API answers, with empty series rather than errors."""
    a = AgentProc(tmp_path, "--simulate", "gpu_lost", "--gpus", "2")
    a.wait_ready()
    try:
        code, r = get(a, "/ui/api/range?metric=gpu_nvlink_rx_bytes_per_second&start=-1h&end=-30m")
        assert code == 200 and r["series"] == []
        code, tl = get(a, "/ui/api/timeline?start=-2h&end=-1h")
        assert code == 200 and tl == {"spans": [], "events": []}
        time.sleep(1.0)
        code, ov = get(a, "/ui/api/overview")
        assert code == 200 and len(ov["gpus"]) == 2
    finally:
        a.stop()


def test_standalone_dashboard_answers_a_failing_backend_in_json():
    """`gpuscope dashboard`'s app (not the agent's): a backend bug is a JSON 500 sentence, and the
    server goes on answering."""
    import asyncio
    import threading

    from aiohttp import web as aioweb

    from gpuscope.web.api import make_ui_app

    class Broken:
        source = "prometheus"

        async def overview(self):
            raise RuntimeError("boom")

        async def meta(self):
            return {"source": "prometheus", "simulated": None, "version": "x", "gpus": [], "metrics": [],
                    "resolution_s": 15.0, "oldest_ns": None}

        async def close(self):
            return None

    loop = asyncio.new_event_loop()
    runner = aioweb.AppRunner(make_ui_app(Broken(), token=None, loopback_only=True, token_path=""))
    loop.run_until_complete(runner.setup())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop.run_until_complete(aioweb.TCPSite(runner, "127.0.0.1", port).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        code, body = http(port, "/ui/api/overview")
        assert code == 500 and json.loads(body) == {"error": "The dashboard failed to answer: RuntimeError."}
        code, body = http(port, "/ui/api/meta")
        assert code == 200 and json.loads(body)["source"] == "prometheus"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
