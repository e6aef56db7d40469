"""Windows the agent starts itself (agent/autotrace.py): a real agent on loopback over the simulated node,
real Python processes opted in by one variable (PYTHONPATH=<data>/bootstrap) with a fake `torch` (as in
test_trace_run.py), and the decisions in process on real simulated snapshots."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from test_agent import AgentProc, http
from test_trace_run import FAKE_TORCH, PROG

from gpuscope.agent import autotrace
from gpuscope.agent.config import ConfigError, ProfilingSection, from_dict
from gpuscope.trace import ondemand as od

DURATION_S = 3.0
# The fake profiler's stop can be made to hang (FAKE_TORCH_STOP_S): a process held mid-window.
FAKE = dict(FAKE_TORCH, **{"profiler.py": FAKE_TORCH["profiler.py"].replace(
    "    def stop(self):\n        pass\n",
    "    def stop(self):\n        time.sleep(float(os.environ.get('FAKE_TORCH_STOP_S', '0')))\n")})
assert FAKE["profiler.py"] != FAKE_TORCH["profiler.py"]


def _env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "LOCAL_RANK", "PYTHONPATH") and not k.startswith("GPUSCOPE_")}
    e.update(extra)
    return e


def _until(what, timeout: float = 60.0, why: str = ""):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {why}")


def _get(agent: AgentProc, path: str, token: bool = False):
    code, body = http(agent.port, path, agent.token() if token else None)
    return code, json.loads(body)


@pytest.fixture(scope="module")
def fake(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fake_autotrace")
    (root / "torch").mkdir()
    for name, text in FAKE.items():
        (root / "torch" / name).write_text(text)
    (root / "prog.py").write_text(PROG)
    return root


@pytest.fixture(scope="module")
def node(tmp_path_factory, fake):
    """The bootstrap published, three programs started (two opted in, one not), then the agent: its first
    verdict (launch_or_sync_bound) is the flip."""
    tmp = tmp_path_factory.mktemp("autotrace")
    data = tmp / "data"
    data.mkdir()
    assert autotrace.publish(data, socket.gethostname()) == ""
    boot = str(data / "bootstrap")
    procs = {}
    for name, path, extra in [("opted", f"{boot}{os.pathsep}{fake}", {}),
                              ("held", f"{boot}{os.pathsep}{fake}", {"FAKE_TORCH_STOP_S": "120"}),
                              ("plain", str(fake), {})]:
        procs[name] = subprocess.Popen([sys.executable, str(fake / "prog.py"), "plain"],
                                       env=_env(PYTHONPATH=path, PROG_SLEEP="300", **extra),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    req_dir = str(data / "trace-requests")
    _until(lambda: len(od.opted_in(req_dir)) == 2, 30, "both opted-in programs to register")
    cfg = tmp / "agent.toml"
    cfg.write_text(f'[profiling]\ncheck_interval = "1s"\nduration = "{DURATION_S:g}s"\nevery = "off"\n')
    agent = AgentProc(tmp, "--simulate", "launch_bound", "--config", str(cfg))
    agent.wait_ready()
    yield types.SimpleNamespace(agent=agent, procs=procs, data=data)
    agent.stop()
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def _listing(node) -> dict:
    code, out = _get(node.agent, "/api/v1/autotrace")
    assert code == 200, out
    return out


def test_windows_the_agent_starts_itself(node):
    """One test over the one node (under pytest-xdist each worker would build its own): the flip's window,
    a process that exits mid-window, a budget spent, the token."""
    _flip_asks_the_opted_in_processes_within_30_s(node)
    _a_process_that_exits_mid_window_is_named(node)
    _a_spent_budget_refuses_in_the_process_own_words(node)


def _flip_asks_the_opted_in_processes_within_30_s(node):
    opted, held, plain = (node.procs[k].pid for k in ("opted", "held", "plain"))
    out = _until(lambda: (o := _listing(node))["flips"] and o["requests"] and o, 60, "the flip and its request")
    flip = out["flips"][-1]
    assert flip["kind"] in autotrace.TRIGGERS and flip["from"] is None and flip["gpu"] == "0"
    [req] = [r for r in out["requests"] if r["id"] in flip["requests"]]
    assert req["pids"] == sorted([opted, held]) and req["trigger"] == f"verdict {flip['kind']} on GPU 0"
    # recorded by the agent: the request's own creation stamp against the flip's
    assert 0 <= req["at_unix"] - flip["flip_unix"] <= 30
    assert req["duration_s"] == DURATION_S
    written = _until(lambda: [w for w in _listing(node)["windows"] if w["pid"] == opted], 60, "the window's verdicts")
    assert written[0]["trigger"] == req["trigger"] and written[0]["id"] == req["id"]
    assert written[0]["verdicts"] and written[0]["verdicts"][0]["gpu"] == "0"
    kinds = {v["kind"] for v in written[0]["verdicts"]}
    rules = {f["rule"] for f in written[0]["findings"]}
    q = "/api/v1/query_range?metric=gpu_trace_verdict&start=-10m&step=1s&agg=max"
    stored = _until(lambda: _get(node.agent, q)[1].get("series"), 20, "the window's verdict in the store")
    assert {s["labels"]["kind"] for s in stored} == kinds
    if rules:
        q = "/api/v1/query_range?metric=gpu_trace_finding&start=-10m&step=1s&agg=max"
        stored = _until(lambda: _get(node.agent, q)[1].get("series"), 20, "the findings in the store")
        assert {s["labels"]["rule"] for s in stored} == rules
    # the program that did not opt in: never asked, never traced, nothing of it in the directories
    names = os.listdir(node.data / "trace-requests") + os.listdir(node.data / "traces")
    assert not [n for n in names if f".{plain}." in n], names
    assert all(plain not in r.get("pids", []) for r in _listing(node)["requests"])


def _a_process_that_exits_mid_window_is_named(node):
    held = node.procs["held"]
    req = _until(lambda: [r for r in _listing(node)["requests"] if held.pid in r.get("pids", [])], 60, "its request")
    # the other process asked with it has written its window: this one's began with it, and its stop holds it
    _until(lambda: [a for r in _listing(node)["requests"] if r["id"] == req[0]["id"] for a in r["answers"]
                    if a["status"] == "written"], 60, "the other process's window")
    assert held.poll() is None
    held.kill()
    held.wait()
    done = _until(lambda: [r for r in _listing(node)["requests"] if r["id"] == req[0]["id"] and r.get("reason")],
                  60, "the agent to notice")
    assert done[0]["reason"] == f"process(es) [{held.pid}] exited before they answered"
    assert held.pid not in [a["pid"] for a in done[0]["answers"]]


def _a_spent_budget_refuses_in_the_process_own_words(node):
    opted = node.procs["opted"].pid
    _until(lambda: [w for w in _listing(node)["windows"] if w["pid"] == opted], 60, "its first window")
    code, out = http(node.agent.port, "/api/v1/trace", None, method="POST",
                     data=json.dumps({"duration": "1s", "pids": [opted]}).encode())
    assert code == 401, out  # only the token holder starts a window
    code, out = http(node.agent.port, "/api/v1/trace", node.agent.token(), method="POST",
                     data=json.dumps({"duration": "1s", "pids": [opted]}).encode())
    assert code == 202, out
    rid = json.loads(out)["id"]
    answer = _until(lambda: [t for t in _get(node.agent, "/api/v1/traces")[1]["traces"] if t["id"] == rid], 30,
                    "its answer")[0]
    assert answer["status"] == "refused" and "duty budget of 1 %" in answer["reason"]
    me = [p for p in _get(node.agent, "/api/v1/traces")[1]["opted_in"] if p["pid"] == opted][0]
    # the process's own record of what it spent: the one window, its whole cost, within the last 10 min
    # the agent asked DURATION_S (3 s), whose cost the prior puts at 15 s, over the 6 s of any 10 minutes:
    # the process shortened it to the longest that fits (1.2 s) and says so
    own = [t for t in _get(node.agent, "/api/v1/traces")[1]["traces"] if t.get("pid") == opted
           and t.get("status") == "written"][0]
    assert own["asked_duration_s"] == DURATION_S and own["duration_s"] == 1.2, own
    assert len(me["windows"]) == 1 and me["spent_s"] == me["windows"][0][1] >= own["duration_s"]
    assert f"spent {me['spent_s']:.1f} s of the last 10 min" in answer["reason"]
    assert me["next_allowed_unix"] > time.time() + 60


# -- in process: decisions on real simulated snapshots ----------------------------------------------
def _auto(tmp_path: Path, snaps: list, **profiling) -> autotrace.AutoTrace:
    data = tmp_path / "data"
    for d in ("trace-requests", "traces"):
        (data / d).mkdir(parents=True, exist_ok=True)
    cfg = types.SimpleNamespace(profiling=ProfilingSection(**profiling), data_path=data)
    return autotrace.AutoTrace(types.SimpleNamespace(cfg=cfg, sampler=types.SimpleNamespace(history=snaps),
                                                     store=None))


def _snaps(scenario: str, n: int = 60) -> list:
    from gpuscope import Sampler

    with Sampler(simulate=scenario) as s:  # 100 ms apart, as the agent samples: GPM needs its window
        out = []
        for _ in range(n):
            out.append(s.sample_once())
            time.sleep(0.1)
    return out


def test_only_a_turn_to_a_host_side_verdict_is_a_flip(tmp_path):
    healthy, launch = _snaps("healthy"), _snaps("launch_bound")
    a = _auto(tmp_path, healthy, every=0.0)
    a.tick(now=1000.0)
    assert list(a.flips) == [] and a._last_kind["0"] not in autotrace.TRIGGERS
    a.agent.sampler.history = launch
    a.tick(now=1005.0)
    [flip] = a.flips
    assert flip["from"] == "healthy" and flip["kind"] in autotrace.TRIGGERS and flip["flip_unix"] == 1005.0
    a.tick(now=1010.0)  # still host-side: no second flip
    assert len(a.flips) == 1 and "0" in a._open
    a.tick(now=1036.0)  # 30 s after it, the flip no longer asks
    assert "0" not in a._open
    off = _auto(tmp_path / "off", launch, on_verdict=False, every=0.0)
    off.tick(now=1000.0)
    assert list(off.flips) == []


def test_the_schedule_asks_on_gpu_processes_and_skips_a_spent_budget(tmp_path):
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        host = socket.gethostname()
        a = _auto(tmp_path, [], every=60.0, on_verdict=False)
        req_dir = a.requests_dir
        od.register(req_dir, {"host": host, "pid": kids[0].pid, "next_allowed_unix": None})
        od.register(req_dir, {"host": host, "pid": kids[1].pid, "next_allowed_unix": time.time() + 500,
                              "spent_s": 6.0, "horizon_s": 600.0})
        # kids[2] opted in but runs on no GPU; os.getpid() is on the GPU but never opted in
        od.register(req_dir, {"host": host, "pid": kids[2].pid})
        procs = [types.SimpleNamespace(pid=p, gpu="0") for p in (kids[0].pid, kids[1].pid, os.getpid())]
        a.agent.sampler.history = [types.SimpleNamespace(time_ns=time.time_ns(), processes=procs, simulated=None,
                                                         gpus=[])]
        a.tick()
        assert list(a.requests) == []  # not due yet
        a._next_scheduled = 0.0
        a.tick()
        asked = [r for r in a.requests if r["id"]]
        skipped = [r for r in a.requests if not r["id"]]
        assert [r["pids"] for r in asked] == [[kids[0].pid]] and asked[0]["trigger"] == "schedule every 60 s"
        assert [r["pid"] for r in skipped] == [kids[1].pid] and "budget is spent" in skipped[0]["reason"]
        [req] = od.pending_for(req_dir, kids[0].pid, host, since_unix=0)
        assert req["trigger"] == "schedule every 60 s" and req["duration_s"] == 1.0
        assert od.pending_for(req_dir, kids[1].pid, host, since_unix=0) == []
    finally:
        for k in kids:
            k.kill()
            k.wait()


def test_a_container_process_is_found_through_its_namespace_pid(tmp_path):
    """A registration from another PID namespace names itself <host>+pidns<inode> and its own pid; the agent
    maps it to the host pid NVML reports through /proc/PID/ns/pid and NSpid (a fake /proc tree here)."""
    proc = tmp_path / "proc"
    for pid, inner in ((4242, 7), (4343, 7)):
        (proc / str(pid) / "ns").mkdir(parents=True)
        (proc / str(pid) / "ns" / "pid").write_text("")
        (proc / str(pid) / "status").write_text(f"Name:\tpython\nNSpid:\t{pid}\t{inner}\n")
    (proc / "self" / "ns").mkdir(parents=True)
    (proc / "self" / "ns" / "pid").write_text("")
    ns = os.stat(proc / "4242" / "ns" / "pid").st_ino
    req_dir = str(tmp_path / "req")
    od.register(req_dir, {"host": f"h+pidns{ns}", "pid": 7})
    od.register(req_dir, {"host": "h+pidns1", "pid": 7})  # a namespace no GPU process lives in
    od.register(req_dir, {"host": "other+pidns{ns}", "pid": 7})
    [t] = autotrace.targets(req_dir, "h", {4242, 4343}, proc=str(proc))
    assert t["host_pid"] == 4242 and t["pid"] == 7
    assert autotrace.targets(req_dir, "h", {4343}, proc=str(proc)) == []


def test_an_unsafe_published_directory_is_never_used(tmp_path, fake):
    """A bootstrap directory others can write: the program runs untraced, says so once on stderr, and a
    module planted beside the bootstrap cannot be imported from there."""
    data = tmp_path / "data"
    data.mkdir()
    assert autotrace.publish(data, socket.gethostname()) == ""
    boot = data / "bootstrap"
    (boot / "planted.py").write_text("print('planted code ran')\n")
    os.chmod(boot, 0o777)
    code = "import sys, torch\ntorch.cuda.init()\ntry:\n    import planted\nexcept ImportError:\n    print('no planted')\n"
    p = subprocess.run([sys.executable, "-c", code], env=_env(PYTHONPATH=f"{boot}{os.pathsep}{fake}"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "no planted\n", p
    assert p.stderr.startswith("gpuscope: not profiling process ") and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.endswith(f": {boot} is writable by others (mode 0777); the program goes on.\n"), p.stderr
    assert os.listdir(data / "trace-requests") == []
    # the agent, for its part, takes the directory back (its own, made 0755 again)
    assert autotrace.publish(data, socket.gethostname()) == "" and (boot.stat().st_mode & 0o777) == 0o755


def test_the_agent_will_not_publish_through_a_symlink(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, data / "bootstrap")
    why = autotrace.publish(data, "h")
    assert why == f"{data / 'bootstrap'} is not a directory (a symlink?)" and os.listdir(elsewhere) == []


def test_profiling_config_is_checked():
    assert from_dict({"profiling": {"every": "off"}}).profiling.every == 0.0
    assert from_dict({"profiling": {"every": "1h", "duration": "5s"}}).profiling.every == 3600.0
    for table, words in [({"evry": "1h"}, "did you mean 'every'"), ({"every": "soon"}, 'or "off"'),
                         ({"duration": "40s"}, "between 1s and 30s"), ({"every": "10s"}, "at least 1m"),
                         ({"on_verdict": "yes"}, "true or false"), ({"check_interval": "5m"}, "between 1s and 60s")]:
        with pytest.raises(ConfigError, match=words):
            from_dict({"profiling": table})
    with pytest.raises(ConfigError, match=r"did you mean \[profiling\]"):
        from_dict({"profilng": {}})


def test_a_window_s_verdicts_are_cached_once_and_dropped_with_their_trace(tmp_path):
    fixture = Path(__file__).parent / "fixtures" / "traces" / "sync_heavy.pt.trace.json.gz"
    a = _auto(tmp_path, [])
    name = "h.7.0123456789abcdef.pt.trace.json.gz"
    shutil.copy(fixture, Path(a.traces_dir) / name)
    od.mark_done(a.requests_dir, "0123456789abcdef", "h", 7, status="written", file=name,
                 profiler_stop_unix_ns=time.time_ns(), trigger="verdict sync_bound on GPU 0")
    assert a.ingest() == 1 and a.ingest() == 0
    [w] = a.windows()
    assert [v["kind"] for v in w["verdicts"]] == ["sync_bound"] and w["trigger"] == "verdict sync_bound on GPU 0"
    assert "sync_in_loop" in {f["rule"] for f in w["findings"]}
    os.unlink(Path(a.traces_dir) / name)  # retention took the trace
    a.ingest()
    assert os.listdir(a.traces_dir) == []
