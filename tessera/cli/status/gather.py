"""Reading the cluster for `tessera status`: nodes, pods, FailedScheduling events, and the DRA
driver's ResourceSlices and claims through the kubeconfig's API server, and each node agent's metrics
(the device plugin's or the DRA driver's) through the API server's pod proxy."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tessera.cli.status.dra import add_dra
from tessera.cli.status.metrics import add_metrics
from tessera.cli.status.report import Json, Status, build_status
from tessera.contract import ContractKeys, now

# What an agent serving /metrics to authorized scrapers only (the chart's metricsAccess) answers
# through the API server's pod proxy, which forwards no bearer token.
HTTP_UNAUTHORIZED = 401
HTTP_FORBIDDEN = 403
NO_TOKEN_THROUGH_PROXY = (
    "not readable: the node agent serves /metrics only to a bearer token allowed get /metrics, which "
    "the API server's pod proxy does not forward (docs/observability.md)"
)
# The node agents' pods, as the chart labels them (a node runs one of the two), and the port their
# metrics are served on.
AGENT_SELECTOR = "app.kubernetes.io/name in (tessera-device-plugin,tessera-dra)"
METRICS_PORT_NAME = "metrics"
API_TIMEOUT_SECONDS = 15.0
DRA_GROUP, DRA_VERSION = "resource.k8s.io", "v1"
HTTP_NOT_FOUND = 404


class StatusError(RuntimeError):
    """What stops `tessera status`, in words for the user (no traceback)."""


def _api(kubeconfig: Path | None, context: str | None) -> Any:
    from kubernetes import client, config  # noqa: PLC0415 (imported when asked: `tessera --help` stays fast)
    from kubernetes.config.config_exception import ConfigException  # noqa: PLC0415

    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    shown = f"kubeconfig {path}" + (f", context {context!r}" if context else "")
    if kubeconfig is not None and not os.path.isfile(kubeconfig):
        raise StatusError(f"{shown}: no such file")
    try:
        api = config.new_client_from_config(
            config_file=None if kubeconfig is None else str(kubeconfig), context=context
        )
    except ConfigException as e:
        raise StatusError(f"{shown}: {e}") from None
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError) as e:
        raise StatusError(f"{shown}: not a usable kubeconfig ({type(e).__name__}: {e})") from None
    api.configuration.retries = 0
    return client, api


def _call(
    what: str,
    server: str,
    function: Callable[..., Any],
    *args: Any,
    tolerated: Callable[[Any], bool] = lambda error: False,
    **kwargs: Any,
) -> Any:
    """``function``'s response; a :class:`StatusError` saying what failed, or None for an API error
    ``tolerated`` accepts."""
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415
    from urllib3.exceptions import HTTPError  # noqa: PLC0415

    try:
        return function(*args, _preload_content=False, _request_timeout=API_TIMEOUT_SECONDS, **kwargs)
    except ApiException as e:
        if tolerated(e):
            return None
        raise StatusError(
            f"{what} from {server}: HTTP {e.status} {e.reason}: {str(e.body or '')[:300]}"
        ) from None
    except (HTTPError, OSError) as e:
        raise StatusError(f"{what} from {server}: {type(e).__name__}: {e}") from None


def _items(response: Any) -> list[Json]:
    items: list[Json] = json.loads(response.data)["items"]
    return items


def dra_items(objects: Any, plural: str, server: str, problems: list[str]) -> list[Json]:
    """Every object of a resource.k8s.io kind: none where the API server does not serve the API,
    and none with a problem said where the kubeconfig's user may not list them (the rest of the
    report stands)."""

    def tolerated(error: Any) -> bool:
        if error.status in (HTTP_UNAUTHORIZED, HTTP_FORBIDDEN):
            problems.append(f"cannot list {plural}: HTTP {error.status} {error.reason}; DRA claims not shown")
        return error.status in (HTTP_NOT_FOUND, HTTP_UNAUTHORIZED, HTTP_FORBIDDEN)

    what, list_all = f"listing {plural}", objects.list_cluster_custom_object
    response = _call(what, server, list_all, DRA_GROUP, DRA_VERSION, plural, tolerated=tolerated)
    return [] if response is None else _items(response)


def _agent_metrics(core: Any, agent: Json, timeout: float) -> str:
    """The node agent's /metrics through the API server's pod proxy."""
    port = next(
        (
            p.get("containerPort")
            for c in agent["spec"].get("containers") or []
            for p in c.get("ports") or []
            if p.get("name") == METRICS_PORT_NAME
        ),
        None,
    )
    if port is None:
        raise StatusError(f"node agent pod {agent['metadata']['name']} names no '{METRICS_PORT_NAME}' port")
    response = core.connect_get_namespaced_pod_proxy_with_path(
        f"{agent['metadata']['name']}:{port}",
        agent["metadata"]["namespace"],
        "metrics",
        _preload_content=False,
        _request_timeout=timeout,
    )
    return str(response.data.decode())


def collect(
    kubeconfig: Path | None, context: str | None, keys: ContractKeys, metrics_timeout: float | None
) -> Status:
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415
    from urllib3.exceptions import HTTPError  # noqa: PLC0415

    client, api = _api(kubeconfig, context)
    server = api.configuration.host
    try:
        core = client.CoreV1Api(api)
        nodes = _items(_call("listing nodes", server, core.list_node))
        pods = _items(_call("listing pods", server, core.list_pod_for_all_namespaces))
        events = _items(
            _call(
                "listing events",
                server,
                core.list_event_for_all_namespaces,
                field_selector="reason=FailedScheduling",
            )
        )
        report = build_status(nodes, pods, events, keys, now())
        objects = client.CustomObjectsApi(api)
        slices = dra_items(objects, "resourceslices", server, report.problems)
        claims = dra_items(objects, "resourceclaims", server, report.problems) if slices else []
        add_dra(report, slices, claims, keys)
        if metrics_timeout is not None:
            agents = {
                str(p["spec"].get("nodeName")): p
                for p in _items(
                    _call(
                        "listing node agents",
                        server,
                        core.list_pod_for_all_namespaces,
                        label_selector=AGENT_SELECTOR,
                    )
                )
                if (p.get("status") or {}).get("phase") == "Running"
            }
            for node in report.nodes:
                agent = agents.get(node.name)
                if agent is None:
                    node.metrics = "no running node agent pod"
                    continue
                try:
                    add_metrics(node, _agent_metrics(core, agent, metrics_timeout))
                except (StatusError, ApiException, HTTPError, OSError, ValueError) as e:
                    # Optional: shown per node, never fatal.
                    if isinstance(e, ApiException) and e.status in (HTTP_UNAUTHORIZED, HTTP_FORBIDDEN):
                        node.metrics = NO_TOKEN_THROUGH_PROXY
                    else:
                        node.metrics = f"not reachable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return report
    finally:
        api.close()
