"""PromQL text that nothing typed can break out of, and a small synchronous client for a Prometheus-compatible
HTTP API (Prometheus, VictoriaMetrics, Thanos, Mimir): /api/v1/query, /api/v1/query_range, /api/v1/series
and /api/v1/label/<name>/values.

    >>> selector("gpu_info", [label_matcher("hostname", 'a"} or vector(1) #')])
    'gpu_info{hostname="a\\\\"} or vector(1) #"}'
    >>> regex_alternation(["node-a", "node.b"])
    'node-a|node\\\\.b'
    >>> duration(90.0), duration(0.25), duration(22.5)
    ('90s', '250ms', '22500ms')

    client = Client("http://prometheus:9090")
    client.query('sum(gpu_power_watts)')        # the result list of an instant query

Every failure of the client is one sentence (a `PromQLError`): the server cannot be reached, did not answer
in time, answered something that is not the Prometheus API, or refused the query (with the server's own
error text). Standard library only (urllib), so `import gpuscope` stays light.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

from ._redact import redact_url
from .errors import Unavailable, UsageError

__all__ = ["BadLabelName", "Client", "PromQLError", "Refused", "duration", "is_label_name", "label_matcher",
           "quote", "regex_alternation", "selector"]

_LABEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RE2_SPECIAL = frozenset("\\.+*?()|[]{}^$")
#: The most of a server's error text a sentence quotes.
_MAX_ERROR_CHARS = 300


class BadLabelName(UsageError, ValueError):
    """A label name that is not one (it would change the query instead of naming a label)."""


class PromQLError(Unavailable):
    """The server cannot answer: unreachable, too slow, not a Prometheus API, or it refused the query."""


class Refused(PromQLError):
    """The server answered the API's JSON with an error (a bad query, a limit, a timeout of its own)."""


# -- PromQL text -----------------------------------------------------------------------------------
def quote(value: str) -> str:
    """A PromQL string literal holding exactly `value`: nothing in it can end the string early."""
    out = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + out.replace("\t", "\\t") + '"'


def regex_alternation(values: Iterable[str]) -> str:
    """An RE2 pattern matching exactly one of `values` (Prometheus anchors it)."""
    return "|".join("".join("\\" + c if c in _RE2_SPECIAL else c for c in v) for v in sorted(set(values)))


def is_label_name(name: str) -> bool:
    return bool(_LABEL.fullmatch(name))


def label_matcher(name: str, value: str, op: str = "=") -> str:
    """`name="value"` with the value quoted; a label name that is not one raises BadLabelName."""
    if not is_label_name(name):
        raise BadLabelName(f"{name!r} is not a label name.")
    if op not in ("=", "!=", "=~", "!~"):
        raise ValueError(f"{op!r} is not a PromQL label matcher operator")
    return f"{name}{op}{quote(value)}"


def selector(metric: str, matchers: Iterable[str] = ()) -> str:
    return metric + "{" + ",".join(matchers) + "}"


def duration(seconds: float) -> str:
    """A PromQL duration, whole seconds or milliseconds (Prometheus takes no fractions); at least 1 ms."""
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


# -- the client ------------------------------------------------------------------------------------
def _one_line(text: Any) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= _MAX_ERROR_CHARS else s[: _MAX_ERROR_CHARS - 1] + "…"


