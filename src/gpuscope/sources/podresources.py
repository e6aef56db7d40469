"""Which pod holds which GPU, from the kubelet's PodResources API (gRPC over its unix socket).

The kubelet answers `List` with every pod on the node and, per container, the devices the device plugins
gave it: for NVIDIA's plugin the resource `nvidia.com/gpu` (or `nvidia.com/mig-1g.10gb`, `nvidia.com/gpu.shared`)
and device ids that are GPU UUIDs (`GPU-…`), MIG UUIDs (`MIG-…`), or replicas of one GPU when it is shared by
time-slicing or MPS (`GPU-…::3`). `Get` answers for one pod (kubelet 1.27+ behind a feature gate, on by
default from 1.34); it is used to learn a new pod at once, and List is asked again where the kubelet lacks it.

The sampler never waits on the socket: `KubeletPods` asks from its own thread, every `interval_s` and
with a `timeout_s` deadline, and the sampler reads the last answer. A failing socket keeps the last
answer (the pods seldom change while a kubelet restarts), logs one line when it starts failing and one when
it recovers, and counts each failure by reason in `stats()`.

    pods = KubeletPods("/var/lib/kubelet/pod-resources/kubelet.sock")
    pods.start({"GPU-5171a7ed-…": "0"})        # the node's GPUs: UUID -> gpu label
    pods.allocations()                         # None until the kubelet has answered once
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._records import PodRef

log = logging.getLogger("gpuscope.kubernetes")

#: Where the kubelet serves the API (its --pod-resources-directory is fixed at this path).
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
#: The kubelet's own gRPC limit for this API is 16 MiB (gRPC's default, 4 MiB, is too small for a large node).
MAX_MESSAGE_BYTES = 16 * 2**20
#: Why a request failed, as counted in stats()["failures"].
REASONS = ("missing", "not_a_socket", "permission", "refused", "timeout", "malformed", "unavailable", "error")

# (namespace, pod, ((container, resource, device ids), ...)): an answer, free of protobuf types.
RawPod = tuple[str, str, tuple[tuple[str, str, tuple[str, ...]], ...]]

_REPLICA = re.compile(r"::\d+$")  # NVIDIA's device plugin, a shared GPU's replica: GPU-<uuid>::3
_OLD_MIG = re.compile(r"^MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/\d+$")  # drivers before R470: MIG-GPU-<uuid>/<gi>/<ci>
_GKE = re.compile(r"^nvidia(\d+)(?:/gi(\d+))?(?:/vgpu\d+)?$")  # GKE's plugin: nvidia0, nvidia0/gi2, nvidia0/vgpu1
_MAX_UNKNOWN = 16


def missing_packages() -> str | None:
    """None when the gRPC client can run here, else one sentence saying what to install."""
    try:
        import grpc  # noqa: F401

        from ._podresources import api_pb2, api_pb2_grpc  # noqa: F401
    except ImportError as e:
        return (f"reading pods from the kubelet needs the grpcio and protobuf packages ({e}); install them "
                "with pip install 'gpuscope[kubernetes]'")
    except Exception as e:  # noqa: BLE001 - the generated code refuses a grpcio or protobuf too old for it
        return (f"reading pods from the kubelet needs newer grpcio and protobuf packages ({e}); upgrade them "
                "with pip install -U 'gpuscope[kubernetes]'")
    return None


def gpu_of(device_id: str, by_uuid: Mapping[str, str], labels: frozenset[str]) -> str | None:
    """The gpu label a kubelet device id names, or None for a device this node's NVML does not list.

    >>> gpu_of("GPU-ab::2", {"gpu-ab": "0"}, frozenset({"0"})), gpu_of("nvidia1/gi3", {}, frozenset({"1/mig3"}))
    ('0', '1/mig3')
    """
    d = _REPLICA.sub("", device_id.strip())
    label = by_uuid.get(d.lower())
    if label is not None:
        return label
    m = _OLD_MIG.match(d)
    if m is not None:
        parent = by_uuid.get(m.group(1).lower())
        label = f"{parent}/mig{m.group(2)}" if parent is not None else None
    elif (m := _GKE.match(d)) is not None:
        label = m.group(1) if m.group(2) is None else f"{m.group(1)}/mig{m.group(2)}"
    return label if label in labels else None


@dataclass(frozen=True)
class Allocations:
    """One answer of the kubelet, joined with the node's GPUs."""

    by_gpu: dict[str, tuple[PodRef, ...]]  # gpu label -> the pods' containers holding it, sorted
    pods: int  # pods in the answer (with or without GPUs)
    unknown: tuple[str, ...]  # NVIDIA device ids in the answer that no GPU of this node has
    at: float  # monotonic seconds when it was answered


