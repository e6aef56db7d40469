"""The guard's configuration: classes, shares, buckets, controller, breaker, redis, agent; YAML or TOML.

Every mistake a user can make in the file ends in one `GuardConfigError` sentence naming the key.

    >>> cfg = parse({"classes": [{"name": "interactive", "share": 0.9}, {"name": "batch", "share": 0.1}]})
    >>> [c.name for c in cfg.classes], cfg.controller.mode
    (['interactive', 'batch'], 'gradient')
"""

from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .._choices import did_you_mean
from .._files import kind_of, load_toml, load_yaml, shown
from .._redact import redact_url
from ..errors import UsageError

__all__ = ["BreakerConfig", "ClassConfig", "ClassifyConfig", "ControllerConfig", "GuardConfig", "GuardConfigError",
           "RedisConfig", "SignalsConfig", "load", "parse"]


class GuardConfigError(UsageError, ValueError):
    """One sentence for the user about a bad guard configuration."""


@dataclass(slots=True)
class ClassConfig:
    """A priority class; the order of `classes` is the priority (first = highest)."""

    name: str
    share: float = 0.0  # guaranteed fraction of the concurrency limit under contention; unused share is borrowable
    rate: float | None = None  # cost units per second for the whole class (None: no class bucket)
    burst: float | None = None  # cost units admitted at once; default = one second of rate
    tenant_rate: float | None = None  # cost units per second per tenant within this class
    tenant_burst: float | None = None
    queue_timeout_s: float = 1.0  # longest wait in the queue before the request is shed
    # longest an admitted request holds its concurrency slot: past it the slot is given back (a drop for the
    # limiter) even if the request never ends; None: no bound (the proxy's own timeouts still end it)
    deadline_s: float | None = None


@dataclass(slots=True)
class ClassifyConfig:
    header: str = "x-priority"  # its value names a class
    tenant_header: str = "x-tenant"
    routes: dict[str, str] = field(default_factory=dict)  # path prefix -> class
    default: str = ""  # class of unmatched traffic; default: the last (lowest) class
    cost: str = "request"  # 'request' (1 per request) or 'tokens' (prompt estimate + max_tokens)
    max_body_bytes: int = 1 << 20  # larger bodies are not parsed for a token estimate


@dataclass(slots=True)
class SignalsConfig:
    """Where the GPU and service signals come from, and the thresholds that act on them."""

    agent: str = ""  # gpuscope agent URL; '' = no GPU signal
    gpu: str = ""  # GPU label to watch ('' = the most loaded one)
    service_metrics: str = ""  # the service's /metrics URL; '' = none
    queue_metric: str = "vllm:num_requests_waiting"
    interval_s: float = 1.0
    stale_hold_s: float = 10.0  # a stale signal holds the last limit this long, then is ignored
    sm_active_high: float = 0.95  # SM activity at or above: no growth
    memory_free_low: float = 0.05  # free memory ratio at or below: back off
    queue_high: float = 8.0  # service-reported waiting requests at or above: back off
    # the service's generated tokens (counter) and running requests (gauge): their time per output token
    tokens_metric: str = "vllm:generation_tokens_total"
    running_metric: str = "vllm:num_requests_running"
    # time per output token over this: back off; over tpot_hold x this: no growth (0: TPOT not acted on)
    tpot_slo_s: float = 0.0
    tpot_hold: float = 0.8
    backoff_ratio: float = 0.9  # limit multiplier per update while a GPU/queue signal says overloaded
    events: bool = True  # post the guard's state changes to the agent's event stream (needs `agent`)
    agent_token_file: str = ""  # the agent's token for those posts; '' = GPUSCOPE_TOKEN, else the agent's default


@dataclass(slots=True)
class ControllerConfig:
    mode: str = "gradient"  # gradient | aimd | simple | fixed
    signal: str = "latency"  # latency | ttft: which latency the controller sees
    initial_limit: float = 20.0
    min_limit: float = 2.0
    max_limit: float = 200.0
    smoothing: float = 0.2  # gradient: weight of the new estimate
    rtt_tolerance: float = 1.25  # gradient: the limit is this x the capacity found (latency grows this much)
    long_window: int = 600  # gradient: re-measure the no-load latency after this many samples (and 10 s) under load
    window_samples: int = 10  # gradient: samples per short window (and per probe)
    window_s: float = 1.0  # gradient: longest short window
    backoff_ratio: float = 0.9  # aimd
    timeout_s: float = 5.0  # aimd: a sample slower than this counts as a drop
    steps: dict[str, float] = field(default_factory=lambda: {"0.85": 0.7, "0.90": 0.4, "0.95": 0.0})  # simple
    consecutive: int = 3  # simple: readings over a threshold before stepping


