"""The GPU/service signal poller against a real gpuscope agent (simulated node) and a real /metrics server."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from test_agent import AgentProc

from gpuscope.guard import GpuSignal, Guard, parse_config
from gpuscope.guard._signals import (
    SignalPoller,
    TpotMeter,
    service_values,
    signal_from_latest,
)

VLLM_METRICS = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 7.0
vllm:num_requests_waiting{model_name="b"} 5.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3.0
"""


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


async def _metrics_server(handler) -> tuple[web.AppRunner, str]:
    """A real aiohttp server on loopback answering /metrics with `handler`; (runner, its /metrics URL)."""
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"


def test_signal_from_a_real_agent_and_queue_depth_from_real_metrics(tmp_path):
    agent = AgentProc(tmp_path, "--simulate", "healthy", "--gpus", "2")
    try:
        agent.wait_ready()

        async def scenario():
            async def metrics(request: web.Request) -> web.Response:
                return web.Response(text=VLLM_METRICS)

            runner, svc = await _metrics_server(metrics)
            clock = Clock()
            g = Guard(parse_config({"classes": [{"name": "a"}], "signals": {
                "agent": f"http://127.0.0.1:{agent.port}", "service_metrics": svc, "queue_high": 10}}), clock=clock)
            try:
                async with aiohttp.ClientSession() as s:
                    sig = None
                    for _ in range(50):  # the agent's first snapshot may be a moment away
                        sig = await SignalPoller(g).poll_once(s)
                        if sig is not None:
                            break
                        await asyncio.sleep(0.1)
            finally:
                await runner.cleanup()
            return g, sig, clock

        g, sig, clock = asyncio.run(scenario())
    finally:
        agent.stop()
    assert sig is not None and 0 <= sig.sm_active_ratio <= 1 and 0 < sig.memory_free_ratio < 1
    assert sig.queue_waiting == 12.0
    assert g.limiter.gpu_signal_state(clock.t) == "fresh"
    assert g.limiter.limit == 18.0  # 12 waiting >= queue_high 10: backed off x0.9 from 20


def test_unreachable_agent_feeds_nothing_and_the_signal_goes_stale():
    async def scenario():
        clock = Clock()
        g = Guard(parse_config({"classes": [{"name": "a"}], "signals": {"agent": "http://127.0.0.1:9"}}), clock=clock)
        g.observe_gpu(GpuSignal(clock.t, sm_active_ratio=0.5))
        async with aiohttp.ClientSession() as s:
            sig = await SignalPoller(g).poll_once(s)
        clock.t += 5
        return sig, g.limiter.gpu_signal_state(clock.t)

    assert asyncio.run(scenario()) == (None, "stale_hold")


def test_signal_parsing_edges():
    snap = {"gpus": [
        {"identity": {"index": 0, "memory_total_bytes": 100}, "values": {"gpu_utilization_ratio": 0.3,
                                                                        "gpu_memory_used_bytes": 96},
         "throttle_reasons": ["gpu_idle"]},
        {"identity": {"index": 1, "memory_total_bytes": 100}, "values": {"gpu_sm_active_ratio": 0.9},
         "throttle_reasons": ["sw_thermal"]}]}
    busiest = signal_from_latest(snap, "", 1.0)
    assert (busiest.sm_active_ratio, busiest.throttled, busiest.memory_free_ratio) == (0.9, True, None)
    g0 = signal_from_latest(snap, "0", 1.0)
    assert (g0.sm_active_ratio, g0.throttled) == (0.3, False) and abs(g0.memory_free_ratio - 0.04) < 1e-9
    assert signal_from_latest(snap, "7", 1.0) is None
    assert service_values("not { prometheus", ("x",)) is None
    assert service_values(VLLM_METRICS, ("vllm:num_requests_running", "x")) == {"vllm:num_requests_running": 3.0}


