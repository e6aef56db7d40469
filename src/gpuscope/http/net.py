"""Where a server listens and where a proxy forwards: one rule for every `--listen` and `--upstream`.

`--listen` takes HOST:PORT, :PORT (meaning 127.0.0.1) or [IPV6]:PORT; PORT 0 lets the system pick a
free port (the server prints the one it got). Standard library only.

>>> parse_listen(":8081")
('127.0.0.1', 8081)
>>> parse_listen("[::1]:0")
('::1', 0)
>>> parse_upstream("http://127.0.0.1:8000/")
'http://127.0.0.1:8000'
>>> is_loopback_host("127.0.0.1"), is_loopback_host("127.example.com")
(True, False)
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse

from ..errors import UsageError

__all__ = ["format_host", "is_loopback_host", "parse_listen", "parse_upstream"]

_HOST = re.compile(r"[A-Za-z0-9._-]+", re.ASCII)


def is_loopback_host(host: str) -> bool:
    """Only a literal loopback address ('127.0.0.1', '::1', '[::1]') or 'localhost' counts: a host name
    that merely starts with '127.' does not."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def format_host(host: str) -> str:
    """The host as it goes in a URL or a HOST:PORT: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def parse_listen(text: str, flag: str = "--listen", example: str = "127.0.0.1:8081") -> tuple[str, int]:
    """(host, port) from HOST:PORT, :PORT (127.0.0.1) or [IPV6]:PORT; port 0 to 65535 (0: any free one)."""
    port_example = example.rpartition(":")[2]
    bad = UsageError(f"{flag} must be HOST:PORT such as {example}, :{port_example} (on 127.0.0.1) or "
                     f"[::1]:{port_example}, not {text!r}.")
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isascii() or not port.isdigit():
        raise bad
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            if ipaddress.ip_address(host).version != 6:
                raise ValueError
        except ValueError:
            raise bad from None
    elif not host:
        host = "127.0.0.1"
    elif ":" in host:  # '::1:8081': which colon ends the address? Brackets say.
        raise UsageError(f"{flag}: write an IPv6 address in brackets, such as [::1]:{port_example}, not {text!r}.")
    elif not _HOST.fullmatch(host):
        raise bad
    if int(port) > 65535:
        raise UsageError(f"{flag} {text!r}: the port must be between 0 and 65535.")
    return host, int(port)


def parse_upstream(text: str, flag: str = "--upstream", example: str = "http://127.0.0.1:8000") -> str:
    """The base URL of a server to talk to, without its trailing '/': http or https, a host, a valid port,
    no query or fragment, no whitespace."""
    try:
        u = urllib.parse.urlsplit(text)
        _ = u.port  # raises ValueError for a port that is no number or out of range
    except ValueError:
        if text.startswith(("http://", "https://")):
            raise UsageError(f"{flag} {text!r} has a bad port or address.") from None
        u = None
    if u is None or u.scheme not in ("http", "https") or not u.hostname or any(c.isspace() for c in text):
        raise UsageError(f"{flag} must be an http:// or https:// URL such as {example}, not {text!r}.")
    if u.query or u.fragment:
        raise UsageError(f"{flag} {text!r} must not carry a query or fragment: give the server's base URL.")
    return text.rstrip("/")
