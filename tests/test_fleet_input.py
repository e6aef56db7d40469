"""Bad input to `gpuscope fleet`: one sentence on stderr, a non-zero exit, no traceback, and no output file
written (or touched) when the report fails.

Servers are real, on loopback: a real Prometheus (scraping a target that serves gpuscope-like series, or one
with none of them), the standard library's HTTP server answering what no Prometheus would, and a socket
that accepts and never answers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from servers import MetricsServer, PrometheusServer, free_port

ROOT = Path(__file__).resolve().parents[1]
LABELS = 'hostname="node-z",gpu="{g}",uuid="GPU-{g}",model="NVIDIA H200 (simulated)",simulated="healthy"'
# GPU 1's pod has a name no pod could have: HTML, a quote, a spreadsheet formula (escaped in every output).
HOSTILE = '<script>alert(1)</script>"=HYPERLINK(1)'
_POD = {0: "", 1: ',namespace="' + HOSTILE.replace('"', '\\"') + '",pod="p"'}
EXPOSITION = "".join(
    f"gpu_info{{{LABELS.format(g=g)}{_POD[g]}}} 1\n"
    f"gpu_sm_active_ratio{{{LABELS.format(g=g)}{_POD[g]}}} 0.5\n"
    f"gpu_energy_joules_total{{{LABELS.format(g=g)}{_POD[g]}}} 1000\n" for g in (0, 1)).encode()


def fleet(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "gpuscope", "fleet", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL)


def one_sentence(p: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == code, (p.returncode, p.stderr)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpuscope: "), p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert p.stdout == ""
    return lines[0]


class Plain:
    """The standard library's HTTP server on loopback answering every GET and POST with `answer(path)`:
    (status, content type, body)."""

    def __init__(self, answer: Callable[[str], tuple[int, str, bytes]]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                status, ctype, body = answer(self.path)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _reply  # noqa: N815 - http.server's names

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def prom_with_gpus(tmp_path_factory) -> Iterator[PrometheusServer]:
    """A real Prometheus scraping a target with two GPUs' series (enough for a report) every second."""
    target = MetricsServer(lambda path: EXPOSITION if path.startswith("/metrics") else None)
    prom = PrometheusServer(tmp_path_factory.mktemp("fleet-input"), [target.address])
    try:
        prom.wait_for("count_over_time(gpu_info[1m])", lambda r: len(r) == 2 and all(float(x["value"][1]) >= 6 for x in r))
        yield prom
    finally:
        prom.stop()
        target.stop()


@pytest.fixture
def outputs(tmp_path) -> tuple[Path, Path, Path]:
    """An old report at each output path: a failed run must leave them as they were."""
    paths = (tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.html")
    for p in paths:
        p.write_text("old\n")
    return paths


def untouched(tmp_path: Path, paths: tuple[Path, ...]) -> None:
    assert all(p.read_text() == "old\n" for p in paths)
    assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith(".gpuscope")) == []  # no temp file


def out_args(paths: tuple[Path, Path, Path]) -> list[str]:
    return ["--json", str(paths[0]), "--csv", str(paths[1]), "--html", str(paths[2])]


# -- the server ------------------------------------------------------------------------------------
def test_unreachable_url(tmp_path, outputs):
    p = fleet("report", "--prometheus", f"http://127.0.0.1:{free_port()}", *out_args(outputs))
    one_sentence(p, 1, "cannot be reached")
    untouched(tmp_path, outputs)


def test_not_a_url_at_all():
    one_sentence(fleet("report", "--prometheus", "ftp://prometheus:9090"), 2, "--prometheus must be an http://")
    one_sentence(fleet("report", "--prometheus", "http://prometheus:9090/?q=1"), 2, "query or fragment")


