"""The kubelet's PodResources API client against a real gRPC server on a unix socket (the generated servicer
of the official proto), the join of its answer with the processes' cgroups, and the allocation states.

No kubelet runs here: tests/kubelet_server.py serves the kubelet's messages, slow or refusing Get as a
kubelet can, and a raw socket answers bytes that are not gRPC. Waits poll what the client records, with a
generous deadline; no assertion is on wall-clock time.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from host_fakes import FakeHostReader

pytest.importorskip("grpc")
from kubelet_server import JunkServer, Kubelet  # noqa: E402

from gpuscope import Sampler, SamplerConfig  # noqa: E402
from gpuscope._hostproc import HostProcInfo  # noqa: E402
from gpuscope._records import GpuIdentity, GpuRecord, PodRef, ProcessRecord  # noqa: E402
from gpuscope.sources import podresources  # noqa: E402
from gpuscope.sources.podresources import Allocations, KubeletPods, allocations_from, gpu_of  # noqa: E402
from gpuscope.sources.pods import PodJoin, state_of  # noqa: E402
from gpuscope.testing import mig_gpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPU0, GPU1 = "GPU-5171a7ed-0000-4000-8000-000000000000", "GPU-5171a7ed-0000-4000-8000-000000000001"
DEVICES = {GPU0: "0", GPU1: "1", "MIG-5171a7ed-0000-4000-8000-000000000002-1": "2/mig1"}


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short directory: a unix socket path must fit in 108 bytes, pytest's tmp_path may not."""
    d = Path(tempfile.mkdtemp(prefix="k8s", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelets() -> Iterator[Callable[..., Kubelet]]:
    made: list[Kubelet] = []

    def make(path: Path, pods: list | None = None, **kw: object) -> Kubelet:
        k = Kubelet(path, pods, **kw).start()
        made.append(k)
        return k

    yield make
    for k in made:
        k.stop()


@pytest.fixture
def clients() -> Iterator[Callable[..., KubeletPods]]:
    made: list[KubeletPods] = []

    def make(path: Path, devices: dict[str, str] | None = None, **kw: object) -> KubeletPods:
        c = KubeletPods(str(path), **{"interval_s": 0.5, "timeout_s": 0.5, **kw})
        c.start(DEVICES if devices is None else devices)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def until(ok: Callable[[], object], what: str, timeout: float = 20.0) -> object:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        v = ok()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


NODE = [
    ("ml", "train-0", [("trainer", "nvidia.com/gpu", [GPU0])]),
    # time-slicing: two replicas of GPU 1, to two pods
    ("serve", "infer-a", [("server", "nvidia.com/gpu.shared", [GPU1 + "::0"])]),
    ("serve", "infer-b", [("server", "nvidia.com/gpu.shared", [GPU1 + "::1"])]),
    ("ml", "mig-job", [("worker", "nvidia.com/mig-1g.18gb", ["MIG-5171a7ed-0000-4000-8000-000000000002-1"])]),
    # a device id NVML does not know, and a resource that is no GPU at all
    ("x", "ghost", [("c", "nvidia.com/gpu", ["GPU-deadbeef-0000-0000-0000-000000000000"])]),
    ("net", "sriov", [("c", "intel.com/sriov", ["0000:3b:02.1"])]),
    ("kube-system", "coredns", []),
]


# ---- device ids ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device_id, label", [
    (GPU0, "0"),
    (GPU0.upper().replace("GPU-", "GPU-"), "0"),  # NVML's UUIDs are lower-case hex; compare without case
    (GPU1 + "::3", "1"),  # NVIDIA's device plugin: replica 3 of a shared GPU
    ("MIG-5171a7ed-0000-4000-8000-000000000002-1", "2/mig1"),
    ("MIG-GPU-5171a7ed-0000-4000-8000-000000000000/1/0", "0/mig1"),  # drivers before R470 (if NVML lists 0/mig1)
    ("nvidia1", "1"),  # GKE's device plugin
    ("nvidia2/gi1", "2/mig1"),
    ("nvidia1/vgpu0", "1"),
    ("GPU-deadbeef-0000-0000-0000-000000000000", None),
    ("nvidia9", None),
    ("", None),
])
def test_device_ids_name_the_gpu_nvml_lists(device_id, label):
    by_uuid = {k.lower(): v for k, v in DEVICES.items()}
    labels = frozenset({*DEVICES.values(), "0/mig1"})
    assert gpu_of(device_id, by_uuid, labels) == label


