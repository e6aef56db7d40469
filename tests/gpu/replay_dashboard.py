"""Render the dashboard from answers recorded on a GPU machine, where no browser runs.

tests/gpu/test_gpu_views.py (with GPUSCOPE_RECORD_DIR) keeps what the agent's /ui/api/* answered while
a workload trained on the GPU. This serves those answers through the real dashboard app (the same
handlers and page, a backend that replays them) and screenshots it in headless Chromium:

    python tests/gpu/replay_dashboard.py REC_DIR/dashboard_api.json docs/img/dashboard-h200.png
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from aiohttp import web

from gpuscope.web.api import make_ui_app
from gpuscope.web.backend import RangeQuery


class ReplayBackend:
    """Answers with what the agent answered then, whatever the page asks now."""

    source = "agent"

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.ranges = {parse_qs(urlsplit(p).query)["metric"][0]: a
                       for p, a in answers.items() if p.startswith("/ui/api/range?")}

    def _one(self, prefix: str) -> Any:
        return next(a for p, a in self.answers.items() if p.startswith(prefix))

    async def overview(self) -> dict[str, Any]:
        return self._one("/ui/api/overview")

    async def meta(self) -> dict[str, Any]:
        return self._one("/ui/api/meta")

    async def range(self, q: RangeQuery) -> dict[str, Any]:
        return self.ranges.get(q.metric) or {"metric": q.metric, "start_ns": q.start_ns, "end_ns": q.end_ns,
                                             "step_s": q.step_s, "agg": q.agg, "simulated": None, "series": []}

    async def timeline(self, start_ns: int, end_ns: int, gpus: tuple[str, ...] = ()) -> dict[str, Any]:
        return self._one("/ui/api/timeline")

    async def alerts(self) -> dict[str, Any]:
        return self._one("/ui/api/alerts")

    async def close(self) -> None:
        return None


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    answers = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    app = make_ui_app(ReplayBackend(answers), token=None, loopback_only=True, token_path="")
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"http://127.0.0.1:{port}/ui/?start=-1m")
        deadline = time.monotonic() + 30
        while not page.evaluate("window.gpuscope && window.gpuscope.renderedAt && window.gpuscope.loads"):
            if time.monotonic() > deadline:
                raise SystemExit("the dashboard did not render the recorded answers within 30 s")
            time.sleep(0.1)
        time.sleep(1.5)  # a live update from the stream, so the cards are filled
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)
        browser.close()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
