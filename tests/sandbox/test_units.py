"""The sandbox's pure parts: image layout, containerd and kubelet configuration, preflight decisions."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import fakegpu
from sandbox import (
    addons,
    cluster,
    containerd,
    controlplane,
    fakenode,
    gpu,
    host,
    images,
    install,
    kubelet,
    nodelife,
    processes,
    record,
)
from sandbox.controlplane import DRA_K8S_VERSION, bin_dir_for
from sandbox.layout import CGROUP_ROOT, CLUSTER_DNS_IP, POD_NETWORK, POD_SUBNET, SERVICE_CIDR, Layout
from sandbox.processes import StartError
from tessera.contract import KEYS
from tests.sandbox import conftest as sandbox_conftest
from tests.sandbox.conftest import keep_logs

LAYOUT = Layout(Path("/srv/sbx"))


def _members(blob: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def _spec() -> images.ImageSpec:
    return images.ImageSpec(
        name="docker.io/local/x:1",
        entries=(images.Entry("bin/tool", data=b"\x7fELF"), images.Entry("bin/sh", target="tool")),
        entrypoint=("/bin/tool",),
    )


def test_layout_is_a_valid_oci_image_with_matching_digests() -> None:
    files = _members(images.build_layout(_spec()))
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, blob in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(blob).hexdigest() == name.rsplit("/", 1)[1]
    index = json.loads(files["index.json"])
    (descriptor,) = index["manifests"]
    assert descriptor["annotations"]["io.containerd.image.name"] == "docker.io/local/x:1"
    assert descriptor["annotations"]["org.opencontainers.image.ref.name"] == "docker.io/local/x:1"
    manifest = json.loads(files["blobs/sha256/" + descriptor["digest"].split(":")[1]])
    config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]])
    layer_digest = manifest["layers"][0]["digest"]
    assert config["rootfs"]["diff_ids"] == [layer_digest]
    assert config["config"]["Entrypoint"] == ["/bin/tool"]
    layer = files["blobs/sha256/" + layer_digest.split(":")[1]]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        names = tar.getnames()
        assert names == sorted(names) and names[0] == "bin"  # parents before children
        assert tar.getmember("bin/sh").linkname == "tool"
        assert tar.extractfile("bin/tool").read() == b"\x7fELF"  # type: ignore[union-attr]


def test_layout_is_reproducible() -> None:
    assert images.build_layout(_spec()) == images.build_layout(_spec())


@pytest.mark.parametrize("name", ["x:1", "local/x:1", "docker.io/local/x"])
def test_layout_refuses_a_name_that_is_not_fully_qualified(name: str) -> None:
    spec = images.ImageSpec(name=name, entries=(), entrypoint=("/x",))
    with pytest.raises(ValueError, match=f"image name: '{name}' must be fully qualified"):
        images.build_layout(spec)


def test_probe_image_holds_glibc_probe_and_the_driver_mount_target() -> None:
    spec = images.probe_spec(b"bb", b"probe", {"lib/x86_64-linux-gnu/libc.so.6": b"libc"}, b"escape")
    paths = {e.path: e for e in spec.entries}
    assert paths[images.PROBE_PATH].data == b"probe"
    assert paths[images.ESCAPE_PATH].data == b"escape"
    assert paths["lib/x86_64-linux-gnu/libc.so.6"].data == b"libc"
    assert paths[images.DRIVER_LIBRARY_DIR].data is None  # a directory
    assert spec.entrypoint == (images.PROBE_PATH,)


def test_containerd_config_carries_the_settings_this_host_needs() -> None:
    config = tomllib.loads(containerd.render_config(LAYOUT))
    assert config["version"] == 2
    assert config["root"] == "/srv/sbx/node/containerd/root"
    assert config["grpc"]["address"] == "/srv/sbx/node/containerd/containerd.sock"
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == images.PAUSE_IMAGE
    assert cri["restrict_oom_score_adj"] is True
    assert cri["disable_apparmor"] is True
    assert cri["netns_mounts_under_state_dir"] is True
    assert cri["containerd"]["default_runtime_name"] == "nvidia"
    runtime = cri["containerd"]["runtimes"]["nvidia"]
    assert runtime["base_runtime_spec"] == "/srv/sbx/node/containerd/nvidia-base-spec.json"
    assert runtime["options"]["SystemdCgroup"] is False
    assert cri["cni"]["conf_dir"] == "/srv/sbx/node/cni/net.d"
    assert config["plugins"]["io.containerd.internal.v1.opt"]["path"].startswith("/srv/sbx/")
    assert "enable_cdi" not in cri and "runtime_path" not in runtime  # the host's containerd 1.6


def test_a_built_containerd_runs_its_own_shim_and_reads_cdi_specs_from_the_sandbox() -> None:
    cri = tomllib.loads(containerd.render_config(LAYOUT, built=True))["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["enable_cdi"] is True
    assert cri["cdi_spec_dirs"] == ["/srv/sbx/node/cdi"]
    runtime = cri["containerd"]["runtimes"]["nvidia"]
    assert runtime["runtime_path"] == "/srv/sbx/node/containerd/bin/containerd-shim-runc-v2"


def test_the_dra_sandbox_runs_the_newest_kubernetes_with_its_containerd_and_the_chart_in_dra_mode() -> None:
    options = cluster.dra(cluster.Options(root=LAYOUT.root, values=("a=b",)))
    assert options.kubernetes_bin == options.containerd_bin == bin_dir_for(DRA_K8S_VERSION)
    assert (options.mode, options.values) == ("dra", ("a=b",))


def test_a_mixed_sandbox_runs_the_dra_paths_kubernetes_with_its_last_node_dras() -> None:
    plain = cluster.Options(root=LAYOUT.root, values=("a=b",), nodes=3)
    assert cluster.in_mode(plain, "deviceplugin") == plain
    assert cluster.in_mode(plain, "dra") == cluster.dra(plain)
    options = cluster.in_mode(plain, "mixed")
    assert options == dataclasses.replace(cluster.dra(plain), mode="mixed")
    further = [n.name for n in nodelife.plan("n", 3)]
    assert [record.node_mode(options.mode, n, further) for n in ("n", "n-2", "n-3")] == [
        "deviceplugin",
        "deviceplugin",
        "dra",
    ]
    assert record.node_mode(cluster.dra(plain).mode, "n", further) == "dra"
    assert record.node_mode("mixed", "n", []) == "deviceplugin"  # one node: nothing is last
    # The scheduler and extender stay on, the scheduler's image the one built, for the pinned version.
    assert cluster.CHART_VALUES["mixed"] == ("mode=mixed", f"scheduler.image.tag={controlplane.K8S_VERSION}")


def test_a_mixed_sandbox_needs_a_node_of_each_kind(tmp_path: Path) -> None:
    options = cluster.in_mode(cluster.Options(root=tmp_path), "mixed")
    with pytest.raises(StartError, match="mode mixed needs a node of each kind"):
        cluster.up(options, report=lambda _: None)
    assert not (tmp_path / "sandbox.json").exists()


def test_base_spec_adds_bind_mounts_and_environment() -> None:
    default = {"mounts": [{"destination": "/proc"}], "process": {"env": ["PATH=/bin"]}}
    mounts = [
        containerd.BindMount("/lib/libcuda.so.1", Path("/d/libcuda.so.1")),
        containerd.BindMount("/s", Path("/h"), read_only=False),
    ]
    spec = containerd.base_spec(default, mounts, {"FAKEGPU_CONFIG": "/c"})
    assert spec["mounts"] == [
        {"destination": "/proc"},
        {
            "destination": "/lib/libcuda.so.1",
            "type": "bind",
            "source": "/d/libcuda.so.1",
            "options": ["rbind", "ro", "nosuid", "nodev"],
        },
        {"destination": "/s", "type": "bind", "source": "/h", "options": ["rbind", "rw", "nosuid", "nodev"]},
    ]
    assert spec["process"]["env"] == ["PATH=/bin", "FAKEGPU_CONFIG=/c"]
    assert default["mounts"] == [{"destination": "/proc"}]  # the input is not changed


def test_cni_config_keeps_ipam_state_in_the_sandbox() -> None:
    (bridge,) = containerd.cni_config(LAYOUT)["plugins"]
    assert bridge["ipMasq"] is False
    assert bridge["ipam"]["dataDir"] == "/srv/sbx/node/cni/ipam"


def test_kubelet_config_for_cgroup_v1_without_cap_sys_resource() -> None:
    config = kubelet.render_config(LAYOUT, port=10250, healthz_port=10248)
    assert config["failCgroupV1"] is False
    assert config["cgroupDriver"] == "cgroupfs"
    assert config["oomScoreAdj"] == 0
    assert config["cgroupRoot"] == f"/{CGROUP_ROOT}"
    assert config["containerRuntimeEndpoint"] == "unix:///srv/sbx/node/containerd/containerd.sock"
    assert config["address"] == "10.244.77.1" and config["healthzBindAddress"] == "127.0.0.1"
    assert config["readOnlyPort"] == 0
    assert config["makeIPTablesUtilChains"] is False
    assert config["authorization"] == {"mode": "AlwaysAllow"}


def _facts(**changes: object) -> host.HostFacts:
    good = host.HostFacts(
        uid=0,
        cgroup_controllers=frozenset(host.REQUIRED_CONTROLLERS),
        missing_programs=(),
        missing_kubernetes=(),
        kubernetes_bin="/k8s/bin",
        taken_ports=(),
        running_runtimes=(),
        socket_path="/srv/sbx/node/containerd/containerd.sock",
        already_up=False,
        node_name="vm",
        node_name_is_loopback=True,
    )
    return host.HostFacts(**{**{f: getattr(good, f) for f in good.__slots__}, **changes})  # type: ignore[arg-type]


def test_preflight_passes_on_a_good_host() -> None:
    assert host.problems(_facts()) == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"uid": 1000}, "tessera sandbox must run as root (uid 0, not 1000)"),
        ({"cgroup_controllers": frozenset({"cpu"})}, "cgroups: no cpuset, memory, pids, devices, freezer"),
        (
            {"missing_programs": ("containerd",)},
            "missing programs: containerd; run hack/install-sandbox-deps.sh",
        ),
        (
            {"missing_kubernetes": ("kubelet",)},
            "missing Kubernetes binaries in /k8s/bin: kubelet; run hack/k8s",
        ),
        ({"taken_ports": (10250,)}, "port 10250 on 127.0.0.1 is taken"),
        ({"running_runtimes": ("containerd (pid 7)",)}, "containerd (pid 7) is already running"),
        ({"socket_path": "/" + "d" * 120}, "sandbox directory too deep"),
        ({"node_name_is_loopback": False}, "node name 'vm' does not resolve to 127.0.0.1"),
        ({"already_up": True}, "a sandbox is already up in this directory"),
        (
            {"kube_chains": ("iptables nat KUBE-SERVICES",)},
            "iptables chains of another Kubernetes node exist (iptables nat KUBE-SERVICES)",
        ),
    ],
)
def test_preflight_names_each_problem(changes: dict[str, object], message: str) -> None:
    (problem,) = host.problems(_facts(**changes))
    assert problem.startswith(message)


def test_only_changed_sysctls_are_restored() -> None:
    before = {"vm/overcommit_memory": "0", "kernel/panic": "1", "net/ipv4/ip_forward": "0"}
    now = {"vm/overcommit_memory": "1", "kernel/panic": "1", "net/ipv4/ip_forward": "1"}
    assert host.sysctls_to_restore(before, now) == {"vm/overcommit_memory": "0", "net/ipv4/ip_forward": "0"}


def test_only_host_directories_the_sandbox_created_are_removed() -> None:
    existed = {"/run/containerd": False, "/var/lib/kubelet": True}
    assert host.host_paths_to_remove(existed) == [Path("/run/containerd")]


def test_gpu_files_place_the_driver_where_the_container_toolkit_does() -> None:
    files = gpu.files_for(LAYOUT)
    mounts = {m.destination: m for m in files.container_mounts()}
    assert mounts["/usr/lib/x86_64-linux-gnu/libcuda.so.1"].source == Path(
        "/srv/sbx/node/gpu/driver/libcuda.so.1"
    )
    assert mounts["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"].read_only
    assert not mounts[gpu.CONTAINER_GPU_STATE].read_only  # shared by every process on the fake GPU
    assert files.container_env() == {
        "FAKEGPU_CONFIG": gpu.CONTAINER_GPU_CONFIG,
        "FAKEGPU_STATE": gpu.CONTAINER_GPU_STATE,
    }


def test_fake_gpu_description_lists_both_gpus() -> None:
    lines = fakegpu.render_config(gpu.SANDBOX_GPUS).splitlines()[1:]
    assert lines == [
        'gpu name="NVIDIA A100-SXM4-40GB" uuid=GPU-6a1e0b7c-0000-4000-8000-00000000a100 memory=40960MiB '
        "sms=108 cc=8.0 pci=0000:3b:00.0 numa=0",
        'gpu name="Tesla T4" uuid=GPU-7b2f1c8d-0000-4000-8000-000000000074 memory=15360MiB '
        "sms=40 cc=7.5 pci=0000:af:00.0 numa=0",
    ]


def test_tessera_is_installed_by_helm_with_the_sandbox_values_and_its_host_dirs() -> None:
    args = install.install_args(LAYOUT)
    assert args[:6] == [
        "install",
        "tessera",
        str(install.CHART),
        "--namespace",
        "tessera-system",
        "--create-namespace",
    ]
    assert args[6:8] == ["--values", str(install.SANDBOX_VALUES)]
    assert [a for a in args[8:] if a != "--set-string"] == [
        "devicePlugin.stateDir=/srv/sbx/node/tessera/state",
        "devicePlugin.hookDir=/srv/sbx/node/tessera/hook",
        "devicePlugin.podResourcesDir=/srv/sbx/node/kubelet/pod-resources",
        "dra.kubeletDir=/srv/sbx/node/kubelet",
        "dra.cdiDir=/srv/sbx/node/cdi",
    ]


def test_sandbox_values_hold_only_what_differs_from_a_gpu_cluster() -> None:
    """No registry here: images are imported and never pulled. And the sandbox's scraper reads the
    metrics, as a cluster binds its Prometheus. Everything else is the chart's."""
    values = yaml.safe_load(install.SANDBOX_VALUES.read_text())
    assert values == {
        "image": {"pullPolicy": "Never"},
        "scheduler": {"image": {"pullPolicy": "Never"}},
        "metricsAccess": {
            "readers": [{"kind": "ServiceAccount", "name": install.SCRAPER, "namespace": install.NAMESPACE}]
        },
    }


