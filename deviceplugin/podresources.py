"""Adapter for the kubelet's pod-resources API (v1): which devices each running container got."""

from __future__ import annotations

from pathlib import Path

import grpc

from deviceplugin.identity import ContainerRef
from proto.podresources.v1 import api_pb2 as pb
from proto.podresources.v1 import api_pb2_grpc as pb_grpc

LIST_TIMEOUT_SECONDS = 5.0

# Device set -> the container the kubelet gave it to.
Owners = dict[frozenset[str], ContainerRef]


class PodResourcesError(RuntimeError):
    """The kubelet's pod-resources socket is there but did not answer."""


def container_devices(socket: Path, resource: str) -> Owners | None:
    """Device set -> container, for the containers holding ``resource``; None when the kubelet's
    socket is absent (a kubelet without the API: nothing can be asked). Raises
    :class:`PodResourcesError` naming the socket when it does not answer (ask again later)."""
    if not socket.exists():
        return None
    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            response = pb_grpc.PodResourcesListerStub(channel).List(
                pb.ListPodResourcesRequest(), timeout=LIST_TIMEOUT_SECONDS
            )
    except grpc.RpcError as e:
        raise PodResourcesError(f"pod-resources List on {socket} failed: {e}") from None
    owners: Owners = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name == resource and devices.device_ids:
                    owners[frozenset(devices.device_ids)] = ContainerRef(
                        pod.namespace, pod.name, container.name
                    )
    return owners
