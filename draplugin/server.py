"""gRPC edge: the kubelet's plugin registration and DRA plugin services over unix sockets.

The kubelet watches its ``plugins_registry`` directory; for a new socket there it calls
``GetInfo`` (type ``DRAPlugin``, the driver name, the DRA socket, ``v1.DRAPlugin``), dials the DRA
socket and reports the outcome with ``NotifyRegistrationStatus``. A restarted kubelet finds the
sockets again; a restarted driver replaces both sockets, which the kubelet sees as a new plugin.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import urllib3
from kubernetes import client

from draplugin.claims import ClaimRef
from draplugin.driver import Driver
from proto.dra.v1 import api_pb2 as dra
from proto.dra.v1 import api_pb2_grpc as dra_grpc
from proto.pluginregistration.v1 import api_pb2 as reg
from proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from tessera.contract import ContractError

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
# The service this driver serves, as the kubelet names it in PluginInfo.supported_versions.
DRA_SERVICE = "v1.DRAPlugin"
WORKERS = 8


def _ref(claim: Any) -> ClaimRef:
    return ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid)


def _failure(ref: ClaimRef, e: Exception) -> str:
    if isinstance(e, ContractError):
        return str(e)
    if isinstance(e, client.ApiException):
        return f"{ref}: the API server answered HTTP {e.status} {e.reason}"
    return f"{ref}: the API server cannot be reached: {e}"


def _log_duration(call: str, claims: int, began: float) -> None:
    """How long a call took in the driver (bench/dra_latency.py reads it from the driver's log)."""
    log.info("%s: %d claim(s) in %.1f ms", call, claims, (time.perf_counter() - began) * 1000)


class DraService(dra_grpc.DRAPluginServicer):  # type: ignore[misc]
    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        began = time.perf_counter()
        response = dra.NodePrepareResourcesResponse()
        for claim in request.claims:
            ref = _ref(claim)
            try:
                devices = self._driver.prepare(ref)
            except (ContractError, client.ApiException, OSError, urllib3.exceptions.HTTPError) as e:
                message = _failure(ref, e)
                log.warning("prepare failed: %s", message)
                response.claims[ref.uid].error = message
                continue
            entry = response.claims[ref.uid]
            for d in devices:
                device = entry.devices.add(
                    request_names=d.request_names,
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=d.cdi_device_ids,
                )
                if d.share_id is not None:
                    device.share_id = d.share_id
        _log_duration("NodePrepareResources", len(request.claims), began)
        return response

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        began = time.perf_counter()
        response = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            ref = _ref(claim)
            try:
                self._driver.unprepare(ref)
            except (ContractError, OSError) as e:
                response.claims[ref.uid].error = f"{ref}: {e}"
                continue
            response.claims[ref.uid].SetInParent()
        _log_duration("NodeUnprepareResources", len(request.claims), began)
        return response


class RegistrationService(reg_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, driver_name: str, endpoint: Path) -> None:
        self._name = driver_name
        self._endpoint = endpoint
        self.registered = threading.Event()

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return reg.PluginInfo(
            type=PLUGIN_TYPE, name=self._name, endpoint=str(self._endpoint), supported_versions=[DRA_SERVICE]
        )

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        if request.plugin_registered:
            log.info("registered with the kubelet as %s", self._name)
            self.registered.set()
        else:
            log.error("the kubelet refused the registration: %s", request.error)
        return reg.RegistrationStatusResponse()


def serve(socket: Path, add: Callable[[grpc.Server], None]) -> grpc.Server:
    """A gRPC server on a fresh unix socket at ``socket`` (a stale one is removed first)."""
    socket.parent.mkdir(parents=True, exist_ok=True)
    socket.unlink(missing_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS))
    add(server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    return server


@dataclass
class Servers:
    dra: grpc.Server
    registration: grpc.Server
    status: RegistrationService
    sockets: tuple[Path, Path]  # registration, DRA

    def stop(self, grace: float = 2.0) -> None:
        """The registration socket first: its removal tells the kubelet the plugin is gone."""
        self.registration.stop(grace).wait()
        self.dra.stop(grace).wait()
        for socket in self.sockets:
            socket.unlink(missing_ok=True)


def serve_driver(driver: Driver, dra_socket: Path, registration_socket: Path) -> Servers:
    """Both servers; the DRA socket first, so it answers once the kubelet has seen the registration."""
    dra_server = serve(dra_socket, lambda s: dra_grpc.add_DRAPluginServicer_to_server(DraService(driver), s))
    status = RegistrationService(driver.keys.dra_driver, dra_socket)
    registration = serve(
        registration_socket, lambda s: reg_grpc.add_RegistrationServicer_to_server(status, s)
    )
    return Servers(
        dra=dra_server, registration=registration, status=status, sockets=(registration_socket, dra_socket)
    )
