"""One trace of a job across nodes (`gpuscope trace fleet`): four real agents on loopback, each with a real
program opted in on demand (fake torch, as in test_trace_ondemand.py), found through a real Prometheus
scraping them; one agent's clock reads 250 ms ahead (the test-only GPUSCOPE_TEST_CLOCK_SHIFT_NS of a
simulated node), as another host's might. Checked on what was recorded: each trace's own window start
(its file on the node) against the common start asked for, and the collectives the fake programs ran at
one true moment, in the merged file."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from servers import PrometheusServer, free_port
from test_agent import env, http
from test_trace_run import FAKE_TORCH, PROG

from gpuscope.agent.trace_api import TEST_CLOCK_SHIFT_ENV
from gpuscope.trace import fleet

SHIFT_NS = 250_000_000        # agent 3's clock, ahead of the real one
LATE_US = 3000.0              # rank 2 reaches every collective 3 ms after the others
JOB = "torchrun/fleet42"
TOKEN = "fleet-test-token-0123456789abcdef"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"

# The fake profiler: a compute kernel and an all-reduce on every 100 ms tick of the real clock inside the
# window, so the ranks' collectives happen at one true moment (rank 2's FAKE_LATE_US after it).
PROFILER = '''
import json, os, secrets, time

class ProfilerActivity:
    CPU = "CPU"
    CUDA = "CUDA"

class _ExperimentalConfig:
    def __init__(self, profile_all_threads=False):
        self.profile_all_threads = profile_all_threads

class profile:
    def __init__(self, **kwargs):
        pass

    def start(self):
        self.t0 = time.time_ns()
        if os.environ.get("FAKE_STARTED"):  # the test kills it mid-window, once the window began
            open(os.environ["FAKE_STARTED"], "w").close()

    def stop(self):
        self.t1 = time.time_ns()

    def export_chrome_trace(self, path):
        late = float(os.environ.get("FAKE_LATE_US", "0"))
        extra = float(os.environ.get("FAKE_EXTRA_US", "0"))  # more compute before each collective
        base = self.t0 // 10**9 * 10**9
        pid = os.getpid()
        us = lambda ns: (ns - base) / 1000.0
        events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}}]
        tick, k = -(-self.t0 // 10**8) * 10**8, 0
        while tick + 2 * 10**7 < self.t1:
            c = 2 * k
            events += [
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": pid,
                 "ts": us(tick) - 60000, "dur": 5.0, "args": {"correlation": c}},
                {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": us(tick) - 50000 - extra,
                 "dur": 50000 + extra + late, "args": {"correlation": c, "device": 0, "stream": 7}},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": pid,
                 "ts": us(tick) - 59000, "dur": 5.0, "args": {"correlation": c + 1}},
                {"ph": "X", "cat": "kernel", "name": NCCL, "pid": 0, "tid": 7, "ts": us(tick) + late,
                 "dur": 10000 - late, "args": {"correlation": c + 1, "device": 0, "stream": 7}}]
            tick, k = tick + 10**8, k + 1
        if os.environ.get("FAKE_TRACE") == "big":
            events += [{"ph": "X", "cat": "cpu_op", "name": secrets.token_hex(64), "pid": pid, "tid": pid,
                        "ts": us(self.t0), "dur": 1.0} for _ in range(3000)]
        with open(path, "w") as f:
            if os.environ.get("FAKE_TRACE") == "broken":  # cut off inside its events
                f.write('{"schemaVersion": 1, "traceEvents": [{"ph": "X", "name": "a", "ts": 1}')
                f.write(chr(125))
                return
            json.dump({"schemaVersion": 1, "baseTimeNanoseconds": base, "traceEvents": events}, f)
'''.replace("NCCL", repr(NCCL))


class Agent:
    def __init__(self, root: Path, i: int, shift_ns: int = 0) -> None:
        self.port = free_port()
        self.data = root / f"agent{i}"
        self.data.mkdir()
        (self.data / "token").write_text(TOKEN + "\n")
        os.chmod(self.data / "token", 0o600)
        e = env()
        if shift_ns:
            e[TEST_CLOCK_SHIFT_ENV] = str(shift_ns)
        self.log = open(root / f"agent{i}.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuscope.cli", "agent", "--port", str(self.port), "--data-dir", str(self.data),
             "--interval", "200ms", "--simulate", "healthy", "--gpus", "1", "--simulate-workload", "fleet42"],
            env=e, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            assert self.proc.poll() is None, Path(self.log.name).read_text()
            try:
                if http(self.port, "/api/v1/clock")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("agent did not come up")

    def get(self, path: str, token: bool = True) -> tuple[int, dict]:
        code, body = http(self.port, path, TOKEN if token else None)
        return code, json.loads(body)

    def post(self, body: object, token: bool = True) -> tuple[int, dict]:
        code, out = http(self.port, "/api/v1/trace", TOKEN if token else None, method="POST",
                         data=json.dumps(body).encode())
        return code, json.loads(out)

    def opted_in(self) -> list[int]:
        return sorted(p["pid"] for p in self.get("/api/v1/traces")[1]["opted_in"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Prog:
    """A program opted in on demand under one agent: `gpuscope trace --on-demand -- python prog.py`."""

    def __init__(self, fake: Path, agent: Agent, **environ: str) -> None:
        e = {k: v for k, v in env().items() if k not in ("RANK", "LOCAL_RANK", "SLURM_JOB_ID", "SLURM_JOBID",
                                                        "TORCHELASTIC_RUN_ID")}
        e["PYTHONPATH"] = f"{fake}{os.pathsep}{e['PYTHONPATH']}"
        e.update(PROG_SLEEP="600", **environ)
        self.agent = agent
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuscope.cli", "trace", "--on-demand", "--agent-dir",
                                      str(agent.data), "--", sys.executable, str(fake / "prog.py"), "plain"],
                                     env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.pid = 0  # the traced interpreter's pid, once it opted in

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _opt_in(progs: list[Prog]) -> None:
    """Wait until every program registered with its agent; learn its traced pid."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        for p in progs:
            if not p.pid:
                children = [int(x) for x in Path(f"/proc/{p.proc.pid}/task/{p.proc.pid}/children").read_text().split()] \
                    if p.proc.poll() is None else []
                p.pid = next((c for c in children if c in p.agent.opted_in()), 0)
        if all(p.pid for p in progs):
            return
        time.sleep(0.3)
    raise AssertionError(f"not opted in: {[p.proc.args for p in progs if not p.pid]}")


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_fleet")
    (root / "torch").mkdir()
    for name, text in FAKE_TORCH.items():
        (root / "torch" / name).write_text(PROFILER if name == "profiler.py" else text)
    (root / "prog.py").write_text(PROG)
    return root


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, fake):
    """Four agents (the last one's clock 250 ms ahead), a job of four ranks on them, a Prometheus scraping them."""
    root = tmp_path_factory.mktemp("fleet")
    agents = [Agent(root, i, SHIFT_NS if i == 3 else 0) for i in range(4)]
    progs: list[Prog] = []
    prom = None
    try:
        for a in agents:
            a.wait_ready()
        progs = [Prog(fake, a, RANK=str(i), TORCHELASTIC_RUN_ID="fleet42", FAKE_LATE_US=str(LATE_US if i == 2 else 0),
                      FAKE_EXTRA_US="30000" if i == 2 else "0")
                 for i, a in enumerate(agents)]
        _opt_in(progs)
        prom = PrometheusServer(root, [f"127.0.0.1:{a.port}" for a in agents])
        prom.wait_for('count(group by (instance) ({workload="torchrun/fleet42"}))',
                      lambda r: bool(r) and r[0]["value"][1] == "4", timeout=60)
        yield agents, progs, prom, root
    finally:
        for p in progs:
            p.stop()
        if prom is not None:
            prom.stop()
        for a in agents:
            a.stop()


