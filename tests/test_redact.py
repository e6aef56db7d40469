import shlex

import pytest

from gpuscope._redact import redact_cmdline, redact_text


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["python", "train.py", "--token", "abc123"], "python train.py --token ***"),
        (["python", "train.py", "--hf-token", "abc123", "--lr", "0.1"], "python train.py --hf-token *** --lr 0.1"),
        (["x", "--password", "hunter2"], "x --password ***"),
        (["x", "--api-key=zzz"], "x --api-key=***"),
        (["x", "--apiKey", "zzz"], "x --apiKey ***"),
        (["x", "--secret", "s", "--auth", "a", "--credentials", "c"], "x --secret *** --auth *** --credentials ***"),
        (["x", "--client_secret=abc", "--db-password", "pw"], "x --client_secret=*** --db-password ***"),
        (["java", "-Djavax.net.ssl.keyStorePassword=changeit", "-storepass", "pw"],
         "java -Djavax.net.ssl.keyStorePassword=*** -storepass ***"),
        # env-style assignments
        (["env", "HF_TOKEN=abc", "WANDB_API_KEY=k", "AWS_SECRET_ACCESS_KEY=s", "python"],
         "env HF_TOKEN=*** WANDB_API_KEY=*** AWS_SECRET_ACCESS_KEY=*** python"),
        (["env", "DB_PASSWORD=pw", "MY_PRIVATE_KEY=k", "AUTH=a", "python"],
         "env DB_PASSWORD=*** MY_PRIVATE_KEY=*** AUTH=*** python"),
        # URLs with userinfo
        (["git", "clone", "https://bob:s3cret@github.com/x.git"], "git clone https://bob:***@github.com/x.git"),
        (["x", "--db=postgres://u:p%40ss@db:5432/x"], "x --db=postgres://u:***@db:5432/x"),
        # Bearer in a header
        (["curl", "-H", "Authorization: Bearer abcdef123", "https://x.org"],
         "curl -H 'Authorization: Bearer ***' https://x.org"),
        (["x", "Bearer", "abcdef123"], "x Bearer ***"),
    ],
)
def test_secret_values_are_hidden(argv, expected):
    assert redact_cmdline(argv) == expected


@pytest.mark.parametrize(
    "token",
    [
        "hf_" + "a1B2" * 9,
        "ghp_" + "x" * 36,
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnop",
        "sk-" + "A1b2" * 12,
        "sk-proj-" + "abcDEF123_-" * 4,
        "xoxb-1234567890-0987654321-abcdefABCDEF",
        "xoxp-1234567890-abcdef",
        "AKIAIOSFODNN7EXAMPLE",
    ],
)
def test_token_shapes_are_hidden_anywhere(token):
    out = redact_cmdline(["python", "run.py", "--model", token, f"--x={token}", f"prefix:{token}"])
    assert token not in out
    assert out.count("***") == 3


@pytest.mark.parametrize(
    "argv",
    [
        ["python", "-m", "vllm", "--tokenizer", "gpt2", "--max-tokens", "100", "--max-num-batched-tokens", "8"],
        ["env", "MAX_TOKENS=100", "TOKENIZERS_PARALLELISM=false", "PWD=/home/me", "OLDPWD=/tmp"],
        ["x", "--author", "me", "--num-passes", "3", "--bypass", "y", "--token-file", "/run/tok"],
        ["x", "--password-file=/run/pw", "--auth-type", "basic", "--key", "value"],
        ["x", "--use-auth-token", "train.py"],  # a switch: train.py is not its value
        ["x", "--task-abcdefghijklmnopqrstuvwxyz", "disk-abcdefghijklmnopqrstuvwxyz"],  # not sk- tokens
        ["torchrun", "--nproc-per-node=8", "https://example.com/a?b=c", "-p", "1234"],
    ],
)
def test_ordinary_arguments_are_kept(argv):
    assert redact_cmdline(argv) == shlex.join(argv)


def test_quoting_matches_shlex_join_and_mask_is_not_quoted():
    argv = ["python", "my script.py", "it's", "*.txt", "", "--token", "a b"]
    out = redact_cmdline(argv)
    assert out == shlex.join(argv[:-1]) + " ***"


def test_mask_inside_a_quoted_argument():
    out = redact_cmdline(["sh", "-c", "HF_TOKEN=abc python x.py --password pw"])
    assert out == "sh -c 'HF_TOKEN=*** python x.py --password ***'"


def test_whole_command_line_in_one_string():
    # Processes that rewrite their argv show up as one space-joined string.
    out = redact_cmdline(["python train.py --token abc --db-password=xyz --lr 3"])
    assert "abc" not in out and "xyz" not in out
    assert "--lr 3" in out


def test_presigned_url_signature_and_credential_are_hidden():
    url = "https://s3.amazonaws.com/b/k?X-Amz-Credential=AKID/x&X-Amz-Signature=deadbeef&part=1"
    out = redact_cmdline(["wget", url])
    assert "deadbeef" not in out and "AKID" not in out and "part=1" in out


