"""`gpuscope dashboard --prometheus URL`: the agent's dashboard over a Prometheus server, for a fleet.

    gpuscope dashboard --prometheus http://prometheus:9090            # http://127.0.0.1:9472/
    gpuscope dashboard --prometheus http://prometheus:9090 --bind 0.0.0.0   # token required
    gpuscope dashboard --prometheus URL --prices prices.toml      # /ui/waste: who holds GPUs they do not use

It listens on 127.0.0.1 unless told otherwise; beyond loopback every request needs a token (made
once, 0600, in ~/.local/share/gpuscope/dashboard-token, or read from --token-file), and HTTPS is advised
(--tls-cert and --tls-key; without them there, one warning line at start). It checks that Prometheus
answers before it starts listening.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

from ..errors import Unavailable, UsageError
from ..http.limits import add_limit_args, limits_from_args
from ..http.net import is_loopback_host, parse_upstream
from ..http.tls import ServerTls, add_tls_args, tls_from_args

DEFAULT_PORT = 9472
TOKEN_NAME = "dashboard-token"


class DashboardError(Unavailable):
    """What stops the dashboard from starting once its flags are good (Prometheus or the port is not
    there, the token file cannot be used): one sentence, exit 1."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prometheus", required=True, metavar="URL",
                   help="the Prometheus server that scrapes the agents, e.g. http://prometheus:9090")
    p.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1; anything "
                   "else requires the token)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 picks a "
                   "free one)")
    p.add_argument("--token-file", metavar="PATH",
                   help=f"the token beyond loopback (default ~/.local/share/gpuscope/{TOKEN_NAME}, made on first use)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for Prometheus (default 10)")
    p.add_argument("--prices", metavar="FILE",
                   help="the waste view's prices (/ui/waste): the TOML file of `gpuscope fleet report --prices` "
                        "([gpu_hour] per model, energy_per_kwh, grid_kg_co2e_per_kwh, currency); default its defaults")
    add_limit_args(p, streams=True)
    add_tls_args(p)


def check_url(url: str) -> str:
    """The URL without a trailing slash; UsageError unless it is http(s)://HOST[:PORT][/path]."""
    return parse_upstream(url, "--prometheus", "http://prometheus:9090")


def token_path(given: str | None) -> Path:
    if given:
        return Path(os.path.expanduser(given))
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "gpuscope" / TOKEN_NAME


def _token(path: Path) -> str:
    from ..http.auth import load_or_create_token

    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise DashboardError(f"The token file {path} cannot be made: {e.strerror}.") from None
    return load_or_create_token(path)  # TokenError: one sentence, exit 1


async def _serve(backend: Any, args: argparse.Namespace, token: str | None, path: Path,
                 announce: Any, tls: ServerTls | None = None) -> int:
    from ..http.serve import ListenError, start
    from .api import make_ui_app
    from .backend import BackendError

    try:
        gpus = await backend.check()
    except BackendError as e:
        await backend.close()
        raise DashboardError(e.message) from None
    loopback = is_loopback_host(args.bind)
    limits = limits_from_args(args)
    app = make_ui_app(backend, token=token, loopback_only=loopback, token_path=str(path),
                      streams_per_client=limits.streams_per_client, stream_stall_s=limits.stream_stall_s)
    try:
        served = await start(app, args.bind, args.port, limits=limits, flag="--port", tls=tls,
                             tls_how="--tls-cert and --tls-key")
    except ListenError as e:
        raise DashboardError(str(e)) from None
    found = (f"{gpus} GPU(s) there now" if gpus else
             "no gpu_info series there yet: is it scraping gpuscope agents?")
    announce(f"gpuscope dashboard over Prometheus at {backend.shown} ({found})\n"
             f"  dashboard: {served.url}/ui/" + ("" if loopback else "?token=TOKEN") + "\n"
             f"  waste:     {served.url}/ui/waste (GPU-hours held, used and idle, and their cost, per group)\n"
             + ("" if loopback else f"  token:     {path} (needed for every request)\n")
             + "  stop with Ctrl-C")
    await served.wait()
    await served.close()
    return 0


def run(args: argparse.Namespace, announce: Any = print) -> int:
    """The verb: 0 after a clean stop; a UsageError (exit 2) or DashboardError (exit 1) when it cannot start."""
    from .promql_backend import PrometheusBackend

    url = check_url(args.prometheus)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, not {args.port}.")
    if not 0 < args.timeout < 86400:  # inf once reached aiohttp as a traceback (OverflowError)
        raise UsageError(f"--timeout must be a number of seconds between 0 and 86400, not {args.timeout:g}.")
    limits_from_args(args)  # bad limits are refused before anything is made
    tls = tls_from_args(args)  # TlsError: one sentence, exit 2
    prices = None
    if getattr(args, "prices", None):
        from ..fleet import load_prices

        prices = load_prices(args.prices)  # PricesError: one sentence naming the file, exit 2
    path = token_path(args.token_file)
    token = None if is_loopback_host(args.bind) and not args.token_file else _token(path)
    backend = PrometheusBackend(url, timeout=args.timeout, prices=prices)
    return asyncio.run(_serve(backend, args, token, path, announce, tls))