def test_the_cluster_scheduler_serves_the_default_profile_only() -> None:
    """Tessera's profile is served by the chart's tessera-scheduler pods, as on a real cluster."""
    config = yaml.safe_load(cluster.DEFAULT_SCHEDULER_CONFIG)
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert "profiles" not in config and "extenders" not in config


def test_fake_node_inventory_is_stable_and_refuses_unknown_models() -> None:
    first = fakenode.inventory("edge-1", ["a100", "t4"])
    assert first == fakenode.inventory("edge-1", ["a100", "t4"])
    assert [g.model for g in first] == ["NVIDIA A100-SXM4-40GB", "Tesla T4"]
    assert first[0].uuid != fakenode.inventory("edge-2", ["a100"])[0].uuid
    assert fakenode.capacity(first)[KEYS.vgpu] == "20"
    with pytest.raises(ValueError, match="--gpu: 'b200' is not one of"):
        fakenode.inventory("edge-1", ["b200"])


ROOT = "/srv/sbx"


@pytest.mark.parametrize(
    ("args", "component"),
    [
        (["/k8s/bin/kubelet", f"--config={ROOT}/kubelet-config.yaml"], True),
        (
            [
                "/usr/bin/containerd-shim-runc-v2",
                "-namespace",
                "k8s.io",
                "-address",
                f"{ROOT}/containerd/c.sock",
            ],
            True,
        ),
        (["/venv/bin/python3", "-m", "extender.main", f"--kubeconfig={ROOT}/cluster/admin.kubeconfig"], True),
        # The command that runs `down`, its sudo, a pager on a log: not the sandbox's to kill.
        (["sudo", "tessera", "sandbox", "down", "--dir", ROOT], False),
        (["/venv/bin/python3", "/venv/bin/tessera", "sandbox", "down", "--dir", ROOT], False),
        (["less", f"{ROOT}/logs/kubelet.log"], False),
        # Another sandbox's kubelet.
        (["/k8s/bin/kubelet", "--config=/srv/sbx2/kubelet-config.yaml"], False),
        ([], False),
    ],
)
def test_only_the_sandboxs_own_components_count_as_its_processes(args: list[str], component: bool) -> None:
    assert host.is_component(args, ROOT) is component


