"""Where the sandbox keeps everything: one directory, plus the few host paths that containerd 1.6 and
the kubelet use whatever they are told (the only ones `sandbox down` removes outside that directory).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path("/var/lib/tessera-sandbox")

# Paths outside the sandbox directory that the components use regardless of their configuration.
# containerd 1.6 puts shim sockets under /run/containerd and libcni caches results in /var/lib/cni;
# the kubelet's device plugin socket directory is a constant of the device plugin API.
HOST_CONTAINERD_RUN = Path("/run/containerd")
HOST_CNI_STATE = Path("/var/lib/cni")
HOST_DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
HOST_KUBELET_DIR = Path("/var/lib/kubelet")
# Every such path (the host directories the components create whatever they are configured with):
# a further node has its own directory at each (sandbox.nodes).
HOST_NODE_PATHS = (
    HOST_CONTAINERD_RUN,
    HOST_CNI_STATE,
    HOST_KUBELET_DIR,
    Path("/var/log/containers"),
    Path("/var/log/pods"),
    Path("/opt/containerd"),
)

# The kubelet's pods live under this cgroup in every hierarchy (cgroupRoot), so cleanup has one
# subtree to remove and never touches cgroups of anything else on the host. Cgroups are the
# machine's, even for a sandbox in a host of its own (sandbox.ownhost): such a sandbox is given a
# subtree of its own through the environment.
CGROUP_ROOT_ENV = "TESSERA_SANDBOX_CGROUP_ROOT"
DEFAULT_CGROUP_ROOT = "tessera-sandbox"


def cgroup_root_of(environ: Mapping[str, str]) -> str:
    name = environ.get(CGROUP_ROOT_ENV, DEFAULT_CGROUP_ROOT)
    if not re.fullmatch(r"[a-z0-9][-a-z0-9]*", name):
        raise ValueError(f"{CGROUP_ROOT_ENV}={name!r}: a cgroup name of lower-case letters, digits and '-'")
    return name


CGROUP_ROOT = cgroup_root_of(os.environ)
# The CNI bridge the pod network uses; `down` deletes it.
BRIDGE = "tessera0"
NETWORK_NAME = "tessera-sandbox"
POD_SUBNET = "10.244.77.0/24"
# Every node's pod subnet is in this range (the first node's is POD_SUBNET; sandbox.nodes): kube-proxy's
# clusterCIDR, and the pods' route to each other.
POD_NETWORK = "10.244.0.0/16"
# The bridge's own address (the pods' gateway); CoreDNS listens there, on the host.
BRIDGE_ADDRESS = "10.244.77.1"
# ClusterIP Services: kube-apiserver's --service-cluster-ip-range, kube-proxy's view of it, and the
# two fixed addresses in it (the `kubernetes` Service takes the first; kube-dns is the usual .10).
SERVICE_CIDR = "10.0.0.0/24"
CLUSTER_DNS_IP = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"


@dataclass(frozen=True, slots=True)
class Layout:
    """The sandbox's paths, as its processes see them. Everything one node keeps (its containerd,
    kubelet, CNI, fake GPUs and Tessera's host directories) is under :attr:`node_root`. The first
    node uses that directory as it is; each further node keeps its own (:meth:`node_home`) and sees it
    at :attr:`node_root` in a mount namespace of its own (sandbox.nodes), so configuration files,
    the chart's host paths and the processes name the same paths on every node. ``home``: the
    directory on the host that :attr:`node_root` stands for here (:meth:`place` maps paths to it), for
    writing a further node's files from the host; ``None``: the first node's."""

    root: Path
    home: Path | None = None

    @property
    def node_root(self) -> Path:
        return self.root / "node"

    @property
    def node_homes(self) -> Path:
        """Where the host keeps the further nodes' own directories, one per node."""
        return self.root / "nodes"

    def node_home(self, node: str) -> Path:
        """Where the host keeps a further node's own directory."""
        return self.node_homes / node

    def of_node(self, node: str) -> Layout:
        """This layout with a further node's files placed in its own directory."""
        return Layout(self.root, self.node_home(node) / "root")

    def place(self, path: Path) -> Path:
        """Where ``path``, as the node sees it, is on the host."""
        if self.home is None or not path.is_relative_to(self.node_root):
            return path
        return self.home / path.relative_to(self.node_root)

    @property
    def state_file(self) -> Path:
        """What `up` started (JSON): read by `down` and `status`."""
        return self.root / "sandbox.json"

    @property
    def host_snapshot(self) -> Path:
        """Host settings as they were before `up` (sysctls, pre-existing dirs), restored by `down`."""
        return self.root / "host-before.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def images(self) -> Path:
        return self.root / "images"

    @property
    def cluster(self) -> Path:
        """The control plane's own directory (etcd data, apiserver certs, kubeconfig)."""
        return self.root / "cluster"

    # containerd
    @property
    def containerd_root(self) -> Path:
        return self.node_root / "containerd" / "root"

    @property
    def containerd_state(self) -> Path:
        return self.node_root / "containerd" / "state"

    @property
    def containerd_config(self) -> Path:
        return self.node_root / "containerd" / "config.toml"

    @property
    def containerd_socket(self) -> Path:
        return self.node_root / "containerd" / "containerd.sock"

    @property
    def containerd_bin(self) -> Path:
        """A link to the directory of the containerd the sandbox runs when it is not the host's
        (containerd, containerd-shim-runc-v2, ctr; see containerd.py); absent for the host's."""
        return self.node_root / "containerd" / "bin"

    @property
    def cdi_dir(self) -> Path:
        """Where containerd reads CDI specs (cdi_spec_dirs) and the DRA driver writes them."""
        return self.node_root / "cdi"

    @property
    def driver_spec(self) -> Path:
        """The OCI base spec that places the GPU driver in every container (see containerd.py)."""
        return self.node_root / "containerd" / "nvidia-base-spec.json"

    @property
    def cni_conf_dir(self) -> Path:
        return self.node_root / "cni" / "net.d"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.node_root / "cni" / "ipam"

    # kubelet
    @property
    def kubelet_root(self) -> Path:
        return self.node_root / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.node_root / "kubelet-config.yaml"

    @property
    def kubelet_certs(self) -> Path:
        return self.node_root / "kubelet-pki"

    @property
    def static_pods(self) -> Path:
        return self.node_root / "manifests"

    @property
    def pod_logs(self) -> Path:
        return self.node_root / "pod-logs"

    # kube-proxy and CoreDNS
    @property
    def kube_proxy_config(self) -> Path:
        return self.node_root / "kube-proxy.yaml"

    @property
    def corefile(self) -> Path:
        return self.root / "Corefile"

    # Tessera's host directories (the chart's hostPaths, sandbox.install)
    @property
    def tessera_state(self) -> Path:
        return self.node_root / "tessera" / "state"

    @property
    def tessera_hook(self) -> Path:
        return self.node_root / "tessera" / "hook"

    # GPU side
    @property
    def gpu(self) -> Path:
        """The fake GPU's configuration and the device plugin's files."""
        return self.node_root / "gpu"

    # Prometheus (`up --monitoring`)
    @property
    def prometheus(self) -> Path:
        """Its configuration and its time series database."""
        return self.root / "prometheus"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"