def test_allocations_from_an_answer():
    raw = [(ns, pod, tuple((c, r, tuple(ids)) for c, r, ids in cs)) for ns, pod, cs in NODE]
    a = allocations_from(raw, {k.lower(): v for k, v in DEVICES.items()}, at=1.0)
    assert a.by_gpu == {
        "0": (PodRef("ml", "train-0", "trainer"),),
        "1": (PodRef("serve", "infer-a", "server"), PodRef("serve", "infer-b", "server")),
        "2/mig1": (PodRef("ml", "mig-job", "worker"),),
    }
    assert a.pods == len(NODE)
    assert a.unknown == ("GPU-deadbeef-0000-0000-0000-000000000000",)  # the SR-IOV function is no GPU


# ---- the client against a real gRPC server -----------------------------------------------------------


def test_list_from_a_real_server(sockdir, kubelets, clients):
    k = kubelets(sockdir / "kubelet.sock", NODE)
    c = clients(k.path)
    a = until(c.allocations, "the first answer")
    assert a.by_gpu["0"] == (PodRef("ml", "train-0", "trainer"),)
    assert set(a.by_gpu["1"]) == {PodRef("serve", "infer-a", "server"), PodRef("serve", "infer-b", "server")}
    assert a.by_gpu["2/mig1"] == (PodRef("ml", "mig-job", "worker"),)
    st = c.stats()
    assert st["state"] == "ok" and st["error"] == ""
    assert st["pods"] == len(NODE) and st["gpus_held"] == ["0", "1", "2/mig1"]
    assert st["unknown_device_ids"] == ["GPU-deadbeef-0000-0000-0000-000000000000"]
    assert sum(st["failures"].values()) == 0 and st["requests"] >= 1 and k.lists >= 1
    m = c.self_metrics()
    assert m["gpuscope_kubelet_up"] == 1.0 and m['gpuscope_kubelet_failures_total{reason="timeout"}'] == 0.0


def test_a_pod_that_ends_between_refreshes_loses_its_gpu(sockdir, kubelets, clients):
    k = kubelets(sockdir / "kubelet.sock", NODE)
    c = clients(k.path)
    until(lambda: (a := c.allocations()) and "0" in a.by_gpu, "train-0 on GPU 0")
    lists = k.lists
    k.pods = [p for p in NODE if p[1] != "train-0"]
    a = until(lambda: (a := c.allocations()) and "0" not in a.by_gpu and a, "the next refresh")
    assert k.lists > lists
    assert "1" in a.by_gpu and a.pods == len(NODE) - 1


