"""Request classification: which priority class, which tenant, what it costs. No I/O.

    >>> from gpuscope.guard._config import parse
    >>> c = Classifier(parse({"classes": [{"name": "interactive"}, {"name": "batch"}],
    ...                       "classify": {"cost": "tokens"}}))
    >>> c.classify(RequestInfo(path="/v1/completions", headers={"x-priority": "interactive"},
    ...                        body={"prompt": "x" * 40, "max_tokens": 16}))
    (0, '', 26.0)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._config import GuardConfig

__all__ = ["Classifier", "RequestInfo", "estimate_tokens"]

_CHARS_PER_TOKEN = 4.0  # the usual English-text rule of thumb for BPE tokenizers; an estimate, not a count
_DEFAULT_MAX_TOKENS = 256.0  # what a completion costs when the body does not bound it


@dataclass(slots=True)
class RequestInfo:
    """What the guard needs to know about a request. `headers` keys are lower-case; `body` is the parsed
    JSON body (or raw bytes, parsed lazily) or None."""

    path: str = "/"
    headers: Mapping[str, str] = field(default_factory=dict)
    body: Any = None
    method: str = "POST"
    tenant: str | None = None  # overrides the tenant header
    klass: str | None = None  # overrides classification


class _Oversize:
    """A body too large to read for an estimate (past classify.max_body_bytes)."""

    def __repr__(self) -> str:
        return "OVERSIZE"


#: Passed as RequestInfo.body for a body past classify.max_body_bytes: it costs the most a request can be
#: charged (its buckets' burst), so padding a prompt past the cap cannot make a request cheap.
OVERSIZE: Any = _Oversize()
_OVERSIZE_COST = 1e12  # charged as the burst: a cost over the burst is capped there (see _bucket.py)


def estimate_tokens(body: Any) -> float:
    """Prompt tokens (characters / 4) plus max_tokens (or max_completion_tokens) of an OpenAI request body;
    OVERSIZE (a body too large to read) costs the burst."""
    if body is OVERSIZE:
        return _OVERSIZE_COST
    if isinstance(body, (bytes, bytearray)):
        try:
            body = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return 1.0
    if not isinstance(body, dict):
        return 1.0
    chars = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        chars += sum(len(p) if isinstance(p, str) else 4 * len(p) if isinstance(p, list) else 0 for p in prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                chars += len(c)
            elif isinstance(c, list):  # content parts: count the text ones
                chars += sum(len(p.get("text", "")) for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    out = body.get("max_tokens", body.get("max_completion_tokens"))
    out_tokens = float(out) if isinstance(out, (int, float)) and not isinstance(out, bool) and out >= 0 \
        else _DEFAULT_MAX_TOKENS
    return max(1.0, chars / _CHARS_PER_TOKEN + out_tokens)


class Classifier:
    """Classes a request by an override, its class header, or its path. The class of each distinct (path,
    header value) seen is cached: the answer depends only on those two and on the config, which a
    Classifier never changes (a new config builds a new guard). Both are client-chosen strings, so the cache
    is bounded at `max_cached` entries; when full it is emptied and refilled by the traffic that follows."""

    __slots__ = ("_index", "_header", "_tenant_header", "_routes", "_default", "_tokens", "cache", "_max_cached")

    def __init__(self, cfg: GuardConfig, max_cached: int = 4096) -> None:
        self._index = {c.name: i for i, c in enumerate(cfg.classes)}
        cl = cfg.classify
        self._header = cl.header
        self._tenant_header = cl.tenant_header
        # longest prefix first, so '/v1/embeddings/x' matches '/v1/embeddings' before '/v1'
        self._routes = sorted(((p, self._index[c]) for p, c in cl.routes.items()), key=lambda r: -len(r[0]))
        self._default = self._index[cl.default]
        self._tokens = cl.cost == "tokens"
        self.cache: dict[tuple[str, str | None], int] = {}  # (path, class header value) -> class index
        self._max_cached = max_cached

    def classify(self, info: RequestInfo) -> tuple[int, str, float]:
        """(class index, tenant, cost). An unknown class named in the header falls back to the route/default
        class: a client cannot promote itself by inventing a name."""
        h = info.headers
        idx = -1
        if info.klass is not None:
            idx = self._index.get(info.klass, -1)
        if idx < 0:
            key = (info.path, h.get(self._header))
            idx = self.cache.get(key, -1)
            if idx < 0:
                idx = self.index_of(*key)
        tenant = info.tenant if info.tenant is not None else h.get(self._tenant_header, "")
        cost = estimate_tokens(info.body) if self._tokens else 1.0
        return idx, tenant, cost

    def header_class(self, header_value: str) -> int:
        """The class a class header value names (trimmed, any case), whatever the path; -1: none."""
        v = header_value.strip()
        return self._index.get(v.lower(), self._index.get(v, -1))

    def index_of(self, path: str, header_value: str | None) -> int:
        """The class of a request with this path and class header value (None: no header); cached."""
        idx = -1
        if header_value is not None:
            idx = self.header_class(header_value)
        if idx < 0:
            for prefix, i in self._routes:
                if path.startswith(prefix):
                    idx = i
                    break
            else:
                idx = self._default
        if len(self.cache) >= self._max_cached:
            self.cache.clear()
        self.cache[(path, header_value)] = idx
        return idx