def allocations_from(raw: Iterable[RawPod], by_uuid: Mapping[str, str], at: float) -> Allocations:
    """The GPUs' holders from an answer (see RawPod); `by_uuid` maps lower-case UUIDs to gpu labels."""
    labels = frozenset(by_uuid.values())
    held: dict[str, set[PodRef]] = {}
    unknown: list[str] = []
    pods = 0
    for namespace, pod, containers in raw:
        pods += 1
        for container, resource, ids in containers:
            for device_id in ids:
                label = gpu_of(device_id, by_uuid, labels)
                if label is not None:
                    held.setdefault(label, set()).add(PodRef(namespace, pod, container))
                elif resource.startswith("nvidia.com/") and device_id not in unknown:
                    unknown.append(device_id)
    return Allocations({k: tuple(sorted(v)) for k, v in held.items()}, pods, tuple(unknown), at)


def _text(v: Any, limit: int = 253) -> str:
    """A name from the answer, as the text it should be: a str, no longer than Kubernetes allows."""
    return v[:limit] if isinstance(v, str) else ""


def raw_pod(p: Any) -> RawPod:
    """One PodResources message as a RawPod (messages keep no reference into the answer)."""
    containers = tuple(
        (_text(c.name), _text(d.resource_name), tuple(_text(i, 512) for i in d.device_ids))
        for c in p.containers for d in c.devices)
    return (_text(p.namespace), _text(p.name), containers)


class _Failed(Exception):
    def __init__(self, reason: str, sentence: str) -> None:
        super().__init__(sentence)
        self.reason = reason


