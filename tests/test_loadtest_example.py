"""The load tester against the example inference service (a real PyTorch model streaming SSE), on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from servers import ExampleService  # tests/ is on sys.path (conftest.py's folder)


def test_openai_chat_against_the_example_service(tmp_path: Path) -> None:
    svc = ExampleService("--seed", "1")
    try:
        p = subprocess.run(
            [sys.executable, "-c", "import sys; from gpuscope.cli import main; sys.exit(main())", "loadtest", svc.url,
             "--openai", "chat", "--prompt-tokens", "32", "--max-tokens", "12", "--rate", "2", "--duration", "3s",
             "--arrival", "constant", "--workers", "1", "--no-gpu", "--no-html", "--json", "--slo", "ttft=5s",
             "--metrics-as", "aiperf", "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    finally:
        svc.stop()
    assert p.returncode in (0, 1), p.stderr
    s = json.loads(p.stdout)
    o = s["overall"]
    assert s["protocol"] == "openai-chat" and o["requests"] == 6 and o["errors"] == {}
    assert o["output_tokens"] > 0 and o["ttft_ms"]["p50"] > 0 and o["tpot_ms"]["mean"] > 0
    recs = [json.loads(line) for line in (tmp_path / "o" / "records.jsonl").read_text().splitlines()]
    assert all(r["tokens_from"] == "usage" and r["output_tokens"] == len(r["chunk_times"]) for r in recs)
    assert s["names"] == {"chunk_gap_ms": "ICL", "tpot_ms": "ITL"}
