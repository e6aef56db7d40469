"""[processes] cmdline: what a real agent (--simulate, a loopback port) shows of its processes' command
lines in every surface: /api/v1/latest, the dashboard's /ui/api/overview, /metrics and `top --once --json`
read from the agent. "redacted" shows the (redacted) command line, "name-only" the process name, "hidden"
nothing; the simulated jobs run `python train.py --batch-size 64 --gpu N`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from test_agent import AgentProc, env, http

ARGS = "train.py --batch-size"  # in the simulated command line, never in the process name ("python")


def _surfaces(a: AgentProc) -> dict[str, str]:
    token = a.token()
    out = {}
    for path in ("/api/v1/latest", "/ui/api/overview", "/metrics"):
        code, body = http(a.port, path, token)
        assert code == 200, (path, code, body[:200])
        out[path] = body.decode()
    # --token=T: a token may start with '-' (token_urlsafe), which argparse would take for a flag
    top = subprocess.run([sys.executable, "-m", "gpuscope", "top", "--once", "--json", "--url",
                          f"http://127.0.0.1:{a.port}", *([f"--token={token}"] if token else [])],
                         env=env(), capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and "Traceback" not in top.stderr, top.stderr
    out["top"] = top.stdout
    return out


def _processes(a: AgentProc, timeout: float = 20.0) -> list[dict]:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        code, body = http(a.port, "/api/v1/latest", a.token())
        procs = json.loads(body).get("processes") if code == 200 else None
        if procs:
            return procs
        time.sleep(0.2)
    raise AssertionError("the agent showed no processes")


@pytest.mark.parametrize("mode", ["redacted", "name-only", "hidden"])
def test_the_cmdline_mode_holds_in_every_surface(tmp_path, mode):
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[processes]\ncmdline = "{mode}"\n')
    a = AgentProc(tmp_path, "--simulate", "healthy", "--gpus", "2", "--config", str(cfg))
    try:
        a.wait_ready()
        procs = _processes(a)
        shown = {p["cmdline"] for p in procs}
        surfaces = _surfaces(a)
    finally:
        a.stop()
    if mode == "redacted":
        assert all(ARGS in c for c in shown), shown
        assert ARGS in surfaces["/api/v1/latest"] and ARGS in surfaces["top"]  # the check below can fail
    else:
        assert shown == ({"python"} if mode == "name-only" else {""}), shown
        for where, text in surfaces.items():
            assert ARGS not in text, (where, text[:500])
        assert {p["name"] for p in procs} == {"python"}  # the name is still there


def test_an_unknown_cmdline_mode_is_one_sentence(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[processes]\ncmdline = "full"\n')
    p = subprocess.run([sys.executable, "-m", "gpuscope", "agent", "--config", str(cfg), "--data-dir",
                        str(tmp_path / "d")], env=env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "[processes] cmdline must be one of redacted, name-only, hidden, not 'full'." in p.stderr
