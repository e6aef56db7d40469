"""A corpus of secrets on command lines, in the families secret scanners classify (gitleaks' and
trufflehog's rules, detect-secrets' plugins): each secret's value must be gone from `redact_cmdline`'s
output. And a corpus of harmless look-alikes (token counts, tokenizers, key frames, git SHAs, run ids,
model names, paths, ports) that must come out exactly as `shlex.join` writes them.

Keys are made here from a seeded generator, never written out whole, so that this file holds no string a
scanner would take for a real key. Written for gpuscope; no scanner's rules or code are copied.
"""

from __future__ import annotations

import json
import random
import shlex
import string

import pytest

from gpuscope._redact import redact_cmdline, redact_text

_rng = random.Random(20261201)
ALNUM = string.ascii_letters + string.digits
HEX = "0123456789abcdef"
UPPER = string.ascii_uppercase + string.digits
B64 = ALNUM + "+/"
URLSAFE = ALNUM + "-_"


def R(n: int, alphabet: str = ALNUM) -> str:
    """n random characters with at least two digits and two letters (as a generated key has)."""
    while True:
        s = "".join(_rng.choice(alphabet) for _ in range(n))
        if n < 4 or set(alphabet) <= set(string.digits) or (sum(c.isdigit() for c in s) >= 2
                                                            and sum(c.isalpha() for c in s) >= 2):
            return s


def P() -> str:
    """A password as people choose them."""
    return _rng.choice(["Hunter2!", "S3cr3t-pass", "correct.horse.battery", "Tr0ub4dor&3", "p@ss:w0rd", "Zx9#qLw"]) \
        + R(4)


# -- secrets: (argv, the values that must not be shown) ------------------------------------------------

SECRETS: list[tuple[list[str], list[str]]] = []


def S(argv: list[str], *values: str) -> None:
    SECRETS.append((argv, list(values)))


# Flags: separate value, =value, attached, single dash, camelCase, snake_case, Java properties.
for flag in ("--password", "--passwd", "--pass", "--pw", "-pw", "--token", "--auth-token", "--access-token",
             "--refresh-token", "--id-token", "--session-token", "--api-key", "--apikey", "--apiKey", "--api_key",
             "--secret", "--client-secret", "--client_secret", "--secret-key", "--secret-access-key",
             "--private-key", "--signing-key", "--encryption-key", "--master-key", "--license-key",
             "--db-password", "--dbPassword", "--redis-password", "--admin-pass", "--passphrase",
             "--credentials", "--creds", "--auth", "--oauth-token", "--bearer", "--oauth2-bearer", "--jwt",
             "--cookie", "--hf-token", "--hf_token", "--wandb-key", "--github-token", "--gitlab-token",
             "--slack-token", "--openai-api-key", "--anthropic-api-key", "--huggingface-token", "--psk",
             "--otp", "--pwd", "--storepass", "-keypass", "--sas-token", "--account-key", "--shared-key"):
    v = P() if "pass" in flag or flag.endswith(("pw", "pwd")) else R(24)
    S(["python", "app.py", flag, v, "--lr", "0.1"], v)
for flag in ("--password", "--token", "--api-key", "--client-secret", "--aws-secret-access-key"):
    v = R(32)
    S(["python", "app.py", f"{flag}={v}"], v)
v = P()
S(["java", f"-Djavax.net.ssl.keyStorePassword={v}", f"-Dspring.datasource.password={v}", "-jar", "app.jar"], v)
v = R(20)
S(["python", "x.py", "--password", "-" + v], v)  # a value that starts with '-'

# Non-ASCII and obfuscated flag names.
for flag in ("--passwort", "--kennwort", "--contraseña", "--senha", "--mot-de-passe", "--wachtwoord", "--parola",
             "--hasło", "--lösenord", "--пароль", "--密码", "--数据库密码", "--パスワード", "--비밀번호", "--токен",
             "--clé-api", "--api-schlüssel", "--ｐａｓｓｗｏｒｄ", "--pass\u00adword", "--to\u200bken", "--şifre"):
    v = P()
    S(["./serve", flag, v], v)
    S(["./serve", f"{flag}={v}x"], v + "x")