def _true_start_ns(agent: Agent, request_id: str, pid: int) -> int:
    """The window's start as the process recorded it on the real clock: its file on the node."""
    [f] = (agent.data / "traces").glob(f"*.{pid}.*{request_id}.pt.trace.json.gz")
    return json.loads(gzip.decompress(f.read_bytes()))["gpuscope"]["profiler_start_unix_ns"]


def test_four_ranks_under_four_agents_merge_on_one_clock(nodes, tmp_path):
    agents, progs, prom, _ = nodes
    out = tmp_path / "job.pt.trace.json.gz"
    e = dict(env(), GPUSCOPE_TOKEN=TOKEN)
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "fleet", "--job", JOB, "--prometheus",
                        prom.url, "--duration", "2s", "--out", str(out), "--json"],
                       capture_output=True, text=True, env=e, timeout=120)
    assert p.returncode == 0, p.stderr + p.stdout
    s = json.loads(p.stdout)
    print(json.dumps({"agents": s["agents"], "ranks": s["ranks"]}, indent=1))  # the figures, with -s
    assert s["missing"] == [] and s["without_job"] == []
    assert sorted(r["rank"] for r in s["ranks"]) == [0, 1, 2, 3]
    by_url = {a["url"]: a for a in s["agents"]}
    # the shift was measured: agent 3 reads 250 ms ahead, the others none, each within its own bound
    for a in agents:
        got = by_url[a.url]
        assert abs(got["offset_ns"] - (SHIFT_NS if a is agents[3] else 0)) <= max(got["offset_error_ns"], 10**5) + 10**5
    # the skew after correction, against the common (real) clock: what each process recorded as its start,
    # against where the merge put it
    for r in s["ranks"]:
        a = next(x for x in agents if x.url == r["url"])
        request_id = by_url[a.url]["request_id"]
        true_error_ns = _true_start_ns(a, request_id, r["pid"]) - s["start_unix_ns"]
        # within 1 ms, or within the bound this run measured for its agent's offset (half the least round
        # trip's delay, which a loaded machine can stretch past 2 ms)
        bound_ns = max(1_000_000, by_url[a.url]["offset_error_ns"])
        assert abs(r["start_error_ns"] - true_error_ns) <= bound_ns, (r, true_error_ns, by_url[a.url])
        # never before the start asked (processes wait for it), but for the error of the offset it was asked on
        # (the estimate then: the one reported is refined by round trips made while the window ran)
        asked_bound_ns = max(1_000_000, by_url[a.url]["start_offset_error_ns"])
        assert by_url[a.url]["start_offset_error_ns"] >= by_url[a.url]["offset_error_ns"]  # only ever refined
        assert true_error_ns >= -asked_bound_ns, (true_error_ns, by_url[a.url])
        assert true_error_ns < 1_000_000_000  # they saw the request before the start: no poll second lost
    merged = json.loads(gzip.decompress(out.read_bytes()))
    names = {e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert {n.split()[1] for n in names} == {"0", "1", "2", "3"}
    # the all-reduces happened at one true moment on ranks 0, 1, 3 (rank 2: 3 ms later): in the merged file
    starts: dict[int, list[float]] = {}
    for ev in merged["traceEvents"]:
        if ev.get("name") == NCCL:
            starts.setdefault(ev["pid"] // 10**7 - 1, []).append(ev["ts"])
    bound_us = max(1000.0, max(a["offset_error_ns"] for a in s["agents"]) / 1000)
    assert sorted(starts) == [0, 1, 2, 3]
    # matched by time, not by order: a rank whose window began late on a loaded machine missed the first tick
    lo, hi = max(min(v) for v in starts.values()), min(max(v) for v in starts.values())
    ticks = [t for t in sorted(starts[0]) if lo - 50_000 <= t <= hi + 50_000]  # µs: the ticks every rank saw
    assert len(ticks) >= 10, (len(ticks), {r: len(v) for r, v in starts.items()})
    for t in ticks:
        on_time = [t, *(min(starts[r], key=lambda x: abs(x - t)) for r in (1, 3))]
        assert max(on_time) - min(on_time) <= 2 * bound_us, on_time  # µs: two ranks' errors may add
        assert abs(min(starts[2], key=lambda x: abs(x - t - LATE_US)) - t - LATE_US) <= 2 * bound_us
    arr = s["arrivals"]
    assert arr["slowest_rank"] == 2 and arr["collectives"] >= 10
    assert abs(arr["spread_p50_ns"] - LATE_US * 1000) <= 2 * bound_us * 1000
    assert [x["rank"] for x in s["stragglers"]] == [2]  # its compute is the longer
    assert {o["rank"] for o in s["communication"]} == {0, 1, 2, 3}


def test_without_the_correction_the_shifted_node_would_be_250_ms_off(nodes):
    """The check above can fail: the same analysis on stamps left off by a clock's offset finds nonsense or
    names the shifted rank, not rank 2 (the files on the nodes hold the real clock's stamps)."""
    from gpuscope.trace.collectives import arrivals
    from gpuscope.trace.kineto import load

    agents, progs, _, _ = nodes
    traces = []
    for i, a in enumerate(agents):
        [f] = (a.data / "traces").glob(f"*.{progs[i].pid}.*.pt.trace.json.gz")
        t = load(f)
        t.rank = i
        traces.append(t)
    # 250 ms is 2.5 of the 100 ms ticks: matched by time, the shifted rank's all-reduces land half a tick from
    # the others', a spread of ~50 ms where the truth is 3 ms
    shifted = arrivals(traces, [SHIFT_NS if i == 3 else 0 for i in range(4)])
    assert shifted is not None and shifted.spread_p50_ns > 40e6
    # a clock 20 ms off, left uncorrected, names the wrong rank
    shifted = arrivals(traces, [20_000_000 if i == 3 else 0 for i in range(4)])
    assert shifted is not None and shifted.slowest_rank == 3 and shifted.spread_p50_ns > 15e6
    right = arrivals(traces)
    assert right is not None and right.slowest_rank == 2


def test_bad_parts_are_named_and_the_rest_merged(nodes, fake, tmp_path, monkeypatch, capsys):
    agents, _, _, root = nodes
    job = "slurm/777"
    ok = Prog(fake, agents[0], RANK="0", SLURM_JOB_ID="777")
    cut = Prog(fake, agents[0], RANK="1", SLURM_JOB_ID="777", FAKE_STARTED=str(tmp_path / "cut.started"))
    killed = Prog(fake, agents[1], RANK="2", SLURM_JOB_ID="777", FAKE_STARTED=str(tmp_path / "killed.started"))
    big = Prog(fake, agents[1], RANK="3", SLURM_JOB_ID="777", FAKE_TRACE="big")
    broken = Prog(fake, agents[2], RANK="4", SLURM_JOB_ID="777", FAKE_TRACE="broken")
    progs = [ok, cut, killed, big, broken]
    try:
        _opt_in(progs)
        dead = f"http://127.0.0.1:{free_port()}"
        monkeypatch.setattr(fleet, "MAX_TRACE_BYTES", 40_000)  # the big one's is ~400 kB, the others' < 5 kB
        result: dict = {}

        def go():
            try:
                result["s"] = fleet.trace_fleet([a.url for a in agents] + [dead], job, 2.0, 2.0, TOKEN,
                                                str(tmp_path), 10.0, str(tmp_path / "bad.pt.trace.json.gz"))
            except Exception as e:  # noqa: BLE001 - reported below
                result["e"] = e

        t = threading.Thread(target=go)
        t.start()
        for name, victim, sig in (("cut", cut, signal.SIGTERM), ("killed", killed, signal.SIGKILL)):
            _wait_for_file(tmp_path / f"{name}.started")
            os.kill(victim.pid, sig)  # mid-window: SIGTERM ends it early and writes; SIGKILL leaves nothing
        t.join(120)
        assert "e" not in result, result
        s = result["s"]
    finally:
        for p in progs:
            p.stop()
    assert s["exit_code"] == fleet.EXIT_PARTIAL
    assert sorted(r["rank"] for r in s["ranks"]) == [0, 1]
    [note] = [r["note"] for r in s["ranks"] if r["note"]]
    assert f"Process {cut.pid}" in note and "ended its window after" in note
    missing = s["missing"]
    assert len(missing) == 4, missing
    assert any(dead in m and "cannot be reached" in m for m in missing)
    assert any(f"Process {killed.pid}" in m and "exited before it wrote its trace" in m for m in missing)
    assert any(f"process {big.pid}" in m and "over the" in m for m in missing)
    assert any(f"process {broken.pid}" in m and "not usable: it is not valid JSON" in m for m in missing)
    assert len(s["without_job"]) == 1 and agents[3].url in s["without_job"][0]
    for line in missing + s["without_job"]:
        assert line.endswith(".") and "Traceback" not in line
    assert (tmp_path / "bad.pt.trace.json.gz").exists()
    fleet.print_summary(s)
    printed = capsys.readouterr().out
    assert "2 rank(s) merged" in printed and printed.count("\nmissing: ") == 4 and "note: Process" in printed


def _wait_for_file(path: Path) -> None:
    end = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.02)


def test_a_job_nobody_holds_ends_in_one_sentence(nodes, tmp_path):
    agents, _, _, _ = nodes
    e = dict(env(), GPUSCOPE_TOKEN=TOKEN)
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "fleet", "--job", "slurm/none-here",
                        "--agents", *[a.url for a in agents], "--out", str(tmp_path / "x.json.gz")],
                       capture_output=True, text=True, env=e, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "No trace of job 'slurm/none-here' was merged" in p.stderr and "No process of job" in p.stderr
    assert not (tmp_path / "x.json.gz").exists()