def test_missing_socket_is_one_line_and_recovers(sockdir, kubelets, clients, caplog):
    caplog.set_level(logging.INFO, logger="gpuscope.kubernetes")
    path = sockdir / "kubelet.sock"
    c = clients(path)
    until(lambda: c.failures["missing"] >= 3, "three failed refreshes")
    assert c.allocations() is None
    st = c.stats()
    assert st["state"] == "failing" and "does not exist" in st["error"] and str(path) in st["error"]
    assert c.self_metrics()["gpuscope_kubelet_up"] == 0.0
    warnings = [r for r in caplog.records if r.name == "gpuscope.kubernetes" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # one line, however many retries
    assert "does not exist" in warnings[0].getMessage()

    kubelets(path, NODE)  # the kubelet comes up
    until(c.allocations, "the first answer after the socket appeared")
    assert c.stats()["state"] == "ok"
    back = [r for r in caplog.records if r.name == "gpuscope.kubernetes" and "answers again" in r.getMessage()]
    assert len(back) == 1
    missing = c.failures["missing"]
    until(lambda: c.requests >= 3 + missing, "two more refreshes")
    assert c.failures["missing"] == missing  # nothing failed once it answered


def test_slow_socket_times_out_and_keeps_the_last_answer(sockdir, kubelets, clients, caplog):
    caplog.set_level(logging.INFO, logger="gpuscope.kubernetes")
    k = kubelets(sockdir / "kubelet.sock", NODE)
    c = clients(k.path, timeout_s=0.3)
    first = until(c.allocations, "the first answer")
    k.delay_s = 5.0  # past the deadline
    until(lambda: c.failures["timeout"] >= 2, "two timed-out refreshes")
    assert c.allocations() is first  # what the kubelet last said still holds
    st = c.stats()
    assert st["state"] == "failing" and "did not answer within 0.3 s" in st["error"]
    assert st["slowest_call_s"] >= 0.3  # the client gave up at its deadline, not at the server's 5 s
    assert st["slowest_call_s"] < 5.0
    warnings = [r.getMessage() for r in caplog.records if r.name == "gpuscope.kubernetes" and "until it answers" in r.getMessage()]
    assert len(warnings) == 1 and "the pods of its last answer stand" in warnings[0]
    k.delay_s = 0.0
    until(lambda: c.stats()["state"] == "ok", "the answer after the kubelet is fast again")


def test_garbage_from_the_socket_is_counted_as_malformed(sockdir, clients):
    junk = JunkServer(sockdir / "kubelet.sock").start()
    try:
        c = clients(junk.path)
        until(lambda: c.failures["malformed"] >= 2, "two malformed answers")
        assert junk.connections >= 1
        assert c.allocations() is None
        assert "not the PodResources API" in c.stats()["error"]
    finally:
        junk.stop()


def test_bytes_that_are_not_the_message_are_malformed(sockdir, clients):
    """A gRPC server that answers List with bytes no ListPodResourcesResponse can be parsed from."""
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
        "List": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"\xff\xff\xff\xff\x0f")})
    server.add_generic_rpc_handlers((handler,))
    path = sockdir / "kubelet.sock"
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        c = clients(path)
        until(lambda: c.failures["malformed"] >= 1, "a malformed answer")
        assert c.allocations() is None
    finally:
        server.stop(None).wait(5)


def test_a_file_that_is_no_socket(sockdir, clients):
    path = sockdir / "kubelet.sock"
    path.write_text("not a socket")
    c = clients(path)
    until(lambda: c.failures["not_a_socket"] >= 1, "a refusal")
    assert "is not a socket" in c.stats()["error"]


def test_get_asks_for_a_new_pod_at_once(sockdir, kubelets, clients):
    k = kubelets(sockdir / "kubelet.sock", NODE[:1])
    c = clients(k.path, interval_s=30.0)  # no List again within the test
    until(c.allocations, "the first answer")
    k.pods = NODE[:1] + [("ml", "late", [("w", "nvidia.com/gpu", [GPU1])])]
    c.hint("uid-late", "ml", "late")
    a = until(lambda: (a := c.allocations()) and "1" in a.by_gpu and a, "the pod from Get")
    assert a.by_gpu["1"] == (PodRef("ml", "late", "w"),)
    assert k.gets == [("ml", "late")] and k.lists == 1
    assert c.stats()["get"] == "supported"
    c.hint("uid-late", "ml", "late")  # the same pod again within the interval: not asked again
    c.hint("uid-gone", "ml", "gone")  # a pod the kubelet does not have: nothing breaks
    until(lambda: ("ml", "gone") in k.gets, "the Get for the missing pod")
    assert k.gets.count(("ml", "late")) == 1 and c.stats()["state"] == "ok"


@pytest.mark.parametrize("get", ["disabled", "unimplemented"])
def test_without_get_a_new_pod_is_found_by_list(sockdir, kubelets, clients, get):
    k = kubelets(sockdir / "kubelet.sock", NODE[:1], get=get)
    c = clients(k.path, interval_s=30.0)
    until(c.allocations, "the first answer")
    k.pods = NODE[:1] + [("ml", "late", [("w", "nvidia.com/gpu", [GPU1])])]
    c.hint("uid-late", "ml", "late")
    until(lambda: (a := c.allocations()) and "1" in a.by_gpu, "the pod from List")
    assert c.stats()["get"] == "not supported" and k.lists == 2
    assert sum(c.failures.values()) == 0  # a kubelet without Get is no failure
    c.hint("uid-other", "ml", "other")  # from now on straight to List
    until(lambda: k.lists == 3, "a List for the next pod")


