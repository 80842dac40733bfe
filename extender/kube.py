"""The few Kubernetes API calls the extender makes, as plain JSON (dicts), through the official client.

Objects stay dicts in the API's own camelCase shape, the same shape kube-scheduler sends in extender
requests, so one parser (``tessera.contract.parse_pod_request``) serves both.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

import orjson
import urllib3
from kubernetes import client, config
from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger(__name__)

JsonObject = dict[str, Any]

# Requests other than watches give up after this long (connect, read) in seconds.
REQUEST_TIMEOUT = (5.0, 30.0)
LIST_PAGE = 500
CONNECTIONS = 48
# Seconds between reads of the bearer token (see KubeApi._headers).
TOKEN_TTL = 10.0


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def load_client(kubeconfig: str | None) -> client.ApiClient:
    """An API client from ``kubeconfig``, else the in-cluster service account, else ~/.kube/config."""
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    # kube-scheduler binds many pods at once; connections beyond the pool are opened and closed per
    # request, each with a TLS handshake. Keep one per concurrent bind (Starlette's thread pool: 40).
    configuration.connection_pool_maxsize = CONNECTIONS
    return client.ApiClient(configuration)


class KubeApi:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self._auth: dict[str, str] = {}
        self._auth_until = 0.0

    def _headers(self) -> dict[str, str]:
        now = time.monotonic()
        if now >= self._auth_until:
            # Through the client's refresh hook (a rotated service-account token, a kubeconfig's
            # exec plugin); it reloads files, so not on every request. A race here only reloads twice.
            token = self.api.configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
            self._auth = {"Authorization": token} if token else {}
            self._auth_until = now + TOKEN_TTL
        return {"Accept": "application/json", "Content-Type": "application/json", **self._auth}

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: object = None,
        timeout: tuple[float, float] = REQUEST_TIMEOUT,
        stream: bool = False,
    ) -> Any:
        # Straight through the client's connection pool (its TLS, client certificates and proxy):
        # the client's request building and model sanitising cost more than the request itself.
        url = self.api.configuration.host + path + (f"?{urlencode(query)}" if query else "")
        response = self.api.rest_client.pool_manager.request(
            method,
            url,
            body=None if body is None else orjson.dumps(body),
            headers=self._headers(),
            timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]),
            preload_content=False,
        )
        if stream and 200 <= response.status < 300:
            return response
        try:
            data = response.read()
        finally:
            # Not preloaded: give the connection back to the pool for the next call.
            response.release_conn()
        if not 200 <= response.status < 300:
            try:
                message = json.loads(data).get("message", "")
            except (ValueError, AttributeError):
                message = data.decode(errors="replace")[:300]
            raise ApiError(response.status, message)
        return orjson.loads(data)

    def list(self, path: str) -> tuple[list[JsonObject], str]:
        """Every item at ``path`` (paged) and the list's resourceVersion."""
        items: list[JsonObject] = []
        token = ""
        while True:
            query = [("limit", str(LIST_PAGE))] + ([("continue", token)] if token else [])
            page = self._call("GET", path, query=query)
            items.extend(page.get("items") or [])
            token = page.get("metadata", {}).get("continue") or ""
            if not token:
                return items, str(page.get("metadata", {}).get("resourceVersion", ""))

    def watch(self, path: str, resource_version: str, timeout_seconds: int) -> Iterator[JsonObject]:
        """Watch events after ``resource_version`` until the server ends the watch."""
        query = [
            ("watch", "1"),
            ("resourceVersion", resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(timeout_seconds)),
        ]
        response = self._call("GET", path, query=query, timeout=(5.0, timeout_seconds + 30.0), stream=True)
        try:
            for line in iter_resp_lines(response):
                yield orjson.loads(line)
        finally:
            response.release_conn()

    def get_pod(self, namespace: str, name: str) -> JsonObject:
        result: JsonObject = self._call("GET", _pod_path(namespace, name))
        return result

    def bind_pod(
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
        self._call("POST", _pod_path(namespace, name) + "/binding", body=body)


def _pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"
