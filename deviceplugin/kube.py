"""Kubernetes API adapter: the pods on this node, their allocation phase and events, the Node's
annotations. Responses are read as plain JSON (no client models) and turned into plain data.

Every read of pods is of this node's pods only: a list or watch with the field selector
``spec.nodeName=<node>``, or a get of one pod by name.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client

from deviceplugin.matching import PodView
from nodeagent.kubeapi import EventTarget, post_review, warning_event
from tessera.contract import (
    ContainerRequest,
    ContractError,
    ContractKeys,
    Phase,
    now,
    parse_container_requests,
    parse_time,
    pod_ref,
)
from tessera.scrapeauth import Review

log = logging.getLogger(__name__)

COMPONENT = "tessera-device-plugin"
CONNECT_SECONDS = 10.0
# Reads of one pod or the node's pods: answered in milliseconds, or the API server is in trouble.
READ_SECONDS = 30.0
HTTP_NOT_FOUND = 404
HTTP_CONFLICT = 409


class KubeUnavailableError(RuntimeError):
    """The API server did not answer; the message says what was asked."""


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


def is_pending(pod: Mapping[str, Any]) -> bool:
    """A pod the kubelet may still admit: phase Pending and not being deleted."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    return status.get("phase", "Pending") == "Pending" and not metadata.get("deletionTimestamp")


@dataclass(frozen=True, slots=True)
class NodePod:
    """A pod bound to this node as the matching sees it, and whether the kubelet may still admit it."""

    view: PodView
    pending: bool


def node_pod(pod: Mapping[str, Any], keys: ContractKeys) -> NodePod:
    return NodePod(pod_view(pod, keys), is_pending(pod))


def _unavailable(what: str, e: Exception) -> KubeUnavailableError:
    return KubeUnavailableError(f"cannot {what}: {e}")


API_ERRORS = (client.ApiException, urllib3.exceptions.HTTPError, OSError)


class Kube:
    """The API calls the agent makes, each scoped to its own node."""

    def __init__(self, api: client.ApiClient, node: str, keys: ContractKeys) -> None:
        self._api = api
        self._core = client.CoreV1Api(api)
        self.node = node
        self.keys = keys

    def close(self) -> None:
        self._api.close()

    @property
    def field_selector(self) -> str:
        """The pods bound to this node."""
        return f"spec.nodeName={self.node}"

    def list_pods(self) -> tuple[list[dict[str, Any]], str]:
        """The pods on this node as the API's JSON, and the list's resourceVersion (to watch from).
        Raises :class:`KubeUnavailableError` naming the node."""
        try:
            response = self._core.list_pod_for_all_namespaces(
                field_selector=self.field_selector,
                _preload_content=False,
                _request_timeout=(CONNECT_SECONDS, READ_SECONDS),
            )
            listed = json.loads(response.data)
        except API_ERRORS as e:
            raise _unavailable(f"list the pods on node {self.node}", e) from None
        items: list[dict[str, Any]] = listed.get("items") or []
        return items, str((listed.get("metadata") or {}).get("resourceVersion") or "")

    def watch_pods(self, resource_version: str, timeout_seconds: int) -> Any:
        """A watch of the pods on this node from ``resource_version`` (with bookmarks), as the open
        HTTP response; read it with :func:`watch_events`. Raises :class:`client.ApiException` (410
        Gone: the version is too old) or a connection error."""
        return self._core.list_pod_for_all_namespaces(
            field_selector=self.field_selector,
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout_seconds,
            _preload_content=False,
            _request_timeout=(CONNECT_SECONDS, timeout_seconds + READ_SECONDS),
        )

    def post_review(self, review: Review) -> dict[str, Any]:
        """Post a TokenReview or SubjectAccessReview (tessera.scrapeauth); the API server's answer.
        Raises :class:`KubeUnavailableError`."""
        try:
            return post_review(self._api, review, (CONNECT_SECONDS, READ_SECONDS))
        except API_ERRORS as e:
            raise _unavailable(f"post a {review.body.get('kind')}", e) from None

    def read_pod(self, namespace: str, name: str) -> NodePod | None:
        """One pod, None when it is gone (or not on this node any more: then it is not ours)."""
        try:
            response = self._core.read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=(CONNECT_SECONDS, READ_SECONDS)
            )
            pod = json.loads(response.data)
        except client.ApiException as e:
            if e.status == HTTP_NOT_FOUND:
                return None
            raise _unavailable(f"read pod {pod_ref(namespace, name)}", e) from None
        except API_ERRORS as e:
            raise _unavailable(f"read pod {pod_ref(namespace, name)}", e) from None
        if (pod.get("spec") or {}).get("nodeName") != self.node:
            return None
        return node_pod(pod, self.keys)

    def node_pods(self) -> list[NodePod]:
        """Every pod on this node."""
        items, _ = self.list_pods()
        return [node_pod(p, self.keys) for p in items]

    def pending_pods(self) -> list[PodView]:
        """Pods on this node that the kubelet may still admit: pending and not being deleted."""
        items, _ = self.list_pods()
        return [pod_view(p, self.keys) for p in items if is_pending(p)]

    def set_phase(self, pod: PodView, phase: Phase) -> None:
        """Patch the pod's allocation phase. The pod's UID is in the patch: a pod of the same name
        created since is refused by the API server (its UID cannot change) instead of patched."""
        self._core.patch_namespaced_pod(
            pod.name,
            pod.namespace,
            {"metadata": {"uid": pod.uid, "annotations": {self.keys.allocation_phase: phase.value}}},
            _request_timeout=(CONNECT_SECONDS, READ_SECONDS),
        )

    def warn(self, pod: EventTarget, reason: str, message: str) -> None:
        """A Warning event on the pod, as ``kubectl describe pod`` shows it."""
        self._core.create_namespaced_event(
            pod.namespace, warning_event(pod, reason, message, component=COMPONENT, node=self.node)
        )

    def delete_pod(self, namespace: str, name: str, uid: str, grace_seconds: int) -> None:
        """Delete the pod with this UID (not a pod of the same name created since) after a grace
        period; a pod already gone is no error."""
        try:
            self._core.delete_namespaced_pod(
                name,
                namespace,
                body={"gracePeriodSeconds": grace_seconds, "preconditions": {"uid": uid}},
                _request_timeout=(CONNECT_SECONDS, READ_SECONDS),
            )
        except client.ApiException as e:
            if e.status not in (HTTP_NOT_FOUND, HTTP_CONFLICT):  # gone, or another pod of that name now
                raise

    def node_labels(self) -> dict[str, str]:
        """This node's labels (its sharing mode among them). Raises :class:`KubeUnavailableError`."""
        try:
            response = self._core.read_node(
                self.node, _preload_content=False, _request_timeout=(CONNECT_SECONDS, READ_SECONDS)
            )
            labels: dict[str, str] = json.loads(response.data)["metadata"].get("labels") or {}
        except API_ERRORS as e:
            raise _unavailable(f"read node {self.node}", e) from None
        return labels

    def node_annotations(self) -> dict[str, str]:
        response = self._core.read_node(self.node, _preload_content=False)
        annotations: dict[str, str] = json.loads(response.data)["metadata"].get("annotations") or {}
        return annotations

    def annotate_node(self, annotations: Mapping[str, str | None]) -> None:
        """Patch the node's annotations (a merge patch: None removes one)."""
        self._core.patch_node(self.node, {"metadata": {"annotations": dict(annotations)}})


