"""The agent's configuration: a TOML file, validated with exact messages, overridden by CLI flags.

    [agent]
    bind = "127.0.0.1"          # loopback by default; anything else requires the token for every request
    port = 9471                 # dcgm-exporter uses 9400
    data_dir = "/var/lib/gpuscope"   # default: /var/lib/gpuscope as root, else ~/.local/share/gpuscope
    log_format = "text"         # or "json" (one JSON object per line)
    log_level = "info"
    max_request_bytes = 65536
    header_timeout = "10s"      # a request's line and headers must arrive within this, its body within
    body_timeout = "60s"        # body_timeout of the headers; a slower one is answered 408 and closed
    max_connections = 4096      # lowered to fit the open-file limit; past it the longest-idle one is closed
    streams_per_client = 8      # live dashboard streams (SSE) one client address may hold
    stream_stall = "30s"        # a stream whose client reads nothing this long is closed, its slot freed
    tls_cert = ""               # HTTPS: a PEM certificate (chain) and its unencrypted key, both or neither;
    tls_key = ""                # relative to this file; re-read when they change (every 5 s) or on SIGHUP

    [sampler]
    interval = "100ms"          # durations: "250ms", "1s", "5m", "2h", "7d", or a number of seconds
    gpm_window = "200ms"
    slow = "1s"
    processes = true
    host = true
    gpm_graphics = false        # GPM graphics activity (DCGM_FI_PROF_GR_ENGINE_ACTIVE): ~1.4 ms of CPU per read

    [processes]
    cmdline = "redacted"        # what process records (API, dashboard, top, /metrics) show of a command line:
                                # "redacted" (secrets hidden), "name-only" (the process name) or "hidden"

    [store]
    flush_interval = "1s"
    raw = "24h"                 # retention per tier
    rollup_1s = "7d"
    rollup_1m = "90d"
    rollup_1h = "730d"
    max_size = "10GiB"

    [prometheus]
    naming = "canonical"        # or "dcgm": DCGM_FI_* names so DCGM dashboards work unchanged; "canonical,dcgm": both
    top_processes = 16          # per GPU; the rest are summed as process="other"

    [remote_write]
    url = ""                    # e.g. "http://victoria:8428/api/v1/write"; empty = off
    interval = "10s"
    headers = {}

    [alerts]
    enabled = true              # the built-in rules, evaluated on the in-memory history, to the log
    rule_files = []             # TOML or YAML (see gpuscope.alerts.rules); relative to this file
    builtins = true
    evaluation_interval = "5s"
    log = true                  # each firing / resolved alert as a log line
    webhook_urls = []           # generic JSON (Alertmanager's webhook format)
    webhook_headers = {}
    slack_urls = []             # Slack-compatible incoming webhooks
    alertmanager_urls = []      # e.g. ["http://alertmanager:9093"]: API v2, every instance of an HA pair
    external_url = ""           # generatorURL in alerts (default http://HOSTNAME:PORT/api/v1/alerts)

    [kubernetes]
    pod_resources_socket = "auto"   # the kubelet's PodResources API, for pod labels and gpu_allocation_state:
                                    # "auto" asks /var/lib/kubelet/pod-resources/kubelet.sock when it exists or
                                    # the agent runs in a pod; a path asks that socket, always; "off" never asks
    pod_resources_interval = "10s"  # how often the kubelet is asked (a new pod's process asks at once)
    pod_resources_timeout = "2s"    # the deadline of one request; the sampler never waits for it

    [profiling]
    publish_bootstrap = true    # the tracing bootstrap in DATA_DIR/bootstrap: PYTHONPATH=<it> opts a program in
    on_verdict = true           # a window when a GPU's verdict turns launch-, sync-, host- or input-bound
    every = "30m"               # a window of every opted-in process this often; "off": never
    duration = "1s"             # each window the agent starts (1s..30s): a 2 s window of a launch-bound loop cost 7.6 s
                                # on the H200 (stop and export), over the 6 s that 1 % of 10 minutes allows
    check_interval = "5s"       # how often the verdicts are looked at (a flip is asked for within this)
"""

from __future__ import annotations

import math
import os
import re
import urllib.parse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .._choices import closest, did_you_mean
from .._files import load_toml, shown
from .._paths import default_data_dir  # re-exported: gpuscope.agent.config.default_data_dir
from .._redact import redact_url
from ..errors import UsageError
from ..http.limits import Limits
from ..http.net import is_loopback_host