@pytest.mark.parametrize("argv, words", [
    (["--agents", "ftp://x"], "must be http://"),
    (["--agents", "http://127.0.0.1:1/metrics"], "base URL"),
    (["--agents", "http://127.0.0.1:1", "--duration", "40s"], "between 1 s and 30 s"),
    (["--agents", "http://127.0.0.1:1", "--start-in", "0s"], "--start-in must be"),
    (["--agents", "http://127.0.0.1:1", "--out", "/nonexistent/x.gz"], "not an existing directory"),
    ([], "One of the arguments --agents --prometheus is required"),
    (["--prometheus", "prometheus:9090"], "--prometheus must be the http://"),
    (["--agents", "http://127.0.0.1:1", "--job", "two\nlines"], "--job must be a workload"),
])
def test_bad_flags(argv, words):
    p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "fleet", "--job", "slurm/1", *argv],
                       capture_output=True, text=True, env=env(), timeout=60)
    assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_the_agent_checks_fleet_requests(nodes):
    agents, progs, _, _ = nodes
    a = agents[0]
    now = time.time()
    for body, code, words in [
        ({"job": "torchrun/fleet42", "pids": [1]}, 400, "either pids or a job"),
        ({"job": ""}, 400, "job must be a workload"),
        ({"job": "x" * 200}, 400, "job must be a workload"),
        ({"job": JOB, "start_unix": now - 30}, 400, "in the past"),
        ({"job": JOB, "start_unix": now + 3600}, 400, "more than the 30 s"),
        ({"job": JOB, "start_unix": "soon"}, 400, "start_unix must be"),
        ({"job": JOB, "start_unix": True}, 400, "start_unix must be"),
        ({"job": "slurm/nobody"}, 404, "No process of job 'slurm/nobody' opted in on this node"),
    ]:
        got, out = a.post(body)
        assert got == code and words in out["error"], (body, out)
    assert a.post({"job": JOB}, token=False)[0] == 401
    code, clock = a.get("/api/v1/clock", token=False)
    assert code == 200 and clock["received_unix_ns"] <= clock["answered_unix_ns"]
    assert abs(clock["received_unix_ns"] - time.time_ns()) < 60 * 10**9
    code, shifted = agents[3].get("/api/v1/clock")
    assert shifted["received_unix_ns"] - time.time_ns() > SHIFT_NS - 10 * 10**9  # its test shift shows


