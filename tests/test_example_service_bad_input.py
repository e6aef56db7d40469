"""Requests and flags a user can get wrong end in a 4xx (service) or one sentence and exit 2 (flags), never a
500 or a traceback."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import ExampleService

SERVER = Path(__file__).resolve().parents[1] / "examples" / "inference_service" / "server.py"


@pytest.fixture(scope="module")
def service() -> Iterator[ExampleService]:
    with ExampleService("--layers", "1", "--width", "32", "--heads", "2", "--vocab", "100", "--context", "64") as s:
        yield s


def _post(url: str, raw: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deeply_nested_json_is_a_400(service: ExampleService, path: str) -> None:
    status, body = _post(service.url + path, b"[" * 200_000 + b"]" * 200_000)
    assert status == 400, body
    assert b"not valid JSON" in body
    status, body = _post(service.url + path, b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    assert status == 400, body


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_port_out_of_range_is_one_sentence_and_exit_2(port: str) -> None:
    p = subprocess.run([sys.executable, str(SERVER), "--device", "cpu", "--port", port, "--layers", "1",
                        "--width", "32", "--heads", "2", "--vocab", "100", "--context", "64"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "--port" in p.stderr, p.stderr