def test_a_plain_http_server_is_not_a_prometheus_api(tmp_path, outputs):
    for answer in (lambda path: (200, "text/html", b"<html><body>hello</body></html>"),
                   lambda path: (404, "text/plain", b"404 page not found\n")):
        srv = Plain(answer)
        try:
            line = one_sentence(fleet("report", "--prometheus", srv.url, *out_args(outputs)), 1,
                                "is not a Prometheus HTTP API")
            assert srv.url in line
        finally:
            srv.stop()
    untouched(tmp_path, outputs)


def test_the_servers_own_error_is_quoted():
    body = json.dumps({"status": "error", "errorType": "bad_data", "error": "query processing would load too many "
                       "samples into memory"}).encode()
    srv = Plain(lambda path: (422, "application/json", body))
    try:
        one_sentence(fleet("report", "--prometheus", srv.url), 1, "refused", "HTTP 422", "too many samples")
    finally:
        srv.stop()


def test_a_server_that_never_answers_times_out():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)  # accepts (the kernel does), never reads nor answers
    try:
        t0 = time.monotonic()
        p = fleet("report", "--prometheus", f"http://127.0.0.1:{sock.getsockname()[1]}", "--timeout", "1")
        one_sentence(p, 1, "did not answer", "within 1 s")
        assert time.monotonic() - t0 < 30
    finally:
        sock.close()


def test_a_prometheus_without_gpuscope_series(tmp_path, outputs):
    target = MetricsServer(lambda path: b"other_metric_total 1\n" if path.startswith("/metrics") else None)
    prom = PrometheusServer(tmp_path / "p", [target.address])
    try:
        prom.wait_for("other_metric_total", lambda r: len(r) == 1)
        line = one_sentence(fleet("report", "--prometheus", prom.url, "--since", "5m", *out_args(outputs)), 1,
                            "has no gpu_info, gpu_sm_active_ratio", "the gpuscope agents must be scraped")
        assert prom.url in line
        # A range from before the agents (here: the target) was scraped holds no series either.
        one_sentence(fleet("report", "--prometheus", prom.url, "--since", "1h", "--until=-30m"), 1,
                     "has no gpu_info")
    finally:
        prom.stop()
        target.stop()
    untouched(tmp_path, outputs)


# -- prices ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,needles", [
    ('[gpu_hour]\n"NVIDIA H200" = -1.0\n', ("must not be negative",)),
    ('energy_per_kwh = -0.1\n', ("energy_per_kwh must not be negative",)),
    ('energy_per_kwh = nan\n', ("finite",)),
    ('currency = "USD"\nenergy_per_kwhh = 0.1\n', ("unknown key 'energy_per_kwhh'", "did you mean 'energy_per_kwh'")),
    ('[gpu_hour]\n"NVIDIA H200" = "cheap"\n', ("must be a number", "not a string")),
    ("gpu_hour = 3\n", ("gpu_hour must be a table",)),
    ("this is [not toml\n", ("is not valid TOML",)),
])
def test_a_bad_prices_file_fails_before_any_query(tmp_path, outputs, text, needles):
    prices = tmp_path / "prices.toml"
    prices.write_text(text)
    srv = Plain(lambda path: (500, "text/plain", b"must not be asked"))
    asked = []
    srv.httpd.RequestHandlerClass.log_message = lambda self, *a: asked.append(a)  # type: ignore[method-assign]
    try:
        p = fleet("report", "--prometheus", srv.url, "--prices", str(prices), *out_args(outputs))
    finally:
        srv.stop()
    one_sentence(p, 2, str(prices), *needles)
    assert asked == []
    untouched(tmp_path, outputs)


def test_a_missing_prices_file(tmp_path):
    one_sentence(fleet("report", "--prometheus", "http://127.0.0.1:1", "--prices", str(tmp_path / "nope.toml")), 2,
                 "nope.toml")


