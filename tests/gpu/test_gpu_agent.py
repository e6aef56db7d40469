"""The agent on a real GPU (`pytest -m gpu`): real NVML through /metrics, the store and the query API."""

from __future__ import annotations

import json
import time

import pytest
from test_agent import AgentProc, http  # tests/ is on sys.path through its conftest.py

pytestmark = pytest.mark.gpu


def _started(tmp_path, *args: str) -> AgentProc:
    """A real agent on this machine's GPUs, ready; skipped where there is no driver."""
    a = AgentProc(tmp_path, *args)
    try:
        a.wait_ready(30)
    except AssertionError as e:
        a.stop()
        if "No NVIDIA driver" in str(e):
            pytest.skip("no NVIDIA driver")
        raise
    return a


def test_agent_on_a_real_gpu(tmp_path):
    a = _started(tmp_path)
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


def test_gr_engine_active_with_gpm_graphics_and_throttle_time_never_outruns_the_clock(tmp_path):
    """`[sampler] gpm_graphics = true` makes dcgm-exporter's default DCGM_FI_PROF_GR_ENGINE_ACTIVE appear, in
    the one-job naming too; every throttle-time counter grows at most one second per second of wall time."""
    cfg = tmp_path / "agent.toml"
    cfg.write_text("[sampler]\ngpm_graphics = true\n")
    a = _started(tmp_path, "--config", str(cfg))
    try:
        time.sleep(3.0)

        def counters() -> tuple[float, dict[str, float]]:
            code, body = http(a.port, "/metrics")
            assert code == 200
            out = {}
            for line in body.decode().splitlines():
                if line.startswith(("gpu_throttle_seconds_total{", "gpu_thermal_throttle_seconds_total{")):
                    key, value = line.rsplit(" ", 1)
                    out[key] = float(value)
            return time.monotonic(), out

        t0, c0 = counters()
        time.sleep(5.0)
        t1, c1 = counters()
        assert c0 and c1.keys() == c0.keys()
        for k in c0:
            assert c1[k] - c0[k] <= (t1 - t0) + 0.5, (k, c0[k], c1[k], t1 - t0)  # 0.5 s: the sampling grain
        for naming in ("dcgm", "canonical,dcgm"):
            code, body = http(a.port, f"/metrics?naming={naming}")
            text = body.decode()
            assert code == 200 and "DCGM_FI_PROF_GR_ENGINE_ACTIVE{" in text, naming
            vals = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                    if x.startswith("DCGM_FI_PROF_GR_ENGINE_ACTIVE{")]
            assert vals and all(0.0 <= v <= 1.0 for v in vals), vals
    finally:
        assert a.stop() == 0