def test_an_agent_beyond_loopback_is_read_with_its_token(tmp_path):
    # Bound beyond loopback the agent answers reads only with the token: without it the GPU signal was lost.
    agent = AgentProc(tmp_path, "--simulate", "healthy", "--bind", "0.0.0.0")
    try:
        agent.wait_ready()

        async def scenario(token_file: str):
            g = Guard(parse_config({"classes": [{"name": "a"}], "signals": {
                "agent": f"http://127.0.0.1:{agent.port}", "agent_token_file": token_file, "events": False}}))
            async with aiohttp.ClientSession() as s:
                for _ in range(50):
                    sig = await SignalPoller(g).poll_once(s)
                    if sig is not None:
                        return sig
                    await asyncio.sleep(0.1)
            return None

        assert asyncio.run(scenario(str(agent.data / "token"))) is not None
        assert asyncio.run(scenario(str(tmp_path / "no-such-token"))) is None  # 401: no signal, never a raise
    finally:
        agent.stop()


def test_the_services_tpot_from_its_token_counter_backs_the_limit_off_over_its_slo():
    """A real /metrics server whose token counter advances 1,000 a read with 10 running: read 0.5 s apart by the
    guard's clock, 10 x 0.5 / 1,000 = 5 ms a token, over a 4 ms SLO: overloaded, the limit backs off."""
    async def scenario():
        reads = {"n": 0}

        async def metrics(request: web.Request) -> web.Response:
            reads["n"] += 1
            return web.Response(text=f"""# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{model_name="m"}} {1000.0 * reads["n"]}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} 10
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="m"}} 0
""")

        runner, svc = await _metrics_server(metrics)
        clock = Clock()
        g = Guard(parse_config({"classes": [{"name": "a"}], "signals": {
            "service_metrics": svc, "tpot_slo_s": 0.004}}), clock=clock)
        try:
            async with aiohttp.ClientSession() as s:
                poller = SignalPoller(g)
                first = await poller.poll_once(s)
                clock.t += 0.5
                second = await poller.poll_once(s)
        finally:
            await runner.cleanup()
        from gpuscope.guard._metrics import render

        return first, second, g.limiter.limit, render(g).decode()

    first, second, limit, text = asyncio.run(scenario())
    assert first is not None and first.tpot_s is None and first.queue_waiting == 0  # no earlier read yet
    assert second is not None and abs(second.tpot_s - 0.005) < 1e-9
    assert limit == 18.0  # 20 x 0.9
    assert "gpuscope_guard_service_tpot_seconds 0.005" in text


def test_the_tpot_meter_edges():
    m = TpotMeter()
    assert m.update(0.0, 100.0, 8.0) is None  # no earlier read
    assert abs(m.update(1.0, 900.0, 8.0) - 0.01) < 1e-12  # 8 running, 800 tokens a second: 10 ms
    assert m.update(2.0, 50.0, 8.0) is None  # the counter went back: the service restarted
    assert m.update(3.0, 50.0, 1.0) == 1.0  # no token in a second with 4.5 running: stalled, the whole interval
    assert m.update(4.0, 60.0, 0.0) is None  # under one running on average (0.5 here): nothing to say
    assert m.update(5.0, 70.0, None) is None and m.update(6.0, 80.0, 1.0) is None  # a missing read starts afresh
    assert service_values("x{", ("x",)) is None
    assert service_values("a_total 2\na_total{b=\"1\"} 3\n", ("a_total", "c")) == {"a_total": 5.0}


def test_a_bad_tpot_slo_is_one_sentence():
    import pytest

    from gpuscope.guard import GuardConfigError

    for bad, words in (({"tpot_slo_s": -1}, "tpot_slo_s"), ({"tpot_slo_s": float("inf")}, "tpot_slo_s"),
                       ({"tpot_hold": 0}, "tpot_hold"), ({"tpot_hold": 1.5}, "tpot_hold")):
        with pytest.raises(GuardConfigError, match=words) as e:
            parse_config({"classes": [{"name": "a"}], "signals": bad})
        assert "\n" not in str(e.value)
