"""The few Kubernetes API calls the extender makes, as plain JSON (dicts), on its event loop.

Objects stay dicts in the API's own camelCase shape, the same shape kube-scheduler sends in extender
requests, so one parser (``tessera.contract.parse_pod_request``) serves both.

The calls are made with aiohttp on the loop that answers kube-scheduler: the extender runs one
thread, so a filter never waits for a bind's or a watch's thread to hand back the interpreter, and a
bind costs no hand-over to a worker thread (docs/benchmarks.md, Extender). Where to connect and how
to authenticate come from the official client's configuration loading (kubeconfig or in-cluster).

Why not kubernetes_asyncio, which runs on the loop too (measured by ``bench/kube_client.py``;
docs/benchmarks.md, "The extender's API client"): its typed models cost 6-10x the CPU per list and
6x per watch event; used raw (``_preload_content=False``), a bind or a get still costs 2-3x, because
its session trusts the environment and so hands every request to a worker thread twice (~/.netrc,
proxy variables): the hand-over this client exists to avoid.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from kubernetes import client, config

from tessera.contract import JsonObject, format_time, now
from tessera.scrapeauth import Review

log = logging.getLogger(__name__)

# Requests other than watches give up after this long, in seconds: to connect, then between reads.
CONNECT_TIMEOUT = 5.0
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=30.0)
LIST_PAGE = 500
# Every pod in the cluster (list and watch, by field selector).
PODS = "/api/v1/pods"
MERGE_PATCH = "application/merge-patch+json"
# Events the extender records name it as their source; their messages are cut to this many characters.
EVENT_SOURCE = "tessera-extender"
EVENT_MESSAGE_LIMIT = 1024
# Open connections kept to the API server: kube-scheduler binds many pods at once, and each new
# connection costs a TLS handshake.
CONNECTIONS = 32
# Seconds between reads of the bearer token (see KubeApi._headers).
TOKEN_TTL = 10.0
# A watch's reads: the stream is split into lines (one event each) here, not by aiohttp, whose
# line reader refuses lines longer than its buffer (a pod can be larger).
WATCH_READ = 1 << 16


class ApiError(Exception):
    """A non-2xx answer from the API server; ``status`` 0 when none came (connection refused or
    dropped, timed out)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message


def load_configuration(kubeconfig: Path | None) -> client.Configuration:
    """Connection settings from ``kubeconfig``, else the in-cluster service account, else
    ~/.kube/config."""
    configuration = client.Configuration()
    if kubeconfig is not None:
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    return configuration


