"""Hide secrets in command lines before they are shown, stored or exported.

GPU jobs are often started with credentials on the command line (``--hf-token hf_...``,
``WANDB_API_KEY=... python train.py``, ``s3://`` or ``https://user:pass@`` URLs). gpuscope shows
command lines in the TUI, the web page and exported labels, so every command line goes through here.

    >>> redact_cmdline(["python", "train.py", "--hf-token", "abc123", "--lr", "0.1"])
    'python train.py --hf-token *** --lr 0.1'
    >>> redact_text("https://user:hunter2@example.com/repo.git")
    'https://user:***@example.com/repo.git'

`redact_url` hides more of a URL that is shown whole (a notifier's). The functions never raise:
monitoring must not break on a strange command line. When in doubt they hide too much rather than too
little.
"""

from __future__ import annotations

import re
import urllib.parse

__all__ = ["redact_cmdline", "redact_text", "redact_url"]

MASK = "***"
# argv strings come from NUL-separated /proc data, so NUL cannot occur in them: it marks a redacted
# span until quoting is done, so that the mask itself is never shell-quoted.
_HOLE = "\x00"

# Name parts (after splitting on - _ . and camelCase) that mark a secret on their own...
_SECRET_PARTS = frozenset({
    "pass", "passwd", "password", "passphrase", "token", "secret", "auth", "oauth", "authorization",
    "credential", "credentials", "creds", "cookie", "apikey", "accesskey", "privatekey", "secretkey",
    "storepass", "keypass",  # Java keytool
})
# ...or as the end of a glued part ("hftoken", "dbpassword", "clientsecret"). Not "pass" ("bypass").
_SECRET_SUFFIXES = ("token", "password", "passwd", "secret", "apikey", "accesskey", "privatekey",
                    "credential", "credentials", "passphrase")
# Two adjacent parts that mark a secret: API_KEY, AWS_SECRET_ACCESS_KEY, --private-key.
_SECRET_PAIRS = frozenset({
    ("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"), ("signing", "key"),
    ("encryption", "key"), ("master", "key"), ("account", "key"), ("session", "key"),
})
# A last part that makes the value a reference to the secret, not the secret: --token-file PATH.
_REFERENCE_SUFFIXES = frozenset({"file", "path", "dir", "env", "type", "name", "url", "length", "len",
                                 "size", "count", "limit", "budget", "timeout", "ttl", "jar"})
# A first part that makes the flag a switch: --use-auth-token, --no-auth (no value follows).
_SWITCH_PREFIXES = frozenset({"no", "use", "enable", "disable", "skip", "require", "with", "without"})

_SPACE = re.compile(r"\s")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NAME_SPLIT = re.compile(r"[-_.]+")

_FLAG = re.compile(r"^(-{1,2})([A-Za-z][\w.\-]*)(?:(=)(.*))?$", re.S)
_ASSIGN = re.compile(r"^([A-Za-z_][\w.\-]*)=(.*)$", re.S)

