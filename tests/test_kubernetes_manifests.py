"""The Kubernetes manifests (deploy/kubernetes) as a cluster gets them, and the agent's image build steps.

No kubelet and no container engine run here. So: every overlay is rendered by the real `kubectl
kustomize`; every rendered object is validated offline against the JSON schemas of Kubernetes releases
(kubernetes-validate) and the Prometheus Operator's objects against schemas generated from its CRDs
(cloudcoil's models); the security context, mounts, probes and resources are asserted on the rendered
DaemonSet; the container's command line (the Containerfile's ENTRYPOINT and the DaemonSet's args), the
ConfigMap's config and the Secret's token file, laid out as the volumes would be, start a real agent
on a free 127.0.0.1 port (the listen address and the host paths are the only things changed); and the
Containerfile's COPY and RUN steps install the source tree into a fresh virtual environment.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from servers import need_binary

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"
OVERLAYS = ("plain", "prometheus-operator", "dcgm-naming")
NAMESPACE = "gpuscope"
#: the oldest Kubernetes release the manifests are checked against, and the newest kubernetes-validate knows
OLDEST_KUBERNETES = "1.30.0"


# -- rendering -----------------------------------------------------------------------------------
@cache
def _render(overlay: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it renders the overlays: kubectl kustomize)")
    done = subprocess.run([kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def rendered(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects as `kubectl kustomize` renders them (a fresh copy each call)."""
    return copy.deepcopy(list(_render(overlay)))


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def agent_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    return container


def config_text(docs: list[dict[str, Any]]) -> str:
    (text,) = one(docs, "ConfigMap")["data"].values()
    return text


def quantity(q: str | int) -> float:
    """A Kubernetes quantity in base units: '50m' -> 0.05, '150Mi' -> 157286400."""
    m = re.fullmatch(r"([0-9.]+)(m|Ki|Mi|Gi|k|M|G)?", str(q))
    assert m, f"not a quantity this test reads: {q!r}"
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return float(m.group(1)) * scale[m.group(2)]


