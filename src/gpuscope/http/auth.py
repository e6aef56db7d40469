"""Who may ask: the token file, the dashboard's cookie, and the one middleware of the agent and the dashboard.

The rule: a server bound to loopback answers only requests addressed to a loopback name (a web page
cannot reach it through a DNS name that resolves to 127.0.0.1: DNS rebinding) and its reads are open;
bound beyond loopback, every request needs the token (the Authorization header, or the dashboard
cookie for reads); changes (POST) need the token wherever it is bound. A refusal never says where the
token file is (that path goes to the server's own log). The one exception: the probe paths a server names
(the agent's /healthz and /readyz, PROBE_PATHS) answer GET and HEAD without the token, because a
Kubernetes httpGet probe cannot send one; such a request is marked (`probe_only(request)`) and its
handler answers only what anyone may know (alive, ready, and a reason that names no file and no error).

    token = load_or_create_token(data_dir / "token")          # 0600, made on first start
    app = web.Application(middlewares=[access(token=token, loopback_only=True, server="agent",
                                              token_hint=AGENT_TOKEN_HINT, token_path=path)])

The token file functions are standard library only (clients use find_token); aiohttp is imported by
the middleware alone.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._paths import default_data_dir
from ..errors import Unavailable

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["AGENT_TOKEN_HINT", "COOKIE", "PROBE_PATHS", "TokenError", "access", "authorized", "cookie_value",
           "find_token", "load_or_create_token", "probe_only", "token_login", "unauthorized_message"]

log = logging.getLogger("gpuscope.http")

COOKIE = "gpuscope_ui"
AGENT_TOKEN_HINT = "the file 'token' in the agent's data directory (see 'gpuscope agent --help')"
LOOPBACK_HOSTS = re.compile(r"^(localhost|127\.[0-9.]+|\[::1\])(:[0-9]+)?$", re.ASCII | re.IGNORECASE)
_SAY_PATH_EVERY_S = 60.0
#: liveness and readiness: what a kubelet's httpGet probe asks, without a token
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
_PROBE_ONLY = "gpuscope.http.probe_only"


class TokenError(Unavailable, RuntimeError):
    """The token file cannot be made or read; the message is one sentence."""


def load_or_create_token(path: Path) -> str:
    """The bearer token, created on first start with 0600 permissions."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            # Through one descriptor, and only for a regular file: `--token-file /tmp` must not chmod
            # the directory (it did, to 0600), nor a FIFO block the start.
            rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise TokenError(f"The token file {path} cannot be read: {e.strerror}.") from None
        try:
            st = os.fstat(rfd)
            if not stat.S_ISREG(st.st_mode):
                raise TokenError(f"The token file {path} is not a regular file; name a file.")
            mode = st.st_mode & 0o777
            if mode & 0o077:
                os.fchmod(rfd, 0o600)
                log.warning("token file %s was readable by others (mode %o); made it 0600", path, mode)
            with os.fdopen(rfd, "r") as f:
                rfd = -1
                token = f.read().strip()
        except OSError as e:
            raise TokenError(f"The token file {path} cannot be read: {e.strerror}.") from None
        finally:
            if rfd >= 0:
                os.close(rfd)
        if len(token) < 16:
            raise TokenError(f"The token file {path} holds no usable token; delete it to make a new one.") from None
        return token
    except OSError as e:
        raise TokenError(f"The token file {path} cannot be made: {e.strerror}.") from None
    token = new_token()
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def new_token() -> str:
    """256 random bits, URL-safe, never starting with '-': `--token $(cat token)` must not read as a flag
    (a token_urlsafe string starts with '-' one time in 64)."""
    token = secrets.token_urlsafe(32)
    return token if token[0] != "-" else secrets.choice("abcdefghijklmnopqrstuvwxyz") + token[1:]


def find_token(explicit: str | None, data_dir: str | None) -> str | None:
    """What a client sends: `explicit` (--token), else $GPUSCOPE_TOKEN, else the agent's token file in
    `data_dir` (default: default_data_dir()); None when there is none to read."""
    if explicit:
        return explicit
    env = os.environ.get("GPUSCOPE_TOKEN")
    if env:
        return env
    path = Path(data_dir).expanduser() / "token" if data_dir else default_data_dir() / "token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


