"""gpuscope.http, the one HTTP kit of the agent, the dashboard, the capture proxy and the guard proxy: one
--listen and --upstream rule, one JSON error body, one access rule, one way to start and stop.

Where the servers' copies used to disagree, a test here pins the rule that now holds (README, "HTTP
servers"): `:PORT` and port 0 in both proxies, the same sentence for a bad --listen, the same JSON
error body and 404/405 sentences on the agent and the dashboard, exit 1 when a port is taken.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from servers import MetricsServer

from gpuscope.errors import UsageError
from gpuscope.http.net import format_host, is_loopback_host, parse_listen, parse_upstream

ROOT = Path(__file__).resolve().parents[1]
GPUSCOPE = [sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


# -- net: one --listen rule, one --upstream rule ------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("127.0.0.1:8081", ("127.0.0.1", 8081)),
    (":8081", ("127.0.0.1", 8081)),         # the guard took this, capture did not
    ("[::1]:8081", ("::1", 8081)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),          # capture took port 0, the guard did not
    ("localhost:65535", ("localhost", 65535)),
])
def test_listen_forms_that_hold(text, want):
    assert parse_listen(text) == want


@pytest.mark.parametrize("text, words", [
    ("nonsense", "--listen must be HOST:PORT"),
    ("127.0.0.1", "--listen must be HOST:PORT"),
    ("127.0.0.1:http", "--listen must be HOST:PORT"),
    ("::1:8081", "write an IPv6 address in brackets"),  # capture read it as host '::1', port 8081
    ("[127.0.0.1]:80", "--listen must be HOST:PORT"),
    ("a b:80", "--listen must be HOST:PORT"),
    ("127.0.0.1:65536", "between 0 and 65535"),
])
def test_listen_refusals_are_one_sentence(text, words):
    with pytest.raises(UsageError) as e:
        parse_listen(text)
    assert words in str(e.value) and repr(text) in str(e.value) and str(e.value).count(". ") == 0


@pytest.mark.parametrize("text, want", [("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
                                        ("https://svc.example/v1", "https://svc.example/v1")])
def test_upstream_forms(text, want):
    assert parse_upstream(text) == want


@pytest.mark.parametrize("text, words", [
    ("localhost:8000", "must be an http:// or https:// URL"),
    ("ftp://example.com", "must be an http:// or https:// URL"),
    ("http://host:99999", "has a bad port"),
    ("http://[::1", "has a bad port or address"),
    ("http://a b", "must be an http:// or https:// URL"),
    ("http://svc:8000/?x=1", "must not carry a query or fragment"),
    ("http://svc:8000/#top", "must not carry a query or fragment"),
])
def test_upstream_refusals(text, words):
    with pytest.raises(UsageError) as e:
        parse_upstream(text)
    assert words in str(e.value) and str(e.value).startswith("--upstream")


def test_loopback_hosts_and_brackets():
    assert all(is_loopback_host(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback_host(h) for h in ("0.0.0.0", "127.example.com", "10.0.0.1", "", "localhost.evil"))
    assert format_host("::1") == "[::1]" and format_host("127.0.0.1") == "127.0.0.1"


def test_net_imports_without_aiohttp():
    code = "import sys, gpuscope.http, gpuscope.http.net, gpuscope.http.auth; print('aiohttp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_env())
    assert out.stdout.strip() == "False"


# -- responses and auth over a real server ------------------------------------------------------------------
def _serve_app(app: Any, scenario: Any) -> Any:
    """Run `scenario(base_url)` in a thread against `app` served by the kit on 127.0.0.1:0."""
    from gpuscope.http.serve import start

    async def main() -> Any:
        served = await start(app, "127.0.0.1", 0)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, scenario, served.url)
        finally:
            await served.close()

    return asyncio.run(main())


def _get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_json_errors_answer_every_failure_as_one_sentence():
    import logging

    from aiohttp import web

    from gpuscope.http.responses import BadRequest, json_errors
    from gpuscope.timeparse import parse_duration

    async def bad(request: web.Request) -> web.Response:
        raise BadRequest("end must be after start.")

    async def bad_time(request: web.Request) -> web.Response:
        parse_duration("soon", "window")
        raise AssertionError

    async def broken(request: web.Request) -> web.Response:
        raise KeyError("x")

    app = web.Application(middlewares=[json_errors(server="thing", not_found="No such page: {path}.",
                                                   log=logging.getLogger("test"))])
    app.router.add_get("/bad", bad)
    app.router.add_get("/time", bad_time)
    app.router.add_get("/broken", broken)

    def scenario(url: str) -> list[tuple[int, dict[str, Any]]]:
        return [_get(url + "/bad"), _get(url + "/time"), _get(url + "/broken"), _get(url + "/nope"),
                _get(url + "/bad", method="POST")]

    answers = _serve_app(app, scenario)
    assert answers == [
        (400, {"error": "end must be after start."}),
        (400, answers[1][1]),
        (500, {"error": "The thing failed to answer: KeyError."}),
        (404, {"error": "No such page: /nope."}),
        (405, {"error": "POST is not allowed on /bad."}),
    ]
    assert "window" in answers[1][1]["error"] and "soon" in answers[1][1]["error"]
    assert issubclass(BadRequest, UsageError)


def test_one_access_rule_for_agent_and_dashboard():
    from aiohttp import web

    from gpuscope.http.auth import COOKIE, access, cookie_value

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    token = "t" * 32
    apps = {}
    for loopback in (True, False):
        app = web.Application(middlewares=[access(token=token, loopback_only=loopback, server="agent",
                                                  token_hint="the agent's data directory")])
        app.router.add_get("/api", hello)
        app.router.add_post("/api", hello)
        app.router.add_get("/ui/", hello)
        apps[loopback] = app

    def loopback(url: str) -> list[int]:
        return [_get(url + "/api")[0], _get(url + "/api", {"Host": "evil.example"})[0],
                _get(url + "/api", method="POST")[0],
                _get(url + "/api", {"Authorization": f"Bearer {token}"}, method="POST")[0]]

    assert _serve_app(apps[True], loopback) == [200, 403, 401, 200]

    def beyond(url: str) -> list[Any]:
        return [_get(url + "/api"), _get(url + "/api", {"Authorization": f"Bearer {token}"})[0],
                _get(url + "/api", {"Cookie": f"{COOKIE}={cookie_value(token)}"})[0],
                _get(url + "/api", {"Cookie": f"{COOKIE}=forged"})[0]]

    refused, header, cookie, forged = _serve_app(apps[False], beyond)
    assert refused[0] == 401 and "Authorization: Bearer <token>" in refused[1]["error"]
    assert (header, cookie, forged) == (200, 200, 401)
    with pytest.raises(ValueError):
        access(token=None, loopback_only=False, server="dashboard", token_hint="x")


def test_token_file_is_made_0600_and_a_directory_is_refused(tmp_path):
    from gpuscope.http.auth import TokenError, find_token, load_or_create_token

    path = tmp_path / "token"
    token = load_or_create_token(path)
    assert len(token) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_token(path) == token
    path.chmod(0o644)
    assert load_or_create_token(path) == token and path.stat().st_mode & 0o777 == 0o600
    assert find_token(None, str(tmp_path)) == token
    d = tmp_path / "shared"
    d.mkdir(mode=0o777)
    with pytest.raises(TokenError, match="not a regular file"):
        load_or_create_token(d)
    with pytest.raises(TokenError, match="cannot be made"):
        load_or_create_token(tmp_path / "missing" / "token")


def test_features_take_the_token_helpers_from_the_kit():
    """web/ and guard/ read or make tokens through gpuscope.http.auth, not through the agent."""
    for rel in ("web/dashboard_cmd.py", "guard/_events.py", "web/api.py"):
        text = (ROOT / "src" / "gpuscope" / rel).read_text()
        assert "..agent" not in text, rel


# -- serve: the port-in-use sentence, port 0, signals -------------------------------------------------------
def test_port_in_use_is_one_sentence_naming_the_flag():
    from aiohttp import web

    from gpuscope.http.serve import ListenError, start

    async def main() -> str:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(ListenError) as e:
                await start(web.Application(), "127.0.0.1", port, flag="--listen")
            return str(e.value)

    msg = asyncio.run(main())
    assert "is already in use; choose another with --listen." in msg and ListenError.exit_code == 1


def _upstream() -> MetricsServer:
    return MetricsServer(lambda path: b"ok\n")


@pytest.mark.parametrize("verb", ["guard", "capture"])
def test_both_proxies_take_port_0_and_colon_port_and_stop_on_sigterm(verb, tmp_path):
    cfg = tmp_path / "g.toml"
    cfg.write_text('[[classes]]\nname = "all"\nrate = 100\nburst = 100\n')
    with _upstream() as up:
        args = (["guard", "proxy", "--config", str(cfg)] if verb == "guard"
                else ["capture", "--out", str(tmp_path / "c.jsonl")])
        proc = subprocess.Popen([*GPUSCOPE, *args, "--upstream", up.url, "--listen", ":0"], env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            url = line.split("http://", 1)[1].split()[0] if "http://" in line else ""
            assert url.startswith("127.0.0.1:") and not url.endswith(":0"), (line, proc.stderr.read())
            with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as r:
                assert r.read() == b"ok\n"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            assert "Traceback" not in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("args", [
    ["guard", "proxy", "--config", "{cfg}", "--upstream", "{up}"],
    ["capture", "--out", "{out}", "--upstream", "{up}"],
])
def test_both_proxies_refuse_the_same_listen_forms_alike(args, tmp_path):
    cfg = tmp_path / "g.toml"
    cfg.write_text('[[classes]]\nname = "all"\nrate = 1\nburst = 1\n')
    with _upstream() as up:
        fill = {"cfg": str(cfg), "up": up.url, "out": str(tmp_path / "c.jsonl")}
        argv = [a.format(**fill) for a in args]
        bad = subprocess.run([*GPUSCOPE, *argv, "--listen", "::1:8081"], env=_env(), capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and "write an IPv6 address in brackets" in bad.stderr
        assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            busy = subprocess.run([*GPUSCOPE, *argv, "--listen", f"127.0.0.1:{port}"], env=_env(),
                                  capture_output=True, text=True, timeout=60)
        assert busy.returncode == 1, busy.stderr
        assert f"Port {port} on 127.0.0.1 is already in use; choose another with --listen." in busy.stderr
        assert busy.stderr.count("\n") == 1 and "Traceback" not in busy.stderr


def test_dashboard_answers_the_kit_error_body():
    """The dashboard alone (`gpuscope dashboard`) is behind the same middleware pair as the agent: the same
    404 shape, the 401 for a change without the token and the 403 for a Host name that is not loopback."""
    from gpuscope.web.api import make_ui_app

    class Backend:
        async def close(self) -> None:
            pass

    app = make_ui_app(Backend(), token=None, loopback_only=True, token_path="")

    def scenario(url: str) -> list[tuple[int, dict[str, Any]]]:
        return [_get(url + "/nope"), _get(url + "/ui/api/overview", method="POST"),
                _get(url + "/ui/api/overview", {"Host": "evil.example"})]

    (c404, b404), (c401, b401), (c403, b403) = _serve_app(app, scenario)
    assert (c404, b404) == (404, {"error": "No such page: /nope; the dashboard is at /ui/."})
    assert c401 == 401 and "needs this server's token" in b401["error"]  # a change needs the token, on loopback too
    assert c403 == 403 and b403["error"].startswith("This dashboard listens on loopback only")


def test_start_waits_for_a_signal_then_closes():
    """served.wait() returns on SIGTERM (the verbs that serve stop cleanly), and close() runs on_shutdown."""
    from aiohttp import web

    from gpuscope.http.serve import start

    shut = []

    async def on_shutdown(app: web.Application) -> None:
        shut.append(True)

    async def main() -> None:
        app = web.Application()
        app.on_shutdown.append(on_shutdown)
        served = await start(app, "127.0.0.1", 0)
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
        await served.wait()
        await served.close()

    previous = signal.getsignal(signal.SIGTERM)
    try:
        asyncio.run(main())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert shut == [True]