SAVED_NAT = [
    "*nat",
    ":PREROUTING ACCEPT [0:0]",
    ":POSTROUTING ACCEPT [0:0]",
    ":KUBE-SERVICES - [0:0]",
    ":KUBE-POSTROUTING - [0:0]",
    ":OTHER - [0:0]",
    '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
    "-A POSTROUTING -j KUBE-POSTROUTING",
    "-A POSTROUTING -s 10.1.0.0/16 -j MASQUERADE",
    "-A KUBE-POSTROUTING -j RETURN",
    "COMMIT",
]


def test_kube_chains_and_the_rules_jumping_into_them_are_found_in_iptables_save_output() -> None:
    assert host.kube_chain_names(SAVED_NAT) == ["KUBE-SERVICES", "KUBE-POSTROUTING"]
    # Only rules in other chains (those must go before the chains can), quoted words kept whole.
    assert host.kube_jump_rules(SAVED_NAT) == [
        ["PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"],
        ["POSTROUTING", "-j", "KUBE-POSTROUTING"],
    ]


def test_kube_proxy_runs_iptables_mode_over_every_nodes_pods_and_leaves_host_sysctls_alone() -> None:
    config = addons.kube_proxy_config(Path("/srv/sbx/cluster/admin.kubeconfig"), "vm", 1, 2)
    assert config["mode"] == "iptables"
    assert config["clusterCIDR"] == POD_NETWORK
    assert ipaddress.ip_network(POD_SUBNET).subnet_of(ipaddress.ip_network(POD_NETWORK))
    assert config["hostnameOverride"] == "vm"
    assert config["healthzBindAddress"] == "127.0.0.1:1" and config["metricsBindAddress"] == "127.0.0.1:2"
    assert config["conntrack"]["maxPerCore"] == 0 and config["conntrack"]["min"] == 0
    assert config["iptables"]["localhostNodePorts"] is False


