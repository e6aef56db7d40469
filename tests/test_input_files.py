"""Every file a user hands gpuscope goes through gpuscope._files: a number of 5,000 digits, a file over the
size cap, nesting past the depth cap and bytes that are not UTF-8 are each one sentence naming the file
and exit 2, never a traceback (agent --config, alerts check, guard check driven as real subprocesses;
stage, replay and request files through their loaders)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuscope import _files
from gpuscope.errors import UsageError
from gpuscope.loadtest.jsonl import json_lines
from gpuscope.loadtest.requests import ReplayError, load_replay
from gpuscope.loadtest.schedule import ScheduleError, load_stage_file
from gpuscope.loadtest.templates import TemplateError, load_request_file

ROOT = Path(__file__).resolve().parents[1]
DIGITS = "9" * 5000
BIG = _files.MAX_FILE_BYTES + 1

# What each file kind holds when it is bad in one way; {x} is the bad part.
TOML = {"digits": f"[agent]\nport = {DIGITS}\n", "deep": "a = " + "[" * 100 + "]" * 100 + "\n",
        "large": "# " + "x" * BIG + "\n", "binary": b"[agent]\nport = 1 # \xff\xfe\n"}
YAML = {"digits": f"a: {DIGITS}\n", "deep": "a: " + "[" * 100 + "]" * 100 + "\n",
        "large": "# " + "x" * BIG + "\n", "binary": b"a: \xff\xfe\n"}
JSON = {"digits": f'[{{"duration": "1s", "rate": {DIGITS}}}]', "deep": "[" * 100 + "]" * 100,
        "large": " " * BIG + "[]", "binary": b'["\xff"]'}
SAYS = {"digits": "holds a number of more than", "deep": "is nested too deep", "large": "is larger than 1 MiB",
        "binary": "is not UTF-8 text"}
# 2**64: below Python's digit limit, above what a 64-bit whole number holds (TOML's own rule)
WIDE = {"toml": "[agent]\nport = 18446744073709551616\n", "yaml": "a: 18446744073709551616\n"}


def _write(path: Path, content: str | bytes) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def _gpuscope(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("GPUSCOPE_URL", None)
    return subprocess.run([sys.executable, "-m", "gpuscope", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120, stdin=subprocess.DEVNULL)


def _one_sentence(p: subprocess.CompletedProcess[str], needle: str, name: str) -> None:
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuscope: "), p.stderr
    assert needle in lines[0] and name in lines[0], lines[0]


@pytest.mark.parametrize("problem", sorted(SAYS))
@pytest.mark.parametrize("verb, suffix", [("agent --config", ".toml"), ("alerts check", ".toml"),
                                          ("alerts check", ".yaml"), ("guard check", ".yaml"),
                                          ("guard check", ".toml")])
def test_the_cli_says_one_sentence_for_each_bad_file(tmp_path, verb, suffix, problem):
    content = (TOML if suffix == ".toml" else YAML)[problem]
    f = _write(tmp_path / f"bad-{problem}{suffix}", content)
    extra = ["--data-dir", str(tmp_path / "d")] if verb.startswith("agent") else []
    _one_sentence(_gpuscope(*verb.split(), str(f), *extra, cwd=tmp_path), SAYS[problem], f.name)
    assert not (tmp_path / "d").exists()  # the agent stopped before it made its data directory


@pytest.mark.parametrize("verb, suffix", [("alerts check", ".toml"), ("guard check", ".yaml")])
def test_a_whole_number_past_64_bits_is_one_sentence(tmp_path, verb, suffix):
    f = _write(tmp_path / f"wide{suffix}", WIDE[suffix[1:]])
    _one_sentence(_gpuscope(*verb.split(), str(f), cwd=tmp_path), "must fit in 64 bits", f.name)


def test_a_rule_file_named_by_the_agent_config_is_capped_too(tmp_path):
    _write(tmp_path / "rules.yaml", YAML["digits"])
    cfg = _write(tmp_path / "agent.toml", '[alerts]\nrule_files = ["rules.yaml"]\n')
    p = _gpuscope("agent", "--config", str(cfg), "--data-dir", str(tmp_path / "d"), cwd=tmp_path)
    _one_sentence(p, SAYS["digits"], "rules.yaml")


@pytest.mark.parametrize("problem", sorted(SAYS))
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_stage_file(tmp_path, suffix, problem):
    content = (YAML if suffix == ".yaml" else JSON)[problem]
    f = _write(tmp_path / f"stages{suffix}", content)
    with pytest.raises(ScheduleError) as e:
        load_stage_file(f)
    msg = str(e.value)
    assert SAYS[problem] in msg and str(f) in msg and "\n" not in msg


@pytest.mark.parametrize("loader, error", [(load_replay, ReplayError), (load_request_file, TemplateError)])
def test_a_json_lines_file_has_a_cap_per_line_not_per_file(tmp_path, loader, error):
    line = '{"t": 0, "path": "/x", "body": "' + "y" * 3000 + '"}\n'
    f = _write(tmp_path / "r.jsonl", line * 400)  # 1.2 MB: more than a config may be, fine as lines
    got = loader(f)
    assert len(got[1] if loader is load_replay else got) == 400
    with pytest.raises(error, match=r"^Line 1 of the file .*r\.jsonl is longer than 2 KiB, the most one line may be\.$"):
        list(json_lines(f, f"the file {f}", error, max_line_bytes=2048))
    assert len(list(json_lines(f, "x", error, max_line_bytes=len(line) - 1))) == 400  # the newline is not counted


@pytest.mark.parametrize("content, says", [
    ('{"t": 0, "n": ' + DIGITS + "}\n", "holds a number too large"),
    ("[" * 2000 + "]" * 2000 + "\n", "is nested too deep"),
    (b'{"t": 0, "path": "/\xff"}\n', "is not UTF-8 text"),
])
def test_a_bad_replay_line(tmp_path, content, says):
    f = _write(tmp_path / "r.jsonl", b'{"t": 0}\n' + (content if isinstance(content, bytes) else content.encode()))
    with pytest.raises(ReplayError) as e:
        load_replay(f)
    assert says in str(e.value) and "r.jsonl" in str(e.value)


def test_a_missing_replay_file_is_one_sentence(tmp_path):
    with pytest.raises(ReplayError, match="does not exist"):
        load_replay(tmp_path / "none.jsonl")


# -- the reader itself ---------------------------------------------------------------------------------

def test_a_file_at_the_cap_is_read_and_one_byte_more_is_not(tmp_path):
    f = _write(tmp_path / "c.toml", "a = 1\n" + "#" * (_files.MAX_FILE_BYTES - 7) + "\n")
    assert os.path.getsize(f) == _files.MAX_FILE_BYTES
    assert _files.load_toml(f, "the file") == {"a": 1}
    f.write_bytes(f.read_bytes() + b"\n")
    with pytest.raises(_files.InputFileError, match="is larger than 1 MiB"):
        _files.load_toml(f, "the file")


def test_nesting_at_the_cap_is_read_and_one_level_more_is_not(tmp_path):
    ok = "[" * _files.MAX_DEPTH + "]" * _files.MAX_DEPTH
    assert _files.parse_json(ok, "x") is not None
    with pytest.raises(_files.InputFileError, match="nested too deep"):
        _files.parse_json("[" + ok + "]", "x")


def test_yaml_aliases_are_walked_once(tmp_path):
    # a "billion laughs" file: nine levels of nine aliases would be 9**9 nodes if each were walked
    lines = ["a0: &a0 [1]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    doc = _files.parse_yaml("\n".join(lines), "x")
    assert len(doc["a9"]) == 9


def test_errors_are_usage_errors_naming_the_file(tmp_path):
    with pytest.raises(UsageError) as e:
        _files.read_text(tmp_path / "none.toml", "the config file none.toml")
    assert str(e.value) == "The config file none.toml does not exist." and e.value.exit_code == 2
    with pytest.raises(UsageError, match="is a directory"):
        _files.read_text(tmp_path, "the config file x")
    with pytest.raises(UsageError, match="^X is not valid YAML at line 2, column 1: "):
        _files.parse_yaml("a: [", "x")
    with pytest.raises(UsageError, match="is not valid YAML: month must be in 1..12"):
        _files.parse_yaml("a: 2024-13-45", "x")
