"""Input a user can get wrong — URLs, -H, -X, stage files, huge plans — ends in one sentence and exit 2, and
nothing a user types can change the shape of the HTTP request the load tester writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from loadtest_servers import LoadtestServer

from gpuscope.loadtest.client import Target, UrlError, encode_request
from gpuscope.loadtest.openai import SseReader
from gpuscope.loadtest.records import RequestRecord


@pytest.fixture(scope="module")
def srv():
    with LoadtestServer() as s:
        yield s


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())",
                           "loadtest", *args], capture_output=True, text=True, cwd=cwd, timeout=60)


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:8000/a b", "http://127.0.0.1:8000/a\x00b",
                                 "http://127.0.0.1:8000/\x7f"])
def test_unusable_urls_are_refused(url: str) -> None:
    with pytest.raises(UrlError):
        Target.parse(url)


def test_non_ascii_url_path_is_percent_encoded() -> None:
    t = Target.parse("http://127.0.0.1:8000/caf\u00e9/\u20ac?q=\u00fc&r=a%20b")
    assert t.path == "/caf%C3%A9/%E2%82%AC?q=%C3%BC&r=a%20b"
    assert encode_request(t, "GET", t.path, {}, b"").startswith(b"GET /caf%C3%A9/%E2%82%AC?q=%C3%BC&r=a%20b HTTP/1.1\r\n")


@pytest.mark.parametrize("args, says", [
    (["http://[::1"], "is not a usable URL"),
    (["{base}/a b"], "is not a usable URL"),
    (["{url}", "-H", "X-A: \u20ac"], "-H"),
    (["{url}", "-H", "X\u20ac: a"], "-H"),
    (["{url}", "-H", "X-A: a\r\nEvil: b"], "-H"),
    (["{url}", "-H", "Bad Name: a"], "-H"),
    (["{url}", "-X", "GET /etc HTTP/1.1"], "-X"),
    (["{url}", "-X", "G\u00c9T"], "-X"),
    (["{url}", "--stage-file", "{binary}"], "is not UTF-8 text"),
    (["{url}", "--stage-file", "{huge_rate}", "--workers", "1"], "more than 1 worker(s) can send"),
    (["{url}", "--stage-file", "{inf_ramp}"], "target rate must be above 0"),
    (["{url}", "--stage-file", "{deep}"], "nested too deep"),
    (["{url}", "--rate", "10000", "--duration", "100000h", "--workers", "1"], "requests"),
    (["{url}", "--openai", "chat", "--prompt-tokens", "100000000", "--requests", "1"], "at most"),
    (["{url}", "--request-file", "{binary}"], "is not UTF-8 text"),
    (["{url}", "--body-file", "{binary}"], "is not UTF-8 text"),
    (["{url}", "--request-file", "{rf_path}"], "\"path\" must start with /"),
    (["{url}", "--request-file", "{rf_method}"], "\"method\" must be an HTTP method"),
    (["{url}", "--request-file", "{rf_headers}"], "\"headers\" must map"),
    (["{url}", "--request-file", "{rf_header_crlf}"], "\"headers\" must map"),
])
def test_bad_input_is_one_sentence_and_exit_2(srv, tmp_path: Path, args: list[str], says: str) -> None:
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "huge.yaml").write_text("- duration: 1s\n  rate: 1e9\n")
    (tmp_path / "inf.yaml").write_text("- duration: 2s\n  rate: 1\n  ramp_to: .inf\n")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    rf = {"rf_path": '{"path": "/ x HTTP/1.1\\r\\nEvil: y"}', "rf_method": '{"path": "/", "method": "GET / HTTP/1.1"}',
          "rf_headers": '{"path": "/", "headers": ["X: y"]}',
          "rf_header_crlf": '{"path": "/", "headers": {"X": "a\\r\\nEvil: y"}}'}
    for name, line in rf.items():
        (tmp_path / f"{name}.jsonl").write_text(line + "\n")
    subs = {"url": srv.url("/fast"), "base": srv.url("").rstrip("/"), "binary": str(tmp_path / "bin.yaml"),
            "huge_rate": str(tmp_path / "huge.yaml"), "inf_ramp": str(tmp_path / "inf.yaml"),
            "deep": str(tmp_path / "deep.json"),
            **{name: str(tmp_path / f"{name}.jsonl") for name in rf}}
    p = _cli(*[a.format(**subs) for a in args], "--no-gpu", "--quiet", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert says in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_sse_event_without_end_is_bounded() -> None:
    """A stream that never ends an event (no blank line) fails as malformed instead of growing without end."""
    rec = RequestRecord(i=0, stage=0, worker=0, t_intended=0.0, t_sent=0.0)
    reader = SseReader(rec)
    chunk = b"data: " + b"x" * 65536
    err = None
    for _ in range(1024):          # 64 MiB offered
        err = reader(chunk, 0.1)
        if err:
            break
    assert err == "malformed"
    assert len(reader.buf) <= SseReader.MAX_EVENT_BYTES


def test_sse_large_but_bounded_event_is_read() -> None:
    rec = RequestRecord(i=0, stage=0, worker=0, t_intended=0.0, t_sent=0.0)
    reader = SseReader(rec)
    text = "y" * 100_000
    event = b'data: {"choices":[{"text":"' + text.encode() + b'"}]}\n\n'
    for k in range(0, len(event), 4096):
        assert reader(event[k:k + 4096], 0.2) is None
    assert reader.chunks == [0.2]


def test_url_password_is_never_written(srv, tmp_path: Path) -> None:
    """A password in the URL (user:password@host) reaches neither the output files nor the terminal."""
    url = srv.url("/fast").replace("://", "://user:S3CRETPW@")
    out = tmp_path / "o"
    p = _cli(url, "--requests", "3", "--workers", "1", "--no-gpu", "--json", "--out", str(out), cwd=tmp_path)
    assert p.returncode in (0, 1), p.stderr
    assert "S3CRETPW" not in p.stdout + p.stderr
    written = [f for f in out.iterdir() if f.is_file()]
    assert any(f.name == "summary.json" for f in written)
    for f in written:
        assert b"S3CRETPW" not in f.read_bytes(), f.name
    assert "user:***@" in (out / "summary.json").read_text()
    closed = "http://user:S3CRETPW@127.0.0.1:9/"
    p = _cli(closed, "--requests", "1", "--no-gpu", "--out", str(tmp_path / "o2"), cwd=tmp_path)
    assert p.returncode == 2 and "S3CRETPW" not in p.stderr, p.stderr


def test_a_replay_file_that_is_not_utf8_is_one_sentence(srv, tmp_path: Path) -> None:
    (tmp_path / "cap.jsonl").write_bytes(b'{"t": 0, "path": "/\xff"}\n')
    p = _cli(srv.url("/latency"), "--replay", "cap.jsonl", "--no-gpu", "--quiet", cwd=tmp_path)
    assert p.returncode == 2 and "is not UTF-8 text" in p.stderr and "Traceback" not in p.stderr, p.stderr
