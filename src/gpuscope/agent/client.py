"""`gpuscope query` and `gpuscope export`: the agent's data on the command line."""

from __future__ import annotations

import csv
import http.client
import io
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from typing import Any

from ..errors import EXIT_USAGE, Unavailable
from ..http.auth import find_token
from .config import DEFAULT_PORT

__all__ = ["BadArgument", "ClientError", "default_url", "find_token", "format_range", "get_json"]


class ClientError(Unavailable, RuntimeError):
    """One sentence for the user."""


class BadArgument(ClientError):
    """The URL or the token itself is unusable (no scheme, bad port, a line break): the user's typing, not a
    missing agent."""

    exit_code = EXIT_USAGE


def default_url() -> str:
    """$GPUSCOPE_URL (an empty one counts as unset), else the local agent; a bad $GPUSCOPE_URL is named as such,
    not as a --url the user never typed."""
    url = os.environ.get("GPUSCOPE_URL") or f"http://127.0.0.1:{DEFAULT_PORT}"
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port
    except ValueError as e:
        raise BadArgument(f"GPUSCOPE_URL {url!r} is not a usable URL: {e}.") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadArgument(f"GPUSCOPE_URL must be an http:// or https:// URL of an agent, not {url!r}.")
    return url


def get_json(url: str, path: str, params: dict[str, str], token: str | None, timeout: float = 30.0,
             require: dict[str, type | tuple[type, ...]] | None = None) -> Any:
    """The agent's JSON object at `path`; `require` names top-level keys and their types that the caller
    reads, so that a server that is not a gpuscope agent ends in one sentence rather than a KeyError."""
    if not url.startswith(("http://", "https://")):
        raise BadArgument(f"--url must start with http:// or https://, not {url!r}.")
    try:
        _ = urllib.parse.urlsplit(url).port  # a bad host or port raises here, not as a traceback from urlopen
    except ValueError as e:
        raise BadArgument(f"--url {url!r} is not a usable URL: {e}.") from None
    if token is not None and not _header_safe(token):  # urllib's ValueError would read as "not JSON"
        raise BadArgument("The token holds a line break or another character that cannot go in an HTTP header; "
                          "check --token, $GPUSCOPE_TOKEN or the token file.")
    full = url.rstrip("/") + path + ("?" + urllib.parse.urlencode(params) if params else "")
    req = urllib.request.Request(full, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read()).get("error", e.reason)
        except (ValueError, AttributeError, RecursionError):
            msg = e.reason
        # 400: the request, built from the user's flags, is bad (--agg, --step, a metric): exit 2 like a bad flag
        raise (BadArgument if e.code == 400 else ClientError)(f"The agent at {url} answered {e.code}: {msg}") from None
    except urllib.error.URLError as e:
        raise ClientError(f"No gpuscope agent answers at {url} ({e.reason}); start one with 'gpuscope agent'.") from None
    except http.client.HTTPException:  # BadStatusLine and kin: something listens there that speaks no HTTP
        raise ClientError(f"{url} did not answer in HTTP; is it a gpuscope agent?") from None
    except (TimeoutError, OSError) as e:
        raise ClientError(f"The agent at {url} did not answer: {e}.") from None
    except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
        raise ClientError(f"{url} answered with something that is not JSON; is it a gpuscope agent?") from None
    if not isinstance(data, dict):
        raise ClientError(f"{url} answered {path} with JSON that is not an object; is it a gpuscope agent?")
    for key, kind in (require or {}).items():
        if not isinstance(data.get(key), kind):
            raise ClientError(f"{url} answered {path} without a usable {key!r}; is it a gpuscope agent?")
    return data


def _header_safe(text: str) -> bool:
    try:
        text.encode("latin-1")  # what http.client encodes header values as
    except UnicodeEncodeError:
        return False
    return text.isprintable()


def _ts(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def format_range(data: dict[str, Any], fmt: str) -> str:
    series = data["series"]
    if fmt == "json":
        return json.dumps(data, indent=1)
    rows: list[list[str]] = []
    for s in series:
        lab = ",".join(f"{k}={v}" for k, v in sorted(s["labels"].items()))
        for t, v in zip(s["timestamps_ns"], s["values"], strict=False):
            rows.append([_ts(t), lab, "" if v is None else f"{v:.6g}"])
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["time", "labels", data["metric"]])
        w.writerows(rows)
        return buf.getvalue()
    if not rows:
        return f"no data for {data['metric']} in that range"
    width = max(len(r[1]) for r in rows)
    head = f"{'time':<24} {'labels':<{width}} {data['metric']}"
    return "\n".join([head] + [f"{r[0]:<24} {r[1]:<{width}} {r[2]}" for r in rows])
