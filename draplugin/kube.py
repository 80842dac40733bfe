"""Kubernetes API adapter of the DRA driver: reads ResourceClaims and the pods they are reserved
for, records Warning events on those pods, publishes the node's ResourceSlice.

Plain JSON through the client's generic object calls (resource.k8s.io/v1 has no client models in
the Python client this project pins).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import urllib3
from kubernetes import client

from nodeagent.kubeapi import EventTarget, warning_event
from tessera.contract import ContractError, ContractKeys, JsonObject

log = logging.getLogger(__name__)

COMPONENT = "tessera-dra"

GROUP, VERSION = "resource.k8s.io", "v1"
HTTP_NOT_FOUND = 404
HTTP_CONFLICT = 409
TIMEOUT = (10.0, 30.0)


def decode(data: bytes | str, what: str) -> Any:
    """An object the API server sent; a :class:`ContractError` for one nested too deep for Python's
    JSON reader (the API server accepts thousands of levels in a claim's opaque parameters, which its
    owner writes), never a RecursionError out of the kubelet's call."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ContractError(
            f"{what}: nested deeper than {sys.getrecursionlimit()} levels, which this driver does not "
            "read (its own parameters are three levels deep)"
        ) from None


class ResourceApi:
    def __init__(self, api: client.ApiClient) -> None:
        self._objects = client.CustomObjectsApi(api)

    def read_claim(self, namespace: str, name: str) -> Mapping[str, object] | None:
        try:
            response = self._objects.get_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                "resourceclaims",
                name,
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )
        except client.ApiException as e:
            if e.status == HTTP_NOT_FOUND:
                return None
            raise
        claim: dict[str, Any] = decode(response.data, f"resource claim {namespace}/{name}")
        return claim

    def read_slice(self, name: str) -> JsonObject | None:
        try:
            response = self._objects.get_cluster_custom_object(
                GROUP, VERSION, "resourceslices", name, _preload_content=False, _request_timeout=TIMEOUT
            )
        except client.ApiException as e:
            if e.status == HTTP_NOT_FOUND:
                return None
            raise
        found: JsonObject = decode(response.data, f"resource slice {name}")
        return found

    def create_slice(self, body: JsonObject) -> None:
        self._objects.create_cluster_custom_object(
            GROUP, VERSION, "resourceslices", body, _request_timeout=TIMEOUT
        )

    def replace_slice(self, body: JsonObject) -> None:
        self._objects.replace_cluster_custom_object(
            GROUP, VERSION, "resourceslices", body["metadata"]["name"], body, _request_timeout=TIMEOUT
        )


class PodApi:
    """The pods a claim is reserved for: read for their priority, warned when their class is lowered."""

    def __init__(self, api: client.ApiClient, node: str) -> None:
        self._core = client.CoreV1Api(api)
        self._node = node

    def read_pod(self, namespace: str, name: str) -> Mapping[str, object] | None:
        try:
            response = self._core.read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=TIMEOUT
            )
        except client.ApiException as e:
            if e.status == HTTP_NOT_FOUND:
                return None
            raise
        pod: dict[str, Any] = decode(response.data, f"pod {namespace}/{name}")
        return pod

    def warn(self, pod: EventTarget, reason: str, message: str) -> None:
        self._core.create_namespaced_event(
            pod.namespace,
            warning_event(pod, reason, message, component=COMPONENT, node=self._node),
            _request_timeout=TIMEOUT,
        )


def _generation(found: Mapping[str, Any]) -> int:
    pool = (found.get("spec") or {}).get("pool") or {}
    generation = pool.get("generation", 0)
    return generation if isinstance(generation, int) else 0


class SliceStore(Protocol):
    """Where the slice is kept (:class:`ResourceApi`)."""

    def read_slice(self, name: str) -> JsonObject | None: ...

    def create_slice(self, body: JsonObject) -> None: ...

    def replace_slice(self, body: JsonObject) -> None: ...


class SlicePublisher:
    """Keeps the node's ResourceSlice what ``render(generation)`` says: creates it when missing (a
    kubelet wipes a driver's slices some time after the driver's socket goes away), replaces it
    with the next generation when the devices changed."""

    def __init__(self, api: SliceStore, keys: ContractKeys, render: Callable[[int], JsonObject]) -> None:
        self._api = api
        self._keys = keys
        self._render = render

    def sync(self) -> bool:
        """One pass; True when the slice was written. Raises the client's errors."""
        wanted = self._render(1)
        name = wanted["metadata"]["name"]
        digest = wanted["metadata"]["annotations"][self._keys.dra_slice_digest]
        found = self._api.read_slice(name)
        if found is None:
            self._api.create_slice(wanted)
            log.info("ResourceSlice %s created (%d devices)", name, len(wanted["spec"]["devices"]))
            return True
        if (found.get("metadata", {}).get("annotations") or {}).get(self._keys.dra_slice_digest) == digest:
            return False
        body = self._render(_generation(found) + 1)
        body["metadata"]["resourceVersion"] = found["metadata"]["resourceVersion"]
        self._api.replace_slice(body)
        log.info("ResourceSlice %s replaced (generation %d)", name, body["spec"]["pool"]["generation"])
        return True

    def try_sync(self) -> None:
        """One pass, its failure logged (the next pass tries again)."""
        try:
            self.sync()
        except client.ApiException as e:
            if e.status != HTTP_CONFLICT:  # a concurrent writer: the next pass sees its version
                log.warning("publishing the ResourceSlice failed: HTTP %s %s", e.status, e.reason)
        except (OSError, urllib3.exceptions.HTTPError) as e:
            log.warning("publishing the ResourceSlice failed: %s", e)
