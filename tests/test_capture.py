"""`gpuscope capture`: the real proxy process in front of the real example inference service and of a plain
aiohttp server: streams pass through as they are produced, one replay line per request, anonymisation,
no credentials in the file, and one sentence for a bad upstream."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from loadtest_servers import LoadtestServer
from servers import ExampleService, free_port
from test_example_service import _wait_for, metrics, stream

from gpuscope.loadtest import schedule as S
from gpuscope.loadtest.capture import anonymise, filler, is_secret_header, prompt_chars, recorded_headers
from gpuscope.loadtest.requests import Protocol
from gpuscope.loadtest.runner import execute, summarize
from gpuscope.loadtest.worker import WorkerConfig

# Not `-m gpuscope.cli`: that would load cli twice (as __main__ and as gpuscope.cli), with two UsageErrors.
GPUSCOPE = [sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())"]


class PlainServer:
    """An aiohttp server on its own thread: /gated streams 'one', then waits for GET /release before 'two';
    /echo answers the request back as JSON; /die drops the connection without an answer."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.gate = asyncio.Event()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/gated", self.gated)
        app.router.add_get("/release", self.release)
        app.router.add_route("*", "/echo", self.echo)
        app.router.add_post("/die", self.die)
        app.router.add_get("/missing", self.missing)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        ready.set()
        self.loop.run_forever()

    async def gated(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        await self.gate.wait()  # released only by a client that already read 'one' through the proxy
        await resp.write(b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\n')
        return resp

    async def missing(self, request: web.Request) -> web.Response:
        return web.json_response({"error": "nope"}, status=404)

    async def release(self, request: web.Request) -> web.Response:
        self.gate.set()
        return web.Response(text="ok")

    async def echo(self, request: web.Request) -> web.Response:
        return web.json_response({"method": request.method, "path": request.path_qs,
                                  "headers": dict(request.headers), "body": (await request.read()).decode()})

    async def die(self, request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.close()
        raise asyncio.CancelledError

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Capture:
    def __init__(self, upstream: str, out: Path, *args: str) -> None:
        self.out = out
        self.proc = subprocess.Popen([*GPUSCOPE, "capture", "--upstream", upstream,
                                      "--listen", "127.0.0.1:0", "--out", str(out), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        assert line.startswith("listening on http://"), (line, self.proc.stderr.read() if self.proc.stderr else "")
        self.url = line.split()[-1]

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, err

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.out.read_text().splitlines()]


@pytest.fixture(scope="module")
def plain() -> Iterator[PlainServer]:
    s = PlainServer()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def example() -> Iterator[ExampleService]:
    s = ExampleService("--seed", "2")
    yield s
    s.stop()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_a_stream_passes_through_as_it_is_produced(plain, tmp_path):
    cap = Capture(plain.url, tmp_path / "c.jsonl")
    try:
        async def go() -> list[bytes]:
            got = []
            async with aiohttp.ClientSession() as s:
                async with s.post(cap.url + "/gated", json={"prompt": "hi"}) as r:
                    got.append(await asyncio.wait_for(r.content.readline(), 20))  # hangs if the proxy buffers
                    async with s.get(plain.url + "/release") as rel:
                        assert rel.status == 200
                    got += [line async for line in r.content if line.strip()]
            return got

        got = run(go())
        assert got[0] == b"data: one\n" and got[-1] == b"data: [DONE]\n"
    finally:
        rc, _ = cap.stop()
    assert rc == 0
    [line] = cap.lines()
    assert line["output_tokens"] == 2 and line["status"] == 200 and line["path"] == "/gated"


def test_replay_lines_from_the_example_service(example, tmp_path):
    cap = Capture(example.url, tmp_path / "c.jsonl")
    try:
        async def go() -> tuple[list[Any], Any]:
            events = await stream(cap.url + "/v1/completions", {"prompt": "one two three", "max_tokens": 9,
                                                                "ignore_eos": True,
                                                                "stream_options": {"include_usage": True}})
            async with aiohttp.ClientSession() as s:
                async with s.post(cap.url + "/v1/chat/completions",
                                  headers={"Authorization": "Bearer sk-secret", "Cookie": "sid=abc",
                                           "X-Api-Key": "k123", "X-Request-Class": "gold"},
                                  json={"model": "m", "max_tokens": 4, "ignore_eos": True,
                                        "messages": [{"role": "user", "content": "hello there"}]}) as r:
                    whole = await r.json()
                async with s.post(cap.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}) as r:
                    assert r.status == 400
            return events, whole

        events, whole = run(go())
    finally:
        cap.stop()
    assert events[-1] == "[DONE]" and len(events) == 9 + 2  # every chunk came through, usage and [DONE] too
    assert whole["usage"]["completion_tokens"] == 4
    lines = cap.lines()
    assert [x["path"] for x in lines] == ["/v1/completions", "/v1/chat/completions", "/v1/completions"]
    assert lines[0]["t"] == 0 and lines[0]["t"] <= lines[1]["t"] <= lines[2]["t"]
    assert [x["output_tokens"] for x in lines] == [9, 4, None]
    assert [x["status"] for x in lines] == [200, 200, 400]
    assert lines[0]["body"]["prompt"] == "one two three" and lines[0]["prompt_chars"] == 13
    assert lines[1]["prompt_chars"] == len("hello there") and lines[1]["method"] == "POST"
    assert all(x["duration_s"] > 0 for x in lines)
    text = cap.out.read_text()
    assert "sk-secret" not in text and "sid=abc" not in text and "k123" not in text
    assert lines[1]["headers"]["X-Request-Class"] == "gold"


def test_a_client_leaving_through_the_proxy_frees_the_upstream_slot(example, tmp_path):
    cap = Capture(example.url, tmp_path / "c.jsonl")
    try:
        async def go() -> tuple[dict[str, float], dict[str, float]]:
            before = await metrics(example.url)
            async with aiohttp.ClientSession() as s:
                r = await s.post(cap.url + "/v1/completions",
                                 json={"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True})
                assert (await r.content.readline()).startswith(b"data: ")
                r.close()
            await _wait_for(example.url, "vllm:num_requests_running", 0)
            return before, await metrics(example.url)

        before, after = run(go())
    finally:
        cap.stop()
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 1000
    [line] = cap.lines()
    assert line["status"] == 200 and line["error"].startswith("The client closed")


def test_anonymise_keeps_structure_lengths_and_numbers(plain, tmp_path):
    cap = Capture(plain.url, tmp_path / "c.jsonl", "--anonymise")
    body = {"model": "llama-3", "max_tokens": 77, "temperature": 0.5,
            "messages": [{"role": "system", "content": "You are Bob."},
                         {"role": "user", "content": [{"type": "text", "text": "My card is 4111 1111!"}]}]}
    try:
        async def go() -> Any:
            async with aiohttp.ClientSession() as s:
                async with s.post(cap.url + "/echo?user=alice", json=body) as r:
                    return await r.json()
        echoed = run(go())
    finally:
        cap.stop()
    assert json.loads(echoed["body"]) == body  # the upstream got the real request
    [line] = cap.lines()
    rec = line["body"]
    assert rec["model"] == "llama-3" and rec["max_tokens"] == 77 and rec["temperature"] == 0.5
    assert rec["messages"][0] == {"role": "system", "content": "xxx xxx xxxx"}
    assert rec["messages"][1]["content"] == [{"type": "text", "text": "xx xxxx xx xxxx xxxxx"}]
    assert line["prompt_chars"] == len("You are Bob.") + len("My card is 4111 1111!")
    text = cap.out.read_text()
    assert "Bob" not in text and "4111" not in text and "alice" not in text
    assert line["path"] == "/echo?user=xxxxx"


def test_non_json_bodies_errors_and_methods_are_recorded(plain, tmp_path):
    cap = Capture(plain.url, tmp_path / "c.jsonl")
    try:
        async def go() -> list[tuple[int, Any]]:
            async with aiohttp.ClientSession() as s:
                out = []
                async with s.put(cap.url + "/echo", data=b"plain words here") as r:
                    out.append((r.status, await r.json()))
                async with s.get(cap.url + "/missing") as r:
                    out.append((r.status, await r.json()))
                async with s.post(cap.url + "/die", json={}) as r:
                    out.append((r.status, await r.json()))
                async with s.post(cap.url + "/echo", data=deep, headers={"Content-Type": "application/json"}) as r:
                    out.append((r.status, await r.json()))
                return out
        deep = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError on it, not ValueError
        (s1, b1), (s2, b2), (s3, b3), (s4, b4) = run(go())
    finally:
        rc, err = cap.stop()
    assert (s1, s2, s3) == (200, 404, 502)
    assert b1["method"] == "PUT" and b2 == {"error": "nope"}
    assert b3["error"]["message"].startswith("The upstream") and "Traceback" not in err
    lines = cap.lines()
    assert lines[0]["body"] == "plain words here" and lines[0]["prompt_chars"] == 16 and lines[0]["method"] == "PUT"
    assert lines[1]["body"] is None and lines[1]["status"] == 404
    assert lines[2]["status"] == 502 and lines[2]["error"].startswith("The upstream")
    assert s4 == 200 and b4["body"] == deep and lines[3]["body"] == deep  # recorded as text
    assert rc == 0


def test_count_stops_after_n_requests(plain, tmp_path):
    cap = Capture(plain.url, tmp_path / "c.jsonl", "--count", "2")

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                async with s.get(cap.url + "/echo") as r:
                    assert r.status == 200
    run(go())
    assert cap.proc.wait(timeout=30) == 0
    assert len(cap.lines()) == 2


@pytest.mark.parametrize("args,sentence", [
    (["--upstream", "http://127.0.0.1:{dead}"], "Cannot connect to the upstream"),
    (["--upstream", "ftp://example.com"], "--upstream must be an http:// or https:// URL"),
    (["--upstream", "http://127.0.0.1:1", "--listen", "nonsense"], "--listen must be HOST:PORT"),
    (["--upstream", "http://127.0.0.1:1", "--count", "-1"], "--count must be"),
    (["--upstream", "{plain}", "--out", "/nonexistent/dir/c.jsonl"], "Cannot write"),
    ([], "--upstream"),
])
def test_bad_input_is_one_sentence_and_exit_2(plain, tmp_path, args, sentence):
    args = [a.replace("{dead}", str(free_port())).replace("{plain}", plain.url) for a in args]
    p = subprocess.run([*GPUSCOPE, "capture", "--listen", "127.0.0.1:0",
                        "--out", str(tmp_path / "c.jsonl"), *args], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert p.returncode == 2, p.stderr
    assert sentence in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "c.jsonl").exists()  # a capture that never started leaves no empty file


def test_helpers():
    assert filler("a b\tc") == "x x\tx"
    assert is_secret_header("Authorization") and is_secret_header("x-api-key") and is_secret_header("Cookie")
    assert is_secret_header("X-Auth-Token") and is_secret_header("api_key") and is_secret_header("Proxy-Authorization")
    assert not is_secret_header("Content-Type") and not is_secret_header("X-Request-Class")
    assert recorded_headers({"Host": "h", "Connection": "x", "Accept": "a"}) == {"Accept": "a"}
    assert prompt_chars({"prompt": ["ab", "cde"]}) == 5 and prompt_chars({"input": "abc"}) == 3
    assert anonymise({"prompt": [1, 2, 3], "n": 1}) == {"prompt": [1, 2, 3], "n": 1}


# -- HTTP/1.1 as upstreams speak it (issue 18): the scripted servers of loadtest_servers behind the proxy ----------
@pytest.fixture(scope="module")
def scripted() -> Iterator[LoadtestServer]:
    with LoadtestServer() as s:
        yield s


def _load(url: str, n: int = 4, proto: Protocol | None = None) -> tuple[dict, list]:
    """gpuscope loadtest's own client through the proxy: n requests at 20/s, the summary and the records."""
    cfg = WorkerConfig(url=url, proto=proto or Protocol(), keep_records=True, timeout_s=10.0,
                       plan=S.plan([S.Stage(None, rate=20, arrival="constant", requests=n)], seed=1))
    res = execute(cfg, 1)
    return summarize(cfg, res, url=url, protocol="http", stage_names=["s"])["overall"], res.records


def test_upstreams_that_speak_http11_their_own_way_pass_through(scripted, tmp_path):
    cap = Capture(f"http://127.0.0.1:{scripted.script_port}", tmp_path / "c.jsonl")
    try:
        for path in ("/eof_body", "/interim", "/trailers", "/close_header", "/close_each", "/head", "/keep"):
            proto = Protocol(method="HEAD") if path == "/head" else None
            o, recs = _load(cap.url + path, proto=proto)
            assert o["errors"] == {} and [r.status for r in recs] == [200] * 4, (path, o["errors"], recs[0])
        o, recs = _load(cap.url + "/eof_sse", proto=Protocol(kind="openai-completions"))
        assert o["errors"] == {} and all(len(r.chunk_times or []) == 3 for r in recs), o["errors"]
        o, _ = _load(cap.url + "/keep", proto=Protocol(headers={"Connection": "close"}))   # the client's own close
        assert o["errors"] == {}
        o, _ = _load(cap.url + "/expect", proto=Protocol(method="POST", body="x" * 100,
                                                         headers={"Expect": "100-continue"}))
        assert o["errors"] == {}

        async def body() -> bytes:
            async with aiohttp.ClientSession() as s, s.get(cap.url + "/eof_body") as r:
                return await r.read()
        assert run(body()) == b"part one, part two, the end"   # a close-delimited body, whole
    finally:
        rc, err = cap.stop()
    assert rc == 0 and "Traceback" not in err
    lines = cap.lines()
    assert all(x["status"] == 200 and "error" not in x for x in lines), [x for x in lines if x["status"] != 200][:1]
    assert [x["output_tokens"] for x in lines if x["path"] == "/eof_sse"] == [3] * 4


@pytest.mark.parametrize("path, says", [
    ("/bad_status", "not valid HTTP (Bad status line)"),
    ("/status_600", "answered status 600, which is not an HTTP status"),
    ("/switch", "switched protocols (101), which the capture proxy does not relay"),
    ("/huge_field", "not valid HTTP (Got more than 8190 bytes"),
    ("/long_body", "not valid HTTP (Bad status line)"),   # the bytes past its body, read as the next answer
])
def test_an_upstream_answer_that_is_not_http_is_a_502_with_its_sentence(scripted, tmp_path, path, says):
    cap = Capture(f"http://127.0.0.1:{scripted.script_port}", tmp_path / "c.jsonl")
    try:
        o, _ = _load(cap.url + path, n=2)
    finally:
        rc, err = cap.stop()
    assert o["errors"] == {"http_5xx": 2} and rc == 0 and "Traceback" not in err
    assert all(x["status"] == 502 and says in x["error"] for x in cap.lines()), cap.lines()


def test_an_upstream_that_cuts_or_stalls_its_body_cuts_the_clients(scripted, tmp_path):
    cap = Capture(f"http://127.0.0.1:{scripted.script_port}", tmp_path / "c.jsonl", "--timeout", "1")
    try:
        o, recs = _load(cap.url + "/short_body", n=2)
        assert o["errors"] == {"disconnect": 2}
        o, recs = _load(cap.url + "/stall_body", n=2)
        assert o["errors"] == {"disconnect": 2}          # cut at the proxy's --timeout, not left hanging
    finally:
        rc, err = cap.stop()
    assert rc == 0 and "Traceback" not in err
    lines = cap.lines()
    assert [x["path"] for x in lines] == ["/short_body"] * 2 + ["/stall_body"] * 2
    assert all("closed the connection before the answer was complete" in x["error"] for x in lines[:2])
    assert all("did not answer in time" in x["error"] for x in lines[2:4])
