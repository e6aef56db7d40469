"""Hide secrets in command lines and URLs before they are shown, stored or exported.

GPU jobs are often started with credentials on the command line (``--hf-token hf_...``,
``WANDB_API_KEY=... python train.py``, ``s3://`` or ``https://user:pass@`` URLs). gpuscope shows
command lines in the TUI, the web page and exported labels, so every command line goes through here.

    >>> redact_cmdline(["python", "train.py", "--hf-token", "abc123", "--lr", "0.1"])
    'python train.py --hf-token *** --lr 0.1'
    >>> redact_text("https://user:hunter2@example.com/repo.git")
    'https://user:***@example.com/repo.git'

What is hidden, in the families secret scanners use: values named like a secret (flags, ``KEY=value``,
environment assignments, JSON / Python / INI / YAML literals inside an argument, HTTP headers, cookies,
query parameters), URL credentials (a password, or a user that is a token), well-known token shapes
(cloud, code hosting, chat, payment, AI and package registry keys, JWTs, PEM private keys), and the
password flags of common clients (``mysql -pX``, ``sshpass -p X``, ``redis-cli -a X``, ...).
tests/test_redact_corpus.py holds the forms checked, and the look-alikes that must be kept.

`redact_url` hides more of a URL that is shown whole (a notifier's). The functions never raise:
monitoring must not break on a strange command line. When in doubt they hide too much rather than too
little.
"""

from __future__ import annotations

import functools
import re
import unicodedata
import urllib.parse
from collections.abc import Callable

__all__ = ["redact_cmdline", "redact_text", "redact_url"]

MASK = "***"
# argv strings come from NUL-separated /proc data, so NUL cannot occur in them: it marks a redacted
# span until quoting is done, so that the mask itself is never shell-quoted.
_HOLE = "\x00"

# -- names ---------------------------------------------------------------------------------------------

# Name parts (after splitting on - _ . and camelCase) that mark a secret on their own...
_SECRET_PARTS = frozenset({
    "pass", "passwd", "password", "passphrase", "passcode", "pw", "pwd", "psk", "token", "secret", "auth",
    "oauth", "authorization", "bearer", "jwt", "credential", "credentials", "creds", "cookie", "apikey",
    "accesskey", "privatekey", "secretkey", "signature", "otp", "totp",
    "storepass", "keypass",  # Java keytool
    "sshpass",
})
# ...or as the end of a glued part or of the whole name glued ("hftoken", "dbpassword", "clientsecret",
# "mot-de-passe"). Not "pass" ("bypass", "compass"). Other languages' words for password, token, secret.
_SECRET_SUFFIXES = (
    "token", "password", "passwd", "secret", "apikey", "accesskey", "privatekey", "credential",
    "credentials", "passphrase", "authkey",
    "passwort", "kennwort", "contraseña", "contrasena", "senha", "motdepasse", "wachtwoord", "parola",
    "hasło", "haslo", "lösenord", "losenord", "adgangskode", "salasana", "jelszó", "jelszo", "heslo",
    "şifre", "sifre", "parolă", "пароль", "токен", "секрет", "κωδικός", "סיסמה", "كلمةالمرور",
    "密码", "密碼", "口令", "令牌", "密钥", "秘钥", "秘密", "パスワード", "トークン", "비밀번호", "토큰",
)
# Words for password of more than one part ("mot de passe", "palavra-passe", "kata sandi").
_GLUED = ("motdepasse", "palavrapasse", "katasandi", "contraseña", "contrasena")
# Two adjacent parts that mark a secret: API_KEY, AWS_SECRET_ACCESS_KEY, --private-key, --clé-api.
_KEY_WORDS = frozenset({"key", "keys", "clé", "cle", "clave", "chiave", "schlüssel", "schluessel", "ключ", "キー"})
_KEY_KINDS = frozenset({"api", "access", "private", "secret", "signing", "encryption", "master", "account",
                        "session", "client", "license", "licence", "service", "auth", "shared", "app", "storage",
                        # vendors whose key is often just VENDOR_KEY
                        "wandb", "kaggle", "openai", "anthropic", "hf", "huggingface", "cohere", "mistral", "groq",
                        "google", "gemini", "azure", "aws", "gcp", "stripe", "twilio", "sendgrid", "mapbox",
                        "datadog", "dd", "algolia", "pinecone", "replicate", "together", "deepseek", "mailgun",
                        "slack", "github", "gitlab", "sentry", "newrelic", "openrouter", "voyage", "elevenlabs",
                        "serper", "tavily", "comet", "neptune", "clearml", "xai", "fireworks", "perplexity"})
