"""The status file the trace bootstrap writes beside each trace never holds the secrets on the traced
program's command line (API keys, tokens, passwords, URL credentials)."""

from __future__ import annotations

import json

from test_trace_run import fake, trace  # noqa: F401  (fake is a fixture)


def test_status_file_redacts_secrets_in_argv(fake, tmp_path):  # noqa: F811
    out = tmp_path / "t"
    p = trace(fake, out, "plain", "--api-key", "sk-SECRET1", "--hf-token=SECRET2", "--model", "m",
              "--db", "postgres://u:SECRET3@db:5432/x", "-H", "Authorization: Bearer SECRET4", "--password", "SECRET5",
              "--max-tokens", "64")
    assert p.returncode == 0, p.stderr
    statuses = list(out.glob("*.gpuscope.json"))
    assert statuses
    for path in statuses:
        text = path.read_text()
        assert "SECRET" not in text, text
        argv = json.loads(text)["argv"]
        assert argv[argv.index("--model") + 1] == "m"      # what is not a secret stays readable
        assert argv[argv.index("--max-tokens") + 1] == "64"
        assert "--api-key" in argv and "postgres://u:***@db:5432/x" in argv