def test_cluster_dns_is_a_service_in_front_of_coredns_on_the_bridge() -> None:
    service, endpoints = addons.dns_service_objects()
    assert service["spec"]["clusterIP"] == CLUSTER_DNS_IP and "selector" not in service["spec"]
    assert endpoints["metadata"]["labels"]["kubernetes.io/service-name"] == "kube-dns"
    assert endpoints["endpoints"][0]["addresses"] == ["10.244.77.1"]
    corefile = addons.render_corefile(Path("/k.conf"), 3, 4)
    assert "bind 10.244.77.1" in corefile and "kubernetes cluster.local" in corefile
    assert "kubeconfig /k.conf" in corefile and "ready 127.0.0.1:4" in corefile
    config = kubelet.render_config(LAYOUT, port=10250, healthz_port=10248)
    assert config["clusterDNS"] == [CLUSTER_DNS_IP] and config["clusterDomain"] == "cluster.local"


def test_pods_route_the_service_range_and_every_nodes_pods_through_the_bridge() -> None:
    ipam = containerd.cni_config(LAYOUT)["plugins"][0]["ipam"]
    assert ipam["routes"] == [{"dst": SERVICE_CIDR}, {"dst": POD_NETWORK}]


def test_registered_plugins_are_the_kubelets_actual_state_not_its_desired_one() -> None:
    text = (
        "# TYPE plugin_manager_total_plugins gauge\n"
        'plugin_manager_total_plugins{socket_path="/k/plugins_registry/a-reg.sock",state="actual_state_of_world"} 1\n'
        'plugin_manager_total_plugins{socket_path="/k/plugins_registry/b-reg.sock",state="desired_state_of_world"} 1\n'
    )
    assert kubelet.REGISTERED_PLUGIN.findall(text) == ["/k/plugins_registry/a-reg.sock"]


