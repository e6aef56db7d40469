"""`gpuscope agent`: the one sampler of a node, its history on disk, served to people and to Prometheus.

    from gpuscope.agent import Agent, config
    Agent(config.load("gpuscope.toml"), simulate="healthy").run()   # blocks until SIGTERM / SIGINT
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .._heap import rss_bytes, tune_for_long_runs
from .._version import __version__
from ..errors import Unavailable
from ..http.auth import load_or_create_token
from ..sampler import Sampler, SamplerConfig
from .config import Config, ConfigError

log = logging.getLogger("gpuscope.agent")

__all__ = ["Agent", "AgentError", "Config", "ConfigError"]


class AgentError(Unavailable, RuntimeError):
    """The agent cannot start; the message is one sentence for the user."""


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        for k, v in record.__dict__.items():
            if k.startswith("f_"):
                out[k[2:]] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class Agent:
    def __init__(self, cfg: Config, simulate: str | None = None, gpus: int | None = None,
                 announce: Any = print, processes: int | None = None, churn_s: float | None = None,
                 tls: Any = None, workload: str | None = None) -> None:
        self.cfg = cfg
        self.tls = tls  # gpuscope.http.tls.ServerTls; made from [agent] tls_cert/tls_key by run() when None
        self.simulate = simulate
        self.gpus = gpus
        self.processes = processes
        self.churn_s = churn_s
        self.workload = workload  # the simulated node's processes' torchrun run id (--simulate-workload)
        self.announce = announce
        self.naming = cfg.prometheus.naming
        self.top_processes = cfg.prometheus.top_processes
        self.loopback_only = cfg.loopback_only
        self.started = time.time()
        self.store: Any = None
        self.sampler: Any = None
        self.remote: Any = None
        self.alerts: Any = None
        self.baselines: Any = None
        self._render_cache: dict[str, tuple[int, bytes]] = {}
        self._render_lock = threading.Lock()
        self._served: Any = None
        self.pods: Any = None  # sources.podresources.KubeletPods when the agent reads the kubelet
        self.pods_off = ""  # why it does not, in words
        self.malloc_tuning: dict[str, int] = {}
        self.port: int | None = None

    # -- what the HTTP side calls --------------------------------------------------------------
    def render_metrics(self, mode: str) -> bytes:
        from ..export.exposition import render

        snap = self.sampler.latest()
        if snap is None:
            return b""
        with self._render_lock:
            cached = self._render_cache.get(mode)
            if cached is not None and cached[0] == snap.time_ns:
                return cached[1]
            extra = self.sampler.self_metrics()
            extra["gpuscope_agent_uptime_seconds"] = time.time() - self.started
            if self.remote is not None:
                extra.update(self.remote.self_metrics())
            if self.alerts is not None:
                extra.update(self.alerts.self_metrics())
            extra.update(self.store.self_metrics())  # gpuscope_store_healthy, ..._last_flush_age_seconds, ...
            if self.pods is not None:  # gpuscope_kubelet_requests_total, ..._failures_total{reason}, ..._up
                extra.update(self.pods.self_metrics())
            if self._served is not None:  # gpuscope_http_refusals_total{reason}, ..._open_connections, ...
                extra.update(self._served.stats.self_metrics())
            body = render(snap, mode=mode, top_processes=self.top_processes, extra=extra)
            self._render_cache[mode] = (snap.time_ns, body)
            return body

    def status(self) -> dict[str, Any]:
        ov = self.sampler.overhead(calls=False)
        store = self.store.stats()  # with its health: healthy is false while the store cannot write
        return {
            "version": __version__, "healthy": store["health"]["healthy"], "uptime_s": time.time() - self.started,
            "simulated": self.sampler.simulated,
            "hostname": self.sampler.hostname, "gpus": [d.label for d in self.sampler.devices],
            "healthy_gpus": sum(1 for d in self.sampler.devices if d.healthy),
            "sampler": {"interval_s": self.sampler.config.interval, **ov},
            "store": store, "data_dir": str(self.cfg.data_path),
            "remote_write": self.remote.stats() if self.remote is not None and hasattr(self.remote, "stats") else None,
            "alerts": None if self.alerts is None else {
                "rules": len(self.alerts.engine.rules), "notifiers": self.alerts.dispatcher.stats(),
                "evaluation_interval_s": self.alerts.interval},
            "bind": f"{self.cfg.agent.bind}:{self.port}", "auth": "token for every request" if not self.loopback_only
            else "token for changes only (loopback)",
            "tls": self.tls.status() if self.tls is not None else None,
            # the HTTP kit's limits and what they refused, by reason (gpuscope.http.serve.REFUSALS)
            "http": self._served.stats.status() if self._served is not None else None,
            # the kubelet's PodResources API: state, requests, failures by reason, the last answer's age
            "kubernetes": self.pods.stats() if self.pods is not None else {"state": "off", "reason": self.pods_off},
            # the process's own memory: RSS, and glibc's malloc settings it runs with (gpuscope._heap)
            "memory": {"rss_bytes": rss_bytes(), "malloc_tuning": self.malloc_tuning},
        }

    @property
    def token_path(self) -> Path:
        return self.cfg.data_path / "token"

    # -- lifecycle -----------------------------------------------------------------------------
    def _open_data_dir(self) -> None:
        path = self.cfg.data_path
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            why = ("is a file, not a directory" if path.exists() and not path.is_dir()
                   else f"is not writable: {e.strerror}")
            raise AgentError(f"The data directory {path} {why}; choose another with --data-dir.") from None
        self.token = load_or_create_token(self.token_path)

    def _open_store(self) -> None:
        from ..store import Retention, Store, StoreError, StoreLocked

        s = self.cfg.store
        try:
            self.store = Store(self.cfg.data_path / "store", flush_interval=s.flush_interval,
                               retention=Retention(raw_s=s.raw, rollup_1s_s=s.rollup_1s, rollup_1m_s=s.rollup_1m,
                                                   rollup_1h_s=s.rollup_1h, max_bytes=s.max_size))
        except StoreLocked as e:
            raise AgentError(f"Another agent already uses {self.cfg.data_path}: {e}") from None
        except StoreError as e:
            raise AgentError(str(e)) from None

    def sampler_config(self) -> SamplerConfig:
        """Raises sampler.ConfigError with a sentence; checked before anything is written."""
        sc = self.cfg.sampler
        kw: dict[str, Any] = {"gpm_window": sc.gpm_window, "collect_processes": sc.processes, "collect_host": sc.host,
                              "cmdline": self.cfg.processes.cmdline}
        if sc.slow >= sc.interval:
            kw["slow"] = sc.slow
        kw["gpm_graphics"] = sc.gpm_graphics
        cfg = SamplerConfig.for_interval(sc.interval, **kw)
        cfg.validate()
        return cfg

    def _start_sampler(self) -> None:
        self.sampler.subscribe(self.store.append)
        if self.cfg.remote_write.url:
            from ..export.remote_write import RemoteWriter

            rw = self.cfg.remote_write
            self.remote = RemoteWriter(rw.url, interval=rw.interval, headers=rw.headers or None,
                                       top_processes=self.top_processes, extra=self.sampler.self_metrics)
            self.sampler.subscribe(self.remote.add)
        self.sampler.start()
        self._start_alerts()
        self._start_baselines()

    def _pod_source(self) -> Any:
        """The kubelet's PodResources client ([kubernetes] pod_resources_socket), or None with why in pods_off.
        Off, silently, where nothing says this is a Kubernetes node; a missing package is one line, not a stop."""
        from ..sources.podresources import DEFAULT_SOCKET, KubeletPods, missing_packages

        k = self.cfg.kubernetes
        path = k.pod_resources_socket
        if path in ("off", ""):
            self.pods_off = "[kubernetes] pod_resources_socket is off"
            return None
        if path == "auto":
            path = DEFAULT_SOCKET
            if not os.path.exists(path) and "KUBERNETES_SERVICE_HOST" not in os.environ:
                self.pods_off = f"not a Kubernetes node: no kubelet socket at {path} and the agent runs in no pod"
                log.debug("pods: %s", self.pods_off, extra={"f_event": "kubelet"})
                return None
        why = missing_packages()
        if why is not None:
            self.pods_off = why
            log.warning("pods: %s; GPU series carry no pod labels.", why, extra={"f_event": "kubelet"})
            return None
        log.info("pods: asking the kubelet at %s every %g s", path, k.pod_resources_interval,
                 extra={"f_event": "kubelet"})
        return KubeletPods(path, interval_s=k.pod_resources_interval, timeout_s=k.pod_resources_timeout)

    def _start_baselines(self) -> None:
        """Per GPU x metric x job, what is usual: learnt every 30 s, kept in the data directory."""
        from ..diagnose.baseline import Baselines, Tracker

        path = self.cfg.data_path / "baselines.json"
        try:
            baselines = Baselines.load(path)
        except ValueError as e:
            log.warning("%s Starting new baselines; the old file is kept as %s.", e, path.name + ".damaged",
                        extra={"f_event": "baselines"})
            path.replace(path.with_name(path.name + ".damaged"))
            baselines = Baselines()
        self.baselines = Tracker(self.sampler, path, baselines=baselines).start()

    def _start_alerts(self) -> None:
        """Rules were validated with the config; the service evaluates on its own thread, started by _serve once
        the port is bound (its alerts link to it, and nothing is sent when the port turns out to be taken)."""
        al = self.cfg.alerts
        if not al.enabled:
            return
        from ..alerts import AlertService, build_notifiers, describe_notifiers, load_rules

        rules = load_rules(al.rule_files, builtins=al.builtins)
        notifiers = build_notifiers(al)
        self.alerts = AlertService(self.sampler, rules, notifiers, interval=al.evaluation_interval)
        log.info("alerts: %d rule(s) every %g s, notifying %s", len(rules), al.evaluation_interval,
                 describe_notifiers(notifiers), extra={"f_event": "alerts"})

    def run(self) -> int:
        a = self.cfg.agent
        if self.tls is None and a.tls_cert:  # a pair it cannot serve: one sentence (exit 2) before anything starts
            from ..http.tls import ServerTls

            src = "" if self.cfg.source == "defaults" else f"{self.cfg.source}: "
            self.tls = ServerTls(a.tls_cert, a.tls_key, cert_name=f"{src}[agent] tls_cert",
                                 key_name=f"{src}[agent] tls_key")
        # Before any thread starts: glibc's malloc as a months-long process needs it (gpuscope._heap).

        self.malloc_tuning = tune_for_long_runs()
        # NVML first: on a machine without a GPU nothing is written before it says so.
        self.pods = self._pod_source()
        self.sampler = Sampler(self.sampler_config(), simulate=self.simulate, gpus=self.gpus,
                               processes=self.processes, churn_s=self.churn_s, pods=self.pods,
                               workload=self.workload)
        try:
            self.sampler.open()  # raises NvmlUnavailable with its sentence
            self._open_data_dir()
            self._open_store()
        except BaseException:
            self.sampler.stop()
            raise
        try:
            self._start_sampler()
            return asyncio.run(self._serve())
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        if self.baselines is not None:
            self.baselines.stop()
            self.baselines = None
        if self.alerts is not None:
            self.alerts.stop()
            self.alerts = None
        if self.sampler is not None:
            self.sampler.stop()
        if self.remote is not None:
            self.remote.stop()
            self.remote = None
        if self.store is not None:
            self.store.close()
            self.store = None
            log.info("agent stopped", extra={"f_event": "stop"})

    async def _serve(self) -> int:
        from ..http.net import format_host
        from ..http.serve import ListenError, start
        from .server import make_app

        a = self.cfg.agent
        limits = a.limits()
        app = make_app(self, a.max_request_bytes, streams_per_client=limits.streams_per_client,
                       stream_stall_s=limits.stream_stall_s)
        try:
            served = await start(app, a.bind, a.port, limits=limits, flag="--port", tls=self.tls,
                                 tls_how="--tls-cert and --tls-key (or [agent] tls_cert and tls_key)")
        except ListenError as e:
            raise AgentError(str(e)) from None
        self.port = served.port
        self._served = served
        host = format_host(a.bind)
        scheme = "https" if self.tls is not None else "http"
        if self.alerts is not None:
            self.alerts.engine.generator_url = (self.cfg.alerts.external_url
                                                or f"{scheme}://{self.sampler.hostname}:{self.port}/api/v1/alerts")
            self.alerts.start()
        what = (f"SIMULATED node, scenario '{self.sampler.simulated}'" if self.sampler.simulated
                else f"{len(self.sampler.devices)} GPU(s)")
        self.announce(f"gpuscope agent {__version__}: sampling {what} every "
                      f"{self.cfg.sampler.interval * 1000:g} ms\n"
                      f"  dashboard:       {scheme}://{host}:{self.port}/ui/\n"
                      f"  API and status:  {scheme}://{host}:{self.port}/api/v1/status\n"
                      f"  Prometheus:      {scheme}://{host}:{self.port}/metrics\n"
                      f"  data:            {self.cfg.data_path}\n"
                      + ("" if self.tls is None else f"  TLS:             {self.tls.describe()}\n")
                      + ("" if self.loopback_only else f"  token:           {self.token_path} (needed for every request)\n")
                      + "  stop with Ctrl-C")
        log.info("agent started", extra={"f_event": "start", "f_port": self.port, "f_bind": a.bind,
                                          "f_max_connections": served.stats.max_connections,
                                          "f_open_files": served.stats.fd_limit[1]})
        await served.wait()
        log.info("stopping: flushing the store", extra={"f_event": "stopping"})
        await served.close()
        return 0
