"""The live views on a real GPU (`pytest -m gpu`): `gpuscope top` and the agent's dashboard API while a
reference workload trains on the GPU.

Set GPUSCOPE_RECORD_DIR to keep what they showed: top's screen (tmux capture with colours), top's
--once --json overview and the dashboard API's answers (for a screenshot rendered elsewhere).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_agent import AgentProc, env, http  # tests/ is on sys.path through its conftest.py

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = Path(os.environ.get("GPUSCOPE_WORKLOADS", ROOT.parent / "shared" / "workloads"))
RECORD = os.environ.get("GPUSCOPE_RECORD_DIR")
# What the dashboard's charts ask for (web/static/app.js CHARTS, with their reference lines).
CHART_METRICS = ("gpu_sm_active_ratio", "gpu_tensor_active_ratio", "gpu_dram_active_ratio", "gpu_utilization_ratio",
                 "gpu_sm_clock_hertz", "gpu_sm_clock_max_hertz", "gpu_power_watts", "gpu_power_limit_watts",
                 "gpu_memory_used_bytes", "gpu_temperature_celsius",
                 "gpu_pcie_rx_bytes_per_second", "gpu_pcie_tx_bytes_per_second",
                 "gpu_nvlink_rx_bytes_per_second", "gpu_nvlink_tx_bytes_per_second")


def _record(name: str, data: bytes | str) -> None:
    if RECORD:
        Path(RECORD).mkdir(parents=True, exist_ok=True)
        (Path(RECORD) / name).write_bytes(data.encode() if isinstance(data, str) else data)


@pytest.fixture(scope="module")
def workload():
    """healthy_training on GPU 0 for the module's tests; yields its pid once it computes."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA driver here")
    script = WORKLOADS / "healthy_training.py"
    if not script.exists():
        pytest.skip(f"{script} not found (set GPUSCOPE_WORKLOADS)")
    p = subprocess.Popen([sys.executable, str(script), "--seconds", "150"], cwd=str(WORKLOADS),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout
            if str(p.pid) in out.split():
                break
            assert p.poll() is None, p.stderr.read()
            time.sleep(0.5)
        busy = 0
        while busy < 3:  # past set-up, into the training loop: the GPU busy in three readings in a row
            assert time.monotonic() < deadline + 60, "the workload never kept the GPU busy"
            util = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                   "-i", "0"], capture_output=True, text=True).stdout.strip()
            busy = busy + 1 if util.isdigit() and int(util) >= 50 else 0
            time.sleep(0.5)
        yield p.pid
    finally:
        p.kill()
        p.wait()


def test_top_once_json_shows_the_real_gpu_and_the_workload(workload, tmp_path):
    r = subprocess.run([sys.executable, "-m", "gpuscope.cli", "top", "--once", "--json",
                        "--url", "http://127.0.0.1:9"],  # no agent there: top samples by itself
                       capture_output=True, text=True, timeout=60, env=env())
    assert r.returncode == 0, r.stderr
    ov = json.loads(r.stdout)
    _record("top_once.json", r.stdout)
    assert ov["simulated"] is None and ov["source"] == "local"
    g = ov["gpus"][0]
    assert "H200" in g["name"] and g["healthy"]
    v = g["values"]
    assert v["gpu_sm_active_ratio"] is not None and v["gpu_sm_active_ratio"] > 0.3, v
    assert v["gpu_utilization_ratio"] is not None and v["gpu_power_watts"] > 100
    assert any(p["pid"] == workload and p["gpu_memory_bytes"] > 1e9 for p in ov["processes"]), ov["processes"]


