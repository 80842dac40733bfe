"""Adapter for the kubelet's pod-resources API (v1): which devices each running container got."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from deviceplugin.identity import ContainerRef
from proto.podresources.v1 import api_pb2 as pb
from proto.podresources.v1 import api_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

LIST_TIMEOUT_SECONDS = 5.0


def container_devices(socket: Path, resource: str) -> dict[frozenset[str], ContainerRef] | None:
    """Device set -> container, for the containers holding ``resource``; None when the kubelet's
    socket is absent or does not answer (the caller keeps its records as they are)."""
    if not socket.exists():
        return None
    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            response = pb_grpc.PodResourcesListerStub(channel).List(
                pb.ListPodResourcesRequest(), timeout=LIST_TIMEOUT_SECONDS
            )
    except grpc.RpcError as e:
        log.warning("pod-resources List on %s failed: %s", socket, e)
        return None
    owners: dict[frozenset[str], ContainerRef] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name == resource and devices.device_ids:
                    owners[frozenset(devices.device_ids)] = ContainerRef(
                        pod.namespace, pod.name, container.name
                    )
    return owners
