"""What a user reads when something they typed is wrong: one sentence that names the flag, verb or config key
they have (never Python API), a "did you mean" for a near miss, the GPUs there are for a GPU that is not,
and a data directory that is a file called a file.

The agent is real (a simulated node of 4 GPUs, on loopback, in a subprocess); the other verbs run in
this process through `gpuscope.cli.main`, as the console script calls it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import _Process, free_port, http_get

import gpuscope
from gpuscope._choices import closest, did_you_mean, gpu_list, no_such_gpu
from gpuscope.cli import build_parser, main

SRC = Path(gpuscope.__file__).resolve().parents[1]  # the checkout under test, also for the subprocesses

# Python API in a sentence for the user: a call (`Store.series()`), a keyword argument (`readonly=True`), a Python
# type name or literal where a file's value is meant ("not list", "NoneType", "not True" for TOML's true), a dotted
# module path (gpuscope.catalog.CATALOG).
PYTHON_API = re.compile(r"[A-Za-z_]\(\)|\w=(True|False|None)\b|\breadonly\b|\bNoneType\b|\bnot (True|False|None)\b"
                        r"|\bnot (list|dict|str|int|float|bool)\b|\b(is|holds) an? (int|str|dict|float|bool)\b"
                        r"|\bgpuscope\.(?!toml|yaml|yml|json|html)[a-z_]+")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def sentence(err: str) -> str:
    """The one line `gpuscope: ...` of stderr, without its prefix."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuscope: "), err
    assert "Traceback" not in err
    return lines[0].removeprefix("gpuscope: ")


def gpuscope_cli(*args: str, env_extra: dict[str, str] | None = None, cwd: Path | None = None,
                 ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("GPUSCOPE_URL", None)
    env.pop("GPUSCOPE_TOKEN", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "gpuscope", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=60, stdin=subprocess.DEVNULL)


# -- the shared kit ---------------------------------------------------------------------------------------

def test_did_you_mean_names_the_closest_choice_or_falls_back():
    keys = ["interval", "gpm_window", "slow", "processes", "host", "gpm_graphics"]
    assert did_you_mean("intervl", keys, "x") == "did you mean 'interval'?"
    assert did_you_mean("gpm_graphic", keys, "x") == "did you mean 'gpm_graphics'?"
    assert did_you_mean("zzzz", keys, "known keys: ...") == "known keys: ..."
    assert closest("zzzz", keys) is None


@pytest.mark.parametrize("gpus, shown", [
    (["0", "1", "2", "3", "4", "5", "6", "7"], "0-7"),
    (["3", "1", "0", "2"], "0-3"),  # in order, whatever order the store gave
    (["0", "2", "5"], "0, 2, 5"),
    (["0", "1", "4", "5", "6"], "0, 1, 4-6"),
    (["10", "9", "11"], "9-11"),  # numerically, not as text
    (["0", "1", "0/mig1"], "0, 1, 0/mig1"),
])
def test_gpu_list_writes_runs_of_indices_as_ranges(gpus, shown):
    assert gpu_list(gpus) == shown


def test_no_such_gpu_says_which_there_are():
    assert no_such_gpu("99", [str(i) for i in range(8)], "this agent") == "No GPU 99 here; this agent has GPUs 0-7."
    assert no_such_gpu("1", ["0"], "this agent") == "No GPU 1 here; this agent has GPU 0."
    assert no_such_gpu("0", [], "this agent") == "No GPU 0 here; this agent has recorded no GPU yet."


# -- a real agent -----------------------------------------------------------------------------------------

class Agent(_Process):
    """`gpuscope agent` on a simulated node of 4 GPUs."""

    name = "agent"
    ready_path = "/api/v1/status"

    def __init__(self, tmp: Path) -> None:
        super().__init__()
        self.data = tmp / "data"
        self.start(tmp)
        self.token = (self.data / "token").read_text().strip()

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "gpuscope", "agent", "--simulate", "healthy", "--gpus", "4",
                "--port", str(self.port), "--data-dir", str(self.data), "--interval", "100ms"]


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> Iterator[Agent]:
    a = Agent(tmp_path_factory.mktemp("agent"))
    try:
        # The store learns a GPU's series at its first flush (1 s); until then the agent knows no GPU.
        deadline = time.monotonic() + 30
        while True:
            status, body = http_get(a.url + "/api/v1/labels", timeout=10)
            if status == 200 and len(json.loads(body)["labels"].get("gpu", [])) == 4:
                break
            assert time.monotonic() < deadline, f"the agent stored no 4 GPUs in 30 s: {body[:300]!r}\n{a.log_tail()}"
            time.sleep(0.2)
        yield a
    finally:
        a.stop()