def test_agent_dashboard_api_on_a_real_gpu(workload, tmp_path):
    a = AgentProc(tmp_path)
    a.wait_ready(30)
    try:
        time.sleep(40)  # a verdict over 10 s needs 10 s; the rest is history for the recorded charts
        answers: dict[str, object] = {}

        def get(path: str) -> dict:
            code, body = http(a.port, path)
            assert code == 200, (path, body[:300])
            answers[path] = json.loads(body)
            return answers[path]

        ov = get("/ui/api/overview")
        g = ov["gpus"][0]
        assert ov["source"] == "agent" and ov["simulated"] is None and "H200" in g["name"]
        assert g["values"]["gpu_sm_active_ratio"] > 0.3
        assert g["verdict"] is not None and g["verdict"]["kind"] in ("healthy", "compute_bound"), g["verdict"]
        assert any(p["pid"] == workload for p in ov["processes"])
        meta = get("/ui/api/meta")
        assert [x["key"] for x in meta["gpus"]] == [g["key"]]
        for metric in CHART_METRICS:
            data = get(f"/ui/api/range?metric={metric}&start=-1m&end=now&step=auto")
            vals = [x for s in data["series"] for x in s["values"] if x is not None]
            assert vals, metric
            if not metric.startswith(("gpu_pcie", "gpu_nvlink")):  # training on resident data moves little
                assert max(vals) > 0, metric
        tl = get("/ui/api/timeline?start=-1m&end=now")
        assert any(s["kind"] in ("healthy", "compute_bound") for s in tl["spans"]), tl["spans"]
        get("/ui/api/alerts")
        code, body = http(a.port, "/ui/")
        assert code == 200 and b"<html" in body.lower()
        code, body = http(a.port, "/ui/vendor/uPlot.iife.min.js")
        assert code == 200 and len(body) > 10_000
        _record("dashboard_api.json", json.dumps(answers))
        if shutil.which("tmux"):
            _top_in_tmux(a, workload)
    finally:
        assert a.stop() == 0


def _top_in_tmux(a: AgentProc, pid: int) -> None:
    """`gpuscope top` reading the agent, in a real terminal (tmux): the GPU and the workload show."""
    sock = f"gpuscope-gpu-{os.getpid()}"
    tm = ["tmux", "-L", sock]
    cmd = f"{sys.executable} -m gpuscope.cli top --url http://127.0.0.1:{a.port}"
    e = env() | {"TERM": "xterm-256color"}
    subprocess.run([*tm, "new-session", "-d", "-x", "120", "-y", "40", cmd], check=True, env=e)
    try:
        screen = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            screen = subprocess.run([*tm, "capture-pane", "-p"], capture_output=True, text=True).stdout
            if "H200" in screen and str(pid) in screen:
                break
            time.sleep(0.5)
        time.sleep(3)  # a few refreshes of history in the sparklines
        colour = subprocess.run([*tm, "capture-pane", "-p", "-e"], capture_output=True, text=True).stdout
        _record("top_screen.ansi", colour)
        assert "H200" in screen and str(pid) in screen, screen
    finally:
        subprocess.run([*tm, "kill-server"], capture_output=True)


def test_top_screenshot_on_a_real_gpu(workload):
    """The README's picture of `gpuscope top` on the H200 while the workload trains (textual's own SVG export,
    as the simulated one in tests/test_top.py): the real GPU, its verdict and the workload's row."""
    import asyncio
    import html

    from gpuscope import Sampler, SamplerConfig
    from gpuscope.top import LocalFeed
    from gpuscope.top.app import TopApp

    feed = LocalFeed(Sampler(SamplerConfig(interval=0.1)), 0.25).start()
    svg: list[str] = []
    try:
        app = TopApp(feed, refresh=0.25)

        def text() -> str:
            return "\n".join(app.query_one(f"#{w}").text.plain for w in ("header", "gpus", "procs"))

        async def go() -> None:
            async with app.run_test(size=(140, 36)) as p:
                deadline = time.monotonic() + 60
                while not ("H200" in text() and str(workload) in text() and "gathering" not in text()):
                    assert time.monotonic() < deadline, text()
                    await p.pause(0.1)
                await p.pause(3.0)  # a few refreshes of history in the sparklines
                svg.append(app.export_screenshot(title="gpuscope top on an NVIDIA H200 (healthy_training.py)"))

        asyncio.run(go())
    finally:
        feed.stop()
    shown = html.unescape(svg[0]).replace("\u00a0", " ")
    assert "H200" in shown and str(workload) in shown and "SIMULATED" not in shown
    _record("top-h200.svg", svg[0])
