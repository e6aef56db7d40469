"""GPU time by stack across a fleet: two real agents on loopback (simulated nodes) fold the traces that land in
their DATA_DIR/traces, as the traced processes write them, serve /api/v1/profile, and `gpuscope profile`
merges them into one pprof (decoded by pprof-format) or speedscope; an agent down, hostile and over-size
answers, a real Prometheus naming the agents."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from servers import prometheus_factory  # noqa: F401 - a fixture
from test_agent import AgentProc, env, free_port, http
from test_profile_pprof import decode  # noqa: F401 - a fixture

from gpuscope.trace.kineto import load
from gpuscope.trace.model import GPU_KINDS

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "fixtures" / "traces"
HOST = socket.gethostname()


def gpu_ns(name: str) -> tuple[int, int]:
    trace = load(TRACES / name)
    gpu = np.isin(trace.events["kind"], GPU_KINDS)
    return int(trace.events["dur_ns"][gpu].sum()), int(gpu.sum())


def drop_trace(traces_dir: Path, fixture: str, pid: int, ended_s_ago: float = 1.0, tag: str = "",
               owner: int | None = None) -> str:
    """A golden trace written into the agent's traces directory as the bootstrap writes one: the "gpuscope"
    key (host, pid, rank, the profiler's start and stop) added, a temporary name, then one rename."""
    with gzip.open(TRACES / fixture, "rt") as f:
        doc = json.load(f)
    stop = time.time_ns() - int(ended_s_ago * 1e9)
    doc["gpuscope"] = {"host": HOST, "pid": pid, "rank": 0, "window": 0, "profiler_start_unix_ns": stop - 5 * 10**9,
                       "profiler_stop_unix_ns": stop, "backend": "torch"}
    name = f"{HOST}.{pid}{tag}.{os.urandom(8).hex()}.pt.trace.json.gz"
    tmp = traces_dir / f".tmp-{name}"
    tmp.write_bytes(gzip.compress(json.dumps(doc).encode()))
    if owner is not None:
        os.chown(tmp, owner, -1)
    os.replace(tmp, traces_dir / name)
    return name


def sleeper(**variables: str) -> subprocess.Popen:
    """A live process in a job (its environment names it), standing for a traced rank."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            env={"PATH": os.environ.get("PATH", ""), **variables})


def wait_for(what, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError("timed out")


def start_agent(tmp: Path, node: str) -> AgentProc:
    before = os.environ.get("GPUSCOPE_NODE_NAME")
    os.environ["GPUSCOPE_NODE_NAME"] = node  # what a DaemonSet sets from spec.nodeName
    try:
        a = AgentProc(tmp, "--simulate", "healthy", "--gpus", "1")
    finally:
        if before is None:
            del os.environ["GPUSCOPE_NODE_NAME"]
        else:
            os.environ["GPUSCOPE_NODE_NAME"] = before
    return a


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Node A: two ranks of torchrun run-7 (launch_bound, sync_heavy); node B: one of slurm job 4242
    (compute_bound) and an old window of it (healthy_training, ended 2 h ago)."""
    ranks = [sleeper(TORCHELASTIC_RUN_ID="run-7"), sleeper(TORCHELASTIC_RUN_ID="run-7"), sleeper(SLURM_JOB_ID="4242")]
    agents = [start_agent(tmp_path_factory.mktemp("a"), "node-a"), start_agent(tmp_path_factory.mktemp("b"), "node-b")]
    try:
        for a in agents:
            a.wait_ready()
        a, b = agents
        files = [drop_trace(a.data / "traces", "launch_bound.pt.trace.json.gz", ranks[0].pid),
                 drop_trace(a.data / "traces", "sync_heavy.pt.trace.json.gz", ranks[1].pid),
                 drop_trace(b.data / "traces", "compute_bound.pt.trace.json.gz", ranks[2].pid),
                 drop_trace(b.data / "traces", "healthy_training.pt.trace.json.gz", ranks[2].pid, ended_s_ago=7200)]
        for agent, names in ((a, files[:2]), (b, files[2:])):
            wait_for(lambda agent=agent, names=names: all((agent.data / "traces" / (n + ".profile.json")).exists()
                                                          for n in names))
        yield {"agents": agents, "ranks": ranks, "urls": [f"http://127.0.0.1:{x.port}" for x in agents]}
    finally:
        for x in agents:
            x.stop()
        for p in ranks:
            p.kill()
            p.wait()


def profile_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuscope.cli", "profile", *args], env=env(), capture_output=True,
                          text=True, timeout=timeout)