def test_the_trace_file_is_served_only_to_the_token_holder(nodes):
    agents, progs, _, _ = nodes
    a = agents[0]
    def written() -> list[dict]:
        return [t for t in a.get("/api/v1/traces")[1]["traces"] if t["status"] == "written"][:1]

    if not written():  # the fleet trace of the first test ran on another worker: this one asks its own window
        assert a.post({"duration": "1s", "pids": a.opted_in()[:1]})[0] == 202
        deadline = time.monotonic() + 120
        while not written() and time.monotonic() < deadline:
            time.sleep(0.2)
    [done] = written()
    path = f"/api/v1/traces/{done['id']}/file?pid={done['pid']}"
    assert http(a.port, path)[0] == 401  # loopback reads are open, trace files are not
    code, body = http(a.port, path, TOKEN)
    assert code == 200 and json.loads(gzip.decompress(body))["gpuscope"]["pid"] == done["pid"]
    for bad, want in [(f"/api/v1/traces/{done['id']}/file?pid=abc", 400),
                      (f"/api/v1/traces/{done['id']}/file?pid=1", 404),
                      (f"/api/v1/traces/{done['id']}/file?pid=%C2%B2", 400),
                      ("/api/v1/traces/..%2F..%2Fetc/file?pid=1", 404),
                      ("/api/v1/traces/0123456789abcdef/file?pid=1", 404)]:
        assert http(a.port, bad, TOKEN)[0] == want, bad