class Client:
    """Queries one server; every answer is the API's `data`, every failure a PromQLError sentence.

    Queries go as form POSTs (a long selector never hits a URL length limit); `timeout` is per request.
    `requests` counts the HTTP requests sent (what a caller reports, or a test asserts on).
    """

    def __init__(self, url: str, *, timeout: float = 60.0, headers: dict[str, str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.shown = redact_url(self.url, keep_path=True)
        self.timeout = float(timeout)
        self.headers = {"Accept": "application/json", "User-Agent": "gpuscope", **(headers or {})}
        self.requests = 0

    def api(self, path: str, params: Sequence[tuple[str, str]] = (), *, post: bool = True) -> Any:
        """`data` of the server's answer to `path`."""
        where = f"The server at {self.shown}"
        body = urllib.parse.urlencode(list(params)).encode()
        if post:
            req = urllib.request.Request(self.url + path, data=body, headers={
                **self.headers, "Content-Type": "application/x-www-form-urlencoded"}, method="POST")
        else:
            req = urllib.request.Request(self.url + path + ("?" + body.decode() if body else ""), headers=self.headers)
        self.requests += 1
        status, raw, ctype = self._send(req, where, path)
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            doc = None
        if isinstance(doc, dict) and doc.get("status") == "success" and status < 400:
            return doc.get("data")
        if isinstance(doc, dict) and doc.get("status") == "error" and doc.get("error"):
            raise Refused(f"{where} refused {path} (HTTP {status}): {_one_line(doc['error'])}.")
        what = f"HTTP {status}" + (f" {ctype.split(';')[0].strip()}" if ctype else "")
        raise PromQLError(f"{where} is not a Prometheus HTTP API: {path} answered {what}, not the API's JSON "
                          "(give the base URL of Prometheus or VictoriaMetrics, e.g. http://prometheus:9090).")

    def _send(self, req: urllib.request.Request, where: str, path: str) -> tuple[int, bytes, str]:
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:  # noqa: S310 - http(s) checked by callers
                return r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            try:
                raw = e.read()
            except OSError:
                raw = b""
            return e.code, raw, e.headers.get("Content-Type", "") if e.headers else ""
        except TimeoutError:
            raise PromQLError(f"{where} did not answer {path} within {self.timeout:g} s.") from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, TimeoutError):
                raise PromQLError(f"{where} did not answer {path} within {self.timeout:g} s.") from None
            why = getattr(reason, "strerror", None) or _one_line(reason)
            raise PromQLError(f"{where} cannot be reached: {why}.") from None
        except (ConnectionError, OSError) as e:  # reset or closed mid-answer, or a malformed status line
            why = getattr(e, "strerror", None) or type(e).__name__
            raise PromQLError(f"{where} broke off its answer to {path} ({why}).") from None
        except ValueError as e:  # http.client: a status line or header that is not HTTP
            raise PromQLError(f"{where} is not a Prometheus HTTP API: its answer to {path} is not HTTP "
                              f"({_one_line(e)}).") from None

    def query(self, expr: str, time_s: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result: [{'metric': {...}, 'value': [t, 'v']}, ...] (a vector)."""
        params = [("query", expr)] + ([("time", _stamp(time_s))] if time_s is not None else [])
        return _result(self.api("/api/v1/query", params), "vector", self.shown)

    def query_range(self, expr: str, start_s: float, end_s: float, step_s: float) -> list[dict[str, Any]]:
        """A range query's result: [{'metric': {...}, 'values': [[t, 'v'], ...]}, ...] (a matrix)."""
        params = [("query", expr), ("start", _stamp(start_s)), ("end", _stamp(end_s)), ("step", _stamp(step_s))]
        return _result(self.api("/api/v1/query_range", params), "matrix", self.shown)

    def series(self, match: Sequence[str], start_s: float, end_s: float) -> list[dict[str, str]]:
        """The label sets of the series matching any of `match` between start and end."""
        params = [("match[]", m) for m in match] + [("start", _stamp(start_s)), ("end", _stamp(end_s))]
        data = self.api("/api/v1/series", params)
        return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []

    def label_values(self, name: str, start_s: float, end_s: float) -> list[str]:
        """The values of label `name` between start and end (`__name__`: the metric names)."""
        if name != "__name__" and not is_label_name(name):
            raise BadLabelName(f"{name!r} is not a label name.")
        data = self.api(f"/api/v1/label/{name}/values", [("start", _stamp(start_s)), ("end", _stamp(end_s))],
                        post=False)
        return [v for v in data if isinstance(v, str)] if isinstance(data, list) else []


def _stamp(seconds: float) -> str:
    return f"{seconds:.3f}"


def _result(data: Any, kind: str, shown: str) -> list[dict[str, Any]]:
    if not isinstance(data, dict) or data.get("resultType") not in (kind, "scalar"):
        got = data.get("resultType") if isinstance(data, dict) else type(data).__name__
        raise PromQLError(f"The server at {shown} answered a {got} where a {kind} was asked for.")
    result = data.get("result")
    return [r for r in result if isinstance(r, dict)] if isinstance(result, list) else []
