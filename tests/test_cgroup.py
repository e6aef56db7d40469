import os

import pytest

from gpuscope._cgroup import Attribution, attribution_from_cgroup, read_attribution

CID = "3f4e2b1a9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f"
SHORT = CID[:12]
UID = "0a1b2c3d-4e5f-6789-abcd-ef0123456789"
UID_ = UID.replace("-", "_")

V1_DOCKER = f"""\
12:memory:/docker/{CID}
11:cpu,cpuacct:/docker/{CID}
1:name=systemd:/docker/{CID}
0::/
"""

V1_K8S_CGROUPFS = f"""\
12:memory:/kubepods/burstable/pod{UID}/{CID}
11:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}
0::/
"""

V2_K8S_SYSTEMD_CONTAINERD = (
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
    f"cri-containerd-{CID}.scope\n"
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (V1_DOCKER, Attribution(container=SHORT, runtime="docker")),
        (f"0::/system.slice/docker-{CID}.scope\n", Attribution(container=SHORT, runtime="docker")),
        (V1_K8S_CGROUPFS, Attribution(container=SHORT, pod_uid=UID)),
        (V2_K8S_SYSTEMD_CONTAINERD, Attribution(container=SHORT, runtime="containerd", pod_uid=UID)),
        # guaranteed QoS pods have no QoS level in the path
        (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
         Attribution(container=SHORT, runtime="containerd", pod_uid=UID)),
        (f"0::/kubepods/pod{UID}/{CID}\n", Attribution(container=SHORT, pod_uid=UID)),
        (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope\n",
         Attribution(container=SHORT, runtime="cri-o", pod_uid=UID)),
        (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/docker-{CID}.scope\n",
         Attribution(container=SHORT, runtime="docker", pod_uid=UID)),
        (f"0::/system.slice/containerd.service/kubepods-burstable-pod{UID_}.slice:cri-containerd:{CID}\n",
         Attribution(container=SHORT, runtime="containerd", pod_uid=UID)),
        (f"0::/machine.slice/libpod-{CID}.scope/container\n", Attribution(container=SHORT, runtime="podman")),
        (f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{CID}.scope\n",
         Attribution(container=SHORT, runtime="podman")),
        (f"0::/system.slice/crio-{CID}.scope\n", Attribution(container=SHORT, runtime="cri-o")),
        (f"0::/default/{CID}\n", Attribution()),  # a bare id outside kubepods says nothing certain
        ("4:cpuset:/slurm/uid_1000/job_123/step_0/task_0\n0::/\n", Attribution(slurm_job="123")),
        ("0::/system.slice/slurmstepd.scope/job_4567/step_batch/user/task_0\n", Attribution(slurm_job="4567")),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", Attribution()),
        ("0::/\n", Attribution()),
        ("", Attribution()),
    ],
)
def test_attribution_from_cgroup(text, expected):
    assert attribution_from_cgroup(text) == expected


def test_monitor_scopes_are_not_containers():
    # conmon is the runtime's monitor process, not the container.
    assert attribution_from_cgroup(f"0::/machine.slice/libpod-conmon-{CID}.scope\n") == Attribution()
    assert attribution_from_cgroup(f"0::/system.slice/crio-conmon-{CID}.scope\n") == Attribution()


def test_v1_lines_fill_what_the_unified_line_lacks():
    text = f"0::/init.scope\n4:cpuset:/slurm/uid_1/job_9/step_0\n3:memory:/docker/{CID}\n"
    assert attribution_from_cgroup(text) == Attribution(container=SHORT, runtime="docker", slurm_job="9")


@pytest.mark.parametrize("junk", ["garbage", "::::", "\x00\x01", "1:2", None])
def test_attribution_from_cgroup_never_raises(junk):
    assert attribution_from_cgroup(junk) == Attribution()


def _fake_proc(root, pid, cgroup=None, environ=None):
    d = root / str(pid)
    d.mkdir(parents=True)
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)
    if environ is not None:
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in environ.items()) + b"\0")
    return d


def test_read_attribution_pod_from_cgroup_and_environ(tmp_path):
    _fake_proc(tmp_path, 42, V2_K8S_SYSTEMD_CONTAINERD, {
        "PATH": "/usr/bin", "HOSTNAME": "trainer-7c9d-xk2p", "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "POD_NAMESPACE": "ml-team", "LD_LIBRARY_PATH": "/x=y",
    })
    att = read_attribution(42, proc_root=str(tmp_path))
    assert att == Attribution(container=SHORT, runtime="containerd", pod_uid=UID, pod="trainer-7c9d-xk2p",
                              namespace="ml-team")