# -- the agent's file endpoint, in process: planted files, the size cap ---------------------------------
def _serve_traces(tmp_path, monkeypatch, **face):
    """A real loopback server with the agent's trace routes over `tmp_path/data` (no sampler, no store)."""
    import types

    from aiohttp import web

    from gpuscope.agent import trace_api

    data = tmp_path / "data"
    (data / "traces").mkdir(parents=True)
    (data / "trace-requests").mkdir()
    agent = types.SimpleNamespace(cfg=types.SimpleNamespace(data_path=data), store=None, token=TOKEN, **face)

    def app():
        made = web.Application()
        trace_api.register(made, agent)
        return made

    return app, data


def _fetch(app, paths):
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    async def go():
        async with TestClient(TestServer(app(), host="127.0.0.1")) as c:
            out = []
            for p in paths:
                r = await c.get(p, headers={"Authorization": f"Bearer {TOKEN}"})
                out.append((r.status, await r.read()))
            return out

    return asyncio.run(go())


def test_the_file_endpoint_serves_only_regular_trace_files_under_its_cap(tmp_path, monkeypatch):
    from gpuscope.agent import trace_api
    from gpuscope.trace import ondemand as od

    monkeypatch.setenv(TEST_CLOCK_SHIFT_ENV, "5000000000")  # ignored: this node is not simulated
    app, data = _serve_traces(tmp_path, monkeypatch, sampler=None)
    req = str(data / "trace-requests")
    real = data / "traces" / "h.7.0123456789abcdef.pt.trace.json.gz"
    real.write_bytes(gzip.compress(json.dumps({"traceEvents": [], "baseTimeNanoseconds": 5}).encode()))
    os.symlink("/etc/passwd", data / "traces" / "h.8.0123456789abcdef.pt.trace.json.gz")
    for pid, file in [(7, real.name), (8, "h.8.0123456789abcdef.pt.trace.json.gz"), (9, "../../../etc/passwd"),
                      (10, "../traces/" + real.name)]:
        od.mark_done(req, "0123456789abcdef", "h", pid, status="written", file=file)
    od.mark_done(req, "0123456789abcdef", "h", 11, status="refused", reason="over the duty budget")
    got = _fetch(app, [f"/api/v1/traces/0123456789abcdef/file?pid={p}" for p in (7, 8, 9, 10, 11)])
    assert got[0][0] == 200 and json.loads(gzip.decompress(got[0][1]))["baseTimeNanoseconds"] == 5  # unshifted
    assert [code for code, _ in got[1:]] == [404, 404, 200, 404]  # the symlink, a path out, basename only
    assert b"not a regular file" in got[1][1] and b"over the duty budget" in got[4][1]
    monkeypatch.setattr(trace_api, "SERVE_MAX_BYTES", 10)
    [(code, body)] = _fetch(app, ["/api/v1/traces/0123456789abcdef/file?pid=7"])
    assert code == 413 and b"copy it from the node" in body


