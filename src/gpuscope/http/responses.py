"""JSON answers and the one error body of gpuscope's own servers: `{"error": "one sentence"}`.

    raise BadRequest("end must be after start.")          # a handler's 400, through json_errors()
    return error_response(409, "No process opted in.")
    return json_response({"accepted": 3}, status=202)

`json_errors(...)` is the middleware that turns what a handler raises into that body: a UsageError
(BadRequest, a bad time or duration, a store's refusal) is a 400 with its sentence, aiohttp's own 404,
405 and 413 get a sentence, anything else is a 500 naming the exception type (its traceback goes to the
log, never to the client). The proxies answer in the OpenAI form their clients read,
`{"error": {"message": "one sentence", "type": ...}}` (serve.py takes the body form per server).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any

from aiohttp import web

from ..errors import UsageError

__all__ = ["BadRequest", "dumps", "error_bytes", "error_response", "json_errors", "json_response"]


class BadRequest(UsageError):
    """The request's parameters or body are wrong: a 400 whose body is this one sentence."""

    status = 400


def _finite(o: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    return o


def dumps(data: Any) -> str:
    """Compact JSON; NaN and infinity as null, numpy arrays and scalars as lists and numbers."""
    return json.dumps(_finite(data), default=lambda o: _finite(o.tolist()) if hasattr(o, "tolist") else str(o),
                      allow_nan=False, separators=(",", ":"))


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=dumps(data), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store", **(headers or {})})


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return json_response({"error": message}, status, headers)


def error_bytes(status: int, message: str) -> bytes:
    """The body of error_response, for answers written below aiohttp's handlers (serve.py)."""
    return dumps({"error": message}).encode()


def _sentence(text: str) -> str:
    text = text.strip() or "The request failed"
    return text if text.endswith((".", "?", "!")) else text + "."


def json_errors(*, server: str, not_found: str, log: logging.Logger) -> Any:
    """The middleware that answers every failure of a handler as `{"error": sentence}`.

    `server` names it in a 500 ("The agent failed to answer: KeyError."); `not_found` is the 404
    sentence, with {path} for the request's path."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except UsageError as e:  # BadRequest, TimeError, StoreError: the request's own fault
            return error_response(getattr(e, "status", 400), str(e))
        except web.HTTPException as e:
            if e.status < 400:
                raise  # a redirect
            reason = {404: not_found.format(path=request.path),
                      405: f"{request.method} is not allowed on {request.path}.",
                      413: "The request body is too large."}.get(e.status, e.reason)
            return error_response(e.status, _sentence(reason), {k: v for k, v in e.headers.items()
                                                                if k in ("Allow", "Retry-After")})
        except asyncio.CancelledError:
            raise
        except ConnectionResetError:  # the client left mid-body (a Content-Length it never sent): not our failure
            return error_response(400, "The connection closed before the request body ended.")
        except Exception as e:  # noqa: BLE001 - the server keeps serving, and answers in JSON
            log.exception("request %s failed", request.path)
            return error_response(500, f"The {server} failed to answer: {type(e).__name__}.")

    return middleware
