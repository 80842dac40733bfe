"""The API server's client of a node agent, from a kubeconfig or the pod's service account, the
Warning events either agent records on pods, and the reviews of their metrics' scrapers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from kubernetes import client, config

from nodeagent.process import SetupError
from tessera.contract import format_time, now
from tessera.scrapeauth import TOKEN_REVIEWS, Review

# Connections kept to the API server: the device plugin's kubelet calls (up to 16 at once), the
# watch, the phase writer and the publisher each hold one while they wait; a connection beyond the
# pool is closed after its call and the next call pays a new TLS handshake.
CONNECTION_POOL = 32


class KubeConfigError(SetupError):
    """No usable credentials; the message names the source."""


def load_api(kubeconfig: Path | None) -> client.ApiClient:
    configuration = client.Configuration()
    try:
        if kubeconfig is not None:
            config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)
    except (config.ConfigException, OSError) as e:
        where = (
            f"--kubeconfig {kubeconfig}" if kubeconfig is not None else "in-cluster config (no --kubeconfig)"
        )
        raise KubeConfigError(f"{where}: {e}") from None
    configuration.connection_pool_maxsize = CONNECTION_POOL
    return client.ApiClient(configuration)


class EventTarget(Protocol):
    """A pod an event is about."""

    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def uid(self) -> str: ...


def warning_event(
    pod: EventTarget, reason: str, message: str, *, component: str, node: str
) -> dict[str, Any]:
    """A Warning event on the pod, as ``kubectl describe pod`` shows it, reported by ``component``
    from ``node`` (the device plugin's admission policy checks the node)."""
    moment = format_time(now())
    return {
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
        "source": {"component": component, "host": node},
        "reportingComponent": component,
        "reportingInstance": node,
        "firstTimestamp": moment,
        "lastTimestamp": moment,
        "count": 1,
    }


def post_review(api: client.ApiClient, review: Review, timeout: tuple[float, float]) -> dict[str, Any]:
    """Post a TokenReview or SubjectAccessReview (tessera.scrapeauth); the API server's answer.
    ``timeout``: to connect, and to read the answer. Raises the client's errors."""
    post = (
        client.AuthenticationV1Api(api).create_token_review
        if review.path == TOKEN_REVIEWS
        else client.AuthorizationV1Api(api).create_subject_access_review
    )
    response = post(review.body, _preload_content=False, _request_timeout=timeout)
    answer: dict[str, Any] = json.loads(response.data)
    return answer
