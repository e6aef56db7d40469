"""On a real NVIDIA GPU (`pytest -m gpu`): `gpuscope loadtest` against the example service on cuda reads this
host's GPU during the run (no agent answering) and puts SM activity, power and energy beside every stage."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from servers import ExampleService  # tests/ is on sys.path (conftest.py's folder)

pytestmark = pytest.mark.gpu


def test_ladder_with_gpu_panels(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    with socket.socket() as s:       # an agent URL that does not answer: the watch falls back to NVML
        s.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{s.getsockname()[1]}"
    svc = ExampleService("--device", "cuda", "--preset", "h200", "--seed", "1")
    try:
        p = subprocess.run(
            [sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())", "loadtest", svc.url,
             "--openai", "completions", "--prompt-tokens", "256", "--max-tokens", "64", "--stages", "2,16",
             "--stage-duration", "6s", "--warmup", "2s", "--gpu", nobody, "--json", "--out", str(tmp_path / "o")],
            capture_output=True, text=True, timeout=300)
    finally:
        svc.stop()
    assert p.returncode in (0, 1), p.stderr
    s = json.loads(p.stdout)
    assert "did not answer" in s["gpu_source"] or "nvml" in s["gpu_source"].lower()
    low, high = (st["gpu"] for st in s["stages"])
    assert low["readings"] >= 6 * 10 * 0.8 and high["readings"] >= 6 * 10 * 0.8   # >= 10 Hz on the run's clock
    assert high["power_w_mean"] > 0 and high["energy_j"] > 0 and high["j_per_output_token"] > 0
    busy = [g["sm_active_mean"] if g["sm_active_mean"] is not None else g["nvml_util_mean"] for g in (low, high)]
    assert busy[1] > busy[0] > 0                # 16 req/s keeps the GPU busier than 2 req/s
    assert (tmp_path / "o" / "gpu.jsonl").exists() and (tmp_path / "o" / "report.html").exists()
