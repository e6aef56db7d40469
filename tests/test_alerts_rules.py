"""Alert rule files: TOML and YAML parse to the same rules; every mistake is one sentence naming the
file, the rule and the key; built-ins can be overridden and disabled; the Prometheus export passes promtool."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml
from servers import need_binary

from gpuscope import cli
from gpuscope.alerts import BUILTIN_RULES, RuleError, load_rules, to_prometheus
from gpuscope.alerts.promrules import expr

GOOD_TOML = """
disable = ["GpuIdleAllocated"]

[[rules]]
name = "GpuHot"
metric = "gpu_temperature_celsius"
agg = "max"
window = "1m"
condition = "> 85"
resolve_threshold = 80
for = "2m"
keep_firing_for = "30s"
severity = "critical"
labels = { team = "ml" }
summary = "GPU {gpu} on {hostname} at {value:.0f} C"

[[rules]]
name = "GpuThrottled"            # replaces the built-in
verdict = "throttled"
window = "1m"
for = "5m"
min_confidence = 0.5

[[rules]]
name = "Xid79"
metric = "gpu_xid_events_total"
match = { xid = "79" }
condition = "> 0"
"""

GOOD_YAML = """
disable: [GpuIdleAllocated]
rules:
  - name: GpuHot
    metric: gpu_temperature_celsius
    agg: max
    window: 1m
    condition: "> 85"
    resolve_threshold: 80
    for: 2m
    keep_firing_for: 30s
    severity: critical
    labels: {team: ml}
    summary: "GPU {gpu} on {hostname} at {value:.0f} C"
  - name: GpuThrottled
    verdict: throttled
    window: 1m
    for: 5m
    min_confidence: 0.5
  - name: Xid79
    metric: gpu_xid_events_total
    match: {xid: "79"}
    condition: "> 0"
