"""A kubelet stand-in for the device plugin's tests and benchmarks: the kubelet's side of the v1beta1
protocol, over real unix sockets with the project's real protos.

As the kubelet does: it serves ``v1beta1.Registration`` on ``<dir>/kubelet.sock``; inside ``Register``
it checks the version, dials the plugin's socket and calls ``GetDevicePluginOptions`` before
answering; then it reads ``ListAndWatch`` (each message the full list). A restart deletes every
socket in the dir and serves a fresh ``kubelet.sock``.
"""

from __future__ import annotations

import contextlib
import stat
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from proto.deviceplugin.v1beta1 import api_pb2 as pb
from proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from proto.podresources.v1 import api_pb2 as pr

T = TypeVar("T")


@dataclass
class Registration:
    at: float
    request: Any  # pb.RegisterRequest
    options: Any  # pb.DevicePluginOptions
    channel: grpc.Channel
    device_lists: list[dict[str, str]] = field(default_factory=list)
    stream_ended: bool = False

    @property
    def stub(self) -> Any:
        return pb_grpc.DevicePluginStub(self.channel)


class KubeletStandIn:
    def __init__(self, plugin_dir: Path) -> None:
        self.plugin_dir = plugin_dir
        self.socket = plugin_dir / "kubelet.sock"
        self.registrations: list[Registration] = []
        self._changed = threading.Condition()
        self._server: grpc.Server | None = None
        self._streams: list[threading.Thread] = []
        # Devices given to containers, as the kubelet's device manager tracks them.
        self.in_use: set[str] = set()
        # (namespace, pod, container) -> devices, as the pod-resources API reports them.
        self.assigned: dict[tuple[str, str, str], list[str]] = {}
        self.pod_resources_socket = plugin_dir / "pod-resources" / "kubelet.sock"

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.method_handlers_generic_handler(
            "v1beta1.Registration",
            {
                "Register": grpc.unary_unary_rpc_method_handler(
                    self._register,
                    request_deserializer=pb.RegisterRequest.FromString,
                    response_serializer=pb.Empty.SerializeToString,
                )
            },
        )
        pod_resources = grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister",
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    self._list_pod_resources,
                    request_deserializer=pr.ListPodResourcesRequest.FromString,
                    response_serializer=pr.ListPodResourcesResponse.SerializeToString,
                )
            },
        )
        server.add_generic_rpc_handlers((handler, pod_resources))
        server.add_insecure_port(f"unix://{self.socket}")
        self.pod_resources_socket.parent.mkdir(exist_ok=True)
        self.pod_resources_socket.unlink(missing_ok=True)
        server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0).wait()
            self._server = None
        with self._changed:
            registrations = list(self.registrations)
        for r in registrations:
            r.channel.close()
        for thread in self._streams:
            thread.join(timeout=5)

    def restart(self) -> float:
        """Stop, delete every socket in the plugin dir as a starting kubelet does, serve again.

        Returns the monotonic time at which the new ``kubelet.sock`` exists.
        """
        self.stop()
        for path in self.plugin_dir.iterdir():
            # A plugin may replace its own socket meanwhile: one gone already needs no deleting.
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()
        self.start()
        return time.monotonic()

    # --- the kubelet's side of Register ------------------------------------------------------------

    def _register(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.version != "v1beta1":
            context.abort(
                grpc.StatusCode.UNKNOWN,
                f'requested API version "{request.version}" is not supported by kubelet. '
                'Supported version is "[v1beta1]"',
            )
        channel = grpc.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        try:
            grpc.channel_ready_future(channel).result(timeout=10)
            options = pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty(), timeout=10)
        except (grpc.FutureTimeoutError, grpc.RpcError) as e:
            channel.close()
            context.abort(grpc.StatusCode.UNKNOWN, f"failed to dial device plugin: {e}")
        registration = Registration(time.monotonic(), request, options, channel)
        with self._changed:
            self.registrations.append(registration)
            self._changed.notify_all()
        thread = threading.Thread(target=self._list_and_watch, args=(registration,), daemon=True)
        thread.start()
        self._streams.append(thread)
        return pb.Empty()

    def _list_pod_resources(self, request: Any, context: grpc.ServicerContext) -> Any:
        pods: dict[tuple[str, str], list[Any]] = {}
        with self._changed:
            for (namespace, pod, container), devices in self.assigned.items():
                resource = self.current.request.resource_name
                pods.setdefault((namespace, pod), []).append(
                    pr.ContainerResources(
                        name=container,
                        devices=[pr.ContainerDevices(resource_name=resource, device_ids=devices)],
                    )
                )
        return pr.ListPodResourcesResponse(
            pod_resources=[
                pr.PodResources(namespace=namespace, name=name, containers=containers)
                for (namespace, name), containers in pods.items()
            ]
        )

    def _list_and_watch(self, registration: Registration) -> None:
        with contextlib.suppress(grpc.RpcError):
            for response in registration.stub.ListAndWatch(pb.Empty()):
                with self._changed:
                    registration.device_lists.append({d.ID: d.health for d in response.devices})
                    self._changed.notify_all()
        with self._changed:
            registration.stream_ended = True
            self._changed.notify_all()

    # --- what tests ask ----------------------------------------------------------------------------

    def wait_for(self, what: Callable[[KubeletStandIn], T | None], timeout: float = 30.0) -> T:
        """Waits until ``what(self)`` is truthy and returns it; fails the test after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                value = what(self)
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"kubelet stand-in: condition not met within {timeout}s")
                self._changed.wait(min(left, 0.5))

    @property
    def current(self) -> Registration:
        assert self.registrations, "the plugin never registered"
        return self.registrations[-1]

    def devices(self) -> dict[str, str]:
        """The latest full device list of the latest registration (ID -> health)."""
        with self._changed:
            lists = self.current.device_lists
            return dict(lists[-1]) if lists else {}

    def allocate(self, *containers: list[str], timeout: float = 30.0) -> Any:
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
        )
        return self.current.stub.Allocate(request, timeout=timeout)

    def preferred(self, available: list[str], must_include: list[str], size: int) -> list[str]:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size
                )
            ]
        )
        response = self.current.stub.GetPreferredAllocation(request, timeout=30)
        return list(response.container_responses[0].deviceIDs)

    def admit_container(self, size: int, owner: tuple[str, str, str] | None = None) -> tuple[list[str], Any]:
        """What the kubelet does for one container asking for ``size`` devices: ask for a preferred
        allocation among the free healthy devices, keep what is free, fill up in arbitrary order, call
        Allocate, and count the devices as in use (by ``owner``, for the pod-resources API) if it
        succeeded."""
        free = sorted(
            d for d, health in self.devices().items() if health == "Healthy" and d not in self.in_use
        )
        if len(free) < size:
            raise AssertionError(f"requested number of devices unavailable: {size} wanted, {len(free)} free")
        chosen = [d for d in self.preferred(free, [], size) if d in free][:size]
        chosen += [d for d in free if d not in chosen][: size - len(chosen)]
        response = self.allocate(chosen)
        with self._changed:
            self.in_use.update(chosen)
        if owner is not None:
            self.assign(owner, chosen)
        return chosen, response

    def assign(self, owner: tuple[str, str, str], devices: list[str]) -> None:
        """Name ``owner`` (namespace, pod, container) as the holder of ``devices`` in the
        pod-resources API, as the kubelet does once Allocate returned."""
        with self._changed:
            self.assigned[owner] = devices

    def forget_assignments(self) -> None:
        with self._changed:
            self.assigned.clear()
