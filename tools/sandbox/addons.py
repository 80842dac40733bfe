"""What makes the sandbox a cluster a Helm chart can be installed into, besides the control plane:
kube-proxy (iptables mode, so ClusterIP Services route) and cluster DNS (CoreDNS, so Service names
resolve: the chart's kube-scheduler calls the extender at ``tessera-extender.<namespace>.svc``).

Both run as host processes, like the kubelet. CoreDNS listens on the pod bridge's own address; the
``kube-dns`` Service (``CLUSTER_DNS_IP``, the kubelet's ``clusterDNS``) has that address as its one
endpoint, so pods reach it through kube-proxy like any Service. kube-controller-manager is started
by :mod:`sandbox.controlplane`.
"""

from __future__ import annotations

import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from sandbox.layout import (
    BRIDGE,
    BRIDGE_ADDRESS,
    CLUSTER_DNS_IP,
    CLUSTER_DOMAIN,
    POD_NETWORK,
    POD_SUBNET,
    Layout,
)
from sandbox.processes import Started, start

LOOPBACK = "127.0.0.1"
DNS_NAMESPACE = "kube-system"
DNS_SERVICE = "kube-dns"


def kube_proxy_config(
    kubeconfig: Path, node: str, healthz_port: int, metrics_port: int, address: str = LOOPBACK
) -> dict[str, Any]:
    """The KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1); its health and metrics on
    ``address`` (a further node's own, in its network namespace)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "hostnameOverride": node,
        # Traffic from outside this range (every node's pods) to a Service is masqueraded
        # (detectLocalMode ClusterCIDR).
        "clusterCIDR": POD_NETWORK,
        "healthzBindAddress": f"{address}:{healthz_port}",
        "metricsBindAddress": f"{address}:{metrics_port}",
        # Leave the host's conntrack sysctls alone (0: do not set); `down` could not tell kube-proxy's
        # values from anyone else's.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
            "udpTimeout": "0s",
            "udpStreamTimeout": "0s",
        },
        # No NodePorts on 127.0.0.1: that needs net.ipv4.conf.all.route_localnet=1 on the host.
        "iptables": {"localhostNodePorts": False, "syncPeriod": "30s", "minSyncPeriod": "0s"},
    }


def write_kube_proxy_config(
    layout: Layout,
    kubeconfig: Path,
    node: str,
    healthz_port: int,
    metrics_port: int,
    *,
    address: str = LOOPBACK,
) -> None:
    config = kube_proxy_config(kubeconfig, node, healthz_port, metrics_port, address)
    layout.place(layout.kube_proxy_config).write_text(yaml.safe_dump(config, sort_keys=False))


def start_kube_proxy(
    layout: Layout, binary: Path, *, name: str = "kube-proxy", enter: Sequence[str] = ()
) -> Started:
    argv = [*enter, str(binary), f"--config={layout.kube_proxy_config}", "--v=1"]
    return start(name, argv, layout.log(name.replace("/", "-")))


def cleanup_kube_proxy(binary: Path) -> None:
    """``kube-proxy --cleanup``: removes the KUBE-* chains and rules kube-proxy made (iptables, and
    IPVS/nftables where those exist). `down` then checks and sweeps what is left itself."""
    if binary.exists():
        subprocess.run([str(binary), "--cleanup", "--v=0"], capture_output=True, timeout=60, check=False)


def render_corefile(kubeconfig: Path, health_port: int, ready_port: int) -> str:
    return (
        ".:53 {\n"
        f"    bind {BRIDGE_ADDRESS}\n"
        "    errors\n"
        f"    health {LOOPBACK}:{health_port}\n"
        f"    ready {LOOPBACK}:{ready_port}\n"
        f"    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{\n"
        f"        kubeconfig {kubeconfig}\n"
        "        pods insecure\n"
        "        fallthrough in-addr.arpa ip6.arpa\n"
        "    }\n"
        "    forward . /etc/resolv.conf\n"
        "    cache 30\n"
        "}\n"
    )


def create_bridge() -> None:
    """The pod bridge with its gateway address, before any pod: CoreDNS binds that address. The CNI
    bridge plugin (isGateway) finds the bridge and the address already there and keeps them; `down`
    deletes the bridge as before."""
    subprocess.run(["ip", "link", "add", BRIDGE, "type", "bridge"], capture_output=True, check=False)
    existing = subprocess.run(
        ["ip", "-o", "-4", "addr", "show", "dev", BRIDGE], capture_output=True, text=True, check=True
    ).stdout
    prefix = POD_SUBNET.split("/")[1]
    if f" {BRIDGE_ADDRESS}/" not in existing:
        subprocess.run(
            ["ip", "addr", "add", f"{BRIDGE_ADDRESS}/{prefix}", "dev", BRIDGE],
            capture_output=True,
            check=True,
        )
    subprocess.run(["ip", "link", "set", BRIDGE, "up"], capture_output=True, check=True)


def start_coredns(
    layout: Layout, binary: Path, kubeconfig: Path, health_port: int, ready_port: int
) -> Started:
    layout.corefile.write_text(render_corefile(kubeconfig, health_port, ready_port))
    argv = [str(binary), f"-conf={layout.corefile}"]
    return start("coredns", argv, layout.log("coredns"), cwd=layout.root)


def dns_service_objects() -> tuple[dict[str, Any], dict[str, Any]]:
    """The kube-dns Service (no selector: CoreDNS is not a pod) and its EndpointSlice."""
    ports = [("dns", "UDP"), ("dns-tcp", "TCP")]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": DNS_SERVICE,
            "namespace": DNS_NAMESPACE,
            "labels": {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"},
        },
        "spec": {
            "clusterIP": CLUSTER_DNS_IP,
            "ports": [{"name": n, "protocol": p, "port": 53, "targetPort": 53} for n, p in ports],
        },
    }
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{DNS_SERVICE}-host",
            "namespace": DNS_NAMESPACE,
            "labels": {
                "kubernetes.io/service-name": DNS_SERVICE,
                "endpointslice.kubernetes.io/managed-by": "sandbox.tessera.local",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [BRIDGE_ADDRESS], "conditions": {"ready": True}}],
        "ports": [{"name": n, "protocol": p, "port": 53} for n, p in ports],
    }
    return service, endpoints


def create_dns_service(api: client.ApiClient) -> None:
    service, endpoints = dns_service_objects()
    client.CoreV1Api(api).create_namespaced_service(DNS_NAMESPACE, service)
    client.DiscoveryV1Api(api).create_namespaced_endpoint_slice(DNS_NAMESPACE, endpoints)


def http_ok(url: str) -> bool:
    """A health endpoint answers 200. kube-controller-manager's serves HTTPS with a certificate it
    made itself, so that one is not verified (a readiness probe on loopback, nothing is sent)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def service_accounts_ready(api: client.ApiClient, namespace: str = "default") -> bool:
    """kube-controller-manager made the namespace's default service account and the CA ConfigMap
    its token volume reads: only then does the API server admit pods there."""
    core = client.CoreV1Api(api)
    try:
        core.read_namespaced_service_account("default", namespace)
        core.read_namespaced_config_map("kube-root-ca.crt", namespace)
    except client.ApiException:
        return False
    return True
