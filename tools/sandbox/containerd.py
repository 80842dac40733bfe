"""containerd for the sandbox, with its own config, root, state and socket: Debian's containerd 1.6
(the device plugin path), or the containerd 2 that hack/k8s-binaries.sh builds, for the DRA path: the
kubelet hands a claim's CDI device names to the runtime (CRI ``CDIDevices``), which 1.6 drops and 2.x
applies from ``cdi_spec_dirs``. Both read the same version 2 configuration (2.x migrates it).

The settings are the ones measured to work on these machines (docs/sandbox.md says why each one):
cgroupfs (runc ``SystemdCgroup = false``), no AppArmor, ``restrict_oom_score_adj`` (root here lacks
CAP_SYS_RESOURCE, so the -998 a pod sandbox asks for would fail), network namespaces mounted under
the state directory, and the project's own pause image as the sandbox image.

How the GPU driver gets into containers: on a real node the NVIDIA container toolkit is configured as
containerd's default runtime (``nvidia``); for containers that get GPUs it edits the OCI spec to bind
``libcuda.so.1``, ``libnvidia-ml.so.1`` and the ``/dev/nvidia*`` nodes from the host driver install.
The sandbox configures the same default runtime name, backed by runc with a *base runtime spec*
(containerd's own default spec plus read-only binds of the project's fake driver libraries at the
paths the toolkit uses). The kubelet, the device plugin and the pods see the same layout either way.
"""

from __future__ import annotations

import copy
import json
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.images import PAUSE_IMAGE
from sandbox.layout import BRIDGE, NETWORK_NAME, POD_NETWORK, POD_SUBNET, SERVICE_CIDR, Layout
from sandbox.processes import Started, start, wait_for

CNI_BIN_DIR = Path("/usr/lib/cni")
K8S_NAMESPACE = "k8s.io"
RUNTIME_NAME = "nvidia"
SHIM = "containerd-shim-runc-v2"
# Snapshotters that cannot work here; disabled so the log shows only what matters.
DISABLED_PLUGINS = tuple(
    f"io.containerd.snapshotter.v1.{name}" for name in ("aufs", "btrfs", "devmapper", "zfs")
)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def _toml(tables: Mapping[str, Mapping[str, object]], top: Mapping[str, object]) -> str:
    lines = [f"{key} = {_toml_value(value)}" for key, value in top.items()]
    for table, values in tables.items():
        lines += ["", f"[{table}]", *(f"  {key} = {_toml_value(value)}" for key, value in values.items())]
    return "\n".join(lines) + "\n"


def render_config(layout: Layout, *, built: bool = False) -> str:
    """containerd's config.toml (version 2 schema) for the sandbox. ``built``: for the containerd in
    ``layout.containerd_bin``, which runs its own runc shim (the host's 1.6 one is first on PATH)
    and reads CDI specs from the sandbox's CDI directory."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    runtime = f"{cri}.containerd.runtimes.{RUNTIME_NAME}"
    cdi: dict[str, object] = {"enable_cdi": True, "cdi_spec_dirs": [str(layout.cdi_dir)]} if built else {}
    shim = {"runtime_path": str(layout.containerd_bin / SHIM)} if built else {}
    return _toml(
        {
            "grpc": {"address": str(layout.containerd_socket)},
            # Default /opt/containerd would be created on the host otherwise.
            'plugins."io.containerd.internal.v1.opt"': {"path": str(layout.containerd_root / "opt")},
            cri: {
                "sandbox_image": PAUSE_IMAGE,
                "disable_apparmor": True,
                "restrict_oom_score_adj": True,
                "netns_mounts_under_state_dir": True,
                "stream_server_address": "127.0.0.1",
                "stream_server_port": "0",
                **cdi,
            },
            f"{cri}.containerd": {"snapshotter": "overlayfs", "default_runtime_name": RUNTIME_NAME},
            runtime: {
                "runtime_type": "io.containerd.runc.v2",
                "base_runtime_spec": str(layout.driver_spec),
                **shim,
            },
            f"{runtime}.options": {"SystemdCgroup": False},
            f"{cri}.cni": {
                "bin_dir": str(CNI_BIN_DIR),
                "conf_dir": str(layout.cni_conf_dir),
                "max_conf_num": 1,
            },
        },
        {
            "version": 2,
            "root": str(layout.containerd_root),
            "state": str(layout.containerd_state),
            "disabled_plugins": DISABLED_PLUGINS,
        },
    )


@dataclass(frozen=True, slots=True)
class BindMount:
    destination: str
    source: Path
    read_only: bool = True


def base_spec(
    default_spec: Mapping[str, Any], mounts: Sequence[BindMount], env: Mapping[str, str]
) -> dict[str, Any]:
    """containerd's default OCI spec plus bind mounts and environment for every container."""
    spec: dict[str, Any] = copy.deepcopy(dict(default_spec))
    spec["mounts"] = [
        *spec.get("mounts", []),
        *(
            {
                "destination": m.destination,
                "type": "bind",
                "source": str(m.source),
                "options": ["rbind", "ro" if m.read_only else "rw", "nosuid", "nodev"],
            }
            for m in mounts
        ),
    ]
    process = spec.setdefault("process", {})
    process["env"] = [*process.get("env", []), *(f"{k}={v}" for k, v in sorted(env.items()))]
    return spec


