"""The sandbox as a cluster a chart can be installed into: the pinned kubelet on containerd runs pods
of the project's own image; kube-controller-manager runs Deployments, DaemonSets, service account
tokens and garbage collection; kube-proxy routes ClusterIP Services; CoreDNS resolves Service names;
each survives a restart. On the shared sandbox, which test_chaos.py brings down last."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from sandbox import cluster, images
from sandbox.layout import BRIDGE_ADDRESS, CLUSTER_DNS_IP
from tests.sandbox.conftest import Sandbox, kube_iptables_chains

pytestmark = pytest.mark.sandbox

NS = "default"
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def _container(name: str, script: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "image": images.PROBE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", script],
        **extra,
    }


def _web_deployment() -> dict[str, Any]:
    # busybox httpd serves the pod's own name, so a client sees which pod answered.
    serve = "mkdir -p /www && hostname > /www/index.html && exec httpd -f -p 8080 -h /www"
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        _container(
                            "web",
                            serve,
                            readinessProbe={"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                        )
                    ],
                },
            },
        },
    }


def _daemonset() -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "agent"},
        "spec": {
            "selector": {"matchLabels": {"app": "agent"}},
            "template": {
                "metadata": {"labels": {"app": "agent"}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [_container("agent", "exec sleep 3600")],
                },
            },
        },
    }


def _until(what: str, check: Callable[[], Any], timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def _ready_pods(core: client.CoreV1Api, selector: str) -> set[str]:
    return {
        p.metadata.name
        for p in core.list_namespaced_pod(NS, label_selector=selector).items
        if p.metadata.deletion_timestamp is None
        and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    }


def _two_ready(core: client.CoreV1Api, without: str = "") -> set[str] | None:
    """The web Deployment's two ready pods (neither named ``without``), or None."""
    ready = _ready_pods(core, "app=web")
    return ready if len(ready) == 2 and without not in ready else None


def _http_get(address: str) -> str:
    # busybox nc (wget in busybox-static crashes in these images), HTTP/1.0 so the server closes.
    return f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {address} 80"


def test_controllers_services_dns_tokens_gc_and_restarts(shared_sandbox: Sandbox) -> None:
    sandbox = shared_sandbox
    core, apps = sandbox.core, client.AppsV1Api(sandbox.api)
    status = cluster.status(sandbox.root)["processes"]
    for name in ("kube-controller-manager", "kube-proxy", "coredns", "prometheus"):
        assert status[name] == "running"
    assert kube_iptables_chains() != []  # kube-proxy's rules are in place
    # The pinned kubelet, on the containerd hack/install-sandbox-deps.sh installs.
    info = core.read_node(sandbox.state.node).status.node_info
    assert info.kubelet_version == "v1.34.10"
    assert info.container_runtime_version.startswith("containerd://1.6")

    # A Deployment of 2 becomes Ready; a deleted pod is replaced.
    apps.create_namespaced_deployment(NS, _web_deployment())
    first = _until("2 ready web pods", lambda: _two_ready(core))
    assert all(core.read_namespaced_pod(name, NS).status.pod_ip.startswith("10.244.77.") for name in first)
    [replica_set] = apps.list_namespaced_replica_set(NS, label_selector="app=web").items
    victim = sorted(first)[0]
    core.delete_namespaced_pod(victim, NS, grace_period_seconds=0)
    second = _until(
        "a replacement web pod",
        lambda: _two_ready(core, without=victim),
    )
    assert len(second - first) == 1
    core.create_namespaced_service(
        NS,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    )
    service_ip = core.read_namespaced_service("web", NS).spec.cluster_ip

    # Each cluster component survives a restart: later steps need all three working.
    for name in ("kube-controller-manager", "kube-proxy", "coredns"):
        old = sandbox.state.process(name).pid
        assert cluster.restart(sandbox.root, name).pid != old
    assert set(cluster.status(sandbox.root)["processes"].values()) == {"running"}

    # A DaemonSet runs one pod on the node.
    apps.create_namespaced_daemon_set(NS, _daemonset())
    _until("the DaemonSet's pod", lambda: _ready_pods(core, "app=agent") or None)
    ds = apps.read_namespaced_daemon_set("agent", NS).status
    assert (ds.desired_number_scheduled, ds.number_ready) == (1, 1)
    [agent] = core.list_namespaced_pod(NS, label_selector="app=agent").items
    assert agent.spec.node_name == sandbox.state.node

    # From another pod: the Service by its ClusterIP and by name (CoreDNS through the kube-dns
    # Service), the API server through the `kubernetes` Service, and the mounted token.
    script = "; ".join(
        [
            f"cat {TOKEN_PATH}/namespace; echo",
            f"echo token=$(cat {TOKEN_PATH}/token)",
            f"test -s {TOKEN_PATH}/ca.crt && echo ca-present",
            "grep nameserver /etc/resolv.conf",
            _http_get(service_ip),
            f"nslookup web.{NS}.svc.cluster.local",
            _http_get("web"),
            "echo | nc -w 5 $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT && echo api-reachable",
            "sleep 3600",
        ]
    )
    core.create_namespaced_pod(
        NS,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "client"},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [_container("client", script)]},
        },
    )
    sandbox.wait_pod("client", "Running")
    log = sandbox.logs("client", until="api-reachable", timeout=60)
    assert log.startswith(f"{NS}\n"), log
    assert "ca-present" in log and f"nameserver {CLUSTER_DNS_IP}" in log
    assert log.count("HTTP/1.1 200 OK") == 2, log
    assert any(pod in log for pod in second), log
    assert f"Name:\tweb.{NS}.svc.cluster.local\nAddress: {service_ip}" in log, log
    assert "api-reachable" in log, log
    # The token is one the API server accepts: as the pod's service account, refused by RBAC (403),
    # not unauthenticated (401).
    token = next(line for line in log.splitlines() if line.startswith("token=")).removeprefix("token=")
    configuration = client.Configuration()
    configuration.host = sandbox.state.api_url
    configuration.ssl_ca_cert = str(sandbox.root / "cluster" / "pki" / "apiserver.crt")
    configuration.api_key = {"authorization": f"Bearer {token}"}
    with client.ApiClient(configuration) as as_pod, pytest.raises(client.ApiException) as refused:
        client.CoreV1Api(as_pod).list_namespaced_secret(NS)
    assert refused.value.status == 403
    assert f"system:serviceaccount:{NS}:default" in str(refused.value.body)
    assert sandbox.state.api_url.startswith(f"https://{BRIDGE_ADDRESS}:")

    # Deleting the Deployment deletes its ReplicaSet and pods (garbage collection by owner).
    apps.delete_namespaced_deployment("web", NS, propagation_policy="Background")
    _until(
        "the garbage collector to remove the ReplicaSet and its pods",
        lambda: (
            not apps.list_namespaced_replica_set(NS, label_selector="app=web").items
            and not core.list_namespaced_pod(NS, label_selector="app=web").items
        ),
    )
    with pytest.raises(client.ApiException) as gone:
        apps.read_namespaced_replica_set(replica_set.metadata.name, NS)
    assert gone.value.status == 404