def test_conninfo_password_is_hidden():
    out = redact_cmdline(["psql", "host=db user=me password=pw dbname=x"])
    assert out == "psql 'host=db user=me password=*** dbname=x'"


def test_redact_text():
    assert redact_text("HF_TOKEN=abc python x.py") == "HF_TOKEN=*** python x.py"
    assert redact_text("https://user:pass@host/x") == "https://user:***@host/x"
    assert redact_text("plain text, nothing secret") == "plain text, nothing secret"
    assert redact_text("hf_" + "z" * 34) == "***"


@pytest.mark.parametrize("bad", [None, [], [None, 1, b"x"], ["a\x00b"], ["\udcff--token", "x"]])
def test_never_raises(bad):
    assert isinstance(redact_cmdline(bad), str)


def test_redact_text_never_raises_on_non_strings():
    assert isinstance(redact_text(None), str)  # type: ignore[arg-type]
    assert isinstance(redact_text(12), str)  # type: ignore[arg-type]


# --- Review fixes: each case below leaked before. ---


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["curl", "-H", "X-Api-Key: s3cr3t", "https://x.org"], "curl -H 'X-Api-Key: ***' https://x.org"),
        (["curl", "-H", "X-Auth-Token:abc", "-H", "Cookie: a=1; b='x'"], "curl -H X-Auth-Token:*** -H 'Cookie: ***'"),
        (["curl", "-H", "Set-Cookie: sid=1", "-H", "X-Session-Id: 42", "-H", "X-Goog-Credential: c"],
         "curl -H 'Set-Cookie: ***' -H 'X-Session-Id: ***' -H 'X-Goog-Credential: ***'"),
        (["curl", "-H", "PRIVATE-TOKEN: glx", "-H", "X-Client-Secret: s", "-H", "X-Db-Password: p"],
         "curl -H 'PRIVATE-TOKEN: ***' -H 'X-Client-Secret: ***' -H 'X-Db-Password: ***'"),
        (["wget", "--header=X-Api-Key: s3", "-HX-Goog-Api-Key: q"], "wget '--header=X-Api-Key: ***' '-HX-Goog-Api-Key: ***'"),
        (["http", "GET", "x.org", "X-API-Key:abc", "apikey:abc"], "http GET x.org X-API-Key:*** apikey:***"),
    ],
)
def test_secret_header_values_are_hidden(argv, expected):
    assert redact_cmdline(argv) == expected


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["curl", "-H", "Authorization: Token abc"], "curl -H 'Authorization: Token ***'"),
        (["curl", "-H", "Authorization: Digest username=\"a\", response=\"b\""], "curl -H 'Authorization: Digest ***'"),
        (["curl", "-H", "Authorization: AWS4-HMAC-SHA256 Credential=AKID/x, Signature=abc"],
         "curl -H 'Authorization: AWS4-HMAC-SHA256 ***'"),
        (["curl", "-H", "Proxy-Authorization: Basic dXNlcjpwdw=="], "curl -H 'Proxy-Authorization: Basic ***'"),
        (["curl", "-H", "Authorization: abc123"], "curl -H 'Authorization: ***'"),  # no scheme: all of it
        (["curl", "-H", "authorization:SSWS abc"], "curl -H 'authorization:SSWS ***'"),
        (["curl", "-H", "Authorization: Bearer", "abcdef123"], "curl -H 'Authorization: Bearer' ***"),
    ],
)
def test_authorization_keeps_only_the_scheme(argv, expected):
    assert redact_cmdline(argv) == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["curl", "-H", "Accept: application/json", "-H", "Content-Type:text/plain", "-H", "Keep-Alive: 5"],
        ["x", "--image", "tokenizer-server:v1", "keyword:x", "localhost:8080", "author:me", "https://h:443/x"],
        ["git", "clone", "https://user@host:8080/a@b"],
    ],
)
def test_ordinary_colon_arguments_are_kept(argv):
    assert redact_cmdline(argv) == shlex.join(argv)


