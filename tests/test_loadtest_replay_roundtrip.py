"""Capture -> replay round trip: real requests through `gpuscope capture --anonymise` in front of the example
service, then that file replayed with `gpuscope loadtest --replay` through a second capture proxy, which
records what arrives. The same requests must arrive (count, methods, paths), asking for and getting the
captured output lengths, at the captured offsets."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from servers import ExampleService

from gpuscope.loadtest.requests import ReplayError, load_replay

GPUSCOPE = [sys.executable, "-m", "gpuscope"]
# Offsets far enough apart that a replay slot is unmistakable on a busy machine: the offset check allows
# half the gap, it is not a latency measurement.
GAP_S = 0.6
# (method, path, body): whole and streamed completions and chat, none with ignore_eos (so an anonymised
# prompt would end elsewhere unless the replay pins the length), one stream without usage, one GET.
SENT: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/completions", {"prompt": "the quick brown fox jumps", "max_tokens": 12, "stream": True,
                                 "stream_options": {"include_usage": True}}),
    ("POST", "/v1/chat/completions", {"model": "m", "max_tokens": 9,
                                      "messages": [{"role": "user", "content": "My card is 4111 1111!"}]}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "over the lazy dog", "max_tokens": 7}),
    ("POST", "/v1/chat/completions", {"max_completion_tokens": 5, "stream": True,
                                      "messages": [{"role": "user", "content": "no usage asked for"}]}),
]


class Capture:
    """`python -m gpuscope capture` on a free port, stopping by itself after `count` requests."""

    def __init__(self, upstream: str, out: Path, count: int, *args: str) -> None:
        self.out = out
        self.proc = subprocess.Popen([*GPUSCOPE, "capture", "--upstream", upstream, "--listen", "127.0.0.1:0",
                                      "--out", str(out), "--count", str(count), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("listening on http://"):
            self.proc.kill()
            raise RuntimeError(f"capture did not start: {line!r} {self.proc.communicate()[1]}")
        self.url = line.split()[-1]

    def lines(self) -> list[dict[str, Any]]:
        _, err = self.proc.communicate(timeout=60)  # --count reached: it exits on its own
        assert self.proc.returncode == 0, err
        return [json.loads(x) for x in self.out.read_text().splitlines()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def _send_all(base: str) -> None:
    async def one(i: int, method: str, path: str, body: dict[str, Any] | None) -> None:
        await asyncio.sleep(i * GAP_S)
        async with aiohttp.ClientSession() as s:
            async with s.request(method, base + path, json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()

    await asyncio.gather(*(one(i, *req) for i, req in enumerate(SENT)))


def test_a_capture_replays_the_same_requests_lengths_and_offsets(tmp_path: Path) -> None:
    first, second = tmp_path / "capture.jsonl", tmp_path / "replayed.jsonl"
    with ExampleService("--seed", "3", "--max-batch", "8") as svc:
        cap = Capture(svc.url, first, len(SENT), "--anonymise")
        try:
            asyncio.run(asyncio.wait_for(_send_all(cap.url), 120))
            captured = cap.lines()
        finally:
            cap.kill()
        # Exactly the captured requests arrive: before a replay the load tester only opens a connection.
        cap2 = Capture(svc.url, second, len(SENT))
        try:
            p = subprocess.run([*GPUSCOPE, "loadtest", cap2.url, "--replay", str(first), "--workers", "1",
                                "--no-gpu", "--no-html", "--json", "--out", str(tmp_path / "run")],
                               capture_output=True, text=True, timeout=180)
            # 1 is a run the load tester calls invalid (it sent late: a busy test machine), still measured
            assert p.returncode in (0, 1) and "Traceback" not in p.stderr, p.stderr
            arrived = cap2.lines()
        finally:
            cap2.kill()

    # The capture: one line each, anonymised, with output and prompt token counts from the usage seen.
    assert [(x["method"], x["path"]) for x in captured] == [(m, path) for m, path, _ in SENT]
    assert "4111" not in first.read_text()
    assert captured[1]["body"]["messages"][0]["content"] == "xx xxxx xx xxxx xxxxx"
    assert captured[0]["prompt_tokens"] == 5 and captured[3]["prompt_tokens"] == 4  # usage.prompt_tokens
    assert captured[4]["prompt_tokens"] == 4 and captured[4]["output_tokens"] is None  # no usage: the words
    outs = [x["output_tokens"] for x in captured]
    assert all(isinstance(n, int) and n >= 1 for n in (outs[0], outs[1], outs[3]))

    # The replay: the same requests arrived, asking for and getting the captured lengths, at the offsets.
    assert [(x["method"], x["path"]) for x in arrived] == [(x["method"], x["path"]) for x in captured]
    assert [x["output_tokens"] for x in arrived] == outs
    assert [x["status"] for x in arrived] == [200] * len(SENT)
    for got, want in zip(arrived, captured, strict=True):
        assert got["t"] - arrived[0]["t"] == pytest.approx(want["t"], abs=GAP_S / 2), (got, want)
        if want["output_tokens"]:
            length_key = "max_completion_tokens" if "max_completion_tokens" in want["body"] else "max_tokens"
            assert got["body"][length_key] == want["output_tokens"] and got["body"]["ignore_eos"] is True
    assert arrived[1]["body"]["messages"] == captured[1]["body"]["messages"]  # the anonymised text as captured
    assert arrived[4]["body"] == captured[4]["body"]  # no output length known: sent as captured

    summary = json.loads(p.stdout)
    assert summary["overall"]["requests"] == len(SENT) and summary["overall"]["errors"] == {}
    records = [json.loads(x) for x in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    streamed = sorted((r for r in records if r.get("chunk_times") is not None), key=lambda r: r["t_intended"])
    assert [r["output_tokens"] for r in streamed] == [outs[0], len(streamed[1]["chunk_times"])]
    assert streamed[0]["tokens_from"] == "usage" and streamed[1]["input_tokens"] == 4  # from prompt_tokens


@pytest.mark.parametrize("line, problem", [
    ('{"t": 0, "path": "v1/completions"}', '"path" must start with /'),
    ('{"t": 0, "headers": ["Accept"]}', '"headers" must be an object'),
    ('{"t": 0, "output_tokens": "many"}', '"output_tokens" must be a whole number'),
    ('{"t": 0, "method": 7}', '"method" must be an HTTP method'),
])
def test_a_replay_line_with_a_field_of_the_wrong_type_is_one_sentence(tmp_path, line, problem):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"t": 0, "method": "GET", "path": "/", "status": 200, "duration_s": 0.1, "prompt_chars": 0}\n'
                 + line + "\n")
    with pytest.raises(ReplayError, match=f"Line 2 of the replay file .*{problem}"):
        load_replay(f)
    p = subprocess.run([*GPUSCOPE, "loadtest", "http://127.0.0.1:9", "--replay", str(f), "--no-gpu"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr and problem in p.stderr
