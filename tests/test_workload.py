"""The `workload` label: the job a GPU process is one rank of, which may span nodes.

The naming of a pod's owner by Kubernetes' conventions (unit), the environment of real child processes read
through /proc (Slurm and torchrun ids, bytes that are not UTF-8, a process that is gone, the size cap), the
label on the per-process and GPU series in both namings, and a real `gpuscope agent --simulate-workload`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import free_port, http_get

from gpuscope import Sampler, SamplerConfig
from gpuscope._cgroup import (
    MAX_ENVIRON_BYTES,
    MAX_WORKLOAD_CHARS,
    Attribution,
    attribution_from_environ,
    pod_owner,
    read_attribution,
    workload_of,
)
from gpuscope._hostproc import HostProcessReader
from gpuscope.export.exposition import render
from gpuscope.fakenvml import FakeGPU, FakeNVML, FakeProcess

ROOT = Path(__file__).resolve().parents[1]


# -- the owner of a pod, by name -----------------------------------------------------------------------
@pytest.mark.parametrize("pod, owner", [
    # a Job (and a DaemonSet, a bare ReplicaSet): <owner>-<5 of rand.String's alphabet>
    ("train-llama-x2kqp", "train-llama"),
    ("nightly-eval-28934710-bq7zt", "nightly-eval-28934710"),  # a CronJob's Job is the owner
    # an indexed Job: <job>-<completion index>-<5>
    ("shard-3-4mzxv", "shard"),
    ("shard-12-4mzxv", "shard"),
    # a Deployment's ReplicaSet: <deploy>-<pod-template-hash>-<5>
    ("web-7d4b9c8f6-x2kqp", "web"),
    ("triton-server-5f8c9d7b44-9txzq", "triton-server"),
    ("api-59b7f5-kd8s2", "api"),  # a short hash (6 characters)
    # a StatefulSet: <name>-<ordinal>
    ("db-0", "db"),
    ("vllm-replicas-12", "vllm-replicas"),
    # Kubeflow: PyTorchJob master and workers, MPIJob launcher and workers, TFJob chief and parameter servers
    ("bert-finetune-master-0", "bert-finetune"),
    ("bert-finetune-worker-15", "bert-finetune"),
    ("allreduce-launcher", "allreduce"),
    ("allreduce-launcher-0", "allreduce"),
    ("allreduce-worker-3", "allreduce"),
    ("resnet-chief-0", "resnet"),
    ("resnet-ps-1", "resnet"),
    # names that match none: the pod's own name
    ("notebook", "notebook"),
    ("my-debug-pod", "my-debug-pod"),
    ("train-abcde", "train-abcde"),  # vowels: not a generated suffix
    ("train-x2kq", "train-x2kq"),  # four characters: not one either
    ("train-X2KQP", "train-X2KQP"),  # upper case: generated names are lower case
    ("worker-0-extra", "worker-0-extra"),
    ("-0", "-0"),
    ("", ""),
])
def test_pod_owner_follows_kubernetes_naming(pod: str, owner: str) -> None:
    assert pod_owner(pod) == owner


def test_workload_is_slurm_then_torchrun_then_the_pods_owner() -> None:
    assert workload_of("4242", "run-1", "ml", "bert-worker-0") == "slurm/4242"
    assert workload_of("", "run-1", "ml", "bert-worker-0") == "torchrun/run-1"
    assert workload_of("", "", "ml", "bert-worker-0") == "k8s/ml/bert"
    assert workload_of("", "", "ml", "web-7d4b9c8f6-x2kqp") == "k8s/ml/web"
    # a pod whose namespace is unknown: its owner's name alone could be any namespace's
    assert workload_of("", "", "", "bert-worker-0") == ""
    assert workload_of("", "", "", "") == ""
    long = workload_of("", "r" * 10_000, "", "")
    assert len(long) == MAX_WORKLOAD_CHARS and long.startswith("torchrun/rrr")


def test_torchruns_default_run_id_none_names_no_workload() -> None:
    # torchrun without --rdzv-id sets TORCHELASTIC_RUN_ID=none: that is every such run on the fleet, not one job
    assert attribution_from_environ(b"TORCHELASTIC_RUN_ID=none\0").torchrun_run == ""
    assert attribution_from_environ(b"TORCHELASTIC_RUN_ID=None\0").torchrun_run == ""
    assert attribution_from_environ(b"TORCHELASTIC_RUN_ID=none-7\0").torchrun_run == "none-7"
    assert attribution_from_environ(b"SLURM_JOBID=77\0").slurm_job == "77"  # the older spelling


def test_only_the_named_variables_are_kept() -> None:
    env = attribution_from_environ(b"AWS_SECRET_ACCESS_KEY=hunter2\0HF_TOKEN=hf_x\0TORCHELASTIC_RUN_ID=r\0")
    assert env == Attribution(torchrun_run="r")
    assert "hunter2" not in repr(env) and "hf_x" not in repr(env)


@pytest.mark.parametrize("junk", [b"", b"\0\0", b"=\0", b"TORCHELASTIC_RUN_ID\0", b"\xff\xfe=\xff\0"])
def test_environ_junk_gives_nothing(junk: bytes) -> None:
    assert attribution_from_environ(junk) == Attribution()


# -- the environment of real processes -------------------------------------------------------------------
def _child(env: dict[bytes, bytes]) -> subprocess.Popen[bytes]:
    """A real process that sleeps with exactly `env` as its environment."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _attribution_once_running(p: subprocess.Popen[bytes], timeout_s: float = 30.0) -> Attribution:
    """The child's attribution once its environment is readable: on a loaded machine /proc/PID/environ was
    once read empty right after Popen returned (a loaded suite run), which says nothing of the reader."""
    deadline = time.monotonic() + timeout_s
    while True:
        att = read_attribution(p.pid)
        if att != Attribution() or time.monotonic() > deadline or p.poll() is not None:
            return att
        time.sleep(0.05)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    made: list[subprocess.Popen[bytes]] = []
    yield made
    for p in made:
        p.kill()
        p.wait(10)


