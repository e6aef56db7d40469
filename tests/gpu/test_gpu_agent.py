"""The agent on a real GPU (`pytest -m gpu`): real NVML through /metrics, the store and the query API."""

from __future__ import annotations

import json
import time

import pytest
from test_agent import AgentProc, http  # tests/ is on sys.path through its conftest.py

pytestmark = pytest.mark.gpu


def test_agent_on_a_real_gpu(tmp_path):
    a = AgentProc(tmp_path)
    try:
        a.wait_ready(30)
    except AssertionError as e:
        a.stop()
        if "No NVIDIA driver" in str(e):
            pytest.skip("no NVIDIA driver")
        raise
    try:
        time.sleep(3.0)
        code, body = http(a.port, "/metrics")
        text = body.decode()
        assert code == 200 and "simulated=" not in text
        assert 'gpu_sm_active_ratio{gpu="0"' in text and "gpu_energy_joules_total{" in text
        code, body = http(a.port, "/metrics?naming=dcgm")
        assert code == 200 and "DCGM_FI_PROF_SM_ACTIVE{" in body.decode()
        code, body = http(a.port, "/api/v1/query_range?metric=gpu_power_watts&start=-20s&step=1s")
        data = json.loads(body)
        assert code == 200 and data["simulated"] is None
        vals = [v for s in data["series"] for v in s["values"] if v is not None]
        assert vals and all(20 < v < 1500 for v in vals)
        code, body = http(a.port, "/api/v1/status")
        st = json.loads(body)
        assert st["healthy_gpus"] >= 1 and st["sampler"]["ticks"] > 20
        print("agent status on the GPU:", json.dumps(st)[:2000])
    finally:
        assert a.stop() == 0