@dataclass(slots=True)
class BreakerConfig:
    enabled: bool = True
    window_s: float = 30.0
    min_requests: int = 20
    failure_rate: float = 0.5
    open_s: float = 30.0
    probes: int = 1  # concurrent probe requests allowed half-open
    success_threshold: int = 2  # probe successes that close the breaker
    failures: list[str] = field(default_factory=lambda: ["5xx", "timeout"])  # of 5xx, 429, 503, timeout, slo
    slo_s: float = 0.0  # a success slower than this is an 'slo' failure (0: none)
    # the proxy's upstream timeouts: connection + response headers, then the longest gap between two body
    # chunks; never the whole answer, which for a long generation may rightly stream for minutes
    timeout_s: float = 60.0
    idle_timeout_s: float = 60.0
    # proxy and ASGI middleware: longest one write to the client may wait, so a client that stops reading
    # gives its concurrency slot back (a slow reader is cut only when it reads nothing for this long)
    client_stall_s: float = 30.0
    fallback: str = "reject"  # reject | cached | model:NAME | upstream:URL
    cache_bytes: int = 65536  # largest response body kept for the 'cached' fallback


@dataclass(slots=True)
class RedisConfig:
    url: str = ""  # '' = local buckets only
    replicas: int = 1  # local fallback divides the rates by this
    prefix: str = "gpuscope:guard"
    retry_s: float = 1.0  # after a failure, try Redis again this often
    timeout_s: float = 0.05


@dataclass(slots=True)
class GuardConfig:
    classes: list[ClassConfig]
    classify: ClassifyConfig = field(default_factory=ClassifyConfig)
    queue_max: int = 256
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    signals: SignalsConfig = field(default_factory=SignalsConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)

    def class_names(self) -> list[str]:
        return [c.name for c in self.classes]


_SECTIONS = {"classify": ClassifyConfig, "controller": ControllerConfig, "signals": SignalsConfig,
             "breaker": BreakerConfig, "redis": RedisConfig}
_FAILURES = ("5xx", "429", "503", "timeout", "slo")


def load(path: str | Path) -> GuardConfig:
    """Read a YAML (.yaml/.yml) or TOML (.toml) guard config; every problem is one GuardConfigError sentence."""
    p = Path(path)
    what = f"the guard config {p}"
    if p.suffix.lower() == ".toml":
        data: Any = load_toml(p, what, error=GuardConfigError)
    else:
        data = load_yaml(p, what, error=GuardConfigError)
    try:
        return parse(data)
    except GuardConfigError as e:
        raise GuardConfigError(f"{p}: {e}") from None


def parse(data: Any) -> GuardConfig:
    """Validate a mapping (already read from YAML/TOML) into a GuardConfig."""
    if not isinstance(data, dict):
        raise GuardConfigError("The guard config must be a mapping with at least 'classes'.")
    allowed = {"classes", "queue_max", *_SECTIONS}
    for k in data:
        if k not in allowed:
            raise GuardConfigError(f"Unknown key {k!r}; " + did_you_mean(
                str(k), allowed, f"the top level takes {', '.join(sorted(allowed))}."))
    raw_classes = data.get("classes")
    if not isinstance(raw_classes, list) or not raw_classes:
        raise GuardConfigError("'classes' must be a non-empty list of classes, e.g. [{name: interactive, share: 0.9}].")
    classes = [_build(ClassConfig, c, f"classes[{i}]") for i, c in enumerate(raw_classes)]
    names = [c.name for c in classes]
    for i, c in enumerate(classes):
        if not isinstance(c.name, str) or not c.name.isidentifier():
            raise GuardConfigError(f"classes[{i}].name must be a plain name such as 'interactive', not {c.name!r}.")
        if names.count(c.name) > 1:
            raise GuardConfigError(f"Class {c.name!r} is declared twice.")
        if not 0.0 <= c.share <= 1.0:
            raise GuardConfigError(f"classes[{i}].share must be between 0 and 1, not {c.share}.")
        for k in ("rate", "burst", "tenant_rate", "tenant_burst"):
            v = getattr(c, k)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise GuardConfigError(f"classes[{i}].{k} must be a positive number, not {v}.")
        if c.queue_timeout_s < 0:
            raise GuardConfigError(f"classes[{i}].queue_timeout_s must not be negative.")
        if c.deadline_s is not None and not (c.deadline_s > 0 and math.isfinite(c.deadline_s)):
            raise GuardConfigError(f"classes[{i}].deadline_s must be a positive number of seconds, not {c.deadline_s:g}.")
    if sum(c.share for c in classes) > 1.0 + 1e-9:
        raise GuardConfigError(f"The class shares add up to {sum(c.share for c in classes):g}; they must not exceed 1.")
    sections = {k: _build(cls, {} if data.get(k) is None else data[k], k) for k, cls in _SECTIONS.items()}
    cfg = GuardConfig(classes=classes, queue_max=_num(data.get("queue_max", 256), "queue_max", int), **sections)
    _check(cfg, names)
    return cfg


