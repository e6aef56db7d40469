"""The main job on a machine without an NVIDIA driver: `gpuscope agent` says so in one sentence, exits 1,
and names a command that works (`--simulate mixed`), which then serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from servers import free_port, http_get


def _driver_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001 - any failure: no usable driver
        return False


pytestmark = pytest.mark.skipif(_driver_present(), reason="this machine has an NVIDIA driver")


def test_agent_without_a_driver_names_the_simulate_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "gpuscope", "agent", "--data-dir", str(tmp_path),
                          "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert "No NVIDIA driver" in lines[0] and "--simulate mixed" in lines[0] and "gpuscope scenarios" in lines[0]


def test_the_named_command_serves(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpuscope", "agent", "--simulate", "mixed", "--data-dir",
                             str(tmp_path), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        status, body = None, b""
        for _ in range(600):  # bounded: up to 60 s on a loaded machine
            try:
                status, body = http_get(f"http://127.0.0.1:{port}/metrics")
                break
            except OSError:
                if proc.poll() is not None:
                    break
                time.sleep(0.1)
        assert status == 200, proc.stderr.read().decode() if proc.poll() is not None else "no answer"
        assert b"gpu_sm_active_ratio" in body
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_doctor_json_without_a_driver_is_json_with_the_reason():
    import json

    out = subprocess.run([sys.executable, "-m", "gpuscope", "doctor", "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    assert doc["available"] is False and "No NVIDIA driver" in doc["reason"] and doc["gpus"] == []
    assert out.stderr == ""


def test_doctor_json_on_a_simulated_node_says_available():
    import json

    out = subprocess.run([sys.executable, "-m", "gpuscope", "doctor", "--json", "--simulate", "mixed", "--gpus", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    doc = json.loads(out.stdout)
    assert doc["available"] is True and len(doc["gpus"]) == 2
