"""`tessera status` (also `kubectl tessera status`): what Tessera holds on a cluster, from a kubeconfig.

Nodes with a Tessera inventory, their GPUs (model, memory, slices), the pods on each GPU with their
memory and cores against the GPU's capacity (from the pods' allocations), what they use when the
node agents' metrics are reachable (through the API server's pod proxy, each with a timeout), and the
pods Pending with the extender's reason (their latest FailedScheduling event). A table for a
terminal (colours only on a TTY), ``-o json`` for scripts.

Only the product's own code and the official ``kubernetes`` client: no tool library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, TextIO

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tessera.cliargs import seconds
from tessera.contract import (
    DEFAULT_DOMAIN,
    DOMAIN_ENV,
    MAX_CORES,
    MIB,
    ContractError,
    ContractKeys,
    keys_for,
    now,
    parse_allocation,
    parse_gpu_usage,
    parse_inventory,
    parse_time,
    pod_ref,
)

# What an agent serving /metrics to authorized scrapers only (the chart's metricsAccess) answers
# through the API server's pod proxy, which forwards no bearer token.
HTTP_UNAUTHORIZED = 401
HTTP_FORBIDDEN = 403
NO_TOKEN_THROUGH_PROXY = (
    "not readable: the node agent serves /metrics only to a bearer token allowed get /metrics, which "
    "the API server's pod proxy does not forward (docs/observability.md)"
)
# The node agents' pods, as the chart labels them, and the port their metrics are served on.
AGENT_SELECTOR = "app.kubernetes.io/name=tessera-device-plugin"
METRICS_PORT_NAME = "metrics"
TERMINAL_PHASES = ("Succeeded", "Failed")
API_TIMEOUT_SECONDS = 15.0


class StatusError(RuntimeError):
    """What stops `tessera status`, in words for the user (no traceback)."""


# --------------------------------------------------------------------------------------------------
# The report


@dataclass
class PodOnGpu:
    namespace: str
    pod: str
    container: str
    memory_bytes: int
    cores_percent: int
    phase: str
    # From the node agent's metrics, when reachable.
    memory_used_bytes: int | None = None


@dataclass
class GpuStatus:
    uuid: str
    index: int
    model: str
    health: str
    memory_bytes: int
    slices_total: int
    memory_allocated_bytes: int = 0
    cores_allocated_percent: int = 0
    slices_used: int = 0
    pods: list[PodOnGpu] = field(default_factory=list)
    # From the node agent's metrics (NVML), when reachable.
    memory_used_bytes: int | None = None
    utilization_ratio: float | None = None


@dataclass
class NodeStatus:
    name: str
    heartbeat_age_seconds: float | None
    # Why the node's annotations could not be read, if they could not.
    error: str | None = None
    gpus: list[GpuStatus] = field(default_factory=list)
    # "ok", "not reachable: ...", or "no node agent pod".
    metrics: str = "not asked"


@dataclass
class PendingPod:
    namespace: str
    pod: str
    reason: str


@dataclass
class Status:
    nodes: list[NodeStatus]
    pending: list[PendingPod]
    # Allocations that could not be read or name a GPU no inventory has.
    problems: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# Building it from API objects (plain JSON, as the API server sends them)

Json = Mapping[str, Any]


def _annotations(obj: Json) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def _requests_gpus(pod: Json, keys: ContractKeys) -> bool:
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        if keys.vgpu in (resources.get("limits") or {}) or keys.vgpu in (resources.get("requests") or {}):
            return True
    return False


def _event_time(event: Json) -> str:
    series = event.get("series") or {}
    return str(
        series.get("lastObservedTime")
        or event.get("lastTimestamp")
        or event.get("eventTime")
        or (event.get("metadata") or {}).get("creationTimestamp")
        or ""
    )


def _add_measured_use(gpus: dict[str, GpuStatus], text: str | None, node: str) -> None:
    """The node agent's published use (the Node's gpu-usage annotation), until its metrics, when
    readable, say more; an unreadable one adds nothing."""
    if text is None:
        return
    try:
        usage = parse_gpu_usage(text, node=node)
    except ContractError:
        return
    for measured in usage.gpus:
        gpu = gpus.get(measured.uuid)
        if gpu is not None:
            gpu.memory_used_bytes = measured.memory_used_mib * MIB
            gpu.utilization_ratio = measured.utilization_percent / 100


def build_status(
    nodes: Iterable[Json],
    pods: Iterable[Json],
    events: Iterable[Json],
    keys: ContractKeys,
    moment: datetime,
) -> Status:
    report = Status(nodes=[], pending=[])
    gpus: dict[str, GpuStatus] = {}
    for node in sorted(nodes, key=lambda n: str(n["metadata"]["name"])):
        name = str(node["metadata"]["name"])
        annotations = _annotations(node)
        text = annotations.get(keys.node_gpus)
        if text is None:
            continue  # not a Tessera node
        entry = NodeStatus(name=name, heartbeat_age_seconds=None)
        report.nodes.append(entry)
        beat = annotations.get(keys.node_heartbeat)
        try:
            if beat is not None:
                entry.heartbeat_age_seconds = (
                    moment - parse_time(beat, field=keys.node_heartbeat)
                ).total_seconds()
            inventory = parse_inventory(text, node=name)
        except ContractError as e:
            entry.error = str(e)
            continue
        for info in sorted(inventory, key=lambda g: g.index):
            gpus[info.uuid] = GpuStatus(
                uuid=info.uuid,
                index=info.index,
                model=info.model,
                health=info.health,
                memory_bytes=info.memory_mib * MIB,
                slices_total=info.split,
            )
            entry.gpus.append(gpus[info.uuid])
        _add_measured_use(gpus, annotations.get(keys.node_gpu_usage), name)

    reasons: dict[tuple[str, str], tuple[str, str]] = {}
    for event in events:
        involved = event.get("involvedObject") or {}
        where = (str(involved.get("namespace")), str(involved.get("name")))
        when = _event_time(event)
        if where not in reasons or when >= reasons[where][0]:
            reasons[where] = (when, str(event.get("message") or "").strip())

    for pod in sorted(pods, key=lambda p: (p["metadata"].get("namespace", ""), p["metadata"]["name"])):
        metadata = pod["metadata"]
        namespace, name = str(metadata.get("namespace", "")), str(metadata["name"])
        ref = pod_ref(namespace, name)
        pod_status = pod.get("status") or {}
        if pod_status.get("phase") in TERMINAL_PHASES:
            continue
        annotations = _annotations(pod)
        text = annotations.get(keys.allocation)
        node_name = (pod.get("spec") or {}).get("nodeName")
        if text is not None and node_name:
            try:
                allocation = parse_allocation(text, pod=ref)
            except ContractError as e:
                report.problems.append(str(e))
                continue
            phase = annotations.get(keys.allocation_phase, "")
            for container in allocation.containers:
                for grant in container.gpus:
                    gpu = gpus.get(grant.uuid)
                    if gpu is None:
                        report.problems.append(
                            f"pod {ref}: container {container.name} holds GPU {grant.uuid}, "
                            f"which no node's inventory lists"
                        )
                        continue
                    gpu.pods.append(
                        PodOnGpu(namespace, name, container.name, grant.memory_mib * MIB, grant.cores, phase)
                    )
                    gpu.memory_allocated_bytes += grant.memory_mib * MIB
                    gpu.cores_allocated_percent += grant.cores
                    gpu.slices_used += 1
        elif not node_name and pod_status.get("phase", "Pending") == "Pending" and _requests_gpus(pod, keys):
            reason = reasons.get((namespace, name), ("", ""))[1]
            if not reason:
                condition: Json = next(
                    (c for c in pod_status.get("conditions") or [] if c.get("type") == "PodScheduled"), {}
                )
                reason = str(condition.get("message") or "not scheduled yet (no FailedScheduling event)")
            report.pending.append(PendingPod(namespace, name, reason))
    return report


def add_metrics(node: NodeStatus, text: str) -> None:
    """Fills in what the node agent's exposition (``text``) says about the node's GPUs and pods."""
    by_uuid = {gpu.uuid: gpu for gpu in node.gpus}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            gpu = by_uuid.get(sample.labels.get("UUID", ""))
            if gpu is None:
                continue
            if sample.name == "tessera_gpu_memory_used_bytes":
                gpu.memory_used_bytes = int(sample.value)
            elif sample.name == "tessera_gpu_utilization_ratio":
                gpu.utilization_ratio = float(sample.value)
            elif sample.name == "tessera_container_memory_used_bytes":
                for pod in gpu.pods:
                    if (pod.namespace, pod.pod, pod.container) == (
                        sample.labels.get("namespace"),
                        sample.labels.get("pod"),
                        sample.labels.get("container"),
                    ):
                        pod.memory_used_bytes = int(sample.value)
    node.metrics = "ok"


# --------------------------------------------------------------------------------------------------
# Reading the cluster


def _api(kubeconfig: str | None, context: str | None) -> Any:
    from kubernetes import client, config  # noqa: PLC0415 (imported when asked: `tessera --help` stays fast)
    from kubernetes.config.config_exception import ConfigException  # noqa: PLC0415

    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    shown = f"kubeconfig {path}" + (f", context {context!r}" if context else "")
    if kubeconfig is not None and not os.path.isfile(kubeconfig):
        raise StatusError(f"{shown}: no such file")
    try:
        api = config.new_client_from_config(config_file=kubeconfig, context=context)
    except ConfigException as e:
        raise StatusError(f"{shown}: {e}") from None
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError) as e:
        raise StatusError(f"{shown}: not a usable kubeconfig ({type(e).__name__}: {e})") from None
    api.configuration.retries = 0
    return client, api


def _call(what: str, server: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415
    from urllib3.exceptions import HTTPError  # noqa: PLC0415

    try:
        return function(*args, _preload_content=False, _request_timeout=API_TIMEOUT_SECONDS, **kwargs)
    except ApiException as e:
        raise StatusError(
            f"{what} from {server}: HTTP {e.status} {e.reason}: {str(e.body or '')[:300]}"
        ) from None
    except (HTTPError, OSError) as e:
        raise StatusError(f"{what} from {server}: {type(e).__name__}: {e}") from None


def _items(response: Any) -> list[Json]:
    items: list[Json] = json.loads(response.data)["items"]
    return items


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
    kubeconfig: str | None, context: str | None, keys: ContractKeys, metrics_timeout: float | None
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


# --------------------------------------------------------------------------------------------------
# Showing it


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def _age(age: float | None) -> str:
    if age is None:
        return "no heartbeat"
    if age < 120:
        return f"heartbeat {max(age, 0):.0f}s ago"
    return f"heartbeat {age / 60:.0f}m ago"


class _Paint:
    def __init__(self, on: bool) -> None:
        self.on = on

    def __call__(self, text: str, colour: str) -> str:
        codes = {"red": "31", "green": "32", "yellow": "33", "bold": "1", "dim": "2"}
        return f"\033[{codes[colour]}m{text}\033[0m" if self.on and text else text


HEADER = ("NODE / GPU / POD", "MODEL", "MEMORY GiB", "CORES %", "SLICES", "STATE", "USE")


def render_table(report: Status, out: TextIO, colour: bool) -> None:
    paint = _Paint(colour)
    rows: list[tuple[tuple[str, ...], tuple[str, ...]]] = []  # (cells, colour per cell)

    def row(cells: Sequence[str], colours: Sequence[str] = ()) -> None:
        rows.append((tuple(cells), tuple(colours) + ("",) * (len(HEADER) - len(colours))))

    row(HEADER, ("bold",) * len(HEADER))
    for node in report.nodes:
        stale = node.heartbeat_age_seconds is None or node.heartbeat_age_seconds > 60
        state = node.error or _age(node.heartbeat_age_seconds)
        row(
            (node.name, "", "", "", "", state, "" if node.metrics == "ok" else f"metrics: {node.metrics}"),
            ("bold", "", "", "", "", "red" if node.error or stale else "green", "dim"),
        )
        for gpu in node.gpus:
            over = gpu.memory_allocated_bytes > gpu.memory_bytes or gpu.cores_allocated_percent > MAX_CORES
            use = []
            if gpu.utilization_ratio is not None:
                use.append(f"util {gpu.utilization_ratio:.0%}")
            if gpu.memory_used_bytes is not None:
                use.append(f"{_gib(gpu.memory_used_bytes)} GiB in use")
            row(
                (
                    f"  {gpu.index} {gpu.uuid}",
                    gpu.model,
                    f"{_gib(gpu.memory_allocated_bytes)} / {_gib(gpu.memory_bytes)}",
                    f"{gpu.cores_allocated_percent} / {MAX_CORES}",
                    f"{gpu.slices_used} / {gpu.slices_total}",
                    gpu.health,
                    ", ".join(use),
                ),
                (
                    "",
                    "",
                    "red" if over else "",
                    "red" if over else "",
                    "",
                    "green" if gpu.health == "Healthy" else "red",
                ),
            )
            for pod in gpu.pods:
                used = "" if pod.memory_used_bytes is None else f"{_gib(pod.memory_used_bytes)} GiB used"
                row(
                    (
                        f"    {pod_ref(pod.namespace, pod.pod)} ({pod.container})",
                        "",
                        _gib(pod.memory_bytes),
                        str(pod.cores_percent),
                        "",
                        pod.phase,
                        used,
                    ),
                    ("", "", "", "", "", "yellow" if pod.phase != "allocated" else ""),
                )
    widths = [max(len(cells[i]) for cells, _ in rows) for i in range(len(HEADER))]
    for cells, colours in rows:
        padded = [
            paint(c.ljust(w), k) if k else c.ljust(w) for c, w, k in zip(cells, widths, colours, strict=True)
        ]
        out.write("  ".join(padded).rstrip() + "\n")
    if not report.nodes:
        out.write("no node has a Tessera GPU inventory (is the device plugin running?)\n")
    if report.pending:
        out.write("\n" + paint("PENDING", "bold") + "\n")
        width = max(len(pod_ref(p.namespace, p.pod)) for p in report.pending)
        for p in report.pending:
            out.write(f"  {pod_ref(p.namespace, p.pod).ljust(width)}  {paint(p.reason, 'yellow')}\n")
    for problem in report.problems:
        out.write(paint(f"problem: {problem}", "red") + "\n")


def render_json(report: Status, out: TextIO) -> None:
    json.dump(asdict(report), out, indent=2)
    out.write("\n")


# --------------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--context", help="kubeconfig context (default: its current context)")
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table", help="default: table")
    parser.add_argument(
        "--domain",
        default=os.environ.get(DOMAIN_ENV, DEFAULT_DOMAIN),
        help=f"domain of Tessera's annotations (default: ${DOMAIN_ENV} or {DEFAULT_DOMAIN})",
    )
    parser.add_argument(
        "--metrics-timeout",
        type=seconds,
        default=3.0,
        help="seconds to wait for each node agent's metrics (through the API server; default 3)",
    )
    parser.add_argument("--no-metrics", action="store_true", help="do not ask the node agents for use")
    parser.add_argument(
        "--color", choices=("auto", "always", "never"), default="auto", help="default: auto (on a TTY)"
    )
    parser.set_defaults(func=run)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status", help="nodes, GPUs, pods on each GPU, and Pending pods with the extender's reason"
    )
    add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        keys = keys_for(args.domain)
        report = collect(
            args.kubeconfig, args.context, keys, None if args.no_metrics else args.metrics_timeout
        )
    except (StatusError, ContractError) as e:
        print(f"tessera status: {e}", file=sys.stderr)
        return 1
    if args.output == "json":
        render_json(report, sys.stdout)
    else:
        colour = args.color == "always" or (
            args.color == "auto" and sys.stdout.isatty() and "NO_COLOR" not in os.environ
        )
        render_table(report, sys.stdout, colour)
    return 0


def kubectl_main(argv: Sequence[str] | None = None) -> int:
    """`kubectl-tessera`: kubectl runs it as `kubectl tessera status ...`."""
    parser = argparse.ArgumentParser(prog="kubectl tessera", description="Tessera's view of the cluster.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register(subparsers)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result