def test_free_ports_are_below_the_ephemeral_range_and_free() -> None:
    """A restarted server must find its port again: outgoing connections never take one of these."""
    low, _ = controlplane._ephemeral_range()
    ports = {controlplane.free_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports), ports
    assert len(ports) > 1  # random, so concurrent sandboxes and tests rarely race for one
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two servers given ports before either binds must not get the same one, even where the
    candidates are few: here a range of 1,000 ports, half of them taken by this test's calls."""
    monkeypatch.setattr(controlplane, "_ephemeral_range", lambda: (11000, 60999))
    monkeypatch.setattr(controlplane, "_handed_out", set())
    ports = [controlplane.free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= p < 11000 for p in ports), ports


LEADER_EXITS_FIRST = r"""
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

static int port;
static const char *release;

/* Listens on the port until the release file exists, then ends the process. */
static void *serve(void *unused) {
    (void)unused;
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(s, (struct sockaddr *)&a, sizeof a) != 0 || listen(s, 1) != 0) exit(3);
    while (access(release, F_OK) != 0) usleep(20000);
    exit(0);
}

int main(int argc, char **argv) {
    pthread_t t;
    if (argc != 3) return 2;
    port = atoi(argv[1]);
    release = argv[2];
    pthread_create(&t, NULL, serve, NULL);
    pthread_exit(NULL); /* the main thread becomes a zombie; the process lives on in its thread */
}
"""


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Go's listeners do
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_process_whose_main_thread_exited_first_is_alive_until_its_last_thread_has(tmp_path: Path) -> None:
    """A SIGKILLed multi-threaded server shows its main thread as a zombie while its other threads
    still exit and hold its listening socket: it counts as gone (and its restart may bind the port)
    only once every thread has exited."""
    source = tmp_path / "leader.c"
    source.write_text(LEADER_EXITS_FIRST)
    program = tmp_path / "leader"
    subprocess.run(["gcc", "-O1", "-pthread", "-o", str(program), str(source)], check=True)
    port = controlplane.free_port()
    release = tmp_path / "release"
    process = processes.start("leader", [str(program), str(port), str(release)], tmp_path / "leader.log")
    try:
        deadline = time.monotonic() + 30
        while (
            _port_free(port) or "Z" not in Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1][:3]
        ):
            assert time.monotonic() < deadline, (
                "the program never reached a zombie main thread and a bound port"
            )
            time.sleep(0.05)
        assert processes.alive(process)  # its main thread is a zombie, its port is still held
        release.touch()
        deadline = time.monotonic() + 30
        while processes.alive(process):
            assert time.monotonic() < deadline, "alive after its last thread ended"
            time.sleep(0.05)
        assert _port_free(port)
    finally:
        release.touch()
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(process.pid, 0)


