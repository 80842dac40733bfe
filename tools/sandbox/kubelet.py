"""The sandbox's kubelet: a real node, registered with the sandbox's apiserver, running pods through
the sandbox's containerd. The configuration follows what this kind of host needs (cgroup v1, root
without CAP_SYS_RESOURCE, containerd 1.6); docs/sandbox.md explains each setting.
"""

from __future__ import annotations

import contextlib
import re
import ssl
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml

from proto.podresources.v1 import api_pb2, api_pb2_grpc
from sandbox.layout import (
    BRIDGE_ADDRESS,
    CGROUP_ROOT,
    CLUSTER_DNS_IP,
    CLUSTER_DOMAIN,
    HOST_DEVICE_PLUGIN_DIR,
    Layout,
)
from sandbox.processes import Started, start

LOOPBACK = "127.0.0.1"


def render_config(
    layout: Layout,
    port: int,
    healthz_port: int,
    *,
    address: str = BRIDGE_ADDRESS,
    healthz_address: str = LOOPBACK,
    cgroup_root: str = f"/{CGROUP_ROOT}",
) -> dict[str, Any]:
    """The KubeletConfiguration (kubelet.config.k8s.io/v1beta1). It serves on ``address``, the
    node's InternalIP (the first node's: the pod bridge's, on the host; a further node's own, in its
    network namespace), where the apiserver reaches it for logs and exec; its health on
    ``healthz_address``; its pods under ``cgroup_root``."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # 1.35 and later refuse cgroup v1 by default; these hosts have it.
        "failCgroupV1": False,
        # containerd runs runc with cgroupfs; containerd 1.6 cannot tell the kubelet which driver.
        "cgroupDriver": "cgroupfs",
        # Every pod cgroup goes under this one subtree, which `down` removes.
        "cgroupRoot": cgroup_root,
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "failSwapOn": False,
        # False: the kubelet adjusts six kernel sysctls to its liking; `down` puts them back.
        "protectKernelDefaults": False,
        # The default (-999) cannot be set by root without CAP_SYS_RESOURCE.
        "oomScoreAdj": 0,
        "makeIPTablesUtilChains": False,
        "staticPodPath": str(layout.static_pods),
        "podLogsDir": str(layout.pod_logs),
        "resolvConf": "/etc/resolv.conf",
        # Pods with dnsPolicy ClusterFirst (the default) ask CoreDNS through the kube-dns Service.
        "clusterDNS": [CLUSTER_DNS_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "address": address,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": healthz_address,
        "healthzPort": healthz_port,
        "authentication": {
            "anonymous": {"enabled": True},
            "webhook": {"enabled": False},
            "x509": {},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "serverTLSBootstrap": False,
        "rotateCertificates": False,
        # A small shared disk must not evict the sandbox's pods.
        "evictionHard": {"nodefs.available": "1%", "imagefs.available": "1%", "memory.available": "100Mi"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # Quicker node status, so readiness and capacity show up within seconds.
        "nodeStatusUpdateFrequency": "4s",
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "5s",
    }


def write_files(layout: Layout, config: dict[str, Any]) -> None:
    for directory in (layout.kubelet_root, layout.kubelet_certs, layout.static_pods, layout.pod_logs):
        layout.place(directory).mkdir(parents=True, exist_ok=True)
    layout.place(layout.kubelet_config).write_text(yaml.safe_dump(config, sort_keys=False))


def start_kubelet(
    layout: Layout,
    binary: Path,
    kubeconfig: Path,
    node_name: str,
    *,
    name: str = "kubelet",
    enter: Sequence[str] = (),
    node_ip: str = BRIDGE_ADDRESS,
) -> Started:
    """The kubelet of node ``node_name``, recorded as ``name``; ``enter`` and ``node_ip``: a
    further node's namespaces (sandbox.nodes.enter) and address (the first node's: the bridge's)."""
    argv = [
        *enter,
        str(binary),
        f"--config={layout.kubelet_config}",
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node_name}",
        f"--root-dir={layout.kubelet_root}",
        f"--cert-dir={layout.kubelet_certs}",
        f"--node-ip={node_ip}",
        "--v=2",
    ]
    return start(name, argv, layout.log(name.replace("/", "-")))


def pod_resources_socket(layout: Layout) -> Path:
    return layout.place(layout.kubelet_root / "pod-resources" / "kubelet.sock")


def allocatable_devices(layout: Layout, resource: str) -> list[str]:
    """Device IDs the kubelet itself can hand out for ``resource`` (pod-resources API); empty until
    a device plugin for it has registered with this kubelet and listed healthy devices."""
    try:
        with grpc.insecure_channel(f"unix://{pod_resources_socket(layout)}") as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            response = stub.GetAllocatableResources(api_pb2.AllocatableResourcesRequest(), timeout=5)
    except grpc.RpcError:
        return []
    return [i for d in response.devices if d.resource_name == resource for i in d.device_ids]


def plugin_socket_since(since: float) -> bool:
    """A plugin socket (any but the kubelet's own) created in the device plugin directory since."""
    for path in HOST_DEVICE_PLUGIN_DIR.glob("*.sock"):
        with contextlib.suppress(OSError):
            if path.name != "kubelet.sock" and path.stat().st_mtime >= since - 1:
                return True
    return False


# The kubelet's plugin manager's gauge: one series per plugin socket it has registered.
REGISTERED_PLUGIN = re.compile(
    r'^plugin_manager_total_plugins\{socket_path="([^"]+)",state="actual_state_of_world"\} 1$', re.M
)


def metrics(port: int, address: str = BRIDGE_ADDRESS) -> str | None:
    """The kubelet's Prometheus metrics (its serving port, anonymous access as configured above);
    None while they cannot be read."""
    # The sandbox's own networks only, the kubelet's self-signed serving certificate: nothing to
    # verify it against.
    unverified = ssl.create_default_context()
    unverified.check_hostname = False
    unverified.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(f"https://{address}:{port}/metrics", timeout=5, context=unverified) as r:
            return str(r.read().decode())
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return None


def registered_plugins(port: int, address: str = BRIDGE_ADDRESS) -> list[str]:
    """The registration sockets of the plugins (DRA drivers, CSI) the kubelet has registered, from
    its metrics; empty while they cannot be read."""
    return REGISTERED_PLUGIN.findall(metrics(port, address) or "")


def dra_driver_registered(layout: Layout, port: int, address: str = BRIDGE_ADDRESS) -> bool:
    """The kubelet has registered a DRA driver of the node's plugin registry (``layout``'s: every
    node's kubelet sees its own at the same path)."""
    registry = f"{layout.kubelet_root / 'plugins_registry'}/"
    return any(p.startswith(registry) for p in registered_plugins(port, address))


def healthy(healthz_port: int, address: str = LOOPBACK) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}:{healthz_port}/healthz", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False
