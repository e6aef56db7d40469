"""The example inference service (examples/inference_service), started for real on the CPU on a free port:
OpenAI-compatible completions and chat, streamed and whole, exact output lengths, usage, /metrics that
move with load, 400s for bad requests and 429 past the queue limit."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from servers import ExampleService  # tests/ is on sys.path (conftest.py's folder)

SERVER = Path(__file__).resolve().parents[1] / "examples" / "inference_service" / "server.py"


@pytest.fixture(scope="module")
def service() -> Iterator[ExampleService]:
    s = ExampleService("--max-batch", "8", "--max-queue", "64", "--seed", "1")
    yield s
    s.stop()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


async def post(url: str, body: Any, raw: bytes | None = None) -> tuple[int, Any, dict[str, str]]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=raw if raw is not None else json.dumps(body)) as r:
            return r.status, await r.json(content_type=None), dict(r.headers)


async def stream(url: str, body: dict[str, Any]) -> list[Any]:
    """The SSE events' data, parsed ('[DONE]' kept as the string)."""
    events: list[Any] = []
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json={**body, "stream": True}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                if line.startswith(b"data: "):
                    data = line[6:].strip().decode()
                    events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_completion_whole_has_exactly_max_tokens(service):
    status, body, _ = run(post(service.url + "/v1/completions",
                               {"prompt": "the quick brown fox", "max_tokens": 7, "ignore_eos": True}))
    assert status == 200
    assert body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
    assert len(body["choices"][0]["text"].split()) == 7
    assert body["choices"][0]["finish_reason"] == "length"


def test_completion_stream_chunks_usage_and_done(service):
    events = run(stream(service.url + "/v1/completions", {"prompt": "hello", "max_tokens": 5, "ignore_eos": True,
                                                          "stream_options": {"include_usage": True}}))
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    chunks = events[:-2]
    assert len(chunks) == 5 and all(len(c["choices"][0]["text"].split()) == 1 for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]


def test_stream_without_include_usage_has_no_usage_chunk(service):
    events = run(stream(service.url + "/v1/completions", {"prompt": "hello", "max_tokens": 3, "ignore_eos": True}))
    assert events[-1] == "[DONE]" and len(events) == 4
    assert all("usage" not in e for e in events[:-1])


def test_chat_stream_and_whole(service):
    url = service.url + "/v1/chat/completions"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    events = run(stream(url, {"messages": messages, "max_tokens": 6, "ignore_eos": True,
                              "stream_options": {"include_usage": True}}))
    chunks = events[:-2]
    assert len(chunks) == 6 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(len(c["choices"][0]["delta"]["content"].split()) == 1 for c in chunks)
    assert events[-2]["usage"]["completion_tokens"] == 6 and events[-1] == "[DONE]"
    status, body, _ = run(post(url, {"messages": messages, "max_completion_tokens": 4, "ignore_eos": True}))
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert len(body["choices"][0]["message"]["content"].split()) == 4 == body["usage"]["completion_tokens"]


def test_models_and_health(service):
    async def go() -> tuple[Any, int]:
        async with aiohttp.ClientSession() as s:
            async with s.get(service.url + "/v1/models") as r:
                models = await r.json()
            async with s.get(service.url + "/health") as r:
                return models, r.status
    models, health = run(go())
    assert models["data"][0]["id"] == "gpuscope-example" and models["data"][0]["max_model_len"] == 1024
    assert health == 200


def test_greedy_output_is_the_same_alone_and_in_a_batch(service):
    """Checks the KV cache and the slot moves: batching must not change what a sequence generates."""
    url = service.url + "/v1/completions"
    probe = {"prompt": "a fixed prompt for greedy decoding", "max_tokens": 40, "temperature": 0, "ignore_eos": True}

    async def go() -> tuple[str, str]:
        alone = (await post(url, probe))[1]["choices"][0]["text"]
        # Neighbours of different lengths finish at different steps, so the probe's slot moves.
        others = [post(url, {"prompt": f"other {i} " * (i + 1), "max_tokens": 5 + 7 * i, "ignore_eos": True})
                  for i in range(5)]
        results = await asyncio.gather(*others[:3], post(url, probe), *others[3:])
        return alone, results[3][1]["choices"][0]["text"]

    alone, batched = run(go())
    assert alone == batched


