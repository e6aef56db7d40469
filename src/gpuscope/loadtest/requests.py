"""What each request carries: generic HTTP (templates, request files), OpenAI streaming, or a replayed capture.

A `RequestMaker` is built once per worker from the picklable `Protocol` description and turns a sequence
number into encoded bytes, a tag and (for streaming) the prompt's size in words.

Replay files (`--replay capture.jsonl`) are what `gpuscope capture` writes, in the format of
docs/loadtest-replay.md (the reference): JSON lines, one request each,
    {"t": 0.125, "method": "POST", "path": "/v1/completions", "headers": {...}, "body": {...} | "text",
     "prompt_tokens": 512, "output_tokens": 128, "tag": "chat", ...}
Only `t` (seconds since the capture's start) is required; capture's `prompt_chars`, `status`,
`duration_s` and `error` are read past. A line with no body but prompt_tokens/output_tokens gets a
generated OpenAI body of that size when `--openai` is given. A captured OpenAI completions or chat body
is sent with its answer's length pinned to the captured `output_tokens` (see `pin_output_tokens`). A
line whose `stream` is true in its JSON body is read as server-sent events.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from .._files import shown
from ..errors import UsageError
from . import openai
from .client import Target, encode_request
from .jsonl import json_lines
from .templates import Template


class ReplayError(UsageError, ValueError):
    """A replay file that cannot be replayed: one sentence."""


# Length keys of OpenAI-compatible bodies: completions and chat's max_tokens, chat's newer name for it.
_LENGTH_KEYS = ("max_tokens", "max_completion_tokens")


def pin_output_tokens(path: str, body: dict, output_tokens: int | None) -> dict:
    """A captured OpenAI completions/chat body that asks for exactly the captured answer's length:
    max_tokens (or max_completion_tokens, whichever it used) set to `output_tokens`, `ignore_eos` on
    (honoured by vLLM, SGLang, TensorRT-LLM and the example service), and usage asked for when it
    streams. Without the pin an anonymised prompt, or another sampling of the same one, stops at
    another end-of-sequence and the replay asks for different work. Other bodies are returned as they are.

    >>> pin_output_tokens("/v1/completions", {"prompt": "xx", "max_tokens": 512}, 37)
    {'prompt': 'xx', 'max_tokens': 37, 'ignore_eos': True}
    """
    if (not isinstance(output_tokens, int) or isinstance(output_tokens, bool) or output_tokens < 1
            or not path.split("?", 1)[0].endswith("/completions") or not ("prompt" in body or "messages" in body)):
        return body
    out = dict(body)
    keys = [k for k in _LENGTH_KEYS if k in out] or ["max_tokens"]
    for k in keys:
        out[k] = output_tokens
    out["ignore_eos"] = True
    if out.get("stream") is True:
        out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True}
    return out


@dataclass
class Protocol:
    kind: str = "http"                 # "http", "openai-completions", "openai-chat"
    method: str = "GET"
    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""                     # a template
    requests: list[dict] | None = None  # a request file, round-robin
    replay: list[dict] | None = None   # one entry per scheduled request, in order
    model: str = "default"
    prompt_tokens: int = 128
    max_tokens: int = 128
    prompts: list[str] | None = None

    @property
    def streaming(self) -> bool:
        return self.kind.startswith("openai")

    @property
    def openai_kind(self) -> str:
        return self.kind.split("-", 1)[1] if self.streaming else ""


class RequestMaker:
    def __init__(self, proto: Protocol, target: Target, seed: int | None, worker: int) -> None:
        self.proto = proto
        self.target = target
        self.rng = random.Random(None if seed is None else seed * 1000 + worker)
        self.body = Template(proto.body)
        self.path = target.path
        if proto.streaming and self.path in ("", "/"):
            self.path = openai.default_path(proto.openai_kind)
        self.headers = dict(proto.headers)
        if (proto.streaming or proto.body.lstrip().startswith(("{", "["))) and not any(
                k.lower() == "content-type" for k in self.headers):
            self.headers["Content-Type"] = "application/json"
        self.static: bytes | None = None
        if proto.kind == "http" and not proto.requests and not proto.replay and self.body.static:
            self.static = encode_request(target, proto.method, self.path, self.headers, proto.body.encode())

    def make(self, seq: int) -> tuple[bytes, str | None, int | None, bool]:
        """(request bytes, tag, prompt words or None, read the answer as SSE)."""
        if self.static is not None:
            return self.static, None, None, False
        p = self.proto
        if p.replay is not None:
            return self._replayed(p.replay[seq % len(p.replay)], seq)
        if p.requests:
            r = p.requests[seq % len(p.requests)]
            body = Template(r["body"]).render(seq, self.rng).encode()
            headers = {**self.headers, **r["headers"]}
            return encode_request(self.target, r["method"], r["path"] or self.path, headers, body), r["tag"], None, False
        if p.streaming:
            prompt = p.prompts[seq % len(p.prompts)] if p.prompts else openai.prompt_of(p.prompt_tokens, self.rng)
            body = openai.body(p.openai_kind, p.model, prompt, p.max_tokens)
            return (encode_request(self.target, "POST", self.path, self.headers, body), None,
                    len(prompt.split()), True)
        body = self.body.render(seq, self.rng).encode()
        return encode_request(self.target, p.method, self.path, self.headers, body), None, None, False

    def _replayed(self, r: dict, seq: int) -> tuple[bytes, str | None, int | None, bool]:
        p = self.proto
        body = r.get("body")
        words = None
        if body is None and p.streaming:
            n_in = int(r.get("prompt_tokens") or p.prompt_tokens)
            raw = openai.body(p.openai_kind, p.model, openai.prompt_of(n_in, self.rng),
                              int(r.get("output_tokens") or p.max_tokens))
            words, stream = n_in, True
        elif isinstance(body, (dict, list)):
            if isinstance(body, dict):
                body = pin_output_tokens(str(r.get("path") or self.path), body, r.get("output_tokens"))
            raw = orjson.dumps(body)
            stream = isinstance(body, dict) and bool(body.get("stream"))
            # The captured prompt size stands in for the server's count if the answer has no usage.
            words = r.get("prompt_tokens") if stream else None
        else:
            raw = str(body or "").encode()
            stream = False
        headers = {**self.headers, **(r.get("headers") or {})}
        method = str(r.get("method") or ("POST" if raw else "GET")).upper()
        path = r.get("path") or self.path
        return encode_request(self.target, method, path, headers, raw), r.get("tag"), words, stream


def load_replay(path: str | Path, speed: float = 1.0) -> tuple[np.ndarray, list[dict]]:
    """Send times (seconds from the start, divided by `speed`) and requests of a capture file."""
    times, reqs = [], []
    for n, obj in json_lines(path, f"the replay file {path}", ReplayError):
        if not isinstance(obj, dict) or not isinstance(obj.get("t"), (int, float)) or obj["t"] < 0:
            raise ReplayError(f"Line {n} of the replay file {path} needs \"t\", seconds since the capture's start.")
        problem = _bad_field(obj)
        if problem:
            raise ReplayError(f"Line {n} of the replay file {path}: {problem} (see docs/loadtest-replay.md).")
        times.append(float(obj["t"]))
        reqs.append(obj)
    if not reqs:
        raise ReplayError(f"The replay file {path} holds no requests.")
    order = np.argsort(np.asarray(times), kind="stable")
    t = np.asarray(times)[order]
    return (t - t[0]) / speed, [reqs[i] for i in order]


# What can be written into a request line and headers (RFC 9110: a token; a field value of visible Latin-1,
# spaces and tabs; a target of visible ASCII): CR/LF would forge a header, other characters cannot be sent.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_TARGET = re.compile(r"/[\x21-\x7e]*")


def _bad_field(obj: dict) -> str | None:
    """What is wrong with a line's optional fields, as a phrase; None when they can be sent."""
    method, target, headers = obj.get("method"), obj.get("path"), obj.get("headers")
    if method is not None and not (isinstance(method, str) and _TOKEN.fullmatch(method)):
        return f"\"method\" must be an HTTP method such as \"POST\", not {method!r}"
    if target is not None and not (isinstance(target, str) and _TARGET.fullmatch(target)):
        return f"\"path\" must start with / and hold no spaces or control characters, not {target!r}"
    if headers is not None and not (isinstance(headers, dict) and all(
            isinstance(k, str) and isinstance(v, str) and _TOKEN.fullmatch(k) and _HEADER_VALUE.fullmatch(v)
            for k, v in headers.items())):
        return "\"headers\" must be an object of header names to values of one line of Latin-1 text"
    for key in ("prompt_tokens", "output_tokens"):
        v = obj.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return f"\"{key}\" must be a whole number of tokens or null, not {shown(v)}"
    if obj.get("tag") is not None and not isinstance(obj["tag"], str):
        return f"\"tag\" must be a string, not {shown(obj['tag'])}"
    return None
