"""Which container, Kubernetes pod or Slurm job a process belongs to, from its cgroup and environment.

A GPU process seen from the host is just a pid; `/proc/<pid>/cgroup` says which container runtime
and pod put it there, and its environment can add the pod's name and namespace.

    >>> attribution_from_cgroup("0::/system.slice/docker-" + "ab" * 32 + ".scope")
    Attribution(container='abababababab', runtime='docker', pod_uid='', pod='', namespace='', slurm_job='')
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

__all__ = ["Attribution", "attribution_from_cgroup", "read_attribution"]

_SHORT_ID = 12


@dataclass(frozen=True)
class Attribution:
    """Where a process runs. Empty strings for what is not known."""

    container: str = ""  # container id, 12 hex digits like `docker ps`
    runtime: str = ""  # 'docker', 'containerd', 'cri-o', 'podman'; '' when the path does not say
    pod_uid: str = ""  # Kubernetes pod UID, with dashes
    pod: str = ""  # Kubernetes pod name (from the environment only)
    namespace: str = ""  # Kubernetes namespace (from the environment or the service account)
    slurm_job: str = ""  # Slurm job id


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
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key in _ENV_KEYS:
            env[key.decode("ascii")] = value.decode("utf-8", "replace")
    return env


_ENV_KEYS = frozenset({b"HOSTNAME", b"KUBERNETES_SERVICE_HOST", b"POD_NAME", b"POD_NAMESPACE",
                       b"SLURM_JOB_ID", b"SLURM_JOBID"})
_SA_NAMESPACE = "var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
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


def read_attribution(pid: int, proc_root: str = "/proc") -> Attribution:
    """Attribution of process `pid`: cgroup path first, then its environment, best effort.

    The pod name comes from POD_NAME (downward API) or, inside Kubernetes only, HOSTNAME; the
    namespace from POD_NAMESPACE or the pod's service-account mount. Unreadable files (another user's
    process without root, a pid that is gone) give empty fields, never an exception.
    """
    try:
        base = os.path.join(proc_root, str(int(pid)))
        data = _read(os.path.join(base, "cgroup"))
        result = attribution_from_cgroup(data.decode("utf-8", "replace")) if data else Attribution()

        raw_env = _read(os.path.join(base, "environ"))
        env = _environ(raw_env) if raw_env else {}
        in_k8s = bool(result.pod_uid) or "KUBERNETES_SERVICE_HOST" in env
        pod = env.get("POD_NAME", "") or (env.get("HOSTNAME", "") if "KUBERNETES_SERVICE_HOST" in env else "")
        namespace = env.get("POD_NAMESPACE", "")
        if in_k8s and not namespace:
            ns = _read_in_root(os.path.join(base, "root"), _SA_NAMESPACE)
            namespace = ns.decode("utf-8", "replace").strip() if ns else ""
        slurm_job = env.get("SLURM_JOB_ID", "") or env.get("SLURM_JOBID", "")
        return _merge(result, Attribution(pod=pod, namespace=namespace, slurm_job=slurm_job))
    except Exception:
        return Attribution()