DEFAULT_PORT = 9471


class ConfigError(UsageError, ValueError):
    """One sentence saying what is wrong and where."""


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$")
_SIZE_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_duration(v: Any, where: str) -> float:
    """A number of seconds or a duration string (the same forms the command line takes)."""
    from ..timeparse import TimeError
    from ..timeparse import parse_duration as parse_text

    if isinstance(v, int | float) and not isinstance(v, bool):
        s = float(v)
        if not (s > 0 and math.isfinite(s)):
            raise ConfigError(f"{where} must be a positive duration, not {shown(v)}.")
        return s
    if isinstance(v, str):
        try:
            return parse_text(v, where)
        except TimeError:
            pass
    raise ConfigError(f"{where} must be a duration such as \"250ms\" or \"1s\", not {shown(v)}.")


def _is_http_url(url: str) -> bool:
    """http(s)://HOST[:PORT]... that urllib can send to: parseable, a host, a valid port, no whitespace."""
    try:
        p = urllib.parse.urlsplit(url)
        p.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
    except ValueError:
        return False
    return p.scheme in ("http", "https") and bool(p.hostname) and not re.search(r"\s", url)


def parse_size(v: Any, where: str) -> int:
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    if isinstance(v, str) and (m := _SIZE.match(v)):
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
        if n > 0:
            return n
    raise ConfigError(f"{where} must be a size such as \"10GiB\" or a number of bytes, not {shown(v)}.")


@dataclass
class AgentSection:
    bind: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    data_dir: str = ""
    log_format: str = "text"
    log_level: str = "info"
    max_request_bytes: int = 65536
    header_timeout: float = Limits.header_timeout_s
    body_timeout: float = Limits.body_timeout_s
    max_connections: int = Limits.max_connections
    streams_per_client: int = Limits.streams_per_client
    stream_stall: float = Limits.stream_stall_s
    tls_cert: str = ""
    tls_key: str = ""

    def limits(self) -> Limits:
        """What the agent's HTTP server holds against slow or greedy clients (gpuscope.http.limits)."""
        return Limits(header_timeout_s=self.header_timeout, body_timeout_s=self.body_timeout,
                      max_connections=self.max_connections, streams_per_client=self.streams_per_client,
                      stream_stall_s=self.stream_stall)


@dataclass
class SamplerSection:
    interval: float = 0.1
    gpm_window: float = 0.2
    slow: float = 1.0
    processes: bool = True
    host: bool = True
    gpm_graphics: bool = False


@dataclass
class ProcessesSection:
    cmdline: str = "redacted"


@dataclass
class StoreSection:
    flush_interval: float = 1.0
    raw: float = 86400.0
    rollup_1s: float = 7 * 86400.0
    rollup_1m: float = 90 * 86400.0
    rollup_1h: float = 730 * 86400.0
    max_size: int = 10 * 2**30


@dataclass
class PrometheusSection:
    naming: str = "canonical"
    top_processes: int = 16


@dataclass
class RemoteWriteSection:
    url: str = ""
    interval: float = 10.0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class AlertsSection:
    enabled: bool = True
    rule_files: list[str] = field(default_factory=list)
    builtins: bool = True
    evaluation_interval: float = 5.0
    log: bool = True
    webhook_urls: list[str] = field(default_factory=list)
    webhook_headers: dict[str, str] = field(default_factory=dict)
    slack_urls: list[str] = field(default_factory=list)
    alertmanager_urls: list[str] = field(default_factory=list)
    external_url: str = ""


@dataclass
class KubernetesSection:
    pod_resources_socket: str = "auto"
    pod_resources_interval: float = 10.0
    pod_resources_timeout: float = 2.0


@dataclass
class ProfilingSection:
    publish_bootstrap: bool = True
    on_verdict: bool = True
    every: float = 1800.0  # seconds; 0: off
    duration: float = 1.0
    check_interval: float = 5.0


