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