def test_a_further_nodes_processes_are_read_by_its_namespace_only_while_its_holder_pins_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a mount namespace's last process is gone its number is free, and the next container any
    node starts may take it: a listing by that number would then kill another node's process."""
    holder = processes.start("n-2/holder", ["sleep", "60"], tmp_path / "holder.log")
    kubelet = processes.start("n-2/kubelet", ["sleep", "60"], tmp_path / "kubelet.log")
    try:
        state = record.SandboxState(
            node="n", kubeconfig="", api_url="", kubernetes_bin="", kubelet_port=1, kubelet_healthz_port=2,
            processes=[holder, kubelet], nodes=[record.FurtherNode(name="n-2", index=2, gpus=("t4",))],
        )  # fmt: skip
        in_namespace = {holder.pid, kubelet.pid, 4242}
        monkeypatch.setattr(nodelife.nodes, "mount_namespace", lambda pid: "mnt:[4026532249]")
        monkeypatch.setattr(nodelife.nodes, "processes_in", lambda namespace: sorted(in_namespace))
        monkeypatch.setattr(nodelife.nodes, "cgroup_pids", lambda root: set())
        listed = nodelife.node_processes(LAYOUT, state, "n-2")
        assert listed() == {kubelet.pid, 4242}  # the holder outlives the rest of its node
        in_namespace -= {4242, kubelet.pid}
        processes.stop(kubelet)
        assert listed() == {holder.pid}
        processes.stop(holder)
        in_namespace.add(5151)  # another node's new container, in a namespace of the same number
        assert listed() == set()
    finally:
        processes.stop(kubelet)
        processes.stop(holder)


