"""The kubelet's side of plugin registration and of the DRA plugin API, over the driver's real unix
sockets with the project's protos, for test_server.py: the driver's gRPC edge against a fake API
server, whose failures (a claim not found, the API server unavailable) a real kubelet cannot be made
to meet on cue. The real kubelet drives the driver in test_node.py.

As the kubelet's plugin watcher does for a socket in its ``plugins_registry`` directory: call
``GetInfo``, check the plugin type and that ``v1.DRAPlugin`` is offered, dial the endpoint it names,
and report the outcome with ``NotifyRegistrationStatus``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from proto.dra.v1 import api_pb2 as dra
from proto.dra.v1 import api_pb2_grpc as dra_grpc
from proto.pluginregistration.v1 import api_pb2 as reg
from proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc

# The kubelet's values (pluginregistration/v1 constants.go, dra/v1 types.go), not the driver's.
DRA_PLUGIN_TYPE = "DRAPlugin"
DRA_SERVICE = "v1.DRAPlugin"
CALL_SECONDS = 30.0


class RegistrationError(RuntimeError):
    """The plugin did not register as the kubelet requires; the message says why."""


@dataclass
class RegisteredDriver:
    info: Any  # reg.PluginInfo
    channel: grpc.Channel

    def prepare(self, *claims: Any) -> Any:
        """NodePrepareResources for ``claims`` (``dra.Claim`` messages)."""
        request = dra.NodePrepareResourcesRequest(claims=claims)
        return dra_grpc.DRAPluginStub(self.channel).NodePrepareResources(request, timeout=CALL_SECONDS)

    def unprepare(self, *claims: Any) -> Any:
        request = dra.NodeUnprepareResourcesRequest(claims=claims)
        return dra_grpc.DRAPluginStub(self.channel).NodeUnprepareResources(request, timeout=CALL_SECONDS)

    def close(self) -> None:
        self.channel.close()


def claim(namespace: str, name: str, uid: str) -> Any:
    return dra.Claim(namespace=namespace, name=name, uid=uid)


def _info(socket: Path) -> Any | None:
    if not socket.exists():
        return None
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        try:
            return reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=5)
        except grpc.RpcError:
            return None


def register(registration_socket: Path, driver_name: str, timeout: float = 60.0) -> RegisteredDriver:
    """Registers the plugin serving ``registration_socket`` once it answers, as the kubelet would."""
    deadline = time.monotonic() + timeout
    while (info := _info(registration_socket)) is None:
        if time.monotonic() > deadline:
            raise RegistrationError(f"no plugin answered GetInfo on {registration_socket} in {timeout:.0f}s")
        time.sleep(0.1)
    if info.type != DRA_PLUGIN_TYPE or info.name != driver_name or DRA_SERVICE not in info.supported_versions:
        raise RegistrationError(
            f"{registration_socket}: type {info.type!r}, name {info.name!r}, versions "
            f"{list(info.supported_versions)}; expected {DRA_PLUGIN_TYPE!r}, {driver_name!r}, {DRA_SERVICE!r}"
        )
    channel = grpc.insecure_channel(f"unix://{info.endpoint}")
    try:
        grpc.channel_ready_future(channel).result(timeout=max(deadline - time.monotonic(), 1.0))
    except grpc.FutureTimeoutError:
        channel.close()
        raise RegistrationError(f"the DRA endpoint {info.endpoint} does not answer") from None
    with grpc.insecure_channel(f"unix://{registration_socket}") as notify:
        reg_grpc.RegistrationStub(notify).NotifyRegistrationStatus(
            reg.RegistrationStatus(plugin_registered=True), timeout=5
        )
    return RegisteredDriver(info, channel)
