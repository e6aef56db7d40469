"""Streaming: SSE chunks parsed per second on one core, and the generator's added latency at 1,000 req/s.

    python benchmarks/bench_loadtest_sse.py [--seconds 10] [--rate 1000]

1. Parsing: vLLM-shaped completion chunks (JSON with id, choices, usage: null) fed through the reader that
   every streamed response goes through, 128 chunks per response; the peer is the bare `orjson.loads` of
   the same payloads (the floor for any reader that looks at the JSON).
2. Added latency: a raw asyncio SSE server in another process stamps, on the same CLOCK_MONOTONIC, when each
   request's last byte arrived and when its answer (3 chunks, usage, [DONE]) was written. The generator's
   added latency per request = (client last byte - client send) - (server write - server receive): the
   loopback both ways plus everything the client does. Goal: p99 <= 1 ms at 1,000 req/s (Poisson, 1 worker).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson

CHUNK = (b'data: {"id":"cmpl-8f1","object":"text_completion","created":1764460000,"model":"m","choices":'
         b'[{"index":0,"text":" the","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}\n\n')


def parse_rate(n_responses: int = 4000, per: int = 128) -> tuple[float, float]:
    from gpuscope.loadtest.openai import SseReader
    from gpuscope.loadtest.records import RequestRecord

    t = time.perf_counter()
    for _ in range(n_responses):
        r = SseReader(RequestRecord(i=0, stage=0, worker=0, t_intended=0.0, t_sent=0.0))
        for k in range(per):
            r(CHUNK, k * 1e-3)
    ours = n_responses * per / (time.perf_counter() - t)
    payload = CHUNK[6:-2]
    t = time.perf_counter()
    for _ in range(n_responses * per):
        orjson.loads(payload)
    floor = n_responses * per / (time.perf_counter() - t)
    return ours, floor


def serve() -> None:
    """The stamping SSE server (run with --serve): prints its port, then one JSON line of stamps at EOF of stdin."""
    stamps: dict[str, tuple[float, float]] = {}

    class P(asyncio.Protocol):
        def connection_made(self, tr: asyncio.BaseTransport) -> None:
            self.tr, self.buf = tr, b""

        def data_received(self, data: bytes) -> None:
            now = time.perf_counter()
            self.buf += data
            head, sep, rest = self.buf.partition(b"\r\n\r\n")
            if not sep:
                return
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(rest) < n:
                return
            body, self.buf = rest[:n], rest[n:]
            prompt = orjson.loads(body)["prompt"]
            events = b"".join(CHUNK for _ in range(3)) + \
                b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":3}}\n\ndata: [DONE]\n\n'
            self.tr.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                          % (len(events), events))
            stamps[prompt] = (now, time.perf_counter())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(P, "127.0.0.1", 0)
        print(srv.sockets[0].getsockname()[1], flush=True)
        await loop.run_in_executor(None, sys.stdin.read)
        print(orjson.dumps(stamps).decode(), flush=True)

    asyncio.run(main())


def added_latency(seconds: float, rate: float, tmp: Path) -> tuple[np.ndarray, dict]:
    from gpuscope.loadtest import schedule as S
    from gpuscope.loadtest.requests import Protocol
    from gpuscope.loadtest.runner import execute, summarize
    from gpuscope.loadtest.worker import WorkerConfig

    proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    port = int(proc.stdout.readline())  # type: ignore[union-attr]
    plan = S.plan([S.Stage(seconds, rate=rate)], seed=1)
    n = len(plan.times[0])
    cfg = WorkerConfig(url=f"http://127.0.0.1:{port}/v1/completions", plan=plan, keep_records=True,
                       proto=Protocol(kind="openai-completions", prompts=[f"p{i}" for i in range(n)]))
    res = execute(cfg, 1)
    summary = summarize(cfg, res, url="u", protocol="openai-completions", stage_names=["s"])
    out, _ = proc.communicate("", timeout=30)
    stamps = orjson.loads(out)
    t0 = res.clock["mono_s"]
    added = []
    for r in res.records:
        if r.t_end is None:
            continue
        recv, done = stamps[f"p{r.i % n}"]
        assert t0 + r.t_sent <= recv   # one clock for both processes
        added.append((r.t_end - r.t_sent) - (done - recv))
    return np.asarray(added), summary


def main() -> None:
    if "--serve" in sys.argv:
        serve()
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=1000.0)
    a = ap.parse_args()
    ours, floor = parse_rate()
    print(f"SSE parsing, one core: {ours:,.0f} chunks/s through the reader; bare orjson.loads of the same "
          f"payloads {floor:,.0f}/s (reader = {ours / floor:.2f}x of that floor)")
    added, summary = added_latency(a.seconds, a.rate, Path("."))
    o, c = summary["overall"], summary["client"]
    print(f"added latency at {a.rate:g} req/s Poisson, 1 worker, {len(added)} streamed requests "
          f"({sum(o['errors'].values())} errors): p50 {np.percentile(added, 50) * 1e3:.3f} ms, "
          f"p99 {np.percentile(added, 99) * 1e3:.3f} ms (goal <= 1 ms), max {added.max() * 1e3:.3f} ms; "
          f"client CPU {c['cpu_percent']:.0f} %, send lag p99 {c['send_lag_ms']['p99']:.2f} ms")


if __name__ == "__main__":
    main()