# Environment assignments: `env X=..`, `KEY=.. cmd` (argv of a shell-less exec), a script in sh -c.
for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY",
             "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GITHUB_TOKEN", "GH_TOKEN", "CI_JOB_TOKEN", "NPM_TOKEN",
             "PGPASSWORD", "MYSQL_PWD", "REDIS_PASSWORD", "DATABASE_PASSWORD", "SLACK_BOT_TOKEN", "DD_API_KEY",
             "SENTRY_AUTH_TOKEN", "TWILIO_AUTH_TOKEN", "KAGGLE_KEY", "AZURE_CLIENT_SECRET", "GOOGLE_API_KEY",
             "DATABRICKS_TOKEN", "COHERE_API_KEY", "VAULT_TOKEN", "RSYNC_PASSWORD", "SSHPASS", "PWD"):
    v = R(30)
    S(["env", f"{name}={v}", "python", "train.py"], v)
v1, v2 = R(40, B64), R(20)
S(["sh", "-c", f"AWS_SECRET_ACCESS_KEY={v1} GITHUB_TOKEN={v2} python train.py --epochs 3"], v1, v2)
v = R(16)
S(["bash", "-c", f'export DB_PASSWORD="{v}"; exec python serve.py'], v)

# Vendor key shapes, anywhere: as a value of an innocent flag, inside a word, in a URL.
SHAPES = {
    "AWS access key id": "AKIA" + R(16, UPPER), "AWS temporary key id": "ASIA" + R(16, UPPER),
    "GitHub classic": "ghp_" + R(36), "GitHub OAuth": "gho_" + R(36), "GitHub app": "ghs_" + R(36),
    "GitHub refresh": "ghr_" + R(36), "GitHub fine-grained": "github_pat_11" + R(20) + "_" + R(59),
    "GitLab PAT": "glpat-" + R(20, URLSAFE), "GitLab deploy": "gldt-" + R(20, URLSAFE),
    "GitLab runner": "glrt-" + R(20, URLSAFE), "GitLab pipeline trigger": "glptt-" + R(40, HEX),
    "Slack bot": "xoxb-" + R(11, string.digits) + "-" + R(12, string.digits) + "-" + R(24),
    "Slack user": "xoxp-" + R(11, string.digits) + "-" + R(32, HEX), "Slack app": "xapp-1-" + R(11) + "-" + R(40),
    "Stripe live": "sk_live_" + R(24), "Stripe test": "sk_test_" + R(24), "Stripe restricted": "rk_live_" + R(24),
    "Stripe webhook": "whsec_" + R(32),
    "OpenAI legacy": "sk-" + R(20) + "T3BlbkFJ" + R(20), "OpenAI project": "sk-proj-" + R(64, URLSAFE),
    "OpenAI service account": "sk-svcacct-" + R(48, URLSAFE),
    "Anthropic": "sk-ant-api03-" + R(93, URLSAFE) + "AA", "Anthropic admin": "sk-ant-admin01-" + R(80, URLSAFE),
    "DeepSeek": "sk-" + R(32, HEX), "OpenRouter": "sk-or-v1-" + R(64, HEX),
    "Hugging Face": "hf_" + R(34), "Hugging Face org": "api_org_" + R(34),
    "npm": "npm_" + R(36), "PyPI": "pypi-AgEIcHlwaS5vcmc" + R(50, URLSAFE),
    "Twilio API key": "SK" + R(32, HEX), "SendGrid": "SG." + R(22, URLSAFE) + "." + R(43, URLSAFE),
    "Databricks": "dapi" + R(32, HEX), "W&B v1": "wandb_v1_" + R(40),
    "Google API key": "AIza" + R(35, URLSAFE), "Google OAuth": "ya29." + R(60, URLSAFE),
    "Google client secret": "GOCSPX-" + R(28, URLSAFE),
    "Mailgun": "key-" + R(32, HEX), "Mailchimp": R(32, HEX) + "-us14",
    "DigitalOcean": "dop_v1_" + R(64, HEX), "Shopify": "shpat_" + R(32, HEX),
    "Atlassian": "ATATT3xFfGF0" + R(180, URLSAFE), "Postman": "PMAK-" + R(24, HEX) + "-" + R(34, HEX),
    "Doppler": "dp.st.prd." + R(40), "Vault": "hvs." + R(90, URLSAFE),
    "Terraform Cloud": R(14) + ".atlasv1." + R(67, URLSAFE), "Grafana cloud": "glc_" + R(60),
    "Grafana service account": "glsa_" + R(32) + "_" + R(8, HEX), "New Relic": "NRAK-" + R(27, UPPER),
    "Sentry": "sntrys_" + R(80), "Linear": "lin_api_" + R(40), "Notion": "ntn_" + R(46),
    "age": "AGE-SECRET-KEY-1" + R(58, UPPER), "Docker Hub": "dckr_pat_" + R(27, URLSAFE),
    "JFrog": "AKCp" + R(69), "Replicate": "r8_" + R(37), "Groq": "gsk_" + R(52), "Perplexity": "pplx-" + R(48),
    "xAI": "xai-" + R(80), "Tavily": "tvly-" + R(32), "LangSmith": "lsv2_pt_" + R(32, HEX) + "_" + R(10, HEX),
    "Pinecone": "pcsk_" + R(60), "Supabase": "sbp_" + R(40, HEX), "PlanetScale": "pscale_tkn_" + R(43),
    "Square": "sq0atp-" + R(22, URLSAFE), "Fly.io": "fm2_" + R(80), "Heroku": "HRKU-" + R(36, URLSAFE),
    "Alibaba": "LTAI" + R(20), "Tencent": "AKID" + R(32), "Azure AD client secret": R(3) + "8Q~" + R(34, URLSAFE),
    "Telegram bot": R(10, string.digits) + ":AA" + R(33, URLSAFE),
    "Discord bot": "M" + R(25) + "." + R(6) + "." + R(38, URLSAFE),
    "JWT": "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIx" + R(30, URLSAFE) + "." + R(43, URLSAFE),
    "RubyGems": "rubygems_" + R(48, HEX), "NuGet": "oy2" + R(43, string.ascii_lowercase + string.digits),
}
for key in SHAPES.values():
    S(["python", "run.py", "--model", key], key)
    S(["python", "run.py", f"--x={key}", f"prefix:{key}"], key)

