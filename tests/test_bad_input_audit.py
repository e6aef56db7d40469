"""Bad input found by an audit of every verb and agent route, each once a traceback, a 500, lost data or an
unclear message: now one sentence and exit 2 (usage) / 1 (nothing there), or a 4xx, and the agent serves on.

Servers are real, on loopback: the standard library's HTTP server (tests/servers.py), a raw TCP server that
speaks no HTTP, and the agent itself in a subprocess.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from servers import _Process, http_get

ROOT = Path(__file__).resolve().parents[1]
DEEP = 100_000  # '[' nested this deep: json, PyYAML and tomllib raise RecursionError, not their parse error


def gpuscope(*args: str, cwd: Path | None = None, timeout: float = 60,
             env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("GPUSCOPE_URL", None)
    env.pop("GPUSCOPE_TOKEN", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "gpuscope", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL)


def one_sentence(p: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == code, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuscope: "), p.stderr
    assert needle in lines[0], lines[0]


# -- what answers at --url ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def not_http() -> Iterator[str]:
    """A TCP server that answers every connection with an SSH banner, as a mistyped port would."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)
    ls.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = ls.accept()
            except TimeoutError:
                continue
            with c:
                c.settimeout(5)
                try:
                    c.recv(65536)
                    c.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                except OSError:
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{ls.getsockname()[1]}"
    stop.set()
    t.join(5)
    ls.close()


@pytest.fixture(scope="module")
def json_server() -> Iterator[str]:
    """Answers GET and POST (the dashboard POSTs its PromQL) to /list/... with a JSON list, /empty/... with {},
    /deep/... with JSON nested DEEP levels."""
    bodies = {"list": b"[1, 2]", "empty": b"{}", "deep": b"[" * DEEP + b"]" * DEEP,
              "oddalerts": b'{"firing": [{"state": "x"}]}', "alertsnotalist": b'{"firing": 5}'}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = bodies.get(self.path.split("/")[1], b"")
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    t.join(5)


VERBS = [  # (arguments before --url, the endpoint the message names)
    (["query", "gpu_sm_active_ratio"], "/api/v1/query_range"),
    (["diagnose", "--seconds", "5"], "/api/v1/diagnose"),
    (["diagnose", "--since", "1h"], "/api/v1/diagnose"),
    (["alerts", "list"], "/api/v1/alerts"),
]