def test_a_hint_without_a_name_lists_again(sockdir, kubelets, clients):
    k = kubelets(sockdir / "kubelet.sock", NODE[:1])
    c = clients(k.path, interval_s=30.0)
    until(c.allocations, "the first answer")
    c.hint("uid-only")
    until(lambda: k.lists == 2, "the early List")
    assert k.gets == []


def test_missing_packages_is_a_sentence(monkeypatch):
    assert podresources.missing_packages() is None
    monkeypatch.setitem(sys.modules, "grpc", None)  # `import grpc` now raises ImportError
    why = podresources.missing_packages()
    assert why is not None and "pip install 'gpuscope[kubernetes]'" in why and "\n" not in why


def test_generated_code_matches_the_proto(tmp_path):
    """The checked-in modules are what grpcio-tools makes from the checked-in proto."""
    pytest.importorskip("grpc_tools")
    pkg = Path("gpuscope/sources/_podresources")
    src = ROOT / "src" / pkg
    (tmp_path / pkg).mkdir(parents=True)
    shutil.copy(src / "api.proto", tmp_path / pkg / "api.proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_path}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(pkg / "api.proto")],
                   cwd=tmp_path, check=True)
    for name in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"):
        assert (tmp_path / pkg / name).read_text() == (src / name).read_text(), f"{name}: regenerate it"
    proto = (src / "api.proto").read_text()
    assert "Licensed under the Apache License, Version 2.0" in proto and "63b3249724f7d89a" in proto
    assert "service PodResourcesLister" in proto and "rpc Get(GetPodResourcesRequest)" in proto


# ---- the join and the states -------------------------------------------------------------------------


class Answer:
    """A PodSource whose answer the test sets."""

    def __init__(self, by_gpu: dict[str, tuple[PodRef, ...]] | None = None) -> None:
        self.answer = None if by_gpu is None else Allocations(by_gpu, len(by_gpu), (), 0.0)
        self.hints: list[tuple[str, str, str]] = []

    def start(self, devices): self.devices = devices  # noqa: E704
    def allocations(self): return self.answer  # noqa: E704
    def hint(self, key, namespace="", pod=""): self.hints.append((key, namespace, pod))  # noqa: E704
    def stop(self): pass  # noqa: E704


def proc(pid: int, gpu: str, pod_uid: str = "", pod: str = "", namespace: str = "", visible: bool = True,
         container: str = "") -> ProcessRecord:
    return ProcessRecord(pid, gpu, "GPU-x", "compute", pod_uid=pod_uid, pod=pod, namespace=namespace,
                         host_visible=visible, container=container)


def gpu(label: str, sm: float | None = 0.0, util: float | None = 0.0, healthy: bool = True,
        mig: bool = False) -> GpuRecord:
    values = {k: v for k, v in (("gpu_sm_active_ratio", sm), ("gpu_utilization_ratio", util)) if v is not None}
    return GpuRecord(GpuIdentity(int(label), f"GPU-{label}", "H200", mig_mode=mig), 0, values, healthy)


A, B = PodRef("ml", "train-0", "trainer"), PodRef("serve", "infer-b", "server")


def test_a_pod_process_gets_the_kubelets_names():
    j = PodJoin(Answer({"0": (A,)}))
    p = proc(1, "0", pod_uid="u1", container="abcdef123456")
    j.attribute(p)
    assert (p.namespace, p.pod, p.container) == ("ml", "train-0", "trainer")
    host = proc(2, "0")  # in no pod's cgroup: the GPU's holder is not its pod
    j.attribute(host)
    assert (host.namespace, host.pod, host.container) == ("", "", "")


