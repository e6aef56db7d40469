"""The opt-in patch for workloads (deploy/kubernetes/profiling): rendered by the real `kubectl kustomize`,
validated against the Kubernetes schemas, consistent with the agent's DaemonSet, and its layout (the
mounts as the pod sees them) opting a real program in by PYTHONPATH alone."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_autotrace import FAKE, _env, _until
from test_kubernetes_manifests import DEPLOY, OLDEST_KUBERNETES, one, rendered
from test_trace_run import PROG

from gpuscope.agent import autotrace
from gpuscope.trace import ondemand as od

PROFILING = DEPLOY / "profiling"


def _workload() -> dict:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it renders the patch: kubectl kustomize)")
    done = subprocess.run([kubectl, "kustomize", str(PROFILING)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (doc,) = [d for d in yaml.safe_load_all(done.stdout) if d]
    return doc


def _mounts(doc: dict) -> tuple[dict, dict[str, str], dict]:
    pod = doc["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    return container, {m["mountPath"]: volumes[m["name"]]["hostPath"]["path"] for m in container["volumeMounts"]}, \
        {m["mountPath"]: m for m in container["volumeMounts"]}


def test_the_patch_adds_one_variable_and_the_agent_s_three_folders():
    doc = _workload()
    container, host_paths, mounts = _mounts(doc)
    env = {e["name"]: e["value"] for e in container["env"]}
    assert list(env) == ["PYTHONPATH"]  # one variable
    boot = env["PYTHONPATH"].split(":")[0]
    base = os.path.dirname(boot)
    # the bootstrap finds its folders as its own directory's siblings
    assert set(host_paths) == {boot, f"{base}/trace-requests", f"{base}/traces"} and boot.endswith("/bootstrap")
    assert mounts[boot].get("readOnly") is True
    assert not any(mounts[p].get("readOnly") for p in (f"{base}/trace-requests", f"{base}/traces"))
    # the node's side is the agent's data directory (the DaemonSet's hostPath), never that directory itself
    ds = one(rendered("plain"), "DaemonSet")
    data = next(v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "data")
    assert {os.path.dirname(p) for p in host_paths.values()} == {data}
    assert {os.path.basename(p) for p in host_paths.values()} == {"bootstrap", "trace-requests", "traces"}
    assert data not in host_paths.values()
    # the workload keeps what it had
    assert container["image"] == "registry.example.com/my-training:1.0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, "latest"])
def test_the_patched_workload_validates_against_the_kubernetes_schemas(version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version() if version == "latest" else version
    kubernetes_validate.validate(_workload(), version, strict=True)


def test_the_pod_s_layout_opts_a_program_in(tmp_path):
    """The node's folders as the pod mounts them (copies under a stand-in root): a program whose only
    change is the patch's PYTHONPATH registers with the agent's request folder."""
    doc = _workload()
    container, host_paths, _ = _mounts(doc)
    node, pod = tmp_path / "node", tmp_path / "pod"
    data = node / "var/lib/gpuscope"
    data.mkdir(parents=True)
    assert autotrace.publish(data, socket.gethostname()) == ""
    for mount_path, host_path in host_paths.items():
        shutil.copytree(node / host_path.lstrip("/"), pod / mount_path.lstrip("/"), symlinks=True)
        shutil.copystat(node / host_path.lstrip("/"), pod / mount_path.lstrip("/"))
    fake = tmp_path / "image"
    (fake / "torch").mkdir(parents=True)
    for name, text in FAKE.items():
        (fake / "torch" / name).write_text(text)
    (fake / "prog.py").write_text(PROG)
    pythonpath = str(pod) + container["env"][0]["value"]
    p = subprocess.Popen([sys.executable, str(fake / "prog.py"), "plain"],
                         env=_env(PYTHONPATH=f"{pythonpath}{os.pathsep}{fake}", PROG_SLEEP="30"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        req_dir = str(pod / "opt/gpuscope/trace-requests")
        [me] = _until(lambda: od.opted_in(req_dir), 30, "the program to register")
        assert me["pid"] == p.pid and me["trace_dir"] == str(pod / "opt/gpuscope/traces")
        assert me["max_duty"] == 0.01 and me["horizon_s"] == 600.0
    finally:
        p.terminate()
        out, err = p.communicate(timeout=30)
    assert out == "out 1\n" and err == "", (out, err)  # nothing of the profiler in the program's output
    assert od.opted_in(req_dir) == []


def test_the_patch_file_is_documented_where_users_look():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "deploy/kubernetes/profiling/opt-in-patch.yaml" in readme
    assert "PYTHONPATH=/var/lib/gpuscope/bootstrap" in readme