@pytest.mark.parametrize(("args", "endpoint"), VERBS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_server_that_speaks_no_http_is_one_sentence(not_http, args, endpoint):
    one_sentence(gpuscope(*args, "--url", not_http), 1, "did not answer in HTTP; is it a gpuscope agent?")


@pytest.mark.parametrize(("args", "endpoint", "kind"),
                         [(a, e, k) for a, e in VERBS for k in ("list", "empty")
                          if (a[0], k) != ("alerts", "empty")],  # {} is a valid alerts answer: nothing firing
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_json_that_is_not_the_agents_is_one_sentence(json_server, args, endpoint, kind):
    one_sentence(gpuscope(*args, "--url", f"{json_server}/{kind}"), 1,
                 f"answered {endpoint} with JSON that is not an object" if kind == "list"
                 else f"answered {endpoint} without a usable")


@pytest.mark.parametrize("kind", ["oddalerts", "alertsnotalist"])
def test_alerts_the_list_cannot_read_are_one_sentence(json_server, kind):
    one_sentence(gpuscope("alerts", "list", "--url", f"{json_server}/{kind}"), 1,
                 "answered /api/v1/alerts with alerts this version cannot read")


def test_json_nested_too_deep_is_one_sentence(json_server):
    one_sentence(gpuscope("query", "gpu_sm_active_ratio", "--url", f"{json_server}/deep"), 1, "not JSON")


def test_top_once_with_a_json_list_names_the_answer(json_server):
    one_sentence(gpuscope("top", "--once", "--url", f"{json_server}/list"), 1,
                 "answered /api/v1/latest with JSON that is not an object")


@pytest.mark.parametrize("args", [["query", "gpu_sm_active_ratio"], ["alerts", "list"], ["diagnose", "--since", "1h"]])
@pytest.mark.parametrize(("url", "needle"), [("127.0.0.1:9471", "must start with http:// or https://"),
                                             ("ftp://host", "must start with http:// or https://"),
                                             ("http://127.0.0.1:99999", "is not a usable URL")])
def test_a_malformed_url_is_a_usage_error(args, url, needle):
    one_sentence(gpuscope(*args, "--url", url), 2, needle)


ENV_VERBS = [["query", "gpu_sm_active_ratio"], ["alerts", "list"], ["diagnose", "--seconds", "5"], ["top", "--once"]]


@pytest.mark.parametrize("args", ENV_VERBS, ids=" ".join)
@pytest.mark.parametrize(("url", "needle"), [("nosch", "GPUSCOPE_URL must be an http:// or https:// URL"),
                                             ("http://[::1", "GPUSCOPE_URL 'http://[::1' is not a usable URL")])
def test_a_bad_gpuscope_url_is_named_as_such(args, url, needle):
    # It was blamed on a --url the user never typed, and exited 1.
    one_sentence(gpuscope(*args, env_extra={"GPUSCOPE_URL": url}), 2, needle)


def test_a_bad_gpuscope_url_does_not_stop_a_simulated_top():
    p = gpuscope("top", "--once", "--json", "--simulate", "healthy", env_extra={"GPUSCOPE_URL": "nosch"})
    assert p.returncode == 0 and json.loads(p.stdout)["simulated"] == "healthy", p.stderr


@pytest.mark.parametrize("args", ENV_VERBS, ids=" ".join)
@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_token_that_cannot_go_in_a_header_is_a_usage_error(json_server, args, how):
    # urllib's "Invalid header value" ValueError was reported as "answered with something that is not JSON".
    token = "abc\ndef"
    p = gpuscope(*args, "--url", f"{json_server}/empty", *(["--token", token] if how == "flag" else []),
                 env_extra={"GPUSCOPE_TOKEN": token} if how == "env" else None)
    one_sentence(p, 2, "The token holds a line break")


def test_a_dashboard_prometheus_answering_json_nested_too_deep(json_server):
    one_sentence(gpuscope("dashboard", "--prometheus", f"{json_server}/deep", "--port", "0", "--timeout", "5"), 1,
                 "no Prometheus API JSON")


# -- time ranges ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", [["diagnose"], ["export", "--out", "x.csv"]])
@pytest.mark.parametrize(("since", "needle"), [("abc", "--since 'abc' is not a duration"),
                                               ("nan", "--since 'nan' is not a duration"),
                                               ("100000d", "--since '100000d' reaches back before 1970")])
def test_since_names_what_was_typed(tmp_path, verb, since, needle):
    one_sentence(gpuscope(*verb, "--since", since, "--data-dir", str(tmp_path)), 2, needle)


def test_since_takes_bare_seconds(tmp_path):
    # It was read as the time '-3600' ("not a plausible unix time"); now it is an hour back: the next
    # complaint is the missing store.
    one_sentence(gpuscope("export", "--out", "x.csv", "--since", "3600", "--data-dir", str(tmp_path)), 1,
                 "No gpuscope store")


# -- run: reports it could not write, checked before the command runs ----------------------------------

@pytest.mark.parametrize(("flags", "needle"), [
    (["--html", "{dir}"], "--html {dir} is a directory"),
    (["--html", "{file}/r.html"], "is not an existing directory"),
    (["--no-html", "--json", "{dir}"], "--json {dir} is a directory"),
    (["--no-html", "--json", "{missing}/r.json"], "is not an existing directory"),
])
def test_run_refuses_an_unwritable_report_before_the_command_runs(tmp_path, flags, needle):
    paths = {"dir": str(tmp_path), "file": str(tmp_path / "a-file"), "missing": str(tmp_path / "missing")}
    (tmp_path / "a-file").write_text("x")
    marker = tmp_path / "ran"
    p = gpuscope("run", "--simulate", "healthy", *[f.format(**paths) for f in flags], "--",
                 sys.executable, "-c", f"open({str(marker)!r}, 'w').close()", cwd=tmp_path)
    one_sentence(p, 2, needle.format(**paths))
    assert not marker.exists(), "the command ran although its report could not be written"


# -- trace --------------------------------------------------------------------------------------------

def _trace_file(path: Path) -> Path:
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "k", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1}]}))
    return path


def test_trace_merge_into_a_directory_is_one_sentence_and_leaves_no_temporary_file(tmp_path):
    trace = _trace_file(tmp_path / "a.json")
    out = tmp_path / "out"
    out.mkdir()
    one_sentence(gpuscope("trace", "merge", str(trace), "--out", str(out)), 2, f"--out {out} is a directory")
    assert not (tmp_path / "out.tmp").exists()


def test_a_failed_trace_write_leaves_no_half_file(tmp_path):
    from gpuscope.trace.perfetto import write_json

    (tmp_path / "t.json").mkdir()  # os.replace onto a directory fails after the temporary file is written
    with pytest.raises(OSError):
        write_json({"traceEvents": []}, tmp_path / "t.json")
    assert not (tmp_path / "t.json.tmp").exists()


