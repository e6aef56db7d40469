"""Real servers for integration tests: Prometheus, VictoriaMetrics, Alertmanager and a tiny /metrics HTTP server,
and the example inference service.

Each runs on a free loopback port with its data in a temporary directory, waits until it is ready,
and is stopped (terminate, then kill) when its `with` block or fixture ends. A test whose binary is
missing is skipped with the package to install (Debian: `apt-get install prometheus victoria-metrics
prometheus-alertmanager`). Binaries are found on PATH, or named by GPUSCOPE_PROMETHEUS, GPUSCOPE_PROMTOOL,
GPUSCOPE_VICTORIA_METRICS, GPUSCOPE_ALERTMANAGER.

    from servers import MetricsServer, PrometheusServer

    def test_scrape(tmp_path):
        with MetricsServer(lambda path: b"up_total 1\\n") as target, \\
             PrometheusServer(tmp_path, targets=[target.address]) as prom:
            prom.wait_for("up_total", lambda r: len(r) == 1)

Fixtures (import them into a test module, `from servers import victoria_metrics  # noqa: F401`):
`victoria_metrics` (a running VictoriaMetricsServer), `prometheus_factory` (call it with
PrometheusServer's arguments; every server it made is stopped at teardown) and `alertmanager` (a running
AlertmanagerServer).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

EXAMPLE_SERVICE = Path(__file__).resolve().parents[1] / "examples" / "inference_service" / "server.py"

__all__ = ["AlertmanagerServer", "ExampleService", "MetricsServer", "WebhookReceiver", "PrometheusServer", "VictoriaMetricsServer", "alertmanager",
           "free_port", "need_binary", "prometheus_factory", "victoria_metrics"]

_BINARIES = {
    "prometheus": ("GPUSCOPE_PROMETHEUS", ("prometheus",), "prometheus"),
    "promtool": ("GPUSCOPE_PROMTOOL", ("promtool",), "prometheus"),
    "victoria-metrics": ("GPUSCOPE_VICTORIA_METRICS", ("victoria-metrics", "victoria-metrics-prod"),
                         "victoria-metrics"),
    "alertmanager": ("GPUSCOPE_ALERTMANAGER", ("prometheus-alertmanager", "alertmanager"), "prometheus-alertmanager"),
}


def find_binary(name: str) -> str | None:
    env, candidates, _ = _BINARIES[name]
    if os.environ.get(env):
        return os.environ[env]
    for c in candidates:
        path = shutil.which(c)
        if path:
            return path
    return None


def need_binary(name: str) -> str:
    """The binary's path, or skip the test saying what to install."""
    path = find_binary(name)
    if path is None:
        env, _, pkg = _BINARIES[name]
        pytest.skip(f"{name} is not installed (Debian: apt-get install {pkg}; or set {env})")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class _PortTaken(Exception):
    pass


