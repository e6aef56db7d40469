"""The guard's own Prometheus metrics, as text exposition (format 0.0.4).

Families: gpuscope_guard_admitted_total{class}, gpuscope_guard_queued_total{class},
gpuscope_guard_shed_total{class,reason}, gpuscope_guard_expired_total{class} (slots taken back at deadline_s),
gpuscope_guard_proxy_deadline_total{reason} (requests a data path stopped at deadline_s: the proxy or a middleware;
the name is the proxy's, which counted them first),
gpuscope_guard_queue_wait_seconds_{sum,count}{class},
gpuscope_guard_inflight{class}, gpuscope_guard_inflight_max{class} and gpuscope_guard_inflight_all_max (the most in
flight at once since the start, per class and all together), gpuscope_guard_reserved_slots{class} (the share's slots at the limit in force),
gpuscope_guard_queue_depth, gpuscope_guard_concurrency_limit,
gpuscope_guard_rate_factor, gpuscope_guard_breaker_state{state} (1 for the current one),
gpuscope_guard_gpu_signal_age_seconds (absent before the first reading), gpuscope_guard_gpu_signal_state{state},
gpuscope_guard_service_tpot_seconds (the service's time per output token at the last reading, where known),
gpuscope_guard_redis_fallback (1 while local fallback buckets stand in for Redis).
Label values go through the exporter's escape(); the rest is a few lines of string building, as in
gpuscope.export.exposition, which renders the sampler's snapshot rather than counters like these.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..export._model import escape
from ._breaker import STATES

if TYPE_CHECKING:
    from ._core import Guard

__all__ = ["CONTENT_TYPE", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SIGNAL_STATES = ("none", "fresh", "stale_hold", "stale_ignored")


def render(g: Guard) -> bytes:
    now = g.now()
    out: list[str] = []
    names = [escape(n) for n in g.cfg.class_names()]

    def family(name: str, kind: str, help: str) -> None:
        out.append(f"# HELP {name} {help}\n# TYPE {name} {kind}\n")

    family("gpuscope_guard_admitted_total", "counter", "Requests admitted, per class.")
    out.extend(f'gpuscope_guard_admitted_total{{class="{n}"}} {v}\n' for n, v in zip(names, g.admitted_total, strict=True))
    family("gpuscope_guard_queued_total", "counter", "Requests that waited in the queue, per class.")
    out.extend(f'gpuscope_guard_queued_total{{class="{n}"}} {v}\n' for n, v in zip(names, g.queued_count_total, strict=True))
    family("gpuscope_guard_shed_total", "counter", "Requests refused, per class and reason.")
    for (i, reason), v in sorted(g.shed_total.items()):
        out.append(f'gpuscope_guard_shed_total{{class="{names[i]}",reason="{escape(reason)}"}} {v}\n')
    family("gpuscope_guard_expired_total", "counter",
           "Admitted requests whose slot the guard took back at their class's deadline_s, per class.")
    out.extend(f'gpuscope_guard_expired_total{{class="{n}"}} {v}\n' for n, v in zip(names, g.expired_total, strict=True))
    family("gpuscope_guard_proxy_deadline_total", "counter",
           "Requests stopped at their class's deadline_s, by what was done.")
    out.extend(f'gpuscope_guard_proxy_deadline_total{{reason="{k}"}} {v}\n' for k, v in g.deadline_total.items())
    family("gpuscope_guard_queue_wait_seconds", "summary", "Time admitted requests waited in the queue.")
    for n, s, c in zip(names, g.queue_wait_sum_s, g.queue_wait_count, strict=True):
        out.append(f'gpuscope_guard_queue_wait_seconds_sum{{class="{n}"}} {s!r}\n')
        out.append(f'gpuscope_guard_queue_wait_seconds_count{{class="{n}"}} {c}\n')
    family("gpuscope_guard_inflight", "gauge", "Requests in flight, per class.")
    out.extend(f'gpuscope_guard_inflight{{class="{n}"}} {v}\n' for n, v in zip(names, g.inflight, strict=True))
    family("gpuscope_guard_inflight_max", "gauge", "The most requests in flight at once since the start, per class.")
    out.extend(f'gpuscope_guard_inflight_max{{class="{n}"}} {v}\n' for n, v in zip(names, g.inflight_peak, strict=True))
    family("gpuscope_guard_inflight_all_max", "gauge", "The most requests in flight at once since the start, in all.")
    out.append(f"gpuscope_guard_inflight_all_max {g.inflight_total_peak}\n")
    family("gpuscope_guard_reserved_slots", "gauge",
           "Slots of the concurrency limit in force reserved for each class by its share.")
    with g._lock:
        reserved = list(g.reserved())
    out.extend(f'gpuscope_guard_reserved_slots{{class="{n}"}} {v}\n' for n, v in zip(names, reserved, strict=True))
    family("gpuscope_guard_queue_depth", "gauge", "Requests waiting in the queue.")
    out.append(f"gpuscope_guard_queue_depth {g.queued_total}\n")
    family("gpuscope_guard_concurrency_limit", "gauge", "The adaptive concurrency limit in force.")
    out.append(f"gpuscope_guard_concurrency_limit {g.limiter.limit!r}\n")
    family("gpuscope_guard_rate_factor", "gauge", "The simple mode's admitted-rate factor (1 = full rate).")
    out.append(f"gpuscope_guard_rate_factor {g.limiter.rate_factor!r}\n")
    family("gpuscope_guard_breaker_state", "gauge", "The upstream circuit breaker's state (1 = current).")
    out.extend(f'gpuscope_guard_breaker_state{{state="{s}"}} {int(g.breaker.state == s)}\n' for s in STATES)
    age = g.limiter.gpu_signal_age_s(now)
    if math.isfinite(age):
        family("gpuscope_guard_gpu_signal_age_seconds", "gauge", "Seconds since the last GPU/service reading.")
        out.append(f"gpuscope_guard_gpu_signal_age_seconds {age:.3f}\n")
    sig = g.limiter.last_signal
    if sig is not None and sig.tpot_s is not None:
        family("gpuscope_guard_service_tpot_seconds", "gauge",
               "The service's time per output token at the last reading (its token counter over its running requests).")
        out.append(f"gpuscope_guard_service_tpot_seconds {sig.tpot_s!r}\n")
    state = g.limiter.gpu_signal_state(now)
    family("gpuscope_guard_gpu_signal_state", "gauge", "The GPU signal's freshness (1 = current).")
    out.extend(f'gpuscope_guard_gpu_signal_state{{state="{s}"}} {int(state == s)}\n' for s in _SIGNAL_STATES)
    fallback = getattr(g.buckets, "fallback_active", False)
    family("gpuscope_guard_redis_fallback", "gauge", "1 while local buckets stand in for unreachable Redis.")
    out.append(f"gpuscope_guard_redis_fallback {int(fallback)}\n")
    return "".join(out).encode()