"""


def write(tmp_path, text, name="rules.toml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_toml_and_yaml_give_the_same_rules(tmp_path):
    a = load_rules([write(tmp_path, GOOD_TOML)])
    b = load_rules([write(tmp_path, GOOD_YAML, "rules.yaml")])
    strip = [(r.name, r.metric, r.verdict, r.agg, r.window_s, r.op, r.threshold, r.resolve_threshold, r.match,
              r.for_s, r.keep_firing_for_s, r.severity, r.labels, r.summary, r.min_confidence) for r in a]
    assert strip == [(r.name, r.metric, r.verdict, r.agg, r.window_s, r.op, r.threshold, r.resolve_threshold,
                      r.match, r.for_s, r.keep_firing_for_s, r.severity, r.labels, r.summary, r.min_confidence)
                     for r in b]
    by = {r.name: r for r in a}
    assert "GpuIdleAllocated" not in by  # disabled
    assert by["GpuThrottled"].for_s == 300 and by["GpuThrottled"].source.endswith("rules.toml")  # overridden
    assert by["GpuLost"].source == "built-in"
    hot = by["GpuHot"]
    assert (hot.agg, hot.window_s, hot.op, hot.threshold, hot.resolve_threshold, hot.for_s) == ("max", 60, ">", 85, 80, 120)
    assert hot.labels == (("team", "ml"),) and hot.severity == "critical"
    assert by["Xid79"].agg == "increase"  # counters default to increase
    assert hot.holds(83, firing=True) and not hot.holds(83, firing=False) and not hot.holds(80, firing=True)


def test_builtins_off_and_empty_file(tmp_path):
    assert load_rules([write(tmp_path, "builtins = false\n")]) == []
    assert [r.name for r in load_rules([write(tmp_path, "", "empty.yaml")])] == [r.name for r in BUILTIN_RULES]


BAD = [
    # (file text, suffix, words the one sentence must hold)
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_temprature_celsius'\ncondition = '> 1'\n", ".toml",
     ["rule 'A'", "metric", "'gpu_temprature_celsius'", "did you mean 'gpu_temperature_celsius'"]),
    ("[[rules]]\nname = 'A'\nmetric = 'banana_metric'\ncondition = '> 1'\n", ".toml",
     ["rule 'A'", "unknown metric 'banana_metric'", "gpuscope doctor"]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_power_watts'\ncondtion = '> 1'\n", ".toml",
     ["rule 'A'", "unknown key 'condtion'", "did you mean 'condition'"]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_power_watts'\n", ".toml", ["rule 'A'", "needs a condition"]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_power_watts'\ncondition = 'above 3'\n", ".toml",
     ["rule 'A'", "condition 'above 3'", "operator"]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_power_watts'\ncondition = '> 1'\nwindow = 'soon'\n", ".toml",
     ["rule 'A'", "window", "duration"]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_power_watts'\ncondition = '> 1'\nfor = -5\n", ".toml",
     ["rule 'A'", "for", "non-negative"]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_power_watts'\ncondition = '> 100'\nresolve_threshold = 120\n", ".toml",
     ["rule 'A'", "resolve_threshold 120", "at or below the threshold 100"]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_power_watts'\ncondition = '== 1'\nresolve_threshold = 1\n", ".toml",
     ["rule 'A'", "resolve_threshold", "not =="]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_xid_events_total'\nagg = 'avg'\ncondition = '> 1'\n", ".toml",
     ["rule 'A'", "counter", "increase"]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_power_watts'\nagg = 'rate'\ncondition = '> 1'\n", ".toml",
     ["rule 'A'", "gauge", "avg"]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_power_watts'\nagg = 'median'\ncondition = '> 1'\n", ".toml",
     ["rule 'A'", "agg must be one of", "'median'"]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_xid_events_total'\nmatch = { code = '79' }\ncondition = '> 0'\n", ".toml",
     ["rule 'A'", "match", "no label 'code'", "xid"]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_process_memory_used_bytes'\ncondition = '> 0'\n", ".toml",
     ["rule 'A'", "per-process"]),
    ("[[rules]]\nname = 'A'\nverdict = 'launch_bond'\n", ".toml", ["rule 'A'", "did you mean 'launch_or_sync_bound'"]),
    ("[[rules]]\nname = 'A'\nverdict = 'throttled'\ncondition = '> 1'\n", ".toml",
     ["rule 'A'", "condition applies to metric rules only"]),
    ("[[rules]]\nname = 'A'\nverdict = 'throttled'\nwindow = '2s'\n", ".toml", ["rule 'A'", "at least 5s"]),
    ("[[rules]]\nname = 'A'\nverdict = 'throttled'\nmin_confidence = 3\n", ".toml", ["rule 'A'", "between 0 and 1"]),
    ("[[rules]]\nname = 'A'\nmetric = 'gpu_power_watts'\nverdict = 'throttled'\ncondition = '> 1'\n", ".toml",
     ["rule 'A'", "exactly one of metric"]),
    ("[[rules]]\nmetric = 'gpu_power_watts'\ncondition = '> 1'\n", ".toml", ["rule #1", "has no name"]),
    ("[[rules]]\nname = 'gpu hot!'\nverdict = 'throttled'\n", ".toml", ["name 'gpu hot!'", "letters, digits"]),
    ("[[rules]]\nname = 'A'\nverdict = 'throttled'\nseverity = 'page'\n", ".toml",
     ["rule 'A'", "severity", "'page'"]),
    ("[[rules]]\nname = 'A'\nverdict = 'throttled'\nlabels = { severity = 'x' }\n", ".toml",
     ["rule 'A'", "'severity' is set by gpuscope", "severity key"]),
    ("[[rules]]\nname = 'A'\nverdict = 'throttled'\nlabels = { 'bad-name' = 'x' }\n", ".toml",
     ["rule 'A'", "'bad-name' is not a label name"]),
    ("[[rules]]\nname = 'A'\nverdict = 'throttled'\nsummary = 'GPU {gpuu} hot'\n", ".toml",
     ["rule 'A'", "summary", "did you mean 'gpu'"]),
    ("[[rules]]\nname = 'A'\nverdict = 'throttled'\nsummary = 'GPU {gpu hot'\n", ".toml",
     ["rule 'A'", "summary", "not a valid template"]),
    ("[[rules]]\nname = 'A'\nverdict = 'throttled'\n[[rules]]\nname = 'A'\nverdict = 'idle'\n", ".toml",
     ["rule 'A'", "same name"]),
    ("[[rule]]\nname = 'A'\n", ".toml", ["unknown top-level key 'rule'", "[[rules]]"]),
    ("disable = ['GpuIdleAlocated']\n", ".toml", ["disable", "'GpuIdleAlocated'", "did you mean 'GpuIdleAllocated'"]),
    ("disable = 'GpuLost'\n", ".toml", ["disable must be a list"]),
    ("rules = 3\n", ".toml", ["rules must be a list"]),
    ("[[rules]]\nname = 'A'\nverdict = \n", ".toml", ["not valid TOML"]),
    ("rules:\n  - name: A\n    verdict: [throttled\n", ".yaml", ["not valid YAML", "line"]),
    ("- just\n- a list\n", ".yml", ["must hold a table"]),
    ("rules:\n  - just a string\n", ".yaml", ["rule #1", "must be a table"]),
    ("rules: []\n", ".json", ["must end in .toml, .yaml or .yml"]),
]


@pytest.mark.parametrize("text,suffix,words", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_every_mistake_is_one_sentence_naming_file_rule_and_key(tmp_path, text, suffix, words):
    path = write(tmp_path, text, "rules" + suffix)
    with pytest.raises(RuleError) as e:
        load_rules([path])
    msg = str(e.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    assert "\n" not in msg and msg.rstrip().endswith((".", "?")), msg
    assert "Traceback" not in msg


def test_missing_unreadable_and_binary_files(tmp_path):
    with pytest.raises(RuleError, match="does not exist"):
        load_rules([tmp_path / "nope.toml"])
    with pytest.raises(RuleError, match="is a directory"):
        (tmp_path / "d.toml").mkdir()
        load_rules([tmp_path / "d.toml"])
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00rules")
    with pytest.raises(RuleError, match="not UTF-8"):
        load_rules([tmp_path / "bin.toml"])


def test_cli_check_exit_codes(tmp_path, capsys):
    good = write(tmp_path, GOOD_TOML)
    assert cli.main(["alerts", "check", str(good)]) == 0
    out = capsys.readouterr().out
    assert "ok: 3 rule(s)" in out
    bad = write(tmp_path, BAD[0][0], "bad.toml")
    assert cli.main(["alerts", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'gpu_temperature_celsius'" in err and "Traceback" not in err
    assert cli.main(["alerts", "check", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_agent_config_refuses_a_bad_rule_file_with_its_sentence(tmp_path):
    from gpuscope.agent import config

    write(tmp_path, BAD[2][0], "bad.toml")
    (tmp_path / "agent.toml").write_text('[alerts]\nrule_files = "bad.toml"\nalertmanager_urls = ["http://am:9093"]\n')
    with pytest.raises(config.ConfigError, match="unknown key 'condtion'; did you mean 'condition'"):
        config.load(tmp_path / "agent.toml")  # found relative to the config file
    (tmp_path / "agent.toml").write_text('[alerts]\nslack_urls = ["hooks.slack.com/services/T0/B0/SECRET"]\n')
    with pytest.raises(config.ConfigError) as e:
        config.load(tmp_path / "agent.toml")
    assert "slack_urls" in str(e.value) and "SECRET" not in str(e.value)
    (tmp_path / "agent.toml").write_text('[alerts]\nevaluation_interval = "often"\n')
    with pytest.raises(config.ConfigError, match=r"\[alerts\] evaluation_interval"):
        config.load(tmp_path / "agent.toml")
    write(tmp_path, GOOD_YAML, "good.yaml")
    (tmp_path / "agent.toml").write_text('[alerts]\nrule_files = ["good.yaml"]\nevaluation_interval = "2s"\n')
    cfg = config.load(tmp_path / "agent.toml")
    assert cfg.alerts.rule_files == [str(tmp_path / "good.yaml")] and cfg.alerts.evaluation_interval == 2.0


# -- the Prometheus rule file --------------------------------------------------------------------------

def test_export_expressions(tmp_path):
    rules = {r.name: r for r in load_rules([write(tmp_path, GOOD_TOML)])}
    assert expr(rules["GpuLost"]) == "gpu_healthy < 1"
    assert expr(rules["GpuEccUncorrected"]) == "increase(gpu_ecc_uncorrected_errors_total[5m]) > 0"
    # an event counter born inside the window counts from zero, as the agent counts it
    assert expr(rules["Xid79"]) == ('(increase(gpu_xid_events_total{xid="79"}[1m]) or '
                                    '(gpu_xid_events_total{xid="79"} unless gpu_xid_events_total{xid="79"} offset 1m)) > 0')
    assert expr(rules["GpuThrottled"]) == 'gpu_verdict{kind="throttled",window="1m"} >= 0.5'
    hot = expr(rules["GpuHot"])
    assert hot.startswith("(max_over_time(gpu_temperature_celsius[1m]) > 85)\nor\n")
    assert 'and ignoring(alertname, alertstate, severity, team) ALERTS{alertname="GpuHot", alertstate="firing"}' in hot


def test_export_passes_promtool_check_rules(tmp_path, capsys):
    promtool = need_binary("promtool")
    out = tmp_path / "gpuscope-rules.yml"
    assert cli.main(["alerts", "export-rules", str(write(tmp_path, GOOD_TOML)), "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    by = {r["alert"]: r for r in doc["groups"][0]["rules"]}
    assert by["GpuHot"]["for"] == "2m" and by["GpuHot"]["keep_firing_for"] == "30s"
    assert by["GpuHot"]["labels"] == {"severity": "critical", "team": "ml"}
    assert by["GpuHot"]["annotations"]["summary"] == \
        'GPU {{ $labels.gpu }} on {{ $labels.hostname }} at {{ printf "%.0f" $value }} C'
    assert "GpuIdleAllocated" not in by
    p = subprocess.run([promtool, "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(by)} rules found" in p.stdout


def test_exported_hysteresis_and_for_behave_in_prometheus(tmp_path):
    """promtool's rule unit tests run the exported rule in Prometheus's own engine: it fires after
    `for`, stays firing between the resolve threshold and the threshold, and resolves below it."""
    promtool = need_binary("promtool")
    rule_file = tmp_path / "r.yml"
    rule_file.write_text(to_prometheus(load_rules([write(tmp_path, """
        builtins = false
        [[rules]]
        name = "GpuHot"
        metric = "gpu_temperature_celsius"
        agg = "last"
        condition = "> 85"
        resolve_threshold = 80
        for = "2m"
        summary = "GPU {gpu} at {value:.0f} C"
        """)])))
    # one sample a minute: 70, then 90 for 4 minutes, 83 for 3 minutes (between 80 and 85), then 75
    tests = {"rule_files": [str(rule_file)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": 'gpu_temperature_celsius{gpu="0",hostname="n1"}',
                          "values": "70 90 90 90 90 83 83 83 75 75"}],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "GpuHot", "exp_alerts": []},  # pending: for 2m not yet over
            {"eval_time": "3m", "alertname": "GpuHot", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "gpu": "0", "hostname": "n1"},
                 "exp_annotations": {"summary": "GPU 0 at 90 C"}}]},
            {"eval_time": "6m", "alertname": "GpuHot", "exp_alerts": [  # 83: held by the hysteresis
                {"exp_labels": {"severity": "warning", "gpu": "0", "hostname": "n1"},
                 "exp_annotations": {"summary": "GPU 0 at 83 C"}}]},
            {"eval_time": "8m", "alertname": "GpuHot", "exp_alerts": []},  # 75: resolved
        ]}]}
    tf = tmp_path / "t.yml"
    tf.write_text(yaml.safe_dump(tests))
    p = subprocess.run([promtool, "test", "rules", str(tf)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_readme_example_is_valid_and_exports(tmp_path):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Alerts"):]
    example = section[section.index("```toml") + len("```toml"):section.index("```", section.index("```toml") + 7)]
    rules = {r.name: r for r in load_rules([write(tmp_path, example)])}
    assert {"GpuHot", "Xid79", "TensorCoresUnused", "GpuLost"} <= set(rules) and "GpuIdleAllocated" not in rules
    promtool = need_binary("promtool")
    out = tmp_path / "readme-rules.yml"
    out.write_text(to_prometheus(list(rules.values())))
    p = subprocess.run([promtool, "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
