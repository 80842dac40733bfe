"""Tessera installed into the sandbox as a platform team installs it: the images `make images` built,
imported into the node's containerd, and `helm install` of charts/tessera with
deploy/sandbox-values.yaml. Every Tessera component then runs as a pod: the node agent as the
DaemonSet, kube-scheduler (profile tessera-scheduler) with the extender beside it as a Deployment of
two leader-elected replicas.

The only values beyond the file are where this sandbox's directories are on the host (they live
under the sandbox directory, which `down` removes): the agent's state dir, the hook dir and the
kubelet's pod-resources dir.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from sandbox.layout import Layout
from sandbox.processes import StartError
from tessera.contract import KEYS

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tessera"
SANDBOX_VALUES = REPO / "deploy" / "sandbox-values.yaml"
RELEASE = "tessera"
NAMESPACE = "tessera-system"
# The node agent in either mode of the chart: tessera-device-plugin or tessera-dra.
AGENT_SELECTOR = "app.kubernetes.io/name in (tessera-device-plugin,tessera-dra)"
EXTENDER_SELECTOR = "app.kubernetes.io/name=tessera-extender"
SCHEDULER_DEPLOYMENT = "tessera-scheduler"
# The extender's health port (the chart's extender.healthPort): /readyz and /metrics, never a verb.
EXTENDER_HEALTH_PORT = 8889
# The OCI archives hack/build-images.sh writes: the product, the chart's kube-scheduler and the
# example of a user's workload image.
IMAGE_ARCHIVES = ("tessera.tar", "kube-scheduler.tar", "tessera-example-python.tar")
HELM_TIMEOUT = 120.0
# The service account the sandbox scrapes Tessera's /metrics as (its Prometheus and the tests).
SCRAPER = "metrics-scraper"


def images_dir() -> Path:
    """Where `make images` leaves the OCI archives (TESSERA_IMAGES_DIR, as hack/build-images.sh)."""
    return Path(os.environ.get("TESSERA_IMAGES_DIR", REPO / "build" / "images"))


def image_archives() -> dict[str, Path]:
    return {name: images_dir() / name for name in IMAGE_ARCHIVES}


def missing_images() -> list[str]:
    return [f"{path} (run `make images`)" for path in image_archives().values() if not path.exists()]


@dataclass(frozen=True, slots=True)
class HostDirs:
    """The chart's host paths in this sandbox, all under the sandbox directory."""

    state: Path
    hook: Path
    pod_resources: Path
    kubelet: Path
    cdi: Path

    def values(self) -> list[str]:
        return [
            f"devicePlugin.stateDir={self.state}",
            f"devicePlugin.hookDir={self.hook}",
            f"devicePlugin.podResourcesDir={self.pod_resources}",
            f"dra.kubeletDir={self.kubelet}",
            f"dra.cdiDir={self.cdi}",
        ]


def host_dirs(layout: Layout) -> HostDirs:
    return HostDirs(
        state=layout.tessera_state,
        hook=layout.tessera_hook,
        pod_resources=layout.kubelet_root / "pod-resources",
        kubelet=layout.kubelet_root,
        cdi=layout.cdi_dir,
    )