# URL userinfo: with and without a password; DSNs; tokens as the user.
for url, secret in [
    ("https://bob:{p}@github.com/o/r.git", "{p}"), ("postgres://app:{p}@db.internal:5432/prod", "{p}"),
    ("postgresql://app:{p}@db/prod?sslmode=require", "{p}"), ("mongodb+srv://u:{p}@cluster0.ab1cd.mongodb.net/x", "{p}"),
    ("mongodb://root:{p}@m1:27017,m2:27017/admin?replicaSet=rs0", "{p}"), ("redis://:{p}@cache:6379/0", "{p}"),
    ("rediss://default:{p}@cache.example.com:6380", "{p}"), ("amqp://guest:{p}@rabbit:5672/vhost", "{p}"),
    ("mysql://root:{p}@127.0.0.1:3306/db", "{p}"), ("ftp://user:{p}@files.example.com/pub", "{p}"),
    ("https://oauth2:{t}@gitlab.com/group/repo.git", "{t}"), ("https://x-access-token:{t}@github.com/o/r", "{t}"),
    ("https://{t}@github.com/o/r.git", "{t}"), ("https://{h}@o450000.ingest.sentry.io/4500000", "{h}"),
    ("git+https://{t}:x-oauth-basic@github.com/o/r", "{t}"),
    ("s3://bucket/key?X-Amz-Credential=AKID%2F20240101&X-Amz-Signature={h}", "{h}"),
    ("https://acct.blob.core.windows.net/c/b?sv=2022-11-02&se=2030-01-01&sp=r&sig={b}", "{b}"),
    ("https://storage.googleapis.com/b/o?X-Goog-Signature={h}&X-Goog-Date=20240101", "{h}"),
    ("https://api.example.com/v1/items?access_token={t}&page=2", "{t}"),
    ("https://api.example.com/v1/items?api_key={t}", "{t}"), ("https://graph.example.com/me?token={t}", "{t}"),
    ("https://hooks.slack.com/services/T0{U}/B0{U}/{t}", "{t}"),
    ("https://discord.com/api/webhooks/1234567890/{t}", "{t}"),
    ("https://corp.webhook.office.com/webhookb2/{t}@{t}/IncomingWebhook/{h}/{t}", "{h}"),
    ("jdbc:postgresql://db:5432/x?user=app&password={p}", "{p}"),
    ("jdbc:sqlserver://db:1433;databaseName=x;user=sa;password={p};", "{p}"),
]:
    vals = {"p": P().replace("@", "").replace(":", ""), "t": R(40), "h": R(32, HEX), "b": R(43, B64), "U": R(8, UPPER)}
    u, sec = url.format(**vals), secret.format(**vals)
    S(["git", "clone", u], sec)
    S(["python", "serve.py", f"--db-url={u}"], sec)