class KubeletPods:
    """Asks the kubelet for the node's pods from a background thread; `allocations()` never blocks."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, interval_s: float = 10.0, timeout_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.socket_path = socket_path
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self._by_uuid: dict[str, str] = {}
        self._answer: Allocations | None = None
        self._raw: dict[tuple[str, str], RawPod] = {}
        self._lock = threading.Lock()  # the counters and the hints; the answer is swapped whole
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channel: Any = None
        self._stub: Any = None
        self.requests = 0
        self.failures = dict.fromkeys(REASONS, 0)
        self.failing: str | None = None  # the sentence of the failure now, None while it answers
        self.last_call_s: float | None = None
        self.slowest_call_s = 0.0
        self.get_supported: bool | None = None  # None until a Get was tried
        self._named: set[tuple[str, str]] = set()  # (namespace, pod) to ask for with Get
        self._early = False  # an unnamed pod is missing from the answer: List again soon
        self._asked: dict[str, float] = {}  # hint key -> when it was last acted on
        self._last_list = float("-inf")
        self._logged_unknown: set[str] = set()

    # -- what the sampler calls ----------------------------------------------------------------
    def start(self, devices: Mapping[str, str]) -> None:
        """Begin asking, in a daemon thread, for the GPUs `devices` (UUID -> gpu label)."""
        self._by_uuid = {uuid.lower(): label for uuid, label in devices.items() if uuid}
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gpuscope-kubelet", daemon=True)
            self._thread.start()

    def allocations(self) -> Allocations | None:
        """The last answer; None until the kubelet has answered once."""
        return self._answer

    def hint(self, key: str, namespace: str = "", pod: str = "") -> None:
        """A process runs in a pod (`key`, its pod UID) that the last answer does not account for: ask for
        that pod with Get when its name is known and the kubelet has Get, else List again. Each key at most
        once per interval, so a process in a pod without GPUs costs nothing after the first time."""
        now = self.clock()
        with self._lock:
            if now - self._asked.get(key, float("-inf")) < self.interval_s:
                return
            self._asked[key] = now
            if len(self._asked) > 4096:
                self._asked = {k: t for k, t in self._asked.items() if now - t < self.interval_s}
            if pod and namespace and self.get_supported is not False:
                self._named.add((namespace, pod))
            else:
                self._early = True
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 2.0)
            self._thread = None
        self._close()

    def stats(self) -> dict[str, Any]:
        a = self._answer
        with self._lock:
            return {
                "socket": self.socket_path, "state": "failing" if self.failing else ("ok" if a else "starting"),
                "error": self.failing or "", "interval_s": self.interval_s, "timeout_s": self.timeout_s,
                "requests": self.requests, "failures": dict(self.failures),
                "last_answer_age_s": None if a is None else round(self.clock() - a.at, 3),
                "last_call_s": self.last_call_s, "slowest_call_s": self.slowest_call_s,
                "pods": None if a is None else a.pods,
                "gpus_held": None if a is None else sorted(a.by_gpu),
                "unknown_device_ids": [] if a is None else list(a.unknown),
                "get": {None: "not tried", True: "supported", False: "not supported"}[self.get_supported],
            }

    def self_metrics(self) -> dict[str, float]:
        from ..catalog import series_key

        out = {"gpuscope_kubelet_requests_total": float(self.requests),
               "gpuscope_kubelet_up": 0.0 if self.failing or self._answer is None else 1.0}
        for reason, n in self.failures.items():
            out[series_key("gpuscope_kubelet_failures_total", reason=reason)] = float(n)
        return out

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        next_list = self.clock()
        while not self._stop.is_set():
            now = self.clock()
            with self._lock:
                named = sorted(self._named)[:8] if self.get_supported is not False else []
                self._named.difference_update(named)
                early = self._early and now - self._last_list >= 1.0
                if early:
                    self._early = False
            try:
                if now >= next_list or early:
                    next_list = max(next_list, now + self.interval_s) if early else now + self.interval_s
                    self._list()
                elif named:
                    self._get(named)
            except Exception as e:  # noqa: BLE001 - the thread must never die
                self._fail("error", f"asking the kubelet at {self.socket_path} failed: {type(e).__name__}: {e}")
            with self._lock:
                pending = bool(self._named) or self._early
            wait = 1.0 if pending else max(0.0, next_list - self.clock())
            self._wake.wait(wait)
            self._wake.clear()

    def _connect(self) -> Any:
        if self._stub is None:
            import grpc

            from ._podresources import api_pb2_grpc

            self._channel = grpc.insecure_channel(
                "unix://" + os.path.abspath(self.socket_path),
                options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.enable_http_proxy", 0)])
            self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    def _close(self) -> None:
        if self._channel is not None:
            try:
                self._channel.close()
            except Exception:  # noqa: BLE001
                pass
        self._channel = self._stub = None

    def _call(self, method: str, request: Any) -> Any:
        """One request with the deadline; raises _Failed with a reason and a sentence."""
        import grpc

        where = f"the kubelet's PodResources socket {self.socket_path}"
        try:
            mode = os.stat(self.socket_path).st_mode
        except FileNotFoundError:
            raise _Failed("missing", f"{where} does not exist (is the kubelet's pod-resources folder mounted "
                                     "into the agent's container?)") from None
        except OSError as e:
            raise _Failed("permission", f"{where} cannot be read: {e.strerror}") from None
        if not stat.S_ISSOCK(mode):
            raise _Failed("not_a_socket", f"{where} is not a socket")
        stub = self._connect()
        t0 = time.perf_counter()
        try:
            with self._lock:
                self.requests += 1
            return getattr(stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            self._close()  # a fresh connection next time: the kubelet may have made a new socket
            code, details = e.code(), str(e.details() or "")
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise _Failed("timeout", f"{where} did not answer within {self.timeout_s:g} s") from None
            if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED) and method == "Get":
                raise _Failed("get", details) from None
            low = details.lower()
            if "permission denied" in low:
                raise _Failed("permission", f"{where} refuses the agent: permission denied (the agent needs "
                                            "to run as root to connect)") from None
            if "connection refused" in low:
                raise _Failed("refused", f"nothing listens on {where} (the kubelet is not running?)") from None
            if code == grpc.StatusCode.INTERNAL or "parsing" in low or "protocol" in low:
                raise _Failed("malformed", f"{where} answered something that is not the PodResources API "
                                           f"({details[:160]})") from None
            if code == grpc.StatusCode.UNAVAILABLE:
                raise _Failed("unavailable", f"{where} is unavailable ({details[:160]})") from None
            raise _Failed("error", f"{where} answered {code.name}: {details[:160]}") from None
        finally:
            took = time.perf_counter() - t0
            self.last_call_s = round(took, 4)
            self.slowest_call_s = max(self.slowest_call_s, self.last_call_s)

    def _list(self) -> None:
        from ._podresources import api_pb2

        self._last_list = self.clock()
        try:
            answer = self._call("List", api_pb2.ListPodResourcesRequest())
            raw = {(p[0], p[1]): p for p in map(raw_pod, answer.pod_resources)}
        except _Failed as f:
            self._fail(f.reason, str(f))
            return
        self._raw = raw
        self._publish()

    def _get(self, pods: list[tuple[str, str]]) -> None:
        from ._podresources import api_pb2

        for namespace, name in pods:
            try:
                answer = self._call("Get", api_pb2.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace))
            except _Failed as f:
                if f.reason != "get":
                    self._fail(f.reason, str(f))
                    return
                if "not found" in str(f):  # the pod has gone, or it is not one of this node's
                    continue
                # An older kubelet (Unimplemented) or the feature gate off ("Get method disabled"): List.
                log.info("the kubelet has no PodResources Get (%s); new pods are found by List instead", f,
                         extra={"f_event": "kubelet"})
                self.get_supported = False
                self._list()
                return
            self.get_supported = True
            p = raw_pod(answer.pod_resources)
            if p[1]:
                self._raw = {**self._raw, (p[0], p[1]): p}
        self._publish()

    def _publish(self) -> None:
        answer = allocations_from(self._raw.values(), self._by_uuid, self.clock())
        self._answer = answer
        for device_id in answer.unknown:
            if device_id not in self._logged_unknown and len(self._logged_unknown) < _MAX_UNKNOWN:
                self._logged_unknown.add(device_id)
                log.warning("the kubelet names the NVIDIA device %r, which NVML does not list on this node (%d GPUs "
                            "here); it is left out of the pods' GPUs", device_id, len(set(self._by_uuid.values())),
                            extra={"f_event": "kubelet"})
        if self.failing is not None:
            log.info("the kubelet's PodResources API answers again at %s (%d pods)", self.socket_path,
                     answer.pods, extra={"f_event": "kubelet"})
        self.failing = None

    def _fail(self, reason: str, sentence: str) -> None:
        with self._lock:
            self.failures[reason if reason in self.failures else "error"] += 1
        if self.failing is None:
            log.warning("%s; %s until it answers (asked again every %g s).", sentence,
                        "no pod is known" if self._answer is None else "the pods of its last answer stand",
                        self.interval_s, extra={"f_event": "kubelet"})
        self.failing = sentence
