"""The dashboard shows the last trace's own verdicts and findings, and why the agent took it (Chromium)."""

from __future__ import annotations

import json
import time

from test_agent import AgentProc
from test_web_chromium import Page, browser  # noqa: F401 - a fixture


def test_the_kernels_box_says_the_window_s_verdict_and_its_trigger(tmp_path, browser):  # noqa: F811
    a = AgentProc(tmp_path, "--simulate", "healthy")
    try:
        a.wait_ready()
        file = "h.42.0123456789abcdef.pt.trace.json.gz"
        done = {"id": "0123456789abcdef", "host": "h", "pid": 42, "status": "written", "file": file,
                "duration_s": 2.0, "profiler_start_unix_ns": time.time_ns(), "answered_unix": time.time(),
                "trigger": "verdict launch_or_sync_bound on GPU 0"}
        (a.data / "trace-requests" / "done.0123456789abcdef.h.42.json").write_text(json.dumps(done))
        kernels = [{"gpu": "0", "name": "k", "short_name": "k", "count": 3, "total_s": 2e-3, "p50_s": 6e-4,
                    "p99_s": 9e-4, "launch_delay_p50_s": None}]
        (a.data / "traces" / (file + ".kernels.json")).write_text(json.dumps({"kernels": kernels}))
        verdicts = {"verdicts": [{"gpu": "0", "kind": "launch_bound", "confidence": 0.9, "summary": "s"}],
                    "findings": [{"rule": "<img src=x onerror=alert(1)>", "severity": "high", "summary": "s"},
                                 {"rule": "tiny_kernel_storm", "severity": "high", "summary": "s"}]}
        (a.data / "traces" / (file + ".verdicts.json")).write_text(json.dumps(verdicts))
        page = Page(browser, f"http://127.0.0.1:{a.port}").open("/ui/")
        page.until("!document.querySelector('#kernels-verdict').hidden", timeout=60.0)  # a loaded CI machine: a bound, not a figure
        text = page.js("document.querySelector('#kernels-verdict').textContent")
        assert text == ("Verdict of this window: GPU 0 launch_bound; findings: <img src=x onerror=alert(1)>, "
                        "tiny_kernel_storm; started by the agent: verdict launch_or_sync_bound on GPU 0")
        assert page.js("document.querySelector('#kernels-verdict img')") is None  # text, never markup
        assert page.errors == []
    finally:
        a.stop()