# A last part that makes the value a reference to the secret or a setting about it, not the secret:
# --token-file PATH, --auth-type basic, --password-stdin.
_REFERENCE_SUFFIXES = frozenset({
    "file", "files", "path", "dir", "env", "type", "name", "url", "uri", "length", "len", "size", "count",
    "limit", "limits", "budget", "timeout", "ttl", "jar", "stdin", "fd", "prompt", "source", "provider",
    "method", "mode", "scheme", "kind", "format", "algorithm", "algo", "header", "helper", "command", "cmd",
    "store", "backend", "endpoint", "server", "host", "port", "realm", "scope", "scopes", "expiry",
    "expires", "lifetime", "version", "policy", "required", "level", "strength", "cache", "location",
    "txt", "json", "yaml", "yml", "toml", "ini", "cfg", "conf", "pem", "crt", "cer", "der", "p12", "pfx",
    "jks", "gpg", "asc", "py", "sh", "log", "csv",
    "dropout", "ratio", "embedding", "embeddings", "merging", "pruning", "weight", "weights", "threshold",
    "interval",
})
# A first part that makes the flag a switch: --use-auth-token, --no-auth (no value follows).
_SWITCH_PREFIXES = frozenset({"no", "use", "enable", "disable", "skip", "require", "with", "without", "allow",
                              "ignore", "show", "print", "trust", "save"})
# Tokenizer tokens are not secrets: --pad-token '<pad>', --eos-token-id 2.
_VOCAB_TOKENS = frozenset({"pad", "eos", "bos", "unk", "sep", "mask", "cls", "start", "end", "stop", "special",
                           "image", "audio", "video", "vision", "placeholder", "think", "begin", "decoder",
                           "sot", "eot", "padding"})
# --pass-at-k 10 (code evals), --pass-rate, --pass-through: not a password.
_PASS_NOT_SECRET = frozenset({"at", "rate", "through", "thru", "count", "fail", "k", "n", "filter"})
# A value that is a directory (PWD=/home/me is the shell's working directory, not a password).
_PATHLIKE = re.compile(r"[/~.]|\$\{?PWD\b|$")

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NAME_SPLIT = re.compile(r"[-_.\s]+")
_FORMAT_CHARS = re.compile("[\u00ad\u200b-\u200f\u2060-\u2064\ufeff]")
# Cheap first look: a string in which none of these occur has no secret-looking name in it.
_KEYWORDS = ("pass", "pw", "psk", "tok", "secret", "auth", "key", "cred", "cookie", "sess", "sig", "jwt", "bearer",
             "priv", "otp", "identified", "kennwort", "senha", "parol", "wachtwoord", "sifre", "heslo", "haslo", "jelsz",
             "contras", "losen", "adgang", "salasana", "sandi")


# The first letters as a lookahead: 5x faster than the plain alternation (or a loop of `in`).
_KEYWORD = re.compile("(?=[" + "".join(sorted({k[0] for k in _KEYWORDS})) + "])(?:" + "|".join(_KEYWORDS) + ")")


def _has_keyword(s: str) -> bool:
    return _KEYWORD.search(s.lower()) is not None


def _norm(name: str) -> str:
    """NFKC (full-width letters), without invisible format characters (soft hyphen, zero-width space)."""
    if name.isascii():
        return name
    return _FORMAT_CHARS.sub("", unicodedata.normalize("NFKC", name))


def _name_parts(name: str) -> list[str]:
    return [p for p in _NAME_SPLIT.split(_CAMEL.sub("_", _norm(name)).lower()) if p]


def _is_secret_name(name: str, *, as_flag: bool = False, value: str | None = None) -> bool:
    """Whether a flag or variable name (without leading dashes) names a secret value. With `value`, a
    name that is secret only as 'pwd' is not when the value is a directory (PWD=/home/me)."""
    kind = _name_kind(name, as_flag)
    if kind == _PWD:
        return value is None or _PATHLIKE.match(value) is None
    return kind == _SECRET


_PLAIN, _SECRET, _PWD = 0, 1, 2


@functools.lru_cache(maxsize=4096)
def _name_kind(name: str, as_flag: bool) -> int:
    """_SECRET, _PLAIN, or _PWD for a name secret only as 'pwd' (also the shell's working directory)."""
    parts = _name_parts(name)
    if not parts or parts[-1] in _REFERENCE_SUFFIXES:
        return _PLAIN
    if as_flag and parts[0] in _SWITCH_PREFIXES:
        return _PLAIN
    pwd = False
    for i, part in enumerate(parts):
        if part in ("token", "tokens") and i and parts[i - 1] in _VOCAB_TOKENS:
            continue
        if part == "pass" and i + 1 < len(parts) and parts[i + 1] in _PASS_NOT_SECRET:
            continue
        if part in ("pwd", "oldpwd"):
            pwd = True
        elif (part in _SECRET_PARTS or part.endswith(_SECRET_SUFFIXES)
              or i and ((parts[i - 1] in _KEY_KINDS and part in _KEY_WORDS)
                        or (parts[i - 1] in _KEY_WORDS and part in _KEY_KINDS))):
            return _SECRET
    if len(parts) > 1 and "".join(parts).endswith(_GLUED):
        return _SECRET
    return _PWD if pwd else _PLAIN