def totals_by(decoded: dict, key: str) -> dict:
    out: dict = {}
    for s in decoded["samples"]:
        acc = out.setdefault(s["labels"].get(key), [0, 0])
        acc[0] += s["values"][0]
        acc[1] += s["values"][1]
    return out


def test_each_agent_folds_its_traces_once_labelled_with_node_pid_and_job(fleet):
    a, b = fleet["agents"]
    code, body = http(a.port, "/api/v1/profile?format=json&since=1h")
    doc = json.loads(body)
    assert code == 200 and doc["node"] == "node-a" and doc["skipped_caches"] == 0
    assert sorted((w["node"], w["pid"], w["job"]) for w in doc["windows"]) == sorted(
        ("node-a", p.pid, "torchrun/run-7") for p in fleet["ranks"][:2])
    assert all(w["end_unix_ns"] > w["start_unix_ns"] for w in doc["windows"])
    code, body = http(b.port, "/api/v1/profile?format=json&since=3h")
    assert [w["job"] for w in json.loads(body)["windows"]] == ["slurm/4242", "slurm/4242"]
    caches = sorted(p.name for p in (a.data / "traces").glob("*.profile.json"))
    assert len(caches) == 2
    mtimes = [(a.data / "traces" / c).stat().st_mtime_ns for c in caches]
    time.sleep(2.5)  # more than two ingest passes: computed once, not again
    assert [(a.data / "traces" / c).stat().st_mtime_ns for c in caches] == mtimes