# -- what is rendered ----------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_the_agent_and_nothing_it_does_not_need(overlay):
    docs = rendered(overlay)
    kinds = sorted(d["kind"] for d in docs)
    extra = ["PrometheusRule", "ServiceMonitor"] if overlay == "prometheus-operator" else []
    assert kinds == sorted(["ConfigMap", "DaemonSet", "Namespace", "Service", "ServiceAccount", *extra])
    # No Role, ClusterRole or binding: the agent asks the API server nothing.
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == NAMESPACE, d["kind"]
    # The overlays differ from the base only where they say: the DaemonSet's args (dcgm-naming).
    base = one(rendered("plain"), "DaemonSet")
    ds = one(docs, "DaemonSet")
    if overlay == "dcgm-naming":
        assert ds["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "--naming=dcgm"
        ds["spec"]["template"]["spec"]["containers"][0]["args"].pop()
    assert ds == base


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, "latest"])
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version() if version == "latest" else version
    checked = 0
    for d in rendered(overlay):
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # custom resources: their own schemas, below
        # strict: a key the schema does not know (a typo) is an error, as kubectl's field validation makes it
        kubernetes_validate.validate(d, version, strict=True)
        checked += 1
    assert checked == 5
    # The validator refuses what a cluster would: a misspelt key, a quantity of the wrong type.
    ds = one(rendered(overlay), "DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="securityContxt"):
        kubernetes_validate.validate(ds, version, strict=True)


def _closed(schema: Any) -> Any:
    """The schema with every object closed to keys it does not name (a typo is an error, as the API
    server's strict field validation makes it), and RE2's leading `^(?i)` in Python's order."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        if isinstance(schema.get("pattern"), str) and schema["pattern"].startswith("^(?i)"):
            schema["pattern"] = "(?i)^" + schema["pattern"][len("^(?i)"):]
        for v in schema.values():
            _closed(v)
    elif isinstance(schema, list):
        for v in schema:
            _closed(v)
    return schema


def test_prometheus_operator_objects_validate_against_the_crd_schemas():
    """cloudcoil's models are generated from the Prometheus Operator's CRDs (v0.80): their JSON schema
    keeps the CRDs' field names, types, required fields, enums and patterns."""
    jsonschema = pytest.importorskip("jsonschema")
    models = pytest.importorskip("cloudcoil.models.prometheus_operator.v1")
    docs = rendered("prometheus-operator")
    for kind in ("ServiceMonitor", "PrometheusRule"):
        obj = one(docs, kind)
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        schema = _closed(getattr(models, kind).model_json_schema(by_alias=True))
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.Draft202012Validator(schema).validate(obj)
    # ... and refuse what the operator would.
    sm = one(docs, "ServiceMonitor")
    schema = _closed(models.ServiceMonitor.model_json_schema(by_alias=True))
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["interval"] = "15 s"
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        jsonschema.validate(bad, schema)
    bad = copy.deepcopy(sm)
    del bad["spec"]["endpoints"][0]["authorization"]["credentials"]["key"]
    with pytest.raises(jsonschema.ValidationError, match="'key' is a required property"):
        jsonschema.validate(bad, schema)


# -- the DaemonSet -------------------------------------------------------------------------------
def test_the_agent_runs_on_every_gpu_node_and_takes_no_gpu():
    docs = rendered("plain")
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["runtimeClassName"] == "nvidia"
    c = agent_container(docs)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    for section in ("requests", "limits"):
        assert not [r for r in c["resources"][section] if "gpu" in r]  # it reads every GPU, holds none


def test_security_context_keeps_only_what_the_agent_needs():
    docs = rendered("plain")
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    sc = agent_container(docs)["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["capabilities"]["add"] == ["SYS_PTRACE"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    # uid 0 for the kubelet's root-owned pod-resources socket, said in the manifest (not by accident).
    assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["hostPID"] is True
    assert not pod.get("hostNetwork") and not pod.get("hostIPC")
    assert pod["automountServiceAccountToken"] is False
    assert one(docs, "ServiceAccount")["automountServiceAccountToken"] is False
    assert one(docs, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    # Every capability kept says why, in a comment right above it in the base.
    lines = (DEPLOY / "base" / "daemonset.yaml").read_text().splitlines()
    for cap in sc["capabilities"]["add"]:
        (at,) = [i for i, line in enumerate(lines) if line.strip() == f"- {cap}"]
        assert lines[at - 1].strip().startswith("#"), f"{cap} is kept without a comment saying why"


def test_mounts_are_the_config_the_token_the_history_and_read_only_host_folders():
    docs = rendered("plain")
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in agent_container(docs)["volumeMounts"]}
    assert set(mounts) == {"/etc/gpuscope", "/var/lib/gpuscope", "/var/lib/gpuscope/token",
                           "/var/lib/kubelet/pod-resources", "/tmp"}
    # Only the agent's own data directory is written; every other mount is read-only (an emptyDir /tmp aside).
    for path, m in mounts.items():
        kind = next(k for k in ("configMap", "secret", "hostPath", "emptyDir") if k in volumes[m["name"]])
        writable = path in ("/var/lib/gpuscope", "/tmp")
        assert m.get("readOnly", False) is not writable, path
        assert kind == {"/etc/gpuscope": "configMap", "/var/lib/gpuscope/token": "secret",
                        "/tmp": "emptyDir"}.get(path, "hostPath"), path
    host_paths = {v["hostPath"]["path"] for v in volumes.values() if "hostPath" in v}
    assert host_paths == {"/var/lib/gpuscope", "/var/lib/kubelet/pod-resources"}  # no /, /sys, /var/run
    secret = volumes[mounts["/var/lib/gpuscope/token"]["name"]]["secret"]
    assert secret["secretName"] == "gpuscope-token" and secret["defaultMode"] == 0o400
    assert mounts["/var/lib/gpuscope/token"]["subPath"] == "token"
    assert volumes[mounts["/tmp"]["name"]]["emptyDir"]["sizeLimit"]
    configmap = volumes[mounts["/etc/gpuscope"]["name"]]["configMap"]["name"]
    assert configmap == one(docs, "ConfigMap")["metadata"]["name"]  # the generated name, with its hash


def test_probes_resources_and_the_grace_period():
    import inspect

    from gpuscope.http.serve import start

    docs = rendered("plain")
    c = agent_container(docs)
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert "httpHeaders" not in c["livenessProbe"]["httpGet"]  # no token in the manifest
    # The footprint goal (issue 19, item 5) as the requests, with headroom in the limits.
    r = c["resources"]
    assert r["requests"] == {"cpu": "50m", "memory": "150Mi"}
    assert quantity(r["limits"]["cpu"]) >= 4 * quantity(r["requests"]["cpu"])
    assert quantity(r["limits"]["memory"]) >= 2 * quantity(r["requests"]["memory"])
    # SIGTERM: open requests get the HTTP kit's shutdown timeout, then the store's last flush.
    grace = one(docs, "DaemonSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > inspect.signature(start).parameters["shutdown_timeout_s"].default


def test_the_probes_are_paths_the_agent_answers_without_the_token():
    """The agent listens beyond loopback in the pod, where every request needs the token, and a kubelet's
    httpGet probe cannot send one: the HTTP kit's probe exemption must cover both probe paths."""
    from gpuscope.http import auth

    if not hasattr(auth, "PROBE_PATHS"):
        pytest.skip("the HTTP kit has no probe exemption yet (gpuscope.http.auth.PROBE_PATHS): "
                    "the probes would get 401 beyond loopback")
    c = agent_container(rendered("plain"))
    assert {c["livenessProbe"]["httpGet"]["path"], c["readinessProbe"]["httpGet"]["path"]} <= auth.PROBE_PATHS


def test_the_config_map_is_a_config_the_agent_accepts_and_matches_the_pod(tmp_path):
    from gpuscope.agent import config as agent_config

    docs = rendered("plain")
    path = tmp_path / "agent.toml"
    path.write_text(config_text(docs))
    cfg = agent_config.load(path)
    assert cfg.agent.bind == "0.0.0.0" and not cfg.loopback_only  # the token is required for every request
    c = agent_container(docs)
    (port,) = c["ports"]
    assert port["containerPort"] == cfg.agent.port and port["name"] == "metrics"
    assert cfg.agent.data_dir in {m["mountPath"] for m in c["volumeMounts"]}
    assert (Path(cfg.agent.data_dir) / "token").as_posix() in {m["mountPath"] for m in c["volumeMounts"]}
    assert c["args"][:2] == ["--config", "/etc/gpuscope/" + path.name]


def test_the_service_and_the_service_monitor_reach_the_agent_with_its_token():
    docs = rendered("prometheus-operator")
    ds, svc, sm = one(docs, "DaemonSet"), one(docs, "Service"), one(docs, "ServiceMonitor")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["clusterIP"] == "None"  # one endpoint per node
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] in {p["name"] for p in agent_container(docs)["ports"]}
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == svc_port["name"] and ep["path"] == "/metrics"
    token_volume = next(v for v in ds["spec"]["template"]["spec"]["volumes"] if "secret" in v)
    assert ep["authorization"]["credentials"] == {"name": token_volume["secret"]["secretName"], "key": "token"}
    assert sm["metadata"]["namespace"] == svc["metadata"]["namespace"]  # the operator reads the Secret there


def test_the_prometheus_rule_is_a_fresh_render_of_export_rules():
    spec = importlib.util.spec_from_file_location("render_prometheusrule", DEPLOY / "render_prometheusrule.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rules = module.export_rules(sys.executable)
    assert module.OUT.read_text() == module.render(rules), (
        "deploy/kubernetes/overlays/prometheus-operator/prometheusrule.yaml is stale: "
        "run python deploy/kubernetes/render_prometheusrule.py")
    rule = one(rendered("prometheus-operator"), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(rules)
    assert len(rule["spec"]["groups"][0]["rules"]) >= 5


def test_the_prometheus_rule_groups_pass_promtool(tmp_path):
    promtool = need_binary("promtool")
    rule = one(rendered("prometheus-operator"), "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_readme_commands_match_the_manifests():
    """The README's Kubernetes section: its Secret is the one the DaemonSet mounts and the ServiceMonitor
    sends, its apply command names the overlays, its build command the Containerfile and the image tag."""
    import gpuscope

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("\n## Kubernetes\n"):]
    section = section[:section.index("\n## ", 1)]
    (secret_cmd,) = [line for line in section.splitlines() if "create secret generic" in line]
    argv = shlex.split(secret_cmd)
    assert argv[argv.index("-n") + 1] == NAMESPACE
    name = argv[argv.index("generic") + 1]
    (literal,) = [a for a in argv if a.startswith("--from-literal=")]
    key = literal.removeprefix("--from-literal=").split("=", 1)[0]
    docs = rendered("prometheus-operator")
    mount = next(m for m in agent_container(docs)["volumeMounts"] if m["name"] == "token")
    volume = next(v for v in one(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"] if v["name"] == "token")
    assert (volume["secret"]["secretName"], mount["subPath"]) == (name, key)
    assert one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["authorization"]["credentials"] == \
        {"name": name, "key": key}
    assert "kubectl apply -k deploy/kubernetes/overlays/plain" in section
    for overlay in OVERLAYS:
        assert f"`{overlay}`" in section
    image = agent_container(docs)["image"]  # the base's `images:` entry, tagged with the package's version
    assert image.endswith(f":{gpuscope.__version__}")
    assert f"-f {CONTAINERFILE.relative_to(ROOT)} -t {image} ." in section and f"docker push {image}" in section


# -- the image -----------------------------------------------------------------------------------
def containerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Containerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in CONTAINERFILE.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def entrypoint() -> list[str]:
    (ep,) = [json.loads(rest) for word, rest in containerfile() if word == "ENTRYPOINT"]
    return ep


def test_the_image_is_the_package_and_its_entrypoint_is_the_agent():
    import gpuscope

    docs = rendered("plain")
    image = agent_container(docs)["image"]
    assert image.rsplit(":", 1)[1] == gpuscope.__version__  # the tag is the version the Containerfile builds
    assert entrypoint() == ["gpuscope", "agent"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["gpuscope"] == "gpuscope.cli:main"
    # The image's environment and the DaemonSet's agree on what the NVIDIA runtime is asked for.
    env = {e["name"]: e.get("value") for e in agent_container(docs)["env"]}
    image_env = " ".join(rest for word, rest in containerfile() if word == "ENV")
    for name in ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"):
        assert f"{name}={env[name]}" in image_env.split()
    assert [rest for word, rest in containerfile() if word == "USER"] == ["65532:65532"]  # not root by default


def test_the_containerfile_install_steps_give_a_working_gpuscope_in_a_fresh_venv(tmp_path):
    """The Containerfile's WORKDIR, COPY and `pip install` steps, run as written into a fresh virtual
    environment but for two flags: the image's --no-cache-dir is dropped, so that pip's cache is reused,
    and --no-compile added. The fresh environment sees the test environment's packages after its own (a
    path file), so pip finds the dependencies there, already satisfied, and builds and installs gpuscope
    itself from the copied files alone: what the image's steps decide (which files are copied, that the
    package builds from them, the entry point, the extras named) is what is tested; resolving the
    dependencies afresh is `make test`'s own install (downloading and installing all of them here took
    25-95 s, a sixth of the suite on 2 cores). The other RUN (useradd) changes the system and is not run."""
    import sysconfig

    import gpuscope

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)  # a hang guard: 120 s ran out at load 40
    inner = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    outer = dict.fromkeys((sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]))
    Path(inner, "zz-test-environment.pth").write_text("".join(f"{p}\n" for p in outer))
    fs = tmp_path / "image"
    workdir = fs
    ran_pip = False
    for word, rest in containerfile():
        if word == "WORKDIR":
            workdir = fs / rest.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif word == "COPY":
            *sources, dest = shlex.split(rest)
            for s in sources:
                src = ROOT / s
                target = (workdir / dest) if not dest.endswith("/") else (workdir / dest / src.name)
                if src.is_dir():
                    shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, target)
        elif word == "RUN":
            argv = shlex.split(rest)
            if argv[0] == "useradd":
                continue
            assert argv[:2] == ["pip", "install"], f"a RUN step this test does not know: {rest}"
            argv = [str(venv / "bin" / "pip"), *[a for a in argv[1:] if a != "--no-cache-dir"], "--no-compile"]
            done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=540)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            ran_pip = True
    assert ran_pip
    exe = venv / "bin" / entrypoint()[0]
    done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"gpuscope {gpuscope.__version__}", done.stderr
    done = subprocess.run([str(exe), *entrypoint()[1:], "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--config" in done.stdout, done.stderr
    # The extras the image asks for are installed (the kubernetes one: the PodResources client's gRPC).
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    if "kubernetes" in extras:
        done = subprocess.run([str(venv / "bin" / "python"), "-c", "import grpc, google.protobuf"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr


# -- the agent, started from the rendered manifests ----------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(port: int, path: str, token: str | None = None, method: str = "GET",
         data: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=data,
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def lay_out_volumes(docs: list[dict[str, Any]], root: Path, token: str) -> dict[str, Path]:
    """The container's mounts as local folders and files under `root`: the ConfigMap's keys, the Secret's
    token (with the volume's mode), empty folders for hostPath and emptyDir. Returns mountPath -> path."""
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    configmaps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    secrets = {"gpuscope-token": {"token": token}}  # made by the user: kubectl create secret generic ...
    out: dict[str, Path] = {}
    for m in sorted(agent_container(docs)["volumeMounts"], key=lambda m: len(m["mountPath"])):
        local = root / m["mountPath"].lstrip("/")
        v = volumes[m["name"]]
        if "configMap" in v:
            local.mkdir(parents=True)
            for key, value in configmaps[v["configMap"]["name"]].items():
                (local / key).write_text(value)
        elif "secret" in v:
            data = secrets[v["secret"]["secretName"]]
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(data[m["subPath"]])
            local.chmod(v["secret"]["defaultMode"])
        else:
            local.mkdir(parents=True, exist_ok=True)
        out[m["mountPath"]] = local
    return out


def local_path(path: str, mounts: dict[str, Path]) -> str:
    """A container path -> where lay_out_volumes put it (the longest mount that holds it)."""
    for mount in sorted(mounts, key=len, reverse=True):
        if path == mount or path.startswith(mount.rstrip("/") + "/"):
            return str(mounts[mount] / os.path.relpath(path, mount))
    return path


def for_this_machine(text: str, port: int, mounts: dict[str, Path]) -> str:
    """The ConfigMap's config with the test's changes only: loopback, a free port, the data folder here."""
    data_dir = tomllib.loads(text)["agent"]["data_dir"]
    out = text
    for key, value in (("bind", "127.0.0.1"), ("port", port), ("data_dir", local_path(data_dir, mounts))):
        out, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {json.dumps(value)}", out)
        assert n == 1, key
    before, after = tomllib.loads(text), tomllib.loads(out)
    for key in ("bind", "port", "data_dir"):
        del before["agent"][key], after["agent"][key]
    assert before == after
    return out


@pytest.mark.parametrize("overlay", ["plain", "dcgm-naming"])
def test_the_rendered_command_line_and_config_start_an_agent_that_serves(overlay, tmp_path):
    docs = rendered(overlay)
    container = agent_container(docs)
    token = os.urandom(32).hex()  # as the README makes it: openssl rand -hex 32
    mounts = lay_out_volumes(docs, tmp_path / "pod", token)
    port = free_port()
    config_path = local_path(container["args"][container["args"].index("--config") + 1], mounts)
    Path(config_path).write_text(for_this_machine(Path(config_path).read_text(), port, mounts))
    argv = [sys.executable, "-m", "gpuscope", *entrypoint()[1:],
            *[local_path(a, mounts) for a in container["args"]], "--simulate", "mixed"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for e in container["env"]:
        env[e["name"]] = e.get("value", "test-node")  # fieldRef spec.nodeName: this test's node
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        code = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                code, body = http(port, "/readyz")
                if code == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        assert proc.poll() is None, f"the agent exited {proc.returncode}: {proc.stderr.read()[-3000:]}"
        assert code == 200, f"/readyz answered {code}"
        assert json.loads(body)["healthy"] is True
        assert http(port, "/healthz")[0] == 200
        deadline = time.monotonic() + 30
        metrics = b""
        # ready before its first full sample: SM activity comes from the second (a rate over two GPM reads)
        want = b"DCGM_FI_DEV_GPU_UTIL" if overlay == "dcgm-naming" else b"\ngpu_sm_active_ratio{"
        while time.monotonic() < deadline:
            code, metrics = http(port, "/metrics")
            if code == 200 and want in metrics:
                break
            time.sleep(0.2)
        text = metrics.decode()
        if overlay == "dcgm-naming":
            assert "DCGM_FI_DEV_GPU_UTIL" in text and "\ngpu_sm_active_ratio{" not in text
        else:
            assert "\ngpu_sm_active_ratio{" in text and "DCGM_FI_" not in text
        assert len(set(re.findall(r'gpu="(\d+)"', text))) == 8  # --simulate mixed: an 8-GPU node
        # The agent's token is the Secret's (a change needs it, even on loopback), and the file is left as mounted.
        event = json.dumps({"kind": "guard", "type": "manifest_test", "severity": "info", "message": "hello",
                            "source": "test"}).encode()
        assert http(port, "/api/v1/events", token="0" * 64, method="POST", data=event)[0] == 401
        assert http(port, "/api/v1/events", token=token, method="POST", data=event)[0] == 202
        token_file = mounts["/var/lib/gpuscope/token"]
        assert token_file.read_text() == token and stat.S_IMODE(token_file.stat().st_mode) == 0o400
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
