"""Rules that hold everywhere since the shared kit has one copy of each: one duration grammar, one error
base with its exit code."""

from __future__ import annotations

import pytest

from gpuscope import errors, timeparse
from gpuscope.loadtest import schedule


@pytest.mark.parametrize(("text", "seconds"), [("250ms", 0.25), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0),
                                               ("1d", 86400.0), ("1w", 604800.0), ("90", 90.0)])
def test_loadtest_durations_take_the_grammar_of_every_verb(text, seconds):
    assert schedule.parse_duration(text) == timeparse.parse_duration(text) == seconds


def test_loadtest_duration_errors_stay_one_sentence():
    with pytest.raises(schedule.ScheduleError, match=r"^'soon' is not a duration"):
        schedule.parse_duration("soon")


def test_loadtest_cli_takes_a_day(tmp_path):
    from gpuscope.loadtest import job

    assert job._duration("1d", "--duration") == 86400.0


def _user_errors():
    import gpuscope.agent
    import gpuscope.agent.client
    import gpuscope.agent.config
    import gpuscope.alerts.rules
    import gpuscope.diagnose.history
    import gpuscope.guard._config
    import gpuscope.loadtest.job
    import gpuscope.runcmd
    import gpuscope.sampler
    import gpuscope.sim
    import gpuscope.store
    import gpuscope.trace.model
    from gpuscope._nvml import NvmlUnavailable

    return [
        (NvmlUnavailable, 1), (gpuscope.agent.AgentError, 1), (gpuscope.agent.client.ClientError, 1),
        (gpuscope.agent.client.BadArgument, 2), (gpuscope.agent.config.ConfigError, 2),
        (gpuscope.alerts.rules.RuleError, 2), (gpuscope.diagnose.history.NoData, 1),
        (gpuscope.guard._config.GuardConfigError, 2), (gpuscope.loadtest.job.SetupError, 2),
        (schedule.ScheduleError, 2), (gpuscope.sampler.ConfigError, 2), (gpuscope.sim.UnknownScenario, 2),
        (gpuscope.store.StoreError, 2), (gpuscope.trace.model.TraceError, 2), (timeparse.TimeError, 2),
    ]


def test_every_one_sentence_error_is_a_user_error_with_its_exit_code():
    for cls, code in _user_errors():
        assert issubclass(cls, errors.UserError), cls
        assert cls("x").exit_code == code, cls


def test_run_error_carries_the_childs_code():
    from gpuscope.runcmd import RunError

    assert RunError("Command not found: nope.", 127).exit_code == 127
    assert RunError("Permission denied: ./x.", 126).exit_code == 126


def test_cli_main_exits_with_the_errors_code(capsys):
    from gpuscope import cli

    assert cli.main(["query", "gpu_sm_active_ratio", "--since", "abc"]) == 2  # TimeError
    assert "--since 'abc' is not a duration" in capsys.readouterr().err
    # No agent on this port: ClientError, exit 1, one line.
    assert cli.main(["query", "gpu_sm_active_ratio", "--url", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpuscope: ")


@pytest.mark.parametrize(("text", "seconds"), [("1m30s", 90.0), ("1h30m", 5400.0), ("2d12h", 216000.0),
                                               ("1y", 31536000.0)])
def test_prometheus_compound_durations_are_the_same_grammar(text, seconds):
    from gpuscope.web.promql_backend import parse_duration as prometheus_duration

    assert timeparse.parse_duration(text) == prometheus_duration(text) == seconds


@pytest.mark.parametrize("text", ["1m30", "m30s", "1.5.5s", "30x", ""])
def test_what_is_not_a_duration_is_refused_by_both(text):
    from gpuscope.web.promql_backend import parse_duration as prometheus_duration

    with pytest.raises(timeparse.TimeError):
        timeparse.parse_duration(text)
    assert prometheus_duration(text) is None


def test_every_verb_module_has_its_face():
    import importlib

    from gpuscope import cli

    for verb, module in cli.VERBS.items():
        mod = importlib.import_module(module)
        assert isinstance(mod.HELP, str) and mod.HELP, verb
        assert callable(mod.add_arguments) and callable(mod.run), verb


def test_sample_verb_runs(capsys):
    from gpuscope import cli

    assert cli.main(["sample", "--simulate", "healthy", "--gpus", "1", "--count", "1", "--every", "0.3s"]) == 0
    assert "GPU 0" in capsys.readouterr().out


def test_new_tokens_never_read_as_a_flag(monkeypatch):
    import secrets

    from gpuscope.http import auth

    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: "-" + "A" * 42)
    token = auth.new_token()
    assert not token.startswith("-") and len(token) == 43 and token[1:] == "A" * 42