# -- shapes --------------------------------------------------------------------------------------------

# Well-known token shapes, anywhere in a string: a prefix a vendor puts on its keys and the key's
# alphabet. Written from the vendors' documented formats (the families gitleaks, trufflehog and
# detect-secrets look for).
_TOKENS = re.compile(
    r"(?<![A-Za-z0-9_])(?:"
    r"hf_[A-Za-z0-9]{20,}|api_org_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"  # GitHub
    r"|gl(?:pat|dt|ptt|rt|cbt|imt|agent|oas|ffct|soat|ft)-[A-Za-z0-9_\-]{20,}|GR1348941[A-Za-z0-9_\-]{20,}"  # GitLab
    r"|xox[abposre]-[A-Za-z0-9\-]{10,}|xapp-\d-[A-Za-z0-9\-]{10,}"  # Slack
    r"|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{10,}|whsec_[A-Za-z0-9]{20,}"  # Stripe
    r"|(?P<sk>sk-[A-Za-z0-9_\-]{20,})"  # OpenAI, Anthropic (sk-ant-), DeepSeek, OpenRouter (sk-or-): checked below
    r"|(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])[A-Z0-9]{16}(?![A-Za-z0-9])"  # AWS access key ids
    r"|AIza[0-9A-Za-z_\-]{35}|ya29\.[0-9A-Za-z_\-]{20,}|GOCSPX-[A-Za-z0-9_\-]{20,}"  # Google
    r"|npm_[A-Za-z0-9]{30,}|pypi-[A-Za-z0-9_\-]{40,}|rubygems_[a-f0-9]{40,}|oy2[a-z0-9]{43}"  # registries
    r"|CLOJARS_[a-z0-9]{40,}|dckr_pat_[A-Za-z0-9_\-]{20,}|AKCp[A-Za-z0-9]{60,}|cmVmdGtu[A-Za-z0-9]{50,}"
    r"|SG\.[A-Za-z0-9_\-]{16,}\.[A-Za-z0-9_\-]{16,}"  # SendGrid
    r"|SK[0-9a-fA-F]{32}(?![A-Za-z0-9])"  # Twilio API keys
    r"|dapi[a-f0-9]{32}(?:-\d+)?|dose[a-f0-9]{32}"  # Databricks
    r"|wandb_v1_[A-Za-z0-9_]{20,}"  # Weights & Biases
    r"|key-[0-9a-f]{32}(?![0-9a-f])|[0-9a-f]{32}-us\d{1,2}(?![0-9])"  # Mailgun, Mailchimp
    r"|do[opr]_v1_[a-f0-9]{64}|shp(?:at|ss|ca|pa)_[a-fA-F0-9]{32}"  # DigitalOcean, Shopify
    r"|ATATT3[A-Za-z0-9_\-=]{20,}|PMAK-[a-f0-9]{24}-[a-f0-9]{34}"  # Atlassian, Postman
    r"|dp\.(?:st|ct|sa|scim|audit|pt)\.[A-Za-z0-9_\-.]{20,}|hv[sbr]\.[A-Za-z0-9_\-]{20,}"  # Doppler, Vault
    r"|[A-Za-z0-9]{14}\.atlasv1\.[A-Za-z0-9_\-=]{40,}"  # Terraform Cloud
    r"|glc_[A-Za-z0-9+/=_\-]{20,}|glsa_[A-Za-z0-9]{32}_[A-Fa-f0-9]{8}"  # Grafana
    r"|NRAK-[A-Z0-9]{27}|sntry[su]_[A-Za-z0-9+/=_\-]{20,}"  # New Relic, Sentry
    r"|lin_api_[A-Za-z0-9]{40}|ntn_[A-Za-z0-9]{40,}|secret_[A-Za-z0-9]{43}(?![A-Za-z0-9])"  # Linear, Notion
    r"|AGE-SECRET-KEY-1[0-9A-Z]{58}"  # age
    r"|r8_[A-Za-z0-9]{30,}|gsk_[A-Za-z0-9]{40,}|pplx-[A-Za-z0-9]{40,}|xai-[A-Za-z0-9]{40,}"  # AI APIs
    r"|fw_[A-Za-z0-9]{20,}|tvly-[A-Za-z0-9\-]{20,}|lsv2_(?:pt|sk)_[a-f0-9]{32}_[a-f0-9]{10}|pcsk_[A-Za-z0-9_]{40,}"
    r"|sbp_[a-f0-9]{40}|pscale_(?:tkn|pw|oauth)_[A-Za-z0-9_\-.=]{30,}|HRKU-[A-Za-z0-9_\-]{20,}"
    r"|sq0(?:atp|csp)-[A-Za-z0-9_\-]{22,}|EAAA[A-Za-z0-9_\-]{60}|fm[12]_[A-Za-z0-9+/=_\-]{40,}"  # Square, Fly
    r"|LTAI[A-Za-z0-9]{12,20}(?![A-Za-z0-9])|AKID[A-Za-z0-9]{13,40}(?![A-Za-z0-9])"  # Alibaba, Tencent
    r"|[A-Za-z0-9_~.]{3}\dQ~[A-Za-z0-9_~.\-]{31,34}"  # Azure AD client secrets
    r"|\d{8,10}:AA[A-Za-z0-9_\-]{33}"  # Telegram bots
    r"|[MN][A-Za-z\d]{23,25}\.[\w\-]{6}\.[\w\-]{27,38}"  # Discord bots
    r"|eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*"  # JSON Web Tokens
    r")"
)
_RUN = re.compile(r"[A-Za-z0-9]{16,}")