def test_a_gpu_model_the_prices_file_does_not_price(tmp_path, outputs, prom_with_gpus):
    prices = tmp_path / "prices.toml"
    prices.write_text('[gpu_hour]\n"NVIDIA A100" = 1.5\n')
    p = fleet("report", "--prometheus", prom_with_gpus.url, "--since", "30s", "--prices", str(prices),
              *out_args(outputs))
    one_sentence(p, 2, "no [gpu_hour] price for the GPU model 'NVIDIA H200'", "prices: NVIDIA A100", "default = PRICE")
    untouched(tmp_path, outputs)
    prices.write_text('currency = "EUR"\n[gpu_hour]\n"NVIDIA H200" = 3.5\n')  # the model, " (simulated)" off
    ok = fleet("report", "--prometheus", prom_with_gpus.url, "--since", "30s", "--prices", str(prices),
               "--json", str(outputs[0]))
    assert ok.returncode == 0, ok.stderr
    r = json.loads(outputs[0].read_text())
    assert r["currency"] == "EUR" and r["fleet"]["line"].startswith("€")
    assert r["fleet"]["gpu_cost"] == pytest.approx(r["fleet"]["observed_gpu_hours"] * 3.5)


# -- flags -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("by", ['namespace) or vector(1', 'namespace"}', "hostname", "pod,namespace", ""])
def test_by_takes_only_its_fixed_choices(by):
    one_sentence(fleet("report", "--prometheus", "http://127.0.0.1:1", "--by", by), 2, "--by", "invalid choice")


def test_by_in_the_library_refuses_what_is_not_a_choice():
    from gpuscope.errors import UsageError
    from gpuscope.fleet import report

    with pytest.raises(UsageError, match="--by must be one of"):
        report("http://127.0.0.1:1", 0.0, 60.0, by="namespace) or vector(1")


@pytest.mark.parametrize("since,until,needle", [
    ("0s", "now", "--since must be positive"),
    ("-5m", "now", "without a minus sign"),
    ("soon", "now", "is not a duration"),
    ("2030-01-02T00:00:00Z", "2030-01-01T00:00:00Z", "empty or inverted"),
    ("1800000000", "1800000000", "empty or inverted"),
    ("1h", "yesterday", "--until 'yesterday'"),
])
def test_an_empty_or_inverted_range(since, until, needle):
    one_sentence(fleet("report", "--prometheus", "http://127.0.0.1:1", f"--since={since}", f"--until={until}"), 2,
                 needle)


