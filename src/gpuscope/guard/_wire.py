"""HTTP/1.1 heads as the guard proxy writes them: which headers go through, how a body is framed. No I/O.

    >>> h = Head()
    >>> for name, value in [(b"Content-Type", b"text/plain"), (b"TE", b"x"), (b"Content-Length", b"3")]:
    ...     h.add(name, value)
    >>> h.length, h.content_type
    (3, b'text/plain')
    >>> request_head(b"POST", b"/v1/x", b"127.0.0.1:8000", h.forwarded(), h.length)
    b'POST /v1/x HTTP/1.1\\r\\nHost: 127.0.0.1:8000\\r\\nContent-Type: text/plain\\r\\nContent-Length: 3\\r\\n\\r\\n'

Hop-by-hop headers (RFC 9110 7.6.1) and those the `Connection` header names are the proxy's business and
are dropped both ways; Host becomes the upstream's (as the aiohttp proxy before did), and the framing is
written by the proxy (Content-Length when it knows the length, else chunked). `Expect` stops here too: the
proxy answers `100 Continue` itself once the request is admitted. Each header is looked at once, as the
parser hands it over (`Head.add`): the forwarded ones are kept as the bytes to write.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["CHUNKED", "HOP", "NONE", "Head", "Headers", "answer", "request_head", "response_head"]

#: dropped in both directions (lower case); Content-Length and Transfer-Encoding are rewritten
HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
                 b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect"})

CHUNKED = -1  # framing: chunked
NONE = -2  # framing: neither length nor chunked (a request has no body; a response runs to EOF)


class Head:
    """One message's headers, sorted as they arrive: the forwarded ones as the bytes to write (`parts`), the
    body's framing (`length`: bytes, CHUNKED or NONE) and the few the proxy reads itself. llhttp has already
    refused a message with both a length and chunking, or a length that is no number. The protocols sort the
    common headers themselves (`add` is what they do, written out: this runs once per header) and call `hop`
    for the hop-by-hop ones."""

    __slots__ = ("parts", "length", "named", "expect", "keep_alive", "content_type", "raw")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.length = NONE
        self.named: set[bytes] | None = None  # other headers the Connection header names
        self.expect: bytes | None = None
        self.keep_alive: bytes | None = None
        self.content_type: bytes | None = None
        self.raw: dict[bytes, bytes] = {}  # lower-case name -> value (the last one of a repeated name)

    def add(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        self.raw[n] = value
        if n in HOP:
            self.hop(n, value)
            return
        if n == b"content-type":
            self.content_type = value
        self.parts += (name, b": ", value, b"\r\n")

    def hop(self, n: bytes, value: bytes) -> None:
        """A hop-by-hop header `n` (lower case): kept for the proxy, not forwarded."""
        if n == b"content-length":
            if self.length != CHUNKED:
                self.length = int(value.split(b",")[0].strip())
        elif n == b"transfer-encoding":
            if value.rsplit(b",", 1)[-1].strip().lower() == b"chunked":
                self.length = CHUNKED
        elif n == b"connection":  # rare: a Connection header naming other headers, hop-by-hop as well
            more = {t.strip().lower() for t in value.split(b",")} - {b"close", b"keep-alive", b""}
            if more:
                self.named = (self.named or set()) | more
        elif n == b"expect":
            self.expect = value
        elif n == b"keep-alive":
            self.keep_alive = value

    def forwarded(self) -> list[bytes]:
        """The headers that go on, each as name, ': ', value, CRLF."""
        named, parts = self.named, self.parts
        if not named:
            return parts
        return [p for i in range(0, len(parts), 4) if parts[i].lower() not in named for p in parts[i:i + 4]]


class Headers(Mapping[str, str]):
    """A request's headers as the guard reads them (lower-case str names and values), decoded only when asked:
    a decision reads two of them."""

    __slots__ = ("_raw",)

    def __init__(self, raw: dict[bytes, bytes]) -> None:
        self._raw = raw

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        v = self._raw.get(key.encode("latin-1"))
        return default if v is None else v.decode("latin-1")

    def __getitem__(self, key: str) -> str:
        return self._raw[key.encode("latin-1")].decode("latin-1")

    def __iter__(self) -> Iterator[str]:
        return (k.decode("latin-1") for k in self._raw)

    def __len__(self) -> int:
        return len(self._raw)


def request_head(method: bytes, target: bytes, host: bytes, headers: list[bytes], length: int) -> bytes:
    """The head sent upstream: `headers` from Head.forwarded(); `length` is the body's byte count, CHUNKED,
    or NONE (no body)."""
    out = [method, b" ", target, b" HTTP/1.1\r\nHost: ", host, b"\r\n", *headers]
    if length >= 0:
        out += (b"Content-Length: ", b"%d" % length, b"\r\n")
    elif length == CHUNKED:
        out.append(b"Transfer-Encoding: chunked\r\n")
    out.append(b"\r\n")
    return b"".join(out)


def response_head(status: int, reason: bytes, headers: list[bytes], length: int, close: bool,
                  keep_alive_header: bool = False) -> bytes:
    """The head sent to the client: `length` as in request_head (NONE: the body runs to the close, or there is
    none); `close` adds `Connection: close`, `keep_alive_header` `Connection: keep-alive` (an HTTP/1.0 client)."""
    out = [b"HTTP/1.1 %d " % status, reason, b"\r\n", *headers]
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