# Connection strings.
for cs, secret in [
    ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={b};EndpointSuffix=core.windows.net", "{b}"),
    ("Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey={b}", "{b}"),
    ("Server=tcp:db.database.windows.net,1433;Database=x;User ID=app;Password={p};Encrypt=true", "{p}"),
    ("Driver={{ODBC Driver 18}};Server=db;UID=sa;PWD={p};", "{p}"),
    ("host=db port=5432 user=app password={p} dbname=prod", "{p}"),
    ("BlobEndpoint=https://a.blob.core.windows.net/;SharedAccessSignature=sv=2022&sig={b}", "{b}"),
]:
    vals = {"p": P().replace(";", "").replace("'", ""), "b": R(43, B64)}
    S(["python", "etl.py", "--conn", cs.format(**vals)], secret.format(**vals))

# Literals inside arguments: JSON, Python, INI, YAML, XML, SQL, TOML.
for lit, secret in [
    ('{{"password": "{p}"}}', "{p}"), ('{{"user": "app", "password":"{p}", "port": 5432}}', "{p}"),
    ('{{"api_key": "{t}", "model": "gpt-4o"}}', "{t}"), ("{{'token': '{t}'}}", "{t}"),
    ('{{"auth": {{"username": "x", "secret": "{t}"}}}}', "{t}"),
    ('{{"type": "service_account", "project_id": "p", "private_key_id": "{h}", "private_key": '
     '"-----BEGIN PRIVATE KEY-----\\nMIIEv{b}\\n-----END PRIVATE KEY-----\\n", "client_email": "x@p.iam"}}', "{b}"),
    ('{{"headers": {{"Authorization": "Bearer {t}"}}}}', "{t}"),
    ("connect(host='db', password='{p}')", "{p}"), ('Client(api_key="{t}")', "{t}"),
    ("psycopg2.connect(dbname='x', user='u', password=\"{p}\")", "{p}"),
    ("[db]\nhost = db\npassword = {p}\n", "{p}"), ("auth:\n  token: {t}\n", "{t}"),
    ("redis:\n  password: '{p}'\n", "{p}"), ("<config><password>{p}</password></config>", "{p}"),
    ("ALTER USER app WITH PASSWORD '{p}';", "{p}"), ("CREATE USER 'u'@'%' IDENTIFIED BY '{p}';", "{p}"),
    ('secret_key = "{t}"', "{t}"), ("{{:api_key => '{t}'}}", "{t}"), ("{{'password' => '{p}'}}", "{p}"),
]:
    vals = {"p": P().replace("'", "").replace('"', "").replace("\\", ""), "t": R(32), "h": R(40, HEX),
            "b": R(60, B64)}
    S(["python", "-c" if "(" in lit else "--config", lit.format(**vals)], secret.format(**vals))

# Held out while the rules were written (2 of these 25 leaked then): deployment tools' own forms.
for argv_fmt in (["docker", "run", "-e", "POSTGRES_PASSWORD={p}", "postgres"], ["docker", "run", "--env", "OPENAI_API_KEY={k}"],
                 ["ansible-playbook", "site.yml", "-e", "ansible_become_pass={p}"],
                 ["ansible-playbook", "site.yml", "--extra-vars", "db_password={p}"],
                 ["terraform", "apply", "-var", "db_password={p}"], ["helm", "install", "x", "--set", "auth.password={p}"],
                 ["helm", "install", "x", "--set", "redis.auth.token={k}"], ["python", "x.py", "--jwt-secret", "{k}"],
                 ["curl", "-d", "client_id=abc&client_secret={k}&grant_type=client_credentials", "https://h/token"],
                 ["curl", "--data-urlencode", "password={p}", "https://h"], ["python", "x.py", "--header", "x-api-key:{k}"],
                 ["python", "-c", "import openai; openai.api_key = '{k}'"], ["python", "-c", "os.environ['HF_TOKEN']='{k}'"],
                 ["python", "x.py", "--azure-storage-key", "{b}"], ["python", "x.py", "--mlflow-tracking-token", "{k}"],
                 ["rclone", "copy", "--s3-secret-access-key", "{b}", "a", "b"], ["python", "x.py", "--comet-api-key", "{k}"]):
    p, k, b = P().replace("'", ""), R(24), R(40, B64)
    secret = p if any("{p}" in a for a in argv_fmt) else b if any("{b}" in a for a in argv_fmt) else k
    S([a.format(p=p, k=k, b=b) for a in argv_fmt], secret)