PodKey = tuple[str, str]  # (namespace, name)


class FreshReads:
    """Reads of pods that start after the caller asked, shared by the callers waiting at once.

    One read at a time. A read covers every pod asked for before it started: a get when that is one
    pod, else one list of the node's pods. A caller takes the first read that started after it asked
    and covers its pods; callers asking while a read is under way (it may have started before they
    asked) wait for the next one, which covers all of them. So concurrent admissions cost one list
    instead of a get each (docs/deviceplugin.md "Allocate from the pod cache").
    """

    def __init__(self, kube: Kube) -> None:
        self._kube = kube
        self._changed = threading.Condition()
        self._asked: set[PodKey] = set()  # pods asked for and not in a read yet
        self._started = 0  # reads started
        self._running = False
        self._callers: Counter[PodKey] = Counter()
        # Per pod: the number of the last read that covered it, and its answer.
        self._results: dict[PodKey, tuple[int, NodePod | None, Exception | None]] = {}
        self.reads = 0
        self.lists = 0

    def waiting(self) -> int:
        """Callers waiting for a read."""
        with self._changed:
            return sum(self._callers.values())

    def read_pod(self, namespace: str, name: str) -> NodePod | None:
        """As :meth:`Kube.read_pod`, from a read that started after this call did."""
        return self.read_pods([(namespace, name)])[(namespace, name)]

    def read_pods(self, pods: Collection[PodKey]) -> dict[PodKey, NodePod | None]:
        """Each pod as the API shows it (None: gone, or not on this node), from a read that started
        after this call did. Raises :class:`KubeUnavailableError` when that read failed."""
        wanted = set(pods)
        with self._changed:
            after = self._started
            self._asked |= wanted
            self._callers.update(wanted)
            try:
                while not all(self._results.get(p, (0, None, None))[0] > after for p in wanted):
                    if self._running:
                        self._changed.wait()
                        continue
                    self._read_asked()
                answers = {p: self._results[p] for p in wanted}
            finally:
                self._callers.subtract(wanted)
                for p in wanted:
                    if self._callers[p] <= 0:
                        del self._callers[p]
                        self._results.pop(p, None)
        for _, _, error in answers.values():
            if error is not None:
                raise error
        return {p: pod for p, (_, pod, _) in answers.items()}

    def _read_asked(self) -> None:
        """One read of the pods asked for; called and returns with the lock held, reads without."""
        batch, self._asked = self._asked, set()
        self._running = True
        self._started += 1
        number = self._started
        self._changed.release()
        found: dict[PodKey, NodePod | None] = {}
        error: Exception | None = None
        try:
            if len(batch) == 1:
                [(namespace, name)] = batch
                found[(namespace, name)] = self._kube.read_pod(namespace, name)
                self.reads += 1
            else:
                listed = {(p.view.namespace, p.view.name): p for p in self._kube.node_pods()}
                found = {p: listed.get(p) for p in batch}
                self.lists += 1
        except Exception as e:  # handed to every caller of this read
            error = e
        finally:
            self._changed.acquire()
        for p in batch:
            if p in self._callers:
                self._results[p] = (number, found.get(p), error)
        self._running = False
        self._changed.notify_all()


def watch_events(response: Any) -> Iterator[dict[str, Any]]:
    """The events of a watch response, one JSON object per line, as they arrive."""
    pending = b""
    for chunk in response.stream(amt=None, decode_content=False):
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if line.strip():
                event: dict[str, Any] = json.loads(line)
                yield event
    if pending.strip():
        last: dict[str, Any] = json.loads(pending)
        yield last
