"""`gpuscope loadtest --report-from DIR` writes a run's report again from its output files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest_servers import LoadtestServer

GPUSCOPE = [sys.executable, "-m", "gpuscope"]


def test_a_run_s_report_is_written_again_from_its_files(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with LoadtestServer() as srv:
        p = subprocess.run([*GPUSCOPE, "loadtest", srv.url("/latency"), "--rate", "20", "--duration", "2s",
                            "--workers", "1", "--no-gpu", "--quiet", "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stderr  # 1: a busy machine sent late; still measured
    first = (out / "report.html").read_text()
    (out / "report.html").unlink()
    p = subprocess.run([*GPUSCOPE, "loadtest", "--report-from", str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "report.html" in p.stdout, p.stderr
    again = (out / "report.html").read_text()
    summary = json.loads((out / "summary.json").read_text())
    n = summary["overall"]["requests"]
    assert n > 10 and f"{n} requests" in again and f"{n} requests" in first
    assert "data-points" in again  # the plots carry the records' data as the first page did


def test_bad_directories_are_one_sentence(tmp_path: Path) -> None:
    def run(d: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*GPUSCOPE, "loadtest", "--report-from", str(d)], capture_output=True, text=True,
                              timeout=60)
    p = run(tmp_path)
    assert p.returncode == 2 and "no summary.json" in p.stderr and "Traceback" not in p.stderr
    (tmp_path / "summary.json").write_text("{not json")
    p = run(tmp_path)
    assert p.returncode == 2 and "not valid JSON" in p.stderr
    (tmp_path / "summary.json").write_text('{"tool": "something else"}')
    p = run(tmp_path)
    assert p.returncode == 2 and "not a gpuscope loadtest summary" in p.stderr
    (tmp_path / "summary.json").write_text('{"tool": "gpuscope loadtest", "version": 1}')
    (tmp_path / "records.jsonl").write_text('{"i": 0}\n[1]\n')
    p = run(tmp_path)
    assert p.returncode == 2 and "Line 1" in p.stderr or "Line 2" in p.stderr, p.stderr
    p = subprocess.run([*GPUSCOPE, "loadtest"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Say which URL" in p.stderr


def test_report_from_recomputes_gpu_figures_for_the_asked_gpus(tmp_path: Path) -> None:
    stage = {"index": 0, "name": "s", "start_s": 0.0, "end_s": 10.0, "target_rate": 1.0,
             "stats": {"requests": 5, "completed": 5, "output_tokens": 50}}
    summary = {"tool": "gpuscope loadtest", "version": 1, "url": "http://x", "duration_s": 10.0,
               "stages": [stage], "overall": {"requests": 5, "completed": 5, "output_tokens": 50},
               "gpu_source": "nvml (2 GPUs, every 95 ms)"}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    lines = [{"t": i * 0.1, "gpu": g, "sm_active": 0.5 if g == "0" else 0.0, "nvml_util": 0.8 if g == "0" else 0.0,
              "power_w": 400.0 if g == "0" else 80.0, "energy_j": (400.0 if g == "0" else 80.0) * i * 0.1,
              "mem_used_frac": 0.3, "source": "nvml", "extra": {}}
             for i in range(100) for g in ("0", "1")]
    (tmp_path / "gpu.jsonl").write_text("".join(json.dumps(o) + "\n" for o in lines))

    def run(*extra: str) -> tuple[subprocess.CompletedProcess[str], str]:
        p = subprocess.run([*GPUSCOPE, "loadtest", "--report-from", str(tmp_path), *extra], capture_output=True,
                           text=True, timeout=60)
        return p, (tmp_path / "report.html").read_text() if p.returncode == 0 else ""

    p, page = run()
    assert p.returncode == 0, p.stderr
    assert "GPU 1 stayed idle through the run" in page and "id=per-gpu" in page
    assert "25.0 %" in page  # the node's mean SM activity, GPU 1's zeros included
    p, page = run("--gpus", "0")
    assert p.returncode == 0, p.stderr
    assert "stayed idle" not in page and "id=per-gpu" not in page and "shown for GPU 0 only" in page
    assert "50.0 %" in page  # GPU 0's own
    assert json.loads((tmp_path / "summary.json").read_text()) == summary  # the run's files are left as written
    p, _ = run("--gpus", "4")
    assert p.returncode == 2 and "holds no readings of GPU 4 (it has 0, 1)" in p.stderr
    p, _ = run("--gpus", "first")
    assert p.returncode == 2 and "not a list of GPU indices" in p.stderr and "Traceback" not in p.stderr