class _Process:
    """A server subprocess with a log file, a readiness probe and a bounded stop."""

    name = "server"
    ready_path = "/"
    start_timeout = 30.0

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    def _command(self) -> list[str]:
        raise NotImplementedError

    def start(self, workdir: Path) -> None:
        # The port was free when free_port() saw it; another test running beside this one (pytest -n) may take
        # it before the server binds. Then the server exits at once saying so, and starts again on another.
        for attempt in range(3):
            try:
                return self._start(workdir)
            except _PortTaken:
                if attempt == 2:
                    raise RuntimeError(f"{self.name} found its port taken three times:\n{self.log_tail()}") from None
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"

    def _start(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"{self.name}.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child, closed in stop()
        self._log = log
        self.proc = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=workdir, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                if "address already in use" in self.log_tail().lower():
                    raise _PortTaken
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} at start:\n{self.log_tail()}")
            try:
                status, _ = http_get(self.url + self.ready_path, timeout=1.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {self.start_timeout:g} s:\n{self.log_tail()}")

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def get_json(self, path: str, **params: Any) -> Any:
        qs = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        status, body = http_get(f"{self.url}{path}?{qs}" if qs else f"{self.url}{path}", timeout=10.0)
        if status != 200:
            raise AssertionError(f"{self.name} {path} {params}: HTTP {status}: {body[:500]!r}")
        return json.loads(body)

    def query(self, promql: str, time_s: float | None = None) -> list[dict[str, Any]]:
        """An instant query through the Prometheus HTTP API: the `result` list."""
        doc = self.get_json("/api/v1/query", query=promql, time=time_s)
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    def wait_for(self, promql: str, ok: Callable[[list[dict[str, Any]]], bool], timeout: float = 30.0,
                 ) -> list[dict[str, Any]]:
        """Query until `ok(result)` holds; fail with the last result after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while True:
            result = self.query(promql)
            if ok(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{promql!r} never satisfied the check in {timeout:g} s; last result: "
                                     f"{json.dumps(result)[:2000]}\n{self.name} log:\n{self.log_tail()}")
            self._before_retry()
            time.sleep(0.25)

    def _before_retry(self) -> None:
        pass

    def __enter__(self) -> _Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PrometheusServer(_Process):
    """A real Prometheus scraping `targets` ("host:port") every `scrape_interval`, optionally
    accepting remote write on /api/v1/write."""

    name = "prometheus"
    ready_path = "/-/ready"

    def __init__(self, workdir: Path, targets: list[str] | None = None, *, scrape_interval: str = "1s",
                 metrics_path: str = "/metrics", jobs: dict[str, dict[str, Any]] | None = None,
                 remote_write_receiver: bool = False, rule_files: list[Path] | None = None) -> None:
        self.binary = need_binary("prometheus")
        super().__init__()
        self.workdir = Path(workdir) / f"prometheus-{self.port}"
        self.scrape_interval = scrape_interval
        job_list = []
        if targets:
            job_list.append({"job_name": "gpuscope", "metrics_path": metrics_path,
                             "static_configs": [{"targets": list(targets)}]})
        for name, cfg in (jobs or {}).items():
            job_list.append({"job_name": name, **cfg})
        self.config = {"global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                                  "evaluation_interval": scrape_interval},
                       "scrape_configs": job_list}
        if rule_files:
            self.config["rule_files"] = [str(p) for p in rule_files]
        self.remote_write_receiver = remote_write_receiver
        self.start(self.workdir)

    def _command(self) -> list[str]:
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(json.dumps(self.config))  # JSON is YAML
        cmd = [self.binary, f"--config.file={cfg}", f"--storage.tsdb.path={self.workdir / 'data'}",
               f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        if self.remote_write_receiver:
            cmd.append("--web.enable-remote-write-receiver")
        return cmd

    @property
    def write_url(self) -> str:
        return self.url + "/api/v1/write"


class VictoriaMetricsServer(_Process):
    """A real single-node VictoriaMetrics; remote write goes to `write_url`. Queries see fresh data
    at once (-search.latencyOffset=0s, and a forced flush before each retry)."""

    name = "victoria-metrics"
    ready_path = "/health"

    def __init__(self, workdir: Path) -> None:
        self.binary = need_binary("victoria-metrics")
        super().__init__()
        self.workdir = Path(workdir) / f"victoria-metrics-{self.port}"
        self.start(self.workdir)

    def _command(self) -> list[str]:
        return [self.binary, f"-httpListenAddr=127.0.0.1:{self.port}",
                f"-storageDataPath={self.workdir / 'data'}", "-search.latencyOffset=0s",
                "-search.disableCache", "-loggerLevel=WARN", "-retentionPeriod=1d"]

    @property
    def write_url(self) -> str:
        return self.url + "/api/v1/write"

    def flush(self) -> None:
        """Make everything received so far searchable."""
        http_get(self.url + "/internal/force_flush")

    def _before_retry(self) -> None:
        self.flush()

    def query(self, promql: str, time_s: float | None = None) -> list[dict[str, Any]]:
        self.flush()
        return super().query(promql, time_s)


class AlertmanagerServer(_Process):
    """A real Alertmanager (clustering off) with one receiver that sends nowhere; `alerts()` reads
    GET /api/v2/alerts. `config` replaces the default configuration (a dict, written as JSON)."""

    name = "alertmanager"
    ready_path = "/-/ready"

    def __init__(self, workdir: Path, config: dict[str, Any] | None = None) -> None:
        self.binary = need_binary("alertmanager")
        super().__init__()
        self.workdir = Path(workdir) / f"alertmanager-{self.port}"
        self.config = config or {"route": {"receiver": "null", "group_wait": "1s", "group_interval": "1s",
                                           "repeat_interval": "1h"},
                                 "receivers": [{"name": "null"}]}
        self.start(self.workdir)

    def _command(self) -> list[str]:
        cfg = self.workdir / "alertmanager.yml"
        cfg.write_text(json.dumps(self.config))  # JSON is YAML
        return [self.binary, f"--config.file={cfg}", f"--storage.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=", "--log.level=warn"]

    def alerts(self, **params: Any) -> list[dict[str, Any]]:
        """GET /api/v2/alerts (active=, silenced=, inhibited=, unprocessed=, filter= as query parameters)."""
        return self.get_json("/api/v2/alerts", **{k: str(v).lower() if isinstance(v, bool) else v
                                                   for k, v in params.items()})

    def wait_alerts(self, ok: Callable[[list[dict[str, Any]]], bool], timeout: float = 20.0,
                    **params: Any) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.alerts(**params)
            if ok(got):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"Alertmanager's alerts never satisfied the check in {timeout:g} s: "
                                     f"{json.dumps(got)[:2000]}\n{self.log_tail()}")
            time.sleep(0.2)


class MetricsServer:
    """The standard library's HTTP server in a thread, answering GET with `body(path)` as the
    Prometheus text format (None -> 404). `address` is host:port for a scrape config."""

    def __init__(self, body: Callable[[str], bytes | None]) -> None:
        self.requests = 0

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.requests += 1
                try:
                    data = body(self.path)
                except Exception as e:  # noqa: BLE001 - report it to the scraper, keep serving
                    msg = f"{type(e).__name__}: {e}".encode()
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="metrics-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class WebhookReceiver:
    """A real aiohttp server on a loopback port, in its own thread, that records every POST
    (`received`: list of (path, headers, parsed JSON)). It answers `fail_first` requests with 500
    first, and waits `delay` seconds before answering."""

    def __init__(self, fail_first: int = 0, delay: float = 0.0) -> None:
        from aiohttp import web

        self.received: list[tuple[str, dict[str, str], Any]] = []
        self.attempts = 0
        self.fail_first, self.delay = fail_first, delay
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()

        async def handle(request: web.Request) -> web.Response:
            with self._lock:
                self.attempts += 1
                fail = self.attempts <= self.fail_first
            if self.delay:
                await asyncio.sleep(self.delay)
            if fail:
                return web.Response(status=500, text="try again later")
            body = await request.json()
            with self._lock:
                self.received.append((request.path, dict(request.headers), body))
            return web.Response(text="ok")

        async def start() -> None:
            app = web.Application()
            app.router.add_post("/{tail:.*}", handle)
            # stop() cancels a request still being answered (a `delay` longer than the test) after 0.5 s
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        self._loop.run_until_complete(start())
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._loop.run_forever, name="webhook-receiver", daemon=True)
        self._thread.start()

    def bodies(self, path: str | None = None) -> list[Any]:
        with self._lock:
            return [b for p, _, b in self.received if path is None or p == path]

    def wait_for(self, ok: Callable[[list[Any]], bool], timeout: float = 20.0, path: str | None = None) -> list[Any]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.bodies(path)
            if ok(got):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"the receiver never got what the test waits for in {timeout:g} s: "
                                     f"{json.dumps(got)[:2000]}")
            time.sleep(0.05)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> WebhookReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ExampleService:
    """The example inference service (examples/inference_service/server.py) as a subprocess:
    `python server.py --port 0 ARGS...`, on the CPU unless ARGS name a --device; `url` is read from its
    first stdout line. Stopped by `stop()` or at the end of its `with` block.

        with ExampleService("--max-batch", "8", "--seed", "1") as svc:
            http_get(svc.url + "/health")
    """

    def __init__(self, *args: str) -> None:
        device = [] if "--device" in args else ["--device", "cpu"]
        self.proc = subprocess.Popen([sys.executable, str(EXAMPLE_SERVICE), "--port", "0", *device, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("listening on http://"):
            self.stop()
            raise RuntimeError(f"the service did not start: {line!r} {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.url = line.split()[-1]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ExampleService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def victoria_metrics(tmp_path: Path) -> Iterator[VictoriaMetricsServer]:
    with VictoriaMetricsServer(tmp_path) as vm:
        yield vm


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[AlertmanagerServer]:
    with AlertmanagerServer(tmp_path) as am:
        yield am


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[..., PrometheusServer]]:
    made: list[PrometheusServer] = []

    def make(targets: list[str] | None = None, **kw: Any) -> PrometheusServer:
        p = PrometheusServer(tmp_path, targets, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop()