def test_profile_merges_two_agents_into_one_pprof(fleet, decode, tmp_path):  # noqa: F811
    out = tmp_path / "fleet.pb.gz"
    r = profile_cli("--since", "1h", "--agents", *fleet["urls"], "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and "from 2 of 2 agent(s)" in r.stdout and "3 window(s) of 3 process(es) on 2 node(s)" in r.stdout
    got = decode(out)
    assert got["sampleTypes"] == [["gpu_time", "nanoseconds"], ["launches", "count"]]
    want_a = [sum(x) for x in zip(gpu_ns("launch_bound.pt.trace.json.gz"), gpu_ns("sync_heavy.pt.trace.json.gz"),
                                  strict=True)]
    assert totals_by(got, "node") == {"node-a": want_a, "node-b": list(gpu_ns("compute_bound.pt.trace.json.gz"))}
    assert totals_by(got, "job") == {"torchrun/run-7": want_a, "slurm/4242": list(gpu_ns("compute_bound.pt.trace.json.gz"))}
    assert set(totals_by(got, "pid")) == {p.pid for p in fleet["ranks"]}
    assert got["durationNanos"] > 0 and got["timeNanos"] > 0


def test_job_and_since_choose_the_windows(fleet, tmp_path):
    out = tmp_path / "job.json"
    r = profile_cli("--since", "3h", "--job", "slurm/4242", "--agents", *fleet["urls"], "--out", str(out),
                    "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert sorted(w["file"].split(".")[1] for w in doc["windows"]) == [str(fleet["ranks"][2].pid)] * 2
    want = [sum(x) for x in zip(gpu_ns("compute_bound.pt.trace.json.gz"), gpu_ns("healthy_training.pt.trace.json.gz"),
                                strict=True)]
    assert [sum(s[2] for s in doc["samples"]), sum(s[3] for s in doc["samples"])] == want


def test_speedscope_of_the_fleet(fleet, tmp_path):
    out = tmp_path / "fleet.speedscope.json"
    r = profile_cli("--agents", *fleet["urls"], "--out", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    total_ns = sum(gpu_ns(n)[0] for n in ("launch_bound.pt.trace.json.gz", "sync_heavy.pt.trace.json.gz",
                                          "compute_bound.pt.trace.json.gz"))
    assert doc["$schema"].startswith("https://www.speedscope.app/")
    assert abs(sum(doc["profiles"][0]["weights"]) * 1e3 - total_ns) < 1e-6 * total_ns


def test_an_agent_down_is_named_and_the_others_merged(fleet, tmp_path):
    down = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "partial.pb.gz"
    r = profile_cli("--agents", fleet["urls"][0], down, fleet["urls"][1], "--out", str(out))
    assert r.returncode == 3, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines == [f"gpuscope profile: no agent answers at {down} (Connection refused).",
                     f"gpuscope profile: written without 1 agent(s): {down}"]
    assert "from 2 of 3 agent(s)" in r.stdout and out.stat().st_size > 0
    r = profile_cli("--agents", down, "--out", str(tmp_path / "none.pb.gz"))
    assert r.returncode == 1 and not (tmp_path / "none.pb.gz").exists()
    assert r.stderr.strip().splitlines()[-1].endswith("No agent's profile could be merged (of 1 asked); nothing written.")


class Hostile(BaseHTTPRequestHandler):
    """Answers /<kind>/api/v1/profile as something that is not an agent's profile."""

    def do_GET(self):  # noqa: N802 - http.server's name
        kind = self.path.split("/")[1]
        if kind == "slow":
            time.sleep(3)
        body, status, ctype = {
            "truncated": (b'{"format": "gpuscope.profile/1", "frames": [["main thr', 200, "application/json"),
            "notprofile": (b'{"hello": "world"}', 200, "application/json"),
            "deep": (b"[" * 100_000 + b"]" * 100_000, 200, "application/json"),
            "huge": (b'{"format": "' + b"x" * (3 << 20) + b'"}', 200, "application/json"),
            "badframe": (json.dumps({"format": "gpuscope.profile/1", "frames": [["k", "kernel", "", 0]],
                                     "samples": [[[0, 99], {}, 5, 1]]}).encode(), 200, "application/json"),
            "error": (b'{"error": "The store is on fire."}', 500, "application/json"),
            "html": (b"<html>hello</html>", 200, "text/html"),
            "slow": (b"{}", 200, "application/json"),
        }[kind]
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args):
        pass


def test_hostile_answers_are_one_sentence_each_and_the_agent_still_merged(fleet, tmp_path, monkeypatch, capsys):
    import gpuscope.commands.profile as verb
    from gpuscope.cli import main

    monkeypatch.setattr(verb, "MAX_ANSWER_BYTES", 2 << 20)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    kinds = {"truncated": "is not JSON (cut short?)", "notprofile": "is not a usable profile: it is not a gpuscope profile",
             "deep": "is not JSON", "huge": "answered more than 2 MiB; left out.",
             "badframe": "is not a usable profile: sample 0 is not",
             "error": "answered HTTP 500: The store is on fire.", "html": "is not JSON"}
    out = tmp_path / "hostile.pb.gz"
    try:
        rc = main(["profile", "--timeout", "60", "--agents", fleet["urls"][0], *(f"{base}/{k}" for k in kinds),
                   "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        # alone, so that the deadline meant for it cannot catch the others on a loaded machine
        rc_slow = main(["profile", "--timeout", "1", "--agents", f"{base}/slow", "--out", str(tmp_path / "slow.pb.gz")])
        err_slow = capsys.readouterr().err.strip().splitlines()
    finally:
        server.shutdown()
    assert rc == 3 and out.stat().st_size > 0
    for kind, words in kinds.items():
        [line] = [x for x in err if f"{base}/{kind} " in x]
        assert words in line and "Traceback" not in line, (kind, line)
    assert err[-1] == "gpuscope profile: written without 7 agent(s): " + ", ".join(f"{base}/{k}" for k in kinds)
    assert rc_slow == 1 and f"the agent at {base}/slow did not answer within 1 s" in err_slow[0]
    assert not (tmp_path / "slow.pb.gz").exists()


def test_agents_found_from_the_targets_prometheus_scrapes(fleet, prometheus_factory, tmp_path):  # noqa: F811
    prom = prometheus_factory([u.removeprefix("http://") for u in fleet["urls"]])
    wait_for(lambda: len(prom.get_json("/api/v1/targets")["data"]["activeTargets"]) == 2)  # discovery's first pass
    out = tmp_path / "prom.pb.gz"
    r = profile_cli("--prometheus", prom.url, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "from 2 of 2 agent(s)" in r.stdout and "on 2 node(s)" in r.stdout
    r = profile_cli("--prometheus", prom.url, "--prometheus-job", "nope", "--out", str(out))
    assert r.returncode == 1 and "scrapes no target in job 'nope'" in r.stderr and "Traceback" not in r.stderr


def test_bad_usage_is_one_sentence(fleet, tmp_path):
    for args, words in [(["--since", "soon"], "--since"), (["--agents", "ftp://x"], "--agents must be an http"),
                        (["--timeout", "0"], "--timeout must be a positive"),
                        (["--out", str(tmp_path)], "is a directory")]:
        full = ["--agents", fleet["urls"][0], "--out", str(tmp_path / "x.pb.gz"), *args]
        r = profile_cli(*full)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_the_endpoint_checks_its_parameters_and_serves_pprof(fleet, decode, tmp_path):  # noqa: F811
    a = fleet["agents"][0]
    for query, words in [("format=svg", "format must be one of"), ("since=soon", "since"),
                         ("since=0s", "since must be"), ("limit=3", "Unknown parameter(s) limit")]:
        code, body = http(a.port, f"/api/v1/profile?{query}")
        assert code == 400 and words in json.loads(body)["error"], (query, body)
    code, body = http(a.port, "/api/v1/profile")
    assert code == 200 and body[:2] == b"\x1f\x8b"
    (tmp_path / "a.pb.gz").write_bytes(body)
    assert set(totals_by(decode(tmp_path / "a.pb.gz"), "node")) == {"node-a"}
    code, body = http(a.port, "/api/v1/profile?format=speedscope&job=nobody")
    assert code == 200 and json.loads(body)["profiles"][0]["samples"] == []


def test_planted_files_are_skipped_and_orphans_dropped(fleet):
    b = fleet["agents"][1]
    traces = b.data / "traces"
    planted = traces / "x.1.pt.trace.json.gz"
    planted.write_bytes(b"not gzip at all")  # a trace that cannot be read: logged once, no cache
    (traces / "evil.pt.trace.json.gz").symlink_to(TRACES / "compute_bound.pt.trace.json.gz")
    orphan = traces / "gone.pt.trace.json.gz.profile.json"
    orphan.write_text("{}")
    wait_for(lambda: not orphan.exists())  # its trace is gone (retention): the cache goes too
    assert not (traces / "evil.pt.trace.json.gz.profile.json").exists()
    assert not (traces / "x.1.pt.trace.json.gz.profile.json").exists()
    hostile = traces / "y.pt.trace.json.gz"
    drop = drop_trace(traces, "sync_heavy.pt.trace.json.gz", fleet["ranks"][2].pid)
    wait_for(lambda: (traces / (drop + ".profile.json")).exists())
    hostile.write_bytes(b"")
    (traces / "y.pt.trace.json.gz.profile.json").write_text('{"format": "gpuscope.profile/1", "frames": 7}')
    code, body = http(b.port, "/api/v1/profile?format=json&since=1h")
    doc = json.loads(body)
    assert code == 200 and doc["skipped_caches"] == 1 and len(doc["windows"]) == 2
    for p in (planted, hostile, traces / "evil.pt.trace.json.gz", traces / "y.pt.trace.json.gz.profile.json",
              traces / drop, traces / (drop + ".profile.json")):
        p.unlink()


def test_beyond_loopback_the_agents_token_is_sent(tmp_path):
    """Bound beyond loopback the agent wants its token for reads too; the verb reads it as `top` does
    (--token, $GPUSCOPE_TOKEN, the token file in --data-dir)."""
    a = AgentProc(tmp_path, "--simulate", "healthy", "--gpus", "1", "--bind", "0.0.0.0")
    rank = sleeper(SLURM_JOB_ID="77")
    try:
        a.wait_ready()
        name = drop_trace(a.data / "traces", "sync_heavy.pt.trace.json.gz", rank.pid)
        wait_for(lambda: (a.data / "traces" / (name + ".profile.json")).exists())
        url = f"http://127.0.0.1:{a.port}"
        r = profile_cli("--agents", url, "--data-dir", str(a.data), "--out", str(tmp_path / "t.pb.gz"))
        assert r.returncode == 0 and "1 window(s)" in r.stdout, r.stderr
        empty = tmp_path / "elsewhere"
        empty.mkdir()
        r = profile_cli("--agents", url, "--data-dir", str(empty), "--out", str(tmp_path / "u.pb.gz"))
        assert r.returncode == 1 and f"the agent at {url} answered HTTP 401" in r.stderr, r.stderr
        r = profile_cli("--agents", url, "--token", "a\nb", "--out", str(tmp_path / "u.pb.gz"))
        assert r.returncode == 2 and "The token holds a line break" in r.stderr
    finally:
        a.stop()
        rank.kill()
        rank.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a file of another user needs root")
def test_a_trace_planted_by_another_user_names_no_job(fleet):
    """The traces directory may be writable by everyone: a trace whose file is neither root's nor the rank's
    user's is folded, but charged to no job (it could claim any pid)."""
    b = fleet["agents"][1]
    traces = b.data / "traces"
    name = drop_trace(traces, "sync_heavy.pt.trace.json.gz", fleet["ranks"][2].pid, owner=54321)
    cache = traces / (name + ".profile.json")
    try:
        wait_for(cache.exists)
        [window] = json.loads(cache.read_text())["windows"]
        assert window["pid"] == fleet["ranks"][2].pid and window["job"] is None
    finally:
        for p in (traces / name, cache):
            p.unlink(missing_ok=True)
