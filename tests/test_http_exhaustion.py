"""Servers that hold under exhaustion: the agent, the dashboard, the capture proxy and the guard proxy, each
a real `gpuscope` process on 127.0.0.1, driven over real sockets, bounded in count and time.

1. slow headers and slow bodies are cut off at the configured deadline (the connection reads EOF);
2. an idle-connection flood under a low open-file limit leaves the server answering, and nothing in its
   log is a traceback; accept() failures are one rate-limited line;
3. a request line or header over 8,190 bytes is a JSON 4xx with one sentence;
4. a 401 does not say where the token file is;
5. dashboard streams: a cap per client address (429), and a client that stops reading gives its slot back.

Every wait is bounded by a deadline far above what the behaviour needs; assertions are on what the
server did (EOF, the status it answered, its log), never on how long it took. Figures go to the test
report as properties (pytest --junitxml) for docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import re
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPUSCOPE = [sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())"]
KINDS = ["agent", "dashboard", "capture", "guard"]
BOUND_S = 30.0  # far above any deadline configured here (1 s); only a server that never acts reaches it


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Upstream:
    """What the proxies forward to, and the dashboard's Prometheus: any GET or POST answers 200 with an
    empty Prometheus result (the proxies pass it on; the dashboard finds no GPUs)."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer  # noqa: N815 - http.server's names

            def log_message(self, *args: Any) -> None:
                pass

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client (the proxy) that left: nothing for the test to see

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[_Upstream]:
    up = _Upstream()
    yield up
    up.stop()