# Well-known token shapes, anywhere in a string.
_TOKENS = re.compile(
    r"(?<![A-Za-z0-9_])(?:"
    r"hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{20,}"  # GitHub classic tokens
    r"|github_pat_[A-Za-z0-9_]{20,}"  # GitHub fine-grained tokens
    r"|sk-(?:[A-Za-z0-9_\-]{20,})"  # OpenAI, Anthropic (sk-ant-...), project keys (sk-proj-...)
    r"|xox[abposr]-[A-Za-z0-9\-]{10,}"  # Slack
    r"|(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])"  # AWS access key ids
    r"|glpat-[A-Za-z0-9_\-]{20,}"  # GitLab
    r"|npm_[A-Za-z0-9]{30,}"  # npm
    r"|wandb_v1_[A-Za-z0-9_]{20,}"  # Weights & Biases (new format)
    r")"
)
_BEARER = re.compile(r"(?i)\b((?:bearer|authorization:\s*basic)\s+)([A-Za-z0-9._~+/=\-]{6,})")
# The password runs from the first ':' of the userinfo to the LAST '@' before the path: unencoded '@'
# (and '?', '#') in passwords are common (mongodb://u:pa@ss@h/db). Greedy, then back to that '@'.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^/\s:]*):([^/\s]+)@")
# key=value inside a longer string: query strings, libpq conninfo, shell snippets. Keys are checked
# with the same name rules as flags.
_INLINE_ASSIGN = re.compile(r"(?<![\w\-])(-{0,2}[A-Za-z_][\w.\-]*)=([^\s&;'\"]+)")
# A flag followed by whitespace inside a longer string; the word after a secret one is its value, even
# when it starts with '-' (scanned by _flag_holes, so that a value is never taken for the next flag).
_INLINE_FLAG = re.compile(r"(?<!\S)(-{1,2}[A-Za-z][\w.\-]*)(?=\s)")
_INLINE_VALUE = re.compile(r"\s+(\S+)")
_SIGNATURE = re.compile(r"(?i)([?&](?:x-amz-signature|x-amz-security-token|sig|signature|x-goog-signature)=)"
                        r"[^&\s#]+")


# HTTP headers (`curl -H 'X-Api-Key: v'`, `wget --header=...`, httpie `Cookie:v`). A name part marks a
# secret header when it ends with one of these words (apikey, authtoken, setcookie) or starts with auth
# (Authorization, Proxy-Authorization, Authentication), besides the flag name rules.
_HEADER_WORD = re.compile(r"(?:key|token|secret|password|passwd|cookie|session|credential)s?$|^auth(?!ors?$)")
# One argv element that is a whole header: the value is everything after the colon.
_HEADER_ARG = re.compile(r"([A-Za-z][\w\-]*):[ \t]*(.*)", re.S)
# A header inside a longer string: a whole name (or glued to -H), not a URL's userinfo
# (https://x-access-token:T@host is _USERINFO's).
_HEADER_TEXT = re.compile(r"(?:(?<=-H)|(?<![\w\-]))(?<!//)([A-Za-z][\w\-]*):[ \t]*")
# Where a header value inside a longer string ends: at its closing quote when the header opens with one
# ("-H 'Cookie: a=1; b=2'"), else at any quote or the end of the line (an unquoted header in a rewritten
# argv: when in doubt, hide the rest of the line).
_HEADER_END = {"'": re.compile(r"['\r\n]"), '"': re.compile(r'["\r\n]'), "": re.compile(r"['\"\r\n]")}
# Authorization values keep their scheme word (any scheme: Bearer, Basic, Token, Digest, AWS4-HMAC-SHA256).
_AUTH_VALUE = re.compile(r"([A-Za-z][\w.\-]*)([ \t]+)\S.*", re.S)
_AUTH_SCHEMES = frozenset({"basic", "bearer", "token", "digest", "negotiate", "ntlm"})

# user:password after -u/--user (curl), -U/--proxy-user (curl's proxy): the user is kept. Attached short
# form only with a plain user name, so that `-use_gpu:1`-like words are less likely to be taken.
_USER_FLAGS = frozenset({"-u", "-U", "--user", "--proxy-user"})
_USER_CLUSTER = re.compile(r"-[A-Za-z]+u")  # curl -su alice:pw
_USER_ARG = re.compile(r"(-[uU]=?[^:=/\s]*|--(?:proxy-)?user=[^:]*):(.+)", re.S)
_USER_TEXT = re.compile(
    r"(?<!\S)(?:-[uU][ \t]*|--(?:proxy-)?user(?:[ \t]+|=))"
    r"(?:'[^:'\r\n]*:([^'\r\n]+)|\"[^:\"\r\n]*:([^\"\r\n]+)|[^\s:'\"]*:([^\s'\"]+))"
)