# PEM blocks.
for kind in ("RSA PRIVATE KEY", "PRIVATE KEY", "EC PRIVATE KEY", "OPENSSH PRIVATE KEY", "ENCRYPTED PRIVATE KEY",
             "PGP PRIVATE KEY BLOCK", "DSA PRIVATE KEY"):
    body = "\n".join(R(64, B64) for _ in range(3))
    S(["ssh-add", "-", f"-----BEGIN {kind}-----\n{body}\n-----END {kind}-----\n"], *body.split("\n"))
body = R(64, B64)
S(["python", "x.py", "--key", f"-----BEGIN RSA PRIVATE KEY-----\n{body}"], body)  # cut short

# HTTP headers and cookies in curl / wget / httpie.
for header in ("Authorization: Bearer {t}", "Authorization: Basic {b}", "Authorization: token {t}",
               "authorization:Bearer {t}", "Proxy-Authorization: Basic {b}", "X-Api-Key: {t}",
               "X-Auth-Token: {t}", "PRIVATE-TOKEN: {t}", "Cookie: sessionid={t}; csrftoken={h}",
               "X-Goog-Api-Key: {t}", "Api-Key: {t}", "X-Vault-Token: {t}", "DD-API-KEY: {h}"):
    vals = {"t": R(40), "b": R(28, B64), "h": R(32, HEX)}
    h = header.format(**vals)
    secret = h.split(" ", 1)[1] if h.split(":")[0].lower().endswith("authorization") else h.split(":", 1)[1].strip()
    if " " in secret and not secret.startswith("sessionid"):
        secret = secret.split(" ", 1)[1]
    S(["curl", "-sS", "-H", h, "https://api.example.com/v1"], *secret.replace(";", "").split())
    S(["wget", f"--header={h}", "https://api.example.com/v1"], *secret.replace(";", "").split())
t = R(40)
S(["curl", "-H", "Authorization: Bearer", t, "https://x"], t)
t = R(40)
S(["http", "POST", "api.example.com/v1", f"Authorization:Bearer {t}"], t)
c = R(32)
S(["curl", "-b", f"session={c}", "https://x"], c)
c = R(32)
S(["curl", "--cookie", f"sid={c}; theme=dark", "https://x"], c)
t = R(40)
S(["git", "-c", f"http.extraHeader=Authorization: Basic {t}", "clone", "https://x/r"], t)

# -u user:password and friends.
for argv_fmt in (["curl", "-u", "alice:{p}", "https://x"], ["curl", "--user", "alice:{p}", "https://x"],
                 ["curl", "-ualice:{p}", "https://x"], ["curl", "--user=alice:{p}"], ["curl", "-su", "alice:{p}"],
                 ["curl", "--proxy-user", "bob:{p}", "https://x"], ["curl", "-U", "bob:{p}", "https://x"],
                 ["smbclient", "//srv/share", "-U", "alice%{p}"], ["smbclient", "//srv/share", "-Ualice%{p}"],
                 ["lftp", "-u", "alice,{p}", "ftp.example.com"], ["sqlplus", "scott/{p}@//db:1521/orcl"],
                 ["sqlplus", "-s", "scott/{p}"]):
    p = P().replace("%", "").replace(",", "").replace("@", "").replace("/", "")
    S([a.format(p=p) for a in argv_fmt], p)