def test_a_shared_gpu_picks_the_pod_by_name_or_by_a_uid_learnt_elsewhere():
    src = Answer({"0": (A,), "1": (A, B)})
    j = PodJoin(src)
    anon = proc(1, "1", pod_uid="ub")
    j.attribute(anon)
    assert anon.pod == "" and src.hints == []  # two pods hold GPU 1: not guessed, and nothing to ask
    named = proc(2, "1", pod_uid="ub", pod="infer-b", namespace="serve")
    j.attribute(named)
    assert (named.namespace, named.pod, named.container) == ("serve", "infer-b", "server")
    again = proc(3, "1", pod_uid="ub")  # the uid was learnt from the named process
    j.attribute(again)
    assert again.pod == "infer-b"
    on0 = proc(4, "0", pod_uid="ua")  # GPU 0's one holder: and now GPU 1 knows ua too
    j.attribute(on0)
    shared = proc(5, "1", pod_uid="ua")
    j.attribute(shared)
    assert (shared.namespace, shared.pod) == ("ml", "train-0")


def test_a_pod_the_answer_lacks_asks_again():
    src = Answer({"0": (A,)})
    j = PodJoin(src)
    p = proc(1, "3", pod_uid="u-new", pod="late", namespace="ml")
    j.attribute(p)
    assert src.hints == [("u-new", "ml", "late")] and p.pod == "late"  # the environment's names stay
    wrong = proc(2, "0", pod_uid="u-other", pod="other", namespace="ml")  # named, but not GPU 0's holder
    j.attribute(wrong)
    assert wrong.pod == "other" and src.hints[-1] == ("u-other", "ml", "other")


def test_two_containers_of_one_pod_keep_the_runtime_id():
    j = PodJoin(Answer({"0": (PodRef("ml", "p", "a"), PodRef("ml", "p", "b"))}))
    p = proc(1, "0", pod_uid="u", container="abcdef123456")
    j.attribute(p)
    assert (p.namespace, p.pod, p.container) == ("ml", "p", "abcdef123456")


def test_states():
    clock = [100.0]
    j = PodJoin(Answer({"0": (A,), "1": (A,), "4": (A,)}), hold_s=30.0, clock=lambda: clock[0])
    gpus = [gpu("0", sm=0.9), gpu("1", sm=0.0, util=0.0), gpu("2"), gpu("3"), gpu("4", sm=None, util=None),
            gpu("5"), gpu("6", healthy=False), gpu("7", mig=True)]
    procs = [proc(1, "0", pod_uid="ua"), proc(2, "1", pod_uid="ua"), proc(3, "3"), proc(4, "4", pod_uid="ua"),
             proc(5, "5", visible=False)]
    j.annotate(gpus, procs)
    states = {g.identity.label: state_of(g.values) for g in gpus}
    assert states == {"0": "in_use_by_pod", "1": "allocated_idle", "2": "unallocated",
                      "3": "in_use_outside_kubernetes",
                      "4": "in_use_by_pod",  # no activity measured, a process runs: in use
                      "5": "in_use_outside_kubernetes",  # a pid we cannot see on a GPU no pod holds
                      "6": None, "7": None}  # lost; MIG-enabled (its instances have their states)
    for g in gpus[:6]:
        assert sum(v for k, v in g.values.items() if k.startswith("gpu_allocation_state")) == 1.0
    assert gpus[0].allocated_to == [A] and gpus[2].allocated_to == []
    # Busy, then idle: in use for hold_s more, then allocated but idle.
    for t, expect in ((110.0, "in_use_by_pod"), (129.0, "in_use_by_pod"), (131.0, "allocated_idle")):
        clock[0] = t
        g = [gpu("0", sm=0.0)]
        j.annotate(g, procs)
        assert state_of(g[0].values) == expect, t


def test_no_answer_no_state():
    j = PodJoin(Answer(None))
    g = [gpu("0", sm=0.9)]
    p = proc(1, "0", pod_uid="u")
    j.attribute(p)
    j.annotate(g, [p])
    assert state_of(g[0].values) is None and g[0].allocated_to == [] and p.pod == ""


