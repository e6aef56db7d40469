"""The GPU and service signal poller: a gpuscope agent's /api/v1/latest and the service's /metrics.

Every `signals.interval_s` it reads, from the agent, the watched GPU's SM activity (GPM; NVML
utilization where GPM is absent), free memory ratio and throttle reasons (power or thermal ones count;
idle, application clocks, sync boost and display clock do not), and from the service's /metrics the
queue gauge (`vllm:num_requests_waiting` by default, summed over its label sets) and, where the service
exports them, its generated-token counter and running-request gauge (`vllm:generation_tokens_total`,
`vllm:num_requests_running`): between two reads, the running requests over the tokens generated a second is
the time per output token its running requests see (each running request gets a token per engine step, so
tokens a second = running x steps a second), prefill stalls included, as a streaming client sees them;
no token generated while requests ran reads as the whole interval (a stalled engine). A failed read feeds
nothing: the signal ages, and the limiter's stale rules apply (see _limit.py). Without `signals.gpu`
the GPU with the highest SM activity is watched.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from ._core import Guard
from ._limit import GpuSignal

__all__ = ["SignalPoller", "TpotMeter", "service_values", "signal_from_latest"]

log = logging.getLogger("gpuscope.guard")

_BENIGN = frozenset({"gpu_idle", "applications_clocks", "sync_boost", "display_clock", "none"})


def signal_from_latest(snap: dict[str, Any], gpu: str, now: float) -> GpuSignal | None:
    """A GpuSignal from the agent's /api/v1/latest answer (None when it has no such GPU)."""
    best: GpuSignal | None = None
    for g in snap.get("gpus") or []:
        ident = g.get("identity") or {}
        label = str(ident.get("index", "")) if ident.get("gpu_instance_id") is None else \
            f"{ident.get('parent_index')}/mig{ident.get('gpu_instance_id')}"
        if gpu and label != gpu and ident.get("uuid") != gpu:
            continue
        v = g.get("values") or {}
        sm = v.get("gpu_sm_active_ratio", v.get("gpu_utilization_ratio"))
        total = ident.get("memory_total_bytes") or v.get("gpu_memory_total_bytes")
        used = v.get("gpu_memory_used_bytes")
        free = v.get("gpu_memory_free_bytes")
        free_ratio = None
        if total:
            if free is not None:
                free_ratio = free / total
            elif used is not None:
                free_ratio = 1.0 - used / total
        throttled = any(r not in _BENIGN for r in g.get("throttle_reasons") or [])
        sig = GpuSignal(now, sm_active_ratio=sm, memory_free_ratio=free_ratio, throttled=throttled)
        if best is None or (sm or 0.0) > (best.sm_active_ratio or 0.0):
            best = sig
    return best


def service_values(text: str, metrics: tuple[str, ...]) -> dict[str, float] | None:
    """Each of `metrics` summed over its label sets in Prometheus text (absent ones left out); None when the
    text does not parse."""
    from prometheus_client.parser import text_string_to_metric_families

    want = set(metrics)
    out: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in want:
                    out[s.name] = out.get(s.name, 0.0) + float(s.value)
    except (ValueError, TypeError):
        return None
    return out


class TpotMeter:
    """The time per output token from two reads of the service's generated-token counter and running gauge: the
    mean of the two running counts over the tokens generated a second between them. None with no earlier
    read, under one request running, or across a counter reset (the service restarted)."""

    def __init__(self) -> None:
        self._last: tuple[float, float, float] | None = None  # (time, tokens, running)

    def update(self, now: float, tokens: float | None, running: float | None) -> float | None:
        if tokens is None or running is None or not (math.isfinite(tokens) and math.isfinite(running)):
            self._last = None
            return None
        last, self._last = self._last, (now, tokens, running)
        if last is None or now <= last[0] or tokens < last[1]:
            return None
        dt, made = now - last[0], tokens - last[1]
        busy = (running + last[2]) / 2
        if busy < 1:
            return None
        return dt if made <= 0 else min(dt, busy * dt / made)


class SignalPoller:
    """Polls the agent and the service's /metrics and feeds the guard; start() inside a running loop."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.s = guard.cfg.signals
        self._task: asyncio.Task | None = None
        self._warned: set[str] = set()
        self._token: str | bool | None = False  # False: not looked up yet
        self.emitter: Any = None  # the guard's events to the agent (_events.py), started with the poller
        self._tpot = TpotMeter()

    def enabled(self) -> bool:
        return bool(self.s.agent or self.s.service_metrics)

    def start(self) -> None:
        if self.enabled() and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
            from ._events import EventEmitter

            if self.emitter is None and EventEmitter.wanted(self.guard):
                self.emitter = EventEmitter(self.guard)
                self.emitter.start()

    async def stop(self) -> None:
        if self.emitter is not None:
            await asyncio.to_thread(self.emitter.stop)  # its last send may take a moment: off the loop
            self.emitter = None
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=max(0.2, self.s.interval_s))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    await self.poll_once(session)
                except Exception as e:  # noqa: BLE001 - a poll failure must not stop the poller
                    self._warn("poll", f"gpuscope guard: signal poll failed: {e}")
                await asyncio.sleep(self.s.interval_s)

    async def poll_once(self, session: Any) -> GpuSignal | None:
        import aiohttp

        now = self.guard.now()
        sig: GpuSignal | None = None
        if self.s.agent:
            try:
                if self._token is False:  # looked up once: the same token the event emitter posts with
                    from ._events import _find_token

                    self._token = _find_token(self.s.agent_token_file)
                auth = {"Authorization": f"Bearer {self._token}"} if self._token else {}
                async with session.get(self.s.agent.rstrip("/") + "/api/v1/latest", headers=auth) as r:
                    if r.status == 200:
                        sig = signal_from_latest(await r.json(content_type=None), self.s.gpu, now)
                    else:
                        self._warn("agent", f"gpuscope guard: the agent at {self.s.agent} answered {r.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                self._warn("agent", f"gpuscope guard: no GPU signal from {self.s.agent} ({type(e).__name__})")
            if sig is None:
                return None  # no GPU reading: let the signal age rather than feed a half reading
        if self.s.service_metrics:
            got: dict[str, float] | None = None
            names = (self.s.queue_metric, self.s.tokens_metric, self.s.running_metric)
            try:
                async with session.get(self.s.service_metrics) as r:
                    if r.status == 200:
                        got = service_values(await r.text(), names)
            except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError) as e:
                self._warn("service", f"gpuscope guard: no queue depth from {self.s.service_metrics} "
                                      f"({type(e).__name__})")
            got = got or {}
            queue = got.get(self.s.queue_metric)
            tpot = self._tpot.update(now, got.get(self.s.tokens_metric), got.get(self.s.running_metric))
            if sig is None:
                if queue is None and tpot is None:
                    return None
                sig = GpuSignal(now)
            sig.queue_waiting = queue
            sig.tpot_s = tpot
        if sig is None:
            return None
        self.guard.observe_gpu(sig)
        self._warned.clear()
        return sig

    def _warn(self, what: str, msg: str) -> None:
        if what not in self._warned:  # once per outage, not once per poll
            self._warned.add(what)
            log.warning(msg)