def cni_config(layout: Layout, subnet: str = POD_SUBNET) -> dict[str, Any]:
    """A bridge network for the node's pods (``subnet``). No masquerading: pods only talk to the
    host, to each other (other nodes' pods through their gateway, the host routing between nodes)
    and to ClusterIP Services (routed through the bridge's address, where kube-proxy's rules
    apply)."""
    return {
        "cniVersion": "1.0.0",
        "name": NETWORK_NAME,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": subnet}]],
                    "routes": [{"dst": SERVICE_CIDR}, {"dst": POD_NETWORK}],
                    "dataDir": str(layout.cni_ipam_dir),
                },
            }
        ],
    }


# --------------------------------------------------------------------------------------------------
# Adapters: files, the containerd process, ctr.


def program(layout: Layout, name: str) -> str:
    """The sandbox's containerd, shim or ctr: from ``layout.containerd_bin`` when the sandbox runs
    a built containerd, else the host's on PATH."""
    built = layout.containerd_bin / name
    return str(built) if layout.place(built).exists() else shutil.which(name) or name


def ctr(layout: Layout, *args: str, timeout: float = 60.0) -> str:
    result = subprocess.run(
        [
            program(layout, "ctr"),
            "--address",
            str(layout.place(layout.containerd_socket)),
            "--namespace",
            K8S_NAMESPACE,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"ctr {' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def default_oci_spec(layout: Layout) -> dict[str, Any]:
    """containerd's own default spec, the one CRI uses when no base spec is configured."""
    argv = [str(layout.place(Path(program(layout, "ctr")))), "oci", "spec"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    spec: dict[str, Any] = json.loads(out)
    return spec


def write_files(
    layout: Layout,
    mounts: Sequence[BindMount],
    env: Mapping[str, str],
    binaries: Path | None = None,
    subnet: str = POD_SUBNET,
) -> None:
    """The configuration, base spec and CNI network (pods in ``subnet``); ``binaries``: the
    directory of a built containerd to run instead of the host's (linked as
    ``layout.containerd_bin``)."""
    place = layout.place
    for directory in (
        layout.containerd_root,
        layout.containerd_state,
        layout.cni_conf_dir,
        layout.cni_ipam_dir,
    ):
        place(directory).mkdir(parents=True, exist_ok=True)
    if binaries is not None:
        place(layout.cdi_dir).mkdir(parents=True, exist_ok=True)
        place(layout.containerd_bin).unlink(missing_ok=True)
        place(layout.containerd_bin).symlink_to(binaries.resolve(), target_is_directory=True)
    place(layout.containerd_config).write_text(render_config(layout, built=binaries is not None))
    spec = base_spec(default_oci_spec(layout), mounts, env)
    place(layout.driver_spec).write_text(json.dumps(spec, indent=2))
    conflist = place(layout.cni_conf_dir) / "10-tessera.conflist"
    conflist.write_text(json.dumps(cni_config(layout, subnet), indent=2))


def socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def start_containerd(
    layout: Layout, timeout: float = 60.0, *, name: str = "containerd", enter: Sequence[str] = ()
) -> Started:
    """containerd, recorded as ``name``; ``enter``: the argv prefix that runs it in a further node's
    namespaces (sandbox.nodes.enter)."""
    argv = [*enter, program(layout, "containerd"), "--config", str(layout.containerd_config)]
    process = start(name, argv, layout.log(name.replace("/", "-")))
    socket = layout.place(layout.containerd_socket)
    wait_for("the containerd socket", lambda: socket_answers(socket), process, timeout)
    return process


def import_images(layout: Layout, tarballs: Mapping[str, Path]) -> None:
    for tarball in tarballs.values():
        ctr(layout, "images", "import", str(tarball))


def images(layout: Layout) -> list[str]:
    return [line for line in ctr(layout, "images", "ls", "-q").splitlines() if line.strip()]
