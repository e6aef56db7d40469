"""HTTP/1.1 heads as the guard proxy writes them: which headers go through, how a body is framed. No I/O.

    >>> request_head(b"POST", b"/v1/x", b"127.0.0.1:8000", [(b"Content-Type", b"text/plain"), (b"TE", b"x")], 3)
    b'POST /v1/x HTTP/1.1\\r\\nHost: 127.0.0.1:8000\\r\\nContent-Type: text/plain\\r\\nContent-Length: 3\\r\\n\\r\\n'
    >>> body_framing([(b"Transfer-Encoding", b"gzip, chunked")])
    -1

Hop-by-hop headers (RFC 9110 7.6.1) and those the `Connection` header names are the proxy's business and
are dropped both ways; Host becomes the upstream's (as the aiohttp proxy before did), and the framing is
written by the proxy (Content-Length when it knows the length, else chunked). `Expect` stops here too: the
proxy answers `100 Continue` itself once the request is admitted.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["CHUNKED", "HOP", "NONE", "answer", "body_framing", "connection_tokens", "request_head", "response_head"]

#: dropped in both directions (lower case); Content-Length and Transfer-Encoding are rewritten
HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
                 b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect"})

CHUNKED = -1  # body_framing: chunked
NONE = -2  # body_framing: neither length nor chunked (a request has no body; a response runs to EOF)


def connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The header names a `Connection` header lists (lower case): hop-by-hop too."""
    out: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            out.update(t.strip().lower() for t in value.split(b","))
    return frozenset(out)


def body_framing(headers: Iterable[tuple[bytes, bytes]]) -> int:
    """The body's length from its headers, CHUNKED, or NONE. The parser (llhttp) has already refused a message
    with both, or with a Content-Length that is no number."""
    length = NONE
    for name, value in headers:
        n = name.lower()
        if n == b"transfer-encoding":
            if value.rsplit(b",", 1)[-1].strip().lower() == b"chunked":
                return CHUNKED
        elif n == b"content-length":
            length = int(value.split(b",")[0].strip())
    return length


def _forwarded(headers: Iterable[tuple[bytes, bytes]], out: list[bytes]) -> None:
    start = len(out)
    named: set[bytes] | None = None
    for name, value in headers:
        n = name.lower()
        if n in HOP:
            if n == b"connection":  # rare: a Connection header naming other headers, hop-by-hop as well
                more = {t.strip().lower() for t in value.split(b",")} - {b"close", b"keep-alive", b""}
                if more:
                    named = (named or set()) | more
            continue
        out += (name, b": ", value, b"\r\n")
    if named:
        tail = out[start:]
        del out[start:]
        for i in range(0, len(tail), 4):
            if tail[i].lower() not in named:
                out += tail[i:i + 4]


def request_head(method: bytes, target: bytes, host: bytes, headers: Iterable[tuple[bytes, bytes]],
                 length: int) -> bytes:
    """The head sent upstream: `length` is the body's byte count, CHUNKED, or NONE (no body)."""
    out = [method, b" ", target, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    _forwarded(headers, out)
    if length >= 0:
        out += (b"Content-Length: ", b"%d" % length, b"\r\n")
    elif length == CHUNKED:
        out.append(b"Transfer-Encoding: chunked\r\n")
    out.append(b"\r\n")
    return b"".join(out)


def response_head(status: int, reason: bytes, headers: Iterable[tuple[bytes, bytes]], length: int,
                  close: bool, keep_alive_header: bool = False) -> bytes:
    """The head sent to the client: `length` as in request_head (NONE: the body runs to the close, or there is
    none); `close` adds `Connection: close`, `keep_alive_header` `Connection: keep-alive` (an HTTP/1.0 client)."""
    out = [b"HTTP/1.1 %d " % status, reason, b"\r\n"]
    _forwarded(headers, out)
    if length >= 0:
        out += (b"Content-Length: ", b"%d" % length, b"\r\n")
    elif length == CHUNKED:
        out.append(b"Transfer-Encoding: chunked\r\n")
    if close:
        out.append(b"Connection: close\r\n")
    elif keep_alive_header:
        out.append(b"Connection: keep-alive\r\n")
    out.append(b"\r\n")
    return b"".join(out)


def answer(status: int, reason: str, headers: dict[str, str], body: bytes, close: bool) -> bytes:
    """A whole answer the proxy writes itself (a refusal, an error, its metrics, a cached answer)."""
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += (f"{k}: {v}" for k, v in headers.items())
    lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
