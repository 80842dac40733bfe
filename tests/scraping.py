"""Scraping Tessera's /metrics as a cluster's Prometheus does: with a service account's bearer token,
which the API server allows get on /metrics (the chart's metrics-reader role), or not."""

from __future__ import annotations

import contextlib
import socket
import urllib.error

from kubernetes import client

from sandbox import install

READER_ROLE = "test-metrics-reader"


def service_account_token(
    api: client.ApiClient, name: str, *, reader: bool, namespace: str = "default"
) -> str:
    """A token of service account ``name`` (made if missing), bound to get /metrics when ``reader``."""
    if reader:
        rbac = client.RbacAuthorizationV1Api(api)
        with contextlib.suppress(client.ApiException):  # there already
            rbac.create_cluster_role(
                {
                    "metadata": {"name": READER_ROLE},
                    "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}],
                }
            )
        with contextlib.suppress(client.ApiException):
            rbac.create_cluster_role_binding(
                {
                    "metadata": {"name": f"{READER_ROLE}-{namespace}-{name}"},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": READER_ROLE,
                    },
                    "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
                }
            )
    return install.service_account_token(api, namespace, name)


def get(url: str, token: str | None, timeout: float = 10.0) -> tuple[int, str]:
    """(status, body) of a GET with ``token`` as the bearer token (none when None)."""
    try:
        return 200, install.scrape(url, token, timeout)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def host_address() -> str:
    """This machine's address the API server can proxy to (it refuses loopback), as to a pod's IP."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))
        return str(probe.getsockname()[0])
