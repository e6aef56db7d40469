"""`gpuscope capture`: a local reverse proxy that records a live service's requests for replay.

Every request to `--listen` is forwarded to `--upstream` and its response streamed back byte for byte as
it arrives (SSE included: nothing is buffered); each request becomes one JSON line in `--out`, in the
replay format of docs/loadtest-replay.md, which `gpuscope loadtest --replay` reads. Lines are written in
arrival order (a line waits for the requests before it to finish), so `t` never decreases.

Upstreams speak HTTP/1.1 their own ways and pass through: a body that ends with the connection (HTTP/1.0,
SSE without chunking) is forwarded chunked; 1xx interim answers are read past; trailers are read, not
forwarded; a kept-alive upstream connection closed under an idempotent request is retried once (aiohttp),
a POST is never sent twice (the client gets a 502 saying the upstream closed the connection). An answer
that is not HTTP — a bad status line, a field over 8,190 bytes, bytes past its body, a status outside
200-599, a 101 — is a 502 with one sentence; a body cut short, or stalled past --timeout, cuts the
client's answer too (it never sees a clean end).

Credentials never reach the file: Authorization, Cookie, API-key and other secret-looking headers are
forwarded upstream but not recorded. `--anonymise` replaces prompt and message text with filler of the
same length and word count, keeping the JSON structure, the model, the roles and every number.

    gpuscope capture --upstream http://127.0.0.1:8000 --out capture.jsonl   # then point clients at :8081
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import replace
from typing import IO, Any

import aiohttp
from aiohttp import web

from ..errors import UsageError
from ..http.limits import limits_from_args
from ..http.net import is_loopback_host, parse_listen, parse_upstream
from ..http.serve import start

# Hop-by-hop headers (RFC 9110 section 7.6.1) belong to one connection, never forwarded or recorded; Host
# and Content-Length are recomputed by whoever sends the request again; Expect (100-continue) is met by this
# proxy itself, which reads the whole body before it forwards anything.
_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                  "upgrade", "host", "content-length", "expect"})
# A header whose name (split on - and _) has a part like these carries a credential: never written.
_SECRET_PART = re.compile(r"(?:key|token|secret|password|passwd|cookie|session|credential|signature)s?$|^auth")
# Request-body keys whose strings are structure, not content: kept by --anonymise.
_STRUCTURAL_KEYS = frozenset({"model", "role", "type", "object", "tool_choice", "name", "id", "tool_call_id",
                              "encoding_format", "response_format", "service_tier", "reasoning_effort"})
_PROMPT_KEYS = ("prompt", "messages", "input")
_MAX_BODY_COPY_BYTES = 8 << 20  # a non-streamed answer is kept up to this size to read its usage


def is_secret_header(name: str) -> bool:
    """True for Authorization, Cookie, X-Api-Key, Api-Key, X-Auth-Token, Proxy-Authorization and the like."""
    parts = [p for p in re.split(r"[-_]", name.lower()) if p]
    return any(_SECRET_PART.search(p) for p in parts) or "apikey" in name.lower().replace("-", "").replace("_", "")


def recorded_headers(headers: Any) -> dict[str, str]:
    """The request headers worth replaying: no hop-by-hop headers, no credentials."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP and not is_secret_header(k)}


def filler(text: str) -> str:
    """Same length, same whitespace: every other character becomes 'x' (so word counts, and so roughly
    token counts, are kept).

    >>> filler("Hi there,  you!")
    'xx xxxxxx  xxxx'
    """
    return "".join(c if c.isspace() else "x" for c in text)


def anonymise(value: Any, key: str | None = None) -> Any:
    """A JSON value with every content string replaced by `filler`; structural strings and numbers kept."""
    if isinstance(value, str):
        return value if key in _STRUCTURAL_KEYS else filler(value)
    if isinstance(value, list):
        return [anonymise(v, key) for v in value]
    if isinstance(value, dict):
        return {k: anonymise(v, k) for k, v in value.items()}
    return value