def _check(cfg: GuardConfig, names: list[str]) -> None:
    cl, ctl, br, sig = cfg.classify, cfg.controller, cfg.breaker, cfg.signals
    if cfg.queue_max < 0:
        raise GuardConfigError("queue_max must not be negative.")
    if not cl.default:
        cl.default = names[-1]
    if cl.default not in names:
        raise GuardConfigError(f"classify.default names class {cl.default!r}, which is not among the classes "
                               f"({', '.join(names)}).")
    for route, c in cl.routes.items():
        if c not in names:
            raise GuardConfigError(f"classify.routes[{route!r}] names class {c!r}, which is not among the classes "
                                   f"({', '.join(names)}).")
    if cl.cost not in ("request", "tokens"):
        raise GuardConfigError(f"classify.cost must be 'request' or 'tokens', not {cl.cost!r}.")
    cl.header, cl.tenant_header = cl.header.lower(), cl.tenant_header.lower()
    if ctl.mode not in ("gradient", "aimd", "simple", "fixed"):
        raise GuardConfigError(f"controller.mode must be gradient, aimd, simple or fixed, not {ctl.mode!r}.")
    if ctl.signal not in ("latency", "ttft"):
        raise GuardConfigError(f"controller.signal must be 'latency' or 'ttft', not {ctl.signal!r}.")
    if not 1 <= ctl.min_limit <= ctl.initial_limit <= ctl.max_limit:
        raise GuardConfigError("controller limits must satisfy 1 <= min_limit <= initial_limit <= max_limit.")
    if not 0 < ctl.smoothing <= 1:
        raise GuardConfigError("controller.smoothing must be in (0, 1].")
    if not (ctl.rtt_tolerance >= 1 and ctl.window_samples >= 1 and ctl.long_window >= 1 and ctl.window_s > 0):
        raise GuardConfigError("controller.rtt_tolerance must be at least 1, window_samples and long_window at least 1, "
                               "and window_s positive.")
    if not 0.5 <= ctl.backoff_ratio < 1:
        raise GuardConfigError("controller.backoff_ratio must be in [0.5, 1).")
    steps: dict[str, float] = {}
    for k, v in ctl.steps.items():
        try:
            t = float(k)
            f = float(v)
        except (TypeError, ValueError):
            raise GuardConfigError(f"controller.steps maps a saturation to a rate factor; {k!r}: {v!r} is not.") from None
        if not (0 < t <= 1 and 0 <= f <= 1):
            raise GuardConfigError(f"controller.steps {k!r}: {v!r} must map a saturation in (0, 1] to a factor in [0, 1].")
        steps[f"{t:.4f}"] = f
    ctl.steps = steps
    if ctl.consecutive < 1:
        raise GuardConfigError("controller.consecutive must be at least 1.")
    for name in br.failures:
        if name not in _FAILURES:
            raise GuardConfigError(f"breaker.failures has {name!r}; the failure classes are {', '.join(_FAILURES)}.")
    if not 0 < br.failure_rate <= 1:
        raise GuardConfigError("breaker.failure_rate must be in (0, 1].")
    if br.probes < 1 or br.success_threshold < 1 or br.min_requests < 1:
        raise GuardConfigError("breaker.probes, success_threshold and min_requests must be at least 1.")
    if not (br.timeout_s > 0 and br.idle_timeout_s > 0 and br.client_stall_s > 0):
        raise GuardConfigError("breaker.timeout_s, breaker.idle_timeout_s and breaker.client_stall_s must be "
                               "positive.")
    if not (br.window_s > 0 and br.open_s >= 0):
        raise GuardConfigError("breaker.window_s must be positive and breaker.open_s not negative.")
    fb = br.fallback
    if not (fb in ("reject", "cached") or fb.startswith("model:") and len(fb) > 6
            or fb.startswith(("upstream:http://", "upstream:https://"))):
        raise GuardConfigError(f"breaker.fallback must be reject, cached, model:NAME or upstream:http://..., not {fb!r}.")
    for url, key in ((sig.agent, "signals.agent"), (sig.service_metrics, "signals.service_metrics")):
        if url and not url.startswith(("http://", "https://")):
            raise GuardConfigError(f"{key} must start with http:// or https://, not {url!r}.")
    if sig.interval_s <= 0 or sig.stale_hold_s < 0:
        raise GuardConfigError("signals.interval_s must be positive and signals.stale_hold_s not negative.")
    if not (sig.tpot_slo_s >= 0 and math.isfinite(sig.tpot_slo_s)):
        raise GuardConfigError(f"signals.tpot_slo_s must be a number of seconds, 0 or more, not {sig.tpot_slo_s:g}.")
    if not 0 < sig.tpot_hold <= 1:
        raise GuardConfigError(f"signals.tpot_hold must be in (0, 1], not {sig.tpot_hold:g}.")
    r = cfg.redis
    if r.url and not r.url.startswith(("redis://", "rediss://", "unix://")):
        raise GuardConfigError(f"redis.url must start with redis://, rediss:// or unix://, not "
                               f"{redact_url(r.url, keep_path=True)!r}.")
    try:
        _ = urllib.parse.urlsplit(r.url).port
    except ValueError:
        raise GuardConfigError(f"redis.url {redact_url(r.url, keep_path=True)!r} has a bad port.") from None
    if r.replicas < 1:
        raise GuardConfigError("redis.replicas must be at least 1.")


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise GuardConfigError(f"{where} must be a mapping, not {kind_of(raw)}.")
    known = {f.name: f for f in fields(cls)}
    for k in raw:
        if k not in known:
            raise GuardConfigError(f"Unknown key {where}.{k}; " + did_you_mean(
                str(k), known, f"{where} takes {', '.join(sorted(known))}."))
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        kwargs[k] = _coerce(v, known[k].type, f"{where}.{k}")
    if cls is ClassConfig and "name" not in kwargs:
        raise GuardConfigError(f"{where} has no name.")
    return cls(**kwargs)


