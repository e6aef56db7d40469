"""What a gpuscope server holds against slow or greedy clients, and the flags that set it (standard library
only; the agent takes the same values from its [agent] config keys).

    header_timeout_s   a request's line and headers must arrive within this (from the connection's
                       start, or from the first byte of the next request on a kept-alive connection)
    body_timeout_s     its body within this, from the end of its headers
    idle_timeout_s     a kept-alive connection with no request open is closed after this
    max_connections    open connections; past it the longest-idle one is closed for the newcomer, and
                       when none is idle the newcomer gets a 503 sentence (lowered to what the open-file
                       limit allows)
    streams_per_client dashboard event streams (SSE) one peer address may hold open
    stream_stall_s     a stream whose client reads nothing for this long gives its slot back
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..errors import UsageError

__all__ = ["Limits", "add_limit_args", "limits_from_args"]

MAX_TIMEOUT_S = 86400.0


@dataclass(frozen=True)
class Limits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0
    max_connections: int = 4096
    #: open files one connection costs: 2 for a proxy (the client's socket and the upstream's)
    fds_per_connection: int = 1
    streams_per_client: int = 8
    stream_stall_s: float = 30.0
    #: one log line per this many seconds for each kind of noise (malformed requests, accept errors)
    log_interval_s: float = 10.0

    def checked(self, name: Callable[[str], str] = lambda key: key) -> Limits:
        """Self, or UsageError naming the value as `name(key without _s)` calls it (a flag, a config key)."""
        for key in ("header_timeout_s", "body_timeout_s", "idle_timeout_s", "stream_stall_s"):
            v = getattr(self, key)
            if isinstance(v, bool) or not (isinstance(v, int | float) and 0 < v <= MAX_TIMEOUT_S):
                raise UsageError(f"{name(key[:-2])} must be a duration between 0 and 1 day, not {v!r}.")
        for key in ("max_connections", "streams_per_client"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1_000_000:
                raise UsageError(f"{name(key)} must be a whole number from 1 to 1000000, not {v!r}.")
        return self


def _duration(text: str) -> float:
    from ..timeparse import TimeError, parse_duration

    try:
        return parse_duration(text, "the duration")
    except TimeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _count(text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 1_000_000:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 1000000, not {text!r}")
    return int(text)


def add_limit_args(parser: argparse.ArgumentParser, *, streams: bool = False) -> None:
    """--header-timeout, --body-timeout, --max-connections (and, for a server with the dashboard,
    --streams-per-client and --stream-stall), with the defaults of `Limits`."""
    d = Limits()
    g = parser.add_argument_group("limits against slow or greedy clients")
    g.add_argument("--header-timeout", type=_duration, metavar="DURATION",
                   help=f"close a connection whose request headers take longer (default {d.header_timeout_s:g}s)")
    g.add_argument("--body-timeout", type=_duration, metavar="DURATION",
                   help=f"close a connection whose request body takes longer (default {d.body_timeout_s:g}s)")
    g.add_argument("--max-connections", type=_count, metavar="N",
                   help=f"open connections at most (default {d.max_connections}, lowered to fit the open-file "
                        "limit); past it the longest-idle is closed, or the newcomer gets 503")
    if streams:
        g.add_argument("--streams-per-client", type=_count, metavar="N",
                       help=f"live dashboard streams one client address may hold (default {d.streams_per_client})")
        g.add_argument("--stream-stall", type=_duration, metavar="DURATION",
                       help=f"close a live stream whose client reads nothing this long (default {d.stream_stall_s:g}s)")


def limits_from_args(args: argparse.Namespace, base: Limits | None = None) -> Limits:
    """The limits the flags of `add_limit_args` set, over `base` (default: Limits())."""
    out = base or Limits()
    for flag, key in (("header_timeout", "header_timeout_s"), ("body_timeout", "body_timeout_s"),
                      ("max_connections", "max_connections"), ("streams_per_client", "streams_per_client"),
                      ("stream_stall", "stream_stall_s")):
        value = getattr(args, flag, None)
        if value is not None:
            out = replace(out, **{key: value})
    return out.checked(lambda key: "--" + key.replace("_", "-"))