# MySQL/MariaDB clients take the password glued to -p (-pVALUE); a separate word after -p is the database.
# -p means other things elsewhere (ports, paths), so only after one of these programs.
_MYSQL_PROGS = frozenset({
    "mysql", "mysqldump", "mysqladmin", "mariadb",
    "mysqlimport", "mysqlcheck", "mysqlshow", "mysqlslap", "mysqlpump", "mysqlbinlog",
    "mariadb-dump", "mariadb-admin", "mariadb-import", "mariadb-check", "mariadb-show", "mariadb-slap",
    "mariadb-binlog",
})
_MYSQL_TEXT = re.compile(
    r"(?<![\w.\-])(?:" + "|".join(sorted(map(re.escape, _MYSQL_PROGS), key=len, reverse=True)) + r")(?![\w.\-:/])"
)
_MYSQL_P_TEXT = re.compile(r"(?<![^\s'\"])-p(?:'[^'\r\n]*'|\"[^\"\r\n]*\"|[^\s'\"])+")
_CMD_END = re.compile(r"[;|&\r\n]")

# What the next argv element is, after the current one.
_NEXT_PLAIN = 0  # nothing special
_NEXT_VALUE = 1  # the value of a secret flag: hidden whatever it looks like (`--password -x`)
_NEXT_WORD = 2  # a word after Bearer/Basic: hidden unless it is a flag
_NEXT_USER = 3  # user:password after -u/--user

# For quoting: the characters shlex.quote leaves unquoted, plus the hole marker.
_UNSAFE = re.compile(r"[^\w@%+=:,./\-\x00]", re.ASCII)


def _name_parts(name: str) -> list[str]:
    return [p for p in _NAME_SPLIT.split(_CAMEL.sub("_", name).lower()) if p]


def _is_secret_name(name: str, *, as_flag: bool = False) -> bool:
    """Whether a flag or variable name (without leading dashes) names a secret value."""
    parts = _name_parts(name)
    if not parts or parts[-1] in _REFERENCE_SUFFIXES:
        return False
    if as_flag and parts[0] in _SWITCH_PREFIXES:
        return False
    for i, part in enumerate(parts):
        if part in _SECRET_PARTS or part.endswith(_SECRET_SUFFIXES):
            return True
        if i and (parts[i - 1], part) in _SECRET_PAIRS:
            return True
    return False


def _inline_assign(m: re.Match[str]) -> str:
    key = m.group(1).lstrip("-")
    if _is_secret_name(key):
        return f"{m.group(1)}={_HOLE}"
    return m.group(0)


def _flag_holes(s: str) -> str:
    """Hide the word after each secret-looking flag in a string holding several words."""
    out: list[str] = []
    last = pos = 0
    while (m := _INLINE_FLAG.search(s, pos)) is not None:
        pos = m.end()
        if not _is_secret_name(m.group(1).lstrip("-"), as_flag=True):
            continue
        v = _INLINE_VALUE.match(s, pos)
        if v is None:
            continue
        out.append(s[last:v.start(1)])
        out.append(_HOLE)
        last = pos = v.end()
    if not out:
        return s
    out.append(s[last:])
    return "".join(out)


def _is_secret_header(name: str) -> bool:
    return any(_HEADER_WORD.search(p) for p in _name_parts(name)) or _is_secret_name(name)


def _header_value_holes(name: str, value: str) -> str:
    """The value of secret header `name`, hidden: all of it, or all but the scheme for Authorization."""
    if name.lower().endswith("authorization"):
        m = _AUTH_VALUE.fullmatch(value)
        if m is not None:
            return value[:m.end(2)] + _HOLE
    return _HOLE


def _header_holes(s: str) -> str:
    """Hide the values of secret-looking `Name: value` headers inside a longer string."""
    out: list[str] = []
    last = pos = 0
    while (m := _HEADER_TEXT.search(s, pos)) is not None:
        pos = m.end()
        name = m.group(1)
        if not _is_secret_header(name):
            continue
        start = m.start()
        quote = s[start - 1] if start and s[start - 1] in "'\"" else ""
        e = _HEADER_END[quote].search(s, pos)
        end = e.start() if e is not None else len(s)
        value = s[pos:end]
        if not value.strip():
            continue
        out.append(s[last:pos])
        out.append(_header_value_holes(name, value))
        last = pos = end
    if not out:
        return s
    out.append(s[last:])
    return "".join(out)