def test_a_simulated_nodes_test_shift_moves_the_served_trace(tmp_path, monkeypatch):
    import types

    from gpuscope.trace import ondemand as od

    monkeypatch.setenv(TEST_CLOCK_SHIFT_ENV, "7")
    app, data = _serve_traces(tmp_path, monkeypatch, sampler=types.SimpleNamespace(simulated="healthy"))
    f = data / "traces" / "h.7.0123456789abcdef.pt.trace.json.gz"
    f.write_bytes(gzip.compress(json.dumps({"traceEvents": [], "baseTimeNanoseconds": 5, "gpuscope": {
        "profiler_start_unix_ns": 100, "profiler_stop_unix_ns": 200}}).encode()))
    od.mark_done(str(data / "trace-requests"), "0123456789abcdef", "h", 7, status="written", file=f.name)
    [(code, body), (_, clock)] = _fetch(app, ["/api/v1/traces/0123456789abcdef/file?pid=7", "/api/v1/clock"])
    doc = json.loads(gzip.decompress(body))
    assert code == 200 and doc["baseTimeNanoseconds"] == 12
    assert (doc["gpuscope"]["profiler_start_unix_ns"], doc["gpuscope"]["profiler_stop_unix_ns"]) == (107, 207)
    assert json.loads(clock)["received_unix_ns"] > 0


