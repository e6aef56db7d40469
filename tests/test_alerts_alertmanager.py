"""Alerts end to end with real parts: a real Alertmanager receives an alert from the engine running on a
simulated node and then its resolution; a real agent process evaluates rules from its config, notifies
Alertmanager and a webhook, and serves /api/v1/alerts and gpu_verdict."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from servers import AlertmanagerServer, WebhookReceiver, free_port

from gpuscope import Sampler, SamplerConfig
from gpuscope.alerts import AlertmanagerNotifier, AlertService, LogNotifier, load_rules
from gpuscope.sim import PROFILES, SimulatedNode

ROOT = Path(__file__).resolve().parents[1]

RULES = """
builtins = false

[[rules]]
name = "GpuHot"
metric = "gpu_temperature_celsius"
agg = "max"
window = "2s"
condition = "> 85"
resolve_threshold = 80
severity = "critical"
labels = { team = "ml" }
summary = "GPU {gpu} on {hostname} at {value:.0f} C"
"""


def am_config(receiver_url: str) -> dict:
    """Alertmanager forwards to our webhook receiver, resolutions included, so the test sees what it did."""
    return {"route": {"receiver": "hook", "group_by": ["alertname"], "group_wait": "0s", "group_interval": "1s",
                      "repeat_interval": "1h"},
            "receivers": [{"name": "hook", "webhook_configs": [{"url": receiver_url, "send_resolved": True}]}]}


def test_alertmanager_receives_and_resolves_an_alert(tmp_path):
    with WebhookReceiver() as rx, AlertmanagerServer(tmp_path, am_config(rx.url + "/from-am")) as am:
        rules_file = tmp_path / "rules.toml"
        rules_file.write_text(RULES)
        node = SimulatedNode("throttled")  # 89 C; the real sampler reads it through the fake NVML
        sampler = Sampler(SamplerConfig(interval=0.05, collect_host=False), nvml=node.nvml,
                          host_reader=node.host_reader, host_source=node.host_source).start()
        svc = AlertService(sampler, load_rules([rules_file]), [AlertmanagerNotifier(am.url), LogNotifier()],
                           interval=0.25, generator_url="http://test/api/v1/alerts").start()
        try:
            got = am.wait_alerts(lambda a: any(x["labels"].get("alertname") == "GpuHot" for x in a))
            [alert] = got
            assert alert["status"]["state"] == "active"
            labels = alert["labels"]
            assert (labels["gpu"], labels["severity"], labels["team"], labels["hostname"]) == \
                ("0", "critical", "ml", sampler.hostname)
            assert labels["uuid"] == node.nvml.gpus[0].uuid
            assert alert["annotations"]["summary"].startswith(f"GPU 0 on {sampler.hostname} at 8")
            assert alert["generatorURL"] == "http://test/api/v1/alerts"
            rx.wait_for(lambda b: any(x["status"] == "firing" for x in b), path="/from-am")

            node.drivers[0].base = PROFILES["healthy"]  # 70 C: below the resolve threshold
            am.wait_alerts(lambda a: not any(x["labels"].get("alertname") == "GpuHot" for x in a))
            sent = rx.wait_for(lambda b: any(x["status"] == "resolved" for x in b), path="/from-am")
            resolved = [x for x in sent if x["status"] == "resolved"][-1]["alerts"][0]
            assert resolved["labels"]["alertname"] == "GpuHot" and resolved["status"] == "resolved"
            assert resolved["endsAt"] > resolved["startsAt"]
            st = svc.dispatcher.stats()["alertmanager"]
            assert st["failures"] == 0 and st["sent"] >= 2
            assert [a["rule"] for a in svc.alerts()["resolved"]] == ["GpuHot"]
        finally:
            svc.stop()
            sampler.stop()


# -- the agent as users run it ---------------------------------------------------------------------------

def _env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + e.get("PYTHONPATH", "")
    return e


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait(check, timeout: float = 30.0, what: str = "") -> object:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
        except (OSError, ValueError):
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def agent_with_alerts(tmp_path):
    with WebhookReceiver() as rx, AlertmanagerServer(tmp_path) as am:
        (tmp_path / "rules.toml").write_text(RULES.replace("builtins = false", "") + """
