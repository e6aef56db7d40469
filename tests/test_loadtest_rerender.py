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
