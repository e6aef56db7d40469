"""Which container, Kubernetes pod, Slurm job or torchrun run a process belongs to, from its cgroup and
environment, and the workload (the job that may span nodes) that makes it one of.

A GPU process seen from the host is just a pid; `/proc/<pid>/cgroup` says which container runtime
and pod put it there, and its environment can add the pod's name and namespace, the Slurm job id and
torchrun's run id. Of the environment only the few variables named in `_ENV_KEYS` are kept: it holds
secrets too.

    >>> attribution_from_cgroup("0::/system.slice/docker-" + "ab" * 32 + ".scope")
    Attribution(container='abababababab', runtime='docker', pod_uid='', pod='', namespace='', slurm_job='', torchrun_run='')
    >>> workload_of("", "", "ml", "train-worker-3"), pod_owner("web-7d4b9c8f6-x2kqp")
    ('k8s/ml/train', 'web')
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from ._text import valid_text

__all__ = ["Attribution", "attribution_from_cgroup", "attribution_from_environ", "pod_owner", "read_attribution",
           "workload_of"]

_SHORT_ID = 12
#: /proc/PID/environ is read up to this many bytes. Kubernetes' service links alone can make an environment of
#: a few hundred KiB in a namespace of many services; a variable past the cap is not seen.
MAX_ENVIRON_BYTES = 1 << 20
#: A workload id longer than this is cut (label values stay bounded).
MAX_WORKLOAD_CHARS = 128


@dataclass(frozen=True)
class Attribution:
    """Where a process runs. Empty strings for what is not known."""

    container: str = ""  # container id, 12 hex digits like `docker ps`
    runtime: str = ""  # 'docker', 'containerd', 'cri-o', 'podman'; '' when the path does not say
    pod_uid: str = ""  # Kubernetes pod UID, with dashes
    pod: str = ""  # Kubernetes pod name (from the environment only)
    namespace: str = ""  # Kubernetes namespace (from the environment or the service account)
    slurm_job: str = ""  # Slurm job id
    torchrun_run: str = ""  # torchrun's run id (TORCHELASTIC_RUN_ID), '' for its default 'none'


_HEX = r"[0-9a-f]{12,64}"
# Runtime-named scopes and directories, systemd and cgroupfs drivers. Order matters: the first match
# in a path wins, and the `-conmon-` scopes (the runtime's monitor, not the container) never match.
_CONTAINER_PATTERNS = [
    (re.compile(rf"(?:^|/)docker-({_HEX})(?:\.scope)?(?:/|$)"), "docker"),
    (re.compile(rf"(?:^|/)docker/({_HEX})(?:/|$)"), "docker"),
    (re.compile(rf"(?:^|/)cri-containerd-({_HEX})(?:\.scope)?(?:/|$)"), "containerd"),
    (re.compile(rf"(?:^|/)(?:cri-)?containerd/({_HEX})(?:/|$)"), "containerd"),
    (re.compile(rf"(?:^|/)nerdctl-({_HEX})(?:\.scope)?(?:/|$)"), "containerd"),
    (re.compile(rf"(?:^|/)crio-({_HEX})(?:\.scope)?(?:/|$)"), "cri-o"),
    (re.compile(rf"(?:^|/)crio/({_HEX})(?:/|$)"), "cri-o"),
    (re.compile(rf"(?:^|/)libpod-({_HEX})(?:\.scope)?(?:/|$)"), "podman"),
    (re.compile(rf"(?:^|/)libpod_parent/({_HEX})(?:/|$)"), "podman"),
    # kubelet's systemd driver on cgroup v1 names some scopes "<pod slice>:<runtime>:<id>"
    (re.compile(rf":cri-containerd:({_HEX})(?:/|$)"), "containerd"),
    (re.compile(rf":docker:({_HEX})(?:/|$)"), "docker"),
    (re.compile(rf":crio:({_HEX})(?:/|$)"), "cri-o"),
]
# cgroupfs driver under kubepods: /kubepods/burstable/pod<uid>/<64 hex>; the runtime is not named.
_BARE_ID = re.compile(r"/([0-9a-f]{64})(?:/|$)")
# Pod UIDs: dashed (cgroupfs), underscored (systemd slices), or 32 hex for static (mirror) pods.
_POD_UID = re.compile(
    r"(?:^|[/-])pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32})"
    r"(?:\.slice)?(?:[/:]|$)"
)
_SLURM_JOB = re.compile(r"(?:^|/)job_(\d+)(?:/|$)")


def _paths(text: str) -> list[str]:
    """The cgroup paths of a /proc/<pid>/cgroup text, v2 unified line first."""
    paths: list[str] = []
    for line in text.splitlines():
        # hierarchy-id:controllers:path; the path itself may contain ':'.
        parts = line.strip().split(":", 2)
        if len(parts) != 3 or not parts[2] or parts[2] == "/":
            continue
        if parts[0] == "0" and parts[1] == "":
            paths.insert(0, parts[2])
        elif parts[2] not in paths:
            paths.append(parts[2])
    return paths


def _from_path(path: str) -> Attribution:
    p = path.lower()
    container = runtime = pod_uid = slurm_job = ""
    for pattern, name in _CONTAINER_PATTERNS:
        m = pattern.search(p)
        if m is not None:
            container, runtime = m.group(1)[:_SHORT_ID], name
            break
    if "kubepods" in p:
        m = _POD_UID.search(p)
        if m is not None:
            pod_uid = m.group(1).replace("_", "-")
        if not container:
            m = _BARE_ID.search(p)
            if m is not None:
                container = m.group(1)[:_SHORT_ID]
    if "slurm" in p:
        m = _SLURM_JOB.search(p)
        if m is not None:
            slurm_job = m.group(1)
    return Attribution(container=container, runtime=runtime, pod_uid=pod_uid, slurm_job=slurm_job)


def _merge(a: Attribution, b: Attribution) -> Attribution:
    """`a`, with its empty fields filled from `b`."""
    changes = {k: v for k, v in vars(b).items() if v and not getattr(a, k)}
    return replace(a, **changes) if changes else a


def attribution_from_cgroup(text: str) -> Attribution:
    """Parse the content of /proc/<pid>/cgroup (v1 or v2) into an Attribution. Never raises.

    >>> attribution_from_cgroup("0::/slurm/uid_1000/job_123/step_0/task_0").slurm_job
    '123'
    """
    result = Attribution()
    try:
        for path in _paths(text):
            result = _merge(result, _from_path(path))
    except Exception:
        pass
    return result


def _environ(data: bytes) -> dict[str, str]:
    """The variables of `_ENV_KEYS` in an environ block (NUL-separated `NAME=value`), values made valid text."""
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key in _ENV_KEYS:
            env[key.decode("ascii")] = valid_text(value.decode("utf-8", "surrogateescape"))
    return env


_ENV_KEYS = frozenset({b"HOSTNAME", b"KUBERNETES_SERVICE_HOST", b"POD_NAME", b"POD_NAMESPACE",
                       b"SLURM_JOB_ID", b"SLURM_JOBID", b"TORCHELASTIC_RUN_ID"})
_SA_NAMESPACE = "var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _read(path: str, limit: int = -1) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except (OSError, ValueError):
        return None


def _read_in_root(root: str, rel: str, max_links: int = 40) -> bytes | None:
    """Read `rel` inside the file system whose root is `root` (a process's /proc/PID/root), following symbolic
    links as that process would. The kernel resolves an absolute link met below /proc/PID/root against *our* root:
    an image's `/var/run -> /run` would read the agent's own /run (its own pod's namespace), not the process's."""
    parts = [p for p in rel.split("/") if p]
    done: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        try:
            target = os.readlink(os.path.join(root, *done, part))
        except OSError:  # not a link (or not there: the read below says so)
            done.append(part)
            continue
        links += 1
        if links > max_links:
            return None
        if target.startswith("/"):
            done = []
        parts = [x for x in target.split("/") if x] + parts
    return _read(os.path.join(root, *done))


def attribution_from_environ(data: bytes) -> Attribution:
    """Pod name and namespace, Slurm job and torchrun run of an environ block (the content of
    /proc/<pid>/environ). The pod name comes from POD_NAME (downward API) or, inside Kubernetes only,
    HOSTNAME. Never raises.

    >>> attribution_from_environ(b"TORCHELASTIC_RUN_ID=llama-7b\\0SECRET=x\\0").torchrun_run
    'llama-7b'
    """
    try:
        return _from_env(_environ(data))
    except Exception:
        return Attribution()


def _from_env(env: dict[str, str]) -> Attribution:
    pod = env.get("POD_NAME", "") or (env.get("HOSTNAME", "") if "KUBERNETES_SERVICE_HOST" in env else "")
    run = env.get("TORCHELASTIC_RUN_ID", "").strip()
    # torchrun's default --rdzv-id is the word 'none': every run started without one would be one workload.
    return Attribution(pod=pod, namespace=env.get("POD_NAMESPACE", ""),
                       slurm_job=(env.get("SLURM_JOB_ID", "") or env.get("SLURM_JOBID", "")).strip(),
                       torchrun_run="" if run.lower() == "none" else run)


def read_attribution(pid: int, proc_root: str = "/proc") -> Attribution:
    """Attribution of process `pid`: cgroup path first, then its environment, best effort.

    The namespace comes from POD_NAMESPACE or the pod's service-account mount. The environment is read up
    to MAX_ENVIRON_BYTES. Unreadable files (another user's process without root, a pid that is gone) give
    empty fields, never an exception.
    """
    try:
        base = os.path.join(proc_root, str(int(pid)))
        data = _read(os.path.join(base, "cgroup"))
        result = attribution_from_cgroup(data.decode("utf-8", "replace")) if data else Attribution()

        raw_env = _read(os.path.join(base, "environ"), MAX_ENVIRON_BYTES)
        if raw_env and len(raw_env) >= MAX_ENVIRON_BYTES:  # cut at the cap: its last variable is not whole
            raw_env = raw_env[:raw_env.rfind(b"\0") + 1]
        variables = _environ(raw_env) if raw_env else {}
        env = _from_env(variables)
        in_k8s = bool(result.pod_uid) or "KUBERNETES_SERVICE_HOST" in variables
        if in_k8s and not env.namespace:
            ns = _read_in_root(os.path.join(base, "root"), _SA_NAMESPACE)
            if ns:
                env = replace(env, namespace=valid_text(ns.decode("utf-8", "surrogateescape")).strip())
        return _merge(result, env)
    except Exception:
        return Attribution()


# -- the workload ------------------------------------------------------------------------------------
# Kubernetes' generated names: rand.String's alphabet (no vowels, no 0, 1, 3) for the 5-character suffix of a
# generateName, and the same alphabet for a ReplicaSet's pod-template-hash (SafeEncodeString of a 32-bit hash:
# up to 10 characters).
_K8S_RAND = "[bcdfghjklmnpqrstvwxz2456789]"
_OWNER_PATTERNS = (
    re.compile(rf"^(.+)-{_K8S_RAND}{{6,10}}-{_K8S_RAND}{{5}}$"),  # Deployment: <deploy>-<rs hash>-<5>
    # an indexed Job: <job>-<completion index>-<5> (a CronJob's Job, <cronjob>-<8-digit minute>, stays itself)
    re.compile(rf"^(.+)-\d{{1,5}}-{_K8S_RAND}{{5}}$"),
    re.compile(rf"^(.+)-{_K8S_RAND}{{5}}$"),  # a Job, a DaemonSet, a bare ReplicaSet: <owner>-<5>
    # Kubeflow's PyTorchJob, MPIJob, TFJob, XGBoostJob replicas: <job>-<replica type>-<index>; MPIJob's launcher
    re.compile(r"^(.+)-(?:master|worker|launcher|chief|ps|evaluator)-\d+$"),
    re.compile(r"^(.+)-launcher$"),
    re.compile(r"^(.+)-\d+$"),  # a StatefulSet: <name>-<ordinal>
)


def pod_owner(pod: str) -> str:
    """The name of the object that made pod `pod`, by Kubernetes' naming conventions; the pod's own name when
    none matches (a bare pod). The kubelet does not say; a StatefulSet named like a Kubeflow replica
    (`redis-master-0`) is read as a Kubeflow job (`redis`).

    >>> [pod_owner(p) for p in ("train-x2kqp", "web-7d4b9c8f6-x2kqp", "db-0", "bert-master-0", "notebook")]
    ['train', 'web', 'db', 'bert', 'notebook']
    """
    for pattern in _OWNER_PATTERNS:
        m = pattern.match(pod)
        if m is not None:
            return m.group(1)
    return pod


def workload_of(slurm_job: str, torchrun_run: str, namespace: str, pod: str) -> str:
    """The job a process is one rank of, which may span nodes: `slurm/<job id>`, `torchrun/<run id>` or
    `k8s/<namespace>/<owner>` (pod_owner), first found; '' for none (a pod whose namespace is unknown has
    none: its owner's name alone could be another namespace's). At most MAX_WORKLOAD_CHARS characters.

    >>> workload_of("4242", "r1", "ml", "x-0"), workload_of("", "r1", "ml", "x-0"), workload_of("", "", "", "x-0")
    ('slurm/4242', 'torchrun/r1', '')
    """
    if slurm_job:
        out = f"slurm/{slurm_job}"
    elif torchrun_run:
        out = f"torchrun/{torchrun_run}"
    elif pod and namespace:
        out = f"k8s/{namespace}/{pod_owner(pod)}"
    else:
        return ""
    return out[:MAX_WORKLOAD_CHARS]