def test_an_output_in_a_missing_directory_fails_before_any_query(tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    for flag in ("--json", "--csv", "--html"):
        p = fleet("report", "--prometheus", f"http://127.0.0.1:{free_port()}", flag, str(missing / "r.out"))
        one_sentence(p, 2, flag, "is not an existing directory")
    one_sentence(fleet("report", "--prometheus", "http://127.0.0.1:1", "--json", str(tmp_path)), 2, "is a directory")
    same = str(tmp_path / "r.out")
    one_sentence(fleet("report", "--prometheus", "http://127.0.0.1:1", "--json", same, "--csv", same), 2,
                 "name the same file")
    assert not (tmp_path / "no").exists()


def test_other_flags_and_actions():
    one_sentence(fleet(), 2, "gpuscope fleet report|rules")
    one_sentence(fleet("report", "--prometheus", "http://127.0.0.1:1", "--top", "0"), 2, "--top must be at least 1")
    one_sentence(fleet("report", "--prometheus", "http://127.0.0.1:1", "--timeout", "0"), 2, "--timeout")
    one_sentence(fleet("report", "--prometheus", "http://127.0.0.1:1", "--source", "cache"), 2, "--source")
    one_sentence(fleet("report"), 2, "--prometheus")


def test_rules_bad_input(tmp_path):
    one_sentence(fleet("rules", "-o", str(tmp_path / "no" / "r.yml")), 2, "--output", "is not an existing directory")
    one_sentence(fleet("rules", "--scrape-interval", "0s"), 2, "--scrape-interval must be positive")
    one_sentence(fleet("rules", "--interval", "often"), 2, "--interval 'often'")
    assert not (tmp_path / "no").exists()


def test_recorded_source_without_the_rules_says_so(prom_with_gpus):
    one_sentence(fleet("report", "--prometheus", prom_with_gpus.url, "--since", "30s", "--source", "recorded"), 1,
                 "does not hold the recorded series", "gpuscope fleet rules")


def test_hostile_label_values_are_escaped_in_every_output(tmp_path, prom_with_gpus):
    import csv

    html, csv_path, js = tmp_path / "r.html", tmp_path / "r.csv", tmp_path / "r.json"
    p = fleet("report", "--prometheus", prom_with_gpus.url, "--since", "30s", "--by", "namespace", "--html", str(html),
              "--csv", str(csv_path), "--json", str(js))
    assert p.returncode == 0, p.stderr
    assert HOSTILE in {g["group"] for g in json.loads(js.read_text())["groups"]}
    page = html.read_text()
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;&quot;=HYPERLINK(1)" in page
    assert "default-src 'none'" in page
    cells = [row[0] for row in csv.reader(csv_path.read_text().splitlines())]
    assert HOSTILE in cells  # starts with '<': no formula; kept as it is
    assert "(none)" in cells
    # A group named like a formula is written so that a spreadsheet shows it as text.
    from gpuscope.fleet._html import csv_text

    r = json.loads(js.read_text())
    r["groups"][0]["group"] = "=HYPERLINK(\"http://x\")"
    assert [row[0] for row in csv.reader(csv_text(r).splitlines())][1] == "'=HYPERLINK(\"http://x\")"


def test_until_takes_a_negative_duration_with_or_without_the_equals_sign():
    for args in (["--until", "-1h"], ["--until=-1h"], ["--until", "-90m", "--since", "1h"]):
        # past the arguments: the range is made, and the (closed) server is what fails
        one_sentence(fleet("report", "--prometheus", f"http://127.0.0.1:{free_port()}", *args), 1, "cannot be reached")


class Guarded:
    """A loopback server that answers the Prometheus API's label values (no metrics) only to requests that
    carry `want` headers, 401 to the rest; it keeps the headers it saw."""

    def __init__(self, want: dict[str, str]) -> None:
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                seen.append(dict(self.headers))
                ok = all(self.headers.get(k) == v for k, v in want.items())
                body = b'{"status":"success","data":[]}' if ok else b"unauthorized"
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json" if ok else "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_server_behind_a_token_or_a_header(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cr3t-t0ken\n")
    server = Guarded({"Authorization": "Bearer s3cr3t-t0ken", "X-Scope-OrgID": "gpu"})
    try:
        base = ["report", "--prometheus", server.url, "--since", "1h"]
        line = one_sentence(fleet(*base), 1, "HTTP 401")  # without: refused
        line += one_sentence(fleet(*base, "--prometheus-token-file", str(token)), 1, "HTTP 401")  # one of two
        # with both it gets through to the API, which holds no gpuscope series
        line += one_sentence(fleet(*base, "--prometheus-token-file", str(token), "--prometheus-header",
                                   "X-Scope-OrgID: gpu"), 1, "has no gpu_info")
        assert server.seen[-1]["Authorization"] == "Bearer s3cr3t-t0ken"
        assert "s3cr3t" not in line

        from gpuscope.fleet import NoFleetData, report

        with pytest.raises(NoFleetData):
            report(server.url, 0.0, 3600.0, headers={"Authorization": "Bearer s3cr3t-t0ken", "X-Scope-OrgID": "gpu"})
    finally:
        server.stop()
    one_sentence(fleet(*base, "--prometheus-header", "no colon here"), 2, "--prometheus-header takes 'Name: value'")
    one_sentence(fleet(*base, "--prometheus-token-file", str(tmp_path / "none")), 2, "--prometheus-token-file",
                 "cannot be read")
    (tmp_path / "empty").write_text("\n")
    one_sentence(fleet(*base, "--prometheus-token-file", str(tmp_path / "empty")), 2, "must hold one token")
