"""Real loopback servers for the load tester's tests, each run as a subprocess (its own core and GIL).

`python tests/loadtest_servers.py --port 0 [--seed 1] [--stall-every 5 --stall-s 1] [--tls CERT KEY]`
prints "ready PORT RAWPORT" and serves until killed:
- GET|POST /latency: answers after 50 ms ± uniform(5 ms) jitter drawn from a seeded RNG; an answer due
  inside a stall window (every --stall-every s from the start, --stall-s long) waits for its end. Each
  answer's [handler start, start of the answer's write, request body] (time.perf_counter(), seconds) is kept:
  GET /_applied lists them (a body of "{seq}" names the load tester's request).
- POST /v1/completions, /v1/chat/completions: scripted SSE — content chunks at 100, 120, 140, 160, 180 ms
  after the request, a usage chunk (prompt_tokens 7, completion_tokens 9) at 190 ms, then [DONE]. Each
  request's [arrival, start of each chunk's write..., start of the last write] (time.perf_counter(), seconds)
  goes to GET /_sse_applied. ?no_usage=1 leaves usage out.
- /status/N: answers status N. /sleep?s=X: answers after X s. /malformed_sse: a 200 stream with bad JSON.
- /error_sse: a 200 stream whose second event is an error object (code 500), as vLLM sends mid-stream.
- /fast: answers "ok" at once (for added-latency measurements: the server's own time is near zero).
- /hold?s=X: answers after X s; each arrival is kept as [time.perf_counter(), /hold requests in flight then,
  itself included]: GET /_held lists them (perf_counter is CLOCK_MONOTONIC, the load tester's clock too).
The raw port speaks bad HTTP: path /garbage answers bytes that are not HTTP; /disconnect closes mid-body.

The script port (`script_url(path)`) is an asyncio server that speaks HTTP/1.1 as real servers do, each
path one behaviour (`?ms=N` delays the answer N ms); every connection's requests are logged, GET
/_script_log on the main port lists them as {"conn": n, "requests": [path, ...], "dropped": k,
"asked_close": k (requests saying `Connection: close`), "expect": bool, "answered": [[time.perf_counter() as
the answer's write began, the request's body], ...]}:
- /close_each: answers, then closes the connection at once without saying `Connection: close`.
- /close_next: answers and keeps the connection; a request that arrives on it later is read and the
  connection closed without an answer (the client's request crossed the server's close: never processed).
- /close_header: answers with `Connection: close` but leaves the connection open: a client that sends
  again on it is logged doing so (and answered).
- /keep: answers every request on the connection and never closes it, whatever the request says.
- /eof_body: no Content-Length, no chunking: the body (three parts, 10 ms apart) ends when it closes.
- /eof_sse: OpenAI-style server-sent events without chunking, ended by closing the connection.
- /interim: a 100 Continue and a 103 Early Hints before the 200. /switch: a 101 nobody asked for.
- /expect: sends 100 Continue when the request says `Expect: 100-continue`, then reads the body.
- /trailers: a chunked answer with a trailer field. /head: Content-Length 5, no body to a HEAD.
- /bad_status: a status line that is not HTTP's; /status_600: a status code past 599;
  /huge_head: 70 KiB of headers (70 fields); /huge_field: one field of 100 KB; /long_body: 5 bytes past its Content-Length; /short_body: 9 of its 100
  bytes, then the close; /stall_body: 9 of its 100 bytes, then silence (the connection held 60 s).
The HTTP/1.0 port (`h10_url(path)`) is Python's own http.server (HTTP/1.0, a connection per request):
/cd answers without Content-Length (close-delimited), /file with it, /sse streams events without length.

    with LoadtestServer() as srv: srv.url("/latency")
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SSE_CHUNKS_S = (0.100, 0.120, 0.140, 0.160, 0.180)
SSE_USAGE_S = 0.190
SSE_TOKENS = {"prompt_tokens": 7, "completion_tokens": 9}
JITTER_BASE_S, JITTER_S = 0.050, 0.005


class LoadtestServer:
    """Starts this module as a subprocess; `url(path)`, `raw_url(path)`, `applied()`, `sse_applied()`."""

    def __init__(self, *extra: str, tls: tuple[str, str] | None = None) -> None:
        self.args = [sys.executable, str(Path(__file__)), "--port", "0", *extra]
        if tls:
            self.args += ["--tls", *tls]
        self.scheme = "https" if tls else "http"

    def __enter__(self) -> LoadtestServer:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()  # type: ignore[union-attr]
        if not line or line[0] != "ready":
            self.proc.kill()
            raise RuntimeError("the test server did not start")
        self.port, self.raw_port, self.script_port, self.h10_port = (int(x) for x in line[1:5])
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def url(self, path: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}{path}"

    def raw_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.raw_port}{path}"

    def script_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.script_port}{path}"

    def h10_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.h10_port}{path}"

    def script_log(self) -> list[dict]:
        return self._get("/_script_log")  # type: ignore[return-value]

    def _get(self, path: str) -> object:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return json.loads(r.read())

    def applied(self) -> list[list]:
        return self._get("/_applied")  # type: ignore[return-value]

    def sse_applied(self) -> list[list[float]]:
        return self._get("/_sse_applied")  # type: ignore[return-value]

    def held(self) -> list[list[float]]:
        return self._get("/_held")  # type: ignore[return-value]


def self_signed(tmp: Path) -> tuple[str, str]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


def main() -> None:
    from aiohttp import web

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--stall-every", type=float, default=0.0)
    ap.add_argument("--stall-s", type=float, default=1.0)
    ap.add_argument("--tls", nargs=2)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    t_start = time.perf_counter()
    applied: list[list[float | str]] = []
    sse_applied: list[list[float]] = []

    def stall_end(t: float) -> float:
        """When an answer due at `t` (perf_counter) may go out: after the stall window holding t, if any."""
        if a.stall_every <= 0:
            return t
        rel = t - t_start
        k = int(rel // a.stall_every)
        s0 = k * a.stall_every + (a.stall_every - a.stall_s)   # stalls sit at the end of each period
        return t_start + s0 + a.stall_s if s0 <= rel < s0 + a.stall_s else t

    async def latency(request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        due = stall_end(t0 + JITTER_BASE_S + rng.uniform(-JITTER_S, JITTER_S))
        body = (await request.read()).decode(errors="replace")
        await asyncio.sleep(due - time.perf_counter())
        resp = web.Response(text="ok")
        w = time.perf_counter()   # before the answer's first byte is written: none can be read earlier
        await resp.prepare(request)
        await resp.write_eof()
        applied.append([t0, w, body])
        return resp

    async def sse(request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        await request.read()
        chat = "chat" in request.path
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = []
        for n, at in enumerate(SSE_CHUNKS_S):
            await asyncio.sleep(t0 + at - time.perf_counter())
            choice = {"index": 0, "delta": {"content": f"w{n}"}} if chat else {"index": 0, "text": f"w{n}"}
            sent.append(time.perf_counter())   # before the write: no byte of it can be read earlier
            await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        await asyncio.sleep(t0 + SSE_USAGE_S - time.perf_counter())
        sent.append(time.perf_counter())
        if not request.query.get("no_usage"):
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": SSE_TOKENS}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        sse_applied.append([t0, *sent])
        return resp

    async def status(request: web.Request) -> web.Response:
        return web.Response(status=int(request.match_info["n"]), text="status")

    async def sleep(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("s", "1")))
        return web.Response(text="slept")

    async def malformed(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\ndata: {not json\n\n')
        await resp.write_eof()
        return resp

    async def error_sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n'
                         b'data: {"error": {"message": "the model failed", "code": 500}}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp

    async def fast(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    holding = [0]
    held: list[list[float]] = []

    async def hold(request: web.Request) -> web.Response:
        holding[0] += 1
        held.append([time.perf_counter(), holding[0]])
        try:
            await asyncio.sleep(float(request.query.get("s", "0.05")))
        finally:
            holding[0] -= 1
        return web.Response(text="held")

    app = web.Application()
    app.router.add_route("*", "/latency", latency)
    app.router.add_post("/v1/completions", sse)
    app.router.add_post("/v1/chat/completions", sse)
    app.router.add_route("*", "/status/{n}", status)
    app.router.add_route("*", "/sleep", sleep)
    app.router.add_route("*", "/malformed_sse", malformed)
    app.router.add_route("*", "/fast", fast)
    app.router.add_route("*", "/hold", hold)
    app.router.add_get("/_held", lambda r: _json(web, held))
    app.router.add_route("*", "/error_sse", error_sse)
    app.router.add_get("/_applied", lambda r: _json(web, applied))
    app.router.add_get("/_sse_applied", lambda r: _json(web, sse_applied))
    script_log: list[dict] = []
    scripted = script_handler(script_log)
    app.router.add_get("/_script_log", lambda r: _json(web, script_log))

    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.close()
            return
        if b" /garbage " in head:
            writer.write(b"this is not HTTP at all\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.close()

    async def serve() -> None:
        import ssl

        ctx = None
        if a.tls:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(*a.tls)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", a.port, ssl_context=ctx)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        raw_srv = await asyncio.start_server(raw, "127.0.0.1", 0)
        script_srv = await asyncio.start_server(scripted, "127.0.0.1", 0, limit=1 << 20)
        print("ready", port, raw_srv.sockets[0].getsockname()[1], script_srv.sockets[0].getsockname()[1],
              start_http10(), flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


OK_2 = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
_SSE_EVENTS = [b'data: {"choices": [{"index": 0, "text": "w%d"}]}\n\n' % n for n in range(3)] + [
    b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}\n\n', b"data: [DONE]\n\n"]


def script_handler(log: list[dict]):  # type: ignore[no-untyped-def]
    """The script port's connection handler (see the module's docstring); `log` gets one entry per connection."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        entry: dict = {"conn": len(log), "requests": [], "dropped": 0, "asked_close": 0, "expect": False,
                       "answered": []}
        log.append(entry)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                line, *fields = head.decode("latin-1").split("\r\n")
                method, target = line.split(" ")[:2]
                path, _, query = target.partition("?")
                headers = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields if f)}
                if entry["requests"] and entry["requests"][-1] == "/close_next":
                    entry["dropped"] += 1   # read, never processed: the close crossed it
                    return
                entry["requests"].append(path)
                entry["asked_close"] += headers.get("connection", "").lower() == "close"
                if headers.get("expect", "").lower() == "100-continue":
                    entry["expect"] = True
                    if path == "/expect":
                        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                ms = dict(q.partition("=")[::2] for q in query.split("&") if q).get("ms")
                if ms:
                    await asyncio.sleep(float(ms) / 1000)
                entry["answered"].append([time.perf_counter(), body.decode("latin-1")])
                if not await _script_answer(path, method, writer):
                    return
        finally:
            writer.close()
    return handle


