"""The guard proxy's own work per request, without sockets: the real client and upstream protocols fed real
bytes, their writes recorded by a transport that keeps nothing (what is left of a request's CPU in
bench_guard_proxy.py is the kernel's and the event loop's).

    python benchmarks/bench_guard_proxy_path.py [--requests 200000] [--headers 8]

One request is: the client's request bytes to Client.data_received (llhttp, the head sorted, the decision,
the upstream head built and written), the upstream's answer bytes to Up.data_received (llhttp, the client
head built, body written, the decision released, the connection back to the pool). Prints microseconds of
CPU per request (process time), median of 5 runs, for the default guard config (adaptive limit) and a fixed
limit, with `--headers` typical client headers on each request.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from gpuscope.guard import Guard, parse_config
from gpuscope.guard._exchange import Client
from gpuscope.guard._upstream import Up
from gpuscope.guard.proxy import ProxyServer
from gpuscope.http.limits import Limits


class NullTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = 0

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written += len(data)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default

    def close(self) -> None:
        raise AssertionError("the benchmark's connections stay open")


HEADERS = [b"User-Agent: bench/1.0", b"Accept: application/json", b"Content-Type: application/json",
           b"Authorization: Bearer abcdefghijklmnopqrstuvwxyz", b"X-Request-Id: 4f1c2a", b"Accept-Encoding: gzip",
           b"X-Priority: interactive", b"X-Tenant: team-a", b"Cookie: a=b", b"Referer: http://x/"]
BODY = b'{"model": "m", "prompt": "hello", "max_tokens": 16}'
ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: Mon, 01 Jan 2026 00:00:00 GMT\r\n"
          b"Server: upstream\r\nContent-Length: 27\r\n\r\n" + b'{"ok": true, "answer": 42}\n')


async def one_run(cfg: dict, n: int, headers: int) -> float:
    loop = asyncio.get_running_loop()
    server = ProxyServer(Guard(parse_config(cfg)), "http://127.0.0.1:9", Limits(fds_per_connection=2), loop)
    server.stats.max_connections = 10
    client = Client(server)
    client.connection_made(NullTransport())
    up = Up(server.main_pool)
    up.connection_made(NullTransport())
    server.main_pool.put(up)
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8090\r\n" + b"".join(h + b"\r\n" for h in HEADERS[:headers])
           + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY)
    t0 = time.process_time()
    for _ in range(n):
        client.data_received(req)
        up.data_received(ANSWER)
    spent = time.process_time() - t0
    assert not client.queue and sum(server.guard.admitted_total) == n, "a request did not complete"
    if client.timer is not None:
        client.timer.cancel()
    return spent / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--headers", type=int, default=8, choices=range(len(HEADERS) + 1), metavar="0-10")
    a = ap.parse_args()
    base = {"classes": [{"name": "interactive", "share": 0.8, "rate": 1e9, "burst": 1e9},
                        {"name": "batch", "share": 0.2, "rate": 1e9, "burst": 1e9}]}
    try:
        import uvloop
        new_loop = uvloop.new_event_loop
    except ImportError:
        new_loop = asyncio.new_event_loop
    for name, cfg in (("adaptive limit (default)", base),
                      ("fixed limit", {**base, "controller": {"mode": "fixed", "max_limit": 256}})):
        runs = []
        for _ in range(5):
            loop = new_loop()
            try:
                runs.append(loop.run_until_complete(one_run(cfg, a.requests // 5, a.headers)))
            finally:
                loop.close()
        print(f"{name:26} {statistics.median(runs) * 1e6:6.2f} us of CPU per request (median of 5, "
              f"{a.headers} client headers)")


if __name__ == "__main__":
    main()
