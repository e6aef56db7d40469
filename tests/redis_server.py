"""A real Redis for tests: `redis-server` on a free loopback port with its data in a temporary directory.

    from redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)

    def test_shared(redis_server):
        r = redis.Redis.from_url(redis_server.url)

A test is skipped, naming the Debian package, when the binary is missing (`apt-get install redis-server`,
or set GPUSCOPE_REDIS_SERVER). `stop()` kills it mid-test (to test what happens when Redis vanishes);
`start()` brings it back on the same port.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

__all__ = ["RedisServer", "redis_server"]


def _binary() -> str:
    path = os.environ.get("GPUSCOPE_REDIS_SERVER") or shutil.which("redis-server")
    if path is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; "
                    "or set GPUSCOPE_REDIS_SERVER)")
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self) -> None:
        self.binary = _binary()
        self.port = _free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="gpuscope-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self._dir.name, "--save", "",
             "--appendonly", "no", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server