@pytest.mark.parametrize("flags", [["--gpu", "99"], ["--label", "gpu=7"]], ids=" ".join)
def test_query_for_a_gpu_that_is_not_there_names_the_gpus_there_are(agent, capsys, flags):
    # It printed "no data for gpu_sm_active_ratio in that range" and exited 0.
    code, _, err = run_cli(capsys, "query", "gpu_sm_active_ratio", "--url", agent.url, *flags)
    gpu = flags[1].removeprefix("gpu=")
    assert (code, sentence(err)) == (2, f"The agent at {agent.url} answered 400: No GPU {gpu} here; "
                                        "this agent has GPUs 0-3.")


def test_query_for_a_gpu_that_is_there_still_answers(agent, capsys):
    code, out, err = run_cli(capsys, "query", "gpu_sm_active_ratio", "--url", agent.url, "--gpu", "2",
                             "--since", "1m", "--format", "json")
    assert code == 0, err
    series = json.loads(out)["series"]
    assert series and {s["labels"]["gpu"] for s in series} == {"2"}


def test_the_json_api_answers_a_gpu_that_is_not_there_with_a_400(agent):
    qs = urllib.parse.urlencode({"metric": "gpu_sm_active_ratio", "start": "-1m", "gpu": "4"})
    status, body = http_get(f"{agent.url}/api/v1/query_range?{qs}", timeout=10)
    assert (status, json.loads(body)["error"]) == (400, "No GPU 4 here; this agent has GPUs 0-3.")


def test_a_posted_event_with_a_misspelt_field_gets_a_suggestion(agent):
    event = {"kind": "guard", "type": "shed", "severity": "warning", "mesage": "m", "source": "s"}
    req = urllib.request.Request(f"{agent.url}/api/v1/events", data=json.dumps(event).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {agent.token}",
                                          "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"] == "mesage is not an event field; did you mean 'message'?"