def test_url_userinfo_named_like_a_header_keeps_the_host():
    out = redact_cmdline(["git", "clone", "https://x-access-token:abc@github.com/o/r.git"])
    assert out == "git clone https://x-access-token:***@github.com/o/r.git"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["curl", "-u", "alice:hunter2", "https://x.org"], "curl -u alice:*** https://x.org"),
        (["curl", "--user", "alice:hunter2"], "curl --user alice:***"),
        (["curl", "-ualice:hunter2"], "curl -ualice:***"),
        (["curl", "--user=alice:hun:ter@2"], "curl --user=alice:***"),
        (["curl", "-su", "alice:pw"], "curl -su alice:***"),
        (["curl", "--proxy-user", "bob:pw", "-Ubob:pw"], "curl --proxy-user bob:*** -Ubob:***"),
        (["curl", "-u", ":pw"], "curl -u :***"),
    ],
)
def test_user_password_keeps_the_user(argv, expected):
    assert redact_cmdline(argv) == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["python", "-u", "train.py", "--lr", "1"],
        ["curl", "-u", "alice", "https://x.org"],  # curl prompts for the password
        ["pip", "install", "-U", "torch"],
        ["curl", "-u", "alice:", "https://x.org"],  # empty password
    ],
)
def test_user_without_password_is_kept(argv):
    assert redact_cmdline(argv) == shlex.join(argv)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["mysql", "-uroot", "-psecret", "db"], "mysql -uroot -p*** db"),
        (["/usr/bin/mysqldump", "-pS3cr3t!", "db"], "/usr/bin/mysqldump -p*** db"),
        (["mysqladmin", "-pabc", "status"], "mysqladmin -p*** status"),
        (["mariadb", "-px"], "mariadb -p***"),
        (["sudo", "mysql", "-pabc"], "sudo mysql -p***"),
        (["mysql", "--password=secret"], "mysql --password=***"),
    ],
)
def test_mysql_attached_password_is_hidden(argv, expected):
    assert redact_cmdline(argv) == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["mysqladmin", "-p", "secret"],  # -p alone prompts; the next word is not its value
        ["ssh", "-p2222", "host"],
        ["python", "x.py", "-pfoo"],
        ["docker", "run", "-p8080:80", "mysql:8"],
    ],
)
def test_dash_p_elsewhere_is_kept(argv):
    assert redact_cmdline(argv) == shlex.join(argv)


@pytest.mark.parametrize(
    "url, expected",
    [
        ("mongodb://u:pa@ss@h/db", "mongodb://u:***@h/db"),
        ("https://u:p@ss@w@rd@host:443/x@y", "https://u:***@host:443/x@y"),
        ("postgres://u:p#q?r@db", "postgres://u:***@db"),
        ("https://me@corp.com:pw@host/x", "https://me@corp.com:***@host/x"),
    ],
)
def test_url_password_runs_to_the_last_at(url, expected):
    assert redact_cmdline(["x", url]) == f"x {expected}"
    assert redact_text(f"run {url} now") == f"run {expected} now"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["x", "--password", "-x", "--lr", "1"], "x --password *** --lr 1"),
        (["x", "--token", "--", "y"], "x --token *** y"),
        (["x", "--api-key", "-abc123"], "x --api-key ***"),
        (["x", "--use-auth-token", "--foo"], "x --use-auth-token --foo"),
        (["x", "--no-auth", "-v"], "x --no-auth -v"),
        (["x", "Bearer", "-v"], "x Bearer -v"),
    ],
)
def test_secret_flag_value_starting_with_dash(argv, expected):
    assert redact_cmdline(argv) == expected


def test_review_leaks_inside_one_string():
    script = ("curl -H 'X-Api-Key: k1' -H \"Authorization: Token t2\" -u bob:pw3 https://h"
              " && mysql -uroot -pPW4 db; python x.py --password -pw5 --a --token y6 --lr 3; ls -p1")
    out = redact_cmdline(["sh", "-c", script])
    for secret in ("k1", "t2", "pw3", "PW4", "pw5", "y6"):
        assert secret not in out
    assert "Token ***" in out and "bob:***" in out and "--lr 3" in out and "ls -p1" in out
    assert redact_text("curl -H 'Cookie: a=1; b=2' -u 'alice:hun ter' x") == "curl -H 'Cookie: ***' -u 'alice:***' x"
    assert redact_text("mongodb://u:pa@ss@h/db") == "mongodb://u:***@h/db"


# --- One redact_url: the notifiers' policy by default, the guard's with keep_path ---


@pytest.mark.parametrize("url, default, kept_path", [
    ("https://hooks.slack.com/services/T0/B0/XYZ", "https://hooks.slack.com/services/***",
     "https://hooks.slack.com/services/T0/B0/XYZ"),
    ("redis://:s3cret@cache:6379/0?db=2&password=p", "redis://:***@cache:6379/0?db=***&password=***",
     "redis://:***@cache:6379/0?db=2&password=***"),
    ("https://ghp0123456789abcdefABCDEF@github.com/o/r", "https://***@github.com/o/***",
     "https://***@github.com/o/r"),
    ("http://am:9093/api/v2/alerts?access_token=t&x=1", "http://am:9093/api/***?access_token=***&x=***",
     "http://am:9093/api/v2/alerts?access_token=***&x=1"),
    ("redis://Cache:port/0", "redis://Cache:port/0", "redis://Cache:port/0"),  # a bad port is shown, not refused
    ("redis://me:pa@ss@cache/0", "redis://me:***@cache/0", "redis://me:***@cache/0"),
])
def test_redact_url_policies(url, default, kept_path):
    from gpuscope._redact import redact_url

    assert redact_url(url) == default
    assert redact_url(url, keep_path=True) == kept_path


def test_one_redact_url_everywhere():
    import gpuscope.alerts
    import gpuscope.guard._config
    import gpuscope.guard._redis  # noqa: F401 - imports it from gpuscope._redact
    from gpuscope._redact import redact_url

    assert gpuscope.alerts.redact_url is redact_url
    assert not hasattr(gpuscope.guard._config, "redact_url") or gpuscope.guard._config.redact_url is redact_url