@dataclass
class Config:
    agent: AgentSection = field(default_factory=AgentSection)
    sampler: SamplerSection = field(default_factory=SamplerSection)
    processes: ProcessesSection = field(default_factory=ProcessesSection)
    store: StoreSection = field(default_factory=StoreSection)
    prometheus: PrometheusSection = field(default_factory=PrometheusSection)
    remote_write: RemoteWriteSection = field(default_factory=RemoteWriteSection)
    alerts: AlertsSection = field(default_factory=AlertsSection)
    kubernetes: KubernetesSection = field(default_factory=KubernetesSection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    source: str = "defaults"

    @property
    def data_path(self) -> Path:
        return Path(os.path.expanduser(self.agent.data_dir)) if self.agent.data_dir else default_data_dir()

    @property
    def loopback_only(self) -> bool:
        return is_loopback_host(self.agent.bind.strip())


_DURATIONS = {("agent", "header_timeout"), ("agent", "body_timeout"), ("agent", "stream_stall"),
              ("sampler", "interval"), ("sampler", "gpm_window"), ("sampler", "slow"), ("store", "flush_interval"),
              ("store", "raw"), ("store", "rollup_1s"), ("store", "rollup_1m"), ("store", "rollup_1h"),
              ("remote_write", "interval"), ("alerts", "evaluation_interval"),
              ("kubernetes", "pod_resources_interval"), ("kubernetes", "pod_resources_timeout"),
              ("profiling", "duration"), ("profiling", "check_interval")}
_OFF_DURATIONS = {("profiling", "every")}  # a duration, or "off" (0)
_SIZES = {("store", "max_size")}
_CHOICES = {("agent", "log_format"): ("text", "json"),
            ("agent", "log_level"): ("debug", "info", "warning", "error"),
            ("prometheus", "naming"): ("canonical", "dcgm", "canonical,dcgm"),
            ("processes", "cmdline"): ("redacted", "name-only", "hidden")}


def _coerce(section: str, key: str, value: Any, default: Any, where: str) -> Any:
    if (section, key) in _DURATIONS:
        return parse_duration(value, where)
    if (section, key) in _OFF_DURATIONS:
        if value == "off" or value is False:
            return 0.0
        try:
            return parse_duration(value, where)
        except ConfigError:
            raise ConfigError(f"{where} must be a duration such as \"30m\", or \"off\", not {shown(value)}.") from None
    if (section, key) in _SIZES:
        return parse_size(value, where)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, not {shown(value)}.")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be a whole number, not {shown(value)}.")
        return value
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, not {shown(value)}.")
        choices = _CHOICES.get((section, key))
        if choices and value not in choices:
            raise ConfigError(f"{where} must be one of {', '.join(choices)}, not {shown(value)}.")
        return value
    if isinstance(default, list):
        if isinstance(value, str):  # one file or URL needs no brackets
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings, such as [\"a\", \"b\"], not {shown(value)}.")
        return list(value)
    if isinstance(default, dict):
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ConfigError(f"{where} must be a table of strings, such as {{ Authorization = \"Bearer x\" }}.")
        return dict(value)
    return value


def from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    cfg = Config(source=source)
    for section, table in data.items():
        sections = [f.name for f in fields(Config) if f.name != "source"]
        if section not in sections:
            known = ", ".join(f"[{name}]" for name in sections)
            near = closest(section, sections)
            raise ConfigError(f"{source}: unknown section [{section}]; "
                              + (f"did you mean [{near}]?" if near else f"the sections are {known}."))
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {section} must be a table ([{section}]), not a value.")
        target = getattr(cfg, section)
        names = {f.name: f for f in fields(target)}
        for key, value in table.items():
            if key not in names:
                home = [other for other in sections if key in {f.name for f in fields(getattr(cfg, other))}]
                raise ConfigError(f"{source}: unknown key {key!r} in [{section}]; " + (
                    f"it belongs in {' or '.join(f'[{h}]' for h in home)}." if home
                    else did_you_mean(key, names, f"known keys: {', '.join(names)}.")))
            where = f"{source}: [{section}] {key}"
            setattr(target, key, _coerce(section, key, value, getattr(target, key), where))
    validate(cfg)
    return cfg


