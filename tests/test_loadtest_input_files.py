"""--prompt-file and --body-file go through the shared capped reader (gpuscope._files): a missing, unreadable,
over-cap or non-UTF-8 file is one sentence and exit 2 before any request is sent, and a good file is used as
it is (a body's bytes unchanged, CRLF included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from loadtest_servers import LoadtestServer

from gpuscope._files import MAX_LINE_BYTES, InputFileError
from gpuscope.loadtest.openai import MAX_PROMPT_FILE_BYTES, load_prompts

NOWHERE = "http://127.0.0.1:9/"  # the discard port: a setup error must come before any connection


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())",
                           "loadtest", *args, "--no-gpu", "--quiet", "--out", str(cwd / "out")],
                          capture_output=True, text=True, cwd=cwd, timeout=60)


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:  # zeros the file system need not store: the cap is checked before decoding
        f.truncate(size)
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    (tmp_path / "adir").mkdir()
    return {"missing": str(tmp_path / "nope.txt"), "latin1": str(tmp_path / "latin1.txt"),
            "adir": str(tmp_path / "adir"),
            "big_prompts": str(_sparse(tmp_path / "big_prompts.txt", MAX_PROMPT_FILE_BYTES + 1)),
            "big_body": str(_sparse(tmp_path / "big_body.json", MAX_LINE_BYTES + 1))}


@pytest.mark.parametrize("flag, file, says", [
    ("--prompt-file", "missing", "--prompt-file {missing} does not exist."),
    ("--prompt-file", "latin1", "--prompt-file {latin1} is not UTF-8 text (byte 3 is not)."),
    ("--prompt-file", "adir", "--prompt-file {adir} is a directory, not a file."),
    ("--prompt-file", "big_prompts", "--prompt-file {big_prompts} is larger than 64 MiB, the most such a file may be."),
    ("--body-file", "missing", "--body-file {missing} does not exist."),
    ("--body-file", "latin1", "--body-file {latin1} is not UTF-8 text (byte 3 is not)."),
    ("--body-file", "adir", "--body-file {adir} is a directory, not a file."),
    ("--body-file", "big_body", "--body-file {big_body} is larger than 16 MiB, the most such a file may be."),
])
def test_a_bad_prompt_or_body_file_is_one_sentence_and_exit_2(tmp_path: Path, files: dict[str, str], flag: str,
                                                               file: str, says: str) -> None:
    openai = ["--openai", "chat"] if flag == "--prompt-file" else []
    p = _cli(NOWHERE, *openai, flag, files[file], "--requests", "1", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == f"gpuscope: {says.format(**files)}", p.stderr  # one line, no traceback


def test_a_prompt_file_without_prompts_or_with_a_bad_json_line_is_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    (tmp_path / "noprompt.jsonl").write_text('{"prompt": "a"}\n\n{"other": 1}\n')
    for name, says in (("blank.txt", "--prompt-file blank.txt holds no prompts."),
                       ("bad.jsonl", "Line 2 of --prompt-file bad.jsonl is not valid JSON."),
                       ("noprompt.jsonl", 'Line 3 of --prompt-file noprompt.jsonl is JSON without a "prompt" string.')):
        p = _cli(NOWHERE, "--openai", "chat", "--prompt-file", name, "--requests", "1", cwd=tmp_path)
        assert p.returncode == 2 and p.stderr.strip() == f"gpuscope: {says}", p.stderr


def test_load_prompts_reads_lines_and_json_lines_and_keeps_to_its_cap(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'\xef\xbb\xbfone prompt\r\n{"prompt": "two"}\n\n{"text": "three \\u00e9"}\n')
    assert load_prompts(f) == ["one prompt", "two", "three \u00e9"]  # the byte-order mark dropped, CRLF split
    with pytest.raises(InputFileError, match=r"^The prompt file .*p\.jsonl is larger than 16 bytes, the most"):
        load_prompts(f, max_bytes=16)
    assert issubclass(InputFileError, ValueError)  # callers that caught ValueError still do


def test_a_body_file_is_sent_byte_for_byte(tmp_path: Path) -> None:
    body = '{"prompt": "caf\u00e9",\r\n "n": 1}\n'
    (tmp_path / "body.json").write_bytes(body.encode())
    with LoadtestServer() as srv:
        p = _cli(srv.url("/latency"), "--body-file", "body.json", "--requests", "2", "--workers", "1", cwd=tmp_path)
        # a loaded machine may send them late, which makes the run invalid (exit 1): not what is tested here
        assert p.returncode == 0 or (p.returncode == 1 and p.stderr.startswith("INVALID RUN: ")
                                     and " late" in p.stderr), p.stderr
        sent = [a[2] for a in srv.applied()]
    assert sent == [body, body]  # CRLF kept: Path.read_text() turned it into LF before