def test_prometheus_that_knows_no_such_job_or_does_not_answer(nodes):
    _, _, prom, _ = nodes
    for where, words in [(prom.url, "No target of the server at"), (f"http://127.0.0.1:{free_port()}", "cannot be reached")]:
        p = subprocess.run([sys.executable, "-m", "gpuscope.cli", "trace", "fleet", "--job", "slurm/absent",
                            "--prometheus", where], capture_output=True, text=True, env=env(), timeout=60)
        assert p.returncode == 1 and words in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_collectives_are_matched_by_time_when_windows_hold_different_ones(tmp_path):
    """Rank 1's window began after the first all-reduce and ends after one more: matched by time, not by
    order, its 2 ms lateness is what is found (by order every pair would be a whole 100 ms gap apart)."""
    from gpuscope.trace.collectives import arrivals
    from gpuscope.trace.kineto import load

    def trace(rank: int, ticks: range, late_us: float):
        events = [{"ph": "X", "cat": "kernel", "name": NCCL, "pid": 0, "tid": 7, "ts": k * 100_000 + late_us,
                   "dur": 5000.0, "args": {"device": 0, "stream": 7, "correlation": k}} for k in ticks]
        f = tmp_path / f"r{rank}.json"
        f.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events, "distributedInfo": {"rank": rank}}))
        return load(f)

    got = arrivals([trace(0, range(0, 10), 0.0), trace(1, range(1, 11), 2000.0), trace(2, range(0, 10), 100.0)])
    assert got is not None and got.collectives == 9
    assert got.slowest_rank == 1 and got.last_share[1] == 1.0
    assert got.spread_p50_ns == pytest.approx(2_000_000) and got.spread_max_ns == 2_000_000
    assert got.wait_ns == [9 * 2_000_000, 0, 9 * 1_900_000]


