"""Hide secrets in command lines before they are shown, stored or exported.

GPU jobs are often started with credentials on the command line (``--hf-token hf_...``,
``WANDB_API_KEY=... python train.py``, ``s3://`` or ``https://user:pass@`` URLs). gpuscope shows
command lines in the TUI, the web page and exported labels, so every command line goes through here.

    >>> redact_cmdline(["python", "train.py", "--hf-token", "abc123", "--lr", "0.1"])
    'python train.py --hf-token *** --lr 0.1'
    >>> redact_text("https://user:hunter2@example.com/repo.git")
    'https://user:***@example.com/repo.git'

Both functions never raise: monitoring must not break on a strange command line. When in doubt they
hide too much rather than too little.
"""

from __future__ import annotations

import re

__all__ = ["redact_cmdline", "redact_text"]

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
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*):([^/\s@]+)@")
# key=value inside a longer string: query strings, libpq conninfo, shell snippets. Keys are checked
# with the same name rules as flags.
_INLINE_ASSIGN = re.compile(r"(?<![\w\-])(-{0,2}[A-Za-z_][\w.\-]*)=([^\s&;'\"]+)")
_INLINE_FLAG = re.compile(r"(?<!\S)(-{1,2}[A-Za-z][\w.\-]*)(\s+)([^\s\-]\S*)")
_SIGNATURE = re.compile(r"(?i)([?&](?:x-amz-signature|x-amz-security-token|sig|signature|x-goog-signature)=)"
                        r"[^&\s#]+")

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


def _inline_flag(m: re.Match[str]) -> str:
    if _is_secret_name(m.group(1).lstrip("-"), as_flag=True):
        return f"{m.group(1)}{m.group(2)}{_HOLE}"
    return m.group(0)


def _holes(s: str) -> str:
    """Replace secrets inside one string with the hole marker."""
    s = _TOKENS.sub(_HOLE, s)
    if "://" in s:
        s = _USERINFO.sub(r"\1:" + _HOLE + "@", s)
    if "=" in s:
        s = _INLINE_ASSIGN.sub(_inline_assign, s)
        if "?" in s or "&" in s:
            s = _SIGNATURE.sub(r"\1" + _HOLE, s)
    if " " in s or "\t" in s:
        # One string holding a whole command line (a process that rewrote its argv) or a header.
        s = _BEARER.sub(r"\1" + _HOLE, s)
        if "-" in s:
            s = _INLINE_FLAG.sub(_inline_flag, s)
    return s


def _arg_holes(arg: str) -> tuple[str, bool]:
    """Redact one argv element. Returns it and whether the next element is a secret value."""
    m = _FLAG.match(arg)
    if m is not None:
        dashes, name, eq, value = m.groups()
        if _is_secret_name(name, as_flag=eq is None):
            if eq is None:
                return arg, True
            return f"{dashes}{name}={_HOLE if value else ''}", False
    else:
        m = _ASSIGN.match(arg)
        # With whitespace in the value this is more likely a `sh -c` script than one variable:
        # leave it to _holes, which hides each secret assignment inside it.
        if m is not None and m.group(2) and not _SPACE.search(m.group(2)) and _is_secret_name(m.group(1)):
            return f"{m.group(1)}={_HOLE}", False
    low = arg.lower()
    next_secret = low in ("bearer", "basic", "authorization:") or low.endswith((" bearer", ": basic"))
    return _holes(arg), next_secret


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

    Values of secret-looking flags (``--password x``, ``--api-key=x``), secret-looking ``KEY=VALUE``
    arguments, passwords in URLs and well-known token shapes are hidden.

    >>> redact_cmdline(["curl", "-H", "Authorization: Bearer abcdef123", "https://x.org"])
    "curl -H 'Authorization: Bearer ***' https://x.org"
    """
    out: list[str] = []
    try:
        next_secret = False
        for raw in argv or ():
            try:
                arg = (raw if isinstance(raw, str) else str(raw)).replace(_HOLE, "")
                if next_secret and arg and not arg.startswith("-"):
                    red, next_secret = _HOLE, False
                else:
                    red, next_secret = _arg_holes(arg)
                out.append(_quote(red).replace(_HOLE, MASK))
            except Exception:
                out.append(MASK)
                next_secret = False
    except Exception:
        out.append(MASK)
    return " ".join(out)
