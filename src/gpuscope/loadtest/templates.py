"""Body templates with variables, and request files of many requests.

Variables: `{seq}` (the request's number), `{rand_int:LO:HI}` (inclusive), `{rand_float:LO:HI}`,
`{choice:a|b|c}`, `{uuid}`. Other braces are left alone, so JSON bodies need no escaping.

    >>> import random
    >>> Template('{"id": {seq}, "n": {rand_int:5:5}}').render(7, random.Random(0))
    '{"id": 7, "n": 5}'

A request file is JSON lines of {"method", "path", "headers", "body", "tag"} (all optional but one of
path/body); the requests are sent in turn, round-robin.
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Callable
from pathlib import Path

import orjson

from ..errors import UsageError
from .jsonl import json_lines

_VAR = re.compile(r"\{(seq|uuid|rand_int:-?\d+:-?\d+|rand_float:-?[\d.]+:-?[\d.]+|choice:[^{}]*)\}")


class TemplateError(UsageError, ValueError):
    """A request template that cannot be filled: one sentence."""


class Template:
    """A string with variables, compiled once, rendered per request."""

    def __init__(self, text: str) -> None:
        self.parts: list[str | Callable[[int, random.Random], str]] = []
        pos = 0
        for m in _VAR.finditer(text):
            self.parts.append(text[pos:m.start()])
            self.parts.append(_var(m.group(1)))
            pos = m.end()
        self.parts.append(text[pos:])
        self.static = len(self.parts) == 1

    def render(self, seq: int, rng: random.Random) -> str:
        if self.static:
            return self.parts[0]  # type: ignore[return-value]
        return "".join(p if isinstance(p, str) else p(seq, rng) for p in self.parts)


def _var(spec: str) -> Callable[[int, random.Random], str]:
    name, _, arg = spec.partition(":")
    if name == "seq":
        return lambda seq, rng: str(seq)
    if name == "uuid":
        return lambda seq, rng: str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if name == "rand_int":
        lo, hi = (int(x) for x in arg.split(":"))
        if lo > hi:
            raise TemplateError(f"{{{spec}}}: the low bound is above the high one.")
        return lambda seq, rng: str(rng.randint(lo, hi))
    if name == "rand_float":
        a, b = (float(x) for x in arg.split(":"))
        return lambda seq, rng: repr(rng.uniform(a, b))
    options = arg.split("|")
    return lambda seq, rng: rng.choice(options)


# RFC 9110 token (header names, methods), field value (visible Latin-1, spaces, tabs) and an origin-form
# request target (visible ASCII from a leading /).
TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
HEADER_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
REQUEST_PATH = re.compile(r"/[\x21-\x7e]*")


def load_request_file(path: str | Path) -> list[dict]:
    """Requests from a JSON-lines file; raises TemplateError with one sentence for a bad file."""
    out = []
    for n, obj in json_lines(path, f"the request file {path}", TemplateError):
        if not isinstance(obj, dict) or not ({"path", "body"} & set(obj)):
            raise TemplateError(f"Line {n} of the request file {path} needs a \"path\" or a \"body\".")
        body = obj.get("body", "")
        method = str(obj.get("method", "POST" if body else "GET")).upper()
        path_ = str(obj.get("path", ""))
        headers = obj.get("headers") or {}
        # What goes into the request line and headers must not be able to end them early (CR/LF, spaces).
        if not TOKEN.fullmatch(method):
            raise TemplateError(f"Line {n} of the request file {path}: \"method\" must be an HTTP method "
                                f"such as POST, not {method!r}.")
        if path_ and not REQUEST_PATH.fullmatch(path_):
            raise TemplateError(f"Line {n} of the request file {path}: \"path\" must start with / and hold no "
                                "spaces, control or non-ASCII characters (percent-encode them).")
        if not isinstance(headers, dict) or not all(
                isinstance(v, str) and TOKEN.fullmatch(str(k)) and HEADER_VALUE.fullmatch(v)
                for k, v in headers.items()):
            raise TemplateError(f"Line {n} of the request file {path}: \"headers\" must map header names to "
                                "values of one line of Latin-1 text.")
        out.append({"method": method, "path": path_, "headers": dict(headers),
                    "body": body if isinstance(body, str) else orjson.dumps(body).decode(),
                    "tag": obj.get("tag")})
    if not out:
        raise TemplateError(f"The request file {path} holds no requests.")
    return out