# -- the dashboard's cookie ------------------------------------------------------------------------
def cookie_value(token: str) -> str:
    """What the browser keeps instead of the token: useless as a bearer token elsewhere."""
    return hmac.new(token.encode(), b"gpuscope dashboard session", hashlib.sha256).hexdigest()


def authorized(request: web.Request, token: str) -> bool:
    """The Bearer header for anything; the dashboard cookie for reads (SameSite=Strict keeps other sites'
    pages from sending it, and reads change nothing)."""
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer ") and hmac.compare_digest(header[7:].strip().encode(), token.encode()):
        return True
    cookie = request.cookies.get(COOKIE)
    return (cookie is not None and request.method in ("GET", "HEAD")
            and hmac.compare_digest(cookie.encode(), cookie_value(token).encode()))


def token_login(request: web.Request, token: str) -> web.StreamResponse | None:
    """For /ui/?token=...: a redirect to the same URL without the token that sets the cookie (or a 401
    for a wrong token); None for any other request."""
    from urllib.parse import urlencode

    from aiohttp import web

    from .responses import error_response

    if "token" not in request.query or not request.path.startswith("/ui"):
        return None
    given = request.query["token"]
    if not hmac.compare_digest(given.encode(), token.encode()):
        return error_response(401, "The token in the URL is not this server's token.")
    rest = [(k, v) for k, v in request.query.items() if k != "token"]
    resp = web.HTTPSeeOther(request.path + ("?" + urlencode(rest) if rest else ""))
    resp.set_cookie(COOKIE, cookie_value(token), httponly=True, samesite="Strict", path="/")
    resp.headers["Cache-Control"] = "no-store"
    resp.headers["Referrer-Policy"] = "no-referrer"
    return resp


def unauthorized_message(request: web.Request, token_hint: str) -> str:
    """The 401 sentence: how to send the token, and where it is kept in words (never the file's path)."""
    if request.path.startswith("/ui"):
        return (f"The dashboard needs this server's token: open /ui/?token=TOKEN once (the token is in {token_hint}); "
                "your browser then keeps a cookie.")
    return f"This request needs the token: send 'Authorization: Bearer <token>' (the token is in {token_hint})."


def probe_only(request: web.Request) -> bool:
    """True when `request` was let through only as a probe (a probe path, beyond loopback, without the
    token): its answer must say nothing but alive/ready and a reason that names no file and no error."""
    return bool(request.get(_PROBE_ONLY, False))


def access(*, token: str | None, loopback_only: bool, server: str, token_hint: str,
           token_path: str | os.PathLike[str] | None = None, probe_paths: frozenset[str] = frozenset()) -> Any:
    """The loopback-Host and bearer-token middleware (the rule in this module's docstring). `server` names
    it in the 403 ("This agent listens on loopback only ..."); `token_hint` says where the token is kept,
    in words; `token_path` goes to the log with the first refusal a minute, not to the client.
    `probe_paths` (PROBE_PATHS for the agent) answer GET and HEAD without the token, marked probe_only."""
    from aiohttp import web

    from .responses import error_response

    if not loopback_only and not token:
        raise ValueError("A server reachable beyond loopback needs a token.")
    said_at = [-_SAY_PATH_EVERY_S]

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if loopback_only and not LOOPBACK_HOSTS.match(request.headers.get("Host", "")):
            return error_response(403, f"This {server} listens on loopback only and answers requests addressed "
                                       "to localhost or 127.0.0.1.")
        if token:
            login = token_login(request, token)  # /ui/?token=...: a cookie for the browser
            if login is not None:
                return login
        needs_token = not loopback_only or request.method not in ("GET", "HEAD", "OPTIONS")
        if (needs_token and request.path in probe_paths and request.method in ("GET", "HEAD")
                and not (token and authorized(request, token))):
            request[_PROBE_ONLY] = True
            return await handler(request)
        if needs_token and not (token and authorized(request, token)):
            now = time.monotonic()
            if token_path is not None and now - said_at[0] >= _SAY_PATH_EVERY_S:
                said_at[0] = now
                log.info("refused %s %s from %s without the token (it is in %s)", request.method, request.path,
                         request.remote, token_path)
            return error_response(401, unauthorized_message(request, token_hint))
        return await handler(request)

    return middleware