def test_metrics_move_with_load(service):
    n, tokens = 6, 150

    async def go() -> tuple[dict[str, float], list[dict[str, float]], dict[str, float]]:
        before = await metrics(service.url)
        load = asyncio.gather(*[stream(service.url + "/v1/completions",
                                       {"prompt": f"load {i}", "max_tokens": tokens, "ignore_eos": True})
                                for i in range(n)])
        task = asyncio.ensure_future(load)
        seen = []
        while not task.done():
            seen.append(await metrics(service.url))
            await asyncio.sleep(0.02)
        await task
        return before, seen, await metrics(service.url)

    before, seen, after = run(go())
    assert max(m["vllm:num_requests_running"] for m in seen) > 1
    assert max(m["example_batch_size"] for m in seen) > 1
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == n * tokens
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == n
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", b'{"max_tokens": 5}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 5000}', "max_tokens"),
    ("/v1/completions", b'{"prompt": [99999999], "max_tokens": 5}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -1}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "n": 3}', "n"),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', "stream"),
    ("/v1/chat/completions", b'{"prompt": "x"}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', "messages"),
])
def test_bad_requests_get_400_with_an_openai_error(service, path, raw, param):
    status, body, _ = run(post(service.url + path, None, raw=raw))
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    assert body["error"]["message"].endswith(".")


def test_unknown_path_and_method_are_json_errors(service):
    async def go() -> list[tuple[int, Any]]:
        async with aiohttp.ClientSession() as s:
            out = []
            for method, path in (("GET", "/v1/nothing"), ("GET", "/v1/completions")):
                async with s.request(method, service.url + path) as r:
                    out.append((r.status, await r.json(content_type=None)))
            return out
    (s1, b1), (s2, b2) = run(go())
    assert (s1, s2) == (404, 405) and "error" in b1 and "error" in b2


async def _wait_for(url: str, name: str, value: float) -> None:
    while (await metrics(url))[name] != value:
        await asyncio.sleep(0.02)


def test_past_the_queue_limit_429_and_disconnects_free_the_slot():
    s = ExampleService("--max-batch", "1", "--max-queue", "1", "--vocab", "64")
    try:
        async def go() -> tuple[int, Any, dict[str, str], dict[str, float]]:
            url = s.url + "/v1/completions"
            long = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            async with aiohttp.ClientSession() as session:
                running = await session.post(url, json=long)    # takes the one batch slot
                await _wait_for(s.url, "vllm:num_requests_running", 1)
                waiting = asyncio.ensure_future(session.post(url, json=long))   # fills the queue
                await _wait_for(s.url, "vllm:num_requests_waiting", 1)
                status, body, headers = await post(url, {"prompt": "x", "max_tokens": 5})
                running.close()  # the client goes away: the server must drop the sequence
                await _wait_for(s.url, "vllm:num_requests_running", 1)  # the waiting one moves in
                (await waiting).close()
                await _wait_for(s.url, "vllm:num_requests_running", 0)
            return status, body, headers, await metrics(s.url)

        status, body, headers, after = run(go())
        assert status == 429 and headers["Retry-After"] == "1"
        assert body["error"]["type"] == "overloaded_error" and "retry" in body["error"]["message"]
        assert after["example_requests_rejected_total"] == 1
        assert after["vllm:generation_tokens_total"] < 2000  # both long streams were cut short
    finally:
        s.stop()


def test_stops_at_end_of_sequence_unless_told_to_ignore_it():
    s = ExampleService("--vocab", "3", "--seed", "3")  # EOS is one id in three: it comes within a few tokens
    try:
        url = s.url + "/v1/completions"
        events = run(stream(url, {"prompt": "x", "max_tokens": 200, "stream_options": {"include_usage": True}}))
        last = events[-3]["choices"][0]
        assert last["finish_reason"] == "stop"
        assert events[-2]["usage"]["completion_tokens"] == sum(len(e["choices"][0]["text"].split())
                                                               for e in events[:-2]) < 200
        status, body, _ = run(post(url, {"prompt": "x", "max_tokens": 200, "ignore_eos": True}))
        assert body["usage"]["completion_tokens"] == 200
    finally:
        s.stop()


def test_bad_flags_exit_2():
    p = subprocess.run([sys.executable, str(SERVER), "--width", "10", "--heads", "3"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "divisible" in p.stderr and "Traceback" not in p.stderr


def test_port_in_use_is_one_sentence(service):
    port = service.url.rsplit(":", 1)[1]
    p = subprocess.run([sys.executable, str(SERVER), "--port", port], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "cannot listen" in p.stderr and "Traceback" not in p.stderr


def test_a_client_leaving_a_whole_answer_frees_its_slot(service):
    async def go() -> tuple[dict[str, float], dict[str, float]]:
        before = await metrics(service.url)
        task = asyncio.ensure_future(post(service.url + "/v1/completions",
                                          {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}))
        await _wait_for(service.url, "vllm:num_requests_running", 1)
        task.cancel()  # closes the connection
        await _wait_for(service.url, "vllm:num_requests_running", 0)
        return before, await metrics(service.url)

    before, after = run(go())
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 1000
    assert after["vllm:request_success_total"] == before["vllm:request_success_total"]