# Clients' own password flags.
for argv_fmt in (["mysql", "-uroot", "-p{p}", "db"], ["/usr/bin/mysqldump", "-p{p}", "db"], ["sudo", "mysql", "-p{p}"],
                 ["sshpass", "-p", "{p}", "ssh", "host"], ["sshpass", "-p{p}", "scp", "a", "b:"],
                 ["redis-cli", "-h", "cache", "-a", "{p}", "ping"], ["redis-cli", "-a{p}", "--no-auth-warning"],
                 ["mongosh", "mongodb://db/x", "-u", "admin", "-p", "{p}"], ["mongodump", "-u", "a", "-p", "{p}"],
                 ["ldapsearch", "-x", "-D", "cn=admin,dc=x", "-w", "{p}", "-b", "dc=x"],
                 ["docker", "login", "-u", "ci", "-p", "{p}", "registry.example.com"],
                 ["podman", "login", "-p", "{p}", "quay.io"], ["helm", "registry", "login", "-p", "{p}", "r"],
                 ["az", "login", "-u", "a@b.c", "-p", "{p}"], ["twine", "upload", "-u", "__token__", "-p", "{p}"],
                 ["sqlcmd", "-S", "db", "-U", "sa", "-P", "{p}"], ["sqlcmd", "-S", "db", "-P{p}"],
                 ["zip", "-P", "{p}", "a.zip", "f"], ["unzip", "-P", "{p}", "a.zip"], ["7z", "a", "-p{p}", "a.7z"],
                 ["mosquitto_pub", "-u", "a", "-P", "{p}", "-t", "x", "-m", "y"],
                 ["ssh-keygen", "-t", "ed25519", "-N", "{p}", "-f", "k"], ["openssl", "rsa", "-passin", "pass:{p}"],
                 ["openssl", "enc", "-aes256", "-k", "{p}", "-in", "f"], ["xfreerdp", "/u:admin", "/p:{p}", "/v:h"],
                 ["plink", "-pw", "{p}", "host"], ["nmcli", "dev", "wifi", "connect", "Home", "password", "{p}"],
                 ["wandb", "login", "{k}"], ["wandb", "login", "--relogin", "{k}"], ["vault", "login", "{k}"],
                 ["ngrok", "config", "add-authtoken", "{k}"], ["ngrok", "authtoken", "{k}"],
                 ["aws", "configure", "set", "aws_secret_access_key", "{k}"],
                 ["git", "config", "--global", "github.token", "{k}"], ["npm", "config", "set", "_authToken", "{k}"],
                 ["poetry", "config", "pypi-token.pypi", "{k}"], ["huggingface-cli", "login", "--token", "{k}"],
                 ["kubectl", "create", "secret", "generic", "db", "--from-literal=password={p}"],
                 ["kubectl", "config", "set-credentials", "u", "--token={k}"],
                 ["heroku", "config:set", "SECRET_KEY_BASE={k}"], ["vault", "login", "-method=userpass",
                                                                   "username=bob", "password={p}"]):
    p, k = P().replace("%", "").replace(",", ""), R(40, HEX)
    S([a.format(p=p, k=k) for a in argv_fmt], p if any("{p}" in a for a in argv_fmt) else k)

# One string holding a whole command line (a process that rewrote its argv).
t, p = R(30), P()
S([f"python train.py --hf-token {t} --db-password={p} --lr 3"], t, p)
t, p = R(30), P()
S(["sh", "-c", f"curl -H 'X-Api-Key: {t}' -u bob:{p} https://h && ls"], t, p)


# -- look-alikes: harmless arguments that must be kept as they are --------------------------------------

