"""gRPC adapter for the kubelet: the DevicePlugin service, registration, and re-registration when the
kubelet restarts (it deletes every socket in the plugin dir and re-creates ``kubelet.sock``).

Only the kubelet's protocol lives here: the slices and their health come from the inventory
(:class:`deviceplugin.inventory.Inventory`), the answers to GetPreferredAllocation and Allocate from
the allocator (:class:`deviceplugin.allocation.Allocator`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import NoReturn, Protocol

import grpc

from deviceplugin.config import Config
from deviceplugin.devices import VirtualDevice
from deviceplugin.kube import KubeUnavailableError
from deviceplugin.matching import AllocationError
from deviceplugin.metrics import PluginMetrics
from deviceplugin.response import ContainerAnswer
from proto.deviceplugin.v1beta1 import api_pb2 as pb
from proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from tessera.contract import DEVICE_PLUGIN_API_VERSION, HEALTHY, UNHEALTHY

log = logging.getLogger(__name__)

# Enough threads that GetDevicePluginOptions is served while ListAndWatch streams stay open, and
# that a burst of calls (20 admissions at once in bench/deviceplugin_latency.py) waits for the same
# shared pod read (deviceplugin.kube.FreshReads) instead of queueing for a thread behind it.
SERVER_THREADS = 32
REGISTER_TIMEOUT_SECONDS = 10.0
REGISTER_RETRY_SECONDS = 1.0
# How often the plugin dir is checked for a restarted kubelet or a deleted socket.
SOCKET_POLL_SECONDS = 0.2


class Slices(Protocol):
    """The slices to offer, and their health."""

    def devices(self) -> tuple[tuple[VirtualDevice, ...], int]: ...

    def wait_for_change(self, version: int, timeout: float) -> int: ...

    def wake(self) -> None: ...


class Answers(Protocol):
    """The answers to the kubelet's admission calls."""

    def preferred(
        self, available: Sequence[str], must_include: Sequence[str], gpu_count: int
    ) -> list[str]: ...

    def allocate(self, requests: Sequence[Sequence[str]]) -> list[ContainerAnswer]: ...


def _device(device: VirtualDevice) -> pb.Device:
    topology = None
    if device.numa_node is not None:
        topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=device.numa_node)])
    return pb.Device(ID=device.id, health=HEALTHY if device.healthy else UNHEALTHY, topology=topology)


def _container_response(answer: ContainerAnswer) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=answer.envs,
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in answer.mounts
        ],
    )


