"""What the guard's ASGI middleware adds per streamed chunk, against the same app without it, same run.

An app streams N body chunks (an SSE answer token by token) to a send that returns at once (the server's
write is not what is measured); cases are interleaved in rounds, the best round of each is kept.

    python benchmarks/bench_guard_asgi_stream.py [--chunks 200000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from gpuscope.guard import Guard, parse_config
from gpuscope.guard.asgi import GuardMiddleware


def make_app(n: int):
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    chunk = {"type": "http.response.body", "body": b"data: {\"token\": 1}\n\n", "more_body": True}
    end = {"type": "http.response.body", "body": b"", "more_body": False}

    async def app(scope, receive, send) -> None:
        await send(start)
        for _ in range(n):
            await send(chunk)
        await send(end)

    return app


async def _send(message) -> None:
    return None


async def _receive():
    return {"type": "http.request", "body": b"", "more_body": False}


async def one(app, n: int) -> float:
    scope = {"type": "http", "method": "GET", "path": "/v1/completions", "headers": [], "query_string": b""}
    t0 = time.perf_counter()
    await app(scope, _receive, _send)
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    plain = make_app(a.chunks)
    guard = Guard(parse_config({"classes": [{"name": "a"}], "controller": {"mode": "fixed", "max_limit": 1000,
                                                                           "initial_limit": 1000}}))
    guarded = GuardMiddleware(make_app(a.chunks), guard=guard, metrics_path=None)
    best = {"plain": float("inf"), "guarded": float("inf")}

    async def run() -> None:
        for _ in range(a.rounds):
            best["plain"] = min(best["plain"], await one(plain, a.chunks))
            best["guarded"] = min(best["guarded"], await one(guarded, a.chunks))

    asyncio.run(run())
    added = best["guarded"] - best["plain"]
    print(f"per chunk: app alone {best['plain'] * 1e6:.3f} us, behind the guard's middleware "
          f"{best['guarded'] * 1e6:.3f} us: added {added * 1e6:.3f} us per chunk "
          f"(ratio {best['guarded'] / best['plain']:.2f})")


if __name__ == "__main__":
    main()