def helm(helm_binary: Path, kubeconfig: Path, *args: str, timeout: float = HELM_TIMEOUT) -> str:
    """Run helm against the sandbox; its output, or a StartError with the command and helm's words."""
    argv = [str(helm_binary), f"--kubeconfig={kubeconfig}", *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise StartError(f"helm {' '.join(args[:3])}: no answer after {timeout:.0f}s") from None
    if done.returncode != 0:
        raise StartError(f"helm {' '.join(args[:3])} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def install_args(layout: Layout, values: Sequence[str] = ()) -> list[str]:
    """`helm install tessera charts/tessera -n tessera-system --create-namespace` with the sandbox's
    values file, its host directories and the user's own ``values`` (``KEY=VALUE``, as helm --set)."""
    args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace"]
    args += ["--values", str(SANDBOX_VALUES)]
    for value in host_dirs(layout).values():
        args += ["--set-string", value]
    for value in values:
        args += ["--set", value]
    return args


def make_host_dirs(layout: Layout) -> None:
    """The chart's host directories the node does not make itself (before the chart is installed,
    and on every further node before its agent starts)."""
    dirs = host_dirs(layout)
    for directory in (dirs.state, dirs.hook):
        layout.place(directory).mkdir(parents=True, exist_ok=True)


def install(helm_binary: Path, kubeconfig: Path, layout: Layout, values: Sequence[str] = ()) -> str:
    make_host_dirs(layout)
    return helm(helm_binary, kubeconfig, *install_args(layout, values))


def _ready(pod: client.V1Pod) -> bool:
    return pod.metadata.deletion_timestamp is None and any(
        c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or [])
    )


def agent_pods(api: client.ApiClient, node: str) -> list[client.V1Pod]:
    pods: list[client.V1Pod] = (
        client.CoreV1Api(api)
        .list_namespaced_pod(NAMESPACE, label_selector=AGENT_SELECTOR, field_selector=f"spec.nodeName={node}")
        .items
    )
    return pods


def service_account_token(api: client.ApiClient, namespace: str, name: str, seconds: int = 3600) -> str:
    """A token (TokenRequest) of service account ``name``, which is made if missing."""
    core = client.CoreV1Api(api)
    try:
        core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    except client.ApiException as e:
        if e.status != 409:
            raise
    request = {"spec": {"expirationSeconds": seconds}}
    token: str = core.create_namespaced_service_account_token(name, namespace, request).status.token
    return token


def scraper_token(api: client.ApiClient, seconds: int = 3600) -> str:
    """A token of the sandbox's scraper (deploy/sandbox-values.yaml binds it the chart's
    metrics-reader role, as a cluster binds Prometheus's service account)."""
    return service_account_token(api, NAMESPACE, SCRAPER, seconds)


def scrape(url: str, token: str | None, timeout: float = 10.0) -> str:
    """GET ``url`` (a /metrics) with ``token`` as its bearer token."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
        return str(response.read().decode())


def agent_metrics_url(api: client.ApiClient, node: str) -> str:
    (agent,) = agent_pods(api, node)
    port = next(p.container_port for p in agent.spec.containers[0].ports if p.name == "metrics")
    return f"http://{agent.status.pod_ip}:{port}/metrics"


def agent_metrics(api: client.ApiClient, node: str) -> str:
    """The Prometheus text the node agent on ``node`` serves on its pod's ``metrics`` port, read as
    the sandbox's scraper."""
    return scrape(agent_metrics_url(api, node), scraper_token(api, seconds=600))


def extender_pods(api: client.ApiClient) -> list[client.V1Pod]:
    pods: list[client.V1Pod] = (
        client.CoreV1Api(api).list_namespaced_pod(NAMESPACE, label_selector=EXTENDER_SELECTOR).items
    )
    return pods


def agent_ready(api: client.ApiClient, node: str) -> bool:
    return any(_ready(p) for p in agent_pods(api, node))


def extenders_ready(api: client.ApiClient) -> bool:
    """Every replica of the chart's scheduler Deployment is ready (its extender's caches synced)."""
    try:
        deployment = client.AppsV1Api(api).read_namespaced_deployment(SCHEDULER_DEPLOYMENT, NAMESPACE)
    except client.ApiException:
        return False
    wanted = deployment.spec.replicas or 0
    ready = sum(_ready(p) for p in extender_pods(api))
    return wanted > 0 and ready >= wanted


def extender_health_urls(api: client.ApiClient) -> list[str]:
    """The health port of every ready extender, by pod IP (the host reaches the pod network)."""
    return [
        f"http://{p.status.pod_ip}:{EXTENDER_HEALTH_PORT}"
        for p in extender_pods(api)
        if _ready(p) and p.status.pod_ip
    ]


def extender_node_count(url: str, token: str) -> float:
    """Nodes with a GPU inventory that an extender holds (its ``tessera_extender_nodes`` gauge), read
    with the scraper's ``token``; -1 while it cannot be read."""
    try:
        text = scrape(f"{url}/metrics", token, timeout=2)
    except (urllib.error.URLError, OSError):
        return -1
    for line in text.splitlines():
        if line.startswith("tessera_extender_nodes "):
            return float(line.split()[1])
    return -1


def extenders_know(api: client.ApiClient, nodes: int) -> bool:
    """Every ready extender holds at least ``nodes`` nodes with a GPU inventory: whichever replica
    leads, a new node is not unknown to it."""
    urls = extender_health_urls(api)
    if not urls:
        return False
    token = scraper_token(api, seconds=600)
    return all(extender_node_count(u, token) >= nodes for u in urls)


def nodes_with_inventory(api: client.ApiClient) -> int:
    return sum(
        KEYS.node_gpus in (n.metadata.annotations or {}) for n in client.CoreV1Api(api).list_node().items
    )


def wait(what: str, ready: Callable[[], bool], timeout: float, explain: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise StartError(f"{what}: not after {timeout:.0f}s; {explain()}")
        time.sleep(0.5)


def describe_pods(api: client.ApiClient) -> str:
    """The chart's pods and why each is not ready, for a failure message."""
    lines = []
    for pod in client.CoreV1Api(api).list_namespaced_pod(NAMESPACE).items:
        waiting = [
            f"{s.name}: {s.state.waiting.reason}"
            if s.state and s.state.waiting
            else f"{s.name}: ready={s.ready}"
            for s in [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])]
        ]
        lines.append(f"{pod.metadata.name} {pod.status.phase} ({'; '.join(waiting) or 'no containers yet'})")
    return "pods in " + NAMESPACE + ": " + (", ".join(lines) or "none")


def restart_agent(api: client.ApiClient, node: str, timeout: float) -> str:
    """Delete the node agent's pod, as an operator would; the DaemonSet makes a new one. Returns the
    new pod's name once it is ready."""
    core = client.CoreV1Api(api)
    old = {p.metadata.name for p in agent_pods(api, node)}
    for name in old:
        core.delete_namespaced_pod(name, NAMESPACE)
    wait(
        "the DaemonSet's new node agent",
        lambda: any(_ready(p) and p.metadata.name not in old for p in agent_pods(api, node)),
        timeout,
        lambda: describe_pods(api),
    )
    [new] = [p.metadata.name for p in agent_pods(api, node) if p.metadata.name not in old and _ready(p)]
    return str(new)