def test_a_failed_sandboxs_logs_are_kept_from_every_node(tmp_path: Path) -> None:
    """keep_logs (tests/sandbox/conftest.py): the process logs, and each node's pod logs and Tessera
    state, the first node's and the further ones' where the host keeps them; a socket in the state
    directory (the device plugin's) is left, and everything else still copied."""
    # A short root, as a sandbox's own: the socket's path must fit sockaddr_un (pytest's tmp_path,
    # deep under an xdist worker's directory, may not).
    short = Path(tempfile.mkdtemp(prefix="tkl-", dir="/tmp"))
    try:
        _keeps_every_nodes_logs(Layout(short / "sbx"), tmp_path / "kept")
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _keeps_every_nodes_logs(layout: Layout, kept: Path) -> None:
    further = layout.of_node("vm-2")
    files = {
        layout.logs / "kubelet.log": "kubelet",
        layout.pod_logs / "default_p_uid" / "main" / "0.log": "pod",
        install.host_dirs(layout).state / "containers" / "uid" / "main" / "allocation.json": "{}",
        further.place(further.pod_logs) / "default_q_uid" / "main" / "0.log": "further pod",
        further.place(install.host_dirs(further).state) / "agent.lock": "vm-2",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(install.host_dirs(layout).state / "tessera.sock"))
    try:
        keep_logs(layout.root, kept)
    finally:
        listening.close()
    assert {str(p.relative_to(kept)): p.read_text() for p in kept.rglob("*") if p.is_file()} == {
        "logs/kubelet.log": "kubelet",
        "node/pod-logs/default_p_uid/main/0.log": "pod",
        "node/state/containers/uid/main/allocation.json": "{}",
        "vm-2/pod-logs/default_q_uid/main/0.log": "further pod",
        "vm-2/state/agent.lock": "vm-2",
    }


def test_a_failed_tests_sandboxes_keep_their_logs_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep_logs_of_failed (tests/conftest.py calls it when a test fails): every sandbox among the
    test's fixture values, alone or in a (Sandbox, HostView) pair, keeps its logs; one already gone
    (a test took it down) and other values are passed over."""
    kept = tmp_path / "kept"
    monkeypatch.setattr(sandbox_conftest, "KEPT_LOGS", kept)
    roots = [tmp_path / "shared", tmp_path / "fleet", tmp_path / "gone"]
    for root in roots[:2]:
        Layout(root).logs.mkdir(parents=True)
        (Layout(root).logs / "kubelet.log").write_text(root.name)
    (Layout(roots[0]).logs / "containerd.log").write_text('level=error msg="shim gone"\n')
    sandboxes = [sandbox_conftest.Sandbox(root, None, None) for root in roots]  # type: ignore[arg-type]
    item = SimpleNamespace(
        funcargs={"a": sandboxes[0], "b": (sandboxes[1], None), "c": sandboxes[2], "d": 1, "e": sandboxes[0]}
    )
    # The shared sandbox, two of the test's fixtures, is named once.
    assert sandbox_conftest.keep_logs_of_failed(item).splitlines() == [  # type: ignore[arg-type]
        "shared/containerd.log:",
        '  level=error msg="shim gone"',
    ]
    assert {str(p.relative_to(kept)): p.read_text() for p in kept.rglob("*") if p.is_file()} == {
        "shared/logs/kubelet.log": "shared",
        "shared/logs/containerd.log": 'level=error msg="shim gone"\n',
        "fleet/logs/kubelet.log": "fleet",
    }


def test_a_failed_tests_report_names_each_nodes_last_kubelet_and_containerd_errors(tmp_path: Path) -> None:
    """last_errors: the last lines at error level (klog's E, containerd's level=error) of every node's
    kubelet and containerd log, the sandbox named; other logs and levels, and the routine NotFound of
    a removed container's status, are left out."""
    logs = Layout(tmp_path / "tessera-fleet-1").logs
    logs.mkdir(parents=True)
    (logs / "kubelet.log").write_text(
        "".join(f"E1207 04:22:{i:02d}.000000 1 kubelet.go:1] error {i}\n" for i in range(8))
        + "I1207 04:23:00.000000 1 kubelet.go:1] fine\n"
        + 'E1207 04:23:01.000000 1 log.go:32] "ContainerStatus failed" err="rpc error: code = NotFound"\n'
    )
    (logs / "vm-2-containerd.log").write_text(
        'time="t" level=info msg="fine"\ntime="t" level=error msg="shim gone"\n'
    )
    (logs / "kube-apiserver.log").write_text("E1207 04:22:00.000000 1 x.go:1] not a node's\n")
    assert sandbox_conftest.last_errors(logs, per_log=2).splitlines() == [
        "tessera-fleet-1/kubelet.log:",
        "  E1207 04:22:06.000000 1 kubelet.go:1] error 6",
        "  E1207 04:22:07.000000 1 kubelet.go:1] error 7",
        "tessera-fleet-1/vm-2-containerd.log:",
        '  time="t" level=error msg="shim gone"',
    ]
