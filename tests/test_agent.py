"""The agent as a user runs it: a real process on a loopback port, a simulated node, real HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from servers import prometheus_factory, victoria_metrics  # noqa: F401,F811 - fixtures

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + e.get("PYTHONPATH", "")
    return e


def http(port: int, path: str, token: str | None = None, method: str = "GET", data: bytes | None = None,
         host: str = "127.0.0.1") -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{host}:{port}{path}", method=method, data=data,
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class AgentProc:
    def __init__(self, tmp: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.data = tmp / "data"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuscope.cli", "agent", "--port", str(self.port), "--data-dir", str(self.data),
             "--interval", "50ms", *args],
            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until /api/v1/status answers; the bound only catches a hang (an agent that exits fails at once): on a
        2-core machine at load 40, a start-up that takes 2 s alone took over 20."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                code, _ = http(self.port, "/api/v1/status", self.token())
                if code == 200:
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        raise AssertionError("agent did not come up")

    def token(self) -> str | None:
        try:
            return (self.data / "token").read_text().strip()
        except OSError:
            return None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def agent(tmp_path):
    a = AgentProc(tmp_path, "--simulate", "healthy", "--gpus", "2")
    a.wait_ready()
    yield a
    a.stop()


def get(agent: AgentProc, path: str) -> tuple[int, dict]:
    code, body = http(agent.port, path)
    return code, json.loads(body)


def test_agent_serves_metrics_and_api(agent):
    time.sleep(1.5)
    code, body = http(agent.port, "/metrics")
    assert code == 200
    text = body.decode()
    assert 'gpu_sm_active_ratio{' in text and 'simulated="healthy"' in text
    code, body = http(agent.port, "/metrics?naming=dcgm")
    assert code == 200 and "DCGM_FI_DEV_GPU_UTIL" in body.decode()
    code, st = get(agent, "/api/v1/status")
    assert st["simulated"] == "healthy" and st["gpus"] == ["0", "1"] and st["sampler"]["ticks"] > 10
    assert st["memory"]["rss_bytes"] > 0  # and glibc's malloc as tuned at start (gpuscope._heap)
    assert st["memory"]["malloc_tuning"] == {"mmap_threshold_bytes": 1 << 20, "arena_max": 2}
    code, latest = get(agent, "/api/v1/latest")
    assert code == 200 and len(latest["gpus"]) == 2 and latest["simulated"] == "healthy"
    code, caps = get(agent, "/api/v1/capabilities")
    assert caps["0"]["gpu_sm_active_ratio"]["supported"] is True


def test_history_is_queryable_and_flushed(agent):
    time.sleep(2.5)
    code, data = get(agent, "/api/v1/query_range?metric=gpu_power_watts&start=-30s&end=now&step=1s&gpu=0")
    assert code == 200, data
    assert len(data["series"]) == 1
    vals = [v for v in data["series"][0]["values"] if v is not None]
    assert vals and all(500 < v < 900 for v in vals)  # the healthy profile draws ~687 W
    code, series = get(agent, "/api/v1/series?metric=gpu_sm_active_ratio")
    assert code == 200 and {s["labels"]["gpu"] for s in series["series"]} == {"0", "1"}
    code, labels = get(agent, "/api/v1/labels")
    assert "gpu" in labels["labels"]


@pytest.mark.parametrize("path, status, needle", [
    ("/api/v1/query_range", 400, "metric is required"),
    ("/api/v1/query_range?metric=gpu_power_watts&start=now&end=-1h", 400, "end must be after start"),
    ("/api/v1/query_range?metric=gpu_power_watts&start=-30d&step=1ms", 400, "too many"),
    ("/api/v1/query_range?metric=gpu_power_watts&step=banana", 400, "not a duration"),
    ("/api/v1/query_range?metric=gpu_power_watts&agg=median", 400, "agg must be one of"),
    ("/api/v1/query_range?metric=no_such_metric", 400, "no_such_metric"),
    ("/api/v1/query_range?metric=gpu_power_watts&start=yesterday", 400, "not a time"),
    ("/api/v1/events?start=now&end=-1h", 400, "end must be after start"),
    ("/api/v1/nope", 404, "No such endpoint"),
    ("/metrics?naming=otel", 400, "naming must be"),
])
def test_bad_requests_get_a_4xx_with_one_sentence(agent, path, status, needle):
    code, body = http(agent.port, path)
    assert code == status
    msg = json.loads(body)["error"]
    assert needle in msg


def test_changes_need_the_token_and_oversized_bodies_are_refused(agent):
    code, body = http(agent.port, "/api/v1/status", method="POST", data=b"{}")
    assert code == 401 and "token" in json.loads(body)["error"]
    code, body = http(agent.port, "/api/v1/status", token=agent.token(), method="POST", data=b"x" * (1 << 20))
    assert code in (405, 413)
    # The agent keeps serving after bad requests.
    assert http(agent.port, "/api/v1/status")[0] == 200


def test_token_is_private_and_required_beyond_loopback(tmp_path):
    a = AgentProc(tmp_path, "--simulate", "idle_allocated", "--bind", "0.0.0.0")
    try:
        a.wait_ready()
        tok = a.data / "token"
        assert oct(tok.stat().st_mode & 0o777) == "0o600"
        code, body = http(a.port, "/metrics")
        assert code == 401
        code, _ = http(a.port, "/metrics", token="wrong-token-wrong-token")
        assert code == 401
        code, _ = http(a.port, "/metrics", token=a.token())
        assert code == 200
    finally:
        assert a.stop() == 0


def test_sigterm_stops_cleanly_and_data_survives_a_restart(tmp_path):
    a = AgentProc(tmp_path, "--simulate", "healthy")
    a.wait_ready()
    time.sleep(2.0)
    assert a.stop() == 0
    b = AgentProc(tmp_path, "--simulate", "healthy", port=a.port)
    try:
        b.wait_ready()
        code, data = get(b, "/api/v1/query_range?metric=gpu_power_watts&start=-60s&step=1s")
        assert code == 200 and any(v is not None for s in data["series"] for v in s["values"])
    finally:
        b.stop()


def test_second_agent_on_same_data_dir_and_port_in_use(agent, tmp_path):
    # Same data directory, another port: refused with a sentence naming the reason.
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "agent", "--simulate", "healthy", "--port",
                        str(free_port()), "--data-dir", str(agent.data)], env=env(), capture_output=True, text=True,
                       timeout=30)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "already" in p.stderr
    # Same port, another data directory.
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "agent", "--simulate", "healthy", "--port",
                        str(agent.port), "--data-dir", str(tmp_path / "other")], env=env(), capture_output=True,
                       text=True, timeout=30)
    assert p.returncode != 0 and "already in use" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("args, needle", [
    (["--config", "/nonexistent.toml"], "does not exist"),
    (["--port", "0"], "port must be between"),
    (["--interval", "0"], "must be positive"),
    (["--interval", "nan"], "not a duration"),
    (["--simulate", "bogus"], "Unknown scenario"),
])
def test_bad_agent_flags(tmp_path, args, needle):
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "agent", "--data-dir", str(tmp_path / "d"), *args],
                       env=env(), capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr


def test_unwritable_data_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "agent", "--simulate", "healthy",
                        "--data-dir", str(blocker / "sub"), "--port", str(free_port())],
                       env=env(), capture_output=True, text=True, timeout=30)
    # A --data-dir below a file is the user's typing (exit 2), named as such; it read "not writable: Not a directory".
    assert p.returncode == 2 and "which is a file, not a directory" in p.stderr and "Traceback" not in p.stderr


def test_query_cli_against_the_agent(agent):
    time.sleep(2.0)
    base = [sys.executable, "-m", "gpuscope.cli", "query", "gpu_power_watts", "--url", f"http://127.0.0.1:{agent.port}",
            "--since", "30s", "--step", "1s", "--gpu", "1"]
    p = subprocess.run([*base, "--format", "json"], env=env(), capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["series"][0]["labels"]["gpu"] == "1"
    p = subprocess.run([*base, "--format", "csv"], env=env(), capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and p.stdout.startswith("time,labels,gpu_power_watts")
    p = subprocess.run([*base[:5], "--url", f"http://127.0.0.1:{free_port()}"], env=env(), capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 1 and "No gpuscope agent answers" in p.stderr


def test_export_cli_reads_the_store_while_the_agent_runs(agent, tmp_path):
    time.sleep(2.5)
    out = tmp_path / "x.csv"
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "export", "--data-dir", str(agent.data), "--since", "1m",
                        "--out", str(out), "--metric", "gpu_power_watts"], env=env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    lines = out.read_text().splitlines()
    assert len(lines) > 5 and "gpu_power_watts" in out.read_text()
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "export", "--data-dir", str(tmp_path / "none"),
                        "--out", str(tmp_path / "y.csv")], env=env(), capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and "No gpuscope store" in p.stderr


def test_kill_9_loses_at_most_the_last_flush_and_the_store_reopens(tmp_path):
    a = AgentProc(tmp_path, "--simulate", "healthy")
    a.wait_ready()
    time.sleep(3.0)

    def stamps_of(agent: AgentProc, start: float, end: float) -> list[float]:
        code, data = get(agent, f"/api/v1/query_range?metric=gpu_power_watts&start={start:.3f}&end={end:.3f}&step=0.1s")
        assert code == 200, data
        return sorted(t / 1e9 for s in data["series"] for t, v in zip(s["timestamps_ns"], s["values"], strict=True)
                      if v is not None)

    # When the agent last committed a flush, by its own figure (a loaded machine may have delayed it), and what
    # it held up to a flush interval (1 s) before that: all of it was on disk when the kill came.
    try:
        asked_at = time.time()
        code, body = http(a.port, "/metrics")
        assert code == 200
        age = float(re.search(r"^gpuscope_store_last_flush_age_seconds(?:{[^}]*})? (\S+)$", body.decode(),
                              re.M).group(1))
        flushed_before = asked_at - age - 1.0
        start = flushed_before - 2.0
        held = stamps_of(a, start, flushed_before)
        killed_at = time.time()
    finally:
        a.proc.kill()  # SIGKILL mid-ingest: no flush, no cleanup
        a.proc.wait()
    b = AgentProc(tmp_path, "--simulate", "healthy", port=a.port)  # the lock died with the process
    try:
        b.wait_ready()
        assert held, "the agent held nothing to check"
        stamps = stamps_of(b, start, killed_at)
        assert stamps, "nothing from before the kill survived"
        # everything flushed came back, without holes: the same samples the agent itself served before the kill
        missing = sorted(set(held) - set(stamps))
        assert not missing, f"{len(missing)} of {len(held)} flushed samples lost, from {missing[0] - killed_at:.2f} s"
    finally:
        b.stop()


def test_prometheus_scrapes_the_agent_and_rate_of_energy_matches_power(agent, prometheus_factory):  # noqa: F811
    prom = prometheus_factory([f"127.0.0.1:{agent.port}"], scrape_interval="1s")
    # rate() extrapolates less while the series is younger than its window: wait for a full window.
    prom.wait_for('count_over_time(gpu_energy_joules_total{gpu="0"}[5s])',
                  lambda r: len(r) == 1 and float(r[0]["value"][1]) >= 5, timeout=40)
    res = prom.query('rate(gpu_energy_joules_total{gpu="0"}[5s])')
    rate = float(res[0]["value"][1])
    power = prom.query('avg_over_time(gpu_power_watts{gpu="0"}[5s])')
    assert power and res[0]["metric"]["simulated"] == "healthy"
    assert rate == pytest.approx(float(power[0]["value"][1]), rel=0.1)
    up = prom.query('up{job="gpuscope"}')
    assert up and up[0]["value"][1] == "1"


def test_agent_remote_writes_into_victoria_metrics(tmp_path, victoria_metrics):  # noqa: F811
    cfg = tmp_path / "gpuscope.toml"
    cfg.write_text(f'[remote_write]\nurl = "{victoria_metrics.write_url}"\ninterval = "1s"\n')
    a = AgentProc(tmp_path, "--simulate", "memory_bound", "--config", str(cfg))
    try:
        a.wait_ready()
        t_end = time.monotonic() + 30
        res: list = []
        while time.monotonic() < t_end and not res:
            time.sleep(1.0)
            res = victoria_metrics.query('gpu_dram_active_ratio{gpu="0"}')
        assert res, "nothing arrived in VictoriaMetrics"
        assert 0.6 < float(res[0]["value"][1]) < 1.0  # memory_bound: DRAM near its ceiling
        assert res[0]["metric"]["simulated"] == "memory_bound"
    finally:
        assert a.stop() == 0


@pytest.mark.parametrize("path, status", [
    ("/api/v1/query_range?metric=gpu_power_watts&agg=p%C2%B2", 400),  # 'p²': a digit only to isdigit()
    ("/api/v1/series?self=1", 200),  # a label filter named like a parameter
    ("/api/v1/series?metric=gpu_power_watts&metric2=x", 200),
    ("/api/v1/series?bad-label=1", 400),
    ("/api/v1/events?start=-99999999999999999999d", 400),  # beyond int64 nanoseconds
    ("/api/v1/query_range?metric=gpu_power_watts&start=9999-12-31T00:00:00Z", 400),
])
def test_odd_requests_are_4xx_not_500(agent, path, status):
    code, body = http(agent.port, path)
    assert code == status, body
    if status >= 400:
        assert json.loads(body)["error"]


def test_loopback_agent_refuses_foreign_host_names(agent):
    # DNS rebinding: a page on evil.example whose name resolves to 127.0.0.1 must not read the agent.
    req = urllib.request.Request(f"http://127.0.0.1:{agent.port}/api/v1/latest", headers={"Host": "evil.example"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 403
    req = urllib.request.Request(f"http://127.0.0.1:{agent.port}/api/v1/status", headers={"Host": f"localhost:{agent.port}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def test_long_interval_is_accepted():
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "sample", "--simulate", "healthy", "--interval", "1.5s",
                        "--every", "1.5s", "--count", "1"], env=env(), capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "SM active" in p.stdout


def test_diagnose_from_the_agent(agent):
    time.sleep(6.5)
    code, data = get(agent, "/api/v1/diagnose?window=6s")
    assert code == 200, data
    primary = {v["gpu"]: v["kind"] for v in data["verdicts"] if v["primary"]}
    assert primary == {"0": "healthy", "1": "healthy"} and data["simulated"] == "healthy"
    assert http(agent.port, "/api/v1/diagnose?window=banana")[0] == 400
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "diagnose", "--url", f"http://127.0.0.1:{agent.port}",
                        "--seconds", "6s", "--json"], env=env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert {v["kind"] for v in json.loads(p.stdout)["verdicts"] if v["primary"]} == {"healthy"}
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "diagnose", "--url", f"http://127.0.0.1:{free_port()}"],
                       env=env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "No gpuscope agent answers" in p.stderr and "Traceback" not in p.stderr


def test_diagnose_a_past_range_from_the_agents_store(agent):
    time.sleep(7.5)  # > min window, flushed (1 s flush interval)
    code, data = get(agent, "/api/v1/diagnose?start=-60s&end=now")
    assert code == 200, data
    assert data["simulated"] == "healthy" and set(data["share"]) == {"0", "1"}
    assert all(set(s) == {"healthy"} for s in data["share"].values()), data["share"]
    assert all(s["kind"] == "healthy" for s in data["spans"] if s["primary"])
    code, data = get(agent, "/api/v1/diagnose?start=-3h&end=-2h")
    assert code == 400 and "no GPU samples" in data["error"]
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "diagnose", "--url", f"http://127.0.0.1:{agent.port}",
                        "--since", "1m", "--json"], env=env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert set(json.loads(p.stdout)["share"]) == {"0", "1"}