def test_mig_instances_from_a_real_server(sockdir, kubelets):
    """A MIG GPU: the kubelet gives MIG UUIDs; each instance's series and processes name their pod."""
    k = kubelets(sockdir / "kubelet.sock", [
        ("ml", "mig-a", [("w", "nvidia.com/mig-3g.71gb", ["MIG-fake0000-0000-0000-0000-000000000000-1"])])])
    pods = KubeletPods(str(k.path), interval_s=0.5, timeout_s=0.5)
    host = FakeHostReader({
        20_001: HostProcInfo(20_001, "python", pod_uid="5171a7ed-0000-4000-8000-00000000000a", container="c1"),
        20_002: HostProcInfo(20_002, "python", pod_uid="5171a7ed-0000-4000-8000-00000000000b", container="c2")})
    s = Sampler(SamplerConfig(interval=0.01, processes=0.01, collect_host=False, events=False), nvml=mig_gpu(),
                host_reader=host, pods=pods)
    try:
        s.sample_once()
        until(pods.allocations, "the first answer")
        snap = until(lambda: (sn := s.sample_once()) and any(r.pod for r in sn.processes) and sn,
                     "a snapshot whose processes were read after the answer")
        by = {g.identity.label: g for g in snap.gpus}
        assert by["0/mig1"].allocated_to == [PodRef("ml", "mig-a", "w")] and by["0/mig2"].allocated_to == []
        assert state_of(by["0"].values) is None  # the MIG-enabled GPU itself
        assert state_of(by["0/mig1"].values) == "in_use_by_pod"
        assert state_of(by["0/mig2"].values) == "in_use_by_pod"  # a pod's process, on an instance no pod asked for
        p = {r.pid: r for r in snap.processes}
        assert (p[20_001].gpu, p[20_001].namespace, p[20_001].pod, p[20_001].container) == ("0/mig1", "ml", "mig-a", "w")
        assert (p[20_002].pod, p[20_002].container) == ("", "c2")
    finally:
        s.stop()
    assert pods._thread is None  # the sampler stopped its pod source


def test_the_views_show_the_state_and_nothing_outside_kubernetes():
    from gpuscope import viewmodel
    from gpuscope._records import Snapshot
    from gpuscope.top import model

    j = PodJoin(Answer({"0": (PodRef("nb", "lab", "notebook"),)}))
    gpus = [gpu("0"), gpu("1")]
    j.annotate(gpus, [proc(1, "0", pod_uid="u"), proc(2, "1")])
    ov = viewmodel.from_snapshot(Snapshot(0, gpus, [], None, [], hostname="n"), with_ppid=False)
    g0, g1 = ov["gpus"]
    assert g0["allocation"] == {"state": "allocated_idle",
                                "pods": [{"namespace": "nb", "pod": "lab", "container": "notebook"}]}
    assert g1["allocation"] == {"state": "in_use_outside_kubernetes", "pods": []}
    assert model.dense_line(g0, 200).endswith("k8s: allocated, idle: nb/lab")
    assert "[k8s: in use outside Kubernetes]" in model.panel_lines(g1, 200, [])[0]
    plain = viewmodel.from_snapshot(Snapshot(0, [gpu("0")], [], None, [], hostname="n"), with_ppid=False)["gpus"][0]
    assert plain["allocation"] is None and model.allocation_text(plain) == ""
    assert "k8s" not in model.dense_line(plain, 200) + "".join(model.panel_lines(plain, 200, []))


def test_the_kubernetes_config_section(tmp_path):
    from gpuscope.agent import config as agent_config

    assert agent_config.Config().kubernetes.pod_resources_socket == "auto"
    f = tmp_path / "agent.toml"
    f.write_text('[kubernetes]\npod_resources_socket = "sock/kubelet.sock"\npod_resources_interval = "5s"\n')
    k = agent_config.load(f).kubernetes
    assert k.pod_resources_socket == str(tmp_path / "sock/kubelet.sock")  # relative to the file, as its others
    assert (k.pod_resources_interval, k.pod_resources_timeout) == (5.0, 2.0)
    for body, words in (('pod_resources_socket = 5', "must be a string"),
                        ('pod_resources_interval = "100ms"', "at least 500ms"),
                        ('pod_resources_timeout = "soon"', "must be a duration"),
                        ('pod_resource_socket = "x"', "did you mean")):
        f.write_text(f"[kubernetes]\n{body}\n")
        with pytest.raises(agent_config.ConfigError) as e:
            agent_config.load(f)
        assert words in str(e.value) and "[kubernetes]" in str(e.value) and "\n" not in str(e.value), str(e.value)