def _token(m: re.Match[str]) -> str:
    # sk- is also the start of words (sk-learn-tutorial-notebook-v2): a key has digits, and a long random
    # run or mixed case.
    sk = m.group("sk")
    if sk is not None and (sum(c.isdigit() for c in sk) < 2 or _RUN.search(sk) is None
                           and (sk.islower() or sk.isupper())):
        return sk
    return _HOLE


# A PEM private key (RSA, EC, OpenSSH, PGP, encrypted...), to its END line or, cut short, to the end.
_PEM = re.compile(r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----.*?(?:-----END[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|$)",
                  re.S)
# Webhook URLs whose secret is their path.
_WEBHOOK = re.compile(
    r"(https?://(?:hooks\.slack\.com/(?:services|workflows|triggers)/|(?:[\w-]+\.)?discord(?:app)?\.com/api/webhooks/"
    r"|[\w.-]+\.webhook\.office\.com/webhookb2/|api\.telegram\.org/bot))[^\s'\"]+")

# -- URLs ----------------------------------------------------------------------------------------------

# The password runs from the first ':' of the userinfo to the LAST '@' before the path: unencoded '@'
# (and '?', '#') in passwords are common (mongodb://u:pa@ss@h/db). Greedy, then back to that '@'.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)([^/\s:]*):([^/\s]+)@")
# A user without a password: a token used as the user (https://TOKEN@github.com, a Sentry DSN's key).
_USER_ONLY = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)([^/\s:@?#'\"]+)@")


def _token_like(user: str) -> bool:
    """A user name that is rather a key: long, and mixed letters and digits (not 'git', 'x-access-token')."""
    if len(user) < 16:
        return False
    digits = sum(c.isdigit() for c in user)
    return len(user) >= 32 or (digits >= 2 and len(user) - digits >= 2)


def _userinfo(m: re.Match[str]) -> str:
    # The user goes too when it is the token (GitHub's TOKEN:x-oauth-basic@).
    user = _HOLE if _token_like(urllib.parse.unquote(m.group(2))) else m.group(2)
    return f"{m.group(1)}{user}:{_HOLE}@"


def _user_only(m: re.Match[str]) -> str:
    return m.group(1) + _HOLE + "@" if _token_like(urllib.parse.unquote(m.group(2))) else m.group(0)


_SIGNATURE = re.compile(r"(?i)([?&;](?:x-amz-signature|x-amz-security-token|sig|signature|x-goog-signature"
                        r"|x-goog-credential|code|key)=)[^&\s#'\"]+")

# -- name: value pairs inside a longer string ----------------------------------------------------------

# key=value: query strings, libpq conninfo, shell snippets, connection strings. Keys are checked with
# the same name rules as flags.
_INLINE_ASSIGN = re.compile(r"(?<![\w\-])(-{0,2}[^\W\d][\w.\-]*)=([^\s&;'\"]+)")
# A quoted key and its value: JSON {"password": "x"}, Python {'api_key': 'x'}, os.environ['TOKEN'] = 'x',
# Ruby 'token' => 'x'.
_QUOTED_KEY = re.compile(r"""(["'])([^"'\s\\:=,{}]{1,80})\1\]?[ \t]*(?:=>|[:=])[ \t]*""")
# A bare key and a quoted value, or an INI-style spaced '=': password='x', PASSWORD="x", password = x.
_BARE_KEY = re.compile(r"""(?<![\w.\-])([^\W\d][\w.\-]*)(?:[ \t]*(?:=>?|:)[ \t]*(?=["'])|[ \t]+=[ \t]*(?=[^\s=]))""")
_BARE_VALUE = re.compile(r"""[^\s,;}\])'"&]+""")
_XML = re.compile(r"<([A-Za-z][\w\-.]*)>([^<]+)</\1>")
_SQL = re.compile(r"""(?i)\b(identified\s+by|password)\s+('[^']*'|"[^"]*")""")
# A flag followed by whitespace inside a longer string; the word after a secret one is its value, even
# when it starts with '-' (scanned by _flag_holes, so that a value is never taken for the next flag).
_INLINE_FLAG = re.compile(r"(?<!\S)(-{1,2}[^\W\d][\w.\-]*)(?=\s)")
_INLINE_VALUE = re.compile(r"\s+(\S+)")
_BEARER = re.compile(r"(?i)\b((?:bearer|authorization:\s*basic)\s+)([A-Za-z0-9._~+/=\-]{6,})")

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

# -- clients' own password flags -------------------------------------------------------------------------

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

_MONGO = frozenset({"mongo", "mongosh", "mongodump", "mongorestore", "mongoexport", "mongoimport", "mongostat",
                    "mongotop", "mongofiles"})
_LDAP = frozenset({"ldapsearch", "ldapmodify", "ldapadd", "ldapdelete", "ldapwhoami", "ldappasswd",
                   "ldapcompare", "ldapmodrdn", "ldapexop"})
_REGISTRY_CLIS = frozenset({"docker", "podman", "nerdctl", "buildah", "helm", "oras", "skopeo", "crane", "regctl"})
_SMB = frozenset({"smbclient", "rpcclient", "smbget", "smbcacls", "smbmap", "mount.cifs"})
_FREERDP = frozenset({"xfreerdp", "wlfreerdp", "sdl-freerdp", "xfreerdp3", "sdl-freerdp3"})
_ORACLE = frozenset({"sqlplus", "rman", "expdp", "impdp", "exp", "imp", "dgmgrl", "sqlldr"})
# How a client's flag carries its password: "glued" (-pVALUE only; -p alone prompts), "next" (the next
# word), "both", "user%" / "user," (user%password after the flag: the user is kept), "cookie" (the next
# word when it is name=value, not a cookie file).
# flag -> [(programs, verb that must have been seen or "", how)]
_CLIENT_FLAGS: dict[str, list[tuple[frozenset[str], str, str]]] = {
    "-p": [(_MYSQL_PROGS | {"7z", "7za", "7zr", "rar", "unrar"}, "", "glued"), (frozenset({"sshpass"}), "", "both"),
           (_MONGO | {"rdesktop", "twine"}, "", "next"), (_REGISTRY_CLIS | {"az"}, "login", "next")],
    "-a": [(frozenset({"redis-cli", "keydb-cli", "valkey-cli"}), "", "both")],
    "-w": [(_LDAP, "", "next")],
    "-P": [(frozenset({"sqlcmd", "bcp"}), "", "both"),
           (frozenset({"zip", "unzip", "zipcloak", "mosquitto_pub", "mosquitto_sub", "mosquitto_rr", "ssh-keygen"}),
            "", "next")],
    "-N": [(frozenset({"ssh-keygen"}), "", "next")],
    "-passin": [(frozenset({"openssl"}), "", "pass:")], "-passout": [(frozenset({"openssl"}), "", "pass:")],
    "-pass": [(frozenset({"openssl"}), "", "pass:")], "-k": [(frozenset({"openssl"}), "", "next")],
    "-U": [(_SMB, "", "user%")], "--user": [(_SMB, "", "user%")],
    "-u": [(frozenset({"lftp"}), "", "user,")],
    "-b": [(frozenset({"curl"}), "", "cookie")],
    "/p:": [(_FREERDP, "", "glued")], "/password:": [(_FREERDP, "", "glued")],
    "password": [(frozenset({"nmcli"}), "", "next")],
}
_GLUED_FLAGS = ("-p", "-a", "-P", "-U", "/p:", "/password:")
_CLIENTS = frozenset().union(*(progs for rules in _CLIENT_FLAGS.values() for progs, _, _ in rules))
# Verbs after which the next plain word is the secret: `wandb login KEY`, `ngrok authtoken KEY`.
_SECRET_VERBS: dict[str, frozenset[str]] = {
    "login": frozenset({"wandb", "vault"}), "authtoken": frozenset({"ngrok"}), "add-authtoken": frozenset({"ngrok"}),
}
# After these words, a secret name given as a plain word takes the next word as its value:
# `aws configure set aws_secret_access_key X`, `git config --global github.token X`.
_CONFIG_VERBS = frozenset({"config", "configure", "set"})
_ORACLE_LOGIN = re.compile(r"([^/\s@'\"]+)/([^@\s]+)(@.*)?", re.S)

# For quoting: the characters shlex.quote leaves unquoted, plus the hole marker.
_UNSAFE = re.compile(r"[^\w@%+=:,./\-\x00]", re.ASCII)


# -- one string ------------------------------------------------------------------------------------------

def _assign_holes(s: str) -> str:
    """Hide the values of secret-named key=value pairs inside a string. The value of a key that is not a
    secret is looked into: --db-url=https://h/?access_token=X, --from-literal=password=X."""
    out: list[str] = []
    last = pos = 0
    while (m := _INLINE_ASSIGN.search(s, pos)) is not None:
        if _is_secret_name(m.group(1).lstrip("-"), value=m.group(2)):
            out += [s[last:m.start(2)], _HOLE]
            last = pos = m.end()
        else:
            pos = m.start(2)
    if not out:
        return s
    out.append(s[last:])
    return "".join(out)


def _value_span(s: str, pos: int) -> tuple[int, int] | None:
    """Where the value that starts at `pos` lies: inside its quotes, or a bare word; None if none."""
    if pos >= len(s):
        return None
    q = s[pos]
    if q in "'\"":
        i = pos + 1
        while i < len(s):
            c = s[i]
            if c == "\\":
                i += 2
                continue
            if c == q:
                break
            i += 1
        return (pos + 1, min(i, len(s))) if i > pos + 1 else None
    if q in "{[":
        return None  # a nested table: its own keys are looked at
    m = _BARE_VALUE.match(s, pos)
    return (pos, m.end()) if m is not None else None


def _literal_holes(s: str) -> str:
    """Hide the values of secret-named keys in literals inside a string (JSON, Python, INI, XML, SQL)."""
    spans: list[tuple[int, int]] = []
    for rx, group in ((_QUOTED_KEY, 2), (_BARE_KEY, 1)):
        for m in rx.finditer(s):
            span = _value_span(s, m.end())
            if span is not None and _is_secret_name(m.group(group), value=s[span[0]:span[1]]):
                spans.append(span)
    if "</" in s:
        spans += [m.span(2) for m in _XML.finditer(s) if _is_secret_name(m.group(1))]
    if "'" in s or '"' in s:
        spans += [(m.start(2) + 1, m.end(2) - 1) for m in _SQL.finditer(s) if m.end(2) - m.start(2) > 2]
    if not spans:
        return s
    out, last = [], 0
    for a, b in sorted(spans):
        if a < last:
            continue
        out += [s[last:a], _HOLE]
        last = b
    out.append(s[last:])
    return "".join(out)


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


_SHORT_PLAIN = re.compile(r"[=:@<'\"\s]")


def _holes(s: str) -> str:
    """Replace secrets inside one string with the hole marker."""
    if len(s) < 16 and _SHORT_PLAIN.search(s) is None:
        return s  # shorter than any key shape, and no name: value, URL, header or second word in it
    if "-----BEGIN" in s:
        s = _PEM.sub(_HOLE, s)
    s = _TOKENS.sub(_token, s)
    if "://" in s:
        s = _WEBHOOK.sub(r"\1" + _HOLE, s)
        s = _USERINFO.sub(_userinfo, s)
        if "@" in s:
            s = _USER_ONLY.sub(_user_only, s)
    if ("?" in s or "&" in s or ";" in s) and "=" in s:
        s = _SIGNATURE.sub(r"\1" + _HOLE, s)
    if ":" in s and ("-u" in s or "-U" in s):
        s = _USER_TEXT.sub(_user_text, s)
    if "-p" in s:
        s = _mysql_holes(s)
    if s.isascii() and not _has_keyword(s):
        return s  # no secret-looking name in it: the name rules below would find nothing
    if "'" in s or '"' in s or " =" in s or "</" in s:
        s = _literal_holes(s)
    if ":" in s:
        s = _header_holes(s)
    if "=" in s:
        s = _assign_holes(s)
    if " " in s or "\t" in s:
        # One string holding a whole command line (a process that rewrote its argv) or a header.
        s = _BEARER.sub(r"\1" + _HOLE, s)
        if "-" in s:
            s = _flag_holes(s)
    return s


# -- argv ----------------------------------------------------------------------------------------------

# What to do with the next argv element: a function of it that returns it redacted, or None when it is
# not the value expected (then it is redacted on its own).
_Next = Callable[[str], "str | None"]


def _hide_value(arg: str) -> str | None:
    """The value of a secret flag: hidden whatever it looks like (`--password -x`)."""
    return _HOLE if arg else None


def _hide_word(arg: str) -> str | None:
    """A word after Bearer/Basic: hidden unless it is a flag."""
    return _HOLE if arg and not arg.startswith("-") else None


def _hide_user(arg: str) -> str | None:
    """The value after -u/--user: `user:password` with the password hidden, or None if it is not one."""
    if arg.startswith("-"):
        return None
    user, colon, password = arg.partition(":")
    if not colon:
        return None
    return f"{user}:{_HOLE if password else ''}"


def _hide_after(sep: str) -> _Next:
    def hide(arg: str) -> str | None:
        user, found, password = arg.partition(sep)
        return f"{user}{sep}{_HOLE}" if found and password and not arg.startswith("-") else None
    return hide


def _hide_cookie(arg: str) -> str | None:
    return _HOLE if "=" in arg and not arg.startswith("-") else None


def _hide_unless_directory(arg: str) -> str | None:
    return None if _PATHLIKE.match(arg) else _hide_value(arg)


def _hide_openssl(arg: str) -> str | None:
    """openssl's pass:PASSWORD (env:VAR and file:PATH name where it is)."""
    return "pass:" + _HOLE if arg.startswith("pass:") and len(arg) > 5 else None


_HOW: dict[str, _Next] = {"next": _hide_value, "both": _hide_value, "user%": _hide_after("%"),
                          "user,": _hide_after(","), "cookie": _hide_cookie, "pass:": _hide_openssl}


def _client_flag(arg: str, words: set[str]) -> tuple[str | None, _Next | None]:
    """A client's own password flag: (the element redacted, or None) and what to do with the next one."""
    rules = _CLIENT_FLAGS.get(arg)
    if rules is not None:
        for progs, verb, how in rules:
            if how != "glued" and not progs.isdisjoint(words) and (not verb or verb in words):
                return arg, _HOW[how]
    for flag in _GLUED_FLAGS:
        if arg.startswith(flag) and len(arg) > len(flag):
            for progs, verb, how in _CLIENT_FLAGS[flag]:
                if how in ("glued", "both") and not progs.isdisjoint(words) and (not verb or verb in words):
                    return flag + _HOLE, None
                if how == "user%" and "%" in arg and not progs.isdisjoint(words):
                    return arg.partition("%")[0] + "%" + _HOLE, None
    return None, None


def _arg_holes(arg: str, words: set[str]) -> tuple[str, _Next | None]:
    """Redact one argv element. Returns it and what to do with the next element.

    `words`: the plain words (program names, verbs) seen before it when one of _CLIENTS is among them.
    """
    if words and (arg in _CLIENT_FLAGS or arg.startswith(_GLUED_FLAGS)):
        red, nxt = _client_flag(arg, words)
        if red is not None:
            return red, nxt
    if arg in _USER_FLAGS or _USER_CLUSTER.fullmatch(arg) is not None:
        return arg, _hide_user
    m = _USER_ARG.fullmatch(arg)
    if m is not None:
        return f"{m.group(1)}:{_HOLE}", None
    m = _FLAG.match(arg)
    if m is not None:
        dashes, name, eq, value = m.groups()
        if _is_secret_name(name, as_flag=eq is None, value=value):
            if eq is None:
                parts = _name_parts(name)
                return arg, _hide_unless_directory if parts and parts[-1] in ("pwd", "oldpwd") else _hide_value
            return f"{dashes}{name}={_HOLE if value else ''}", None
    else:
        m = _ASSIGN.match(arg)
        # With whitespace in the value this is more likely a `sh -c` script than one variable:
        # leave it to _holes, which hides each secret assignment inside it.
        if (m is not None and m.group(2) and not _SPACE.search(m.group(2))
                and _is_secret_name(m.group(1), value=m.group(2))):
            return f"{m.group(1)}={_HOLE}", None
        m = _HEADER_ARG.fullmatch(arg)
        if m is not None and m.group(2).strip() and _is_secret_header(m.group(1)):
            name, value = m.groups()
            if name.lower().endswith("authorization") and value.strip().lower() in _AUTH_SCHEMES:
                return arg, _hide_word  # -H 'Authorization: Bearer' TOKEN
            return arg[:m.start(2)] + _header_value_holes(name, value), None
    low = arg.lower()
    if low in ("bearer", "basic", "authorization:") or low.endswith((" bearer", ": basic")):
        return _holes(arg), _hide_word
    return _holes(arg), None


_SPACE = re.compile(r"\s")
_FLAG = re.compile(r"^(-{1,2})([^\W\d_][\w.\-\u00ad\u200b-\u200f\u2060-\u2064\ufeff]*)(?:(=)(.*))?$", re.S)
_ASSIGN = re.compile(r"^([^\W\d][\w.\-]*)=(.*)$", re.S)


_NO_WORDS: set[str] = set()


def _program(arg: str) -> str:
    return arg.rpartition("/")[2].lower().removesuffix(".exe")


def _quote(s: str) -> str:
    if not s:
        return "''"
    if _UNSAFE.search(s) is None:
        return s
    return "'" + s.replace("'", "'\"'\"'") + "'"


def redact_text(s: str) -> str:
    """`s` with secrets (token shapes, URL credentials, secret-looking key=value, headers, Bearer) as ``***``.

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
    secret-looking ``KEY=VALUE`` arguments, literals (``'{"password": "x"}'``) and ``Name: value``
    headers (Authorization keeps its scheme), ``-u user:password`` passwords, clients' own password flags
    (``mysql -pX``, ``sshpass -p X``, ``redis-cli -a X``, ``docker login -p X``, ``wandb login KEY``...),
    URL credentials and well-known token shapes are hidden.

    >>> redact_cmdline(["curl", "-H", "Authorization: Bearer abcdef123", "https://x.org"])
    "curl -H 'Authorization: Bearer ***' https://x.org"
    """
    out: list[str] = []
    try:
        nxt: _Next | None = None
        words: set[str] = set()  # plain words seen: programs and verbs
        secret_word = configuring = oracle = client = False
        for raw in argv or ():
            try:
                arg = (raw if isinstance(raw, str) else str(raw)).replace(_HOLE, "")
                red = nxt(arg) if nxt is not None else None
                nxt = None
                plain = bool(arg) and not arg.startswith("-")
                if red is None and secret_word and plain and "=" not in arg:
                    red, secret_word = _HOLE, False
                if red is None and oracle and plain:
                    oracle = False  # the login is the first word after sqlplus: user/password@db
                    if (m := _ORACLE_LOGIN.fullmatch(arg)) is not None:
                        red = f"{m.group(1)}/{_HOLE}{m.group(3) or ''}"
                if red is None:
                    red, nxt = _arg_holes(arg, words if client else _NO_WORDS)
                    if (configuring and plain and nxt is None and "/" not in arg and "=" not in arg
                            and ":" not in arg and _is_secret_name(arg)):
                        nxt = _hide_word  # aws configure set aws_secret_access_key VALUE
                out.append(_quote(red).replace(_HOLE, MASK))
                if plain and len(arg) < 64:
                    # The client may come after a wrapper (sudo, env, docker exec): look at every word.
                    word = _program(arg)
                    words.add(word)
                    verbs = _SECRET_VERBS.get(word)
                    secret_word = secret_word or (verbs is not None and not verbs.isdisjoint(words))
                    configuring = configuring or word in _CONFIG_VERBS
                    client = client or word in _CLIENTS
                    oracle = oracle or (word in _ORACLE and red == arg)
            except Exception:
                out.append(MASK)
                nxt = None
    except Exception:
        out.append(MASK)
    return " ".join(out)


def redact_url(url: str, *, keep_path: bool = False) -> str:
    """A URL to show (logs, messages, status lines), with its credentials hidden.

    By default for a URL where a service's secret may sit anywhere (a notifier's): its password, a user
    that is a token, every query value and every path segment but the first are hidden (a Slack webhook's
    secret is its path). With `keep_path`, for a URL whose path and query say where, not who (a Redis
    URL's /db and ?db=): only the password, a token user and secret-named query values (password=,
    token=, ...) are hidden, and a URL with none of them comes back as it is.

    >>> redact_url("https://user:pw@hooks.slack.com/services/T0/B0/XYZ?token=abc")
    'https://user:***@hooks.slack.com/services/***?token=***'
    >>> redact_url("redis://:s3cret@10.0.0.5:6379/0?password=x&db=1", keep_path=True)
    'redis://:***@10.0.0.5:6379/0?password=***&db=1'
    """
    try:
        p = urllib.parse.urlsplit(url)
        # From the netloc as written (a bad port is shown, not refused); the password runs to the last '@'.
        userinfo, at, host = p.netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        token_user = bool(at) and _token_like(urllib.parse.unquote(user))
        if at:
            host = f"{MASK if token_user else user}{':' + MASK if colon else ''}@{host}"
        if keep_path:
            pairs = p.query.split("&") if p.query else []
            hidden = [f"{k}={MASK}" if _is_secret_name(urllib.parse.unquote_plus(k)) else pair
                      for pair in pairs for k in [pair.partition("=")[0]]]
            if not colon and not token_user and hidden == pairs:
                return url
            return urllib.parse.urlunsplit((p.scheme, host, p.path, "&".join(hidden), p.fragment))
        segs = [s for s in p.path.split("/") if s]
        lead = "/" if p.path.startswith("/") else ""  # 'nosch' stays 'nosch' in "must be a URL, not ..."
        path = (lead + segs[0] + (f"/{MASK}" if len(segs) > 1 else "")) if segs else p.path
        query = "&".join(f"{k}={MASK}" for k, _ in urllib.parse.parse_qsl(p.query, keep_blank_values=True))
        return urllib.parse.urlunsplit((p.scheme, host, path, query, ""))
    except ValueError:
        return "<a URL that cannot be parsed>"
