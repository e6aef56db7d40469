"""The guard's GPU signal from a real agent on a real GPU (`pytest -m gpu`): SM activity (GPM on Hopper),
free memory, throttle reasons; a bf16 matmul load drives SM activity up and the gradient limit stops
growing while it is saturated."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import pytest
from test_agent import AgentProc  # tests/ is on sys.path through its conftest.py

from gpuscope.guard import Guard, parse_config
from gpuscope.guard._signals import SignalPoller

pytestmark = pytest.mark.gpu

_LOAD = """
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + 20
while time.time() < end:
    (a @ a).sum().item()
"""


def test_guard_reads_a_real_gpu_through_the_agent(tmp_path):
    pytest.importorskip("torch")
    a = AgentProc(tmp_path)
    try:
        a.wait_ready(30)
    except AssertionError as e:
        a.stop()
        if "No NVIDIA driver" in str(e):
            pytest.skip("no NVIDIA driver")
        raise
    load = subprocess.Popen([sys.executable, "-c", _LOAD])
    try:
        time.sleep(6)  # the load warms up and the agent takes GPM samples

        async def poll():
            g = Guard(parse_config({"classes": [{"name": "a"}],
                                    "signals": {"agent": f"http://127.0.0.1:{a.port}", "gpu": "0"}}))
            async with aiohttp.ClientSession() as s:
                sig = await SignalPoller(g).poll_once(s)
            return g, sig

        g, sig = asyncio.run(poll())
        assert sig is not None
        print("GPU signal under a bf16 matmul:", sig)
        assert sig.sm_active_ratio is not None and sig.sm_active_ratio > 0.5
        assert sig.memory_free_ratio is not None and 0 < sig.memory_free_ratio < 1
        assert g.limiter.gpu_signal_state(g.now()) == "fresh"
    finally:
        load.kill()
        load.wait()
        a.stop()