def test_read_attribution_pod_name_env_wins_over_hostname(tmp_path):
    _fake_proc(tmp_path, 42, V1_K8S_CGROUPFS, {"HOSTNAME": "h", "KUBERNETES_SERVICE_HOST": "x",
                                              "POD_NAME": "real-pod"})
    assert read_attribution(42, proc_root=str(tmp_path)).pod == "real-pod"


def test_read_attribution_hostname_outside_kubernetes_is_not_a_pod(tmp_path):
    _fake_proc(tmp_path, 42, V1_DOCKER, {"HOSTNAME": "3f4e2b1a9c8d"})
    att = read_attribution(42, proc_root=str(tmp_path))
    assert att == Attribution(container=SHORT, runtime="docker")


def test_read_attribution_namespace_from_service_account(tmp_path):
    d = _fake_proc(tmp_path, 42, V1_K8S_CGROUPFS, {"KUBERNETES_SERVICE_HOST": "x", "HOSTNAME": "p"})
    sa = d / "root/var/run/secrets/kubernetes.io/serviceaccount"
    sa.mkdir(parents=True)
    (sa / "namespace").write_text("inference\n")
    assert read_attribution(42, proc_root=str(tmp_path)).namespace == "inference"


def test_the_service_account_namespace_is_read_inside_the_processs_root_through_its_absolute_links(tmp_path):
    """An image whose /var/run is a link to /run (most are): the kernel would resolve that absolute link
    against the agent's root, i.e. read the agent's own pod's namespace (or none). It is resolved inside
    the process's root, relative links and '..' too, and a loop of links ends in no namespace."""
    d = _fake_proc(tmp_path / "proc", 42, V1_K8S_CGROUPFS, {"KUBERNETES_SERVICE_HOST": "x", "HOSTNAME": "p"})
    root = d / "root"
    sa = root / "run/secrets/kubernetes.io/serviceaccount"
    sa.mkdir(parents=True)
    (sa / "namespace").write_text("team-a\n")
    (root / "var").mkdir()
    (root / "var/run").symlink_to("/run")  # absolute, as in the image
    assert read_attribution(42, proc_root=str(tmp_path / "proc")).namespace == "team-a"
    (root / "var/run").unlink()
    (root / "var/run").symlink_to("../run")  # relative
    assert read_attribution(42, proc_root=str(tmp_path / "proc")).namespace == "team-a"
    (root / "var/run").unlink()
    (root / "var/run").symlink_to("/var/run")  # a loop
    assert read_attribution(42, proc_root=str(tmp_path / "proc")).namespace == ""


def test_read_attribution_slurm_env_fills_in(tmp_path):
    _fake_proc(tmp_path, 7, "0::/user.slice\n", {"SLURM_JOB_ID": "31337", "SLURM_PROCID": "0"})
    assert read_attribution(7, proc_root=str(tmp_path)) == Attribution(slurm_job="31337")
    # the cgroup path is the authority when both are there
    _fake_proc(tmp_path, 8, "0::/system.slice/slurmstepd.scope/job_5/step_0\n", {"SLURM_JOB_ID": "6"})
    assert read_attribution(8, proc_root=str(tmp_path)).slurm_job == "5"


def test_read_attribution_missing_or_unreadable(tmp_path):
    assert read_attribution(12345, proc_root=str(tmp_path)) == Attribution()
    _fake_proc(tmp_path, 9, V1_DOCKER)  # no environ file
    assert read_attribution(9, proc_root=str(tmp_path)) == Attribution(container=SHORT, runtime="docker")
    d = _fake_proc(tmp_path, 10, None, {"SLURM_JOB_ID": "1"})
    (d / "cgroup").mkdir()  # reading a directory fails like a permission error would
    assert read_attribution(10, proc_root=str(tmp_path)) == Attribution(slurm_job="1")
    assert read_attribution("not a pid", proc_root=str(tmp_path)) == Attribution()  # type: ignore[arg-type]


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read every file")
def test_read_attribution_permission_denied(tmp_path):
    d = _fake_proc(tmp_path, 11, V1_DOCKER, {"SLURM_JOB_ID": "1"})
    (d / "environ").chmod(0)
    assert read_attribution(11, proc_root=str(tmp_path)) == Attribution(container=SHORT, runtime="docker")


def test_read_attribution_of_this_process_does_not_raise():
    assert isinstance(read_attribution(os.getpid()), Attribution)