def _texts(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _texts(v)
    elif isinstance(value, dict):  # a chat message or a content part: only its text counts
        for k in ("content", "text"):
            if k in value:
                yield from _texts(value[k])


def _prompt_texts(body: Any) -> list[str]:
    if isinstance(body, dict) and any(k in body for k in _PROMPT_KEYS):
        return [s for k in _PROMPT_KEYS if k in body for s in _texts(body[k])]
    return [body] if isinstance(body, str) else []


def _token_ids(value: Any) -> int:
    """How many token ids a prompt given as ids holds ([1, 2] or [[1, 2], [3]]); 0 for text."""
    if isinstance(value, list):
        return sum(_token_ids(v) if isinstance(v, list) else int(isinstance(v, int) and not isinstance(v, bool))
                   for v in value)
    return 0


def prompt_chars(body: Any) -> int:
    """Characters of prompt text: the completions prompt, the chat messages' text, an embeddings input;
    for any other body its length as text."""
    return sum(len(s) for s in _prompt_texts(body))


def prompt_words(body: Any) -> int:
    """The prompt's size in tokens when the answer does not say: its whitespace-separated words (what the
    example service's tokenizer counts, and about one token each for English prose), plus any token ids.

    >>> prompt_words({"messages": [{"role": "user", "content": "Hi there,  you!"}]})
    3
    """
    ids = sum(_token_ids(body[k]) for k in _PROMPT_KEYS if k in body) if isinstance(body, dict) else 0
    return sum(len(s.split()) for s in _prompt_texts(body)) + ids


class UsageScanner:
    """Reads token counts from a response as it streams by: the last `usage` seen in an SSE `data:` line,
    or in a whole JSON body."""

    def __init__(self, content_type: str, encoded: bool) -> None:
        self.sse = content_type.startswith("text/event-stream") and not encoded
        self.json = "json" in content_type and not encoded
        self._line = b""
        self._body = bytearray()
        self.output_tokens: int | None = None
        self.prompt_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        if self.sse:
            lines = (self._line + chunk).split(b"\n")
            self._line = lines.pop()
            for line in lines:
                if line.startswith(b"data:") and b'"usage"' in line:
                    self._take(line[5:])
        elif self.json and len(self._body) + len(chunk) <= _MAX_BODY_COPY_BYTES:
            self._body += chunk

    def close(self) -> None:
        if self.sse and self._line.startswith(b"data:"):
            self._take(self._line[5:])
        elif self.json and self._body:
            self._take(bytes(self._body))

    def _take(self, data: bytes) -> None:
        try:
            usage = json.loads(data).get("usage")
        except (ValueError, AttributeError, RecursionError):
            return
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.output_tokens = usage["completion_tokens"]
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            self.prompt_tokens = usage["prompt_tokens"]


class Recorder:
    """Writes records in arrival order: record i is written once records 0..i-1 are."""

    def __init__(self, out: IO[str], anonymise: bool) -> None:
        self.out = out
        self.anonymise = anonymise
        self.t0: float | None = None
        self._next_seq = 0
        self._next_write = 0
        self._done: dict[int, dict[str, Any] | None] = {}
        self.written = 0

    def begin(self) -> tuple[int, float]:
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        self._next_seq += 1
        return self._next_seq - 1, now

    def finish(self, seq: int, record: dict[str, Any] | None) -> None:
        """Record `seq` (None: a request whose body never came, nothing to replay) and write what is due."""
        self._done[seq] = record
        while self._next_write in self._done:
            done = self._done.pop(self._next_write)
            self._next_write += 1
            if done is not None:
                self.out.write(json.dumps(done, ensure_ascii=False, separators=(",", ":")) + "\n")
                self.written += 1
        self.out.flush()

    def body_value(self, raw: bytes, content_type: str) -> Any:
        if not raw:
            return None
        text = raw.decode("utf-8", errors="replace")
        body: Any = text
        if "json" in content_type or text.lstrip()[:1] in ("{", "["):
            try:
                body = json.loads(text)
            except (ValueError, RecursionError):  # kept as text, as any body that is not JSON
                pass
        return body

    def path(self, path_qs: str) -> str:
        if not self.anonymise or "?" not in path_qs:
            return path_qs
        path, query = path_qs.split("?", 1)
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        return path + "?" + urllib.parse.urlencode([(k, filler(v)) for k, v in pairs])


class CaptureProxy:
    def __init__(self, upstream: str, recorder: Recorder, timeout_s: float = 600.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.recorder = recorder
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=10)
        self.session: aiohttp.ClientSession | None = None
        self.errors = 0

    async def start(self) -> None:
        # auto_decompress=False: the bytes go back exactly as the upstream sent them.
        self.session = aiohttp.ClientSession(timeout=self.timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        seq, t_start = self.recorder.begin()
        try:
            raw = await request.read()
        except BaseException:  # the client left, or its body missed the kit's body deadline
            self.recorder.finish(seq, None)  # the requests after it are still written
            raise
        content_type = request.headers.get("Content-Type", "")
        body = self.recorder.body_value(raw, content_type)
        record: dict[str, Any] = {
            "t": round(t_start - (self.recorder.t0 or t_start), 6), "method": request.method,
            "path": self.recorder.path(request.path_qs), "headers": recorded_headers(request.headers),
            "body": anonymise(body) if self.recorder.anonymise else body, "prompt_chars": prompt_chars(body),
            "prompt_tokens": prompt_words(body), "output_tokens": None, "status": 0, "duration_s": 0.0}
        forward = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        resp: web.StreamResponse | None = None
        try:
            async with self.session.request(request.method, self.upstream + request.path_qs, headers=forward,
                                            data=raw or None, allow_redirects=False,
                                            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type")) as up:
                if up.status == 101 or not 200 <= up.status <= 599:
                    # (1xx interim answers never get here: the client reads past them.) A 101 would tell the
                    # client its connection now speaks another protocol, which this proxy does not relay.
                    raise _NotHttp(f"The upstream {self.upstream} switched protocols (101), which the capture proxy "
                                   "does not relay." if up.status == 101 else
                                   f"The upstream {self.upstream} answered status {up.status}, which is not an HTTP "
                                   "status.")
                headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP or k.lower() == "content-length"}
                if up.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    headers.pop("Content-Length", None)
                resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
                await resp.prepare(request)
                scanner = UsageScanner(up.headers.get("Content-Type", ""), "Content-Encoding" in up.headers)
                record["status"] = up.status
                async for chunk in up.content.iter_any():  # as it arrives: a token's SSE event is not held back
                    scanner.feed(chunk)
                    await resp.write(chunk)
                scanner.close()
                record["output_tokens"] = scanner.output_tokens
                if scanner.prompt_tokens is not None:  # the server's own count beats the word estimate
                    record["prompt_tokens"] = scanner.prompt_tokens
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, _NotHttp) as e:
            sentence = _upstream_failure(self.upstream, e)
            record["error"] = sentence
            if resp is None:  # nothing sent yet: the client gets a 502 that says why
                record["status"] = 502
                self.errors += 1
                print(f"gpuscope capture: {request.method} {request.path}: {sentence}", file=sys.stderr, flush=True)
                return web.Response(status=502, body=error_body(502, sentence), content_type="application/json")
            if not isinstance(e, ConnectionResetError) and request.transport is not None:
                request.transport.close()  # the upstream broke off: the client must not see a clean end
            return resp  # the client or the upstream went away mid-answer: recorded with what was seen
        except asyncio.CancelledError:
            record["error"] = "The client closed the connection before the answer was complete."
            raise
        finally:
            record["duration_s"] = round(time.monotonic() - t_start, 6)
            self.recorder.finish(seq, record)


class _NotHttp(Exception):
    """An upstream answer the proxy will not pass on; the message is the client's sentence."""


def _upstream_failure(upstream: str, e: BaseException) -> str:
    if isinstance(e, _NotHttp):
        return str(e)
    if isinstance(e, aiohttp.ClientResponseError):   # aiohttp's parser refused the answer (bad status line,
        what = (e.message or "").strip().splitlines()  # a field over 8190 bytes, bytes past the body...)
        return f"The upstream {upstream} sent an answer that is not valid HTTP ({(what or ['?'])[0].rstrip(':.')})."
    if isinstance(e, asyncio.TimeoutError):
        return f"The upstream {upstream} did not answer in time."
    if isinstance(e, aiohttp.ClientConnectorError):
        why = ("connection refused" if isinstance(e.os_error, ConnectionRefusedError)
               else str(e.os_error.strerror or e.os_error).rstrip("."))
        return f"Cannot connect to the upstream {upstream}: {why}."
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        return f"The upstream {upstream} closed the connection before the answer was complete."
    if isinstance(e, (ConnectionResetError, aiohttp.ClientConnectionResetError)):
        return "The client closed the connection before the answer was complete."
    return f"The upstream {upstream} failed: {e}."


async def _probe(upstream: str) -> str | None:
    """None when the upstream answers HTTP at all (any status), else one sentence saying why not."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.get(upstream + "/", allow_redirects=False):
                return None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return _upstream_failure(upstream, e)


_ERROR_TYPES = {502: "bad_gateway", 503: "overloaded", 408: "request_timeout"}


def error_body(status: int, sentence: str) -> bytes:
    """The proxy's own answers in the OpenAI error form its clients read: the 502 when the upstream is away,
    the kit's 408, 414, 431 and 503 (gpuscope.http.serve)."""
    return json.dumps({"error": {"message": sentence, "type": _ERROR_TYPES.get(status, "invalid_request"),
                                 "code": status}}).encode()


async def _serve(args: argparse.Namespace, upstream: str, host: str, port: int) -> int:
    problem = await _probe(upstream)
    if problem:
        raise UsageError(problem)
    try:
        out = open(args.out, "w", encoding="utf-8")  # noqa: SIM115 - closed below, after the server stops
    except OSError as e:
        raise UsageError(f"Cannot write {args.out}: {e.strerror or e}.") from None
    try:
        return await _proxy(args, upstream, host, port, out)
    finally:
        out.close()


async def _proxy(args: argparse.Namespace, upstream: str, host: str, port: int, out: IO[str]) -> int:
    recorder = Recorder(out, args.anonymise)
    proxy = CaptureProxy(upstream, recorder, args.timeout)
    await proxy.start()
    app = web.Application(client_max_size=256 << 20)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    limits = replace(limits_from_args(args), fds_per_connection=2)  # the client's socket and the upstream's
    try:
        # handler_cancellation: a client that leaves cancels its forwarded request, so the upstream sees it leave too.
        served = await start(app, host, port, limits=limits, flag="--listen", error_body=error_body,
                             handler_cancellation=True)
    except BaseException:
        await proxy.close()
        raise
    print(f"listening on {served.url}", flush=True)
    print(f"gpuscope capture: forwarding to {upstream}, recording to {args.out}"
          + (" (anonymised)" if args.anonymise else "") + "; Ctrl-C stops.", file=sys.stderr, flush=True)
    if not is_loopback_host(host):
        print(f"gpuscope capture: warning: listening on {host}, reachable from other machines.", file=sys.stderr)
    waiting = asyncio.ensure_future(served.wait())
    try:
        while not waiting.done() and not (args.count and recorder.written >= args.count):
            await asyncio.wait([waiting], timeout=0.1)
    finally:
        served.stop_soon()
        await waiting
        await served.close()
        await proxy.close()
    print(f"gpuscope capture: {recorder.written} requests recorded in {args.out}"
          + (f", {proxy.errors} could not reach the upstream" if proxy.errors else "") + ".", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    upstream = parse_upstream(args.upstream)
    host, port = parse_listen(args.listen)
    if args.count < 0:
        raise UsageError(f"--count must be 0 (no limit) or more, not {args.count}.")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be more than 0 seconds, not {args.timeout:g}.")
    limits_from_args(args)  # bad limits are refused before the upstream is probed
    return asyncio.run(_serve(args, upstream, host, port))