SHA = "9fceb02d0ae598e95dc970b74767f19372d61af8"
LOOKALIKES: list[list[str]] = [
    ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "meta-llama/Llama-3-8B-Instruct",
     "--tokenizer", "gpt2", "--max-tokens", "512", "--max-num-batched-tokens", "8192", "--port", "8000"],
    ["python", "train.py", "--token-file", "/run/secrets/hf", "--password-file=/run/pw", "--secret-name", "db"],
    ["python", "train.py", "--passes", "3", "--num-passes", "2", "--bypass", "--keyframe", "10", "--compass", "n"],
    ["python", "train.py", "--lr", "3e-4", "--weight-decay", "0.01", "--warmup-ratio", "0.03", "--seed", "42"],
    ["python", "generate.py", "--pad-token", "<pad>", "--eos-token-id", "2", "--bos-token", "<s>",
     "--stop-token", "</s>", "--add-special-tokens", "--tokens-per-second", "50"],
    ["git", "checkout", SHA], ["git", "show", SHA[:12]], ["git", "log", f"{SHA}..HEAD"],
    ["python", "train.py", "--run-id", "3f2b9c1e-8d7a-4e6b-9f0a-1c2d3e4f5a6b", "--resume", "ckpt/step-1000"],
    ["docker", "run", "--gpus", "all", "-p", "8080:80", "-p8443:443", "nvcr.io/nvidia/pytorch:24.01-py3"],
    ["docker", "pull", "ghcr.io/org/image@sha256:" + "ab12" * 16],
    ["torchrun", "--nnodes=2", "--nproc-per-node=8", "--rdzv-endpoint=10.0.0.1:29500", "train.py"],
    ["python", "x.py", "--auth-type", "basic", "--auth-url", "https://login.example.com", "--key", "value"],
    ["python", "x.py", "--use-auth-token", "--no-auth", "--with-token", "--password-stdin", "--token-budget", "9"],
    ["python", "x.py", "--secret-dir", "/var/run/secrets", "--credential-source", "env", "--auth-provider", "oidc"],
    ["curl", "-H", "Accept: application/json", "-H", "Content-Type: text/plain", "https://api.example.com/v1?page=2"],
    ["curl", "-b", "cookies.txt", "-c", "cookies.txt", "https://example.com"],
    ["ssh", "-p", "2222", "user@host"], ["ssh", "-p2222", "host"], ["pip", "install", "-U", "torch==2.3.0"],
    ["python", "-u", "train.py"], ["curl", "-u", "alice", "https://x.org"], ["mysqladmin", "-p", "status"],
    ["python", "x.py", "--model", "mistralai/Mistral-7B-Instruct-v0.2", "--revision", "a1b2c3d4e5f6"],
    ["python", "x.py", "--model", "sk-learn-tutorial-notebook-v2", "--task-abcdefghijklmnopqrstuvwxyz"],
    ["python", "x.py", "--data", "s3://bucket/datasets/train-00001-of-00008.parquet", "--hosts", "a.b.c:1234"],
    ["git", "clone", "https://github.com/huggingface/transformers.git"], ["git", "clone", "git@github.com:o/r.git"],
    ["git", "clone", "https://user@host:8080/a@b"], ["git", "clone", "https://x-access-token@github.com/o/r"],
    ["env", "MAX_TOKENS=100", "TOKENIZERS_PARALLELISM=false", "PWD=/home/me", "OLDPWD=/tmp", "CUDA_VISIBLE_DEVICES=0,1"],
    ["env", "NCCL_DEBUG=INFO", "HF_HOME=/data/hf", "WANDB_PROJECT=llm", "WANDB_MODE=offline", "python", "t.py"],
    ["python", "-c", "import torch; print(torch.cuda.is_available())"],
    ["python", "-c", "from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained('gpt2')"],
    ["python", "x.py", "--config", '{"lr": 0.001, "max_tokens": 512, "tokenizer": "gpt2", "auth_type": "none"}'],
    ["python", "x.py", "--keys", "a,b,c", "--key-column", "id", "--primary-key", "uid", "--sort-key", "t"],
    ["deepspeed", "--num_gpus", "8", "pretrain.py", "--deepspeed", "ds_config.json", "--zero-stage", "3"],
    ["nvidia-smi", "dmon", "-s", "pucvmet", "-d", "1"], ["nvidia-smi", "--query-gpu=uuid,memory.used", "--format=csv"],
    ["python", "x.py", "--image", "tokenizer-server:v1", "keyword:x", "localhost:8080", "author:me", "https://h:443/x"],
    ["python", "x.py", "--author", "me", "--authors", "a,b", "--authority", "ca", "--tokenize", "--detokenize"],
    ["python", "x.py", "--sig-figs", "3", "--signal", "SIGTERM", "--session-name", "exp1", "--cookie-jar", "j.txt"],
    ["kubectl", "get", "secret", "db-creds", "-o", "yaml"], ["kubectl", "get", "pods", "-n", "ml"],
    ["aws", "configure", "set", "region", "us-east-1"], ["git", "config", "--global", "user.name", "Alice"],
    ["python", "-m", "torch.distributed.run", "--master-port", "29500", "--master-addr", "10.0.0.1", "x.py"],
    ["python", "x.py", "--output-dir", "/scratch/runs/2024-06-01T12:00:00", "--log-every", "100"],
    ["ollama", "run", "llama3:70b-instruct-q4_K_M"], ["python", "x.py", "--hash", "e3b0c44298fc1c149afbf4c8996fb924"],
    ["python", "x.py", "--ids", "123456789012345678", "--uuid", "0190a9b2-7c3d-7e4f-8a9b-0c1d2e3f4a5b"],
    ["python", "x.py", "--bucket", "gs://ml-data/AKIAxx/readme.txt", "--api-base", "https://api.openai.com/v1"],
    ["python", "x.py", "--tp", "4", "--pp", "2", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8"],
    ["rsync", "-avz", "--password-file=/etc/rsync.pw", "src/", "dst:/x"],
    ["python", "x.py", "--prompt", "Write a poem about passwords and tokens."],
    ["sqlplus", "/", "as", "sysdba"], ["sqlplus", "-s", "@scripts/report.sql"],
    ["python", "x.py", "--otp-length", "6", "--psk-file", "wifi.psk", "--jwt-algorithm", "RS256"],
    ["python", "x.py", "--max-sessions", "4", "--pwd-dir", "/tmp", "--pw-strength", "2"],
    ["openssl", "rsa", "-passin", "env:KEY_PASS", "-in", "k.pem"], ["openssl", "rsa", "-passin", "file:/run/pw"],
    ["ls", "-la", "/home/user/.ssh"], ["cat", "/proc/cpuinfo"], ["python", "train.py", "--help"],
    ["python", "x.py", "--tokenizer-path", "/models/tok", "--token-dropout", "0.1", "--num-tokens", "4096"],
    ["python", "x.py", "--url", "https://example.com/a/b/c?x=1&y=2", "--proxy", "http://10.0.0.2:3128"],
    ["java", "-Xmx4g", "-Dlog4j.configurationFile=log4j2.xml", "-jar", "app.jar"],
    ["python", "eval.py", "--pass-at-k", "10", "--pass-rate", "0.9", "--passthrough", "--max-new-tokens", "256"],
    ["python", "x.py", "--trust-remote-code", "--auth-method", "oidc", "--secrets-file", "s.env", "--token-level"],
    ["python", "x.py", "--keypoint-threshold", "0.5", "--hotkey", "ctrl+c", "--text-key", "text", "--label-key", "y"],
    ["python", "x.py", "--api-base", "http://127.0.0.1:8000/v1", "--api-version", "2024-02-01", "--key-id", "k1"],
    ["python", "x.py", "--session-dir", "/tmp/s", "--cookie-file", "c.txt", "--bearer-header", "Authorization"],
    ["python", "x.py", "--private", "--public", "--passive", "--password-prompt", "--ask-pass"],
    ["python", "x.py", "--num-key-value-heads", "8", "--secret-sharing-scheme", "shamir", "--sk", "0.5"],
    ["python", "x.py", "--auth0-domain", "x.auth0.com", "--apikey-env", "OPENAI", "--hf-token-path", "/x"],
    ["python", "x.py", "--token-embedding-size", "768", "--public-key", "/etc/k.pub", "--sig-level", "0.05"],
    ["git", "commit", "-m", "fix token refresh bug in the password reset flow"],
]


