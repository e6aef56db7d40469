"""Guard configs, good and bad: every bad one ends in one sentence (GuardConfigError, and exit 2 from the CLI);
`gpuscope guard proxy` started as a real process in front of a real upstream."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from gpuscope._redact import redact_url
from gpuscope.cli import main
from gpuscope.guard import GuardConfigError, load_config, parse_config

GOOD_YAML = """
classes:
  - {name: interactive, share: 0.9, rate: 100, burst: 20, tenant_rate: 10}
  - {name: batch, share: 0.1, queue_timeout_s: 5}
classify: {routes: {"/v1/embeddings": batch}, cost: tokens}
controller: {mode: aimd, max_limit: 64}
signals: {agent: "http://127.0.0.1:9400", service_metrics: "http://127.0.0.1:8000/metrics"}
breaker: {failures: [5xx, "429", timeout, slo], slo_s: 2, fallback: "model:small"}
redis: {url: "redis://127.0.0.1:6379/0", replicas: 3}
"""

GOOD_TOML = """
queue_max = 32
[[classes]]
name = "interactive"
share = 0.8
[[classes]]
name = "batch"
share = 0.2
[controller]
mode = "simple"
[controller.steps]
"0.8" = 0.5
"""


def test_good_yaml_and_toml(tmp_path):
    y = tmp_path / "g.yaml"
    y.write_text(GOOD_YAML)
    cfg = load_config(y)
    assert cfg.class_names() == ["interactive", "batch"]
    assert (cfg.classify.default, cfg.controller.mode, cfg.redis.replicas) == ("batch", "aimd", 3)
    assert cfg.breaker.failures == ["5xx", "429", "timeout", "slo"]
    t = tmp_path / "g.toml"
    t.write_text(GOOD_TOML)
    cfg = load_config(t)
    assert (cfg.queue_max, cfg.controller.steps) == (32, {"0.8000": 0.5})


BAD = [
    ({"classes": []}, "non-empty list"),
    ({"classes": [{"name": "a"}], "clases": 1}, "Unknown key 'clases'"),
    ({"classes": [{"name": "a", "shar": 0.5}]}, "Unknown key classes[0].shar"),
    ({"classes": [{"share": 0.5}]}, "has no name"),
    ({"classes": [{"name": "a b"}]}, "plain name"),
    ({"classes": [{"name": "a"}, {"name": "a"}]}, "declared twice"),
    ({"classes": [{"name": "a", "share": 0.8}, {"name": "b", "share": 0.5}]}, "add up to 1.3"),
    ({"classes": [{"name": "a", "share": 2}]}, "between 0 and 1"),
    ({"classes": [{"name": "a", "rate": -1}]}, "positive number"),
    ({"classes": [{"name": "a", "rate": "fast"}]}, "must be a number"),
    ({"classes": [{"name": "a", "rate": float("nan")}]}, "finite"),
    ({"classes": [{"name": "a"}], "classify": {"default": "vip"}}, "classify.default names class 'vip'"),
    ({"classes": [{"name": "a"}], "classify": {"routes": {"/x": "vip"}}}, "classify.routes['/x'] names class 'vip'"),
    ({"classes": [{"name": "a"}], "classify": {"cost": "bytes"}}, "classify.cost"),
    ({"classes": [{"name": "a"}], "controller": {"mode": "vegas"}}, "controller.mode"),
    ({"classes": [{"name": "a"}], "controller": {"min_limit": 50}}, "min_limit"),
    ({"classes": [{"name": "a"}], "controller": {"steps": {"x": 1}}}, "controller.steps"),
    ({"classes": [{"name": "a"}], "breaker": {"failures": ["4xx"]}}, "breaker.failures has '4xx'"),
    ({"classes": [{"name": "a"}], "breaker": {"fallback": "upstream:ftp://x"}}, "breaker.fallback"),
    ({"classes": [{"name": "a"}], "breaker": {"enabled": "yes"}}, "true or false"),
    ({"classes": [{"name": "a"}], "breaker": {"window_s": -1}}, "breaker.window_s must be positive"),
    ({"classes": [{"name": "a"}], "signals": {"agent": "localhost:9400"}}, "signals.agent must start"),
    ({"classes": [{"name": "a"}], "redis": {"url": "http://x"}}, "redis.url"),
    ({"classes": [{"name": "a"}], "redis": {"replicas": 0}}, "redis.replicas"),
    ({"classes": [{"name": "a"}], "queue_max": 1.5}, "whole number"),
    ({"classes": [{"name": "a"}], "controller": []}, "controller must be a mapping"),
    ([1, 2], "must be a mapping"),
]


@pytest.mark.parametrize(("data", "words"), BAD, ids=[w for _, w in BAD])
def test_bad_config_is_one_sentence_naming_the_problem(data, words):
    with pytest.raises(GuardConfigError) as e:
        parse_config(data)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and msg.endswith((".", "?"))  # '?': "did you mean 'classes'?"


@pytest.mark.parametrize(("name", "text", "words"), [
    ("bad.yaml", "classes: [name: a\n", "not valid YAML at line"),
    ("bad.toml", "classes = [", "not valid TOML"),
    ("empty.yaml", "", "must be a mapping"),
    ("bin.yaml", b"\xff\xfe\x00", "is not UTF-8 text"),
    ("unknown.yaml", "classes: [{name: a}]\nbreaker: {fail_max: 5}\n", "Unknown key breaker.fail_max"),
    # a RecursionError, not a parser error
    pytest.param("deep.yaml", "[" * 100_000 + "]" * 100_000, "nested too deep", id="deep.yaml"),
    pytest.param("deep.toml", "a = " + "[" * 100_000 + "]" * 100_000, "nested too deep", id="deep.toml"),
])
def test_bad_files_exit_2_with_one_sentence(tmp_path, capsys, name, text, words):
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["guard", "check", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_check_cli(tmp_path, capsys):
    assert main(["guard", "check", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    p = tmp_path / "g.yaml"
    p.write_text(GOOD_YAML)
    assert main(["guard", "check", str(p)]) == 0
    assert "OK: classes interactive (share 0.9), batch (share 0.1); controller aimd" in capsys.readouterr().out
    assert main(["guard"]) == 2
    assert main(["guard", "proxy", "--config", str(p), "--upstream", "localhost:8000"]) == 2
    assert "--upstream must be an http://" in capsys.readouterr().err
    assert main(["guard", "proxy", "--config", str(p), "--upstream", "http://x:1", "--listen", "nope"]) == 2
    assert "--listen must be HOST:PORT" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_proxy_command_forwards_to_a_real_upstream(tmp_path):
    async def scenario() -> list:
        app = web.Application()

        async def hello(request: web.Request) -> web.Response:
            return web.json_response({"via": request.headers.get("x-forwarded-by", "proxy"), "path": request.path})

        app.router.add_get("/v1/models", hello)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        up = f"http://127.0.0.1:{runner.addresses[0][1]}"
        cfg = tmp_path / "g.toml"
        cfg.write_text('[[classes]]\nname = "all"\nrate = 1\nburst = 1\n')
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())",
                                 "guard", "proxy", "--config", str(cfg), "--upstream", up, "--listen",
                                 f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            loop = asyncio.get_running_loop()

            def get(path: str) -> tuple[int, str]:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                            return r.status, r.read().decode()
                    except urllib.error.HTTPError as e:
                        return e.code, e.read().decode()
                    except OSError:
                        if time.monotonic() > deadline or proc.poll() is not None:
                            raise
                        time.sleep(0.1)

            first = await loop.run_in_executor(None, get, "/v1/models")
            second = await loop.run_in_executor(None, get, "/v1/models")
            metrics = await loop.run_in_executor(None, get, "/guard/metrics")
            bad = []
            for line in (b"GET @host/ HTTP/1.1\r\nHost: x\r\n\r\n", ) * 3:  # any client can send these
                rd, wr = await asyncio.open_connection("127.0.0.1", port)
                wr.write(line)
                bad.append((await rd.read())[:12])
                wr.close()
            return [first, second, metrics, bad]
        finally:
            proc.terminate()
            proc_output.append(proc.communicate(timeout=10)[0])
            await runner.cleanup()

    proc_output: list[str] = []
    first, second, metrics, bad = asyncio.run(scenario())
    log = proc_output[0]
    assert bad == [b"HTTP/1.1 400"] * 3
    assert "Traceback" not in log and log.count("malformed HTTP request from 127.0.0.1 answered 400: ") == 1, log
    assert first[0] == 200 and json.loads(first[1])["path"] == "/v1/models"
    assert second[0] == 429 and json.loads(second[1])["error"]["code"] == "rate"
    assert 'gpuscope_guard_admitted_total{class="all"} 1' in metrics[1]


@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
    ("rediss://app:s3cret@cache:6380", "rediss://app:***@cache:6380"),
    ("redis://cache:6379/0?password=s3cret&db=2", "redis://cache:6379/0?password=***&db=2"),
    ("unix://:s3cret@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
    ("redis://cache:6379/0", "redis://cache:6379/0"),
])
def test_redact_url_hides_the_password(url, shown):
    assert redact_url(url, keep_path=True) == shown


def test_a_redis_password_is_never_shown(tmp_path, capsys):
    p = tmp_path / "g.yaml"
    p.write_text(GOOD_YAML.replace("redis://127.0.0.1", "redis://:s3cret@127.0.0.1"))
    assert main(["guard", "check", str(p)]) == 0
    out = capsys.readouterr().out
    assert "Redis redis://:***@127.0.0.1:6379/0" in out and "s3cret" not in out
    for bad in ("http://:s3cret@cache:6379", "redis://:s3cret@cache:port/0"):
        with pytest.raises(GuardConfigError) as e:
            parse_config({"classes": [{"name": "a"}], "redis": {"url": bad}})
        assert "s3cret" not in str(e.value) and ":***@cache" in str(e.value)