def test_a_real_process_environment_gives_its_slurm_job_and_torchrun_run(children: list) -> None:
    slurm = _child({b"PATH": b"/usr/bin", b"SLURM_JOB_ID": b"918273", b"API_TOKEN": b"s3cret"})
    torch = _child({b"TORCHELASTIC_RUN_ID": b"llama-70b-run7", b"PATH": b"/usr/bin"})
    children += [slurm, torch]
    att = _attribution_once_running(slurm)
    assert att.slurm_job == "918273" and att.torchrun_run == ""
    assert _attribution_once_running(torch).torchrun_run == "llama-70b-run7"
    # the host reader carries it to the process record
    reader = HostProcessReader()
    info = reader.read(torch.pid)
    assert info is not None and info.torchrun_run == "llama-70b-run7" and info.slurm_job == ""
    info = reader.read(slurm.pid)
    assert info is not None and info.slurm_job == "918273"
    assert "s3cret" not in repr(info)


def test_a_real_process_environment_that_is_not_utf8_is_made_valid_text(children: list) -> None:
    p = _child({b"TORCHELASTIC_RUN_ID": b"run-\xff\xfe-caf\xc3\xa9", b"SLURM_JOB_ID": b"\xc3(7"})
    children.append(p)
    att = _attribution_once_running(p)
    assert att.torchrun_run == "run-\\xff\\xfe-café"
    assert att.slurm_job == "\\xc3(7"
    att.torchrun_run.encode("utf-8")  # encodable: /metrics, the store and JSON can carry it
    assert workload_of(att.slurm_job, att.torchrun_run, "", "") == "slurm/\\xc3(7"


def test_a_process_that_is_gone_has_no_workload() -> None:
    p = _child({b"SLURM_JOB_ID": b"5"})
    pid = p.pid
    p.kill()
    p.wait(10)  # reaped: /proc/<pid> is gone (pids are not reused within a test)
    assert not os.path.exists(f"/proc/{pid}")
    assert read_attribution(pid) == Attribution()
    assert HostProcessReader().read(pid) is None


def test_an_environ_that_cannot_be_read_gives_nothing(tmp_path: Path) -> None:
    # A process of another user without root gives EACCES; a directory in its place gives EISDIR: both OSError.
    (tmp_path / "7" / "environ").mkdir(parents=True)
    assert read_attribution(7, proc_root=str(tmp_path)) == Attribution()


def test_the_environ_is_read_up_to_its_cap(tmp_path: Path) -> None:
    def pad(n: int) -> bytes:  # one variable of n bytes, its NUL included
        return b"PAD=" + b"x" * (n - 5) + b"\0"

    cases = {
        1: b"TORCHELASTIC_RUN_ID=early\0" + pad(MAX_ENVIRON_BYTES),  # before the cap: read
        2: pad(MAX_ENVIRON_BYTES - 100) + b"TORCHELASTIC_RUN_ID=inside\0",  # ends before the cap: read
        3: pad(MAX_ENVIRON_BYTES) + b"TORCHELASTIC_RUN_ID=late\0",  # past the cap: not seen
        # across the cap: not cut to a prefix of the id ("strad"), which would name another job
        4: pad(MAX_ENVIRON_BYTES - 25) + b"TORCHELASTIC_RUN_ID=straddling\0",
    }
    for pid, env in cases.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "environ").write_bytes(env)
    got = {pid: read_attribution(pid, proc_root=str(tmp_path)).torchrun_run for pid in cases}
    assert got == {1: "early", 2: "inside", 3: "", 4: ""}


