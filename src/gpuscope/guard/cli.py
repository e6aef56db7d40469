"""`gpuscope guard`: check a guard config, or run the guard as a reverse proxy in front of a service."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from ..http.limits import Limits, add_limit_args, limits_from_args
from ..http.net import parse_listen, parse_upstream
from ..http.tls import add_tls_args, tls_from_args

HELP = "GPU-aware admission control: check a config, or run the guard as a proxy in front of a service"
DESCRIPTION = """\
Admission control for an inference service: priority classes with guaranteed shares, token buckets per
class and tenant, an adaptive concurrency limit on latency and GPU signals, a circuit breaker.

  gpuscope guard check guard.yaml
  gpuscope guard proxy --config guard.yaml --upstream http://127.0.0.1:8000 --listen 127.0.0.1:8090

The config is YAML or TOML; see docs/guard.md. Refused requests get 429 (503 with the circuit open) and
Retry-After; the guard's own metrics are at /guard/metrics on the proxy."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="guard_action", metavar="ACTION")
    c = sub.add_parser("check", help="validate a guard config (exit 2 with the reason when it is bad)")
    c.add_argument("config", metavar="CONFIG", help="the guard config, .yaml/.yml or .toml")
    p = sub.add_parser("proxy", help="serve a reverse proxy with the guard in front of --upstream")
    p.add_argument("--config", required=True, metavar="CONFIG", help="the guard config, .yaml/.yml or .toml")
    p.add_argument("--upstream", required=True, metavar="URL", help="the service, e.g. http://127.0.0.1:8000")
    p.add_argument("--listen", default="127.0.0.1:8090", metavar="HOST:PORT",
                   help="where the proxy listens: HOST:PORT, :PORT (127.0.0.1) or [::1]:PORT (default "
                        "127.0.0.1:8090; port 0 picks a free one)")
    add_limit_args(p)
    add_tls_args(p)


def _config(path: str):  # noqa: ANN202 - GuardConfig, imported late
    from ..errors import UsageError
    from ._config import GuardConfigError, load

    try:
        return load(path)
    except GuardConfigError as e:
        raise UsageError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError

    action = getattr(args, "guard_action", None)
    if action is None:
        raise UsageError("Say what to do: gpuscope guard check|proxy (see 'gpuscope guard --help').")
    cfg = _config(args.config)
    if action == "check":
        from .._redact import redact_url

        names = ", ".join(f"{c.name} (share {c.share:g})" for c in cfg.classes)
        print(f"{args.config}: OK: classes {names}; controller {cfg.controller.mode}; "
              f"breaker {'on' if cfg.breaker.enabled else 'off'}; "
              f"{'Redis ' + redact_url(cfg.redis.url, keep_path=True) if cfg.redis.url else 'local buckets'}")
        return 0
    host, port = parse_listen(args.listen, example="127.0.0.1:8090")
    upstream = parse_upstream(args.upstream)
    limits = replace(limits_from_args(args), fds_per_connection=2)  # the client's socket and the upstream's
    tls = tls_from_args(args)  # TlsError: one sentence, exit 2
    from .proxy import run as run_proxy

    return run_proxy(_serve(cfg, upstream, host, port, limits, tls))


async def _serve(cfg: Any, upstream: str, host: str, port: int, limits: Limits, tls: Any = None) -> int:
    from ..http.tls import warn_clear_text
    from ._core import Guard
    from .proxy import serve

    server = await serve(Guard.from_config(cfg), upstream, host, port, limits=limits, flag="--listen",
                         ssl=tls.context if tls is not None else None)
    if tls is not None:
        tls.watch()  # the files re-read when they change, or on SIGHUP
    else:
        warn_clear_text(host, tls, "--tls-cert and --tls-key")
    print(f"gpuscope guard: proxying {server.url} -> {upstream} (metrics at /guard/metrics)", flush=True)
    try:
        await server.wait()
        await server.close()
    finally:
        if tls is not None:
            tls.unwatch()
    return 0