def _coerce(v: Any, typ: Any, where: str) -> Any:
    t = str(typ)
    if t == "bool":
        if not isinstance(v, bool):
            raise GuardConfigError(f"{where} must be true or false, not {shown(v)}.")
        return v
    if t in ("float", "float | None"):
        if v is None and "None" in t:
            return None
        return _num(v, where, float)
    if t == "int":
        return _num(v, where, int)
    if t == "str":
        if not isinstance(v, str):
            raise GuardConfigError(f"{where} must be a string, not {shown(v)}.")
        return v
    if t.startswith("dict"):
        if not isinstance(v, dict) or not all(isinstance(k, (str, int, float)) for k in v):
            raise GuardConfigError(f"{where} must be a mapping.")
        return {str(k): x for k, x in v.items()}
    if t.startswith("list"):
        if not isinstance(v, list) or not all(isinstance(x, (str, int)) for x in v):
            raise GuardConfigError(f"{where} must be a list of names.")
        return [str(x) for x in v]
    return v


def _num(v: Any, where: str, kind: type) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise GuardConfigError(f"{where} must be a number, not {shown(v)}.")
    if not math.isfinite(v):
        raise GuardConfigError(f"{where} must be a finite number, not {shown(v)}.")
    if kind is int:
        if v != int(v):
            raise GuardConfigError(f"{where} must be a whole number, not {shown(v)}.")
        return int(v)
    return float(v)