def _user_text(m: re.Match[str]) -> str:
    g = next(i for i in (1, 2, 3) if m.start(i) >= 0)
    whole, base = m.group(0), m.start()
    return whole[:m.start(g) - base] + _HOLE + whole[m.end(g) - base:]


def _mysql_holes(s: str) -> str:
    """Hide -pPASSWORD after a MySQL/MariaDB client name, up to the end of that command."""
    pos = 0
    while (m := _MYSQL_TEXT.search(s, pos)) is not None:
        e = _CMD_END.search(s, m.end())
        end = e.start() if e is not None else len(s)
        seg = _MYSQL_P_TEXT.sub("-p" + _HOLE, s[m.end():end])
        s = s[:m.end()] + seg + s[end:]
        pos = m.end() + len(seg)
    return s


def _holes(s: str) -> str:
    """Replace secrets inside one string with the hole marker."""
    s = _TOKENS.sub(_HOLE, s)
    if "://" in s:
        s = _USERINFO.sub(r"\1:" + _HOLE + "@", s)
    if ":" in s:
        s = _header_holes(s)
    if "=" in s:
        s = _INLINE_ASSIGN.sub(_inline_assign, s)
        if "?" in s or "&" in s:
            s = _SIGNATURE.sub(r"\1" + _HOLE, s)
    if " " in s or "\t" in s:
        # One string holding a whole command line (a process that rewrote its argv) or a header.
        s = _BEARER.sub(r"\1" + _HOLE, s)
        if "-" in s:
            s = _flag_holes(s)
    if ":" in s and ("-u" in s or "-U" in s):
        s = _USER_TEXT.sub(_user_text, s)
    if "-p" in s:
        s = _mysql_holes(s)
    return s


def _arg_holes(arg: str, mysql: bool = False) -> tuple[str, int]:
    """Redact one argv element. Returns it and what the next element is (one of the _NEXT_ values).

    `mysql`: a MySQL/MariaDB client came before, so `-pVALUE` is a password.
    """
    if mysql and arg.startswith("-p") and len(arg) > 2:
        return "-p" + _HOLE, _NEXT_PLAIN
    if arg in _USER_FLAGS or _USER_CLUSTER.fullmatch(arg) is not None:
        return arg, _NEXT_USER
    m = _USER_ARG.fullmatch(arg)
    if m is not None:
        return f"{m.group(1)}:{_HOLE}", _NEXT_PLAIN
    m = _FLAG.match(arg)
    if m is not None:
        dashes, name, eq, value = m.groups()
        if _is_secret_name(name, as_flag=eq is None):
            if eq is None:
                return arg, _NEXT_VALUE
            return f"{dashes}{name}={_HOLE if value else ''}", _NEXT_PLAIN
    else:
        m = _ASSIGN.match(arg)
        # With whitespace in the value this is more likely a `sh -c` script than one variable:
        # leave it to _holes, which hides each secret assignment inside it.
        if m is not None and m.group(2) and not _SPACE.search(m.group(2)) and _is_secret_name(m.group(1)):
            return f"{m.group(1)}={_HOLE}", _NEXT_PLAIN
        m = _HEADER_ARG.fullmatch(arg)
        if m is not None and m.group(2).strip() and _is_secret_header(m.group(1)):
            name, value = m.groups()
            if name.lower().endswith("authorization") and value.strip().lower() in _AUTH_SCHEMES:
                return arg, _NEXT_WORD  # -H 'Authorization: Bearer' TOKEN
            return arg[:m.start(2)] + _header_value_holes(name, value), _NEXT_PLAIN
    low = arg.lower()
    next_secret = low in ("bearer", "basic", "authorization:") or low.endswith((" bearer", ": basic"))
    return _holes(arg), _NEXT_WORD if next_secret else _NEXT_PLAIN