@pytest.mark.parametrize(("flags", "needle"), [
    (["--simulate", "nosuch"], "Unknown scenario 'nosuch'"),
    (["--on-demand", "--out", "x"], "--out does not apply with it"),
    (["--on-demand", "--delay", "0", "--duration", "3s"], "--delay, --duration do not apply with it"),
    (["--on-demand", "--agent-dir", "{missing}"], "--agent-dir {missing} is not a directory"),
])
def test_trace_run_refuses_flags_it_would_ignore(tmp_path, flags, needle):
    missing = str(tmp_path / "missing")
    p = gpuscope("trace", "run", *[f.format(missing=missing) for f in flags], "--", "true", cwd=tmp_path)
    one_sentence(p, 2, needle.format(missing=missing))
    assert not os.path.exists(missing)


# -- files nested too deep ------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "text"), [("r.yaml", "[" * DEEP + "]" * DEEP),
                                            ("r.toml", "a = " + "[" * DEEP + "]" * DEEP)], ids=["yaml", "toml"])
def test_a_rule_file_nested_too_deep(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    one_sentence(gpuscope("alerts", "check", str(tmp_path / name)), 2, "is nested too deep")


def test_a_config_file_nested_too_deep(tmp_path):
    (tmp_path / "c.toml").write_text("a = " + "[" * DEEP + "]" * DEEP)
    one_sentence(gpuscope("agent", "--config", str(tmp_path / "c.toml"), "--data-dir", str(tmp_path / "d")), 2,
                 "is nested too deep")


@pytest.mark.parametrize(("text", "needle"), [
    ('[alerts]\nexternal_url = "javascript:alert(1)"\n', "external_url must be the agent's http:// or https:// URL"
                                                          " as people reach it, not 'javascript:alert(1)'."),
    ('[alerts]\nwebhook_urls = ["nosch"]\n', "webhook_urls must hold http:// or https:// URLs, not 'nosch'."),
], ids=["external_url", "webhook_urls"])
def test_a_config_url_that_is_not_http_is_named_as_typed(tmp_path, text, needle):
    # external_url was not checked (it became every alert's link); a bad URL was shown as '/nosch'
    (tmp_path / "c.toml").write_text(text)
    one_sentence(gpuscope("agent", "--config", str(tmp_path / "c.toml"), "--data-dir", str(tmp_path / "d")), 2,
                 needle)


def test_a_baselines_file_nested_too_deep_is_reported_as_damaged(tmp_path):
    from gpuscope.diagnose.baseline import Baselines

    path = tmp_path / "baselines.json"
    path.write_text("[" * DEEP + "]" * DEEP)
    with pytest.raises(ValueError, match="is damaged"):
        Baselines.load(path)


# -- the agent's HTTP API -------------------------------------------------------------------------------

class Agent(_Process):
    """The agent on a simulated node, started and stopped by the tests' shared server harness."""

    name = "agent"
    ready_path = "/api/v1/status"

    def __init__(self, tmp: Path) -> None:
        super().__init__()
        self.data = tmp / "data"
        self.start(tmp)
        assert self.log_path is not None
        self.log = self.log_path
        self.token = (self.data / "token").read_text().strip()

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "gpuscope", "agent", "--simulate", "healthy", "--port", str(self.port),
                "--data-dir", str(self.data), "--interval", "50ms"]

    def get(self, path: str) -> tuple[int, bytes]:
        return http_get(self.url + path, timeout=10.0)

    def raw(self, head: bytes, *parts: bytes, pause_s: float = 0.0) -> bytes:
        """Sends the request in pieces, `pause_s` apart, and returns the whole answer."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            s.sendall(head)
            for part in parts:
                time.sleep(pause_s)
                s.sendall(part)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out

    def post(self, path: str, body: bytes, pause_s: float = 0.0) -> tuple[int, dict]:
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nConnection: close\r\n"
                f"Authorization: Bearer {self.token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        half = len(body) // 2
        answer = self.raw(head, body[:half], body[half:], pause_s=pause_s)
        status = int(answer.split(b" ", 2)[1])
        return status, json.loads(answer.split(b"\r\n\r\n", 1)[1])


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> Iterator[Agent]:
    a = Agent(tmp_path_factory.mktemp("agent"))
    yield a
    a.stop()


@pytest.mark.parametrize("path", ["/api/v1/events", "/api/v1/trace"])
def test_json_nested_too_deep_is_a_400_not_a_500(agent, path):
    status, doc = agent.post(path, b"[" * 30_000 + b"]" * 30_000)
    assert status == 400 and doc["error"].endswith("."), (status, doc)
    assert agent.get("/api/v1/status")[0] == 200


def test_an_events_body_in_two_tcp_segments_is_read_whole(agent):
    # read(n) returned the first segment alone: a valid list was refused as "not valid JSON"
    events = [{"kind": "guard", "type": "shed", "severity": "warning", "message": "m" * 200, "source": f"s{i}"}
              for i in range(3)]
    status, doc = agent.post("/api/v1/events", json.dumps(events).encode(), pause_s=0.3)
    assert (status, doc) == (202, {"accepted": 3})


def test_malformed_http_and_a_client_gone_mid_body_leave_no_traceback_in_the_log(agent):
    host = f"Host: 127.0.0.1:{agent.port}\r\n".encode()
    answers = [
        agent.raw(b"GET /api/v1/status HTTP/1.1\r\n\r\n"),  # no Host
        agent.raw(b"GET /api/v1/status HTTP/1.1\r\n" + host + b"X-A: " + b"a" * 10_000 + b"\r\n\r\n"),
        agent.raw(b"GET /api/v1/status HTTP/1.1\r\n" + host + b"Content-Length: -5\r\n\r\n"),
    ]
    # each a JSON sentence (the 8,190-byte header limit's answer was aiohttp's plain text): gpuscope.http.serve
    assert [a.split(b"\r\n")[0].split()[1] for a in answers] == [b"400", b"431", b"400"], answers
    assert all(b"application/json" in a and b'{"error":"' in a for a in answers), answers
    with socket.create_connection(("127.0.0.1", agent.port), timeout=10) as s:  # promises 100 bytes, sends 2
        s.sendall(b"POST /api/v1/events HTTP/1.1\r\n" + host + f"Authorization: Bearer {agent.token}\r\n".encode()
                  + b"Content-Length: 100\r\n\r\n{}")
        time.sleep(0.3)
    assert agent.get("/api/v1/status")[0] == 200  # after the client above is gone
    time.sleep(0.3)
    log = agent.log.read_text()
    assert "Traceback" not in log and " ERROR " not in log, log


def test_a_request_the_agent_refuses_as_bad_is_a_usage_error(agent):
    # The agent's 400 answers a query built from the user's flags: exit 2 like a bad flag (it was 1).
    one_sentence(gpuscope("query", "gpu_sm_active_ratio", "--url", f"http://127.0.0.1:{agent.port}", "--agg", "p0"),
                 2, "answered 400: agg must be one of")


def test_diagnose_seconds_reach_the_agent_as_a_duration_it_reads(agent):
    # --seconds 100000d went out as window=8.64e+09s, which the agent refused as "not a duration"
    one_sentence(gpuscope("diagnose", "--url", f"http://127.0.0.1:{agent.port}", "--seconds", "100000d"), 2,
                 "window is longer than the")


# -- an output that is one of the inputs -----------------------------------------------------------------

def test_trace_flame_and_merge_refuse_to_overwrite_their_input(tmp_path):
    trace = _trace_file(tmp_path / "a.json")
    before = trace.read_text()
    one_sentence(gpuscope("trace", "flame", str(trace), "--out", str(trace)), 2, "would overwrite")
    one_sentence(gpuscope("trace", "merge", str(trace), "--out", str(tmp_path / "." / "a.json")), 2, "would overwrite")
    assert trace.read_text() == before


def test_export_rules_refuses_to_overwrite_a_rule_file(tmp_path):
    rules = tmp_path / "r.yaml"
    rules.write_text('rules:\n  - name: x\n    metric: gpu_sm_active_ratio\n    condition: "< 0.5"\n')
    before = rules.read_text()
    one_sentence(gpuscope("alerts", "export-rules", str(rules), "-o", str(rules)), 2, "would overwrite")
    assert rules.read_text() == before


def test_export_refuses_to_write_into_the_store(tmp_path):
    # --out DATA/store/gpuscope.db replaced the store's database with CSV
    from gpuscope.store import Store

    Store(str(tmp_path / "store")).close()
    db = sorted((tmp_path / "store").iterdir())
    sizes = {p.name: p.stat().st_size for p in db}
    p = gpuscope("export", "--data-dir", str(tmp_path), "--since", "1h", "--format", "csv",
                 "--out", str(tmp_path / "store" / db[0].name))
    one_sentence(p, 2, "is inside")
    assert {p.name: p.stat().st_size for p in sorted((tmp_path / "store").iterdir())} == sizes


@pytest.mark.parametrize("verb", [["run", "--simulate", "healthy", "--no-html"], ["trace", "run"]], ids=" ".join)
def test_an_empty_command_name_is_a_usage_error(tmp_path, verb):
    # `run -- "$UNSET"` read "Command not found: ." and exited 127
    one_sentence(gpuscope(*verb, "--", "", cwd=tmp_path), 2, "The command to run is an empty string")