def load(path: str | os.PathLike[str] | None) -> Config:
    if path is None:
        return Config()
    p = Path(path)
    data = load_toml(p, f"the config file {p}", error=ConfigError)
    alerts = data.get("alerts")
    if isinstance(alerts, dict) and isinstance(alerts.get("rule_files"), list | str):
        # Rule files are found relative to the config file, as Prometheus does.
        files = [alerts["rule_files"]] if isinstance(alerts["rule_files"], str) else alerts["rule_files"]
        alerts["rule_files"] = [str(p.parent / os.path.expanduser(f)) if isinstance(f, str) else f for f in files]
    agent = data.get("agent")
    if isinstance(agent, dict):  # the certificate and key too (as Prometheus reads its tls_config files)
        for key in ("tls_cert", "tls_key"):
            if isinstance(agent.get(key), str) and agent[key]:
                agent[key] = str(p.parent / os.path.expanduser(agent[key]))
    kube = data.get("kubernetes")
    if isinstance(kube, dict) and isinstance(kube.get("pod_resources_socket"), str):
        sock = kube["pod_resources_socket"]
        if sock not in ("auto", "off", ""):  # a path relative to this file, as the other files named in it
            kube["pod_resources_socket"] = str(p.parent / os.path.expanduser(sock))
    return from_dict(data, str(p))


def validate(cfg: Config) -> None:
    """Checks that span keys or come from CLI flags after the file was read."""
    src = "" if cfg.source == "defaults" else f"{cfg.source}: "
    a = cfg.agent
    if not 0 < a.port < 65536:
        raise ConfigError(f"{src}[agent] port must be between 1 and 65535, not {a.port}.")
    if a.max_request_bytes < 1024:
        raise ConfigError(f"{src}[agent] max_request_bytes must be at least 1024.")
    if not a.bind.strip():
        raise ConfigError(f"{src}[agent] bind must be an address such as 127.0.0.1.")
    if bool(a.tls_cert) != bool(a.tls_key):
        raise ConfigError(f"{src}[agent] tls_cert and tls_key go together: give both files, or neither.")
    try:
        a.limits().checked(lambda key: f"{src}[agent] {key}")
    except UsageError as e:
        raise ConfigError(str(e)) from None
    if not cfg.sampler.interval > 0:
        raise ConfigError(f"{src}[sampler] interval must be a positive duration, not {cfg.sampler.interval:g}.")
    if cfg.prometheus.top_processes < 0:
        raise ConfigError(f"{src}[prometheus] top_processes must be 0 or more.")
    k = cfg.kubernetes
    if k.pod_resources_timeout > 60 or k.pod_resources_interval < 0.5:
        raise ConfigError(f"{src}[kubernetes] pod_resources_timeout must be at most 60s and pod_resources_interval "
                          "at least 500ms.")
    pr = cfg.profiling
    if not 1.0 <= pr.duration <= 30.0:
        raise ConfigError(f"{src}[profiling] duration must be between 1s and 30s, not {pr.duration:g} s.")
    if not 1.0 <= pr.check_interval <= 60.0:
        raise ConfigError(f"{src}[profiling] check_interval must be between 1s and 60s, not {pr.check_interval:g} s.")
    if 0 < pr.every < 60.0:
        raise ConfigError(f"{src}[profiling] every must be at least 1m (or \"off\"), not {pr.every:g} s: the "
                          "process's budget would refuse most of the windows anyway.")
    url = cfg.remote_write.url
    if url and not _is_http_url(url):
        raise ConfigError(f"{src}[remote_write] url must be an http:// or https:// URL, not {url!r}.")
    al = cfg.alerts
    for key in ("webhook_urls", "slack_urls", "alertmanager_urls"):
        for u in getattr(al, key):
            if not _is_http_url(u):
                raise ConfigError(f"{src}[alerts] {key} must hold http:// or https:// URLs, not {redact_url(u)!r}.")
    if al.external_url and not _is_http_url(al.external_url):  # it becomes every alert's link back to the agent
        raise ConfigError(f"{src}[alerts] external_url must be the agent's http:// or https:// URL as people "
                          f"reach it, not {redact_url(al.external_url)!r}.")
    for name, value in al.webhook_headers.items():
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name) or "\r" in value or "\n" in value:
            raise ConfigError(f"{src}[alerts] webhook_headers: {name!r} must be a header name with a one-line value.")
    if al.enabled and (al.rule_files or not al.builtins):
        from ..alerts.rules import RuleError, load_rules

        try:
            load_rules(al.rule_files, builtins=al.builtins)
        except RuleError as e:
            raise ConfigError(str(e)) from None