# -- the label on the series ---------------------------------------------------------------------------
def _labels(text: str, name: str) -> list[dict[str, str]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def test_real_processes_on_a_gpu_label_their_series_with_their_workload(children: list) -> None:
    """Two real processes (their /proc read by the real host reader) on fake GPUs: the per-process series carry
    each one's workload; GPU 0, whose only process is one job's, carries it on its own series; GPU 1, shared by
    two jobs, carries none on its own series."""
    a = _child({b"TORCHELASTIC_RUN_ID": b"job-a"})
    b = _child({b"SLURM_JOB_ID": b"31337"})
    children += [a, b]
    # The host reader reads a process's environment once (a GPU process is long past its exec); a child read
    # between its fork and its exec on a loaded machine would keep an empty one, which says nothing of the reader.
    assert _attribution_once_running(a) != Attribution() and _attribution_once_running(b) != Attribution()
    fake = FakeNVML([FakeGPU(index=0, uuid="GPU-a", processes=[FakeProcess(pid=a.pid)]),
                     FakeGPU(index=1, uuid="GPU-b", processes=[FakeProcess(pid=a.pid), FakeProcess(pid=b.pid)])])
    with Sampler(SamplerConfig(interval=0.05, collect_host=False, events=False), nvml=fake) as s:
        snap = s.sample_once()
        deadline = time.monotonic() + 10
        while not snap.processes and time.monotonic() < deadline:
            time.sleep(0.05)
            snap = s.sample_once()
    assert {(p.gpu, p.pid, p.workload) for p in snap.processes} == {
        ("0", a.pid, "torchrun/job-a"), ("1", a.pid, "torchrun/job-a"), ("1", b.pid, "slurm/31337")}
    text = render(snap).decode()
    procs = {(x["gpu"], x["pid"], x.get("workload")) for x in _labels(text, "gpu_process_memory_used_bytes")}
    assert procs == {("0", str(a.pid), "torchrun/job-a"), ("1", str(a.pid), "torchrun/job-a"),
                     ("1", str(b.pid), "slurm/31337")}
    gpus = {x["gpu"]: x.get("workload") for x in _labels(text, "gpu_memory_used_bytes")}
    assert gpus == {"0": "torchrun/job-a", "1": None}
    dcgm = {x["gpu"]: x.get("workload") for x in _labels(render(snap, mode="dcgm").decode(), "DCGM_FI_DEV_FB_USED")}
    assert dcgm == {"0": "torchrun/job-a", "1": None}


# -- a real agent ------------------------------------------------------------------------------------------
def _gpuscope(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuscope", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args, words", [
    (["--simulate-workload", "job-1"], "--simulate-workload only applies to a simulated node"),
    (["--simulate", "healthy", "--simulate-workload", "a=b"], "is not one"),
    (["--simulate", "healthy", "--simulate-workload", "none"], "is not one"),
    (["--simulate", "healthy", "--simulate-workload", ""], "is not one"),
    (["--simulate", "healthy", "--simulate-workload", "x" * 200], "is not one"),
])
def test_a_bad_simulated_workload_is_one_sentence_and_exit_2(tmp_path: Path, args: list[str], words: str) -> None:
    r = _gpuscope("agent", *args, "--port", "0", "--data-dir", str(tmp_path / "d"))
    assert r.returncode == 2, r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()


def test_an_agent_with_a_simulated_workload_labels_process_and_gpu_series(tmp_path: Path) -> None:
    port = free_port()
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "gpuscope", "agent", "--simulate", "throttled", "--gpus", "2",
                             "--simulate-workload", "llama-pretrain", "--port", str(port),
                             "--data-dir", str(tmp_path / "data")],
                            env={**os.environ, "GPUSCOPE_NODE_NAME": "node-w"}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "agent.log").read_text()
            try:
                text = http_get(url + "/metrics", 2.0)[1].decode()
            except OSError:
                text = ""
            if "gpu_process_memory_used_bytes{" in text:
                break
            time.sleep(0.2)
        procs = _labels(text, "process_cpu_cores")
        assert len(procs) == 2 and all(p["workload"] == "torchrun/llama-pretrain" for p in procs), procs
        assert all(p["hostname"] == "node-w" for p in procs)
        gpus = _labels(text, "gpu_power_watts")
        assert {g["gpu"]: g.get("workload") for g in gpus} == {"0": "torchrun/llama-pretrain",
                                                                "1": "torchrun/llama-pretrain"}
        dcgm = _labels(http_get(url + "/metrics?naming=dcgm", 2.0)[1].decode(), "DCGM_FI_DEV_POWER_USAGE")
        assert {g["gpu"]: g.get("workload") for g in dcgm} == {"0": "torchrun/llama-pretrain",
                                                                "1": "torchrun/llama-pretrain"}
        latest = json.loads(http_get(url + "/api/v1/latest", 2.0)[1])
        assert {p["workload"] for p in latest["processes"]} == {"torchrun/llama-pretrain"}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
