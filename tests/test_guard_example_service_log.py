"""The example inference service answers a malformed request with 400 and logs one short line for a burst of
them, never aiohttp's traceback per request (any client could flood the log)."""

from __future__ import annotations

import socket

from servers import ExampleService


def _raw(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port)), timeout=30) as s:
        s.sendall(data)
        return s.recv(64)


def test_malformed_requests_are_a_400_and_one_log_line():
    svc = ExampleService("--layers", "1", "--width", "32", "--heads", "2", "--vocab", "100", "--context", "64")
    try:
        answers = [_raw(svc.url, b"GET @host/ HTTP/1.1\r\nHost: x\r\n\r\n")[:12] for _ in range(3)]
    finally:
        svc.stop()
    log = svc.proc.stderr.read() if svc.proc.stderr else ""
    assert answers == [b"HTTP/1.0 400"] * 3
    assert "Traceback" not in log and log.count("malformed HTTP request answered 400: InvalidURLError") == 1, log