def _slow_file_server(gaps_s: list[float]):
    """A real HTTP server on loopback serving one trace file in chunks, `gaps_s` between them."""
    import asyncio

    from aiohttp import web

    body = gzip.compress(json.dumps({"traceEvents": [{"ph": "X", "name": "k", "ts": i, "dur": 1}
                                                     for i in range(2000)]}).encode())
    parts = [body[i * len(body) // (len(gaps_s) + 1):(i + 1) * len(body) // (len(gaps_s) + 1)]
             for i in range(len(gaps_s) + 1)]

    async def serve(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(gaps_s[i - 1])
            await resp.write(part)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/api/v1/traces/{rid}/file", serve)
    return app, body


@pytest.mark.parametrize("gaps, arrives", [([0.25] * 16, True), ([5.0], False)])
def test_a_large_trace_arrives_however_long_it_takes_unless_it_stalls(tmp_path, gaps, arrives):
    import asyncio

    import aiohttp
    from aiohttp import web

    app, body = _slow_file_server(gaps)

    async def main():
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        agent = fleet.Agent(url=f"http://127.0.0.1:{port}", shown=f"127.0.0.1:{port}", request_id="r1")
        r = fleet.Rank(agent=agent, pid=7)
        t0 = time.monotonic()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3.0)) as session:
                await fleet._download(session, r, str(tmp_path))
        finally:
            await runner.cleanup()
        return r, time.monotonic() - t0

    r, took = asyncio.run(main())
    if arrives:  # 16 gaps of 0.25 s: the whole body took longer than the 3 s per request, with no stall in it
        assert took >= 4.0 and r.problem == "" and Path(r.path).read_bytes() == body
    else:
        assert r.problem == f"The trace of process 7 on {r.agent.shown} stopped arriving (nothing for 3 s)."
        assert not list(tmp_path.iterdir())  # nothing half-written is left


# -- the agent reads each trace once for its three readers ---------------------------------------------------
TRACE_FIXTURE = Path(__file__).parent / "fixtures" / "traces" / "launch_bound.pt.trace.json.gz"


def _count_opens(monkeypatch, path: Path) -> dict[str, int]:
    import builtins

    opened = {"n": 0}
    real_open = builtins.open

    def counting_open(file, *a, **kw):
        if isinstance(file, str | os.PathLike) and os.path.abspath(file) == str(path):
            opened["n"] += 1
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", counting_open)
    return opened


def test_the_agents_readers_of_a_trace_share_one_read(tmp_path, monkeypatch):
    """Kernel statistics, verdicts and findings, folded stacks: one open of the file for the three, at once or
    one after the other (each read it on its own: three); a file rewritten is read again."""
    import shutil

    from gpuscope.agent import trace_api
    from gpuscope.trace.kineto import load

    path = tmp_path / "h.1.pt.trace.json.gz"
    shutil.copy(TRACE_FIXTURE, path)
    expected = trace_api.kernel_table(str(path), None)  # before counting: what a read of its own gives
    trace_api._shared.clear()
    opened = _count_opens(monkeypatch, path)
    assert trace_api.kernel_table(str(path), None) == expected
    verdicts_trace = trace_api.read_trace(str(path), "verdicts")
    assert trace_api.read_trace(str(path), "profile") is verdicts_trace
    assert opened["n"] == 1
    assert len(verdicts_trace) == len(load(TRACE_FIXTURE))
    # every reader took it: it is gone, and a reader asking again reads the file again
    trace_api.read_trace(str(path), "kernels")
    assert opened["n"] == 2
    # three at once: one reads, two wait for it
    trace_api._shared.clear()
    got: dict[str, object] = {}
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, trace_api.read_trace(str(path), r)))
               for r in trace_api.READERS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert opened["n"] == 3 and len({id(t) for t in got.values()}) == 1
    # a bad file: one read, the same sentence for each reader
    path.write_bytes(b"{")
    for r in trace_api.READERS:
        with pytest.raises(Exception, match="not valid JSON"):
            trace_api.read_trace(str(path), r)
    assert opened["n"] == 4


def test_the_agents_three_products_of_a_trace_read_it_once(tmp_path, monkeypatch):
    import shutil
    import types

    from gpuscope.agent import autotrace, profile_api, trace_api

    path = tmp_path / "h.1.pt.trace.json.gz"
    shutil.copy(TRACE_FIXTURE, path)
    trace_api._shared.clear()
    face = types.SimpleNamespace(cfg=types.SimpleNamespace(data_path=tmp_path), store=None, sampler=None)
    opened = _count_opens(monkeypatch, path)
    trace_api.kernel_table(str(path), None)
    autotrace.window_verdicts(str(path), None)
    profile_api.Profiles(face).fold(str(path))  # type: ignore[arg-type]
    assert opened["n"] == 1
