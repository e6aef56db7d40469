"""Pods on a Kubernetes node, end to end: the real agent (`--simulate mixed`, its processes in pods' cgroups)
asks a real gRPC server on a unix socket that serves the kubelet's PodResources API (tests/kubelet_server.py),
and /metrics (both namings), /api/v1/latest, /api/v1/status and /api/v1/diagnose carry what it said.

Waits poll the agent with a generous deadline; what is asserted is what the agent and its sampler
recorded (the sampler's own tick times and missed ticks, the client's request counters), never wall time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("grpc")
from kubelet_server import JunkServer, Kubelet  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
UUID = "GPU-5171a7ed-0000-4000-8000-{:012d}".format
INTERVAL_S = 0.05
TIMEOUT_S = 1.0  # the client's deadline: [kubernetes] pod_resources_timeout

NODE = [
    ("ml", "train-0", [("trainer", "nvidia.com/gpu", [UUID(0)])]),
    ("serve", "infer-a", [("server", "nvidia.com/gpu.shared", [UUID(1) + "::0"])]),  # GPU 1, time-sliced
    ("serve", "infer-b", [("server", "nvidia.com/gpu.shared", [UUID(1) + "::1"])]),
    ("ml", "short-job", [("main", "nvidia.com/gpu", [UUID(2)])]),
    ("ml", "serve-3", [("server", "nvidia.com/gpu", [UUID(3)])]),
    ("ml", "etl-4", [("loader", "nvidia.com/gpu", [UUID(4)])]),
    ("nb", "jupyter-alice", [("notebook", "nvidia.com/gpu", [UUID(5)])]),
    ("ml", "train-6", [("trainer", "nvidia.com/gpu", [UUID(6)])]),
    # GPU 7 is no pod's: its process runs outside Kubernetes. And a device this node's NVML does not list:
    ("x", "ghost", [("c", "nvidia.com/gpu", ["GPU-deadbeef-0000-0000-0000-000000000000"])]),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    def __init__(self, workdir: Path, config: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        cfg = workdir / "agent.toml"
        cfg.write_text(config)
        e = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}  # not in a pod here
        extra = dict(env or {})
        prepend = extra.pop("PREPEND", "")
        e["PYTHONPATH"] = os.pathsep.join(p for p in (prepend, str(ROOT / "src"), e.get("PYTHONPATH", "")) if p)
        e.update(extra)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuscope.cli", "agent", "--port", str(self.port), "--data-dir",
             str(workdir / "data"), "--interval", f"{INTERVAL_S * 1000:g}ms", "--simulate", "mixed", "--config",
             str(cfg)], env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.stderr = ""
        until(lambda: self.get("/api/v1/status") is not None, "the agent to answer", self)

    def raw(self, path: str) -> bytes | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited {self.proc.returncode}: {self.proc.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.read()
        except (urllib.error.URLError, ConnectionError, OSError):
            return None

    def get(self, path: str) -> dict | None:
        body = self.raw(path)
        return None if body is None else json.loads(body)

    def metrics(self, naming: str = "canonical") -> list[tuple[str, dict[str, str], float]]:
        text = self.raw(f"/metrics?naming={naming}").decode()
        return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, self.stderr = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.stderr = self.proc.communicate()
        return self.stderr


def until(ok: Callable[[], object], what: str, agent: Agent | None = None, timeout: float = 45.0) -> object:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        v = ok()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def config(sock: Path | str) -> str:
    return (f'[kubernetes]\npod_resources_socket = "{sock}"\npod_resources_interval = "1s"\n'
            f'pod_resources_timeout = "{TIMEOUT_S:g}s"\n')


def series(samples, name: str, **labels: str) -> list[dict[str, str]]:
    return [lab for n, lab, _ in samples if n == name and all(lab.get(k) == v for k, v in labels.items())]


def states(samples, uuid_label: str = "uuid") -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n, lab, v in samples:
        if n == "gpu_allocation_state" and v == 1.0:
            out.setdefault(lab["gpu"], []).append(lab["state"])
    return out


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="k8s", dir="/tmp"))  # a unix socket path fits in 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_pods_on_a_kubernetes_node(sockdir):
    kubelet = Kubelet(sockdir / "kubelet.sock", NODE).start()
    agent = Agent(sockdir, config(kubelet.path))
    try:
        until(lambda: series(agent.metrics(), "gpu_power_watts", gpu="0", pod="train-0"), "pod labels", agent)
        # Processes are read every second: wait for a read after the kubelet's first answer.
        until(lambda: any(p["pod"] == "train-0" for p in agent.get("/api/v1/latest")["processes"]),
              "process records with pods", agent)

        # -- canonical naming: every series of a GPU a pod holds names it; a shared GPU's name no pod --
        m = agent.metrics()
        for name in ("gpu_power_watts", "gpu_memory_used_bytes", "gpu_sm_active_ratio", "gpu_info"):
            lab = series(m, name, gpu="0")[0]
            assert (lab["namespace"], lab["pod"], lab["container"]) == ("ml", "train-0", "trainer"), name
            assert series(m, name, gpu="5")[0]["pod"] == "jupyter-alice"
            assert "pod" not in series(m, name, gpu="1")[0], name  # two pods share GPU 1
            assert "pod" not in series(m, name, gpu="7")[0], name
        proc0 = series(m, "gpu_process_memory_used_bytes", gpu="0")[0]
        assert (proc0["namespace"], proc0["pod"], proc0["container"]) == ("ml", "train-0", "trainer")
        assert proc0["pid"] == "4000000"
        assert "pod" not in series(m, "gpu_process_memory_used_bytes", gpu="7")[0]
        st = states(m)
        assert set(st) == {str(i) for i in range(8)} and all(len(v) == 1 for v in st.values()), st
        assert st["0"] == ["in_use_by_pod"] and st["1"] == ["in_use_by_pod"]
        assert st["5"] == ["allocated_idle"] and st["7"] == ["in_use_outside_kubernetes"]
        assert len(series(m, "gpu_allocation_state", gpu="0")) == 4  # one series per state, 1 for the one it is in

        # -- DCGM naming, with dcgm-exporter's label names --
        d = agent.metrics("dcgm")
        lab = series(d, "DCGM_FI_DEV_POWER_USAGE", gpu="0")[0]
        assert (lab["namespace"], lab["pod"], lab["container"], lab["UUID"]) == ("ml", "train-0", "trainer", UUID(0))
        assert series(d, "DCGM_FI_DEV_FB_USED", gpu="5")[0]["pod"] == "jupyter-alice"
        assert "pod" not in series(d, "DCGM_FI_DEV_GPU_UTIL", gpu="1")[0]
        dst = [lab for n, lab, v in d if n == "gpu_allocation_state" and v == 1.0]
        assert {(x["gpu"], x["state"]) for x in dst} >= {("5", "allocated_idle"), ("7", "in_use_outside_kubernetes")}
        assert all("UUID" in x and "Hostname" in x for x in dst)
        both = agent.metrics("canonical,dcgm")
        assert len(series(both, "gpu_allocation_state")) == 32  # once, in canonical naming: 8 GPUs x 4 states
        assert series(both, "DCGM_FI_DEV_POWER_USAGE", gpu="0", pod="train-0")

        # -- the API's records --
        latest = agent.get("/api/v1/latest")
        procs = {p["gpu"]: p for p in latest["processes"]}
        assert (procs["0"]["namespace"], procs["0"]["pod"], procs["0"]["container"]) == ("ml", "train-0", "trainer")
        assert procs["0"]["pod_uid"] == "5171a7ed-0000-4000-8000-000000000000"
        assert procs["1"]["pod"] == "" and procs["1"]["container"] == "015171a7ed01"  # shared: the runtime id stays
        assert (procs["7"]["pod"], procs["7"]["pod_uid"], procs["7"]["container"]) == ("", "", "")
        gpus = {g["identity"]["uuid"]: g for g in latest["gpus"]}
        assert gpus[UUID(0)]["allocated_to"] == [{"namespace": "ml", "pod": "train-0", "container": "trainer"}]
        assert len(gpus[UUID(1)]["allocated_to"]) == 2 and gpus[UUID(7)]["allocated_to"] == []
        status = agent.get("/api/v1/status")["kubernetes"]
        assert status["state"] == "ok" and status["pods"] == len(NODE) and status["socket"] == str(kubelet.path)
        assert status["unknown_device_ids"] == ["GPU-deadbeef-0000-0000-0000-000000000000"]
        assert sum(status["failures"].values()) == 0
        assert series(m, "gpuscope_kubelet_up")

        # -- the dashboard's overview and the verdict of the idle GPU name the pod --
        ov = agent.get("/ui/api/overview")
        card = {g["gpu"]: g for g in ov["gpus"]}
        assert card["5"]["allocation"] == {"state": "allocated_idle", "pods": [
            {"namespace": "nb", "pod": "jupyter-alice", "container": "notebook"}]}
        assert card["7"]["allocation"]["state"] == "in_use_outside_kubernetes"

        def idle_verdict():
            vs = agent.get("/api/v1/diagnose?window=10s")["verdicts"]
            return next((v for v in vs if v["gpu"] == "5" and v["kind"] == "idle_allocated"), None)

        v = until(idle_verdict, "GPU 5's idle_allocated verdict", agent)
        assert "allocated to pod nb/jupyter-alice" in v["summary"] and v["evidence"]["pods"] == ["nb/jupyter-alice"]

        # -- `gpuscope top --once` on this agent: the state beside each GPU's verdict --
        top = subprocess.run([sys.executable, "-m", "gpuscope.cli", "top", "--once", "--url",
                              f"http://127.0.0.1:{agent.port}"], env={**os.environ, "PYTHONPATH": str(ROOT / "src"),
                                                                      "COLUMNS": "160"},
                             capture_output=True, text=True, timeout=60)
        assert top.returncode == 0, top.stderr
        rows = {line.split()[0]: line for line in top.stdout.splitlines() if line[:1].isdigit()}
        assert "k8s: allocated, idle: nb/jupyter-alice" in rows["5"], top.stdout
        assert "k8s: in use outside Kubernetes" in rows["7"] and "k8s: in use by ml/train-0" in rows["0"]

        # -- a pod that ends between two refreshes --
        kubelet.pods = [p for p in NODE if p[1] != "short-job"]
        until(lambda: not series(agent.metrics(), "gpu_power_watts", gpu="2", pod="short-job"), "short-job gone",
              agent)
        until(lambda: all(p["pod"] != "short-job" for p in agent.get("/api/v1/latest")["processes"]),
              "its process records", agent)
        assert agent.get("/api/v1/status")["kubernetes"]["pods"] == len(NODE) - 1

        # -- a slow socket: the client times out in its own thread; the sampler ticks on --
        before = agent.get("/api/v1/status")
        kubelet.delay_s = 3.0
        until(lambda: agent.get("/api/v1/status")["kubernetes"]["failures"]["timeout"] >= 3, "three timeouts", agent)
        during = agent.get("/api/v1/status")
        k8s, sampler = during["kubernetes"], during["sampler"]
        assert k8s["state"] == "failing" and "did not answer within" in k8s["error"]
        assert k8s["slowest_call_s"] >= TIMEOUT_S  # each failed call held its thread for the whole deadline
        # A tick that waited on the socket would have lasted as long as the call did.
        assert sampler["tick_max_us"] / 1e6 < k8s["slowest_call_s"], sampler
        ticks = sampler["ticks"] - before["sampler"]["ticks"]
        missed = sampler["missed_ticks"] - before["sampler"]["missed_ticks"]
        blocked = k8s["failures"]["timeout"] * (TIMEOUT_S / INTERVAL_S - 1)  # what a waiting sampler would miss
        assert ticks > 0 and missed < blocked / 2, (ticks, missed, blocked)
        assert series(agent.metrics(), "gpu_power_watts", gpu="0", pod="train-0")  # the last answer stands
        kubelet.delay_s = 0.0
        until(lambda: agent.get("/api/v1/status")["kubernetes"]["state"] == "ok", "the recovery", agent)
    finally:
        err = agent.stop()
        kubelet.stop()
    lines = err.splitlines()
    assert sum("did not answer within" in line for line in lines) == 1, err  # one line when it starts failing
    assert sum("answers again" in line for line in lines) == 1, err  # one when it recovers
    assert sum("GPU-deadbeef" in line for line in lines) == 1, err
    assert "Traceback" not in err


def test_missing_then_garbage_then_a_kubelet(sockdir):
    """The socket is missing at start, then answers garbage, then is the kubelet: the agent samples and serves
    throughout, says one line when it fails and one when it answers, and counts each failure by reason."""
    path = sockdir / "kubelet.sock"
    agent = Agent(sockdir, config(path))
    junk = kubelet = None
    try:
        until(lambda: agent.get("/api/v1/status")["kubernetes"]["failures"]["missing"] >= 2, "missing", agent)
        m = agent.metrics()
        assert series(m, "gpu_power_watts", gpu="0") and not series(m, "gpu_allocation_state")
        assert not series(m, "gpu_power_watts", pod="train-0")
        st = agent.get("/api/v1/status")["kubernetes"]
        assert st["state"] == "failing" and "does not exist" in st["error"] and st["pods"] is None
        junk = JunkServer(path).start()
        until(lambda: agent.get("/api/v1/status")["kubernetes"]["failures"]["malformed"] >= 2, "malformed", agent)
        assert not series(agent.metrics(), "gpu_allocation_state")
        junk.stop()
        junk = None
        kubelet = Kubelet(path, NODE).start()
        until(lambda: series(agent.metrics(), "gpu_allocation_state", gpu="7", state="in_use_outside_kubernetes"),
              "the states once the kubelet answers", agent)
        status = agent.get("/api/v1/status")
        assert status["kubernetes"]["state"] == "ok" and status["healthy_gpus"] == 8
        assert status["sampler"]["ticks"] > 0
    finally:
        err = agent.stop()
        for s in (junk, kubelet):
            if s is not None:
                s.stop()
    assert sum("does not exist" in line for line in err.splitlines()) == 1, err
    assert sum("answers again" in line for line in err.splitlines()) == 1, err
    assert "Traceback" not in err


def test_outside_kubernetes_nothing_is_said_of_allocation(sockdir):
    if os.path.exists("/var/lib/kubelet/pod-resources/kubelet.sock"):
        pytest.skip("this machine runs a kubelet")
    agent = Agent(sockdir, "[sampler]\nprocesses = true\n")
    try:
        until(lambda: agent.get("/api/v1/latest") and agent.get("/api/v1/latest")["processes"], "processes", agent)
        m = agent.metrics() + agent.metrics("dcgm")
        assert series(m, "gpu_power_watts") and not series(m, "gpu_allocation_state")
        assert not [n for n, _, _ in m if n.startswith("gpuscope_kubelet")]
        assert not [lab for _, lab, _ in m if "pod" in lab or "namespace" in lab]
        latest = agent.get("/api/v1/latest")
        assert all(p["pod_uid"] == "" and p["container"] == "" for p in latest["processes"])  # no pods simulated
        assert all(g["allocated_to"] == [] for g in latest["gpus"])
        assert all(g["allocation"] is None for g in agent.get("/ui/api/overview")["gpus"])
        st = agent.get("/api/v1/status")["kubernetes"]
        assert st["state"] == "off" and "not a Kubernetes node" in st["reason"]
    finally:
        err = agent.stop()
    assert "kubelet" not in err.lower() and "Traceback" not in err


def test_without_grpc_the_agent_says_so_and_samples(sockdir):
    """gRPC not installed (a `grpc` that cannot be imported stands first on the path): one line, no pods."""
    blocker = sockdir / "blocked"
    (blocker / "grpc").mkdir(parents=True)
    (blocker / "grpc" / "__init__.py").write_text('raise ImportError("No module named \'grpc\'")\n')
    kubelet = Kubelet(sockdir / "kubelet.sock", NODE).start()
    agent = Agent(sockdir, config(kubelet.path), env={"PREPEND": str(blocker)})
    try:
        until(lambda: agent.get("/api/v1/latest") and agent.get("/api/v1/latest")["processes"], "processes", agent)
        m = agent.metrics()
        assert series(m, "gpu_power_watts", gpu="0") and not series(m, "gpu_allocation_state")
        st = agent.get("/api/v1/status")["kubernetes"]
        assert st["state"] == "off" and "pip install 'gpuscope[kubernetes]'" in st["reason"]
        assert kubelet.lists == 0
    finally:
        err = agent.stop()
        kubelet.stop()
    lines = [line for line in err.splitlines() if "gpuscope[kubernetes]" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