async def _script_answer(path: str, method: str, writer: asyncio.StreamWriter) -> bool:
    """Writes the answer `path` asks for; False when the connection is to close after it."""
    w = writer.write
    if path == "/close_each":
        w(OK_2)
        return False
    if path in ("/close_next", "/keep", "/expect"):
        w(OK_2)
    elif path == "/close_header":
        w(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
    elif path in ("/eof_body", "/eof_sse"):
        sse = path == "/eof_sse"
        w(b"HTTP/1.1 200 OK\r\nContent-Type: " + (b"text/event-stream" if sse else b"text/plain") + b"\r\n\r\n")
        for part in (_SSE_EVENTS if sse else [b"part one, ", b"part two, ", b"the end"]):
            await writer.drain()
            await asyncio.sleep(0.01)
            w(part)
        await writer.drain()
        return False
    elif path == "/interim":
        w(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.01)
        w(OK_2)
    elif path == "/switch":
        w(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
    elif path == "/trailers":
        w(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n"
          b"2\r\nok\r\n0\r\nX-Checksum: 1234\r\n\r\n")
    elif path == "/head":
        w(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n" + (b"" if method == "HEAD" else b"hello"))
    elif path == "/bad_status":
        w(b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n")
    elif path == "/status_600":
        w(b"HTTP/1.1 600 Odd\r\nContent-Length: 0\r\n\r\n")
    elif path == "/huge_head":
        w(b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-Filler-%d: %s\r\n" % (n, b"f" * 1000) for n in range(70))
          + b"Content-Length: 2\r\n\r\nok")
    elif path == "/huge_field":
        w(b"HTTP/1.1 200 OK\r\nX-Filler: " + b"f" * 100_000 + b"\r\nContent-Length: 2\r\n\r\nok")
    elif path == "/long_body":
        w(OK_2 + b"EXTRA")
    elif path == "/short_body":
        w(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        return False
    elif path == "/stall_body":
        w(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()
        await asyncio.sleep(60)
        return False
    else:
        w(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()
    return True


def start_http10() -> int:
    """Python's http.server on a free loopback port, in a thread (HTTP/1.0: one request per connection)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            self.send_response(200)
            if self.path.startswith("/sse"):
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for event in _SSE_EVENTS:
                    time.sleep(0.01)
                    self.wfile.write(event)
                    self.wfile.flush()
                return
            body = b"served by http.server, HTTP/1.0\n"
            if self.path.startswith("/file"):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1]


async def _json(web: object, obj: object) -> object:
    return web.json_response(obj)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