class DevicePluginService:
    """The ``v1beta1.DevicePlugin`` service (gRPC finds the methods by name)."""

    def __init__(
        self, slices: Slices, answers: Answers, stopping: threading.Event, metrics: PluginMetrics
    ) -> None:
        self._slices = slices
        self._answers = answers
        self._stopping = stopping
        self._metrics = metrics

    def GetDevicePluginOptions(  # noqa: N802 (the gRPC method name)
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(  # noqa: N802 (the gRPC method name)
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        sent = None
        while not self._stopping.is_set() and context.is_active():
            devices, version = self._slices.devices()
            if version != sent:
                yield pb.ListAndWatchResponse(devices=[_device(d) for d in devices])
                sent = version
            self._slices.wait_for_change(version, timeout=1.0)

    def GetPreferredAllocation(  # noqa: N802 (the gRPC method name)
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        return pb.PreferredAllocationResponse(
            container_responses=[
                pb.ContainerPreferredAllocationResponse(
                    deviceIDs=self._answers.preferred(
                        list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size
                    )
                )
                for r in request.container_requests
            ]
        )

    def Allocate(  # noqa: N802 (the gRPC method name)
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        with self._metrics.allocate_latency.time():
            try:
                answers = self._answers.allocate([list(r.devices_ids) for r in request.container_requests])
            except AllocationError as e:
                self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, e.message)
            except KubeUnavailableError as e:
                self._refuse(context, grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.AllocateResponse(container_responses=[_container_response(a) for a in answers])

    def _refuse(self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
        self._metrics.allocate_errors.labels(code.name).inc()
        context.abort(code, message)

    def PreStartContainer(  # noqa: N802 (the gRPC method name)
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


class PluginServer:
    """One gRPC server on the plugin's socket; a fresh one is started for every registration."""

    def __init__(self, slices: Slices, answers: Answers, config: Config, metrics: PluginMetrics) -> None:
        self._slices = slices
        self._config = config
        self._stopping = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=SERVER_THREADS))
        pb_grpc.add_DevicePluginServicer_to_server(
            DevicePluginService(slices, answers, self._stopping, metrics), self._server
        )
        self._socket_inode: int | None = None

    def start(self) -> None:
        path = self._config.plugin_socket
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        if self._server.add_insecure_port(f"unix://{path}") == 0:
            raise OSError(f"cannot listen on {path}")
        self._server.start()
        self._socket_inode = _inode(path)

    def socket_intact(self) -> bool:
        return self._socket_inode is not None and _inode(self._config.plugin_socket) == self._socket_inode

    def stop(self) -> None:
        """Stop serving; open ListAndWatch streams end, so the kubelet drops this endpoint."""
        self._stopping.set()
        self._slices.wake()
        self._server.stop(grace=0.5).wait()
        if self.socket_intact():
            self._config.plugin_socket.unlink(missing_ok=True)

    def register(self) -> None:
        config = self._config
        with grpc.insecure_channel(f"unix://{config.kubelet_socket}") as channel:
            pb_grpc.RegistrationStub(channel).Register(
                pb.RegisterRequest(
                    version=DEVICE_PLUGIN_API_VERSION,
                    endpoint=config.endpoint,
                    resource_name=config.keys.vgpu,
                    options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
                ),
                timeout=REGISTER_TIMEOUT_SECONDS,
            )


def run_registration(
    slices: Slices,
    answers: Answers,
    config: Config,
    metrics: PluginMetrics,
    stop: threading.Event,
    *,
    registered: threading.Event | None = None,
) -> None:
    """Serve and register until ``stop``; start over whenever the kubelet restarts. ``registered`` is
    set once the kubelet first took the registration.

    A restarted kubelet deletes our socket and re-creates ``kubelet.sock`` (a new inode): either
    sign stops the old server (ending its stream), starts a fresh one, and registers again.

    This is a watch on the two sockets, not a retry loop, so no retry library drives it: a failed
    registration is only a state the watch sees again on its next look (at most once a second),
    and while registering keeps failing the watch must still notice a kubelet restart or a deleted
    socket and serve afresh before registering again, which a retry around ``Register`` alone would
    sleep through.
    """
    server: PluginServer | None = None
    registered_with: int | None = None  # inode of the kubelet.sock we registered with
    next_attempt = 0.0
    last_error = ""
    try:
        while not stop.is_set():
            kubelet = _inode(config.kubelet_socket)
            restarted = registered_with is not None and kubelet != registered_with
            if server is None or not server.socket_intact() or restarted:
                if server is not None:
                    log.info("kubelet restarted or plugin socket removed: serving afresh")
                    server.stop()
                server = PluginServer(slices, answers, config, metrics)
                server.start()
                registered_with = None
                metrics.registered.set(0)
                next_attempt = 0.0
            if registered_with is None and kubelet is not None and time.monotonic() >= next_attempt:
                try:
                    server.register()
                except grpc.RpcError as e:
                    error = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.Call) else str(e)
                    if error != last_error:
                        log.warning("registering with %s failed, retrying: %s", config.kubelet_socket, error)
                        last_error = error
                    next_attempt = time.monotonic() + REGISTER_RETRY_SECONDS
                else:
                    registered_with = kubelet
                    metrics.registered.set(1)
                    if registered is not None:
                        registered.set()
                    last_error = ""
                    log.info("registered %s with the kubelet at %s", config.keys.vgpu, config.kubelet_socket)
            stop.wait(SOCKET_POLL_SECONDS)
    finally:
        if server is not None:
            server.stop()