class Server:
    """One of the four servers as `gpuscope` runs it, with the limits given (agent: [agent] config keys;
    the others: flags), its port read from what it prints and its log (stderr) in a file."""

    def __init__(self, kind: str, tmp: Path, upstream: _Upstream, *, limits: dict[str, Any] | None = None,
                 bind: str = "127.0.0.1", nofile: tuple[int, int] | None = None, extra: tuple[str, ...] = ()) -> None:
        self.kind, self.tmp = kind, tmp
        tmp.mkdir(parents=True, exist_ok=True)
        limits = limits or {}
        self.data = tmp / "data"
        if kind == "agent":
            cfg = tmp / "agent.toml"
            keys = "".join(f"{k} = {json.dumps(v)}\n" for k, v in limits.items())
            cfg.write_text(f'[agent]\nbind = "{bind}"\n{keys}')
            argv = ["agent", "--simulate", "healthy", "--port", str(_free_port()), "--data-dir", str(self.data),
                    "--config", str(cfg)]
        else:
            flags = [x for k, v in limits.items() for x in (f"--{k.replace('_', '-')}", str(v))]
            if kind == "dashboard":
                argv = ["dashboard", "--prometheus", upstream.url, "--port", "0", "--bind", bind,
                        "--token-file", str(tmp / "dashboard-token"), *flags]
            elif kind == "capture":
                argv = ["capture", "--upstream", upstream.url, "--listen", f"{bind}:0", "--out",
                        str(tmp / "capture.jsonl"), *flags]
            else:
                cfg = tmp / "guard.toml"
                cfg.write_text('[classify]\ncost = "tokens"\n\n[[classes]]\nname = "all"\nrate = 100000\n'
                               'burst = 100000\n')  # cost = tokens: the guard reads the body before deciding
                argv = ["guard", "proxy", "--config", str(cfg), "--upstream", upstream.url, "--listen", f"{bind}:0",
                        *flags]
        self.log_path = tmp / "server.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()

        def limit_files() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

        self.proc = subprocess.Popen([*GPUSCOPE, *argv, *extra], env=_env(), stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, preexec_fn=limit_files)
        self.port = self._read_port()

    def _read_port(self) -> int:
        deadline = time.monotonic() + 60
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.search(r"(?:listening on|proxying|dashboard:)\s+http://[^\s/]+:(\d+)", line)
            if m:
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # drain the rest
                return int(m.group(1))
        self.stop()
        raise AssertionError(f"{self.kind} did not start: {self.log_path.read_text()}")

    @property
    def probe(self) -> str:
        """A path each server answers by itself (no upstream needed)."""
        return {"agent": "/metrics", "dashboard": "/ui/", "capture": "/metrics", "guard": "/guard/metrics"}[self.kind]

    @property
    def token(self) -> str:
        return (self.data / "token").read_text().strip()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def start(tmp_path: Path, upstream: _Upstream) -> Iterator[Any]:
    made: list[Server] = []

    def make(kind: str, **kw: Any) -> Server:
        s = Server(kind, tmp_path / f"{kind}{len(made)}", upstream, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def _connect(port: int, source: str = "127.0.0.1", rcvbuf: int | None = None, timeout: float = 10.0) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:  # before connect, so that the window is small from the start
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _request(port: int, raw: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send `raw`, read the whole answer (the connection closes or the Content-Length is in)."""
    with _connect(port, timeout=timeout) as s:
        s.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        want = int(headers.get("content-length", -1))
        while want < 0 or len(body) < want:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return int(lines[0].split()[1]), headers, body


def _get(port: int, path: str, headers: str = "") -> tuple[int, dict[str, str], bytes]:
    return _request(port, f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}Connection: close\r\n\r\n".encode())


def _sentence(kind: str, body: bytes) -> str:
    """The one sentence of a JSON error body: {"error": "..."} from the agent and the dashboard, the OpenAI
    form {"error": {"message": "..."}} from the proxies."""
    err = json.loads(body)["error"]
    return err if kind in ("agent", "dashboard") else err["message"]


def _one_sentence(text: str) -> None:
    assert text and text[0].isupper() and text.endswith(".") and "\n" not in text and "Traceback" not in text, text


# -- 1. deadlines for headers and bodies --------------------------------------------------------------------
def _trickle_until_closed(socks: list[socket.socket], byte: bytes, every_s: float = 0.2) -> dict[socket.socket, bytes]:
    """Send one byte to every open socket each `every_s` until the server closes it (EOF or a reset) or
    BOUND_S passes; what each one read, for those closed (the others are missing from the answer)."""
    got = {s: b"" for s in socks}
    closed: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + BOUND_S
    for s in socks:
        s.setblocking(False)
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for s in socks:
            if s in closed:
                continue
            try:
                s.send(byte)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:  # reset or broken pipe: closed by the server
                closed[s] = got[s]
        readable, _, _ = select.select([s for s in socks if s not in closed], [], [], every_s)
        for s in readable:
            try:
                chunk = s.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                closed[s] = got[s]
                continue
            if chunk:
                got[s] += chunk
            else:
                closed[s] = got[s]
    return closed


@pytest.mark.parametrize("kind", KINDS)
def test_slow_headers_are_cut_off_at_the_header_deadline(kind, start, record_property):
    srv = start(kind, limits={"header_timeout": "1s"})
    socks = [_connect(srv.port) for _ in range(20)]
    try:
        for s in socks:
            s.sendall(f"GET {srv.probe} HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nX-Slow: ".encode())
        closed = _trickle_until_closed(socks, b"a")
        record_property("slow_header_connections_closed", f"{len(closed)}/{len(socks)}")
        assert len(closed) == len(socks), f"{len(socks) - len(closed)} slow-header connections still open"
        for answer in closed.values():  # a request had begun: the server said why it closed
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            _one_sentence(_sentence(kind, answer.partition(b"\r\n\r\n")[2]))
        assert _get(srv.port, srv.probe)[0] == 200  # and it still serves
    finally:
        for s in socks:
            s.close()
    assert "Traceback" not in srv.log()


def _slow_body_request(srv: Server) -> bytes:
    if srv.kind == "agent":  # a handler that reads the body: posting events takes the token
        return (f"POST /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nAuthorization: Bearer {srv.token}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n[").encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{").encode()


@pytest.mark.parametrize("kind", ["agent", "capture", "guard"])  # the dashboard has no route that reads a body
def test_slow_bodies_are_cut_off_at_the_body_deadline(kind, start, record_property):
    srv = start(kind, limits={"header_timeout": "1s", "body_timeout": "1s"})
    socks = [_connect(srv.port) for _ in range(10)]
    try:
        for s in socks:
            s.sendall(_slow_body_request(srv))
        closed = _trickle_until_closed(socks, b" ")
        record_property("slow_body_connections_closed", f"{len(closed)}/{len(socks)}")
        assert len(closed) == len(socks), f"{len(socks) - len(closed)} slow-body connections still open"
        for answer in closed.values():
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            assert "body did not arrive" in _sentence(kind, answer.partition(b"\r\n\r\n")[2])
        assert _get(srv.port, srv.probe)[0] == 200
    finally:
        for s in socks:
            s.close()
    assert "Traceback" not in srv.log()


# -- 2. a connection cap below the open-file limit --------------------------------------------------------
def _open_idle(port: int, n: int) -> tuple[list[socket.socket], int]:
    """Up to n idle connections (each connect bounded to 2 s); the sockets and how many connects failed."""
    socks, failed = [], 0
    for _ in range(n):
        try:
            socks.append(_connect(port, timeout=2.0))
        except OSError:
            failed += 1
    return socks, failed


@pytest.mark.parametrize("kind", KINDS)
def test_an_idle_flood_under_a_low_open_file_limit_leaves_the_server_answering(kind, start, record_property):
    # soft = hard = 256: nothing to raise it to; 400 idle connections would need more files than the server has
    srv = start(kind, limits={"header_timeout": "60s"}, nofile=(256, 256))
    socks, failed = _open_idle(srv.port, 400)
    try:
        try:
            status = _get(srv.port, srv.probe)[0]
        except OSError as e:
            status = f"no answer ({type(e).__name__})"
        record_property("probe_under_400_idle_connections", status)
        assert status == 200
    finally:
        for s in socks:
            s.close()
    log = srv.log()
    record_property("log_bytes", len(log))
    record_property("tracebacks_in_log", log.count("Traceback"))
    assert "Traceback" not in log and len(log) < 20_000, log[-3000:]


def test_over_the_cap_with_no_idle_connection_the_newcomer_gets_a_503_sentence(start):
    srv = start("agent", limits={"max_connections": 20, "body_timeout": "60s"})
    busy = []
    try:
        for _ in range(20):  # every slot holds a request whose body is still coming: none is idle
            s = _connect(srv.port)
            s.sendall(_slow_body_request(srv))
            busy.append(s)
        time.sleep(0.5)  # not a timing assertion: lets the server parse the headers before the newcomer
        status, headers, body = _get(srv.port, srv.probe)
        assert status == 503 and headers["content-type"] == "application/json", body
        _one_sentence(json.loads(body)["error"])
        assert "20 connections open" in json.loads(body)["error"]
    finally:
        for s in busy:
            s.close()


@pytest.mark.parametrize("kind", ["agent", "guard"])
def test_the_soft_open_file_limit_is_raised_to_the_hard_limit(kind, start):
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 4096)
    srv = start(kind, nofile=(256, hard))
    limits = Path(f"/proc/{srv.proc.pid}/limits").read_text()
    soft_now = int(re.search(r"Max open files\s+(\d+)", limits).group(1))
    assert soft_now == hard
    if kind == "agent":  # its log is at INFO: it says what the limit became
        assert f"open-file limit raised from 256 to {hard}" in srv.log()


ACCEPT_FAILURES = r'''
import asyncio, os, resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from aiohttp import web
from gpuscope.http.limits import Limits
from gpuscope.http.serve import start

async def main():
    served = await start(web.Application(), "127.0.0.1", 0, limits=Limits(log_interval_s=60))
    print(served.port, flush=True)
    hogs = []
    while True:  # every file this process may open is taken: the next accept() fails with EMFILE
        try:
            hogs.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            break
    sys.stdin.readline()  # the test has connected; asyncio retries accept() once a second
    await asyncio.sleep(float(sys.argv[1]))
    for fd in hogs:
        os.close(fd)
    await served.close()

asyncio.run(main())
'''


def test_accept_failures_are_one_rate_limited_line_not_a_traceback_each():
    seconds = 4.0
    proc = subprocess.Popen([sys.executable, "-c", ACCEPT_FAILURES, str(seconds)], env=_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    socks = []
    try:
        port = int(proc.stdout.readline())
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(5)]
        proc.stdin.write("\n")
        proc.stdin.flush()
        _, err = proc.communicate(timeout=60)
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
    # asyncio retried accept() about once a second for `seconds` and failed each time
    assert err.count("socket.accept() out of system resource") == 1, err
    assert "Too many open files" in err and "Traceback" not in err, err


# -- 3. a request line or header over 8,190 bytes -----------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_an_oversized_request_line_or_header_is_a_json_4xx_sentence(kind, start, record_property):
    srv = start(kind)
    long_header = _get(srv.port, srv.probe, "X-Big: " + "a" * 10_000 + "\r\n")
    long_url = _get(srv.port, srv.probe + "?q=" + "a" * 10_000)
    record_property("long_header", f"{long_header[0]} {long_header[1].get('content-type')}")
    record_property("long_url", f"{long_url[0]} {long_url[1].get('content-type')}")
    for (status, headers, body), want in ((long_header, 431), (long_url, 414)):
        assert status == want and headers["content-type"] == "application/json", (status, headers, body[:200])
        sentence = _sentence(kind, body)
        _one_sentence(sentence)
        assert "8190 bytes" in sentence
    assert "Traceback" not in srv.log()


# -- 4. the 401 says how to send the token, not where its file is -------------------------------------------
@pytest.mark.parametrize("kind", ["agent", "dashboard"])
def test_a_401_does_not_name_the_token_file(kind, start):
    srv = start(kind, bind="0.0.0.0")  # beyond loopback every request needs the token (traffic stays on 127.0.0.1)
    for path in ("/api/v1/status", "/ui/"):
        status, _, body = _get(srv.port, path)
        assert status == 401
        sentence = json.loads(body)["error"]
        _one_sentence(sentence)
        assert str(srv.tmp) not in sentence and "/token" not in sentence and "dashboard-token" not in sentence
        assert ("agent's data directory" if kind == "agent" else "--token-file") in sentence
    if kind == "agent":  # the path goes to the server's own log
        assert str(srv.data / "token") in srv.log()


# -- 5. dashboard streams: a cap per client, and a stalled client gives its slot back ------------------------
def _open_stream(port: int, source: str, rcvbuf: int | None = None) -> tuple[socket.socket, int, bytes]:
    s = _connect(port, source=source, rcvbuf=rcvbuf)
    s.sendall(f"GET /ui/api/stream?interval=250ms HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            break
        head += chunk
    return s, int(head.split()[1]), head


@pytest.mark.parametrize("kind", ["agent", "dashboard"])
def test_one_client_cannot_hold_every_stream(kind, start, record_property):
    srv = start(kind, limits={"streams_per_client": 2})
    socks = []
    try:
        statuses = []
        for _ in range(3):
            s, status, head = _open_stream(srv.port, "127.0.0.1")
            socks.append(s)
            statuses.append(status)
        record_property("three_streams_from_one_client", statuses)
        assert statuses == [200, 200, 429], statuses
        body = head.partition(b"\r\n\r\n")[2]
        while len(body) < int(re.search(rb"Content-Length: (\d+)", head, re.I).group(1)):
            body += socks[-1].recv(4096)
        sentence = json.loads(body)["error"]
        _one_sentence(sentence)
        assert "Too many live dashboards (2) are open from 127.0.0.1" in sentence
        s, status, _ = _open_stream(srv.port, "127.0.0.2")  # another client still gets one
        socks.append(s)
        assert status == 200
    finally:
        for s in socks:
            s.close()


def test_a_stream_whose_client_stops_reading_gives_its_slot_back(start, record_property):
    srv = start("agent", limits={"streams_per_client": 1, "stream_stall": "1s"}, extra=("--simulate", "mixed"))
    stalled, status, _ = _open_stream(srv.port, "127.0.0.1", rcvbuf=4096)  # and never read again
    try:
        assert status == 200
        deadline = time.monotonic() + 90  # buffers to fill at ~40 kB/s, then the 1 s stall: far less than this
        refused = 0
        while time.monotonic() < deadline:
            s, status, _ = _open_stream(srv.port, "127.0.0.1")
            s.close()
            if status == 200:
                break
            assert status == 429
            refused += 1
            time.sleep(0.5)
        record_property("slot_back_after_s", round(time.monotonic() - (deadline - 90), 1) if status == 200 else None)
        assert status == 200, "the stalled stream still holds its client's only slot"
        assert refused >= 1  # it was held while the client still had buffer room
        stalled.setblocking(True)
        stalled.settimeout(10)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            while stalled.recv(1 << 20):  # what was buffered, then the reset of the aborted connection
                pass
            raise ConnectionResetError  # EOF: closed as well
    finally:
        stalled.close()
    assert "read nothing for 1 s; closed it" in srv.log()


# -- the limits themselves: a bad value is one sentence before anything starts ------------------------------
@pytest.mark.parametrize("argv, words", [
    (["capture", "--upstream", "http://127.0.0.1:9", "--header-timeout", "soon"], "--header-timeout"),
    (["guard", "proxy", "--config", "{cfg}", "--upstream", "http://127.0.0.1:9", "--max-connections", "0"],
     "--max-connections"),
    (["dashboard", "--prometheus", "http://127.0.0.1:9", "--streams-per-client", "-1"], "--streams-per-client"),
    (["dashboard", "--prometheus", "http://127.0.0.1:9", "--body-timeout", "2d"], "--body-timeout"),
    (["agent", "--simulate", "healthy", "--config", "{agent_cfg}"], "[agent] header_timeout"),
])
def test_a_bad_limit_is_one_sentence_and_exit_2(argv, words, tmp_path):
    (tmp_path / "g.toml").write_text('[[classes]]\nname = "all"\nrate = 1\nburst = 1\n')
    (tmp_path / "a.toml").write_text('[agent]\nheader_timeout = "0s"\n')
    argv = [a.format(cfg=tmp_path / "g.toml", agent_cfg=tmp_path / "a.toml") for a in argv]
    p = subprocess.run([*GPUSCOPE, *argv], env=_env(), capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert p.returncode == 2 and words in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr and p.stdout == ""