def tls_context(configuration: client.Configuration) -> ssl.SSLContext:
    """The TLS the official client would use: the cluster's CA, a client certificate if any."""
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file or None)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class KubeApi:
    """The API server, as the extender uses it. Made outside the event loop; its connections are
    opened on first use inside it, and closed by :meth:`close`."""

    def __init__(self, configuration: client.Configuration) -> None:
        self.configuration = configuration
        self._session: aiohttp.ClientSession | None = None
        self._auth: dict[str, str] = {}
        self._auth_until = 0.0

    def _headers(self) -> dict[str, str]:
        now = time.monotonic()
        if now >= self._auth_until:
            # Through the client's refresh hook (a rotated service-account token, a kubeconfig's
            # exec plugin); it reloads files, so not on every request.
            token = self.configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
            self._auth = {"Authorization": token} if token else {}
            self._auth_until = now + TOKEN_TTL
        return {"Accept": "application/json", "Content-Type": "application/json", **self._auth}

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=tls_context(self.configuration), limit=CONNECTIONS),
                # Only the proxy the configuration names (as the official client), none from the environment.
                trust_env=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: object = None,
        timeout: aiohttp.ClientTimeout = REQUEST_TIMEOUT,
        content_type: str = "application/json",
    ) -> Any:
        return self._open().request(
            method,
            self.configuration.host + path,
            params=query,
            data=None if body is None else orjson.dumps(body),
            headers={**self._headers(), "Content-Type": content_type},
            timeout=timeout,
            proxy=self.configuration.proxy or None,
            server_hostname=self.configuration.tls_server_name or None,  # kubeconfig's tls-server-name
        )

    async def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: object = None,
        content_type: str = "application/json",
    ) -> Any:
        try:
            async with self._request(
                method, path, query=query, body=body, content_type=content_type
            ) as response:
                data = await response.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ApiError(0, f"{method} {path}: {type(e).__name__}: {e}") from e
        _raise_for_status(response.status, data)
        return orjson.loads(data)

    async def list(self, path: str, field_selector: str = "") -> tuple[list[JsonObject], str]:
        """Every item at ``path`` (paged) matching ``field_selector``, and the list's resourceVersion."""
        items: list[JsonObject] = []
        token = ""
        while True:
            query = [("limit", str(LIST_PAGE)), *_selecting(field_selector)]
            query += [("continue", token)] if token else []
            page = await self._call("GET", path, query=query)
            items.extend(page.get("items") or [])
            token = page.get("metadata", {}).get("continue") or ""
            if not token:
                return items, str(page.get("metadata", {}).get("resourceVersion", ""))

    async def watch(
        self, path: str, resource_version: str, timeout_seconds: int, field_selector: str = ""
    ) -> AsyncIterator[JsonObject]:
        """Watch events after ``resource_version`` (of items matching ``field_selector``) until the
        server ends the watch."""
        query = [
            ("watch", "1"),
            ("resourceVersion", resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(timeout_seconds)),
            *_selecting(field_selector),
        ]
        try:
            async with self._request(
                "GET", path, query=query, timeout=_watch_timeout(timeout_seconds)
            ) as response:
                if not 200 <= response.status < 300:
                    _raise_for_status(response.status, await response.read())
                pending = b""
                while chunk := await response.content.read(WATCH_READ):
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield orjson.loads(line)
                if pending.strip():
                    yield orjson.loads(pending)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ApiError(0, f"watch {path}: {type(e).__name__}: {e}") from e

    async def get_lease(self, namespace: str, name: str) -> JsonObject:
        namespaced = f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace, safe='')}"
        result: JsonObject = await self._call("GET", f"{namespaced}/leases/{quote(name, safe='')}")
        return result

    async def post_review(self, review: Review) -> JsonObject:
        """Post a TokenReview or SubjectAccessReview (tessera.scrapeauth); the API server's answer."""
        answer: JsonObject = await self._call("POST", review.path, body=review.body)
        return answer

    async def get_pod(self, namespace: str, name: str) -> JsonObject:
        result: JsonObject = await self._call("GET", _pod_path(namespace, name))
        return result

    async def bind_pod(
        self,
        namespace: str,
        name: str,
        *,
        uid: str,
        resource_version: str,
        node: str,
        annotations: dict[str, str],
    ) -> None:
        """Create the pod's Binding. The API server checks ``uid`` and ``resource_version`` (when not
        empty) as preconditions and copies ``annotations`` onto the pod in the same write."""
        metadata: JsonObject = {"name": name, "namespace": namespace, "uid": uid, "annotations": annotations}
        if resource_version:
            metadata["resourceVersion"] = resource_version
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": metadata,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        await self._call("POST", _pod_path(namespace, name) + "/binding", body=body)

    async def patch_pod_metadata(self, namespace: str, name: str, patch: JsonObject) -> None:
        """A JSON merge patch of the pod's metadata (``metadata.uid`` and ``metadata.resourceVersion``
        in it are preconditions the API server checks: 409 Conflict when the pod changed), through
        the pod's status subresource: the right kube-scheduler holds (system:kube-scheduler), so the
        extender beside it needs none of its own; the subresource keeps the spec as it is."""
        await self._call(
            "PATCH", _pod_path(namespace, name) + "/status", body=patch, content_type=MERGE_PATCH
        )

    async def create_event(self, pod: JsonObject, *, reason: str, message: str, warning: bool) -> None:
        """An event on ``pod``, as ``kubectl describe pod`` shows them."""
        metadata = pod.get("metadata") or {}
        namespace = str(metadata.get("namespace"))
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{metadata.get('name')}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": metadata.get("name"),
                "namespace": namespace,
                "uid": metadata.get("uid"),
                "resourceVersion": metadata.get("resourceVersion"),
            },
            "reason": reason,
            "message": message[:EVENT_MESSAGE_LIMIT],
            "type": "Warning" if warning else "Normal",
            "source": {"component": EVENT_SOURCE},
            "firstTimestamp": format_time(now()),
            "lastTimestamp": format_time(now()),
            "count": 1,
        }
        await self._call("POST", f"/api/v1/namespaces/{quote(namespace, safe='')}/events", body=body)


def _watch_timeout(timeout_seconds: int) -> aiohttp.ClientTimeout:
    """The server ends a watch after ``timeout_seconds``; a silent one is given up 30 s later. A
    whole-request limit rather than one between reads, which aiohttp would re-arm on every chunk."""
    return aiohttp.ClientTimeout(total=timeout_seconds + 30.0, sock_connect=CONNECT_TIMEOUT)


def _selecting(field_selector: str) -> list[tuple[str, str]]:
    return [("fieldSelector", field_selector)] if field_selector else []


def _raise_for_status(status: int, data: bytes) -> None:
    if 200 <= status < 300:
        return
    try:
        message = json.loads(data).get("message", "")
    except (ValueError, AttributeError):
        message = data.decode(errors="replace")[:300]
    raise ApiError(status, message)


def _pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"