@pytest.mark.parametrize("argv, values", SECRETS, ids=[f"secret{i}" for i in range(len(SECRETS))])
def test_every_secret_value_is_gone(argv, values):
    out = redact_cmdline(argv)
    for v in values:
        assert v not in out, (argv, out)
    assert "***" in out


@pytest.mark.parametrize("argv", LOOKALIKES, ids=[f"lookalike{i}" for i in range(len(LOOKALIKES))])
def test_every_lookalike_is_kept(argv):
    assert redact_cmdline(argv) == shlex.join(argv)


def test_the_corpus_is_large_and_varied():
    assert len(SECRETS) >= 150 and len(LOOKALIKES) >= 60
    assert len(SHAPES) >= 60  # vendor families


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_shapes_are_hidden_in_free_text_too(kind):
    key = SHAPES[kind]
    assert key not in redact_text(f"job failed: export KEY {key} (retry)")


def test_json_literal_keeps_its_shape():
    out = redact_cmdline(["x", "--config", json.dumps({"user": "app", "password": "hunter2", "port": 5432})])
    assert out == """x --config '{"user": "app", "password": "***", "port": 5432}'"""


def test_user_only_url_keeps_the_host():
    token = R(40)
    assert redact_cmdline(["git", "clone", f"https://{token}@github.com/o/r.git"]) == \
        "git clone https://***@github.com/o/r.git"
