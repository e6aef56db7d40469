"""HTTP pieces shared by the ASGI middleware, the aiohttp middleware and the proxy."""

from __future__ import annotations

import json
from typing import Any

from ._core import Decision

__all__ = ["GUARD_HEADER", "needs_body", "refusal", "rewrite_model", "cache_key", "parse_json"]

GUARD_HEADER = "x-gpuscope-guard"  # on every answer the guard wrote itself: why (shed reason, 'cached')

_MESSAGES = {
    "rate": "The {k} class is over its rate limit; retry after {s} s.",
    "tenant_rate": "This tenant is over its rate limit in the {k} class; retry after {s} s.",
    "concurrency": "The service is at its concurrency limit for the {k} class; retry after {s} s.",
    "queue_full": "The queue is full of higher-priority work; retry after {s} s.",
    "queue_timeout": "The request waited its {k} class's longest queue time without a free slot; retry after {s} s.",
    "evicted": "Higher-priority work took this request's place in the queue; retry after {s} s.",
    "gpu_saturated": "The GPU is saturated and admission is paused; retry after {s} s.",
    "breaker_open": "The upstream is failing and its circuit is open; retry after {s} s.",
}


def refusal(d: Decision) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and an OpenAI-style JSON error body for a shed decision."""
    s = d.retry_after_header()
    msg = _MESSAGES.get(d.reason, "The request was refused; retry after {s} s.").format(k=d.klass, s=s)
    body = json.dumps({"error": {"message": msg, "type": "overloaded" if d.status == 503 else "rate_limited",
                                 "code": d.reason, "class": d.klass}}).encode()
    return d.status, {"Retry-After": s, "Content-Type": "application/json", GUARD_HEADER: d.reason}, body


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: '[' nested thousands deep
        return None


def rewrite_model(body: bytes, model: str) -> bytes:
    """The same JSON body with its `model` field set to the cheaper model (unchanged when not JSON)."""
    data = parse_json(body)
    if not isinstance(data, dict):
        return body
    data["model"] = model
    return json.dumps(data).encode()


def cache_key(method: str, path: str, body: Any) -> str:
    model = body.get("model") if isinstance(body, dict) else None
    return f"{method} {path} {model or ''}"


def needs_body(guard: Any) -> bool:
    """Whether the guard's config needs the request body before deciding (token cost, model route, cache)."""
    cfg = guard.cfg
    return cfg.classify.cost == "tokens" or cfg.breaker.fallback == "cached" or cfg.breaker.fallback.startswith("model:")
