"""The example inference service on a real GPU (`pytest -m gpu`): it answers on cuda with the h200 preset,
and under 16 concurrent streams the GPU's SM activity is clearly above idle."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

import aiohttp
import pytest
from servers import ExampleService  # tests/ is on sys.path (conftest.py's folder)
from test_example_service import metrics, post

from gpuscope import Sampler

pytestmark = pytest.mark.gpu


class Window:
    """SM activity of GPU 0 (GPM's true SM activity, else NVML utilization) while the `with` block runs."""

    def __init__(self, sampler: Sampler) -> None:
        self.values: list[float] = []
        self.on = False
        self.lock = threading.Lock()
        sampler.subscribe(self._take)

    def _take(self, snap) -> None:
        if self.on and snap.gpus:
            g = snap.gpus[0]
            v = g.sm_active_ratio if g.sm_active_ratio is not None else g.utilization_ratio
            if v is not None:
                with self.lock:
                    self.values.append(v)

    def __enter__(self) -> Window:
        self.values, self.on = [], True
        return self

    def __exit__(self, *exc: object) -> None:
        self.on = False

    def median(self) -> float:
        with self.lock:
            assert len(self.values) >= 5, f"only {len(self.values)} readings"
            return statistics.median(self.values)


def test_service_on_cuda_is_busy_under_16_streams(sampler):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    s = ExampleService("--preset", "h200", "--device", "cuda", "--ignore-eos")
    try:
        status, body, _ = asyncio.run(post(s.url + "/v1/completions", {"prompt": "warm up", "max_tokens": 8}))
        assert status == 200 and body["usage"]["completion_tokens"] == 8
        t0 = time.monotonic()
        status, body, _ = asyncio.run(post(s.url + "/v1/completions", {"prompt": "one stream", "max_tokens": 512}))
        print(f"one stream: {512 / (time.monotonic() - t0):.0f} tokens/s")
        window = Window(sampler)
        with window:
            time.sleep(3)
        idle = window.median()

        async def load() -> tuple[int, float]:
            async def one(session: aiohttp.ClientSession, i: int) -> int:
                async with session.post(s.url + "/v1/completions",
                                        json={"prompt": f"stream {i} " * 50, "max_tokens": 1500, "stream": True,
                                              "stream_options": {"include_usage": True}}) as r:
                    usage = 0
                    async for line in r.content:
                        if line.startswith(b"data: {") and b'"usage"' in line:
                            usage = json.loads(line[6:])["usage"]["completion_tokens"]
                    return usage
            t0 = time.monotonic()
            async with aiohttp.ClientSession() as session:
                tokens = await asyncio.gather(*[one(session, i) for i in range(16)])
            return sum(tokens), time.monotonic() - t0

        before = asyncio.run(metrics(s.url))
        with window:
            tokens, seconds = asyncio.run(load())
        busy = window.median()
        after = asyncio.run(metrics(s.url))
        steps = after["example_decode_steps_total"] - before["example_decode_steps_total"]
        step_s = (after["example_decode_seconds_total"] - before["example_decode_seconds_total"]) / max(steps, 1)
        print(f"SM activity idle {idle:.3f}, under 16 streams {busy:.3f}; {tokens} tokens in {seconds:.1f} s "
              f"= {tokens / seconds:.0f} tokens/s; {steps:.0f} decode steps of {step_s * 1e3:.2f} ms, peak batch "
              f"{after['example_batch_size_peak']:.0f}")
        assert tokens == 16 * 1500
        assert busy > max(0.2, 3 * idle), (idle, busy)
    finally:
        s.stop()


def test_graphed_decode_answers_exactly_at_every_batch_size():
    """The small model on cuda: CUDA graphs padded to batch buckets still give each request its own tokens."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    s = ExampleService("--device", "cuda", "--max-batch", "8", "--ignore-eos")
    try:
        url = s.url + "/v1/completions"

        async def go() -> tuple[list[int], str, str]:
            probe = {"prompt": "greedy probe", "max_tokens": 300, "temperature": 0}
            first = (await post(url, probe))[1]["choices"][0]["text"]
            results = await asyncio.gather(*[post(url, {"prompt": f"r {i}", "max_tokens": 20 + 37 * i})
                                             for i in range(7)])
            again = (await post(url, probe))[1]["choices"][0]["text"]
            return [r[1]["usage"]["completion_tokens"] for r in results], first, again

        counts, first, again = asyncio.run(go())
        assert counts == [20 + 37 * i for i in range(7)]
        assert first == again and len(first.split()) == 300
    finally:
        s.stop()
