"""What the HTTP kit refuses is counted, and a running agent shows the counts: the `http` section of
/api/v1/status and gpuscope_http_refusals_total{reason} on /metrics, the same numbers in both.

Two real agents (`gpuscope agent --simulate mixed`, 8 GPUs) on 127.0.0.1, driven over raw sockets: each
refusal in gpuscope.http.serve.REFUSALS is provoked a known number of times and read back. Every wait is
bounded by a deadline far above what the behaviour needs; the assertions are on the answers the test got
and the counts the agent recorded, never on how long anything took.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuscope.http.serve import REFUSALS
from gpuscope.web.api import MAX_STREAMS

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 60.0  # far above any deadline configured here (1 s); only an agent that never acts reaches it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connect(port: int, source: str = "127.0.0.1", rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:  # before connect, so that the window is small from the start
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(BOUND_S)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _read_to_eof(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    data = b""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def _head(s: socket.socket) -> tuple[int, bytes]:
    """The status and the head of an answer that stays open (a stream), with what came after it."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split()[1]), data


class Agent:
    """`gpuscope agent --simulate mixed` with `[agent]` limits from a config file; every answer it gives this
    test goes through `request`, which tallies the 503s of its connection cap."""

    def __init__(self, tmp: Path, limits: dict[str, Any]) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.data = tmp / "data"
        cfg = tmp / "agent.toml"
        cfg.write_text("[agent]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in limits.items()))
        self.port = _free_port()
        self.log_path = tmp / "agent.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuscope", "agent", "--simulate", "mixed",
                                      "--interval", "100ms", "--port", str(self.port), "--data-dir", str(self.data),
                                      "--config", str(cfg)], env=env, stdout=subprocess.DEVNULL, stderr=self._log,
                                     start_new_session=True)
        self.cap_503s = 0

    def wait_ready(self) -> None:
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text(errors="replace")
            try:
                if self.request("/api/v1/status")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the agent did not start: {self.log_path.read_text(errors='replace')}")

    def request(self, path: str, head: str = "") -> tuple[int, bytes]:
        """GET `path` on a fresh connection closed by the server after the answer; (status, body)."""
        with _connect(self.port) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n{head}Connection: close\r\n\r\n"
                      .encode())
            answer = _read_to_eof(s)
        status = int(answer.split()[1])
        body = answer.partition(b"\r\n\r\n")[2]
        if status == 503 and b"connections open" in body:
            self.cap_503s += 1
        return status, body

    def http_status(self) -> dict[str, Any]:
        status, body = self.request("/api/v1/status")
        assert status == 200, body[:300]
        return json.loads(body)["http"]

    def refusals_on_metrics(self) -> dict[str, float]:
        status, body = self.request("/metrics")
        assert status == 200, body[:300]
        out = {}
        for fam in text_string_to_metric_families(body.decode()):
            for sample in fam.samples:
                if sample.name == "gpuscope_http_refusals_total":
                    out[sample.labels["reason"]] = sample.value
                elif sample.name in ("gpuscope_http_open_connections", "gpuscope_http_max_connections"):
                    out[sample.name] = sample.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _until(check: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + BOUND_S
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen in {BOUND_S:g} s; last: {last!r}")


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[tuple[Agent, Agent]]:
    # Deadlines of 1 s and room for every stream on one; a connection cap of 4 and 2 streams a client on the other.
    a = Agent(tmp_path / "deadlines", {"header_timeout": "1s", "body_timeout": "1s", "stream_stall": "1s",
                                       "streams_per_client": MAX_STREAMS + 8})
    b = Agent(tmp_path / "caps", {"max_connections": 4, "streams_per_client": 2})
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b
    finally:
        a.stop()
        b.stop()


def _stream(agent: Agent, source: str, *, interval: str = "10s", rcvbuf: int | None = None) -> tuple[socket.socket, int]:
    s = _connect(agent.port, source=source, rcvbuf=rcvbuf)
    s.sendall(f"GET /ui/api/stream?interval={interval} HTTP/1.1\r\nHost: 127.0.0.1:{agent.port}\r\n\r\n".encode())
    return s, _head(s)[0]


def _expect(agent: Agent, want: dict[str, int]) -> dict[str, Any]:
    """/api/v1/status and /metrics both say `want` (0 for every reason not named), once the agent's latest
    snapshot is rendered again (/metrics is rendered once per sample)."""
    full = {reason: want.get(reason, 0) for reason in REFUSALS}
    status = agent.http_status()
    assert status["refused"] == full, status
    _until(lambda: {k: v for k, v in agent.refusals_on_metrics().items() if k in REFUSALS} == full,
           f"/metrics showing {full}")
    return status


def test_every_refusal_is_counted_in_status_and_on_metrics(agents: tuple[Agent, Agent]) -> None:
    a, b = agents
    _expect(a, {})  # every reason there from the start, at 0

    # -- a: deadlines, oversized and malformed requests, a stalled stream, a server full of streams ----------
    with _connect(a.port) as s:  # headers that never end
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{a.port}\r\nX-Slow: ".encode())
        assert _read_to_eof(s).startswith(b"HTTP/1.1 408 ")
    token = (a.data / "token").read_text().strip()
    with _connect(a.port) as s:  # a body that never ends, to a handler that reads it
        s.sendall((f"POST /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1:{a.port}\r\nAuthorization: Bearer {token}\r\n"
                   "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n[").encode())
        assert _read_to_eof(s).startswith(b"HTTP/1.1 408 ")
    assert a.request("/metrics?q=" + "a" * 10_000)[0] == 414
    assert a.request("/metrics", "X-Big: " + "a" * 10_000 + "\r\n")[0] == 431
    assert a.request("/metrics", "this line is no header\r\n")[0] == 400

    stalled, code = _stream(a, "127.0.0.3", interval="250ms", rcvbuf=4096)  # and never read again
    try:
        assert code == 200
        _until(lambda: a.http_status()["refused"]["stream_stalled"] == 1, "the unread stream being cut")
    finally:
        stalled.close()
    streams = []
    try:
        for _ in range(MAX_STREAMS):
            s, code = _stream(a, "127.0.0.1")
            streams.append(s)
            assert code == 200
        s, code = _stream(a, "127.0.0.1")
        streams.append(s)
        assert code == 503
    finally:
        for s in streams:
            s.close()
    st = _expect(a, {"header_timeout": 1, "body_timeout": 1, "uri_too_long": 1, "headers_too_large": 1,
                     "malformed": 1, "stream_stalled": 1, "streams_server_full": 1})
    assert st["max_connections"] > 1000 and st["open_files_limit"] >= st["max_connections"]

    # -- b: streams per client, the longest-idle connection closed for a newcomer, the cap's 503 -------------
    a1, code1 = _stream(b, "127.0.0.1")
    a2, code2 = _stream(b, "127.0.0.1")
    a3, code3 = _stream(b, "127.0.0.1")  # answered 429, and kept alive: the one idle connection of the four
    b1, b2 = None, None
    try:
        assert (code1, code2, code3) == (200, 200, 429)
        b1, code = _stream(b, "127.0.0.2")
        assert code == 200
        b2, code = _stream(b, "127.0.0.2")  # the fifth connection: the idle one makes room
        assert code == 200
        _read_to_eof(a3)  # the rest of the 429's body, then the close (a timeout here fails the test)
        assert b.request("/metrics")[0] == 503  # four streams open: none idle
        assert b.cap_503s >= 1
    finally:
        for s in (a1, a2, a3, b1, b2):
            if s is not None:
                s.close()
    # the streams' connections close as the agent reads their EOF; a status read before that is one more 503
    st = _until(lambda: b.request("/api/v1/status")[0] == 200 and b.http_status(), "a status read under the cap")
    assert st["max_connections"] == 4 and 1 <= st["open_connections"] <= 4, st
    _expect(b, {"streams_per_client": 1, "idle_evicted": 1, "connection_cap": b.cap_503s})
    on_metrics = b.refusals_on_metrics()
    assert on_metrics["gpuscope_http_max_connections"] == 4
    assert "Traceback" not in a.log_path.read_text(errors="replace") + b.log_path.read_text(errors="replace")