[[rules]]
name = "GpuThrottledNow"
verdict = "throttled"
window = "5s"
""")
        secret_hook = rx.url.replace("http://", "http://bot:hunter2@") + "/hook"
        (tmp_path / "agent.toml").write_text(f"""
[alerts]
rule_files = ["rules.toml"]
evaluation_interval = "500ms"
webhook_urls = ["{secret_hook}"]
alertmanager_urls = "{am.url}"
""")
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "gpuscope.cli", "agent", "--config", str(tmp_path / "agent.toml"),
                                 "--port", str(port), "--data-dir", str(tmp_path / "data"), "--interval", "100ms",
                                 "--simulate", "throttled"], env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            _wait(lambda: _get(port, "/api/v1/status")[0] == 200, what="the agent", timeout=120.0)
            yield port, am, rx, proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_agent_evaluates_and_notifies(agent_with_alerts):
    port, am, rx, proc = agent_with_alerts
    body = _wait(lambda: (lambda d: d if any(a["rule"] == "GpuHot" for a in d["firing"]) else None)(
        json.loads(_get(port, "/api/v1/alerts")[1])), what="GpuHot firing in /api/v1/alerts")
    assert body["enabled"] and body["simulated"] == "throttled"
    hot = next(a for a in body["firing"] if a["rule"] == "GpuHot")
    assert hot["labels"]["simulated"] == "throttled" and hot["labels"]["team"] == "ml"
    assert {r["name"] for r in body["rules"]} >= {"GpuHot", "GpuThrottled", "GpuLost"}  # built-ins kept
    assert set(body["notifiers"]) == {"log", "webhook", "alertmanager"}
    am.wait_alerts(lambda a: any(x["labels"].get("alertname") == "GpuHot" for x in a))
    hooks = rx.wait_for(lambda b: any(a["labels"]["alertname"] == "GpuHot" for x in b for a in x["alerts"]),
                        path="/hook")
    assert hooks[0]["alerts"][0]["generatorURL"].endswith(f":{port}/api/v1/alerts")
    # the verdict needs 5 s of samples
    _wait(lambda: any(a["rule"] == "GpuThrottledNow" for a in json.loads(_get(port, "/api/v1/alerts")[1])["firing"]),
          what="the verdict rule firing")
    # /metrics carries the verdict of its own 30 s window, refreshed on its own schedule: wait for it too
    # (under load it lags the rule by a refresh) rather than read it once.
    def throttled_on_metrics() -> bool:
        lines = _get(port, "/metrics")[1].decode().splitlines()
        return any(ln.startswith("gpu_verdict{") and 'kind="throttled"' in ln and 'window="30s"' in ln for ln in lines)

    _wait(throttled_on_metrics, what="the throttled verdict on /metrics")
    metrics = _get(port, "/metrics")[1].decode()
    assert 'window="5s"' in metrics
    assert 'gpuscope_alerts{' in metrics and 'state="firing"' in metrics
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "alerts", "list", "--url", f"http://127.0.0.1:{port}"],
                       env=_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "SIMULATED" in p.stdout and "GpuHot" in p.stdout and "firing" in p.stdout
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    assert "alert firing GpuHot" in err and "webhook" in err and "hunter2" not in err


def test_agent_with_a_bad_rule_file_says_one_sentence(tmp_path):
    (tmp_path / "rules.yaml").write_text("rules:\n  - name: X\n    metric: gpu_sm_activ_ratio\n    condition: '< 0.1'\n")
    (tmp_path / "agent.toml").write_text('[alerts]\nrule_files = ["rules.yaml"]\n')
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "agent", "--config", str(tmp_path / "agent.toml"),
                        "--port", str(free_port()), "--data-dir", str(tmp_path / "data"), "--simulate", "healthy"],
                       env=_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and "did you mean 'gpu_sm_active_ratio'" in p.stderr
