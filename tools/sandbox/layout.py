"""Where the sandbox keeps everything: one directory, plus the few host paths that containerd 1.6 and
the kubelet use whatever they are told (the only ones `sandbox down` removes outside that directory).
"""

from __future__ import annotations

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

# The kubelet's pods live under this cgroup in every hierarchy (cgroupRoot), so cleanup has one
# subtree to remove and never touches cgroups of anything else on the host.
CGROUP_ROOT = "tessera-sandbox"
# The CNI bridge the pod network uses; `down` deletes it.
BRIDGE = "tessera0"
NETWORK_NAME = "tessera-sandbox"
POD_SUBNET = "10.244.77.0/24"
# The bridge's own address (the pods' gateway); CoreDNS listens there, on the host.
BRIDGE_ADDRESS = "10.244.77.1"
# ClusterIP Services: kube-apiserver's --service-cluster-ip-range, kube-proxy's view of it, and the
# two fixed addresses in it (the `kubernetes` Service takes the first; kube-dns is the usual .10).
SERVICE_CIDR = "10.0.0.0/24"
CLUSTER_DNS_IP = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"


@dataclass(frozen=True, slots=True)
class Layout:
    root: Path

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
        return self.root / "containerd" / "root"

    @property
    def containerd_state(self) -> Path:
        return self.root / "containerd" / "state"

    @property
    def containerd_config(self) -> Path:
        return self.root / "containerd" / "config.toml"

    @property
    def containerd_socket(self) -> Path:
        return self.root / "containerd" / "containerd.sock"

    @property
    def containerd_bin(self) -> Path:
        """A link to the directory of the containerd the sandbox runs when it is not the host's
        (containerd, containerd-shim-runc-v2, ctr; see containerd.py); absent for the host's."""
        return self.root / "containerd" / "bin"

    @property
    def cdi_dir(self) -> Path:
        """Where containerd reads CDI specs (cdi_spec_dirs) and the DRA driver writes them."""
        return self.root / "cdi"

    @property
    def driver_spec(self) -> Path:
        """The OCI base spec that places the GPU driver in every container (see containerd.py)."""
        return self.root / "containerd" / "nvidia-base-spec.json"

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.root / "cni" / "ipam"

    # kubelet
    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.root / "kubelet-config.yaml"

    @property
    def kubelet_certs(self) -> Path:
        return self.root / "kubelet-pki"

    @property
    def static_pods(self) -> Path:
        return self.root / "manifests"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"

    # kube-proxy and CoreDNS
    @property
    def kube_proxy_config(self) -> Path:
        return self.root / "kube-proxy.yaml"

    @property
    def corefile(self) -> Path:
        return self.root / "Corefile"

    # GPU side
    @property
    def gpu(self) -> Path:
        """The fake GPU's configuration and the device plugin's files."""
        return self.root / "gpu"

    # Prometheus (`up --monitoring`)
    @property
    def prometheus(self) -> Path:
        """Its configuration and its time series database."""
        return self.root / "prometheus"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"
