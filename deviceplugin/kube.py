"""Kubernetes API adapter: the pods on this node, their allocation phase and events, the Node's
annotations. Responses are read as plain JSON (no client models) and turned into plain data."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config

from deviceplugin.matching import PodView
from tessera.contract import (
    ContainerRequest,
    ContractError,
    ContractKeys,
    Phase,
    format_time,
    now,
    parse_container_requests,
    parse_time,
    pod_ref,
)

log = logging.getLogger(__name__)

COMPONENT = "tessera-device-plugin"


class KubeConfigError(RuntimeError):
    """No usable credentials; the message names the source."""


class KubeUnavailableError(RuntimeError):
    """The API server did not answer; the message says what was asked."""


def load_api(kubeconfig: Path | None) -> client.ApiClient:
    try:
        if kubeconfig is not None:
            return config.new_client_from_config(config_file=str(kubeconfig))
        config.load_incluster_config()
    except (config.ConfigException, OSError) as e:
        where = (
            f"--kubeconfig {kubeconfig}" if kubeconfig is not None else "in-cluster config (no --kubeconfig)"
        )
        raise KubeConfigError(f"{where}: {e}") from None
    return client.ApiClient()


def pod_view(pod: Mapping[str, Any], keys: ContractKeys) -> PodView:
    metadata = pod.get("metadata") or {}
    namespace, name = metadata.get("namespace", ""), metadata.get("name", "")
    created = metadata.get("creationTimestamp")
    containers: tuple[ContainerRequest, ...] = ()
    request_error = None
    try:
        containers = parse_container_requests(pod, keys)
    except ContractError as e:
        # The extender would never have bound it; matching reports it on the pod.
        request_error = f"its request is invalid: {e}"
    return PodView(
        namespace=namespace,
        name=name,
        uid=metadata.get("uid", ""),
        created=parse_time(created, field=f"pod {pod_ref(namespace, name)}: creationTimestamp")
        if created
        else now(),
        annotations=metadata.get("annotations") or {},
        gpu_containers=containers,
        request_error=request_error,
    )


class Kube:
    """The API calls the agent makes, each scoped to its own node."""

    def __init__(self, api: client.ApiClient, node: str, keys: ContractKeys) -> None:
        self._api = api
        self._core = client.CoreV1Api(api)
        self.node = node
        self.keys = keys

    def close(self) -> None:
        self._api.close()

    def _pods_on_node(self) -> list[dict[str, Any]]:
        response = self._core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node}", _preload_content=False
        )
        items: list[dict[str, Any]] = json.loads(response.data)["items"]
        return items

    def pending_pods(self) -> list[PodView]:
        """Pods on this node that the kubelet may still admit: pending and not being deleted."""
        try:
            pods = self._pods_on_node()
        except (client.ApiException, urllib3.exceptions.HTTPError, OSError) as e:
            raise KubeUnavailableError(f"cannot list the pods on node {self.node}: {e}") from None
        return [
            pod_view(p, self.keys)
            for p in pods
            if (p.get("status") or {}).get("phase", "Pending") == "Pending"
            and not p["metadata"].get("deletionTimestamp")
        ]

    def pod_uids(self) -> dict[tuple[str, str], str]:
        """(namespace, name) -> UID of every pod on this node."""
        return {
            (p["metadata"]["namespace"], p["metadata"]["name"]): p["metadata"]["uid"]
            for p in self._pods_on_node()
        }

    def set_phase(self, pod: PodView, phase: Phase) -> None:
        self._core.patch_namespaced_pod(
            pod.name,
            pod.namespace,
            {"metadata": {"annotations": {self.keys.allocation_phase: phase.value}}},
        )

    def warn(self, pod: PodView, reason: str, message: str) -> None:
        """A Warning event on the pod, as ``kubectl describe pod`` shows it."""
        moment = format_time(now())
        self._core.create_namespaced_event(
            pod.namespace,
            {
                "metadata": {"generateName": f"{pod.name}.", "namespace": pod.namespace},
                "involvedObject": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "namespace": pod.namespace,
                    "name": pod.name,
                    "uid": pod.uid,
                },
                "type": "Warning",
                "reason": reason,
                "message": message[:1024],
                "source": {"component": COMPONENT, "host": self.node},
                "reportingComponent": COMPONENT,
                "reportingInstance": self.node,
                "firstTimestamp": moment,
                "lastTimestamp": moment,
                "count": 1,
            },
        )

    def node_annotations(self) -> dict[str, str]:
        response = self._core.read_node(self.node, _preload_content=False)
        annotations: dict[str, str] = json.loads(response.data)["metadata"].get("annotations") or {}
        return annotations

    def annotate_node(self, annotations: Mapping[str, str]) -> None:
        self._core.patch_node(self.node, {"metadata": {"annotations": dict(annotations)}})