def test_a_posted_event_that_is_no_object_is_named_in_json_words(agent):
    req = urllib.request.Request(f"{agent.url}/api/v1/events", data=b"[5]", method="POST",
                                 headers={"Authorization": f"Bearer {agent.token}",
                                          "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    error = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and error.endswith("must be a JSON object, not a number."), error  # was "not int"


# -- --data-dir that is a file ------------------------------------------------------------------------------

def _verbs_with(option: str) -> set[str]:
    """Every verb (and action: 'alerts list') whose parser takes `option`."""
    found: set[str] = set()

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if option in action.option_strings:
                found.add(name)
            if isinstance(action, argparse._SubParsersAction):
                for verb, sub in action.choices.items():
                    walk(sub, f"{name} {verb}".strip())

    walk(build_parser(), "")
    return found


# The least each verb needs to reach its --data-dir; an agent nobody runs (port 1) where one is asked for.
DATA_DIR_VERBS = {
    "agent": ["agent", "--simulate", "healthy", "--port", "{port}"],
    "query": ["query", "gpu_sm_active_ratio", "--url", "http://127.0.0.1:1"],
    "export": ["export", "--out", "{tmp}/out.csv"],
    "diagnose": ["diagnose", "--since", "1h"],
    "top": ["top", "--once", "--url", "http://127.0.0.1:1"],
    "profile": ["profile", "--agents", "http://127.0.0.1:1", "--out", "{tmp}/out.pb.gz"],
}


def test_every_verb_that_takes_data_dir_is_checked_below():
    assert _verbs_with("--data-dir") == set(DATA_DIR_VERBS)


@pytest.mark.parametrize("verb", sorted(DATA_DIR_VERBS))
def test_a_data_dir_that_is_a_file_is_called_a_file(tmp_path, capsys, verb):
    # The agent said "The data directory F is not writable: File exists"; the store verbs "No gpuscope store at
    # F/store"; query and top read no token from it and said nothing.
    afile = tmp_path / "afile"
    afile.write_text("")
    argv = [a.format(tmp=tmp_path, port=free_port()) for a in DATA_DIR_VERBS[verb]]
    code, _, err = run_cli(capsys, *argv, "--data-dir", str(afile))
    assert (code, sentence(err)) == (2, f"--data-dir {afile} is a file, not a directory.")
    code, _, err = run_cli(capsys, *argv, "--data-dir", str(afile / "sub"))
    assert (code, sentence(err)) == (2, f"--data-dir {afile / 'sub'} lies below {afile}, which is a file, "
                                        "not a directory.")


def test_a_config_data_dir_that_is_a_file_names_the_config_key(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[agent]\ndata_dir = "{afile}"\n')
    code, _, err = run_cli(capsys, "agent", "--config", str(cfg), "--simulate", "healthy", "--port", str(free_port()))
    assert (code, sentence(err)) == (2, f"{cfg}: [agent] data_dir {afile} is a file, not a directory.")


def test_the_agent_itself_calls_a_data_dir_that_is_a_file_a_file(tmp_path):
    # Through the Python API, where no flag was checked first (it said "not writable: File exists").
    from gpuscope.agent import Agent, AgentError
    from gpuscope.agent.config import from_dict

    afile = tmp_path / "afile"
    afile.write_text("")
    agent = Agent(from_dict({"agent": {"data_dir": str(afile), "port": free_port()}}), simulate="healthy")
    with pytest.raises(AgentError) as e:
        agent.run()
    assert str(e.value) == f"The data directory {afile} is a file, not a directory; choose another with --data-dir."


# -- did you mean -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, said", [
    ('[sampler]\nintervl = "1s"\n', "unknown key 'intervl' in [sampler]; did you mean 'interval'?"),
    ("[sampler]\ngpm_graphic = true\n", "unknown key 'gpm_graphic' in [sampler]; did you mean 'gpm_graphics'?"),
    ('[samplr]\ninterval = "1s"\n', "unknown section [samplr]; did you mean [sampler]?"),
    ('[agent]\ninterval = "1s"\n', "unknown key 'interval' in [agent]; it belongs in [sampler] or [remote_write]."),
    ("[agent]\nzzzz = 1\n", "unknown key 'zzzz' in [agent]; known keys: bind, port, data_dir,"),
    ("[zzzzz]\nzzzz = 1\n", "unknown section [zzzzz]; the sections are [agent], [sampler],"),
])
def test_an_unknown_agent_config_key_gets_the_key_it_misspells(tmp_path, capsys, text, said):
    cfg = tmp_path / "agent.toml"
    cfg.write_text(text)
    code, _, err = run_cli(capsys, "agent", "--config", str(cfg))
    assert code == 2 and sentence(err).startswith(f"{cfg}: {said}"), err


@pytest.mark.parametrize("text, said", [
    ("clases: [{name: a}]\n", "Unknown key 'clases'; did you mean 'classes'?"),
    ("classes: [{name: a, shar: 0.5}]\n", "Unknown key classes[0].shar; did you mean 'share'?"),
    ("classes: [{name: a}]\nzzzz: 1\n", "Unknown key 'zzzz'; the top level takes "),
    ("classes: [5]\n", "classes[0] must be a mapping, not a number."),  # was "not int"
])
def test_an_unknown_guard_config_key_gets_the_key_it_misspells(tmp_path, capsys, text, said):
    cfg = tmp_path / "guard.yaml"
    cfg.write_text(text)
    code, _, err = run_cli(capsys, "guard", "check", str(cfg))
    assert code == 2 and sentence(err).startswith(f"{cfg}: {said}"), err


def test_an_unknown_scenario_gets_the_scenario_it_misspells(capsys):
    code, _, err = run_cli(capsys, "top", "--once", "--simulate", "helthy")
    assert (code, sentence(err)) == (2, "Unknown scenario 'helthy'; did you mean 'healthy'?")
    code, _, err = run_cli(capsys, "top", "--once", "--simulate", "zzzz")
    assert code == 2 and sentence(err).startswith("Unknown scenario 'zzzz'; choose one of: compute_bound,"), err


def test_an_alert_rule_on_an_unknown_metric_names_a_command_not_a_python_name(tmp_path, capsys):
    rules = tmp_path / "r.toml"
    rules.write_text('[[rules]]\nname = "A"\nmetric = "zzzz"\ncondition = "> 1"\n')
    code, _, err = run_cli(capsys, "alerts", "check", str(rules))
    said = sentence(err)
    assert code == 2 and "'gpuscope doctor --json'" in said and not PYTHON_API.search(said), said
    rules.write_text('[[rules]]\nname = "A"\nmetric = "gpu_temperature_celsiu"\ncondition = "> 1"\n')
    code, _, err = run_cli(capsys, "alerts", "check", str(rules))
    assert code == 2 and sentence(err).endswith("did you mean 'gpu_temperature_celsius'?"), err


# -- no Python API in what the user reads ------------------------------------------------------------------

def test_the_pattern_finds_what_it_must():
    for bad in ["(Store.series() lists what is stored).", "or open the store with readonly=True.",
                "classes[0] must be a mapping, not list.", "traceEvents is a int, not a list",
                "in gpuscope.catalog.CATALOG.", "(SamplerConfig(gpm_graphics=True))", "(gpuscope.viewmodel)",
                "[agent] port must be a whole number, not True."]:
        assert PYTHON_API.search(bad), bad
    for fine in ["--data-dir /x is a file, not a directory.", "see 'gpuscope top --help'",
                 "enable with [sampler] gpm_graphics = true", "gpuscope run -- python train.py.",
                 "must be a JSON object, not a list.", "[agent] port must be a whole number, not true."]:
        assert not PYTHON_API.search(fine), fine


def _bad_invocations(tmp: Path) -> list[list[str]]:
    """A corpus of mistakes, each ending in one sentence: flags, values, files of every kind."""
    (tmp / "afile").write_text("")
    files = {
        "agent.toml": '[sampler]\nintervl = "1s"\n', "agent2.toml": "[agent]\nport = true\n",
        "guard.yaml": "classes: [{name: a, shar: 0.5}]\n", "guard2.yaml": "classes: 5\n",
        "guard3.toml": "classes = [5]\n", "rules.toml": '[[rules]]\nname = "A"\nmetric = "zzzz"\ncondition = "> 1"\n',
        "rules2.yaml": "rules: [5]\n", "trace.json": '{"traceEvents": 5}', "trace2.json": '{"traceEvents": [5]}',
        "trace3.json": '{"traceEvents": [{"ph": "X", "name": "k", "ts": 1, "dur": 1, "args": [1]}]}',
        "stages.yaml": "- {duration: 1s, rate: 5, colour: red}\n", "guard4.yaml": "classes: [{name: a, share: true}]\n",
        "rules3.toml": '[[rules]]\nname = "A"\nmetric = "gpu_temperature_celsius"\ncondition = "> 1"\nfor = true\n',
        "rules4.yaml": "rules: [{name: null}]\n", "agent3.toml": "[agent]\nbind = false\n",
    }
    for name, text in files.items():
        (tmp / name).write_text(text)
    t = str(tmp)
    return [
        ["qurey"], ["query"], ["query", "m", "--format", "jsn"], ["query", "m", "--since", "soon"],
        ["query", "m", "--label", "novalue", "--url", "http://127.0.0.1:1"],
        ["top", "--once", "--simulate", "helthy"], ["top", "--refresh", "0"], ["sample", "--gpus", "3"],
        ["agent", "--config", f"{t}/agent.toml"], ["agent", "--config", f"{t}/agent2.toml"],
        ["agent", "--config", f"{t}/missing.toml"], ["agent", "--data-dir", f"{t}/afile", "--simulate", "healthy"],
        ["export", "--out", f"{t}/x.csv", "--data-dir", f"{t}/afile"], ["export", "--out", f"{t}/x.bin"],
        ["diagnose", "--since", "1h", "--data-dir", f"{t}/nothing"], ["diagnose", "--seconds", "1"],
        ["guard", "check", f"{t}/guard.yaml"], ["guard", "check", f"{t}/guard2.yaml"],
        ["guard", "check", f"{t}/guard3.toml"], ["guard", "check", f"{t}/guard4.yaml"],
        ["alerts", "check", f"{t}/rules.toml"], ["alerts", "check", f"{t}/rules3.toml"],
        ["alerts", "check", f"{t}/rules4.yaml"], ["agent", "--config", f"{t}/agent3.toml"],
        ["alerts", "check", f"{t}/rules2.yaml"], ["alerts"], ["trace", "analyze", f"{t}/trace.json"],
        ["trace", "analyze", f"{t}/trace2.json"], ["trace", "analyze", f"{t}/trace3.json"],
        ["loadtest", "http://127.0.0.1:1/", "--stage-file", f"{t}/stages.yaml", "--no-gpu", "--out", f"{t}/lt"],
        ["run", "--simulate", "healthy", "--no-html", "--", ""],
    ]


def test_no_sentence_of_a_corpus_of_mistakes_names_python_api(tmp_path, capsys):
    said = []
    for argv in _bad_invocations(tmp_path):
        code, _, err = run_cli(capsys, *argv)
        assert code in (1, 2), (argv, code, err)
        said.append((argv, sentence(err)))
    leaks = [(argv, s) for argv, s in said if PYTHON_API.search(s)]
    assert not leaks, "\n".join(f"{' '.join(a)}: {s}" for a, s in leaks)


def test_no_sentence_about_the_agents_store_names_python_api(agent, capsys):
    # An unknown metric comes from the store's own sentence (it named Store.series()).
    code, _, err = run_cli(capsys, "query", "gpu_sm_activ_ratio", "--url", agent.url)
    said = sentence(err)
    assert code == 2 and said.startswith(f"The agent at {agent.url} answered 400: Unknown metric"), said
    assert not PYTHON_API.search(said), said


def test_a_second_agent_on_the_same_data_dir_names_no_python_api(agent):
    p = gpuscope_cli("agent", "--simulate", "healthy", "--port", str(free_port()), "--data-dir", str(agent.data))
    said = sentence(p.stderr)
    assert p.returncode == 1 and "Another agent already uses" in said, said
    assert not PYTHON_API.search(said), said


def test_doctor_names_config_keys_not_python_api(capsys):
    # The GPM graphics metric's reason ended in "(SamplerConfig(gpm_graphics=True))".
    code, out, _ = run_cli(capsys, "doctor", "--simulate", "healthy")
    assert code == 0 and "[sampler] gpm_graphics = true" in out, out
    assert not PYTHON_API.search(out), PYTHON_API.search(out)


def _helps() -> Iterator[tuple[str, str]]:
    def walk(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, str]]:
        yield name, parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for verb, sub in action.choices.items():
                    yield from walk(sub, f"{name} {verb}")

    yield from walk(build_parser(), "gpuscope")


def test_no_help_names_python_api():
    helps = dict(_helps())
    assert {"gpuscope", "gpuscope top", "gpuscope alerts list", "gpuscope guard proxy"} <= set(helps)
    leaks = {name: m.group(0) for name, text in helps.items() if (m := PYTHON_API.search(text))}
    assert not leaks, leaks  # 'top --json' said "(gpuscope.viewmodel)"


def test_every_verb_says_what_it_does():
    # `gpuscope scenarios --help` had no description at all.
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bare = [verb for verb, p in sub.choices.items() if not p.description]
    assert not bare, bare


def test_events_for_a_gpu_that_is_not_there_is_a_400_naming_the_gpus_there_are(agent):
    # It answered an empty list, as if that GPU had had no events.
    status, body = http_get(f"{agent.url}/api/v1/events?gpu=99&start=-1h", timeout=10)
    assert (status, json.loads(body)["error"]) == (400, "No GPU 99 here; this agent has GPUs 0-3.")
    status, body = http_get(f"{agent.url}/api/v1/events?gpu=2&start=-1h", timeout=10)
    assert status == 200 and isinstance(json.loads(body)["events"], list)
