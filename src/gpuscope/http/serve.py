"""Start a gpuscope HTTP server: one way to listen, one sentence when it cannot, one way to stop.

    served = await start(app, "127.0.0.1", 9471, flag="--port")   # ListenError: one sentence, exit 1
    print(f"listening on {served.url}")
    await served.wait()     # until SIGTERM or SIGINT (or served.stop_soon())
    await served.close()    # graceful: the app's on_shutdown, open requests finish, then cleanup

Malformed requests are logged as one line per interval with a count (gpuscope._serverlog).
"""

from __future__ import annotations

import asyncio
import errno
import signal
import socket
from dataclasses import dataclass, field

from aiohttp import web

from .._serverlog import server_logger
from ..errors import Unavailable
from .net import format_host

__all__ = ["ListenError", "Served", "start"]


class ListenError(Unavailable):
    """The server cannot listen where it was told: one sentence (exit 1)."""


@dataclass
class Served:
    """A started server: where it listens, and how to stop it."""

    runner: web.AppRunner
    host: str
    port: int
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://{format_host(self.host)}:{self.port}"

    def stop_soon(self) -> None:
        self.stopping.set()

    async def wait(self, signals: bool = True) -> None:
        """Until SIGTERM or SIGINT (when `signals` and on the main thread) or stop_soon()."""
        loop = asyncio.get_running_loop()
        installed = []
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    loop.add_signal_handler(sig, self.stopping.set)
                    installed.append(sig)
                except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                    pass
        try:
            await self.stopping.wait()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    async def close(self) -> None:
        await self.runner.cleanup()


async def start(app: web.Application, host: str, port: int, *, flag: str = "--port",
                handler_cancellation: bool = False, shutdown_timeout_s: float = 60.0) -> Served:
    """Serve `app` on host:port (port 0: a free one, see .port); ListenError with one sentence naming
    `flag` when it cannot listen."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False, logger=server_logger(),
                           handler_cancellation=handler_cancellation, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ListenError(_listen_sentence(host, port, flag, e)) from None
    bound = next((a[1] for a in runner.addresses if isinstance(a, tuple)), port)
    return Served(runner, host, bound)


def _listen_sentence(host: str, port: int, flag: str, e: OSError) -> str:
    where = f"{format_host(host)}:{port}"
    if e.errno == errno.EADDRINUSE:
        return f"Port {port} on {host} is already in use; choose another with {flag}."
    if e.errno == errno.EACCES:
        return f"Cannot listen on {where}: permission denied (ports below 1024 need privileges); choose another with {flag}."
    if e.errno == errno.EADDRNOTAVAIL:
        return f"Cannot listen on {where}: no interface of this machine has the address {host}."
    if isinstance(e, socket.gaierror):
        return f"Cannot listen on {where}: the name {host!r} does not resolve."
    return f"Cannot listen on {where}: {(e.strerror or str(e)).rstrip('.')}."
