"""A kubelet's PodResources API for tests: a real gRPC server on a unix socket, serving the official proto's
messages through the generated servicer, with the faults a node shows (slow, Get disabled or missing), and
a raw socket that answers bytes that are not gRPC."""

from __future__ import annotations

import os
import socket
import threading
from concurrent import futures
from pathlib import Path

import grpc

from gpuscope.sources._podresources import api_pb2, api_pb2_grpc

# (namespace, pod, [(container, resource, [device ids])])
Pod = tuple[str, str, list[tuple[str, str, list[str]]]]


def message(pod: Pod) -> api_pb2.PodResources:
    namespace, name, containers = pod
    by_name: dict[str, api_pb2.ContainerResources] = {}
    for container, resource, ids in containers:
        c = by_name.setdefault(container, api_pb2.ContainerResources(name=container))
        c.devices.append(api_pb2.ContainerDevices(resource_name=resource, device_ids=ids))
    return api_pb2.PodResources(name=name, namespace=namespace, containers=list(by_name.values()))


class Kubelet(api_pb2_grpc.PodResourcesListerServicer):
    """Serves `pods` (a list the test may replace at any time). `delay_s` holds every answer back;
    `get`: 'supported', 'disabled' (what a kubelet with the feature gate off says) or 'unimplemented'
    (a kubelet older than 1.27)."""

    def __init__(self, path: Path, pods: list[Pod] | None = None, get: str = "supported") -> None:
        self.path = path
        self.pods: list[Pod] = list(pods or [])
        self.delay_s = 0.0
        self.get = get
        self.lists = 0
        self.gets: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._release = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{path}")

    def start(self) -> Kubelet:
        self.server.start()
        return self

    def stop(self) -> None:
        self._release.set()
        self.server.stop(grace=None).wait(5)
        if self.path.exists():
            self.path.unlink()

    def _hold(self) -> None:
        if self.delay_s:
            self._release.wait(self.delay_s)

    def List(self, request, context):  # noqa: N802 - the proto's name
        with self._lock:
            self.lists += 1
        self._hold()
        return api_pb2.ListPodResourcesResponse(pod_resources=[message(p) for p in list(self.pods)])

    def Get(self, request, context):  # noqa: N802
        if self.get == "unimplemented":
            return super().Get(request, context)
        if self.get == "disabled":
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        with self._lock:
            self.gets.append((request.pod_namespace, request.pod_name))
        self._hold()
        for p in list(self.pods):
            if (p[0], p[1]) == (request.pod_namespace, request.pod_name):
                return api_pb2.GetPodResourcesResponse(pod_resources=message(p))
        context.abort(grpc.StatusCode.UNKNOWN,
                      f"pod {request.pod_name} in namespace {request.pod_namespace} not found")


class JunkServer:
    """A unix socket that answers every connection with bytes that are no HTTP/2 (nor gRPC) at all."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> JunkServer:
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + os.urandom(512))
            except OSError:
                pass
            finally:
                conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()
        if self.path.exists():
            self.path.unlink()
