"""`gpuscope dashboard --prometheus URL`: the agent's dashboard over a Prometheus server, for a fleet.

    gpuscope dashboard --prometheus http://prometheus:9090            # http://127.0.0.1:9472/
    gpuscope dashboard --prometheus http://prometheus:9090 --bind 0.0.0.0   # token required

It listens on 127.0.0.1 unless told otherwise; beyond loopback every request needs a token (made
once, 0600, in ~/.local/share/gpuscope/dashboard-token, or read from --token-file). It checks that
Prometheus answers before it starts listening.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import ipaddress
import os
import signal
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from ..errors import UserError

DEFAULT_PORT = 9472
TOKEN_NAME = "dashboard-token"


class DashboardError(UserError):
    """What stops the dashboard from starting: one sentence, and the exit code (2 a usage mistake,
    1 Prometheus or the port is not there)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = self.exit_code = code


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prometheus", required=True, metavar="URL",
                   help="the Prometheus server that scrapes the agents, e.g. http://prometheus:9090")
    p.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1; anything "
                   "else requires the token)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p.add_argument("--token-file", metavar="PATH",
                   help=f"the token beyond loopback (default ~/.local/share/gpuscope/{TOKEN_NAME}, made on first use)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for Prometheus (default 10)")


def check_url(url: str) -> str:
    """The URL without a trailing slash; DashboardError unless it is http(s)://HOST[:PORT][/path]."""
    try:
        p = urllib.parse.urlsplit(url)
        p.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
    except ValueError:
        p = None
    if p is None or p.scheme not in ("http", "https") or not p.hostname or any(c.isspace() for c in url):
        raise DashboardError(f"--prometheus needs an http:// or https:// URL such as http://prometheus:9090, "
                             f"not {url!r}.", 2)
    if p.query or p.fragment:
        raise DashboardError("--prometheus takes the server's base URL, without a query or fragment.", 2)
    return url.rstrip("/")


def is_loopback(bind: str) -> bool:
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:
        return False


def token_path(given: str | None) -> Path:
    if given:
        return Path(os.path.expanduser(given))
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "gpuscope" / TOKEN_NAME


def _token(path: Path) -> str:
    from ..agent import AgentError, load_or_create_token

    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        return load_or_create_token(path)
    except AgentError as e:
        raise DashboardError(str(e)) from None
    except OSError as e:
        raise DashboardError(f"The token file {path} cannot be made: {e.strerror}.") from None


async def _serve(backend: Any, args: argparse.Namespace, token: str | None, path: Path,
                 announce: Any) -> int:
    from aiohttp import web

    from .api import make_ui_app
    from .backend import BackendError

    try:
        gpus = await backend.check()
    except BackendError as e:
        await backend.close()
        raise DashboardError(e.message) from None
    loopback = is_loopback(args.bind)
    app = make_ui_app(backend, token=token, loopback_only=loopback, token_path=str(path))
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.bind, args.port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        if e.errno == errno.EADDRINUSE:
            raise DashboardError(f"Port {args.port} on {args.bind} is already in use; choose another with --port.") from None
        raise DashboardError(f"Cannot listen on {args.bind}:{args.port}: {e.strerror}.") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - not the main thread
            pass
    sockets = getattr(site._server, "sockets", None) or []
    port = sockets[0].getsockname()[1] if sockets else args.port
    host = args.bind if ":" not in args.bind else f"[{args.bind}]"
    found = (f"{gpus} GPU(s) there now" if gpus else
             "no gpu_info series there yet: is it scraping gpuscope agents?")
    announce(f"gpuscope dashboard over Prometheus at {backend.shown} ({found})\n"
             f"  dashboard: http://{host}:{port}/ui/" + ("" if loopback else "?token=TOKEN") + "\n"
             + ("" if loopback else f"  token:     {path} (needed for every request)\n")
             + "  stop with Ctrl-C")
    await stop.wait()
    await runner.cleanup()
    return 0


def run(args: argparse.Namespace, announce: Any = print) -> int:
    """The verb: 0 after a clean stop; 1 or 2 with one sentence when it cannot start."""
    from .promql_backend import PrometheusBackend

    try:
        url = check_url(args.prometheus)
        if not 0 <= args.port <= 65535:
            raise DashboardError(f"--port must be between 0 and 65535, not {args.port}.", 2)
        if not 0 < args.timeout < 86400:  # inf once reached aiohttp as a traceback (OverflowError)
            raise DashboardError(f"--timeout must be a number of seconds between 0 and 86400, not {args.timeout:g}.", 2)
        path = token_path(args.token_file)
        token = None if is_loopback(args.bind) and not args.token_file else _token(path)
        backend = PrometheusBackend(url, timeout=args.timeout)
        return asyncio.run(_serve(backend, args, token, path, announce))
    except DashboardError as e:
        print(f"gpuscope: {e}", file=sys.stderr)
        return e.code
