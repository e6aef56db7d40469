"""The agent starts a window itself in a real PyTorch process (`pytest -m gpu`): the launch-bound reference
workload, opted in by nothing but PYTHONPATH=<the agent's data dir>/bootstrap (gpuscope itself not on its
path), turns its GPU's verdict host-side; the agent records the flip, asks within 30 s, and the window's
own verdict (from the trace) is launch-bound."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_agent import AgentProc, http  # tests/ is on sys.path through its conftest.py

from gpuscope.agent.autotrace import FLIP_OPEN_S, TRIGGERS

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = Path(os.environ.get("GPUSCOPE_WORKLOADS", ROOT.parent / "shared" / "workloads"))


def _until(what, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError("timed out")


def test_a_launch_bound_pytorch_process_gets_a_window_within_30_s_of_the_flip(tmp_path):
    script = WORKLOADS / "launch_bound.py"
    if not script.exists() or shutil.which("nvidia-smi") is None:
        pytest.skip("needs the reference workloads (GPUSCOPE_WORKLOADS) and an NVIDIA driver")
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[profiling]\ncheck_interval = "1s"\nduration = "2s"\nevery = "off"\n')
    agent = AgentProc(tmp_path, "--config", str(cfg))
    prog = None
    try:
        agent.wait_ready(60)
        boot = agent.data / "bootstrap"
        assert (boot / "sitecustomize.py").exists()
        e = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCOPE_") and k not in ("RANK", "LOCAL_RANK")}
        e.update(PYTHONPATH=str(boot), WORKLOAD_SECONDS="100")  # the one variable; no gpuscope on the path
        started = time.time()
        prog = subprocess.Popen([sys.executable, str(script)], env=e, cwd=str(WORKLOADS),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def listing():
            return json.loads(http(agent.port, "/api/v1/autotrace")[1])

        def written():
            out = listing()
            for r in out["requests"]:
                if prog.pid in r.get("pids", []) and any(a["pid"] == prog.pid and a["status"] == "written"
                                                         for a in r["answers"]):
                    return out, r
            return None

        out, req = _until(written, 120)
        flip = next(f for f in out["flips"] if req["id"] in f["requests"])
        assert flip["kind"] in TRIGGERS and flip["flip_unix"] >= started
        delay_s = req["at_unix"] - flip["flip_unix"]  # both stamped by the agent
        assert 0 <= delay_s <= FLIP_OPEN_S
        [answer] = [a for a in req["answers"] if a["pid"] == prog.pid]
        window = _until(lambda: [w for w in listing()["windows"] if w["id"] == req["id"] and w["pid"] == prog.pid],
                        60)[0]
        kinds = {v["kind"] for v in window["verdicts"]}
        print(f"\nflip {flip['from']} -> {flip['kind']} {flip['flip_unix'] - started:.1f} s after the launch; asked "
              f"{delay_s:.2f} s after the flip; window cost {answer['cost_s']} s; its verdicts {sorted(kinds)}; "
              f"findings {sorted({f['rule'] for f in window['findings']})}")
        assert "launch_bound" in kinds, window
        # the process's own record of its spend, and a second window refused by it
        regs = json.loads(http(agent.port, "/api/v1/traces")[1])["opted_in"]
        [me] = [p for p in regs if p["pid"] == prog.pid]
        assert me["spent_s"] == answer["cost_s"] and me["next_allowed_unix"] > time.time()
    except BaseException:  # what the agent and the program said, for the one who reads the failure
        try:
            print("autotrace:", json.dumps(json.loads(http(agent.port, "/api/v1/autotrace")[1]))[-4000:])
        except Exception:  # noqa: BLE001
            pass
        if prog is not None and prog.poll() is None:
            prog.terminate()
            print("program:", prog.communicate(timeout=60)[1][-3000:])
        agent.stop()
        print("agent:", agent.proc.stderr.read()[-3000:])
        raise
    finally:
        if prog is not None and prog.poll() is None:
            prog.terminate()
            _, err = prog.communicate(timeout=60)
            assert "Traceback" not in err, err
        agent.stop()
