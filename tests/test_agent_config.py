"""The agent's config file: every mistake a user can make ends in one sentence naming the place."""

from __future__ import annotations

import time

import pytest

from gpuscope.agent import config
from gpuscope.timeparse import TimeError, parse_duration, parse_time


def write(tmp_path, text: str):
    p = tmp_path / "gpuscope.toml"
    p.write_text(text)
    return p


def test_defaults_bind_loopback_and_avoid_dcgm_port():
    cfg = config.load(None)
    assert cfg.agent.bind == "127.0.0.1" and cfg.loopback_only
    assert cfg.agent.port == config.DEFAULT_PORT != 9400


def test_full_file_is_read_with_units(tmp_path):
    cfg = config.load(write(tmp_path, """
[agent]
bind = "0.0.0.0"
port = 9999
log_format = "json"
[sampler]
interval = "250ms"
gpm_window = 0.5
[store]
raw = "2h"
max_size = "512MiB"
[prometheus]
naming = "dcgm"
top_processes = 4
[remote_write]
url = "http://127.0.0.1:8428/api/v1/write"
headers = { X-Scope-OrgID = "gpu" }
"""))
    assert cfg.agent.port == 9999 and not cfg.loopback_only
    assert cfg.sampler.interval == pytest.approx(0.25) and cfg.sampler.gpm_window == 0.5
    assert cfg.store.raw == 7200 and cfg.store.max_size == 512 * 2**20
    assert cfg.prometheus.naming == "dcgm" and cfg.remote_write.headers == {"X-Scope-OrgID": "gpu"}


@pytest.mark.parametrize("text, needle", [
    ("[agent]\nprot = 1\n", "unknown key 'prot' in [agent]"),
    ("[agnet]\nport = 1\n", "unknown section [agnet]"),
    ("[agent]\nport = \"nine\"\n", "[agent] port must be a whole number"),
    ("[agent]\nport = 70000\n", "port must be between 1 and 65535"),
    ("[sampler]\ninterval = \"fast\"\n", "[sampler] interval must be a duration"),
    ("[sampler]\ninterval = \"-1s\"\n", "[sampler] interval must be a duration"),
    ("[sampler]\ninterval = 0\n", "must be a positive duration"),
    ("[sampler]\nprocesses = \"yes\"\n", "must be true or false"),
    ("[store]\nmax_size = \"lots\"\n", "must be a size"),
    ("[prometheus]\nnaming = \"otel\"\n", "must be one of canonical, dcgm"),
    ("[remote_write]\nurl = \"victoria:8428\"\n", "must be an http:// or https:// URL"),
    ("[remote_write]\nurl = \"http://vm:99999/api/v1/write\"\n", "must be an http:// or https:// URL"),
    ("[remote_write]\nheaders = { a = 1 }\n", "must be a table of strings"),
    ("agent = 3\n", "must be a table"),
    ("[agent\n", "is not valid TOML"),
])
def test_bad_config_is_one_clear_sentence(tmp_path, text, needle):
    with pytest.raises(config.ConfigError) as e:
        config.load(write(tmp_path, text))
    msg = str(e.value)
    assert needle in msg
    assert "\n" not in msg and msg.endswith((".", "?"))  # '?': "did you mean 'port'?"


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.toml")
    p = tmp_path / "bin.toml"
    p.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(config.ConfigError, match="not UTF-8"):
        config.load(p)


@pytest.mark.parametrize("text, seconds", [("250ms", 0.25), ("2", 2.0), ("1.5m", 90.0), ("1h", 3600.0), ("7d", 604800.0)])
def test_durations(text, seconds):
    assert config.parse_duration(text, "x") == pytest.approx(seconds)
    assert parse_duration(text) == pytest.approx(seconds)


def test_times():
    now = 1_800_000_000.0
    assert parse_time("now", now) == int(now * 1e9)
    assert parse_time("-1h", now) == int((now - 3600) * 1e9)
    assert parse_time("now-15m", now) == int((now - 900) * 1e9)
    assert parse_time("1700000000", now) == 1_700_000_000 * 10**9
    assert parse_time("2026-11-29T10:00:00Z", now) == parse_time("2026-11-29T10:00:00+00:00", now)
    for bad in ("yesterday", "-1parsec", "1e20"):
        with pytest.raises(TimeError):
            parse_time(bad, now)
    with pytest.raises(TimeError):
        parse_duration("0s")


@pytest.mark.parametrize("bind, loopback", [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                            ("127.example.org", False), ("10.0.0.1", False)])
def test_only_real_loopback_counts_as_loopback(bind, loopback):
    cfg = config.load(None)
    cfg.agent.bind = bind
    assert cfg.loopback_only is loopback


# ---- [sampler] gpm_graphics: DCGM_FI_PROF_GR_ENGINE_ACTIVE, a default dcgm-exporter field --------------

@pytest.mark.parametrize("on", [True, False])
def test_sampler_gpm_graphics_key_gives_dcgm_gr_engine_active_or_says_why_not(tmp_path, on):
    import json

    from test_agent import AgentProc, http

    cfg = config.load(write(tmp_path, f"[sampler]\ngpm_graphics = {'true' if on else 'false'}\n"))
    assert cfg.sampler.gpm_graphics is on
    a = AgentProc(tmp_path, "--simulate", "healthy", "--config", str(tmp_path / "gpuscope.toml"))
    try:
        a.wait_ready()
        text = ""
        for _ in range(100):  # GPM rates need two samples a window apart
            code, body = http(a.port, "/metrics?naming=dcgm", a.token())
            assert code == 200
            text = body.decode()
            if "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{" in text:
                break
            time.sleep(0.1)
        assert "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{" in text  # GPM is read
        code, body = http(a.port, "/api/v1/capabilities", a.token())
        cap = json.loads(body)["0"]["gpu_graphics_active_ratio"]
    finally:
        a.stop()
    if on:
        line = next(x for x in text.splitlines() if x.startswith("DCGM_FI_PROF_GR_ENGINE_ACTIVE{"))
        assert 0.5 < float(line.rsplit(" ", 1)[1]) <= 1.0  # a ratio, as dcgm-exporter's (healthy: ~98 %)
        assert cap == {"supported": True, "reason": ""}
    else:
        assert "DCGM_FI_PROF_GR_ENGINE_ACTIVE" not in text
        assert cap["supported"] is False and "[sampler] gpm_graphics = true" in cap["reason"]