def _user_holes(arg: str) -> tuple[str, int] | None:
    """The value after -u/--user: `user:password` with the password hidden, or None if it is not one."""
    if arg.startswith("-"):
        return None
    user, colon, password = arg.partition(":")
    if not colon:
        return None
    return f"{user}:{_HOLE if password else ''}", _NEXT_PLAIN


def _quote(s: str) -> str:
    if not s:
        return "''"
    if _UNSAFE.search(s) is None:
        return s
    return "'" + s.replace("'", "'\"'\"'") + "'"


def redact_text(s: str) -> str:
    """`s` with secrets (token shapes, URL passwords, secret-looking key=value, Bearer) as ``***``.

    >>> redact_text("HF_TOKEN=abc python x.py")
    'HF_TOKEN=*** python x.py'
    """
    try:
        if not isinstance(s, str):
            s = str(s)
        return _holes(s.replace(_HOLE, "")).replace(_HOLE, MASK)
    except Exception:
        return MASK


def redact_cmdline(argv: list[str]) -> str:
    """Join `argv` into one display string, shell-quoted like `shlex.join`, with secrets as ``***``.

    Values of secret-looking flags (``--password x``, even ``--password -x``; ``--api-key=x``),
    secret-looking ``KEY=VALUE`` arguments and ``Name: value`` headers (Authorization keeps its scheme),
    ``-u user:password`` passwords, ``mysql -pPASSWORD``, passwords in URLs and well-known token shapes
    are hidden.

    >>> redact_cmdline(["curl", "-H", "Authorization: Bearer abcdef123", "https://x.org"])
    "curl -H 'Authorization: Bearer ***' https://x.org"
    """
    out: list[str] = []
    try:
        nxt = _NEXT_PLAIN
        mysql = False
        for raw in argv or ():
            try:
                arg = (raw if isinstance(raw, str) else str(raw)).replace(_HOLE, "")
                done = None
                if nxt == _NEXT_VALUE and arg:
                    done = _HOLE, _NEXT_PLAIN
                elif nxt == _NEXT_WORD and arg and not arg.startswith("-"):
                    done = _HOLE, _NEXT_PLAIN
                elif nxt == _NEXT_USER:
                    done = _user_holes(arg)
                red, nxt = done if done is not None else _arg_holes(arg, mysql)
                out.append(_quote(red).replace(_HOLE, MASK))
                # The client may come after a wrapper (sudo, env, docker exec): look at every program word.
                if not mysql and not arg.startswith("-") and arg.rpartition("/")[2] in _MYSQL_PROGS:
                    mysql = True
            except Exception:
                out.append(MASK)
                nxt = _NEXT_PLAIN
    except Exception:
        out.append(MASK)
    return " ".join(out)


def redact_url(url: str) -> str:
    """A URL to show (logs, messages) where a service's secret may sit anywhere: its password, query
    values and every path segment but the first hidden (a Slack webhook's secret is its path).

    >>> redact_url("https://user:pw@hooks.slack.com/services/T0/B0/XYZ?token=abc")
    'https://user:***@hooks.slack.com/services/***?token=***'
    """
    try:
        p = urllib.parse.urlsplit(url)
        host = p.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        if p.port:
            host = f"{host}:{p.port}"
        if p.username is not None:
            host = f"{p.username}:{MASK}@{host}" if p.password is not None else f"{p.username}@{host}"
        segs = [s for s in p.path.split("/") if s]
        lead = "/" if p.path.startswith("/") else ""  # 'nosch' stays 'nosch' in "must be a URL, not ..."
        path = (lead + segs[0] + (f"/{MASK}" if len(segs) > 1 else "")) if segs else p.path
        query = "&".join(f"{k}={MASK}" for k, _ in urllib.parse.parse_qsl(p.query, keep_blank_values=True))
        return urllib.parse.urlunsplit((p.scheme, host, path, query, ""))
    except ValueError:
        return "<a URL that cannot be parsed>"
